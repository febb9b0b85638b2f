//! The write path (see the module docs of [`super`]): new shards copied
//! into slots and queued for write-back per `write_back_policy`, shards
//! without a slot written through to the backend.

use std::sync::Arc;
use std::time::Duration;

use super::stats::add;
use super::table::{Guard, Release, READY};
use super::{chunks_of, staging, FillPolicy, Inner, Runtime, TaskCtx, WriteBackPolicy, LOCK_CHUNK};
use crate::block::{BlockId, ShardIo};
use crate::error::{Result, UcmError};
use crate::task::TaskId;

/// Work decided for one shard of a dump.
pub(super) enum DumpPlan {
    Cached,
    Stage(ShardIo, u32),
    Bypass(ShardIo),
    Failed(UcmError),
}

/// A dump being planned: the plans so far and what deciding them found.
struct Planning {
    sync: bool,
    plans: Vec<DumpPlan>,
    /// Dirty slots the eviction policy offered (lazy write-back).
    wanted: Vec<BlockId>,
    /// Clean copies to write back again.
    redirty: Vec<(BlockId, u32, u32)>,
    evictions: u64,
    /// Slots found with damaged metadata, dropped.
    damaged: u64,
}

impl Planning {
    /// Plans one shard: served by the copy in the cache, staged into a new
    /// slot, or written straight through to the backend.
    fn plan(&mut self, g: &mut Guard<'_>, s: ShardIo) {
        let shard = s.index as u32;
        let mut found = g.find(&s.block, shard);
        if let Some(slot) = found {
            if g.meta(slot).state == READY && g.checksum_of(slot, &s.block, shard).is_none() {
                // Its metadata no longer vouches for its bytes: replaced by
                // this dump's.
                g.drop_entry(slot);
                self.damaged += 1;
                found = None;
            }
        }
        match found {
            Some(slot) => {
                let m = g.meta(slot);
                // Content-addressed: a ready copy holds these bytes.
                // A dirty one is on its way to the backend. A clean
                // one was written back, but the backend may have
                // evicted it since, and this dump must be loadable
                // after the cache drops its copy: write it back
                // again (a backend that still has it only notes the
                // dump). A sync dump must not return before the
                // backend has it, and a shard being filled may yet
                // fail.
                if m.state == READY && !self.sync {
                    if m.dirty == 0 {
                        g.mark_dirty(slot);
                        self.redirty.push((s.block, shard, slot));
                    }
                    self.plans.push(DumpPlan::Cached);
                } else {
                    self.plans.push(DumpPlan::Bypass(s));
                }
            }
            None => {
                let wanted = &mut self.wanted;
                match g.alloc(&s.block, shard, &mut |_, m| wanted.push(BlockId(m.block))) {
                    Some(a) => {
                        self.evictions += u64::from(a.evicted);
                        self.plans.push(DumpPlan::Stage(s, a.slot));
                    }
                    None => self.plans.push(DumpPlan::Bypass(s)),
                }
            }
        }
    }
}

impl Inner {
    pub(super) fn dump(
        self: &Arc<Self>,
        rt: &Runtime,
        shards: Vec<ShardIo>,
        prerequisite: u64,
    ) -> TaskId {
        let n = shards.len();
        let task = self.tasks.create("dump", n);
        let ctx = TaskCtx::new(task.clone(), n, false, &self.in_flight);
        add(&self.c.dump_shards, n as u64);
        let (mut stage, mut bypass) = (vec![], vec![]);
        for p in self.plan_dump(shards) {
            match p {
                DumpPlan::Cached => {
                    add(&self.c.dump_dedup, 1);
                    ctx.done(&self.c, Ok(()));
                }
                DumpPlan::Stage(s, slot) => stage.push((s, slot)),
                DumpPlan::Bypass(s) => bypass.push(s),
                DumpPlan::Failed(e) => ctx.done(&self.c, Err(e)),
            }
        }
        self.spawn_stage_jobs(rt, &ctx, stage, prerequisite);
        if !bypass.is_empty() {
            add(&self.c.bypass_dumps, bypass.len() as u64);
            let (me, ctx2) = (self.clone(), ctx.clone());
            let units = bypass.len();
            self.spawn_or_fail(&rt.waits, &ctx, units, move || {
                me.bypass_dump(&ctx2, bypass, prerequisite)
            });
        }
        task.id()
    }

