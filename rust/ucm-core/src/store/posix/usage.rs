//! The bytes a store directory holds, counted together by every store that
//! writes there, so that a capacity bounds the directory rather than each
//! store's share of it (vLLM's workers and several engines share one).
//!
//! Each root keeps one small record, `<root>/.ucm-usage`: the bytes of the
//! block files and of the files in the work directories (spares), as their
//! lengths add up. A store adds what each of its changes adds or removes
//! (a block published, a file deleted, a spare preallocated), under an
//! `flock` of the record; moving a file (a block recycled as a spare, a
//! spare published as a block) changes nothing. A store that opens sets
//! the record to what its scan of the directory counted, which also
//! repairs what killed processes left uncounted; so does the evictor of a
//! store that finds the record unreadable or cannot bring the directory
//! under its capacity with the blocks it knows.
//!
//! A record starts "not counted": the first store to read every block
//! directory after it was made (or found damaged) counts it, so a directory
//! that held blocks before its record existed is counted whole. One store
//! counts a root at a time (`<root>/.ucm-usage.lock`), and its count
//! corrects the record rather than replace it: what the other stores added
//! while it counted stays in.
//!
//! Never a wait: a change that finds the record locked (another store
//! is in the middle of its own change, or a stray process holds the lock)
//! is kept here and added with the next change that gets the lock.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};

use parking_lot::{Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};
use rustix::fs::{FlockOperation, Mode, OFlags};

use super::files::Dir;
use super::tree::Tree;
use crate::error::Result;
use crate::hashing::xxh3::xxh3_64;

/// The record's name under each root.
pub const USAGE_FILE: &str = ".ucm-usage";
/// The lock a store holds while it counts a root.
pub const COUNT_LOCK_FILE: &str = ".ucm-usage.lock";
const MAGIC: &[u8; 8] = b"UCMUSAGE";
const VERSION: u32 = 1;
const RECORD_LEN: usize = 32;
/// The record's count was set by a scan of the whole directory (and kept
/// up since): without it, the count covers only changes since it was made.
const COUNTED: u32 = 1;

/// One root's record.
struct RootUsage {
    /// The record (None: it could not be opened; this store counts alone).
    file: Option<File>,
    path: PathBuf,
    /// Changes not yet in the record.
    pending: AtomicI64,
    /// The record's value when last read or written.
    last: AtomicU64,
    /// Orders this process's threads: an `flock` is shared by every thread
    /// holding the same open file.
    local: Mutex<()>,
    /// Every change this store counted here, summed per [`Part`]: what a
    /// count of the directory taken meanwhile may have missed.
    own: Box<[AtomicI64; PARTS]>,
    /// A count to write over the record at the next chance.
    set_to: Mutex<Option<u64>>,
    /// The record is to be marked counted at the next write (a count's
    /// correction is pending).
    mark_counted: AtomicBool,
    /// The file one store at a time holds while it counts the root.
    count_lock: Option<File>,
    /// Per [`Part`]: held shared by this store's changes there (the file
    /// operation and its count together), exclusively by a scan reading
    /// the part, so that each change is either in what the scan reads or
    /// after it, never half of each.
    parts: Box<[RwLock<()>; PARTS]>,
}

impl RootUsage {
    /// A root's record with nothing counted yet by this store.
    fn new(file: Option<File>, path: PathBuf, count_lock: Option<File>) -> Self {
        RootUsage {
            file,
            path,
            pending: AtomicI64::new(0),
            last: AtomicU64::new(0),
            local: Mutex::new(()),
            own: Box::new(std::array::from_fn(|_| AtomicI64::new(0))),
            set_to: Mutex::new(None),
            mark_counted: AtomicBool::new(false),
            count_lock,
            parts: Box::new(std::array::from_fn(|_| RwLock::new(()))),
        }
    }
}

/// Where under a root bytes came or went: a block directory (its byte), or
/// the work directories (spares and temporaries).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    /// A block directory.
    Bucket(u8),
    /// The work directories.
    Work,
}

/// Parts of a root: 256 block directories and the work directories.
const PARTS: usize = 257;

impl Part {
    fn index(self) -> usize {
        match self {
            Part::Bucket(b) => usize::from(b),
            Part::Work => 256,
        }
    }
}

