//! The background thread of the Posix store: capacity eviction and the
//! clean-up of blocks whose assembly was abandoned.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::Shared;

/// Wake-up reasons for the thread.
#[derive(Default)]
pub(super) struct Signal {
    wake: bool,
    stop: bool,
}

/// How often the thread looks at the store even when nobody woke it.
const PERIOD: Duration = Duration::from_secs(5);
/// A dump that finds no spare at the capacity recycles cold blocks down to
/// this share of it, so the pool refills in batches.
pub(super) const LOW_WATERMARK: f64 = 0.9;

pub(super) fn spawn(shared: Arc<Shared>) -> crate::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("ucm-posix-evict".into())
        .spawn(move || run(&shared))
        .map_err(|e| crate::UcmError::os("spawn thread", "ucm-posix-evict", e))
}

pub(super) fn wake(shared: &Shared) {
    let (lock, cv) = &shared.evict_signal;
    lock.lock().wake = true;
    cv.notify_one();
}

pub(super) fn stop(shared: &Shared) {
    let (lock, cv) = &shared.evict_signal;
    lock.lock().stop = true;
    cv.notify_one();
}

fn run(shared: &Shared) {
    let mut last_beat = std::time::Instant::now();
    loop {
        {
            let (lock, cv) = &shared.evict_signal;
            let mut sig = lock.lock();
            if !sig.wake && !sig.stop {
                cv.wait_for(&mut sig, PERIOD);
            }
            if sig.stop {
                return;
            }
            sig.wake = false;
        }
        evict_over_capacity(shared);
        drop_abandoned_writers(shared);
        if last_beat.elapsed() >= super::work::HEARTBEAT {
            if let Some(w) = shared.work.lock().as_ref() {
                w.heartbeat();
            }
            last_beat = std::time::Instant::now();
        }
    }
}

/// Keeps blocks and spare files together within the capacity: evicts the
/// least recently used unpinned blocks while they take more, then, at the
/// capacity, turns cold blocks into the spares the pool misses. Returns the
/// number of blocks evicted.
pub(super) fn evict_over_capacity(shared: &Shared) -> usize {
    let cap = shared.cfg.capacity_bytes;
    if cap == 0 {
        return 0;
    }
    // Spares take disk space too: counted with the blocks.
    let on_disk = || shared.index.used_bytes() + shared.spares.bytes();
    let mut evicted = 0;
    // A recycled file stays on disk as a spare, so a pass may free nothing;
    // passes go on until the pool is full (its budget is a tenth of the
    // capacity) and evicted files are deleted.
    while on_disk() > cap {
        let pass = evict_coldest(shared, on_disk() - cap);
        if pass == 0 {
            break; // the rest is pinned or was just dumped elsewhere
        }
        evicted += pass;
    }
    // The files of cold blocks become the spares the pool misses: neither a
    // create nor a delete, and the bytes on disk stay the same. So a store
    // at capacity dumps into recycled files.
    let missing = shared.spare_reserve_bytes();
    let short = (on_disk() + missing).saturating_sub(cap).min(missing);
    if short > 0 {
        evicted += evict_coldest(shared, short);
    }
    log::debug!(
        "evicted {evicted} block(s); {} byte(s) in use, {} in spare files",
        shared.index.used_bytes(),
        shared.spares.bytes()
    );
    evicted
}

/// Evicts the least recently used unpinned blocks worth `bytes`.
fn evict_coldest(shared: &Shared, bytes: u64) -> usize {
    shared
        .index
        .coldest(bytes)
        .iter()
        .map(|id| usize::from(evict_one(shared, id)))
        .sum()
}

/// Evicts up to `count` of the least recently used unpinned blocks stored
/// under root `root`, recycling their files into the spare pool (see
/// [`Shared::spare_for_new_block`]). Returns the number evicted.
pub(super) fn recycle_coldest(shared: &Shared, root: usize, count: usize) -> usize {
    let len = shared.layout.file_len().max(1);
    let mut evicted = 0;
    let candidates = shared.index.coldest((count as u64 * 2).saturating_mul(len));
    for id in candidates {
        if evicted == count {
            break;
        }
        if shared.paths.root_index(&id) == root {
            evicted += usize::from(evict_one(shared, &id));
        }
    }
    evicted
}

