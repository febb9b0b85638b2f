//! Bookkeeping of dirty blocks: what this process still has to write to the
//! backend, when, and what went wrong.
//!
//! The slot table knows *that* a slot is dirty (so it is never evicted);
//! this map knows *what to do about it*: per block, the dirty shards and
//! their slots, the retry schedule, the last error. One thread (in
//! [`super::CacheStore`]) drains it in batches.
//!
//! * `async`: an entry is due once it is `write_back_interval` old, or as
//!   soon as `write_back_batch_size` entries are waiting (whichever first).
//!   While copies between slots and callers are running (a dump or load
//!   someone is waiting for), a full batch waits until they end, unless the
//!   backlog passes a quarter of the cache: the backend write reads slot
//!   memory and takes CPU, so starting it mid-dump halved the dump's speed
//!   on a two-core machine, while deferring it costs the backend write a
//!   few milliseconds of head start.
//! * `lazy`: an entry is due only when eviction wanted its slot (the
//!   allocator reports dirty candidates) or on `flush`.
//! * `sync` dumps write their blocks themselves; only failed ones land here
//!   for retries.
//!
//! A failed write keeps the entry (the slots stay dirty, so nothing is
//! lost), counts a failure and schedules a retry with exponential backoff
//! (50 ms doubling up to `write_back_max_backoff`). `flush` makes every
//! entry present at its start due immediately, waits until each has been
//! written or has failed once more, and reports the failures.
//!
//! Over 600 lines with its unit tests (the second 260); the code is 360.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::block::BlockId;
use crate::error::UcmError;

/// Blocks a failed flush names in its error.
const FLUSH_ERROR_NAMES: usize = 8;

/// First retry delay after a failed write.
pub const BASE_BACKOFF: Duration = Duration::from_millis(50);

/// One dirty block.
pub struct Entry {
    /// Dirty shards: shard index -> slot.
    pub shards: BTreeMap<u32, u32>,
    /// When it became dirty.
    pub since: Instant,
    /// Lazy entries: eviction asked for it.
    pub wanted: bool,
    /// Not before (retry backoff).
    pub next_try: Instant,
    /// Failed attempts so far.
    pub attempts: u32,
    /// Last failure.
    pub last_error: Option<UcmError>,
    /// A write of it is running.
    pub inflight: bool,
    /// Number of the last flush whose pass attempted it.
    pub tried_in_flush: u64,
}

/// The map, the flush generation and the stop flag.
#[derive(Default)]
pub struct State {
    /// Dirty blocks.
    pub dirty: HashMap<BlockId, Entry>,
    /// Incremented by each flush.
    pub flush_gen: u64,
    /// Asks the thread to exit once idle.
    pub stop: bool,
}

/// Shared between dumps, eviction, flush and the write-back thread.
#[derive(Default)]
pub struct WriteBack {
    /// Everything above.
    pub state: Mutex<State>,
    /// Wakes the write-back thread.
    pub wake: Condvar,
    /// Wakes flushes waiting for a pass to finish.
    pub progress: Condvar,
    /// Copy jobs between slots and callers queued or running.
    foreground: AtomicUsize,
}

/// One foreground copy job, counted while it lives (queued or running).
pub struct Foreground(Arc<WriteBack>);

impl Drop for Foreground {
    fn drop(&mut self) {
        if self.0.foreground.fetch_sub(1, Ordering::AcqRel) == 1 {
            // Under the lock, so the thread cannot miss this between
            // seeing the copies busy and going to sleep.
            let _st = self.0.state.lock();
            self.0.wake.notify_all();
        }
    }
}

/// Retry delay after `attempts` failures.
pub fn backoff(attempts: u32, max: Duration) -> Duration {
    let shift = attempts.saturating_sub(1).min(20);
    (BASE_BACKOFF * (1u32 << shift)).min(max.max(BASE_BACKOFF))
}

