//! The read path (see the module docs of [`super`]): hits copied out,
//! concurrent fills waited for (or read past, over a local backend),
//! misses filled from the backend in one request per task, bypasses
//! through staging buffers.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use super::stats::add;
use super::table::{FILLING, FREE, READY};
use super::{chunks_of, staging, FillPolicy, Inner, Runtime, TaskCtx, LOCK_CHUNK};
use crate::block::{BlockId, ShardIo};
use crate::error::{Result, UcmError};
use crate::io::AlignedBuf;
use crate::task::{PoolSender, TaskId};

/// Shards to fill, each with the slot allocated for it.
type Fills = Vec<(ShardIo, u32)>;

/// Work decided for one shard of a load.
pub(super) enum LoadPlan {
    Hit(ShardIo, u32),
    Wait(ShardIo, u32),
    Fill(ShardIo, u32),
    Bypass(ShardIo),
    Failed(UcmError),
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
        for chunk in chunks_of(shards, LOCK_CHUNK) {
            let mut g = match self.table.lock() {
                Ok(g) => g,
                Err(e) => {
                    plans.extend(chunk.iter().map(|_| LoadPlan::Failed(e.clone())));
                    continue;
                }
            };
            for s in chunk {
                let shard = s.index as u32;
                if let Some(slot) = g.find(&s.block, shard) {
                    g.pin(slot);
                    if g.meta(slot).state == READY {
                        g.access(slot);
                        plans.push(LoadPlan::Hit(s, slot));
                    } else {
                        plans.push(LoadPlan::Wait(s, slot));
                    }
                } else if first_loads.contains(&s.block) {
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
        let (mut hits, mut waits, mut fills, mut bypass): (Vec<_>, Vec<_>, Fills, Vec<_>) =
            (vec![], vec![], vec![], vec![]);
        for p in plans {
            match p {
                LoadPlan::Hit(s, slot) => hits.push((s, slot)),
                LoadPlan::Wait(s, slot) => waits.push((s, slot)),
                LoadPlan::Fill(s, slot) => fills.push((s, slot)),
                LoadPlan::Bypass(s) => bypass.push(s),
                LoadPlan::Failed(e) => ctx.done(&self.c, Err(e)),
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
            let shards = self.slot_shards(fills.iter().map(|(s, slot)| (s.block, s.index, *slot)));
            let unwritten = self.wb.dirty_among(fills.iter().map(|(s, _)| &s.block));
            let (me, ctx2) = (self.clone(), ctx.clone());
            let n = fills.len();
            if unwritten.is_empty() {
                let submitted = self.backend.load(shards);
                self.spawn_or_fail(&rt.waits, &ctx, n, move || {
                    me.finish_fill(&ctx2, submitted, fills)
                });
            } else {
                self.spawn_or_fail(&rt.waits, &ctx, n, move || {
                    me.wb.settle(&unwritten, me.deadline(&ctx2));
                    let submitted = me.backend.load(shards);
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

    pub(super) fn copy_out_hits(&self, ctx: &TaskCtx, items: Vec<(ShardIo, u32)>) {
        let mut outcomes = Vec::with_capacity(items.len());
        for (s, slot) in &items {
            if ctx.task.should_skip() {
                outcomes.push(None);
                continue;
            }
            // SAFETY: the slot is READY (immutable) and pinned by us, so it
            // holds shard_size valid bytes until we unpin; the caller
            // guarantees its segments are writable until the task completes,
            // which happens after this copy.
            let r = unsafe { self.transport.copy_out(self.table.data(*slot), &s.segs) };
            if r.is_ok() {
                add(&self.c.bytes_loaded_l1, self.cfg.shard_size as u64);
            }
            outcomes.push(Some(r));
        }
        self.unpin_all(items.iter().map(|(_, slot)| *slot));
        for o in outcomes {
            match o {
                Some(r) => ctx.done(&self.c, r),
                None => ctx.skip(&self.c),
            }
        }
    }

    pub(super) fn wait_for_fill(self: &Arc<Self>, ctx: &TaskCtx, s: ShardIo, slot: u32) {
        add(&self.c.fill_waits, 1);
        let mut pause = Duration::from_micros(20);
        let mut polls = 0u32;
        loop {
            let state = match self.table.lock() {
                Ok(mut g) => {
                    let st = g.meta(slot).state;
                    if st == READY {
                        g.access(slot);
                    }
                    st
                }
                Err(e) => {
                    ctx.done(&self.c, Err(e));
                    return;
                }
            };
            match state {
                READY => {
                    add(&self.c.l1_hits, 1);
                    self.copy_out_hits(ctx, vec![(s, slot)]);
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

    pub(super) fn finish_fill(
        &self,
        ctx: &TaskCtx,
        submitted: Result<TaskId>,
        fills: Vec<(ShardIo, u32)>,
    ) {
        let res = submitted.and_then(|t| self.backend.wait(t));
        if let Ok(mut g) = self.table.lock() {
            for (_, slot) in &fills {
                if res.is_ok() {
                    g.fill_done(*slot, false);
                } else {
                    g.drop_entry(*slot);
                }
            }
        }
        match res {
            Ok(()) => {
                let n = fills.len() as u64;
                add(&self.c.l2_hits, n);
                add(&self.c.bytes_loaded_l2, n * self.cfg.shard_size as u64);
                self.copy_out_hits(ctx, fills);
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
            self.end_fills(ends, false);
        }
    }

    /// Reads shards into their slots, which then become ready (or leave
    /// the index if the read failed).
    fn fill_slots(&self, slots: Vec<(BlockId, usize, u32)>) {
        let n = slots.len() as u64;
        let shards = self.slot_shards(slots.iter().copied());
        let filled = self
            .backend
            .load_in_background(shards)
            .and_then(|t| self.backend.wait(t));
        if filled.is_ok() {
            add(&self.c.fills_after_load, n);
        }
        self.end_fills(slots.iter().map(|&(_, _, slot)| slot), filled.is_ok());
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
