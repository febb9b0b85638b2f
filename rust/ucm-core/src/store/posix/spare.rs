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
//! Spares are also preallocated to a block file's full length (`fallocate`)
//! when the file system has room to spare: an O_DIRECT write that extends a
//! file takes ext4's slow path (block allocation, an orphan-list entry and an
//! i_size update in the journal per write), while overwriting allocated
//! space is what the raw-disk baseline measures. A nearly full disk needs its
//! space for real blocks, so below [`PREALLOC_MIN_FREE`] free bytes (or 5 %
//! of the file system) spares stay empty.
//!
//! Evicted block files are recycled as spares instead of being deleted:
//! the file is already allocated to the right length, so the next dump
//! overwrites it in place, and neither the delete nor a create happens.
//! That matters in a store at capacity, where every dump is paired with an
//! eviction: on ext4 a delete frees extents (a discard on `-o discard`
//! mounts) and makes the following creates slow, because the inode
//! allocator skips the inodes freed in the last half minute by reading
//! their inode-table blocks (`recently_deleted`), which under a steady
//! evict/dump churn cost more than writing a 1 MiB shard. A recycled file
//! still holds its old block's bytes until overwritten; it is never
//! published before every shard is written, so those bytes are never read
//! as a block.
//!
//! Spares live in the store instance's work directory under each root
//! (`<root>/.work/<token>/spare.<n>`, see [`super::work`]): the same file
//! system as the block directories, so the publishing rename stays atomic.
//! They outlive a clean close: the next instance adopts them (a restart
//! keeps its pool instead of deleting and recreating it). Each is checked
//! (see [`super::files::Opener::reuse`]) when it is taken for a block.
//!
//! Spares take disk space like blocks, so the pool counts the bytes of its
//! files ([`SparePool::bytes`]) and, in a store with a capacity, holds at
//! most a byte budget of them (a share of the capacity): the evictor counts
//! them with the blocks, so blocks and spares together stay within the
//! capacity.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use super::work::SPARE_PREFIX;

/// Free bytes a file system must keep for spares to be preallocated.
pub const PREALLOC_MIN_FREE: u64 = 2 << 30;

/// Most bytes of preallocated spares per root; spares beyond it stay empty.
pub const PREALLOC_POOL_MAX: u64 = 256 << 20;

struct Root {
    dir: PathBuf,
    /// Each spare with its length when it joined the pool.
    files: Mutex<VecDeque<(PathBuf, u64)>>,
}

/// Spare temporary files per storage root.
pub struct SparePool {
    roots: Vec<Root>,
    target: usize,
    prealloc_len: u64,
    /// Most bytes the spares may take together (`u64::MAX`: no limit).
    max_bytes: u64,
    /// Bytes the spares take now.
    bytes: AtomicU64,
    seq: AtomicU64,
    stop: AtomicBool,
    wake: (Mutex<bool>, Condvar),
}

impl SparePool {
    /// A pool keeping `target` spares in each of `dirs` (the instance's
    /// work directory of each root; `target == 0` disables it),
    /// preallocated to `prealloc_len` bytes where there is room (0: always
    /// empty).
    pub fn new(dirs: &[PathBuf], target: usize, prealloc_len: u64) -> Self {
        SparePool {
            roots: dirs
                .iter()
                .map(|d| Root {
                    dir: d.clone(),
                    files: Mutex::new(VecDeque::new()),
                })
                .collect(),
            target,
            prealloc_len,
            max_bytes: u64::MAX,
            bytes: AtomicU64::new(0),
            seq: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            wake: (Mutex::new(false), Condvar::new()),
        }
    }

    /// The same pool holding at most `max_bytes` bytes of spares: beyond
    /// them, new spares stay empty and evicted files are not kept.
    pub fn with_max_bytes(mut self, max_bytes: u64) -> Self {
        self.max_bytes = max_bytes;
        self
    }

