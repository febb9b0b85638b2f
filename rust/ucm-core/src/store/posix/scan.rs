//! Start-up scan: rebuild the index from the block directories, remove
//! what does not belong at a block's name, and clean up the temporary files
//! older versions left in the block directories. (Work directories of dead
//! instances are reclaimed by `super::work::reclaim`.)

use std::time::{Duration, SystemTime};

use super::files::{Dir, LEGACY_SPARE_DIR, LEGACY_TMP_MARKER, WORK_DIR};
use super::index::Index;
use super::tree::{bucket_name, Tree};
use super::work::SPARE_PREFIX;
use crate::block::BlockId;

/// Temporaries in the older naming are removed once this old: their
/// owners can't be told alive or dead without a lock.
const LEGACY_TMP_MAX_AGE: Duration = Duration::from_secs(3600);

/// What the scan found.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
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
    /// Bytes of the regular files at block names (of any layout) and in
    /// the work directories, per root: what the roots' usage counts.
    pub root_bytes: Vec<u64>,
}

/// Indexes every complete block file (a regular file of `file_len` bytes)
/// under `tree`, ordering recency by modification time; blocks already in
/// the index keep their place. When `clean` is set (stores that write,
/// never a lookup-only one) it also removes what is not a regular file at
/// a block's name and stale legacy temporaries. Nothing is followed: a
/// link at a block directory's name is repaired (or skipped) by the tree.
pub fn scan(tree: &Tree, index: &Index, file_len: u64, clean: bool) -> ScanReport {
    let mut report = ScanReport {
        root_bytes: vec![0; tree.root_count()],
        ..Default::default()
    };
    // (mtime, id, size): recency follows the mtime order.
    let mut found: Vec<(u64, BlockId, u64)> = Vec::new();
    let mut progress = Progress::new(PROGRESS_EVERY);
    for r in 0..tree.root_count() {
        let root = tree.root(r);
        let Ok(entries) = root.entries() else {
            continue;
        };
        for sub in entries {
            let name = sub.name.to_string_lossy();
            if name == LEGACY_SPARE_DIR {
                if clean {
                    if let Ok(dir) = root.sub(&sub.name) {
                        report.removed_temps += remove_legacy_temps(&dir);
                        let _ = root.remove_dir(&sub.name);
                    }
                }
                continue;
            }
            if name == WORK_DIR {
                if let Ok(work) = root.sub(&sub.name) {
                    report.root_bytes[r] += work_bytes(&work);
                }
                continue;
            }
            let Some(b) = bucket_of(&name) else {
                continue;
            };
            let Ok(dir) = tree.bucket_at(r, b) else {
                continue; // logged by the tree
            };
            scan_bucket(
                &dir,
                file_len,
                clean,
                &mut report,
                r,
                &mut found,
                &mut progress,
            );
        }
    }
    found.sort_unstable_by_key(|(t, _, _)| *t);
    let oldest_first: Vec<BlockId> = found.iter().map(|(_, id, _)| *id).collect();
    report.blocks = index.insert_found(&oldest_first);
    report.bytes = report.blocks as u64 * file_len;
    index.date_found(&oldest_first);
    report
}

/// The block directory a root's entry names (two lowercase hex digits).
fn bucket_of(name: &str) -> Option<u8> {
    let b = u8::from_str_radix(name, 16).ok()?;
    (name.len() == 2 && bucket_name(b) == name).then_some(b)
}

/// Scans one block directory of root `root` into `found` and `report`.
fn scan_bucket(
    dir: &Dir,
    file_len: u64,
    clean: bool,
    report: &mut ScanReport,
    root: usize,
    found: &mut Vec<(u64, BlockId, u64)>,
    progress: &mut Progress,
) {
    let Ok(files) = dir.entries() else {
        return;
    };
    for f in files {
        let fname = f.name.to_string_lossy();
        let Ok(st) = dir.lstat(&f.name) else { continue };
        if let Some(id) = BlockId::from_hex(&fname) {
            if st.is_file() {
                report.root_bytes[root] += st.len;
                if st.len == file_len {
                    found.push((st.mtime_ns, id, st.len));
                    progress.tick(found.len(), dir.path());
                } else {
                    report.ignored += 1;
                }
            } else if clean && !st.is_dir() {
                log::warn!(
                    "removed {} from the store: it is {}, not a block file",
                    dir.join(&f.name).display(),
                    st.describe()
                );
                let _ = dir.remove_file(&f.name);
                report.removed_foreign += 1;
            } else {
                report.ignored += 1;
            }
        } else if fname.contains(LEGACY_TMP_MARKER) {
            if clean
                && st.is_file()
                && is_stale_legacy(st.mtime_ns)
                && dir.remove_file(&f.name).is_ok()
            {
                report.removed_temps += 1;
            }
        } else {
            report.ignored += 1;
        }
    }
}