/// How long a block that another store sharing the directory dumped is
/// kept by this store's evictor, however cold it looks here: the other
/// store's `wait()` returned, and its next load must find the block.
pub(super) const RECENT_DUMP_GRACE: Duration = Duration::from_secs(10);

/// Removes `id` unless a load pinned it or another store dumped it within
/// [`RECENT_DUMP_GRACE`], and recycles or deletes its file.
fn evict_one(shared: &Shared, id: &super::BlockId) -> bool {
    let path = shared.paths.block(id);
    let len = shared.layout.file_len();
    if let (Some(known), Some(mtime)) =
        (shared.index.known_mtime(id), super::scan::probe(&path, len))
    {
        let now = super::scan::nanos(std::time::SystemTime::now());
        if mtime > known && now.saturating_sub(mtime) < RECENT_DUMP_GRACE.as_nanos() as u64 {
            // Dumped elsewhere since we last saw it: as recent as it gets.
            shared.index.insert(*id, len, None, mtime);
            return false;
        }
    }
    let root = shared.paths.root_index(id);
    // Only a regular file becomes a spare; whatever else was put at a
    // block's name is deleted.
    let file_len = match std::fs::symlink_metadata(&path) {
        Ok(m) if m.file_type().is_file() => Some(m.len()),
        _ => None,
    };
    // Until the file has left the block's name, a lookup must not find it
    // there and index the block again (see `Shared::file_moves`).
    let _moves = shared.file_moves.lock();
    // The pool counts the file before the index lets it go: a dump checking
    // the capacity in between would otherwise see room for a create.
    let reserved = file_len.filter(|l| shared.spares.reserve(root, *l));
    if shared.index.remove_if_unpinned(id).is_none() {
        if let Some(l) = reserved {
            shared.spares.unreserve(l);
        }
        return false;
    }
    #[cfg(test)]
    tests::BETWEEN_REMOVE_AND_MOVE.with(|hook| {
        if let Some(f) = hook.borrow_mut().as_mut() {
            f();
        }
    });
    // Counted with each removal, so stats never show a block gone from the
    // index but not yet counted as evicted.
    shared.counters.evictions.fetch_add(1, Ordering::Relaxed);
    if reserved.is_some_and(|l| shared.spares.recycle(root, &path, l)) {
        shared
            .counters
            .files_recycled
            .fetch_add(1, Ordering::Relaxed);
    } else {
        let _ = std::fs::remove_file(path);
    }
    true
}

impl Shared {
    /// Spare files a store with a capacity keeps by recycling evicted block
    /// files: the pool's target, at most a tenth of the capacity (0: no
    /// capacity, or no pool).
    pub(super) fn recycled_spares(&self) -> u64 {
        spare_budget(
            self.cfg.capacity_bytes,
            self.spares.target(),
            self.layout.file_len(),
        ) / self.layout.file_len().max(1)
    }

    /// True when the filler must not create spare files: the store has
    /// reached its capacity once (it evicted), or creating would take it
    /// there. From then on the pool is refilled by eviction only (see
    /// [`evict`] and [`Shared::spare_for_new_block`]), so a store at
    /// capacity keeps a fixed set of files: a create after the evictor's
    /// batch freed room would only make a later eviction delete a file.
    pub(super) fn near_capacity(&self) -> bool {
        let reserve = self.recycled_spares() * self.layout.file_len();
        reserve > 0
            && (self.counters.evictions.load(Ordering::Relaxed) > 0
                || self.index.used_bytes() + reserve > self.cfg.capacity_bytes)
    }

