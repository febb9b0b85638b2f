//! The background thread of the Posix store: capacity eviction and the
//! clean-up of blocks whose assembly was abandoned.
//!
//! The capacity bounds the directory, not this store's share of it: the
//! bytes compared with it are the roots' usage, which every store writing
//! there counts ([`super::usage`]). Each store evicts the coldest blocks it
//! knows; a block another store dumped in the last [`RECENT_DUMP_GRACE`]
//! is never evicted, checked on the file itself at eviction time.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::index::fold_mtime;
use super::tree::Tree;
use super::usage::Part;
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
    let mut last_beat = Instant::now();
    let mut recount = Recount::default();
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
        // Until the background pass has read and dated every block, the
        // evictor would pick among what it happens to know.
        if shared.indexed.load(Ordering::Acquire) {
            recount.before_pass(shared);
            evict_over_capacity(shared);
            recount.after_pass(shared);
        }
        drop_abandoned_writers(shared);
        if last_beat.elapsed() >= super::work::HEARTBEAT {
            if let Some(w) = &shared.work {
                w.heartbeat();
            }
            last_beat = Instant::now();
        }
    }
}

/// Least time between two scans of the directory by the evictor.
const RESCAN_EVERY: Duration = Duration::from_secs(60);

/// When the evictor scans the directory again, to learn the blocks other
/// stores wrote since this one opened (their writers may have exited, or
/// never evict because their capacity is larger), or to count the
/// directory's bytes again when the usage record was damaged.
#[derive(Default)]
struct Recount {
    last: Option<Instant>,
}

impl Recount {
    /// Before a pass: over the capacity while much of the directory is
    /// blocks this store does not know, it learns them first, so that the
    /// coldest of all are evicted rather than its own.
    fn before_pass(&mut self, shared: &Shared) {
        let cap = shared.cfg.capacity_bytes;
        let on_disk = shared.dir_bytes();
        let known = shared.index.used_bytes() + shared.spares.bytes();
        let unknown = on_disk.saturating_sub(known);
        let stale = shared.usage.take_stale();
        if stale || (cap > 0 && on_disk > cap && unknown > cap / 4) {
            self.rescan(shared, stale);
        }
    }

    /// After a pass that left the directory over the capacity: nothing
    /// this store knows could go, so it looks for what it does not know.
    fn after_pass(&mut self, shared: &Shared) {
        let cap = shared.cfg.capacity_bytes;
        if cap > 0 && shared.dir_bytes() > cap && self.rescan(shared, false) {
            evict_over_capacity(shared);
        }
    }