/// Bytes of the spare files in the work directories under `work`: what
/// the roots' usage counts there (a temporary counts once it is published).
pub(super) fn work_bytes(work: &Dir) -> u64 {
    let mut bytes = 0;
    for e in work.entries().into_iter().flatten() {
        let Ok(dir) = work.sub(&e.name) else { continue };
        for f in dir.entries().into_iter().flatten() {
            if !f.name.to_string_lossy().starts_with(SPARE_PREFIX) {
                continue;
            }
            if let Ok(st) = dir.lstat(&f.name) {
                if st.is_file() {
                    bytes += st.len;
                }
            }
        }
    }
    bytes
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
    fn tick(&mut self, blocks: usize, root: &std::path::Path) -> bool {
        if blocks % 1024 != 0 || self.last.elapsed() < self.every {
            return false;
        }
        self.last = std::time::Instant::now();
        log::info!(
            "indexing the posix store: {blocks} block(s) after {:.1} s (at {})",
            self.start.elapsed().as_secs_f64(),
            root.display()
        );
        true
    }
}

/// Removes the stale legacy temporaries directly under `dir`.
fn remove_legacy_temps(dir: &Dir) -> usize {
    dir.entries()
        .into_iter()
        .flatten()
        .filter(|f| {
            f.name.to_string_lossy().contains(LEGACY_TMP_MARKER)
                && dir
                    .lstat(&f.name)
                    .is_ok_and(|st| st.is_file() && is_stale_legacy(st.mtime_ns))
                && dir.remove_file(&f.name).is_ok()
        })
        .count()
}

pub(super) fn is_stale_legacy(mtime_ns: u64) -> bool {
    nanos(SystemTime::now()).saturating_sub(mtime_ns) >= LEGACY_TMP_MAX_AGE.as_nanos() as u64
}

/// The mtime (ns since the epoch) of a published, complete block file
/// `name` in `dir` (a regular file, not a link to one), or None.
pub fn probe(dir: &Dir, name: &str, file_len: u64) -> Option<u64> {
    let st = dir.lstat(name).ok()?;
    (st.is_file() && st.len == file_len).then_some(st.mtime_ns)
}

/// `t` in ns since the epoch (0 before it).
pub fn nanos(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::posix::tree::temp_tree;
    use std::path::Path;

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
        let (d, tree) = temp_tree();
        let a = BlockId([0x11; 16]);
        let b = BlockId([0x22; 16]);
        let c = BlockId([0x33; 16]);
        std::fs::write(tree.block_path(&a), vec![0u8; 100]).unwrap();
        std::fs::write(tree.block_path(&b), vec![0u8; 99]).unwrap(); // wrong size
        std::os::unix::fs::symlink(tree.block_path(&a), tree.block_path(&c)).unwrap();
        // Legacy temporaries: an old one and a fresh one.
        let dir_a = d.path().join("11");
        let old = dir_a.join(format!("{}{LEGACY_TMP_MARKER}1.1.1", a.hex()));
        let fresh = dir_a.join(format!("{}{LEGACY_TMP_MARKER}1.1.2", a.hex()));
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
        let r = scan(&tree, &index, 100, false);
        assert_eq!((r.removed_temps, r.removed_foreign), (0, 0));
        assert_eq!(r.root_bytes, vec![199], "blocks of any length count");
        assert!(old.exists());
        let index = Index::default();
        let r = scan(&tree, &index, 100, true);
        assert_eq!(r.blocks, 1);
        assert_eq!(r.bytes, 100);
        assert_eq!((r.removed_temps, r.removed_foreign), (1, 1));
        assert!(index.contains(&a) && !index.contains(&b) && !index.contains(&c));
        assert!(!old.exists() && fresh.exists());
        assert!(
            tree.block_path(&a).exists(),
            "the symlink went, not its target"
        );
        let bucket = tree.bucket(&a).unwrap();
        assert!(probe(&bucket, &a.hex(), 100).is_some());
        assert!(probe(&tree.bucket(&b).unwrap(), &b.hex(), 100).is_none());
        std::os::unix::fs::symlink(tree.block_path(&a), tree.block_path(&c)).unwrap();
        assert!(probe(&tree.bucket(&c).unwrap(), &c.hex(), 100).is_none());
        // Scanning again leaves what is indexed where it is.
        assert_eq!(scan(&tree, &index, 100, false).blocks, 0);
    }

    /// A block directory that is a link to a folder outside the store: its
    /// files are neither indexed nor removed.
    #[test]
    fn never_descends_through_a_link() {
        let (d, _) = temp_tree();
        let outside = tempfile::tempdir().unwrap();
        let id = BlockId([0x44; 16]);
        std::fs::write(outside.path().join(id.hex()), vec![0u8; 100]).unwrap();
        std::os::unix::fs::symlink(outside.path().join(id.hex()), outside.path().join("l"))
            .unwrap();
        std::fs::remove_dir(d.path().join("44")).unwrap();
        std::os::unix::fs::symlink(outside.path(), d.path().join("44")).unwrap();
        let lookup_only = Tree::open(&[d.path().to_path_buf()], false, false).unwrap();
        let index = Index::default();
        let r = scan(&lookup_only, &index, 100, true);
        assert_eq!(r.blocks, 0);
        assert!(outside.path().join("l").exists());
        assert!(outside.path().join(id.hex()).exists());
    }
}
