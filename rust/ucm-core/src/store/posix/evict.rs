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
/// Evict down to this share of the capacity, so eviction runs in batches.
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

/// Evicts least-recently-used unpinned blocks until usage is back under the
/// low watermark. Returns the number of blocks evicted.
pub(super) fn evict_over_capacity(shared: &Shared) -> usize {
    let cap = shared.cfg.capacity_bytes;
    let used = shared.index.used_bytes();
    // Room for the spares the pool misses (at most a tenth of the capacity,
    // so the target below stays under it).
    let limit = cap.saturating_sub(shared.spare_reserve_bytes());
    if cap == 0 || used <= limit {
        return 0;
    }
    let target = (limit as f64 * LOW_WATERMARK) as u64;
    let mut evicted = 0;
    for id in shared.index.coldest(used - target) {
        evicted += usize::from(evict_one(shared, &id));
    }
    log::debug!(
        "evicted {evicted} block(s); {} byte(s) in use",
        shared.index.used_bytes()
    );
    evicted
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
    if shared.index.remove_if_unpinned(id).is_none() {
        return false;
    }
    // Counted with each removal, so stats never show a block gone from the
    // index but not yet counted as evicted.
    shared.counters.evictions.fetch_add(1, Ordering::Relaxed);
    if shared.spares.recycle(shared.paths.root_index(id), &path) {
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
        let cap = self.cfg.capacity_bytes;
        let len = self.layout.file_len().max(1);
        (self.spares.target() as u64).min(cap / 10 / len)
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

    /// Bytes of capacity the evictor keeps free while the spare pool misses
    /// files: [`Shared::recycled_spares`] files, the same margin at which
    /// the filler stops creating ([`Shared::near_capacity`]), so one of the
    /// two always refills the pool. A store at capacity then dumps into
    /// recycled files: it neither creates nor deletes files.
    pub(super) fn spare_reserve_bytes(&self) -> u64 {
        if self.spares.deficit() == 0 {
            return 0;
        }
        self.recycled_spares() * self.layout.file_len()
    }
}

/// A block whose shards stopped arriving (a layer-wise dump cut short)
/// would hold its temporary file forever: after twice the task timeout
/// (at least a minute) of inactivity it is dropped.
fn drop_abandoned_writers(shared: &Shared) {
    let idle =
        Duration::from_millis(shared.cfg.timeout_ms.saturating_mul(2)).max(Duration::from_secs(60));
    let stale: Vec<_> = shared
        .writers
        .lock()
        .values()
        .filter(|w| w.is_stale(idle))
        .cloned()
        .collect();
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