/// A count of one root's bytes by a scan that reads its parts one after
/// another (see [`Usage::start_count`]): for each part, what the scan found
/// there and what this store had changed there before the scan read it.
pub struct Count {
    root: usize,
    before: Vec<i64>,
    counted: Vec<u64>,
    /// The record when the count began, with this store's changes then.
    record_start: i64,
    /// This store's changes to the root, summed, when the count began.
    own_start: i64,
    /// Held (`flock`) while the count runs.
    lock: File,
}

impl Drop for Count {
    fn drop(&mut self) {
        // The lock belongs to the open file the store keeps: unlock it
        // explicitly, closing this handle of it would not.
        let _ = rustix::fs::flock(&self.lock, FlockOperation::Unlock);
    }
}

impl Count {
    /// Runs `read` of `part` while this store changes nothing there: its
    /// changes are then either in what `read` finds or counted after it.
    pub fn read<T>(&mut self, usage: &Usage, part: Part, read: impl FnOnce() -> T) -> T {
        let _alone = usage.reading(self.root, part);
        self.before[part.index()] = usage.own_in(self.root, part);
        read()
    }

    /// Bytes the scan found in `part`.
    pub fn found(&mut self, part: Part, bytes: u64) {
        self.counted[part.index()] += bytes;
    }
}

/// This store changing parts of a root (see [`Usage::changing`]).
pub struct Changing<'a>(#[allow(dead_code)] Vec<RwLockReadGuard<'a, ()>>);

/// The bytes under each root of a store, as every store writing there
/// counts them.
pub struct Usage {
    roots: Vec<RootUsage>,
    /// A record was found damaged, or new (nothing counted it yet): a scan
    /// should set it.
    stale: AtomicBool,
}

fn encode(bytes: u64, counted: bool) -> [u8; RECORD_LEN] {
    let mut r = [0u8; RECORD_LEN];
    r[..8].copy_from_slice(MAGIC);
    r[8..12].copy_from_slice(&VERSION.to_le_bytes());
    let flags = if counted { COUNTED } else { 0 };
    r[12..16].copy_from_slice(&flags.to_le_bytes());
    r[16..24].copy_from_slice(&bytes.to_le_bytes());
    let check = xxh3_64(&r[..24]);
    r[24..].copy_from_slice(&check.to_le_bytes());
    r
}

/// The record's value and whether a scan counted it; None when it is not
/// a record of this version (new, truncated, or written by something else).
fn decode(r: &[u8; RECORD_LEN]) -> Option<(u64, bool)> {
    let check = u64::from_le_bytes(r[24..].try_into().ok()?);
    let flags = u32::from_le_bytes(r[12..16].try_into().ok()?);
    (&r[..8] == MAGIC && r[8..12] == VERSION.to_le_bytes() && xxh3_64(&r[..24]) == check).then(
        || {
            (
                u64::from_le_bytes(r[16..24].try_into().unwrap_or_default()),
                flags & COUNTED != 0,
            )
        },
    )
}

/// Opens (or creates) the counting lock under `root` (see [`Count`]).
fn open_count_lock(root: &Dir) -> std::io::Result<File> {
    open_regular(root, COUNT_LOCK_FILE)
}

/// Opens (or creates) the record under `root`: a regular file, never
/// through a link (a link there is removed, the link itself).
fn open_record(root: &Dir) -> std::io::Result<File> {
    open_regular(root, USAGE_FILE)
}

/// Opens (or creates, 0600) the regular file `name` under `root`, never
/// through a link (a link there is removed, the link itself). Read-only:
/// `flock` needs no more, and a file kept open for writing would stop the
/// file system from being remounted read-only while the store runs (see
/// [`writable`]).
fn open_regular(root: &Dir, name: &str) -> std::io::Result<File> {
    let open = || {
        rustix::fs::openat(
            root,
            name,
            OFlags::RDONLY | OFlags::CREATE | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        )
        .map(File::from)
        .map_err(std::io::Error::from)
    };
    let file = match open() {
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            root.remove_file(name)?;
            open()?
        }
        r => r?,
    };
    let meta = file.metadata()?;
    if !meta.file_type().is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{} is not a regular file", root.join(name).display()),
        ));
    }
    Ok(file)
}

/// The file open as `file`, opened again for writing for one update: the
/// same inode (through `/proc/self/fd`, never a name someone could swap).
fn writable(file: &File) -> std::io::Result<File> {
    use std::os::fd::AsRawFd;
    std::fs::OpenOptions::new()
        .write(true)
        .open(format!("/proc/self/fd/{}", file.as_raw_fd()))
}