impl WriteBack {
    /// Counts one foreground copy job until the returned value is dropped.
    pub fn foreground(self: &Arc<Self>) -> Foreground {
        self.foreground.fetch_add(1, Ordering::AcqRel);
        Foreground(self.clone())
    }

    /// Whether foreground copy jobs are queued or running.
    pub fn copies_running(&self) -> bool {
        self.foreground.load(Ordering::Acquire) > 0
    }

    /// Records dirty shards (block, shard, slot). `wanted` marks lazy
    /// entries due at once (an adopted orphan, a failed sync write).
    pub fn add(&self, items: &[(BlockId, u32, u32)], wanted: bool) {
        if items.is_empty() {
            return;
        }
        let now = Instant::now();
        let mut st = self.state.lock();
        for &(block, shard, slot) in items {
            let e = st.dirty.entry(block).or_insert_with(|| Entry {
                shards: BTreeMap::new(),
                since: now,
                wanted,
                next_try: now,
                attempts: 0,
                last_error: None,
                inflight: false,
                tried_in_flush: 0,
            });
            e.shards.insert(shard, slot);
            e.wanted |= wanted;
        }
        drop(st);
        self.wake.notify_all();
    }

    /// Records a failed attempt of blocks written outside the thread (a
    /// sync dump), so they are retried.
    pub fn add_failed(&self, items: &[(BlockId, u32, u32)], err: &UcmError, max: Duration) {
        self.add(items, true);
        let mut st = self.state.lock();
        let now = Instant::now();
        for (block, _, _) in items {
            if let Some(e) = st.dirty.get_mut(block) {
                e.attempts += 1;
                e.next_try = now + backoff(e.attempts, max);
                e.last_error = Some(err.clone());
            }
        }
    }

    /// Lazy write-back: eviction would like these slots' blocks written.
    pub fn want(&self, blocks: &[BlockId]) {
        if blocks.is_empty() {
            return;
        }
        let mut st = self.state.lock();
        let mut any = false;
        for b in blocks {
            if let Some(e) = st.dirty.get_mut(b) {
                any |= !e.wanted;
                e.wanted = true;
            }
        }
        drop(st);
        if any {
            self.wake.notify_all();
        }
    }

    /// The blocks among `blocks` that have shards not yet in the backend.
    pub fn dirty_among<'a>(&self, blocks: impl IntoIterator<Item = &'a BlockId>) -> Vec<BlockId> {
        let st = self.state.lock();
        if st.dirty.is_empty() {
            return Vec::new();
        }
        let mut out: Vec<BlockId> = blocks
            .into_iter()
            .filter(|b| st.dirty.contains_key(b))
            .copied()
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }

    /// Read-your-writes for a load that must read `blocks` from the
    /// backend although some of their shards are still dirty here. A dump
    /// that found slots for only part of a block wrote the rest through, so
    /// the backend holds the block unpublished until the cached part is
    /// written back. Makes those entries due at once and waits until each is
    /// written, or fails once more (an entry already failing counts at
    /// once: the backend's own answer is what the load gets), or
    /// `deadline` passes.
    pub fn settle(&self, blocks: &[BlockId], deadline: Instant) {
        let mut st = self.state.lock();
        let start: Vec<Option<u32>> = blocks
            .iter()
            .map(|b| {
                st.dirty
                    .get(b)
                    .filter(|e| e.last_error.is_none())
                    .map(|e| e.attempts)
            })
            .collect();
        loop {
            let mut pending = false;
            let mut wake = false;
            for (b, first) in blocks.iter().zip(&start) {
                let Some(first) = first else { continue };
                if let Some(e) = st.dirty.get_mut(b) {
                    if e.attempts == *first {
                        pending = true;
                        wake |= !e.wanted;
                        e.wanted = true;
                    }
                }
            }
            if !pending || st.stop {
                return;
            }
            if wake {
                self.wake.notify_all();
            }
            if self.progress.wait_until(&mut st, deadline).timed_out() {
                return;
            }
        }
    }

    /// Number of dirty blocks.
    pub fn dirty_blocks(&self) -> usize {
        self.state.lock().dirty.len()
    }
}

