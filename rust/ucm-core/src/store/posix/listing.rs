//! Which block directories the index has read, and how it stays current
//! with what other processes publish and remove there.
//!
//! A store indexes its directories lazily: a lookup that reaches a block
//! directory the index has not read yet lists it then (names only, no
//! `stat`), while a background pass lists the rest (see `open`). So a store
//! over a million blocks answers its first lookup in the time it takes to
//! list the directories that lookup needs, not to scan them all.
//!
//! Before a directory is listed, an inotify watch is put on it: from then
//! on every block another process publishes or removes there is an event.
//! A lookup that misses first reads the events queued so far (one
//! non-blocking `read`), so a block another store published before the
//! lookup began is found, and an absent block costs no system call at all.
//! Where a directory can't be watched (NFS, where other hosts' changes
//! raise no event; inotify unavailable or out of watches), a miss is
//! checked on disk as before (one `stat`, or one listing when a lookup
//! misses many blocks of the directory).

use std::collections::HashMap;
use std::ffi::CStr;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};

use parking_lot::{Mutex, RwLock};
use rustix::fs::inotify::{self, CreateFlags, ReadFlags, WatchFlags};

use super::files::Dir;
use super::index::Index;
use super::tree::Tree;
use crate::block::BlockId;

/// A directory's state: not read yet.
const UNLISTED: u8 = 0;
/// Read, and watched: the index knows all of it.
const WATCHED: u8 = 1;
/// Read, but not watched: a miss must still be checked on disk.
const POLLED: u8 = 2;

/// A block directory: the root's index and its byte.
type Bucket = (usize, u8);

/// The inotify instance and which watch is which directory.
struct Watch {
    fd: OwnedFd,
    buckets: RwLock<HashMap<i32, Bucket>>,
    /// One reader of the events at a time, so they apply in order.
    reading: Mutex<()>,
}

/// What the index has read of each block directory of each root.
pub struct Listing {
    state: Vec<[AtomicU8; 256]>,
    /// One lister per directory at a time.
    listing: Vec<[Mutex<()>; 256]>,
    watch: Option<Watch>,
    /// Roots whose changes raise no event here (NFS).
    unwatchable: Vec<bool>,
    /// Changes handed over so far, by any caller of [`Listing::catch_up`].
    handed: AtomicU64,
    /// Directories read into the index so far, by any caller of
    /// [`Listing::ensure`].
    reads: AtomicU64,
}

/// What listing a block directory found besides its blocks.
#[derive(Debug, Default)]
pub struct Listed {
    /// Blocks (regular files, or of unknown type, at block names).
    pub blocks: Vec<BlockId>,
    /// Entries at block names that are not regular files (links, FIFOs...).
    pub foreign: Vec<std::ffi::OsString>,
    /// Other names (temporaries of older versions, unknown files).
    pub other: Vec<std::ffi::OsString>,
}

/// Lists block directory `dir`: names and types only, never a `stat`.
pub fn list_dir(dir: &Dir) -> Listed {
    let mut out = Listed::default();
    for e in dir.entries().into_iter().flatten() {
        match BlockId::from_hex(&e.name.to_string_lossy()) {
            Some(id) => match e.kind {
                None | Some(rustix::fs::FileType::RegularFile) => out.blocks.push(id),
                Some(_) => out.foreign.push(e.name),
            },
            None => out.other.push(e.name),
        }
    }
    out
}

impl Listing {
    /// The state of `roots` roots, none read yet; watched where possible.
    pub fn new(tree: &Tree) -> Self {
        let watch = match inotify::init(CreateFlags::NONBLOCK | CreateFlags::CLOEXEC) {
            Ok(fd) => Some(Watch {
                fd,
                buckets: RwLock::new(HashMap::new()),
                reading: Mutex::new(()),
            }),
            Err(e) => {
                log::info!(
                    "posix store: no inotify instance ({e}); lookups that miss check the disk"
                );
                None
            }
        };
        let roots = tree.root_count();
        Listing {
            state: (0..roots)
                .map(|_| std::array::from_fn(|_| AtomicU8::new(UNLISTED)))
                .collect(),
            listing: (0..roots)
                .map(|_| std::array::from_fn(|_| Mutex::new(())))
                .collect(),
            watch,
            unwatchable: (0..roots).map(|i| tree.root(i).on_nfs()).collect(),
            handed: AtomicU64::new(0),
            reads: AtomicU64::new(0),
        }
    }