impl Usage {
    /// The records of every root of `tree`, created where missing. A root
    /// whose record can't be used is counted by this store alone (logged).
    pub fn open(tree: &Tree) -> Result<Self> {
        let roots = (0..tree.root_count())
            .map(|i| {
                let root = tree.root(i);
                let file = match open_record(root) {
                    Ok(f) => Some(f),
                    Err(e) => {
                        log::warn!(
                            "{}: {e}; this store counts its capacity alone under {}",
                            root.join(USAGE_FILE).display(),
                            root.path().display()
                        );
                        None
                    }
                };
                RootUsage::new(file, root.join(USAGE_FILE), open_count_lock(root).ok())
            })
            .collect();
        let usage = Usage {
            roots,
            stale: AtomicBool::new(false),
        };
        for i in 0..usage.roots.len() {
            usage.sync(i);
        }
        Ok(usage)
    }

    /// A usage that counts nothing (a store that never writes).
    pub fn none(roots: usize) -> Self {
        Usage {
            roots: (0..roots)
                .map(|_| RootUsage::new(None, PathBuf::new(), None))
                .collect(),
            stale: AtomicBool::new(false),
        }
    }

    /// Counts `delta` bytes more (or fewer) under root `root`, from a tool
    /// that runs no count of its own (the part matters to a count only).
    pub fn add(&self, root: usize, delta: i64) {
        self.add_to(root, Part::Work, delta);
    }

    /// Counts `delta` bytes more (or fewer) in `part` of root `root`.
    pub fn add_to(&self, root: usize, part: Part, delta: i64) {
        if delta == 0 {
            return;
        }
        if let Some(r) = self.roots.get(root) {
            r.own[part.index()].fetch_add(delta, Ordering::AcqRel);
            r.pending.fetch_add(delta, Ordering::AcqRel);
            self.sync(root);
        }
    }

    /// A file of `bytes` bytes moved between parts of root `root` (a block
    /// recycled as a spare, a spare published as a block): the root's count
    /// stays, the parts' change (a scan under way reads them one by one).
    pub fn moved(&self, root: usize, from: Part, to: Part, bytes: u64) {
        if let Some(r) = self.roots.get(root) {
            r.own[from.index()].fetch_sub(bytes as i64, Ordering::AcqRel);
            r.own[to.index()].fetch_add(bytes as i64, Ordering::AcqRel);
        }
    }