/// When entries are due: the write-back settings.
pub struct Schedule {
    /// `write_back_interval`.
    pub interval: Duration,
    /// The `lazy` policy.
    pub lazy: bool,
    /// `write_back_batch_size`.
    pub batch: usize,
    /// Waiting entries that start a batch even while foreground copies run.
    pub backlog: usize,
}

/// Blocks taken for one write.
pub struct Batch {
    /// Their dirty shards: (block, shard, slot).
    pub items: Vec<(BlockId, u32, u32)>,
    /// Per block, the shards this write covers.
    pub blocks: Vec<(BlockId, Vec<u32>)>,
    /// The flush generation when they were taken.
    pub gen: u64,
}

impl State {
    /// Takes the due entries, oldest first and at most a batch, and marks
    /// them in flight; `Err` with when to look again when none is due.
    /// Entries a flush is waiting for are due whatever the policy.
    /// `copying`: foreground copies are running, so a full batch alone does
    /// not make entries due (see the module docs).
    pub fn take_due(
        &mut self,
        now: Instant,
        s: &Schedule,
        copying: bool,
    ) -> Result<Batch, Instant> {
        let gen = self.flush_gen;
        let waiting = self
            .dirty
            .values()
            .filter(|e| !e.inflight && e.next_try <= now)
            .count();
        let full = waiting >= if copying { s.backlog } else { s.batch };
        let mut next_wake = now + super::HOUSEKEEPING;
        let mut ready: Vec<(Instant, BlockId)> = Vec::new();
        for (b, e) in &self.dirty {
            if e.inflight {
                continue;
            }
            let flushing = e.tried_in_flush < gen;
            if !flushing && e.next_try > now {
                next_wake = next_wake.min(e.next_try);
                continue;
            }
            let due = flushing || e.wanted || (!s.lazy && (full || e.since + s.interval <= now));
            if due {
                ready.push((e.since, *b));
            } else if !s.lazy {
                next_wake = next_wake.min(e.since + s.interval);
            }
        }
        if ready.is_empty() {
            return Err(next_wake);
        }
        ready.sort_unstable_by_key(|(since, _)| *since);
        ready.truncate(s.batch);
        let mut items = Vec::new();
        let mut blocks = Vec::new();
        for (_, b) in ready {
            if let Some(e) = self.dirty.get_mut(&b) {
                e.inflight = true;
                items.extend(e.shards.iter().map(|(&sh, &slot)| (b, sh, slot)));
                blocks.push((b, e.shards.keys().copied().collect::<Vec<_>>()));
            }
        }
        Ok(Batch { items, blocks, gen })
    }

    /// Records the outcome of a write of `blocks` taken in flush
    /// generation `gen`: written shards leave their entry (a block with
    /// none left is clean), a failure schedules a retry. Returns how many
    /// blocks failed.
    pub fn written(
        &mut self,
        blocks: Vec<(BlockId, Vec<u32>)>,
        gen: u64,
        res: &crate::error::Result<()>,
        max_backoff: Duration,
    ) -> u64 {
        let now = Instant::now();
        let mut failed = 0;
        for (b, written) in blocks {
            let Some(e) = self.dirty.get_mut(&b) else {
                continue;
            };
            e.inflight = false;
            e.tried_in_flush = e.tried_in_flush.max(gen);
            match res {
                Ok(()) => {
                    for sh in written {
                        e.shards.remove(&sh);
                    }
                    e.attempts = 0;
                    e.last_error = None;
                    e.wanted = false;
                    if e.shards.is_empty() {
                        self.dirty.remove(&b);
                    }
                }
                Err(err) => {
                    failed += 1;
                    e.attempts += 1;
                    e.next_try = now + backoff(e.attempts, max_backoff);
                    e.last_error = Some(err.clone());
                }
            }
        }
        failed
    }