    /// True when the index knows every block of `bucket`: read and watched.
    pub fn complete(&self, (root, b): Bucket) -> bool {
        self.state[root][usize::from(b)].load(Ordering::Acquire) == WATCHED
    }

    /// True when `bucket` was read (watched or not).
    pub fn listed(&self, (root, b): Bucket) -> bool {
        self.state[root][usize::from(b)].load(Ordering::Acquire) != UNLISTED
    }

    /// Reads `bucket` into the index unless it was read already: its
    /// blocks join as found (the coldest, undated), after a watch is put on
    /// the directory so that nothing published meanwhile is missed. Returns
    /// what the listing found (None when it was read before, or the
    /// directory can't be opened).
    pub fn ensure(
        &self,
        tree: &Tree,
        index: &Index,
        moves: &Mutex<()>,
        bucket: Bucket,
    ) -> Option<Listed> {
        if self.listed(bucket) {
            return None;
        }
        let (root, b) = bucket;
        let _one = self.listing[root][usize::from(b)].lock();
        if self.listed(bucket) {
            return None;
        }
        let dir = tree.bucket_at(root, b).ok()?;
        let watched = self.add_watch(&dir, bucket);
        // An eviction moving a file away waits, or is done: what is indexed
        // is what the directory holds (see `moves`).
        let moves = moves.lock();
        let listed = list_dir(&dir);
        index.insert_found(&listed.blocks);
        drop(moves);
        let state = if watched { WATCHED } else { POLLED };
        // Counted before the state says so: a lookup that sees the
        // directory complete also sees that it was read since it began.
        self.reads.fetch_add(1, Ordering::AcqRel);
        self.state[root][usize::from(b)].store(state, Ordering::Release);
        Some(listed)
    }

    fn add_watch(&self, dir: &Dir, bucket: Bucket) -> bool {
        let Some(w) = &self.watch else {
            return false;
        };
        if self.unwatchable[bucket.0] {
            return false;
        }
        // The directory this store opened, not whatever its name leads to
        // now: the kernel resolves the descriptor's own entry.
        let path = format!("/proc/self/fd/{}", dir.as_fd().as_raw_fd());
        // A file written in place (not published by a rename, as ucm does)
        // is looked at again when its writer closes it.
        let flags = WatchFlags::CREATE
            | WatchFlags::CLOSE_WRITE
            | WatchFlags::MOVED_TO
            | WatchFlags::DELETE
            | WatchFlags::MOVED_FROM
            | WatchFlags::DELETE_SELF
            | WatchFlags::MOVE_SELF
            | WatchFlags::ONLYDIR;
        match inotify::add_watch(&w.fd, path.as_str(), flags) {
            Ok(wd) => {
                w.buckets.write().insert(wd, bucket);
                true
            }
            Err(e) => {
                log::debug!("no watch on {}: {e}", dir.path().display());
                false
            }
        }
    }

    /// Hands each block name changed since the last call to `changed`
    /// (which looks at what is there now: the events only say where to
    /// look, so their order and age don't matter). Returns once no event is
    /// queued (one system call when there is none), or at once where
    /// nothing is watched: how many changes it handed over. A call waits
    /// for one in progress, so everything queued before it began is handed
    /// over when it returns.
    pub fn catch_up(&self, mut changed: impl FnMut(BlockId)) -> usize {
        let Some(w) = &self.watch else {
            return 0;
        };
        let _reading = w.reading.lock();
        let mut buf = [MaybeUninit::<u8>::uninit(); 16 << 10];
        let mut reader = inotify::Reader::new(&w.fd, &mut buf);
        let mut handed = 0;
        loop {
            let event = match reader.next() {
                Ok(ev) => ev,
                Err(_) => return handed, // EAGAIN: nothing more queued
            };
            let flags = event.events();
            if flags.contains(ReadFlags::QUEUE_OVERFLOW) {
                log::warn!(
                    "posix store: too many changes to follow one by one; \
                     reading the block directories again"
                );
                self.forget_all(w);
                continue;
            }
            let Some(bucket) = w.buckets.read().get(&event.wd()).copied() else {
                continue;
            };
            if flags.intersects(ReadFlags::IGNORED | ReadFlags::DELETE_SELF | ReadFlags::MOVE_SELF)
            {
                // The directory went (or moved away): read it again when
                // it is needed.
                w.buckets.write().remove(&event.wd());
                self.state[bucket.0][usize::from(bucket.1)].store(UNLISTED, Ordering::Release);
                continue;
            }
            if flags.contains(ReadFlags::ISDIR) {
                continue;
            }
            if let Some(id) = event.file_name().and_then(block_id_of) {
                changed(id);
                handed += 1;
                self.handed.fetch_add(1, Ordering::AcqRel);
            }
        }
    }

