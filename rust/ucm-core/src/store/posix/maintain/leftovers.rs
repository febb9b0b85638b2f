//! What stopped Posix stores left behind, found and removed by the names
//! those stores give their files, and only there:
//! * the work directory `.work/<token>` of a store that is gone (its `lock`
//!   can be taken; on NFS, where a lock may be local to another host, the
//!   store also marked it closed or stopped its heartbeat): its `lock`, its
//!   `closed` marker, its spare files `spare.<n>` and its temporaries
//!   `<32 hex>.<n>`;
//! * the directory `.work/.<token>.new` of a store that died while making
//!   its work directory, an hour on;
//! * temporaries `<32 hex>.tmp.<writer>...` in the block directories
//!   (older versions and the NFS stage through a mount write them there),
//!   idle for an hour: a live writer gives a block up long before.
//!
//! A file of any other name is left where it is (and its directory with
//! it); a live store's work directory is never touched: a removal holds the
//! dead store's lock, so a store that starts meanwhile leaves it alone too.

use std::fs::File;
use std::time::Duration;

use rustix::fs::{FileType, OFlags};

use super::{block_in, bucket_name, label};
use crate::error::{Result, UcmError};
use crate::store::maintain::{ItemKind, Kept, Leftover, Place, Removal};
use crate::store::posix::files::{try_lock, Dir, LOCK_FILE, WORK_DIR};
use crate::store::posix::tree::Tree;
use crate::store::posix::work::{older_than, CLOSED_FILE, NFS_STALE_AFTER, SPARE_PREFIX};
use crate::store::safe_fs::{describe_kind, DirEntry};

/// Temporaries and half-made work directories this old are abandoned.
const IDLE: Duration = Duration::from_secs(3600);

/// A store instance's token (lowercase hex).
fn is_token(name: &str) -> bool {
    (8..=32).contains(&name.len()) && name.bytes().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f'))
}

/// The token of a work directory being made (`.<token>.new`).
fn is_being_made(name: &str) -> bool {
    name.strip_prefix('.')
        .and_then(|n| n.strip_suffix(".new"))
        .is_some_and(is_token)
}

fn digits(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|c| c.is_ascii_digit())
}

/// A name a store gives a file in its work directory.
fn written_by_store(name: &str) -> bool {
    if name == LOCK_FILE || name == CLOSED_FILE {
        return true;
    }
    if let Some(rest) = name.strip_prefix(SPARE_PREFIX) {
        let rest = rest
            .strip_prefix(|c: char| c.is_ascii_lowercase())
            .unwrap_or(rest);
        return digits(rest);
    }
    name.split_once('.').is_some_and(|(hex, seq)| {
        crate::block::BlockId::from_hex(hex).is_some_and(|id| id.hex() == hex) && digits(seq)
    })
}

/// Whether the store that owns work directory `dir` is gone.
enum Owner {
    /// Gone: its lock, now held here.
    Gone(File),
    /// Running.
    Alive,
    /// No lock file: not a store's work directory.
    NoLock,
}

fn owner(dir: &Dir, nfs: bool) -> Owner {
    let Ok(lock) = dir.open_file(LOCK_FILE, OFlags::RDONLY) else {
        return Owner::NoLock;
    };
    if !lock.metadata().is_ok_and(|m| m.file_type().is_file()) {
        return Owner::NoLock;
    }
    if !try_lock(&lock) {
        return Owner::Alive;
    }
    if nfs && dir.lstat(CLOSED_FILE).is_err() && !older_than(dir, LOCK_FILE, NFS_STALE_AFTER) {
        return Owner::Alive; // a lock local to another host: trust the heartbeat
    }
    Owner::Gone(lock)
}