    /// Forgets dirty shards that can never be written (their slot was
    /// dropped: it failed its checksum); a block left with none is no
    /// longer dirty here.
    pub fn forget(&mut self, shards: &[(BlockId, u32)]) {
        for (b, sh) in shards {
            if let Some(e) = self.dirty.get_mut(b) {
                e.shards.remove(sh);
                if e.shards.is_empty() && !e.inflight {
                    self.dirty.remove(b);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_and_caps() {
        let max = Duration::from_secs(1);
        assert_eq!(backoff(1, max), Duration::from_millis(50));
        assert_eq!(backoff(2, max), Duration::from_millis(100));
        assert_eq!(backoff(30, max), max);
    }

    #[test]
    fn add_merges_shards_of_a_block() {
        let wb = WriteBack::default();
        let b = BlockId([1; 16]);
        wb.add(&[(b, 0, 5), (b, 1, 6)], false);
        wb.add(&[(b, 2, 9)], false);
        assert_eq!(wb.dirty_blocks(), 1);
        assert_eq!(wb.state.lock().dirty[&b].shards.len(), 3);
    }

    #[test]
    fn take_due_follows_the_policy_and_written_records_the_outcome() {
        let wb = WriteBack::default();
        let (a, b) = (BlockId([1; 16]), BlockId([2; 16]));
        let hour = Duration::from_secs(3600);
        let eager = Schedule {
            interval: hour,
            lazy: false,
            batch: 2,
            backlog: 3,
        };
        wb.add(&[(a, 0, 5), (a, 1, 6)], false);
        let mut st = wb.state.lock();
        // Young, and the batch is not full: not due.
        assert!(st.take_due(Instant::now(), &eager, false).is_err());
        drop(st);
        wb.add(&[(b, 3, 7)], false);
        let mut st = wb.state.lock();
        let batch = st.take_due(Instant::now(), &eager, false).unwrap();
        assert_eq!(batch.items, vec![(a, 0, 5), (a, 1, 6), (b, 3, 7)]);
        // In flight: not taken twice.
        assert!(st.take_due(Instant::now(), &eager, false).is_err());
        let err = UcmError::NoSpace("full".into());
        assert_eq!(st.written(batch.blocks, batch.gen, &Err(err), hour), 2);
        assert_eq!(st.dirty[&a].attempts, 1);
        // Backing off: not due again yet, even with a full batch.
        assert!(st.take_due(Instant::now(), &eager, false).is_err());
        st.dirty
            .values_mut()
            .for_each(|e| e.next_try = Instant::now());
        let batch = st.take_due(Instant::now(), &eager, false).unwrap();
        assert_eq!(st.written(batch.blocks, batch.gen, &Ok(()), hour), 0);
        assert!(st.dirty.is_empty());
        drop(st);

        let lazy = Schedule {
            interval: Duration::ZERO,
            lazy: true,
            batch: 1,
            backlog: 1,
        };
        wb.add(&[(a, 0, 5)], false);
        wb.add(&[(b, 0, 6)], false);
        assert!(wb
            .state
            .lock()
            .take_due(Instant::now(), &lazy, false)
            .is_err());
        wb.want(&[b]);
        let take_due = || {
            wb.state
                .lock()
                .take_due(Instant::now(), &lazy, false)
                .ok()
                .unwrap()
        };
        assert_eq!(take_due().items, vec![(b, 0, 6)]);
        // A flush makes the rest due whatever the policy.
        wb.state.lock().flush_gen += 1;
        assert_eq!(take_due().items, vec![(a, 0, 5)]);
    }

    #[test]
    fn a_full_batch_waits_for_foreground_copies_unless_the_backlog_is_large() {
        let wb = Arc::new(WriteBack::default());
        let s = Schedule {
            interval: Duration::from_secs(3600),
            lazy: false,
            batch: 2,
            backlog: 3,
        };
        let due = |copying: bool| {
            wb.state
                .lock()
                .take_due(Instant::now(), &s, copying)
                .map(|b| b.items.len())
        };
        wb.add(&[(BlockId([1; 16]), 0, 1), (BlockId([2; 16]), 0, 2)], false);
        let fg = wb.foreground();
        assert!(wb.copies_running());
        assert!(due(true).is_err());
        drop(fg);
        assert!(!wb.copies_running());
        assert!(due(wb.copies_running()).is_ok());
        wb.state.lock().dirty.clear();
        // A backlog starts a batch even while copies run.
        let three: Vec<_> = (1..=3u8)
            .map(|i| (BlockId([i; 16]), 0, u32::from(i)))
            .collect();
        wb.add(&three, false);
        assert_eq!(due(true), Ok(2));
        // So does an entry older than the interval.
        wb.state.lock().dirty.clear();
        wb.add(&three[..1], false);
        let old = Schedule {
            interval: Duration::ZERO,
            ..s
        };
        assert!(wb.state.lock().take_due(Instant::now(), &old, true).is_ok());
    }

    #[test]
    fn settle_marks_dirty_blocks_wanted_and_returns_when_they_are_written() {
        let wb = std::sync::Arc::new(WriteBack::default());
        let (a, b, clean) = (BlockId([1; 16]), BlockId([2; 16]), BlockId([3; 16]));
        wb.add(&[(a, 0, 1), (b, 0, 2)], false);
        assert_eq!(wb.dirty_among([&clean, &b, &a, &b]), vec![a, b]);
        let writer = {
            let wb = wb.clone();
            std::thread::spawn(move || loop {
                let mut st = wb.state.lock();
                if st.dirty.values().all(|e| e.wanted) {
                    st.dirty.clear();
                    drop(st);
                    wb.progress.notify_all();
                    return;
                }
                wb.wake.wait_for(&mut st, Duration::from_millis(5));
            })
        };
        let t0 = Instant::now();
        wb.settle(&[a, b, clean], t0 + Duration::from_secs(20));
        assert!(t0.elapsed() < Duration::from_secs(10));
        assert_eq!(wb.dirty_blocks(), 0);
        writer.join().unwrap();
    }

    #[test]
    fn settle_does_not_wait_for_a_failing_block_or_past_its_deadline() {
        let wb = WriteBack::default();
        let (a, b) = (BlockId([1; 16]), BlockId([2; 16]));
        let err = UcmError::NoSpace("full".into());
        wb.add_failed(&[(a, 0, 1)], &err, Duration::from_secs(60));
        let t0 = Instant::now();
        wb.settle(&[a], t0 + Duration::from_secs(20));
        assert!(t0.elapsed() < Duration::from_secs(10));
        wb.add(&[(b, 0, 2)], false);
        wb.settle(&[b], Instant::now() + Duration::from_millis(30));
        assert!(wb.state.lock().dirty[&b].wanted);
    }
}

/// The write-back thread and `flush`, the parts of [`super::Inner`] that
/// drain this map.
mod thread {
    use std::collections::VecDeque;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use super::super::integrity::SlotWrite;
    use super::super::stats::add;
    use super::super::{Inner, WriteBackPolicy, HOUSEKEEPING};
    use super::{Batch, Schedule, FLUSH_ERROR_NAMES};
    use crate::block::BlockId;
    use crate::error::{Result, UcmError};

    /// Write-back batches submitted to the backend and not yet waited for.
    /// Two keep the backend busy across one batch's tail; more only
    /// queue behind the backend's own I/O threads.
    const BATCHES_IN_FLIGHT: usize = 2;

    impl Inner {
        pub(in crate::store::cache) fn write_back_loop(self: Arc<Self>) {
            let schedule = Schedule {
                interval: Duration::from_millis(self.cfg.write_back_interval_ms),
                lazy: self.cfg.write_back_policy == WriteBackPolicy::Lazy,
                batch: self.cfg.write_back_batch_size,
                backlog: (self.cfg.slots() / self.cfg.shard_count().max(1) / 4)
                    .max(self.cfg.write_back_batch_size),
            };
            let max_backoff = Duration::from_millis(self.cfg.write_back_max_backoff_ms);
            let mut last_housekeeping = Instant::now();
            // Oldest first. Waiting for one batch before taking the next
            // left the backend idle between batches (its last file's
            // publication, then the next submission): a flush of many
            // batches reached about two thirds of the backend's own dump
            // speed.
            let mut writing: VecDeque<(Batch, SlotWrite)> = VecDeque::new();
            loop {
                if self.cfg.share_buffer_enable && last_housekeeping.elapsed() >= HOUSEKEEPING {
                    self.housekeep();
                    last_housekeeping = Instant::now();
                }
                let taken = {
                    let mut st = self.wb.state.lock();
                    let copying = self.wb.copies_running();
                    let room = writing.len() < BATCHES_IN_FLIGHT;
                    match room.then(|| st.take_due(Instant::now(), &schedule, copying)) {
                        Some(Ok(batch)) => Some(batch),
                        Some(Err(next_wake)) if writing.is_empty() => {
                            if st.stop {
                                return;
                            }
                            self.wb.wake.wait_until(&mut st, next_wake);
                            continue;
                        }
                        _ => None,
                    }
                };
                match taken {
                    Some(batch) => {
                        let write = self.start_slot_write(&batch.items);
                        writing.push_back((batch, write));
                    }
                    None => {
                        if let Some((batch, write)) = writing.pop_front() {
                            let (res, skipped) = self.finish_slot_write(write);
                            self.record_written(batch, res, &skipped, max_backoff);
                        }
                    }
                }
            }
        }

        /// Records a finished write: the entries' outcome (shards
        /// `skipped` leave them whatever it was), the failure count, and a
        /// wake-up for flushes waiting on it.
        fn record_written(
            &self,
            batch: Batch,
            res: Result<()>,
            skipped: &[(BlockId, u32)],
            max_backoff: Duration,
        ) {
            let n = batch.items.len();
            let mut st = self.wb.state.lock();
            let failed = st.written(batch.blocks, batch.gen, &res, max_backoff);
            st.forget(skipped);
            add(&self.c.write_back_failures, failed);
            if let Err(e) = &res {
                log::warn!(
                    "write-back of {n} shard(s) failed (kept dirty in the cache, will retry): {e}"
                );
            }
            drop(st);
            self.wb.progress.notify_all();
        }

        pub(in crate::store::cache) fn flush(&self) -> Result<()> {
            let mut st = self.wb.state.lock();
            st.flush_gen += 1;
            let gen = st.flush_gen;
            let keys: Vec<BlockId> = st.dirty.keys().copied().collect();
            self.wb.wake.notify_all();
            loop {
                let pending = keys.iter().any(|k| {
                    st.dirty
                        .get(k)
                        .is_some_and(|e| e.inflight || e.tried_in_flush < gen)
                });
                if !pending || st.stop {
                    break;
                }
                self.wb
                    .progress
                    .wait_for(&mut st, Duration::from_millis(100));
            }
            let failed: Vec<(&BlockId, &super::Entry)> = keys
                .iter()
                .filter_map(|k| st.dirty.get(k).map(|e| (k, e)))
                .collect();
            if failed.is_empty() {
                return Ok(());
            }
            let first = failed
                .iter()
                .find_map(|(_, e)| e.last_error.clone())
                .map_or_else(|| "not attempted".to_string(), |e| e.to_string());
            // Named, so an operator can find them in the logs and the store;
            // a few are enough to search for.
            let mut names: Vec<String> = failed
                .iter()
                .take(FLUSH_ERROR_NAMES)
                .map(|(k, _)| k.hex())
                .collect();
            if failed.len() > FLUSH_ERROR_NAMES {
                names.push(format!("and {} more", failed.len() - FLUSH_ERROR_NAMES));
            }
            Err(UcmError::TaskFailed(format!(
                "flush: {} block(s) could not be written to the {} backend and stay dirty in \
             the cache (retried with backoff): {}; first error: {first}",
                failed.len(),
                self.backend.name(),
                names.join(", ")
            )))
        }
    }
}