    /// Decides each shard's plan under the table lock, a chunk of shards
    /// at a time, and passes on what deciding found: clean copies to write
    /// back again, dirty slots lazy write-back should write, evictions.
    fn plan_dump(&self, shards: Vec<ShardIo>) -> Vec<DumpPlan> {
        let mut p = Planning {
            sync: self.cfg.write_back_policy == WriteBackPolicy::Sync,
            plans: Vec::with_capacity(shards.len()),
            wanted: Vec::new(),
            redirty: Vec::new(),
            evictions: 0,
            damaged: 0,
        };
        for chunk in chunks_of(shards, LOCK_CHUNK) {
            match self.table.lock() {
                Ok(mut g) => chunk.into_iter().for_each(|s| p.plan(&mut g, s)),
                Err(e) => {
                    p.plans
                        .extend(chunk.iter().map(|_| DumpPlan::Failed(e.clone())));
                }
            }
        }
        add(&self.c.evictions, p.evictions);
        add(&self.c.corrupt_shards, p.damaged);
        self.wb.add(&p.redirty, false);
        self.lazy_want(p.wanted);
        p.plans
    }

    /// Copies staged shards into their slots on the copy pool, in jobs
    /// ([`Inner::copy_jobs`]).
    fn spawn_stage_jobs(
        self: &Arc<Self>,
        rt: &Runtime,
        ctx: &Arc<TaskCtx>,
        stage: Vec<(ShardIo, u32)>,
        prerequisite: u64,
    ) {
        for job in self.copy_jobs(stage) {
            let (me, ctx2) = (self.clone(), ctx.clone());
            let units = job.len();
            let fg = self.wb.foreground();
            // A failed spawn is unreachable in practice (the pool lives until
            // close); the slots would stay FILLING until the table is dropped.
            self.spawn_or_fail(&rt.copy, ctx, units, move || {
                me.stage_dump(&ctx2, job, prerequisite);
                drop(fg);
            });
        }
    }

    pub(super) fn stage_dump(&self, ctx: &TaskCtx, items: Vec<(ShardIo, u32)>, prerequisite: u64) {
        let mut results = Vec::with_capacity(items.len());
        for (s, slot) in &items {
            if ctx.task.should_skip() {
                results.push(None);
                continue;
            }
            // SAFETY: the slot is FILLING and owned by this task (pinned, in
            // nobody's read path), with shard_size bytes; the caller's
            // segments are readable until its task completes.
            let r = unsafe {
                self.transport
                    .copy_in_summed(self.table.data(*slot), &s.segs, prerequisite)
            };
            results.push(Some(r));
        }
        let mut dirty = Vec::new();
        match self.table.lock() {
            Ok(mut g) => {
                for ((s, slot), r) in items.iter().zip(&results) {
                    if let Some(Ok(checksum)) = r {
                        g.fill_done(*slot, true, *checksum);
                        dirty.push((s.block, s.index as u32, *slot));
                    } else {
                        g.drop_entry(*slot);
                    }
                    g.unpin(*slot);
                }
            }
            Err(e) => {
                // The slots can't be published, so the shards are in no
                // tier: the dump fails, and the slots leave the index later.
                self.table.defer(
                    items
                        .iter()
                        .flat_map(|(_, s)| [Release::Abandon(*s), Release::Unpin(*s)]),
                );
                for r in results.iter_mut().flatten() {
                    if r.is_ok() {
                        *r = Err(e.clone());
                    }
                }
            }
        }
        add(
            &self.c.bytes_dumped_l1,
            (dirty.len() * self.cfg.shard_size) as u64,
        );
        let wb_result = match self.cfg.write_back_policy {
            WriteBackPolicy::Sync if !dirty.is_empty() => {
                let r = self.write_blocks(&dirty);
                if let Err(e) = &r {
                    add(&self.c.write_back_failures, distinct_blocks(&dirty));
                    self.wb.add_failed(
                        &dirty,
                        e,
                        Duration::from_millis(self.cfg.write_back_max_backoff_ms),
                    );
                }
                r
            }
            WriteBackPolicy::Sync => Ok(()),
            _ => {
                self.wb.add(&dirty, false);
                Ok(())
            }
        };
        for r in results {
            match r {
                None => ctx.skip(&self.c),
                Some(Ok(_)) => ctx.done(&self.c, wb_result.clone()),
                Some(Err(e)) => ctx.done(&self.c, Err(e)),
            }
        }
    }

