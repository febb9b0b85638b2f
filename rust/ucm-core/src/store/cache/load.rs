//! The read path (see the module docs of [`super`]): hits copied out,
//! concurrent fills waited for (or read past, over a local backend),
//! misses filled from the backend in one request per task, bypasses
//! through staging buffers.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use super::integrity::SlotLoad;
use super::stats::add;
use super::table::{Release, FILLING, FREE, READY};
use super::{chunks_of, staging, FillPolicy, Inner, Runtime, TaskCtx, LOCK_CHUNK};
use crate::block::{BlockId, ShardIo};
use crate::error::Result;
use crate::io::AlignedBuf;
use crate::task::{PoolSender, TaskId};

/// Shards to fill, each with the slot allocated for it.
type Fills = Vec<(ShardIo, u32)>;

/// Shards to copy out of ready slots: each with its slot and the checksum
/// its bytes must match.
type Hits = Vec<(ShardIo, u32, u64)>;

/// Work decided for one shard of a load.
pub(super) enum LoadPlan {
    Hit(ShardIo, u32, u64),
    Wait(ShardIo, u32),
    Fill(ShardIo, u32),
    Bypass(ShardIo),
}

impl Inner {
    pub(super) fn plan_load(&self, shards: Vec<ShardIo>) -> (Vec<LoadPlan>, Vec<BlockId>) {
        let fill = matches!(
            self.cfg.fill_policy,
            FillPolicy::ReadAllocate | FillPolicy::ReuseAllocate
        );
        // Blocks this load would read straight into the caller for the first
        // time: under reuse_allocate they are read like bypasses, not kept.
        let first_loads = if self.cfg.fill_policy == FillPolicy::ReuseAllocate {
            self.seen_once.first_sightings(
                shards
                    .iter()
                    .filter(|s| self.reads_into_caller(s))
                    .map(|s| s.block),
            )
        } else {
            HashSet::new()
        };
        let mut first_load_shards = 0;
        let mut plans = Vec::with_capacity(shards.len());
        let mut wanted = Vec::new();
        let mut evictions = 0;
        let mut damaged = 0;
        let mut locked = true;
        for chunk in chunks_of(shards, LOCK_CHUNK) {
            // A table that can't be locked (the lock's bound passed) is a
            // miss: the shards are read from the backend, and the rest of
            // the load does not wait for the lock again.
            let g = if locked { self.table.lock().ok() } else { None };
            locked = g.is_some();
            let Some(mut g) = g else {
                plans.extend(chunk.into_iter().map(LoadPlan::Bypass));
                continue;
            };
            for s in chunk {
                let shard = s.index as u32;
                let found = g.find(&s.block, shard);
                if let Some(slot) = found.filter(|&slot| g.meta(slot).state != READY) {
                    g.pin(slot);
                    plans.push(LoadPlan::Wait(s, slot));
                    continue;
                }
                if let Some(slot) = found {
                    if let Some(sum) = g.checksum_of(slot, &s.block, shard) {
                        g.pin(slot);
                        g.access(slot);
                        plans.push(LoadPlan::Hit(s, slot, sum));
                        continue;
                    }
                    // Its metadata no longer vouches for its bytes: a miss.
                    g.drop_entry(slot);
                    damaged += 1;
                }
                if first_loads.contains(&s.block) {
                    first_load_shards += 1;
                    plans.push(LoadPlan::Bypass(s));
                } else if fill {
                    match g.alloc(&s.block, shard, &mut |_, m| wanted.push(BlockId(m.block))) {
                        Some(a) => {
                            evictions += u64::from(a.evicted);
                            plans.push(LoadPlan::Fill(s, a.slot));
                        }
                        None => plans.push(LoadPlan::Bypass(s)),
                    }
                } else {
                    plans.push(LoadPlan::Bypass(s));
                }
            }
        }
        add(&self.c.evictions, evictions);
        add(&self.c.corrupt_shards, damaged);
        add(&self.c.first_loads_not_kept, first_load_shards);
        self.read_past_fills(&mut plans);
        (plans, wanted)
    }

