//! Pre-created temporary files for dumps.
//!
//! Creating a file is the slowest step of a dump on some file systems: on
//! the ext4 volumes of our test VMs a create takes 0.5–0.7 ms and does not
//! scale with threads (about 1,400 creates/s), more than writing a 1 MiB
//! shard; on NFS a create is a server round trip. A background thread keeps
//! a few empty files per storage root, created ahead of time, so a dump only
//! opens one (microseconds), writes it and renames it into place. Bursts of
//! dumps up to the pool size skip the create; beyond that, dumps create
//! their own temporaries as before.
//!
//! Spares are left empty on purpose: preallocating them (`fallocate`) would
//! save a little allocation work per write, but spares would then hold disk
//! space that a nearly full disk needs for real blocks.
//!
//! Spares live in `<root>/.spare/` (the same file system as the block
//! directories, so the publishing rename stays atomic), are named like other
//! temporaries (`spare.tmp.<pid>.<instance>.<seq>`), are removed on close, and
//! leftovers of dead processes are removed by the next start's scan.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use super::files::{make_private_dir, TMP_MARKER};

/// Name of the spare-file directory under each root.
pub const SPARE_DIR: &str = ".spare";

struct Root {
    dir: PathBuf,
    files: Mutex<VecDeque<PathBuf>>,
}

/// Spare temporary files per storage root.
pub struct SparePool {
    roots: Vec<Root>,
    target: usize,
    owner: String,
    seq: AtomicU64,
    stop: AtomicBool,
    wake: (Mutex<bool>, Condvar),
}

impl SparePool {
    /// A pool keeping `target` empty spares under each root (`target == 0`
    /// disables it); `owner` is the store's `<pid>.<instance>`.
    pub fn new(roots: &[PathBuf], target: usize, owner: String) -> Self {
        SparePool {
            roots: roots
                .iter()
                .map(|r| Root {
                    dir: r.join(SPARE_DIR),
                    files: Mutex::new(VecDeque::new()),
                })
                .collect(),
            target,
            owner,
            seq: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            wake: (Mutex::new(false), Condvar::new()),
        }
    }

    /// True when the pool keeps spares at all.
    pub fn enabled(&self) -> bool {
        self.target > 0
    }

    /// Takes a spare file under root `root` (its index), if one is ready.
    pub fn take(&self, root: usize) -> Option<PathBuf> {
        let r = self.roots.get(root)?;
        let path = r.files.lock().pop_front();
        if path.is_some() {
            let (lock, cv) = &self.wake;
            *lock.lock() = true;
            cv.notify_one();
        }
        path
    }

    /// Number of spares ready (all roots).
    #[cfg(test)]
    pub fn ready(&self) -> usize {
        self.roots.iter().map(|r| r.files.lock().len()).sum()
    }

    /// The filler loop; returns when [`SparePool::stop`] is called.
    pub fn run(&self) {
        if !self.enabled() {
            return;
        }
        for r in &self.roots {
            if let Err(e) = make_private_dir(&r.dir) {
                log::warn!("spare files disabled under {}: {e}", r.dir.display());
            }
        }
        while !self.stop.load(Ordering::Acquire) {
            let mut made = false;
            for r in &self.roots {
                if r.files.lock().len() < self.target {
                    if let Some(p) = self.create(&r.dir) {
                        r.files.lock().push_back(p);
                        made = true;
                    }
                }
            }
            if !made {
                let (lock, cv) = &self.wake;
                let mut woken = lock.lock();
                if !*woken && !self.stop.load(Ordering::Acquire) {
                    // Also retry periodically after errors (no inodes left).
                    cv.wait_for(&mut woken, Duration::from_secs(1));
                }
                *woken = false;
            }
        }
    }

    fn create(&self, dir: &Path) -> Option<PathBuf> {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let path = dir.join(format!("spare{TMP_MARKER}{}.{seq}", self.owner));
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .ok()?;
        Some(path)
    }

    /// Stops the filler loop.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        let (lock, cv) = &self.wake;
        *lock.lock() = true;
        cv.notify_all();
    }

    /// Removes the spares not taken (on close).
    pub fn discard(&self) {
        for r in &self.roots {
            for p in r.files.lock().drain(..) {
                let _ = std::fs::remove_file(p);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn fills_hands_out_and_discards() {
        let d = tempfile::tempdir().unwrap();
        let pool = Arc::new(SparePool::new(&[d.path().to_path_buf()], 3, "1.1".into()));
        let filler = {
            let p = pool.clone();
            std::thread::spawn(move || p.run())
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while pool.ready() < 3 && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(pool.ready(), 3);
        let f = pool.take(0).unwrap();
        assert!(f.starts_with(d.path().join(SPARE_DIR)));
        assert_eq!(std::fs::metadata(&f).unwrap().len(), 0);
        assert!(pool.take(1).is_none());
        pool.stop();
        filler.join().unwrap();
        pool.discard();
        let left: Vec<_> = std::fs::read_dir(d.path().join(SPARE_DIR))
            .unwrap()
            .collect();
        assert_eq!(left.len(), 1); // only the one we took
    }
}