    pub(super) fn bypass_dump(&self, ctx: &TaskCtx, items: Vec<ShardIo>, prerequisite: u64) {
        let n = items.len();
        let res = (|| {
            let mut bufs = Vec::with_capacity(n);
            for s in &items {
                let mut b = staging(self.cfg.shard_size)?;
                // SAFETY: `b` has shard_size bytes we own; the caller's
                // segments (shard_size in total, checked at submit) are
                // readable until its task completes.
                unsafe {
                    self.transport
                        .copy_in(b.as_mut_ptr(), &s.segs, prerequisite)?
                };
                bufs.push(b);
            }
            let shards = self.staged_shards(&items, &mut bufs);
            let r = self
                .backend
                .dump(shards, 0)
                .and_then(|t| self.backend.wait(t));
            drop(bufs);
            r
        })();
        if res.is_ok() {
            add(&self.c.bytes_dumped_l2, (n * self.cfg.shard_size) as u64);
        }
        for _ in 0..n {
            ctx.done(&self.c, res.clone());
        }
    }

    /// Writes dirty slots (block, shard, slot) to the backend, waits, and
    /// on success cleans them. A shard whose slot failed its checksum
    /// meanwhile is not written, and fails the write: the dump that
    /// waits for it must not report it stored.
    fn write_blocks(&self, items: &[(BlockId, u32, u32)]) -> Result<()> {
        let (r, skipped) = self.finish_slot_write(self.start_slot_write(items));
        match skipped.first() {
            Some(&(block, shard)) if r.is_ok() => {
                Err(super::integrity::corrupt_slot(block, shard as usize))
            }
            _ => r,
        }
    }

    /// The backend has these slots' bytes: clean those that still hold
    /// what was written, drop them if the fill policy does not keep dumped
    /// blocks, and count them. A lock not had is the write's error: the
    /// slots stay dirty and are written again later (content-addressed,
    /// so the backend only notes it), never cleaned without the lock.
    pub(super) fn after_written(&self, items: &[(BlockId, u32, u32)]) -> Result<()> {
        let keep = self.cfg.fill_policy != FillPolicy::NoAllocate;
        let mut g = self.table.lock()?;
        for &(block, shard, slot) in items {
            let m = g.meta(slot);
            if m.block != block.0 || m.shard != shard || m.state != READY {
                continue; // dropped meanwhile (its bytes failed a check)
            }
            g.mark_clean(slot);
            if !keep {
                g.drop_entry(slot);
            }
        }
        drop(g);
        add(
            &self.c.bytes_dumped_l2,
            (items.len() * self.cfg.shard_size) as u64,
        );
        add(&self.c.write_back_blocks, distinct_blocks(items));
        Ok(())
    }
}

pub(super) fn distinct_blocks(items: &[(BlockId, u32, u32)]) -> u64 {
    let mut b: Vec<BlockId> = items.iter().map(|i| i.0).collect();
    b.sort_unstable();
    b.dedup();
    b.len() as u64
}