    /// Turns waits for slots still being filled into reads of the backend,
    /// where the backend reads locally into the caller's memory and holds
    /// the block. Such a slot is mostly filled after an earlier load, on a
    /// low-priority thread, with a second read of the same files: waiting
    /// for it made a repeated load wait for that whole fill, several times
    /// longer than the backend's own read. A block the backend lacks (its
    /// dump is still arriving in the slot) is waited for as before.
    fn read_past_fills(&self, plans: &mut [LoadPlan]) {
        let (waits, blocks): (Vec<usize>, Vec<BlockId>) = plans
            .iter()
            .enumerate()
            .filter_map(|(i, p)| match p {
                LoadPlan::Wait(s, _) if self.reads_into_caller(s) => Some((i, s.block)),
                _ => None,
            })
            .unzip();
        if waits.is_empty() {
            return;
        }
        let Ok(present) = self.backend.lookup(&blocks) else {
            return; // the waits stay: they need nothing of the backend
        };
        let mut unpin = Vec::new();
        for (&i, here) in waits.iter().zip(present) {
            if !here {
                continue;
            }
            if let LoadPlan::Wait(s, slot) = &plans[i] {
                unpin.push(*slot);
                plans[i] = LoadPlan::Bypass(s.clone());
            }
        }
        add(&self.c.fills_read_past, unpin.len() as u64);
        self.unpin_all(unpin);
    }

    pub(super) fn load(self: &Arc<Self>, rt: &Runtime, shards: Vec<ShardIo>) -> TaskId {
        let n = shards.len();
        let task = self.tasks.create("load", n);
        let ctx = TaskCtx::new(task.clone(), n, true, &self.in_flight);
        add(&self.c.load_shards, n as u64);
        let (plans, wanted) = self.plan_load(shards);
        self.lazy_want(wanted);
        let (mut hits, mut waits, mut fills, mut bypass): (Hits, Vec<_>, Fills, Vec<_>) =
            (vec![], vec![], vec![], vec![]);
        for p in plans {
            match p {
                LoadPlan::Hit(s, slot, sum) => hits.push((s, slot, sum)),
                LoadPlan::Wait(s, slot) => waits.push((s, slot)),
                LoadPlan::Fill(s, slot) => fills.push((s, slot)),
                LoadPlan::Bypass(s) => bypass.push(s),
            }
        }
        add(&self.c.l1_hits, hits.len() as u64);
        for job in self.copy_jobs(hits) {
            let (me, ctx2) = (self.clone(), ctx.clone());
            let units = job.len();
            let fg = self.wb.foreground();
            self.spawn_or_fail(&rt.copy, &ctx, units, move || {
                me.copy_out_hits(&ctx2, job);
                drop(fg);
            });
        }
        for (s, slot) in waits {
            let (me, ctx2) = (self.clone(), ctx.clone());
            self.spawn_or_fail(&rt.copy, &ctx, 1, move || me.wait_for_fill(&ctx2, s, slot));
        }
        if !fills.is_empty() {
            add(&self.c.fills, fills.len() as u64);
        }
        let direct;
        (direct, fills) = self.split_direct_fills(fills);
        if !direct.is_empty() {
            let unwritten = self.wb.dirty_among(direct.iter().map(|(s, _)| &s.block));
            let (me, ctx2) = (self.clone(), ctx.clone());
            let n = direct.len();
            let fill_pool = rt.fills.sender();
            self.spawn_or_fail(&rt.waits, &ctx, n, move || {
                me.direct_fill(&ctx2, direct, unwritten, fill_pool)
            });
        }
        if !fills.is_empty() {
            let items: Vec<_> = fills
                .iter()
                .map(|(s, slot)| (s.block, s.index, *slot))
                .collect();
            let unwritten = self.wb.dirty_among(fills.iter().map(|(s, _)| &s.block));
            let (me, ctx2) = (self.clone(), ctx.clone());
            let n = fills.len();
            if unwritten.is_empty() {
                let submitted = self.start_slot_load(&items, false);
                self.spawn_or_fail(&rt.waits, &ctx, n, move || {
                    me.finish_fill(&ctx2, submitted, fills)
                });
            } else {
                self.spawn_or_fail(&rt.waits, &ctx, n, move || {
                    me.wb.settle(&unwritten, me.deadline(&ctx2));
                    let submitted = me.start_slot_load(&items, false);
                    me.finish_fill(&ctx2, submitted, fills)
                });
            }
        }
        if !bypass.is_empty() {
            add(&self.c.bypass_loads, bypass.len() as u64);
            let (me, ctx2) = (self.clone(), ctx.clone());
            let n = bypass.len();
            self.spawn_or_fail(&rt.waits, &ctx, n, move || me.bypass_load(&ctx2, bypass));
        }
        task.id()
    }