    /// Bytes of spare files the pool misses to its budget
    /// ([`Shared::recycled_spares`] files) while it is short of files: the
    /// filler creates them below the capacity ([`Shared::near_capacity`]),
    /// the evictor recycles cold blocks into them at the capacity, so one of
    /// the two always refills the pool. A store at capacity then dumps into
    /// recycled files: it neither creates nor deletes files.
    pub(super) fn spare_reserve_bytes(&self) -> u64 {
        if self.spares.deficit() == 0 {
            return 0;
        }
        // The spares held are counted as they are; room for the rest.
        (self.recycled_spares() * self.layout.file_len()).saturating_sub(self.spares.bytes())
    }
}

/// Bytes of spare files a store with capacity `cap` keeps at most: `target`
/// files of `file_len` bytes, within a tenth of the capacity (0: no
/// capacity, or no pool).
pub(super) fn spare_budget(cap: u64, target: usize, file_len: u64) -> u64 {
    let len = file_len.max(1);
    (target as u64).min(cap / 10 / len) * len
}

/// A block whose shards stopped arriving (a layer-wise dump cut short)
/// would hold its temporary file forever: after twice the task timeout
/// (at least a minute) of inactivity it is dropped.
fn drop_abandoned_writers(shared: &Shared) {
    let idle =
        Duration::from_millis(shared.cfg.timeout_ms.saturating_mul(2)).max(Duration::from_secs(60));
    let stale = shared.writers.lock().stale(idle);
    for w in stale {
        w.abandon();
        shared.forget_writer(&w);
        let _ = std::fs::remove_file(&w.tmp);
        log::warn!(
            "dropped the incomplete block {} after {:?} without progress",
            w.block,
            idle
        );
    }
}

#[cfg(test)]
pub(super) mod tests {
    use std::cell::RefCell;

    use super::*;
    use crate::block::{BlockId, MemSeg, ShardIo};
    use crate::store::{PosixConfig, PosixStore, Store};

    thread_local! {
        /// Runs on the evicting thread after the block left the index and
        /// before its file left the block's name.
        pub(in crate::store::posix) static BETWEEN_REMOVE_AND_MOVE:
            RefCell<Option<Box<dyn FnMut()>>> = const { RefCell::new(None) };
    }

    /// A lookup probing the block's name while an eviction moves its file
    /// neither reports the block nor indexes it again: the index never
    /// holds a block whose file is gone (a hit no load could serve).
    #[test]
    fn a_lookup_during_an_eviction_does_not_index_the_leaving_file() {
        let dir = tempfile::tempdir().unwrap();
        let store = PosixStore::open(PosixConfig {
            storage_backends: vec![dir.path().to_path_buf()],
            block_size: 4096,
            shard_size: 4096,
            tensor_size_list: vec![4096],
            ..Default::default()
        })
        .unwrap();
        let block = BlockId([7; 16]);
        let data = vec![7u8; 4096];
        let shard = ShardIo {
            block,
            index: 0,
            segs: vec![MemSeg {
                addr: data.as_ptr() as usize,
                len: data.len(),
            }],
        };
        store.wait(store.dump(vec![shard], 0).unwrap()).unwrap();
        let shared = store.shared.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        let prober = shared.clone();
        BETWEEN_REMOVE_AND_MOVE.with(|h| {
            *h.borrow_mut() = Some(Box::new(move || {
                let (prober, tx) = (prober.clone(), tx.clone());
                std::thread::spawn(move || {
                    let _ = tx.send(prober.present(&block));
                });
                // Long enough for the lookup to probe, were it not held back.
                std::thread::sleep(std::time::Duration::from_millis(200));
            }))
        });
        assert!(evict_one(&shared, &block));
        BETWEEN_REMOVE_AND_MOVE.with(|h| h.borrow_mut().take());
        let found = rx.recv().unwrap();
        assert!(!found, "the lookup reported a block whose file was leaving");
        assert!(
            shared.index.known_mtime(&block).is_none(),
            "the index holds a block whose file is gone"
        );
        assert!(!store.lookup(&[block]).unwrap()[0]);
    }
}
