//! Whether the store's directories can be trusted.
//!
//! Whoever can write a storage directory can remove blocks, fill the disk,
//! and plant block files (a forged block with a valid checksum serves wrong
//! KV). The store defends itself against what that user puts at its file
//! names (see [`super::files`]), but not against forged content. So a
//! directory that other users can write to gets one loud warning at open
//! naming the risk, and `posix_strict` refuses it (and block files owned by
//! other users) instead.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use super::files::{euid, WORK_DIR};
use crate::error::{Result, UcmError};

/// Why `dir` can be written by users other than this process's, if it can.
fn exposure(dir: &Path) -> Option<String> {
    let meta = std::fs::symlink_metadata(dir).ok()?;
    if meta.file_type().is_symlink() {
        return Some("a symbolic link (its target can be changed)".into());
    }
    if !meta.is_dir() {
        return None; // reported elsewhere
    }
    let mode = meta.mode();
    let sticky = mode & 0o1000 != 0;
    if meta.uid() != euid() && meta.uid() != 0 {
        return Some(format!(
            "owned by uid {}, not this process's uid {}",
            meta.uid(),
            euid()
        ));
    }
    if mode & 0o002 != 0 {
        return Some(if sticky {
            format!("writable by every user (mode {:o}, sticky)", mode & 0o7777)
        } else {
            format!("writable by every user (mode {:o})", mode & 0o7777)
        });
    }
    if mode & 0o020 != 0 && !sticky {
        return Some(format!("writable by its group (mode {:o})", mode & 0o7777));
    }
    None
}

/// Checks every root (followed: a root may be a symlink the user chose)
/// and, below it, the block and work directories (not followed). Warns
/// once per exposed directory, or fails when `strict`.
pub fn check_dirs(roots: &[std::path::PathBuf], strict: bool) -> Result<()> {
    for root in roots {
        let mut exposed = Vec::new();
        if let Ok(real) = std::fs::canonicalize(root) {
            if let Some(why) = exposure(&real) {
                exposed.push((real, why));
            }
        }
        for sub in (0..=255u8)
            .map(|b| root.join(format!("{b:02x}")))
            .chain([root.join(WORK_DIR)])
        {
            if let Some(why) = exposure(&sub) {
                exposed.push((sub, why));
            }
        }
        for (dir, why) in exposed {
            let msg = format!(
                "storage directory {} is {why}: other users can remove, replace or forge \
                 blocks in it, and a forged block serves wrong KV; use a directory only \
                 this user can write (chmod 700)",
                dir.display()
            );
            if strict {
                return Err(UcmError::invalid(format!(
                    "posix_strict: refusing it: {msg}"
                )));
            }
            log::warn!("{msg}, or set posix_strict: true to refuse such directories");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn exposed_directories_are_named() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("kv");
        std::fs::create_dir(&root).unwrap();
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o700)).unwrap();
        assert!(check_dirs(std::slice::from_ref(&root), true).is_ok());
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = check_dirs(std::slice::from_ref(&root), true).unwrap_err();
        assert!(e.to_string().contains("writable by every user"), "{e}");
        assert!(check_dirs(std::slice::from_ref(&root), false).is_ok());
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o700)).unwrap();
        std::os::unix::fs::symlink(d.path(), root.join("ab")).unwrap();
        let e = check_dirs(std::slice::from_ref(&root), true).unwrap_err();
        assert!(e.to_string().contains("symbolic link"), "{e}");
    }
}