    /// Held around a change of `parts` of root `root`: the file operation
    /// and its [`Usage::add`] or [`Usage::moved`] (see `RootUsage::parts`).
    pub fn changing(&self, root: usize, parts: &[Part]) -> Changing<'_> {
        Changing(
            self.roots
                .get(root)
                // Recursive: a change may nest in another of the same part,
                // and must not wait behind the scan that waits for the outer.
                .map(|r| {
                    parts
                        .iter()
                        .map(|p| r.parts[p.index()].read_recursive())
                        .collect()
                })
                .unwrap_or_default(),
        )
    }

    fn reading(&self, root: usize, part: Part) -> Option<RwLockWriteGuard<'_, ()>> {
        self.roots.get(root).map(|r| r.parts[part.index()].write())
    }

    fn own_in(&self, root: usize, part: Part) -> i64 {
        self.roots
            .get(root)
            .map_or(0, |r| r.own[part.index()].load(Ordering::Acquire))
    }

    /// Begins a count of root `root` by a scan (see [`Count`]), unless
    /// another store is counting it (None: that one's count will do).
    pub fn start_count(&self, root: usize) -> Option<Count> {
        let r = self.roots.get(root)?;
        let lock = r.count_lock.as_ref()?.try_clone().ok()?;
        rustix::fs::flock(&lock, FlockOperation::NonBlockingLockExclusive).ok()?;
        // The record as it stands, with every change of ours in it.
        let record_start = (0..100).find_map(|_| {
            if self.sync(root) && r.pending.load(Ordering::Acquire) == 0 {
                Some(r.last.load(Ordering::Acquire) as i64)
            } else {
                std::thread::sleep(std::time::Duration::from_millis(10));
                None
            }
        })?;
        let before: Vec<i64> = (0..PARTS)
            .map(|p| r.own[p].load(Ordering::Acquire))
            .collect();
        Some(Count {
            root,
            own_start: before.iter().sum(),
            before,
            counted: vec![0; PARTS],
            record_start,
            lock,
        })
    }

    /// Corrects the root's record by what the count found: the bytes the
    /// scan read, plus what this store changed in each part after reading
    /// it, against the record when the count began and this store's
    /// changes since. Other stores' changes meanwhile stay in the record.
    /// Marks the record counted.
    pub fn finish_count(&self, count: Count) {
        let Some(r) = self.roots.get(count.root) else {
            return;
        };
        let mut found: i64 = 0;
        let mut own_now: i64 = 0;
        for p in 0..PARTS {
            let now = r.own[p].load(Ordering::Acquire);
            own_now = own_now.saturating_add(now);
            found = found
                .saturating_add(count.counted[p] as i64)
                .saturating_add(now - count.before[p]);
        }
        let correction = found - count.record_start - (own_now - count.own_start);
        r.pending.fetch_add(correction, Ordering::AcqRel);
        r.mark_counted.store(true, Ordering::Release);
        self.sync(count.root);
    }

    /// Sets root `root`'s count to `bytes` (what a scan counted): now, or
    /// with the next change that gets the record's lock.
    pub fn set(&self, root: usize, bytes: u64) {
        if let Some(r) = self.roots.get(root) {
            let _local = r.local.lock();
            r.pending.store(0, Ordering::Release);
            *r.set_to.lock() = Some(bytes);
            r.last.store(bytes, Ordering::Release);
        }
        self.sync(root);
    }

    /// Bytes under every root together, as last counted (with this store's
    /// changes not yet in a record).
    pub fn bytes(&self) -> u64 {
        (0..self.roots.len()).map(|i| self.root_bytes(i)).sum()
    }

    /// Bytes under root `root`.
    pub fn root_bytes(&self, root: usize) -> u64 {
        let Some(r) = self.roots.get(root) else {
            return 0;
        };
        self.sync(root);
        let last = r.last.load(Ordering::Acquire) as i64;
        last.saturating_add(r.pending.load(Ordering::Acquire))
            .max(0) as u64
    }

    /// True (once) when a record was found damaged, or not counted yet,
    /// since the last call: a scan should set it (see [`Usage::start_count`]).
    pub fn take_stale(&self) -> bool {
        self.stale.swap(false, Ordering::AcqRel)
    }

    /// Reads root `root`'s record and adds this store's pending changes to
    /// it (or first sets it, when a scan asked), under its lock; leaves
    /// everything pending when the lock is taken by someone else right now.
    /// True when the record was read and written.
    fn sync(&self, root: usize) -> bool {
        let r = &self.roots[root];
        let Some(_local) = r.local.try_lock() else {
            return false; // another thread of ours is at it: it takes our change too
        };
        let Some(file) = &r.file else {
            if let Some(v) = r.set_to.lock().take() {
                r.last.store(v, Ordering::Release);
            }
            let delta = r.pending.swap(0, Ordering::AcqRel);
            let value = (r.last.load(Ordering::Acquire) as i64).saturating_add(delta);
            r.last.store(value.max(0) as u64, Ordering::Release);
            return true;
        };
        if rustix::fs::flock(file, FlockOperation::NonBlockingLockExclusive).is_err() {
            return false;
        }
        let set = r.set_to.lock().take();
        let mut rec = [0u8; RECORD_LEN];
        let read = file.read_exact_at(&mut rec, 0);
        let (current, counted) = match (read, set) {
            (_, Some(v)) => (v, true),
            (Ok(()), None) => match decode(&rec) {
                Some(v) => v,
                None => (self.damaged(r, &rec), false),
            },
            // A new record (shorter than one): nothing counted yet.
            (Err(_), None) => (0, false),
        };
        let marking = r.mark_counted.swap(false, Ordering::AcqRel);
        let counted = counted || marking;
        self.stale.store(!counted, Ordering::Release);
        let delta = r.pending.swap(0, Ordering::AcqRel);
        let value = (current as i64).saturating_add(delta).max(0) as u64;
        let written = writable(file)
            .and_then(|w| w.write_all_at(&encode(value, counted), 0))
            .is_ok();
        if !written {
            r.pending.fetch_add(delta, Ordering::AcqRel);
            if let Some(v) = set {
                *r.set_to.lock() = Some(v);
            }
            if marking {
                r.mark_counted.store(true, Ordering::Release);
            }
        }
        r.last.store(value, Ordering::Release);
        let _ = rustix::fs::flock(file, FlockOperation::Unlock);
        written
    }

    /// A record that is not one: counted from zero until a scan sets it.
    fn damaged(&self, r: &RootUsage, rec: &[u8; RECORD_LEN]) -> u64 {
        if rec.iter().any(|b| *b != 0) && !self.stale.load(Ordering::Acquire) {
            log::warn!(
                "{} is damaged; counting the directory's bytes again",
                r.path.display()
            );
        }
        0
    }
}

