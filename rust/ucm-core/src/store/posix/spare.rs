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
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use super::files::{Dir, Opener};
use super::usage::{Part, Usage};
use super::work::{WorkDirs, SPARE_PREFIX};

/// Free bytes a file system must keep for spares to be preallocated.
pub const PREALLOC_MIN_FREE: u64 = 2 << 30;

/// Most bytes of preallocated spares per root; spares beyond it stay empty.
pub const PREALLOC_POOL_MAX: u64 = 256 << 20;

/// One root's spares: each by its name in the instance's work directory,
/// with its length when it joined the pool.
#[derive(Default)]
struct Root {
    files: Mutex<VecDeque<(String, u64)>>,
}

/// Spare temporary files per storage root.
pub struct SparePool {
    /// The instance's work directories (None: a pool that never holds
    /// files, as in a lookup-only store).
    work: Option<Arc<WorkDirs>>,
    usage: Arc<Usage>,
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
    /// A pool keeping `target` spares in each of the instance's work
    /// directories (`target == 0`, or no `work`, disables it), preallocated
    /// to `prealloc_len` bytes where there is room (0: always empty); every
    /// byte it adds to or removes from a root is counted in `usage`.
    pub fn new(
        work: Option<Arc<WorkDirs>>,
        usage: Arc<Usage>,
        roots: usize,
        target: usize,
        prealloc_len: u64,
    ) -> Self {
        SparePool {
            target: if work.is_some() { target } else { 0 },
            work,
            usage,
            roots: (0..roots).map(|_| Root::default()).collect(),
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

    /// Removes spare `name` of root `root` from the disk, and its bytes
    /// from the root's usage.
    fn delete(&self, root: usize, name: &str) {
        if let Some(work) = &self.work {
            let dir = work.dir(root);
            let _changing = self.usage.changing(root, &[Part::Work]);
            if let Ok(st) = dir.lstat(name) {
                if dir.remove_file(name).is_ok() && st.is_file() {
                    self.usage.add_to(root, Part::Work, -(st.len as i64));
                }
            }
        }
    }

    /// Adds spare files adopted from a dead instance (see
    /// [`super::work::reclaim`], which moved them into this instance's
    /// work directory) to root `root`'s pool; those beyond the byte budget
    /// are removed. Returns how many were kept.
    pub fn adopt(&self, root: usize, names: Vec<String>) -> usize {
        let mut kept = 0;
        for name in names {
            let len = self.len_of(root, &name);
            match self.roots.get(root) {
                Some(r) if self.charge(len) => {
                    r.files.lock().push_back((name, len));
                    kept += 1;
                }
                _ => self.delete(root, &name),
            }
        }
        kept
    }

    /// The most spares a root may hold, adopted or recycled ones included.
    pub fn capacity(&self) -> usize {
        self.recycle_cap()
    }

    /// Takes a spare file under root `root` (its index), if one is ready,
    /// renamed `temp` in the instance's work directory there: from then on
    /// it is a temporary, which the root's usage does not count (a block
    /// counts once published). Returns its length.
    pub fn take_as(&self, root: usize, temp: &str) -> Option<u64> {
        let r = self.roots.get(root)?;
        let work = self.work.as_ref()?;
        loop {
            let (name, len) = r.files.lock().pop_front()?;
            self.release(len);
            let (lock, cv) = &self.wake;
            *lock.lock() = true;
            cv.notify_one();
            let dir = work.dir(root);
            let _changing = self.usage.changing(root, &[Part::Work]);
            self.usage.add_to(root, Part::Work, -(len as i64));
            if dir.rename(&name, &dir, temp).is_ok() {
                return Some(len);
            }
            // Gone from under its name: the next one, if any.
            dir.remove_entry(&name);
        }
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

    /// A fresh name for a file entering root `root`'s work directory.
    pub fn fresh_name(&self, tag: &str) -> String {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        format!("{SPARE_PREFIX}{tag}{seq}")
    }

    /// Takes the file `name`, already moved into root `root`'s work
    /// directory and reserved with [`SparePool::reserve`] at `len` bytes,
    /// into the pool; when the pool filled up meanwhile, the file is
    /// deleted instead. The root's usage is unchanged by the move itself.
    pub fn recycled(&self, root: usize, name: String, len: u64) {
        let Some(r) = self.roots.get(root) else {
            self.release(len);
            self.delete(root, &name);
            return;
        };
        let mut files = r.files.lock();
        if files.len() >= self.recycle_cap() {
            drop(files);
            self.release(len);
            self.delete(root, &name);
        } else {
            // Recycled files are whole block files: hand them out first.
            files.push_front((name, len));
        }
    }

    /// Returns a spare taken with [`SparePool::take_as`] but not used (the
    /// block it was for turned out to be written by someone else): `temp`
    /// is renamed a spare again and counted again, or deleted when the pool
    /// has no room for it.
    pub fn put_back(&self, root: usize, temp: &str) {
        let Some(work) = self.work.as_ref() else {
            return;
        };
        let dir = work.dir(root);
        let len = dir.lstat(temp).map_or(0, |st| st.len);
        match self.roots.get(root) {
            Some(r) if self.charge(len) => {
                let name = self.fresh_name("b");
                let _changing = self.usage.changing(root, &[Part::Work]);
                if dir.rename(temp, &dir, &name).is_ok() {
                    self.usage.add_to(root, Part::Work, len as i64);
                    r.files.lock().push_front((name, len));
                } else {
                    self.release(len);
                    dir.remove_entry(temp);
                }
            }
            _ => dir.remove_entry(temp),
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
            for (i, r) in self.roots.iter().enumerate() {
                let ready = r.files.lock().len();
                if ready < self.target && may_create() {
                    if let Some(spare) = self.create(i, ready) {
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

    /// Creates one spare in root `root` (its name and length); `ready`
    /// spares are already waiting there.
    fn create(&self, root: usize, ready: usize) -> Option<(String, u64)> {
        let work = self.work.as_ref()?;
        let dir = work.dir(root);
        let name = self.fresh_name("");
        let file = Opener::new(false, false).create(&dir, &name).ok()?.file;
        let within_budget = (ready as u64).saturating_mul(self.prealloc_len) < PREALLOC_POOL_MAX;
        if self.prealloc_len > 0
            && within_budget
            && self.room_for_prealloc(&dir)
            && self.charge(self.prealloc_len)
        {
            let _changing = self.usage.changing(root, &[Part::Work]);
            if preallocate(&file, self.prealloc_len) {
                self.usage
                    .add_to(root, Part::Work, self.prealloc_len as i64);
                return Some((name, self.prealloc_len));
            }
            self.release(self.prealloc_len);
        }
        Some((name, 0))
    }

    fn room_for_prealloc(&self, dir: &Dir) -> bool {
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
        for (i, r) in self.roots.iter().enumerate() {
            let names: Vec<_> = r.files.lock().drain(..).collect();
            for (name, len) in names {
                self.release(len);
                self.delete(i, &name);
            }
        }
    }

    /// A spare's length (0 if it can't be read: it is checked when taken).
    fn len_of(&self, root: usize, name: &str) -> u64 {
        self.work
            .as_ref()
            .and_then(|w| w.dir(root).lstat(name).ok())
            .map_or(0, |st| st.len)
    }
}

/// Free and total bytes of the file system holding `dir`.
fn free_and_total(dir: &Dir) -> Option<(u64, u64)> {
    let st = rustix::fs::fstatvfs(dir).ok()?;
    let frsize = st.f_frsize;
    Some((
        st.f_bavail.saturating_mul(frsize),
        st.f_blocks.saturating_mul(frsize),
    ))
}

/// Best effort: a file system without `fallocate` keeps the spare empty
/// (false).
fn preallocate(file: &std::fs::File, len: u64) -> bool {
    let ok = rustix::fs::fallocate(file, rustix::fs::FallocateFlags::empty(), 0, len).is_ok();
    if !ok {
        let _ = file.set_len(0);
    }
    ok
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::posix::tree::Tree;

    /// A pool over a new store tree, its work directories and usage.
    fn pool(target: usize, len: u64) -> (tempfile::TempDir, Arc<WorkDirs>, Arc<Usage>, SparePool) {
        let d = tempfile::tempdir().unwrap();
        let tree = Tree::open(&[d.path().to_path_buf()], true, false).unwrap();
        let work = Arc::new(WorkDirs::create(&tree).unwrap());
        let usage = Arc::new(Usage::open(&tree).unwrap());
        let pool = SparePool::new(Some(work.clone()), usage.clone(), 1, target, len);
        (d, work, usage, pool)
    }

    #[test]
    fn fills_hands_out_and_discards() {
        let (_d, work, _usage, pool) = pool(3, 0);
        let pool = Arc::new(pool);
        let filler = {
            let p = pool.clone();
            std::thread::spawn(move || p.run(|| true))
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while pool.ready() < 3 && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(pool.ready(), 3);
        let len = pool.take_as(0, "t").unwrap();
        assert_eq!((work.dir(0).lstat("t").unwrap().len, len), (0, 0));
        assert!(pool.take_as(1, "u").is_none());
        pool.put_back(0, "t");
        assert_eq!(pool.ready(), 3);
        pool.take_as(0, "t").unwrap();
        pool.stop();
        filler.join().unwrap();
        pool.discard();
        let left: Vec<_> = work
            .dir(0)
            .entries()
            .unwrap()
            .into_iter()
            .filter(|e| e.name.to_string_lossy().starts_with(SPARE_PREFIX))
            .collect();
        assert_eq!(left.len(), 0, "only the one taken stays, as a temporary");
        assert!(work.dir(0).lstat("t").is_ok());
    }

    #[test]
    fn recycles_block_files_up_to_the_cap() {
        let len = 64 << 20;
        let (_d, work, usage, pool) = pool(2, len);
        // 256 MiB budget / 64 MiB files = 4 = cap (between 2 and 8).
        assert_eq!(pool.recycle_cap(), 4);
        let dir = work.dir(0);
        for i in 0..5u8 {
            dir.create_file(format!("block{i}"), 0o600, rustix::fs::OFlags::empty())
                .unwrap();
            std::fs::write(dir.join(format!("block{i}")), [i; 100]).unwrap();
            usage.add_to(0, Part::Bucket(0), 100);
            let kept = pool.reserve(0, 100);
            assert_eq!(kept, i < 4, "file {i}");
            if kept {
                let name = pool.fresh_name("r");
                dir.rename(format!("block{i}"), &dir, &name).unwrap();
                pool.recycled(0, name, 100);
            }
        }
        assert_eq!(pool.ready(), 4);
        assert_eq!(usage.bytes(), 500, "moving files counts nothing");
        let mut taken = Vec::new();
        while pool.take_as(0, "t").is_some() {
            taken.push(std::fs::read(dir.join("t")).unwrap()[0]);
            std::fs::remove_file(dir.join("t")).unwrap();
        }
        // The last recycled is handed out first; contents are the old ones.
        assert_eq!(taken, vec![3, 2, 1, 0]);
        assert_eq!(pool.bytes(), 0, "taken spares leave the budget");
        assert_eq!(usage.bytes(), 100, "and the count: a temporary is not");
        assert!(!pool.reserve(1, 100), "no such root");
        assert!(pool.reserve(0, 100));
        pool.unreserve(100);
        assert_eq!(pool.bytes(), 0);
        let off = SparePool::new(Some(work.clone()), usage.clone(), 1, 0, len);
        assert!(!off.reserve(0, 100), "pool disabled");
    }

    #[test]
    fn preallocates_within_budget_when_there_is_room() {
        let len = 1 << 20;
        let (_d, work, usage, pool) = pool(4, len);
        let room = pool.room_for_prealloc(&work.dir(0));
        let (first, first_len) = pool.create(0, 0).unwrap();
        let expect = if room { len } else { 0 };
        assert_eq!(work.dir(0).lstat(&first).unwrap().len, expect);
        assert_eq!((first_len, pool.bytes()), (expect, expect));
        assert_eq!(usage.bytes(), expect, "the root's usage counts it");
        // Past the byte budget, spares stay empty whatever the room.
        let over = (PREALLOC_POOL_MAX / len) as usize;
        let (late, _) = pool.create(0, over).unwrap();
        assert_eq!(work.dir(0).lstat(&late).unwrap().len, 0);
    }
}