    /// Scans the directory into the index (blocks already there keep their
    /// place; new ones come in as the coldest, by mtime), and with `count`
    /// sets the roots' usage to what it counted. At most every
    /// [`RESCAN_EVERY`]. Only a damaged record is counted again: a record
    /// kept by every store's changes is exact, while a count taken as
    /// other stores move and delete files can only approach it.
    fn rescan(&mut self, shared: &Shared, count: bool) -> bool {
        if shared.work.is_none() || self.last.is_some_and(|t| t.elapsed() < RESCAN_EVERY) {
            return false;
        }
        self.last = Some(Instant::now());
        let what = super::indexer::Pass {
            clean: false,
            date: true,
            count,
        };
        let report = super::indexer::pass(shared, what);
        log::info!(
            "read the store directory again{}: {} block(s) this store did not know",
            if count { " and counted its bytes" } else { "" },
            report.new_blocks
        );
        true
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
    // Every store's blocks and spares under the roots.
    let on_disk = || shared.dir_bytes();
    // A dump refilling the pool at the capacity evicts too (see
    // `Shared::spare_for_new_block`): one at a time, or both would evict
    // for the same excess and leave room that the next dumps fill with new
    // files.
    let _refilling = shared.refill_lock.lock();
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
        "evicted {evicted} block(s); {} byte(s) under the roots, {} in this store's spare files",
        shared.dir_bytes(),
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
    if !shared.indexed.load(Ordering::Acquire) {
        return 0;
    }
    let len = shared.layout.file_len().max(1);
    let mut evicted = 0;
    let candidates = shared.index.coldest((count as u64 * 2).saturating_mul(len));
    for id in candidates {
        if evicted == count {
            break;
        }
        if shared.tree.root_index(&id) == root {
            evicted += usize::from(evict_one(shared, &id));
        }
    }
    evicted
}

/// How long a block that another store sharing the directory dumped is
/// kept by this store's evictor, however cold it looks here: the other
/// store's `wait()` returned, and its next load must find the block.
pub(super) const RECENT_DUMP_GRACE: Duration = Duration::from_secs(10);

/// True when a file last modified at `mtime_ns` is within the grace.
fn recent(mtime_ns: u64) -> bool {
    let now = super::scan::nanos(std::time::SystemTime::now());
    now.saturating_sub(mtime_ns) < RECENT_DUMP_GRACE.as_nanos() as u64
}

/// Removes `id` unless a load pinned it or another store dumped it within
/// [`RECENT_DUMP_GRACE`], and recycles or deletes its file.
///
/// The file is first moved out of the block's name into this store's work
/// directory, then looked at once more: a store that dumps the block again
/// in between either touched it before the move (then it is put back) or
/// finds the name empty and writes the block anew, so its load finds it.
fn evict_one(shared: &Shared, id: &super::BlockId) -> bool {
    let name = Tree::block_name(id);
    let len = shared.layout.file_len();
    let (Ok(bucket), Some(work)) = (shared.tree.bucket(id), shared.work.as_ref()) else {
        return false;
    };
    let st = match bucket.lstat(&name) {
        Ok(st) => st,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            // Evicted by another store: nothing to free, nothing to count.
            let _moves = shared.file_moves.lock(&shared.tree, id);
            shared.index.remove(id);
            return false;
        }
        Err(_) => return false,
    };
    let ours = shared.index.own_mtime(id) == Some(fold_mtime(st.mtime_ns));
    if st.is_file() && recent(st.mtime_ns) && !ours {
        // Dumped by another store a moment ago: as recent as it gets.
        shared.index.insert(*id, None);
        return false;
    }
    let root = shared.tree.root_index(id);
    // Only a block file becomes a spare; whatever else was put at a
    // block's name is deleted.
    let block_file = st.is_file() && st.len == len;
    // Until the file has left the block's name, a lookup must not find it
    // there and index the block again (see `Shared::file_moves`).
    let _moves = shared.file_moves.lock(&shared.tree, id);
    // The pool counts the file before the index lets it go: a dump checking
    // the capacity in between would otherwise see room for a create.
    let reserved = block_file && shared.spares.reserve(root, len);
    if !shared.index.remove_if_unpinned(id) {
        if reserved {
            shared.spares.unreserve(len);
        }
        return false;
    }
    #[cfg(test)]
    tests::BETWEEN_REMOVE_AND_MOVE.with(|hook| {
        if let Some(f) = hook.borrow_mut().as_mut() {
            f();
        }
    });
    let away = shared.spares.fresh_name("r");
    let dir = work.dir(root);
    let part = Part::Bucket(id.0[0]);
    let changing = shared.usage.changing(root, &[part, Part::Work]);
    if bucket.rename(&name, &dir, &away).is_err() {
        // Gone meanwhile (another store evicted it), or not ours to move.
        if reserved {
            shared.spares.unreserve(len);
        }
        return false;
    }
    let moved = dir.lstat(&away).ok();
    let moved_len = moved.filter(|m| m.is_file()).map_or(0, |m| m.len);
    shared.usage.moved(root, part, Part::Work, moved_len);
    let touched = moved.is_some_and(|m| m.mtime_ns != st.mtime_ns);
    // Dumped again between the look and the move: put it back.
    if touched && dir.rename_noreplace(&away, &bucket, &name).is_ok() {
        shared.usage.moved(root, Part::Work, part, moved_len);
        drop(changing);
        if reserved {
            shared.spares.unreserve(len);
        }
        shared.index.insert(*id, None);
        log::debug!("kept block {id}: dumped again while it was being evicted");
        return false;
    }
    // Counted with each removal, so stats never show a block gone from the
    // index but not yet counted as evicted.
    shared.counters.evictions.fetch_add(1, Ordering::Relaxed);
    if reserved {
        shared.spares.recycled(root, away, len);
        shared
            .counters
            .files_recycled
            .fetch_add(1, Ordering::Relaxed);
    } else if dir.remove_file(&away).is_ok() {
        shared.usage.add_to(root, Part::Work, -(moved_len as i64));
    }
    drop(changing);
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
                || self.blocks_bytes() + reserve > self.cfg.capacity_bytes)
    }

    /// [`Shared::dir_bytes`] but this store's own spare files: what the
    /// blocks (and other stores' spares) take.
    pub(super) fn blocks_bytes(&self) -> u64 {
        self.dir_bytes().saturating_sub(self.spares.bytes())
    }

    /// Bytes under the store's roots: every store's blocks and spare files,
    /// as the roots' usage counts them (only this store's, where it can't
    /// share the count).
    pub(super) fn dir_bytes(&self) -> u64 {
        if self.work.is_some() {
            self.usage.bytes()
        } else {
            self.index.used_bytes()
        }
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
        shared.discard_temp(&w.tmp);
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
            shared.index.own_mtime(&block).is_none(),
            "the index holds a block whose file is gone"
        );
        assert!(!store.lookup(&[block]).unwrap()[0]);
    }
}