/// The work directories of stopped stores under every root of `tree`,
/// and what is found there that no store wrote.
pub(super) fn work_dirs(tree: &Tree) -> (Vec<Leftover>, Vec<Kept>) {
    let mut found = Vec::new();
    let mut kept = Vec::new();
    for r in 0..tree.root_count() {
        let root = tree.root(r);
        let parent = match root.sub(WORK_DIR) {
            Ok(p) => p,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => {
                kept.push(Kept::new(
                    label(&root.join(WORK_DIR)),
                    format!("{e}: not followed"),
                ));
                continue;
            }
        };
        let nfs = root.on_nfs();
        for e in parent.entries().into_iter().flatten() {
            let name = e.name.to_string_lossy().to_string();
            let path = label(&parent.join(&e.name));
            let being_made = is_being_made(&name);
            if !is_token(&name) && !being_made {
                kept.push(Kept::new(
                    path,
                    "not a work directory a store made: left alone",
                ));
                continue;
            }
            let kind = parent.kind_of(&e);
            if kind != Some(FileType::Directory) {
                let what = kind.map_or("gone", describe_kind);
                kept.push(Kept::new(
                    path,
                    format!("{what}, not a work directory: left alone"),
                ));
                continue;
            }
            let Ok(dir) = parent.sub(&e.name) else {
                continue; // replaced meanwhile
            };
            if being_made {
                if !older_than(&parent, &name, IDLE) {
                    continue; // a store starting now
                }
            } else {
                match owner(&dir, nfs) {
                    Owner::Gone(_) => {}
                    Owner::Alive => continue,
                    Owner::NoLock => {
                        kept.push(Kept::new(
                            path,
                            "no lock file: not a work directory a store made: left alone",
                        ));
                        continue;
                    }
                }
            }
            let (files, bytes, strangers) = store_files(&dir);
            kept.extend(strangers);
            found.push(Leftover {
                label: path,
                bytes,
                files: files.len(),
                kind: ItemKind::StoppedStore,
                place: Place::WorkDir {
                    root: r,
                    name,
                    files,
                    unlocked: being_made,
                },
            });
        }
    }
    (found, kept)
}

/// The files of work directory `dir` that a store wrote (its lock last),
/// their bytes, and the others, left alone.
fn store_files(dir: &Dir) -> (Vec<String>, u64, Vec<Kept>) {
    let mut files = Vec::new();
    let mut bytes = 0;
    let mut strangers = Vec::new();
    for f in dir.entries().into_iter().flatten() {
        let name = f.name.to_string_lossy().to_string();
        match dir.lstat(&f.name) {
            Ok(st) if st.is_file() && written_by_store(&name) && f.name.to_str().is_some() => {
                bytes += st.len;
                files.push(name);
            }
            Ok(st) => strangers.push(Kept::new(
                label(&dir.join(&f.name)),
                if st.is_file() {
                    "not a file a store writes there: left alone".to_string()
                } else {
                    format!(
                        "{}, not a file a store writes there: left alone",
                        st.describe()
                    )
                },
            )),
            Err(_) => {}
        }
    }
    // The lock goes last, and `closed` just before it.
    files.sort_by_key(|n| (n == LOCK_FILE, n == CLOSED_FILE, n.clone()));
    (files, bytes, strangers)
}

/// The idle temporaries among `entries` of block directory `b` of root `r`.
pub(super) fn idle_temps(
    tree: &Tree,
    r: usize,
    b: u8,
    dir: &Dir,
    entries: Vec<DirEntry>,
) -> Vec<Leftover> {
    let mut out = Vec::new();
    for e in entries {
        let Some(name) = e.name.to_str() else {
            continue;
        };
        let Some((hex, writer)) = name.split_once(".tmp.") else {
            continue;
        };
        let Some(block) = block_in(tree, r, b, hex.as_ref()) else {
            continue;
        };
        if writer.is_empty()
            || !writer
                .bytes()
                .all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f' | b'.'))
        {
            continue;
        }
        let Ok(st) = dir.lstat(name) else { continue };
        if !st.is_file() || !older_than(dir, name, IDLE) {
            continue;
        }
        out.push(Leftover {
            label: label(&dir.join(name)),
            bytes: st.len,
            files: 1,
            kind: ItemKind::IdleTemp,
            place: Place::Temp {
                root: r,
                dir: bucket_name(b),
                name: name.to_string(),
                block,
            },
        });
    }
    out
}