    /// Copies ready slots out to the caller. Out of a shared segment, which
    /// other processes can write, each shard's bytes are checked against
    /// its checksum as they are copied; a shard that fails is a miss: its
    /// slot is dropped, the wrong bytes are cleared from the caller's host
    /// memory, and it is read from the backend instead. A private tier is
    /// this process's own memory, trusted as vLLM trusts its KV memory: the
    /// check took its hot loads from 10.2–10.6 to 7.2–8.4 GB/s
    /// (`benches/pipeline_bench.py`, hot load, 2 CPUs), and its write-back
    /// still checks every slot, so a changed byte never reaches the tier
    /// below as a block that verifies.
    pub(super) fn copy_out_hits(&self, ctx: &TaskCtx, items: Hits) {
        let mut outcomes = Vec::with_capacity(items.len());
        let mut corrupt = Vec::new();
        let check = self.cfg.share_buffer_enable;
        for (s, slot, sum) in &items {
            if ctx.task.should_skip() {
                outcomes.push(None);
                continue;
            }
            let data = self.table.data(*slot);
            // SAFETY: the slot is READY (immutable) and pinned by us, so it
            // holds shard_size valid bytes until we unpin; the caller
            // guarantees its segments are writable until the task completes,
            // which happens after this copy.
            let r = unsafe {
                if check {
                    self.transport.copy_out_summed(data, &s.segs)
                } else {
                    self.transport.copy_out(data, &s.segs).map(|()| *sum)
                }
            };
            match r {
                Ok(got) if got != *sum => {
                    self.clear_host(s);
                    corrupt.push((s.block, s.index as u32, *slot));
                    continue;
                }
                Ok(_) => add(&self.c.bytes_loaded_l1, self.cfg.shard_size as u64),
                Err(_) => {}
            }
            outcomes.push(Some(r.map(|_| ())));
        }
        self.discard_corrupt(&corrupt, "by a load");
        self.unpin_all(items.iter().map(|(_, slot, _)| *slot));
        for o in outcomes {
            match o {
                Some(r) => ctx.done(&self.c, r),
                None => ctx.skip(&self.c),
            }
        }
        if !corrupt.is_empty() {
            let misses: Vec<ShardIo> = items
                .into_iter()
                .filter(|(s, slot, _)| {
                    corrupt
                        .iter()
                        .any(|c| c.2 == *slot && c.0 == s.block && c.1 == s.index as u32)
                })
                .map(|(s, _, _)| s)
                .collect();
            add(&self.c.bypass_loads, misses.len() as u64);
            self.bypass_load(ctx, misses);
        }
    }

    /// Zeroes a shard's destination when it is host memory, so bytes that
    /// failed their check are not left where the caller reads (device
    /// memory is overwritten by the read that follows, or the load fails).
    fn clear_host(&self, s: &ShardIo) {
        if !self.transport.is_host(&s.segs) {
            return;
        }
        for seg in &s.segs {
            // SAFETY: the caller guarantees its segments are writable until
            // its task completes, which happens after this.
            unsafe { std::ptr::write_bytes(seg.addr as *mut u8, 0, seg.len) };
        }
    }