    /// Bytes the spare files take (their lengths), all roots together.
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    /// Reserves `len` bytes of the budget; false when they do not fit.
    fn charge(&self, len: u64) -> bool {
        self.bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |b| {
                b.checked_add(len).filter(|n| *n <= self.max_bytes)
            })
            .is_ok()
    }

    fn release(&self, len: u64) {
        let _ = self
            .bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |b| {
                Some(b.saturating_sub(len))
            });
    }

    /// True when the pool keeps spares at all.
    pub fn enabled(&self) -> bool {
        self.target > 0
    }

    /// Adds spare files adopted from a dead instance (see
    /// [`super::work::reclaim`]) to root `root`'s pool; those beyond the
    /// byte budget are removed. Returns how many were kept.
    pub fn adopt(&self, root: usize, files: Vec<PathBuf>) -> usize {
        let mut kept = 0;
        for f in files {
            let len = file_len(&f);
            match self.roots.get(root) {
                Some(r) if self.charge(len) => {
                    r.files.lock().push_back((f, len));
                    kept += 1;
                }
                _ => {
                    let _ = std::fs::remove_file(f);
                }
            }
        }
        kept
    }

    /// The most spares a root may hold, adopted or recycled ones included.
    pub fn capacity(&self) -> usize {
        self.recycle_cap()
    }

    /// Takes a spare file under root `root` (its index), if one is ready.
    pub fn take(&self, root: usize) -> Option<PathBuf> {
        let r = self.roots.get(root)?;
        let (path, len) = r.files.lock().pop_front()?;
        self.release(len);
        let (lock, cv) = &self.wake;
        *lock.lock() = true;
        cv.notify_one();
        Some(path)
    }

    /// Most spares a root may hold through recycling: the filler's target,
    /// or as many full block files as fit the preallocation byte budget,
    /// up to four times the target.
    fn recycle_cap(&self) -> usize {
        let by_bytes = PREALLOC_POOL_MAX
            .checked_div(self.prealloc_len)
            .unwrap_or(0) as usize;
        by_bytes.clamp(self.target, self.target.saturating_mul(4))
    }

    /// Makes room in root `root`'s pool for a block file of `len` bytes
    /// that is about to be evicted: charges its bytes and returns true, or
    /// returns false when the pool is disabled or full. Charged before the
    /// block leaves the index, so the file counts in one or the other
    /// throughout the move; [`SparePool::recycle`] completes it, or
    /// [`SparePool::unreserve`] gives the bytes back.
    pub fn reserve(&self, root: usize, len: u64) -> bool {
        if !self.enabled() || self.prealloc_len == 0 {
            return false;
        }
        let Some(r) = self.roots.get(root) else {
            return false;
        };
        if r.files.lock().len() >= self.recycle_cap() {
            return false;
        }
        self.charge(len)
    }

    /// Gives back the bytes of a [`SparePool::reserve`] whose block stayed.
    pub fn unreserve(&self, len: u64) {
        self.release(len);
    }

    /// Renames an evicted block file, reserved with [`SparePool::reserve`]
    /// at `len` bytes, into root `root`'s spare directory and returns true;
    /// or returns false (the caller deletes it) when the rename fails.
    pub fn recycle(&self, root: usize, file: &Path, len: u64) -> bool {
        let Some(r) = self.roots.get(root) else {
            self.release(len);
            return false;
        };
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let spare = r.dir.join(format!("{SPARE_PREFIX}r{seq}"));
        if std::fs::rename(file, &spare).is_err() {
            self.release(len);
            return false;
        }
        let mut files = r.files.lock();
        if files.len() >= self.recycle_cap() {
            drop(files);
            self.release(len);
            let _ = std::fs::remove_file(&spare);
        } else {
            // Recycled files are whole block files: hand them out first.
            files.push_front((spare, len));
        }
        true
    }

    /// Returns a spare taken with [`SparePool::take`] but not used (the
    /// block it was for turned out to be written by someone else).
    pub fn put_back(&self, root: usize, file: PathBuf) {
        let len = file_len(&file);
        match self.roots.get(root) {
            Some(r) if self.charge(len) => r.files.lock().push_front((file, len)),
            _ => {
                let _ = std::fs::remove_file(file);
            }
        }
    }

    /// Number of spares ready (all roots).
    #[cfg(test)]
    pub fn ready(&self) -> usize {
        self.roots.iter().map(|r| r.files.lock().len()).sum()
    }

    /// Spares missing from the filler's target, all roots together.
    pub fn deficit(&self) -> usize {
        self.roots
            .iter()
            .map(|r| self.target.saturating_sub(r.files.lock().len()))
            .sum()
    }

    /// The pool's target per root (0: disabled).
    pub fn target(&self) -> usize {
        self.target
    }

    /// The filler loop; returns when [`SparePool::stop`] is called. It
    /// creates a spare only while `may_create()` holds (a store at capacity
    /// refills the pool by recycling evicted files instead).
    pub fn run(&self, may_create: impl Fn() -> bool) {
        if !self.enabled() {
            return;
        }
        while !self.stop.load(Ordering::Acquire) {
            let mut made = false;
            for r in &self.roots {
                let ready = r.files.lock().len();
                if ready < self.target && may_create() {
                    if let Some(spare) = self.create(&r.dir, ready) {
                        r.files.lock().push_back(spare);
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

    /// Creates one spare (its path and length); `ready` spares are already
    /// waiting in `dir`.
    fn create(&self, dir: &Path, ready: usize) -> Option<(PathBuf, u64)> {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let path = dir.join(format!("{SPARE_PREFIX}{seq}"));
        let file = super::files::Opener::new(false, false)
            .create(&path)
            .ok()?
            .file;
        let within_budget = (ready as u64).saturating_mul(self.prealloc_len) < PREALLOC_POOL_MAX;
        if self.prealloc_len > 0
            && within_budget
            && self.room_for_prealloc(dir)
            && self.charge(self.prealloc_len)
        {
            if preallocate(&file, self.prealloc_len) {
                return Some((path, self.prealloc_len));
            }
            self.release(self.prealloc_len);
        }
        Some((path, 0))
    }

    fn room_for_prealloc(&self, dir: &Path) -> bool {
        let Some((free, total)) = free_and_total(dir) else {
            return false;
        };
        let pool = PREALLOC_POOL_MAX.min(self.prealloc_len.saturating_mul(self.target as u64));
        let floor = PREALLOC_MIN_FREE.max(total / 20);
        free > floor.saturating_add(pool)
    }

    /// Stops the filler loop.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        let (lock, cv) = &self.wake;
        *lock.lock() = true;
        cv.notify_all();
    }

    /// Removes the spares not taken (a store that must leave nothing).
    #[cfg(test)]
    pub fn discard(&self) {
        for r in &self.roots {
            for (p, len) in r.files.lock().drain(..) {
                self.release(len);
                let _ = std::fs::remove_file(p);
            }
        }
    }
}

/// Free and total bytes of the file system holding `dir`.
fn free_and_total(dir: &Path) -> Option<(u64, u64)> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: `c` is a valid NUL-terminated path and `st` a writable,
    // properly sized statvfs the call fills in.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return None;
    }
    let frsize = st.f_frsize as u64;
    Some((
        (st.f_bavail as u64).saturating_mul(frsize),
        (st.f_blocks as u64).saturating_mul(frsize),
    ))
}

/// Best effort: a file system without `fallocate` keeps the spare empty
/// (false).
fn preallocate(file: &std::fs::File, len: u64) -> bool {
    use std::os::fd::AsRawFd;
    let Ok(len) = libc::off_t::try_from(len) else {
        return false;
    };
    // SAFETY: plain syscall on a descriptor owned by `file`.
    let r = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len) };
    if r != 0 {
        let _ = file.set_len(0);
    }
    r == 0
}

