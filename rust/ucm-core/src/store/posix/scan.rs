//! Start-up scan: rebuild the index from the directories and clean up
//! temporary files left by writers that died (SIGKILL, power loss).

use std::path::Path;
use std::time::{Duration, SystemTime};

use super::files::{Paths, TMP_MARKER};
use super::index::Index;
use crate::block::BlockId;

/// A temporary file whose owner is alive is still left alone after this
/// long only if its owner can't be checked (another host on a shared FS).
const FOREIGN_TMP_MAX_AGE: Duration = Duration::from_secs(3600);

/// What the scan found.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ScanReport {
    /// Published blocks indexed.
    pub blocks: usize,
    /// Bytes they hold.
    pub bytes: u64,
    /// Leftover temporary files removed.
    pub removed_temps: usize,
    /// Files ignored (unknown names, or blocks of another size/layout).
    pub ignored: usize,
}

/// Indexes every complete block file (size `file_len`) under `paths`,
/// ordering recency by modification time, and (when `clean` is set: only
/// stores that write, never a lookup-only one) removes stale temporaries.
pub fn scan(paths: &Paths, index: &Index, file_len: u64, clean: bool) -> ScanReport {
    let mut report = ScanReport::default();
    let mut found: Vec<(SystemTime, BlockId, u64)> = Vec::new();
    for root in paths.roots() {
        let Ok(subdirs) = std::fs::read_dir(root) else {
            continue;
        };
        for sub in subdirs.flatten() {
            let name = sub.file_name();
            let name = name.to_string_lossy();
            if name == super::spare::SPARE_DIR {
                if clean {
                    report.removed_temps += remove_stale_temps(&sub.path());
                }
                continue;
            }
            if name.len() != 2 || !name.bytes().all(|b| b.is_ascii_hexdigit()) {
                continue;
            }
            let Ok(files) = std::fs::read_dir(sub.path()) else {
                continue;
            };
            for f in files.flatten() {
                let fname = f.file_name();
                let fname = fname.to_string_lossy();
                let Ok(meta) = f.metadata() else { continue };
                if let Some(id) = BlockId::from_hex(&fname) {
                    if meta.len() == file_len {
                        let mtime = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
                        found.push((mtime, id, meta.len()));
                    } else {
                        report.ignored += 1;
                    }
                } else if fname.contains(TMP_MARKER) {
                    if clean
                        && is_stale_temp(&fname, &meta)
                        && std::fs::remove_file(f.path()).is_ok()
                    {
                        report.removed_temps += 1;
                    }
                } else {
                    report.ignored += 1;
                }
            }
        }
    }
    found.sort_unstable_by_key(|(t, _, _)| *t);
    for (stamp, (_, id, len)) in found.iter().enumerate() {
        index.insert(*id, *len, Some(stamp as u64 + 1));
        report.bytes += len;
    }
    index.advance_clock(found.len() as u64 + 1);
    report.blocks = found.len();
    report
}

/// Removes the stale temporaries directly under `dir`; returns how many.
fn remove_stale_temps(dir: &Path) -> usize {
    let Ok(files) = std::fs::read_dir(dir) else {
        return 0;
    };
    files
        .flatten()
        .filter(|f| {
            let name = f.file_name().to_string_lossy().to_string();
            name.contains(TMP_MARKER)
                && f.metadata().is_ok_and(|m| is_stale_temp(&name, &m))
                && std::fs::remove_file(f.path()).is_ok()
        })
        .count()
}

/// A temporary is stale when its writer process is gone, or when it is old
/// and its owner is alive or cannot be checked (another host on a shared
/// file system, or a reused pid). Temporaries of this very process are left
/// alone: another store of this process may be writing them.
fn is_stale_temp(name: &str, meta: &std::fs::Metadata) -> bool {
    let owner = name
        .split(TMP_MARKER)
        .nth(1)
        .and_then(|rest| rest.split('.').next())
        .and_then(|pid| pid.parse::<i32>().ok());
    let old = meta
        .modified()
        .ok()
        .and_then(|t| t.elapsed().ok())
        .is_some_and(|age| age >= FOREIGN_TMP_MAX_AGE);
    match owner {
        Some(pid) if pid as u32 == std::process::id() => old,
        Some(pid) if pid > 0 => !process_alive(pid) || old,
        _ => old,
    }
}

fn process_alive(pid: i32) -> bool {
    // SAFETY: kill with signal 0 only checks for existence and permission.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// True if a published, complete block file exists at `path`.
pub fn probe(path: &Path, file_len: u64) -> bool {
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.len() == file_len)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_blocks_and_removes_dead_temps() {
        let d = tempfile::tempdir().unwrap();
        let paths = Paths::new(vec![d.path().to_path_buf()]);
        paths.create_dirs().unwrap();
        let a = BlockId([0x11; 16]);
        let b = BlockId([0x22; 16]);
        std::fs::write(paths.block(&a), vec![0u8; 100]).unwrap();
        std::fs::write(paths.block(&b), vec![0u8; 99]).unwrap(); // wrong size
                                                                 // a temp of a dead process (pid 2^22 - 1 is above pid_max defaults
                                                                 // on most systems) and one of a live process (pid 1).
        let dead = paths
            .dir(&a)
            .join(format!("{}{TMP_MARKER}4194303.1", a.hex()));
        let live = paths.dir(&a).join(format!("{}{TMP_MARKER}1.1", a.hex()));
        // Another store of this very process may be writing this one.
        let ours = paths.temp(&a, 1);
        std::fs::write(&dead, b"x").unwrap();
        std::fs::write(&live, b"x").unwrap();
        std::fs::write(&ours, b"x").unwrap();
        let index = Index::default();
        let r = scan(&paths, &index, 100, false);
        assert_eq!(r.removed_temps, 0);
        assert!(dead.exists());
        let index = Index::default();
        let r = scan(&paths, &index, 100, true);
        assert_eq!(r.blocks, 1);
        assert_eq!(r.bytes, 100);
        assert_eq!(r.removed_temps, 1);
        assert!(index.contains(&a) && !index.contains(&b));
        assert!(!dead.exists() && live.exists() && ours.exists());
        assert!(probe(&paths.block(&a), 100) && !probe(&paths.block(&b), 100));
    }
}