    /// Changes handed over so far by every caller of [`Listing::catch_up`]:
    /// a lookup that read the index before another thread applied a change
    /// sees this grow.
    pub fn changes_seen(&self) -> u64 {
        self.handed.load(Ordering::Acquire)
    }

    /// Directories read into the index so far by every caller of
    /// [`Listing::ensure`]: a lookup that read the index before another
    /// thread (the background pass) read a directory sees this grow.
    pub fn reads_done(&self) -> u64 {
        self.reads.load(Ordering::Acquire)
    }

    /// Waits (at most `timeout`) for a change to be queued; true if one is.
    pub fn wait(&self, timeout: std::time::Duration) -> bool {
        let Some(w) = &self.watch else {
            std::thread::sleep(timeout);
            return false;
        };
        let mut fds = [rustix::event::PollFd::new(
            &w.fd,
            rustix::event::PollFlags::IN,
        )];
        let ts = rustix::event::Timespec {
            tv_sec: timeout.as_secs() as _,
            tv_nsec: timeout.subsec_nanos() as _,
        };
        rustix::event::poll(&mut fds, Some(&ts)).is_ok_and(|n| n > 0)
    }

    /// After the event queue overflowed: every directory must be read
    /// again (what the index holds stays until then).
    fn forget_all(&self, w: &Watch) {
        for roots in &self.state {
            for s in roots {
                s.store(UNLISTED, Ordering::Release);
            }
        }
        let wds: Vec<i32> = w.buckets.write().drain().map(|(wd, _)| wd).collect();
        for wd in wds {
            let _ = inotify::remove_watch(&w.fd, wd);
        }
    }
}

fn block_id_of(name: &CStr) -> Option<BlockId> {
    BlockId::from_hex(name.to_str().ok()?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::posix::tree::temp_tree;

    #[test]
    fn a_watched_directory_follows_other_processes() {
        let (d, tree) = temp_tree();
        let index = Index::new(1);
        let listing = Listing::new(&tree);
        let moves = Mutex::new(());
        let a = BlockId([0x5a; 16]);
        let b = BlockId({
            let mut b = [0x5a; 16];
            b[15] = 1;
            b
        });
        std::fs::write(tree.block_path(&a), b"x").unwrap();
        let bucket = (0, 0x5a);
        assert!(!listing.listed(bucket));
        let found = listing.ensure(&tree, &index, &moves, bucket).unwrap();
        assert_eq!(found.blocks, vec![a]);
        assert!(
            listing.complete(bucket),
            "tmpfs and local disks are watched"
        );
        assert!(index.contains(&a));
        assert!(
            listing.ensure(&tree, &index, &moves, bucket).is_none(),
            "read once"
        );
        // Published and removed by "another process".
        assert!(!listing.wait(std::time::Duration::from_millis(1)));
        std::fs::write(d.path().join("b"), b"y").unwrap();
        std::fs::rename(d.path().join("b"), tree.block_path(&b)).unwrap();
        std::fs::remove_file(tree.block_path(&a)).unwrap();
        assert!(listing.wait(std::time::Duration::from_secs(5)));
        let mut changed = Vec::new();
        assert_eq!(listing.catch_up(|id| changed.push(id)), 2);
        assert_eq!(changed, vec![b, a]);
        // The directory replaced: read again on the next need.
        std::fs::remove_file(tree.block_path(&b)).unwrap();
        std::fs::remove_dir(d.path().join("5a")).unwrap();
        listing.catch_up(|_| {});
        assert!(!listing.listed(bucket));
    }

    #[test]
    fn listing_tells_blocks_from_the_rest() {
        let (d, tree) = temp_tree();
        let id = BlockId([0x11; 16]);
        std::fs::write(tree.block_path(&id), b"x").unwrap();
        let dir = d.path().join("11");
        std::os::unix::fs::symlink("/etc/passwd", dir.join("22".repeat(16))).unwrap();
        std::fs::write(dir.join("notes"), b"").unwrap();
        let l = list_dir(&tree.bucket(&id).unwrap());
        assert_eq!(l.blocks, vec![id]);
        assert_eq!((l.foreign.len(), l.other.len()), (1, 1));
    }
}