/// A spare's length (0 if it can't be read: it is checked when taken).
fn file_len(path: &Path) -> u64 {
    std::fs::symlink_metadata(path).map_or(0, |m| m.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn fills_hands_out_and_discards() {
        let d = tempfile::tempdir().unwrap();
        let pool = Arc::new(SparePool::new(&[d.path().to_path_buf()], 3, 0));
        let filler = {
            let p = pool.clone();
            std::thread::spawn(move || p.run(|| true))
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while pool.ready() < 3 && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(pool.ready(), 3);
        let f = pool.take(0).unwrap();
        assert!(f.starts_with(d.path()));
        assert_eq!(std::fs::metadata(&f).unwrap().len(), 0);
        assert!(pool.take(1).is_none());
        pool.stop();
        filler.join().unwrap();
        pool.discard();
        let left: Vec<_> = std::fs::read_dir(d.path()).unwrap().collect();
        assert_eq!(left.len(), 1); // only the one we took
    }

    #[test]
    fn recycles_block_files_up_to_the_cap() {
        let d = tempfile::tempdir().unwrap();
        let len = 64 << 20;
        let spares = d.path().join("spares");
        std::fs::create_dir(&spares).unwrap();
        let pool = SparePool::new(std::slice::from_ref(&spares), 2, len);
        // 256 MiB budget / 64 MiB files = 4 = cap (between 2 and 8).
        assert_eq!(pool.recycle_cap(), 4);
        let mut taken = Vec::new();
        for i in 0..5 {
            let f = d.path().join(format!("block{i}"));
            std::fs::write(&f, [i as u8; 100]).unwrap();
            let kept = pool.reserve(0, 100) && pool.recycle(0, &f, 100);
            assert_eq!(kept, i < 4, "file {i}");
            assert_eq!(f.exists(), !kept, "file {i}");
        }
        assert_eq!(pool.ready(), 4);
        while let Some(p) = pool.take(0) {
            assert!(p.starts_with(&spares));
            taken.push(std::fs::read(&p).unwrap()[0]);
        }
        // The last recycled is handed out first; contents are the old ones.
        assert_eq!(taken, vec![3, 2, 1, 0]);
        assert_eq!(pool.bytes(), 0, "taken spares leave the budget");
        assert!(!pool.reserve(1, 100), "no such root");
        assert!(pool.reserve(0, 100));
        pool.unreserve(100);
        assert_eq!(pool.bytes(), 0);
        let off = SparePool::new(std::slice::from_ref(&spares), 0, len);
        assert!(!off.reserve(0, 100), "pool disabled");
    }

    #[test]
    fn preallocates_within_budget_when_there_is_room() {
        let d = tempfile::tempdir().unwrap();
        let len = 1 << 20;
        let pool = SparePool::new(&[d.path().to_path_buf()], 4, len);
        let dir = d.path().to_path_buf();
        let room = pool.room_for_prealloc(&dir);
        let (first, first_len) = pool.create(&dir, 0).unwrap();
        let expect = if room { len } else { 0 };
        assert_eq!(std::fs::metadata(&first).unwrap().len(), expect);
        assert_eq!((first_len, pool.bytes()), (expect, expect));
        // Past the byte budget, spares stay empty whatever the room.
        let over = (PREALLOC_POOL_MAX / len) as usize;
        let (late, _) = pool.create(&dir, over).unwrap();
        assert_eq!(std::fs::metadata(&late).unwrap().len(), 0);
    }
}