/// Removes a leftover after checking again that it still is one: what it
/// did, the root, and the bytes of it the root's usage record counted.
pub(super) fn remove(tree: &Tree, leftover: &Leftover) -> Result<(Removal, usize, u64)> {
    let open = |dir: &Dir, name: &str| match dir.sub(name) {
        Ok(d) => Ok(Some(d)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("{e}: not followed")),
    };
    match &leftover.place {
        Place::WorkDir {
            root,
            name,
            files,
            unlocked,
        } => {
            let r = tree.root(*root);
            let parent = match open(r, WORK_DIR) {
                Ok(Some(p)) => p,
                Ok(None) => return Ok((Removal::Gone, *root, 0)),
                Err(why) => return Ok((Removal::Kept(why), *root, 0)),
            };
            let dir = match open(&parent, name) {
                Ok(Some(d)) => d,
                Ok(None) => return Ok((Removal::Gone, *root, 0)),
                Err(why) => return Ok((Removal::Kept(why), *root, 0)),
            };
            // Held until every file is gone.
            let _lock = if *unlocked {
                if !older_than(&parent, name, IDLE) {
                    return Ok((
                        Removal::Kept("being made by a store that is starting".into()),
                        *root,
                        0,
                    ));
                }
                None
            } else {
                match owner(&dir, r.on_nfs()) {
                    Owner::Gone(lock) => Some(lock),
                    Owner::Alive => {
                        return Ok((
                            Removal::Kept(
                                "its store is running (or another one is reclaiming it)".into(),
                            ),
                            *root,
                            0,
                        ))
                    }
                    Owner::NoLock => return Ok((Removal::Gone, *root, 0)),
                }
            };
            let (mut bytes, mut counted) = (0, 0);
            for f in files {
                let Ok(st) = dir.lstat(f) else { continue };
                if !st.is_file() {
                    continue;
                }
                match dir.remove_file(f) {
                    Ok(()) => {
                        bytes += st.len;
                        // The usage record counts spares, not temporaries.
                        if f.starts_with(SPARE_PREFIX) {
                            counted += st.len;
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(UcmError::os("unlink", dir.join(f), e)),
                }
            }
            // Stays when something no store wrote is still in it.
            let _ = parent.remove_dir(name);
            Ok((Removal::Removed { bytes }, *root, counted))
        }
        Place::Temp {
            root, dir, name, ..
        } => {
            let d = match open(tree.root(*root), dir) {
                Ok(Some(d)) => d,
                Ok(None) => return Ok((Removal::Gone, *root, 0)),
                Err(why) => return Ok((Removal::Kept(why), *root, 0)),
            };
            let st = match d.lstat(name) {
                Ok(st) => st,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    return Ok((Removal::Gone, *root, 0))
                }
                Err(e) => return Err(UcmError::os("stat", d.join(name), e)),
            };
            if !st.is_file() {
                return Ok((
                    Removal::Kept(format!("{}, not a temporary file", st.describe())),
                    *root,
                    0,
                ));
            }
            if !older_than(&d, name, IDLE) {
                return Ok((
                    Removal::Kept("written to again: its writer is alive".into()),
                    *root,
                    0,
                ));
            }
            match d.remove_file(name) {
                Ok(()) => Ok((Removal::Removed { bytes: st.len }, *root, 0)),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok((Removal::Gone, *root, 0)),
                Err(e) => Err(UcmError::os("unlink", d.join(name), e)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_stores_give_their_files() {
        let hex = "ab".repeat(16);
        for ok in [
            "lock",
            "closed",
            "spare.0",
            "spare.a12",
            "spare.r3",
            &format!("{hex}.7"),
        ] {
            assert!(written_by_store(ok), "{ok}");
        }
        for bad in [
            "notes.txt",
            "spare.",
            "spare.x",
            "spare.ab1",
            &format!("{hex}.x"),
            &format!("{}.1", "AB".repeat(16)),
            "lock.bak",
        ] {
            assert!(!written_by_store(bad), "{bad}");
        }
        assert!(is_token("0123456789abcdef") && !is_token("home") && !is_token("0123456789ABCDEF"));
        assert!(is_being_made(".0123456789abcdef.new") && !is_being_made(".x.new"));
    }
}
