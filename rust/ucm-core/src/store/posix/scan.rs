//! Start-up scan: rebuild the index from the block directories, remove
//! what does not belong at a block's name, and clean up the temporary files
//! older versions left in the block directories. (Work directories of dead
//! instances are reclaimed by [`super::work::reclaim`].)

use std::path::Path;
use std::time::{Duration, SystemTime};

use super::files::{kind_of, Paths, LEGACY_SPARE_DIR, LEGACY_TMP_MARKER};
use super::index::Index;
use crate::block::BlockId;

/// Temporaries in the older naming are removed once this old: their
/// owners can't be told alive or dead without a lock.
const LEGACY_TMP_MAX_AGE: Duration = Duration::from_secs(3600);

/// What the scan found.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ScanReport {
    /// Published blocks indexed.
    pub blocks: usize,
    /// Bytes they hold.
    pub bytes: u64,
    /// Leftover temporary files removed.
    pub removed_temps: usize,
    /// Symlinks, FIFOs, devices and sockets removed from block names.
    pub removed_foreign: usize,
    /// Files ignored (unknown names, or blocks of another size/layout).
    pub ignored: usize,
}

/// Indexes every complete block file (a regular file of `file_len` bytes)
/// under `paths`, ordering recency by modification time. When `clean` is
/// set (stores that write, never a lookup-only one) it also removes what
/// is not a regular file at a block's name and stale legacy temporaries.
pub fn scan(paths: &Paths, index: &Index, file_len: u64, clean: bool) -> ScanReport {
    let mut report = ScanReport::default();
    let mut found: Vec<(SystemTime, BlockId, u64)> = Vec::new();
    // (mtime, id, size): recency follows the mtime order.
    let mut progress = Progress::new(PROGRESS_EVERY);
    for root in paths.roots() {
        let Ok(subdirs) = std::fs::read_dir(root) else {
            continue;
        };
        for sub in subdirs.flatten() {
            let name = sub.file_name();
            let name = name.to_string_lossy();
            if name == LEGACY_SPARE_DIR {
                if clean {
                    report.removed_temps += remove_legacy_temps(&sub.path(), true);
                }
                continue;
            }
            if name.len() != 2 || !name.bytes().all(|b| b.is_ascii_hexdigit()) {
                continue;
            }
            // `read_dir` would follow a symlink planted at a block directory.
            if !sub.file_type().is_ok_and(|t| t.is_dir()) {
                log::warn!(
                    "{} is not a directory (a symlink?); its blocks are ignored",
                    sub.path().display()
                );
                continue;
            }
            let Ok(files) = std::fs::read_dir(sub.path()) else {
                continue;
            };
            for f in files.flatten() {
                let fname = f.file_name();
                let fname = fname.to_string_lossy();
                // DirEntry metadata does not follow symlinks.
                let Ok(meta) = f.metadata() else { continue };
                if let Some(id) = BlockId::from_hex(&fname) {
                    if meta.file_type().is_file() {
                        if meta.len() == file_len {
                            let mtime = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
                            found.push((mtime, id, meta.len()));
                            progress.tick(found.len(), root);
                        } else {
                            report.ignored += 1;
                        }
                    } else if clean && !meta.is_dir() {
                        log::warn!(
                            "removed {} from the store: it is {}, not a block file",
                            f.path().display(),
                            kind_of(&meta)
                        );
                        let _ = std::fs::remove_file(f.path());
                        report.removed_foreign += 1;
                    } else {
                        report.ignored += 1;
                    }
                } else if fname.contains(LEGACY_TMP_MARKER) {
                    if clean && is_stale_legacy(&meta) && std::fs::remove_file(f.path()).is_ok() {
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
        index.insert(*id, *len, Some(stamp as u64 + 1), nanos(found[stamp].0));
        report.bytes += len;
    }
    index.advance_clock(found.len() as u64 + 1);
    report.blocks = found.len();
    report
}

/// Logs how far a long scan got, so a start-up over a large store does not
/// look hung: every [`PROGRESS_EVERY`] while it runs.
struct Progress {
    start: std::time::Instant,
    last: std::time::Instant,
    every: Duration,
}

/// How often a running scan logs its progress.
const PROGRESS_EVERY: Duration = Duration::from_secs(2);

impl Progress {
    fn new(every: Duration) -> Self {
        let now = std::time::Instant::now();
        Progress {
            start: now,
            last: now,
            every,
        }
    }

    /// Logs (and returns true) when `every` passed since the last line;
    /// looks at the clock once per 1024 blocks.
    fn tick(&mut self, blocks: usize, root: &Path) -> bool {
        if blocks % 1024 != 0 || self.last.elapsed() < self.every {
            return false;
        }
        self.last = std::time::Instant::now();
        log::info!(
            "indexing the posix store under {}: {blocks} block(s) after {:.1} s",
            root.display(),
            self.start.elapsed().as_secs_f64()
        );
        true
    }
}

/// Removes the stale legacy temporaries directly under `dir` (and `dir`
/// itself when it ends up empty and `remove_dir` is set).
fn remove_legacy_temps(dir: &Path, remove_dir: bool) -> usize {
    let Ok(files) = std::fs::read_dir(dir) else {
        return 0;
    };
    let n = files
        .flatten()
        .filter(|f| {
            let name = f.file_name().to_string_lossy().to_string();
            name.contains(LEGACY_TMP_MARKER)
                && f.metadata().is_ok_and(|m| is_stale_legacy(&m))
                && std::fs::remove_file(f.path()).is_ok()
        })
        .count();
    if remove_dir {
        let _ = std::fs::remove_dir(dir);
    }
    n
}

fn is_stale_legacy(meta: &std::fs::Metadata) -> bool {
    meta.modified()
        .ok()
        .and_then(|t| t.elapsed().ok())
        .is_some_and(|age| age >= LEGACY_TMP_MAX_AGE)
}

/// The mtime (ns since the epoch) of a published, complete block file at
/// `path` (a regular file, not a symlink to one), or None.
pub fn probe(path: &Path, file_len: u64) -> Option<u64> {
    let m = std::fs::symlink_metadata(path).ok()?;
    (m.file_type().is_file() && m.len() == file_len)
        .then(|| nanos(m.modified().unwrap_or(SystemTime::UNIX_EPOCH)))
}

/// `t` in ns since the epoch (0 before it).
pub fn nanos(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::posix::files::temp_paths;

    #[test]
    fn long_scans_report_progress() {
        let mut p = Progress::new(Duration::from_millis(10));
        assert!(!p.tick(1024, Path::new("/x")), "too early");
        std::thread::sleep(Duration::from_millis(15));
        assert!(!p.tick(1023, Path::new("/x")), "only every 1024 blocks");
        assert!(p.tick(2048, Path::new("/x")));
        assert!(!p.tick(3072, Path::new("/x")), "not again right away");
    }

    #[test]
    fn finds_blocks_and_removes_what_is_not_a_block() {
        let (_d, paths) = temp_paths();
        let a = BlockId([0x11; 16]);
        let b = BlockId([0x22; 16]);
        let c = BlockId([0x33; 16]);
        std::fs::write(paths.block(&a), vec![0u8; 100]).unwrap();
        std::fs::write(paths.block(&b), vec![0u8; 99]).unwrap(); // wrong size
        std::os::unix::fs::symlink(paths.block(&a), paths.block(&c)).unwrap();
        // Legacy temporaries: an old one and a fresh one.
        let old = paths
            .dir(&a)
            .join(format!("{}{LEGACY_TMP_MARKER}1.1.1", a.hex()));
        let fresh = paths
            .dir(&a)
            .join(format!("{}{LEGACY_TMP_MARKER}1.1.2", a.hex()));
        std::fs::write(&old, b"x").unwrap();
        std::fs::write(&fresh, b"x").unwrap();
        let long_ago = SystemTime::now() - 2 * LEGACY_TMP_MAX_AGE;
        std::fs::File::options()
            .write(true)
            .open(&old)
            .unwrap()
            .set_modified(long_ago)
            .unwrap();
        let index = Index::default();
        let r = scan(&paths, &index, 100, false);
        assert_eq!((r.removed_temps, r.removed_foreign), (0, 0));
        assert!(old.exists());
        let index = Index::default();
        let r = scan(&paths, &index, 100, true);
        assert_eq!(r.blocks, 1);
        assert_eq!(r.bytes, 100);
        assert_eq!((r.removed_temps, r.removed_foreign), (1, 1));
        assert!(index.contains(&a) && !index.contains(&b) && !index.contains(&c));
        assert!(!old.exists() && fresh.exists());
        assert!(paths.block(&a).exists(), "the symlink went, not its target");
        assert!(probe(&paths.block(&a), 100).is_some() && probe(&paths.block(&b), 100).is_none());
        std::os::unix::fs::symlink(paths.block(&a), paths.block(&c)).unwrap();
        assert!(probe(&paths.block(&c), 100).is_none());
    }
}