    pub(super) fn wait_for_fill(self: &Arc<Self>, ctx: &TaskCtx, s: ShardIo, slot: u32) {
        add(&self.c.fill_waits, 1);
        let mut pause = Duration::from_micros(20);
        let mut polls = 0u32;
        let mut checksum = 0;
        loop {
            let state = match self.table.lock() {
                Ok(mut g) => {
                    let mut st = g.meta(slot).state;
                    if st == READY {
                        match g.checksum_of(slot, &s.block, s.index as u32) {
                            Some(sum) => {
                                g.access(slot);
                                checksum = sum;
                            }
                            None => {
                                // Damaged metadata: a miss, read below.
                                g.drop_entry(slot);
                                add(&self.c.corrupt_shards, 1);
                                st = FREE;
                            }
                        }
                    }
                    st
                }
                Err(e) => {
                    self.table.defer([Release::Unpin(slot)]);
                    ctx.done(&self.c, Err(e));
                    return;
                }
            };
            match state {
                READY => {
                    add(&self.c.l1_hits, 1);
                    self.copy_out_hits(ctx, vec![(s, slot, checksum)]);
                    return;
                }
                FILLING => {
                    if ctx.task.should_skip() {
                        self.unpin_all([slot]);
                        ctx.skip(&self.c);
                        return;
                    }
                    polls += 1;
                    if polls % 4096 == 0 {
                        // The filler may be another process that died.
                        self.housekeep();
                    }
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_millis(1));
                }
                _ => {
                    // The fill we waited for failed: read it ourselves, so
                    // the caller gets the backend's own answer.
                    debug_assert_eq!(state, FREE);
                    self.unpin_all([slot]);
                    add(&self.c.bypass_loads, 1);
                    self.bypass_load(ctx, vec![s]);
                    return;
                }
            }
        }
    }

    pub(super) fn finish_fill(&self, ctx: &TaskCtx, submitted: SlotLoad, fills: Fills) {
        let res = self.finish_slot_load(submitted);
        match self.table.lock() {
            Ok(mut g) => {
                for (i, (_, slot)) in fills.iter().enumerate() {
                    match &res {
                        Ok(sums) => g.fill_done(*slot, false, sums[i]),
                        Err(_) => g.drop_entry(*slot),
                    }
                }
            }
            // The slots can't be published: they leave the index later.
            // Their bytes are still ours (FILLING, pinned) to copy out.
            Err(_) => self
                .table
                .defer(fills.iter().map(|(_, slot)| Release::Abandon(*slot))),
        }
        match res {
            Ok(sums) => {
                let n = fills.len() as u64;
                add(&self.c.l2_hits, n);
                add(&self.c.bytes_loaded_l2, n * self.cfg.shard_size as u64);
                let hits = fills
                    .into_iter()
                    .zip(sums)
                    .map(|((s, slot), sum)| (s, slot, sum))
                    .collect();
                self.copy_out_hits(ctx, hits);
            }
            Err(e) => {
                add(&self.c.l2_misses, fills.len() as u64);
                self.unpin_all(fills.iter().map(|(_, slot)| *slot));
                for _ in &fills {
                    ctx.done(&self.c, Err(e.clone()));
                }
            }
        }
    }

    /// Splits the fills whose reads go straight to the caller from those
    /// read into their slots first. A fresh slot is memory the process has
    /// never touched: filling it inside the load costs a page fault per
    /// page and a second copy, which made a cold load through the cache
    /// about half as fast as the backend alone. When the backend reads
    /// locally, the caller's bytes come straight from it and the slot is
    /// filled afterwards, off the load's critical path. Device memory, and
    /// backends where a second read is a second remote request, keep the
    /// read-then-copy path.
    fn split_direct_fills(&self, fills: Fills) -> (Fills, Fills) {
        if fills.is_empty() || !self.backend.reads_are_local() {
            return (Vec::new(), fills);
        }
        fills
            .into_iter()
            .partition(|(s, _)| self.reads_into_caller(s))
    }

    /// Whether the backend reads `s` straight into the caller's memory: it
    /// reads locally, and the memory is the host's.
    fn reads_into_caller(&self, s: &ShardIo) -> bool {
        self.backend.reads_are_local() && self.transport.is_host(&s.segs)
    }

    /// Reads `fills` from the backend into the caller's memory and finishes
    /// them; then queues the read of the same shards into their (still
    /// FILLING, pinned) slots on the low-priority fill pool. Loads of these
    /// shards meanwhile wait for the slot as for any fill. The second read
    /// never touches caller memory, which may be gone once its task has
    /// finished.
    pub(super) fn direct_fill(
        self: &Arc<Self>,
        ctx: &TaskCtx,
        fills: Fills,
        unwritten: Vec<BlockId>,
        fill_pool: Option<PoolSender>,
    ) {
        if !unwritten.is_empty() {
            self.wb.settle(&unwritten, self.deadline(ctx));
        }
        let caller: Vec<ShardIo> = fills.iter().map(|(s, _)| s.clone()).collect();
        let slots: Vec<(BlockId, usize, u32)> = fills
            .iter()
            .map(|(s, slot)| (s.block, s.index, *slot))
            .collect();
        drop(fills);
        let res = self.read_into_caller(ctx, caller);
        let ends: Vec<u32> = slots.iter().map(|&(_, _, slot)| slot).collect();
        let me = self.clone();
        let queued =
            res.is_ok() && fill_pool.is_some_and(|p| p.spawn(move || me.fill_slots(slots)));
        if !queued {
            self.end_fills(&ends, None);
        }
    }

    /// Reads shards into their slots, which then become ready (or leave
    /// the index if the read failed).
    fn fill_slots(&self, slots: Vec<(BlockId, usize, u32)>) {
        let n = slots.len() as u64;
        let filled = self.finish_slot_load(self.start_slot_load(&slots, true));
        if filled.is_ok() {
            add(&self.c.fills_after_load, n);
        }
        let ends: Vec<u32> = slots.iter().map(|&(_, _, slot)| slot).collect();
        self.end_fills(&ends, filled.ok().as_deref());
    }

    /// Loads shards straight from the backend: into the caller's memory
    /// when it is host memory and the backend reads locally (as for direct
    /// fills), otherwise through staging buffers. Fresh staging memory costs
    /// a page fault per page and a second copy: a 4k-token prompt loaded
    /// through it took a fresh vLLM engine over a second.
    pub(super) fn bypass_load(&self, ctx: &TaskCtx, items: Vec<ShardIo>) {
        let n = items.len();
        let unwritten = self.wb.dirty_among(items.iter().map(|s| &s.block));
        if !unwritten.is_empty() {
            self.wb.settle(&unwritten, self.deadline(ctx));
        }
        if items.iter().all(|s| self.reads_into_caller(s)) {
            // The outcome is already the task's, unit by unit.
            let _ = self.read_into_caller(ctx, items);
            return;
        }
        let bufs: Result<Vec<AlignedBuf>> = (0..n).map(|_| staging(self.cfg.shard_size)).collect();
        let mut bufs = match bufs {
            Ok(b) => b,
            Err(e) => {
                for _ in 0..n {
                    ctx.done(&self.c, Err(e.clone()));
                }
                return;
            }
        };
        let shards = self.staged_shards(&items, &mut bufs);
        let res = self.backend.load(shards).and_then(|t| self.backend.wait(t));
        self.count_backend_loads(n, &res);
        match res {
            Ok(()) => {
                for (s, b) in items.iter().zip(&bufs) {
                    if ctx.task.should_skip() {
                        ctx.skip(&self.c);
                        continue;
                    }
                    // SAFETY: `b` holds shard_size bytes we own; the caller's
                    // segments are writable until its task completes.
                    let r = unsafe { self.transport.copy_out(b.as_ptr(), &s.segs) };
                    ctx.done(&self.c, r);
                }
            }
            Err(e) => {
                for _ in 0..n {
                    ctx.done(&self.c, Err(e.clone()));
                }
            }
        }
    }

    /// Reads `shards` from the backend straight into the caller's memory,
    /// counts them and completes their units; returns the outcome.
    fn read_into_caller(&self, ctx: &TaskCtx, shards: Vec<ShardIo>) -> Result<()> {
        let n = shards.len();
        let res = self.backend.load(shards).and_then(|t| self.backend.wait(t));
        self.count_backend_loads(n, &res);
        for _ in 0..n {
            ctx.done(&self.c, res.clone());
        }
        res
    }

    /// Counts `n` shards read from the backend with outcome `res`.
    fn count_backend_loads(&self, n: usize, res: &Result<()>) {
        let n = n as u64;
        match res {
            Ok(()) => {
                add(&self.c.l2_hits, n);
                add(&self.c.bytes_loaded_l2, n * self.cfg.shard_size as u64);
            }
            Err(_) => add(&self.c.l2_misses, n),
        }
    }
}