impl std::fmt::Debug for Usage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Usage")
            .field("bytes", &self.bytes())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stores_on_one_directory_count_together() {
        let d = tempfile::tempdir().unwrap();
        let tree = |d: &tempfile::TempDir| Tree::open(&[d.path().to_path_buf()], true, false);
        let a = Usage::open(&tree(&d).unwrap()).unwrap();
        let b = Usage::open(&tree(&d).unwrap()).unwrap();
        // A new record asks every store for a count until one sets it.
        assert!(a.take_stale() && b.take_stale());
        let w = Part::Work;
        a.add_to(0, w, 100);
        b.add_to(0, w, 50);
        assert_eq!((a.bytes(), b.bytes()), (150, 150));
        b.add_to(0, w, -120);
        assert_eq!(a.bytes(), 30);
        a.set(0, 7);
        assert_eq!(b.bytes(), 7);
        // A count corrects the record: what this store changed in a part
        // after the count read it is added, what it changed before is in
        // what the count read, and what other stores changed meanwhile
        // stays.
        let mut count = a.start_count(0).unwrap();
        assert!(b.start_count(0).is_none(), "one count at a time");
        a.add_to(0, Part::Bucket(1), 1000); // before: the scan sees it
        count.read(&a, Part::Bucket(1), || ());
        count.found(Part::Bucket(1), 1000 + 4);
        a.add_to(0, Part::Bucket(1), 3); // after: the scan missed it
        b.add_to(0, Part::Bucket(9), 50); // another store, meanwhile
        a.add_to(0, Part::Bucket(2), 20); // before its part is read
        count.read(&a, Part::Bucket(2), || ());
        count.found(Part::Bucket(2), 20);
        // Moved out of a part the scan read into one it has not read yet:
        // found there once, not twice.
        a.moved(0, Part::Bucket(2), Part::Work, 20);
        count.read(&a, Part::Work, || ());
        count.found(Part::Work, 20);
        a.finish_count(count);
        assert_eq!(b.bytes(), 1004 + 3 + 20 + 50);
        assert!(!b.take_stale() || !a.take_stale() || b.bytes() > 0);
        a.set(0, 7);
        assert_eq!(b.bytes(), 7);
        // A change waits while its part is read.
        let shared = std::sync::Arc::new(Usage::open(&tree(&d).unwrap()).unwrap());
        let mut count = shared.start_count(0).unwrap();
        let (change, waited) = count.read(&shared, Part::Work, || {
            let s = shared.clone();
            let t = std::thread::spawn(move || {
                let _c = s.changing(0, &[Part::Work]);
            });
            std::thread::sleep(std::time::Duration::from_millis(50));
            let waited = !t.is_finished();
            (t, waited)
        });
        change.join().unwrap();
        assert!(waited);
        drop(count);
        // A change made while another process holds the lock waits here
        // and joins the next one.
        let other = File::open(d.path().join(USAGE_FILE)).unwrap();
        rustix::fs::flock(&other, FlockOperation::LockExclusive).unwrap();
        a.add_to(0, w, 10);
        assert_eq!(a.bytes(), 17, "its own change counts at once");
        assert_eq!(b.bytes(), 7, "the record has not changed");
        drop(other);
        a.add_to(0, w, 1);
        assert_eq!(b.bytes(), 18);
        // Counted by a scan (set): nothing more is asked.
        assert!(!a.take_stale());
        std::fs::write(d.path().join(USAGE_FILE), [0xff; 64]).unwrap();
        a.add_to(0, w, 5);
        assert!(a.take_stale());
        assert_eq!(b.bytes(), 5);
        // A link at the record's name is not followed.
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("f"), b"x").unwrap();
        std::fs::remove_file(d.path().join(USAGE_FILE)).unwrap();
        std::os::unix::fs::symlink(outside.path().join("f"), d.path().join(USAGE_FILE)).unwrap();
        let c = Usage::open(&tree(&d).unwrap()).unwrap();
        c.add_to(0, w, 3);
        assert_eq!(std::fs::read(outside.path().join("f")).unwrap(), b"x");
        assert_eq!(c.bytes(), 3);
    }
}
