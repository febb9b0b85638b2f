//! The Cache store: a host-memory tier of fixed capacity in front of any
//! other [`Store`] (the *backend*: Posix, Empty, a store written in Python,
//! another cache).
//!
//! # Structure
//!
//! * [`table`]: one slot per (block, shard), page-aligned, in one region
//!   (private memory, or a `/dev/shm` segment in shared mode, see
//!   [`region`]); a hash index, slot states and pins under one robust
//!   process-shared mutex; the eviction [`policy`] (S3-FIFO by default,
//!   chosen by measurement, see its module docs).
//! * [`transport`]: memcpy, or CUDA async copies on the cache's own streams
//!   when the caller's memory is on a GPU.
//! * [`writeback`]: what is dirty, retries with backoff, flush.
//!
//! # Read path
//!
//! `load` classifies every shard under the table lock: a **hit** (ready
//! slot) is pinned and copied out by a copy thread; a shard another task is
//! **filling** is pinned and waited for (so two loads of a missing shard
//! read the backend once, and nobody reads half-written memory); a **miss**
//! takes a slot in state FILLING and all misses of the task go to the
//! backend in one `load` aimed at the slots, then are copied out. When
//! `fill_policy` says not to keep load misses, or no slot can be taken
//! (every slot pinned or dirty), the shard is loaded into a staging buffer
//! instead (**bypass**). A miss of a block that still has dirty shards here
//! first has that block written back (read-your-writes: a dump that found
//! slots for only part of a block wrote the rest through, and the backend
//! publishes the block only once the cached part arrives). Lookups answer
//! from the cache first and ask the backend only about the rest.
//!
//! # Write path
//!
//! `dump` copies each new shard into a fresh slot, marks it READY and dirty
//! (dirty slots are never evicted), then per `write_back_policy`: `sync`
//! writes the task's shards to the backend before completing; `async`
//! completes at once and queues them for the write-back thread, which
//! batches; `lazy` completes at once and leaves them until eviction wants
//! the slot, or `flush`/`close`. Shards already cached are not written again
//! (blocks are content-addressed). A shard that finds no slot, or one being
//! filled concurrently, is written through a staging buffer to the backend
//! directly and its task completes only once the backend has it. A failed
//! backend write leaves the shard dirty, counted and retried (see
//! [`writeback`]); `flush` reports what still fails; `close` flushes.
//!
//! # Threads
//!
//! Copy threads run hits, post-dump copies and waits on concurrent fills;
//! backend threads wait on backend tasks (fills, bypasses). The two pools
//! are separate so a copy thread waiting for a fill can never block the
//! thread that completes it. One write-back thread drains the dirty map
//! and, in shared mode, reaps dead participants and adopts their dirty
//! slots once a second.

mod config;
pub mod policy;
pub mod region;
mod stats;
pub mod table;
pub mod transport;
mod writeback;

pub use config::{CacheConfig, FillPolicy, WriteBackPolicy, KEYS};
pub use policy::PolicyKind;
pub use transport::DeviceMemory;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use self::stats::{add, get, Counters};
use self::table::{Geometry, Table, FILLING, FREE, READY};
use self::transport::Transport;
use self::writeback::{backoff, WriteBack};
use super::{Store, StoreStats};
use crate::block::{BlockId, MemSeg, ShardIo};
use crate::error::{Result, UcmError};
use crate::io::AlignedBuf;
use crate::task::{Task, TaskId, TaskRegistry, WorkerPool};

/// Shards classified per table-lock acquisition, so one huge task does not
/// hold the lock for long.
const LOCK_CHUNK: usize = 256;
/// Bytes of hits copied per copy job: big enough to amortise the job,
/// small enough to spread a task over every copy thread.
const COPY_JOB_BYTES: usize = 4 << 20;
/// How often the write-back thread reaps dead participants (shared mode).
const HOUSEKEEPING: Duration = Duration::from_secs(1);

/// Per-task completion bookkeeping (latency of loads).
struct TaskCtx {
    task: Arc<Task>,
    start: Instant,
    remaining: AtomicUsize,
    is_load: bool,
}

impl TaskCtx {
    fn new(task: Arc<Task>, units: usize, is_load: bool) -> Arc<Self> {
        Arc::new(TaskCtx {
            task,
            start: Instant::now(),
            remaining: AtomicUsize::new(units),
            is_load,
        })
    }

    fn finish_one(&self, c: &Counters) {
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 && self.is_load {
            c.load_latency.record(self.start.elapsed());
        }
    }

    // Bookkeeping first: once the last unit completes, the caller's `wait`
    // returns and may read the stats.
    fn done(&self, c: &Counters, outcome: Result<()>) {
        self.finish_one(c);
        self.task.complete_unit(outcome);
    }

    fn skip(&self, c: &Counters) {
        self.finish_one(c);
        self.task.skip_unit();
    }
}

struct Inner {
    cfg: CacheConfig,
    // Declared before `table`: it unregisters the table's memory on drop.
    transport: Transport,
    table: Table,
    backend: Arc<dyn Store>,
    tasks: TaskRegistry,
    c: Counters,
    wb: WriteBack,
    shard_count: usize,
}

struct Runtime {
    copy: WorkerPool,
    waits: WorkerPool,
    writer: Option<JoinHandle<()>>,
}

/// The host-memory tier (see the module docs).
pub struct CacheStore {
    inner: Arc<Inner>,
    rt: Mutex<Option<Runtime>>,
    closed: AtomicBool,
}

fn staging(len: usize) -> Result<AlignedBuf> {
    AlignedBuf::try_new(len)
        .map_err(|_| UcmError::OutOfMemory(format!("staging buffer of {len} bytes")))
}

impl CacheStore {
    /// Builds the cache over `backend` (which it owns from now on: closing
    /// the cache flushes into it and then closes it).
    pub fn open(cfg: CacheConfig, backend: Arc<dyn Store>) -> Result<Self> {
        cfg.validate()?;
        let geo = Geometry::new(
            cfg.slots(),
            cfg.shard_size,
            cfg.block_size,
            cfg.eviction_policy,
        );
        let table = if cfg.share_buffer_enable {
            Table::shared(&cfg.unique_id, geo)?
        } else {
            Table::private(geo)?
        };
        let transport = Transport::new(
            cfg.device_id,
            cfg.device_memory,
            cfg.cache_stream_number,
            table.data_area(),
        )?;
        let inner = Arc::new(Inner {
            shard_count: cfg.shard_count(),
            tasks: TaskRegistry::new(cfg.timeout_ms),
            transport,
            table,
            backend,
            c: Counters::default(),
            wb: WriteBack::default(),
            cfg,
        });
        if inner.transfers() {
            inner.housekeep();
        }
        let copy = WorkerPool::new("ucm-cache-copy", inner.cfg.copy_threads)?;
        let waits = WorkerPool::new("ucm-cache-wait", inner.cfg.backend_threads)?;
        let wb_inner = inner.clone();
        let writer = std::thread::Builder::new()
            .name("ucm-cache-writeback".into())
            .spawn(move || wb_inner.write_back_loop())
            .map_err(|e| UcmError::os("spawn thread", "ucm-cache-writeback", e))?;
        log::info!(
            "cache store: {} slot(s) of {} bytes ({}), eviction {}, fill {}, write-back {}, backend {}",
            inner.table.geometry().n_slots,
            inner.cfg.shard_size,
            inner.table.shm_path().unwrap_or("private memory"),
            inner.cfg.eviction_policy,
            inner.cfg.fill_policy,
            inner.cfg.write_back_policy,
            inner.backend.name()
        );
        Ok(CacheStore {
            inner,
            rt: Mutex::new(Some(Runtime {
                copy,
                waits,
                writer: Some(writer),
            })),
            closed: AtomicBool::new(false),
        })
    }

    /// The configuration in use.
    pub fn config(&self) -> &CacheConfig {
        &self.inner.cfg
    }

    /// The store below the cache.
    pub fn backend(&self) -> &Arc<dyn Store> {
        &self.inner.backend
    }

    /// Number of slots.
    pub fn slots(&self) -> usize {
        self.inner.table.geometry().n_slots
    }

    /// Path of the shared segment (shared mode).
    pub fn shm_path(&self) -> Option<&str> {
        self.inner.table.shm_path()
    }

    /// True when copies to device memory use CUDA.
    pub fn has_cuda(&self) -> bool {
        self.inner.transport.has_cuda()
    }

    /// Whether every shard of `id` is in the cache (ready), without asking
    /// the backend.
    pub fn cached(&self, id: &BlockId) -> Result<bool> {
        let g = self.inner.table.lock()?;
        Ok(self.inner.block_cached(&g, id))
    }

    #[doc(hidden)]
    /// Test hook: takes the table lock and never returns (the process is
    /// expected to be killed), to exercise recovery from a dead lock owner.
    pub fn debug_hold_lock_forever(&self) -> ! {
        let _g = self.inner.table.lock();
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    }

    fn ensure_open(&self) -> Result<()> {
        if self.closed.load(Ordering::Acquire) {
            Err(UcmError::Closed)
        } else {
            Ok(())
        }
    }

    fn check_shards(&self, shards: &[ShardIo]) -> Result<()> {
        self.ensure_open()?;
        if !self.inner.transfers() {
            return Err(UcmError::Unsupported(
                "load/dump are disabled in the lookup-only role (device_id = -1)".into(),
            ));
        }
        let cfg = &self.inner.cfg;
        for (i, s) in shards.iter().enumerate() {
            if s.index >= self.inner.shard_count {
                return Err(UcmError::invalid(format!(
                    "shard_index[{i}] = {} is out of range: blocks have {} shard(s)",
                    s.index, self.inner.shard_count
                )));
            }
            if s.len() != cfg.shard_size {
                return Err(UcmError::invalid(format!(
                    "shard {i} (block {}): tensors sum to {} bytes, expected shard_size {}",
                    s.block,
                    s.len(),
                    cfg.shard_size
                )));
            }
            if s.segs.iter().any(|g| g.addr == 0) {
                return Err(UcmError::invalid(format!("shard {i}: null memory address")));
            }
        }
        Ok(())
    }
}

/// Work decided for one shard of a load.
enum LoadPlan {
    Hit(ShardIo, u32),
    Wait(ShardIo, u32),
    Fill(ShardIo, u32),
    Bypass(ShardIo),
    Failed(UcmError),
}

/// Work decided for one shard of a dump.
enum DumpPlan {
    Cached,
    Stage(ShardIo, u32),
    Bypass(ShardIo),
    Failed(UcmError),
}

impl Inner {
    fn transfers(&self) -> bool {
        self.cfg.device_id >= 0
    }

    fn block_cached(&self, g: &table::Guard<'_>, id: &BlockId) -> bool {
        (0..self.shard_count as u32).all(|s| {
            g.find(id, s)
                .is_some_and(|slot| g.meta(slot).state == READY)
        })
    }

    fn unpin_all(&self, slots: impl IntoIterator<Item = u32>) {
        if let Ok(mut g) = self.table.lock() {
            for s in slots {
                g.unpin(s);
            }
        }
    }

    fn slot_seg(&self, slot: u32) -> MemSeg {
        MemSeg {
            addr: self.table.data(slot) as usize,
            len: self.cfg.shard_size,
        }
    }

    /// Reaps dead participants and adopts dirty slots nobody owns (shared
    /// mode; in private mode there is nobody else).
    fn housekeep(&self) {
        if !self.cfg.share_buffer_enable {
            return;
        }
        let orphans = match self.table.lock() {
            Ok(mut g) => {
                g.reap_dead();
                if self.transfers() {
                    g.adopt_orphans()
                } else {
                    Vec::new()
                }
            }
            Err(e) => {
                log::warn!("cache housekeeping: {e}");
                return;
            }
        };
        if !orphans.is_empty() {
            log::warn!(
                "adopted {} dirty shard(s) left by a departed participant; writing them back",
                orphans.len()
            );
            let items: Vec<_> = orphans.into_iter().map(|(s, b, sh)| (b, sh, s)).collect();
            self.wb.add(&items, true);
        }
    }

    // ---------------------------------------------------------------- load

    fn plan_load(&self, shards: Vec<ShardIo>) -> (Vec<LoadPlan>, Vec<BlockId>) {
        let fill = self.cfg.fill_policy == FillPolicy::ReadAllocate;
        let mut plans = Vec::with_capacity(shards.len());
        let mut wanted = Vec::new();
        let mut evictions = 0;
        let mut it = shards.into_iter().peekable();
        while it.peek().is_some() {
            let chunk: Vec<ShardIo> = it.by_ref().take(LOCK_CHUNK).collect();
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
        (plans, wanted)
    }

    fn load(self: &Arc<Self>, rt: &Runtime, shards: Vec<ShardIo>) -> TaskId {
        let n = shards.len();
        let task = self.tasks.create("load", n);
        let ctx = TaskCtx::new(task.clone(), n, true);
        add(&self.c.load_shards, n as u64);
        let (plans, wanted) = self.plan_load(shards);
        self.lazy_want(wanted);
        let (mut hits, mut waits, mut fills, mut bypass) = (vec![], vec![], vec![], vec![]);
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
        let per_job = (COPY_JOB_BYTES / self.cfg.shard_size.max(1)).max(1);
        while !hits.is_empty() {
            let rest = hits.split_off(hits.len().min(per_job));
            let job = std::mem::replace(&mut hits, rest);
            let (me, ctx2) = (self.clone(), ctx.clone());
            let units = job.len();
            self.spawn_or_fail(&rt.copy, &ctx, units, move || me.copy_out_hits(&ctx2, job));
        }
        for (s, slot) in waits {
            let (me, ctx2) = (self.clone(), ctx.clone());
            self.spawn_or_fail(&rt.copy, &ctx, 1, move || me.wait_for_fill(&ctx2, s, slot));
        }
        if !fills.is_empty() {
            add(&self.c.fills, fills.len() as u64);
            let shards: Vec<ShardIo> = fills
                .iter()
                .map(|(s, slot)| ShardIo {
                    block: s.block,
                    index: s.index,
                    segs: vec![self.slot_seg(*slot)],
                })
                .collect();
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

    /// Queues `job` or, if the pool is shut down, fails its `units`.
    fn spawn_or_fail(
        &self,
        pool: &WorkerPool,
        ctx: &Arc<TaskCtx>,
        units: usize,
        job: impl FnOnce() + Send + 'static,
    ) {
        if !pool.spawn(job) {
            for _ in 0..units {
                ctx.done(&self.c, Err(UcmError::Closed));
            }
        }
    }

    fn copy_out_hits(&self, ctx: &TaskCtx, items: Vec<(ShardIo, u32)>) {
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

    fn wait_for_fill(self: &Arc<Self>, ctx: &TaskCtx, s: ShardIo, slot: u32) {
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

    fn finish_fill(&self, ctx: &TaskCtx, submitted: Result<TaskId>, fills: Vec<(ShardIo, u32)>) {
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

    /// When a wait for the backend on behalf of `ctx` gives up.
    fn deadline(&self, ctx: &TaskCtx) -> Instant {
        ctx.task
            .deadline()
            .unwrap_or_else(|| Instant::now() + Duration::from_millis(self.cfg.timeout_ms.max(1)))
    }

    /// Loads shards through staging buffers, straight from the backend.
    fn bypass_load(&self, ctx: &TaskCtx, items: Vec<ShardIo>) {
        let n = items.len();
        let unwritten = self.wb.dirty_among(items.iter().map(|s| &s.block));
        if !unwritten.is_empty() {
            self.wb.settle(&unwritten, self.deadline(ctx));
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
        let shards = items
            .iter()
            .zip(bufs.iter_mut())
            .map(|(s, b)| ShardIo {
                block: s.block,
                index: s.index,
                segs: vec![MemSeg {
                    addr: b.as_mut_ptr() as usize,
                    len: self.cfg.shard_size,
                }],
            })
            .collect();
        let res = self.backend.load(shards).and_then(|t| self.backend.wait(t));
        match res {
            Ok(()) => {
                add(&self.c.l2_hits, n as u64);
                add(&self.c.bytes_loaded_l2, (n * self.cfg.shard_size) as u64);
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
                add(&self.c.l2_misses, n as u64);
                for _ in 0..n {
                    ctx.done(&self.c, Err(e.clone()));
                }
            }
        }
    }

    fn lazy_want(&self, wanted: Vec<BlockId>) {
        if self.cfg.write_back_policy == WriteBackPolicy::Lazy && !wanted.is_empty() {
            self.wb.want(&wanted);
        }
    }

    // ---------------------------------------------------------------- dump

    fn dump(self: &Arc<Self>, rt: &Runtime, shards: Vec<ShardIo>, prerequisite: u64) -> TaskId {
        let n = shards.len();
        let task = self.tasks.create("dump", n);
        let ctx = TaskCtx::new(task.clone(), n, false);
        add(&self.c.dump_shards, n as u64);
        let sync = self.cfg.write_back_policy == WriteBackPolicy::Sync;
        let mut plans = Vec::with_capacity(n);
        let mut wanted = Vec::new();
        let mut redirty = Vec::new();
        let mut evictions = 0;
        let mut it = shards.into_iter().peekable();
        while it.peek().is_some() {
            let chunk: Vec<ShardIo> = it.by_ref().take(LOCK_CHUNK).collect();
            let mut g = match self.table.lock() {
                Ok(g) => g,
                Err(e) => {
                    plans.extend(chunk.iter().map(|_| DumpPlan::Failed(e.clone())));
                    continue;
                }
            };
            for s in chunk {
                let shard = s.index as u32;
                match g.find(&s.block, shard) {
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
                        if m.state == READY && !sync {
                            if m.dirty == 0 {
                                g.mark_dirty(slot);
                                redirty.push((s.block, shard, slot));
                            }
                            plans.push(DumpPlan::Cached);
                        } else {
                            plans.push(DumpPlan::Bypass(s));
                        }
                    }
                    None => {
                        match g.alloc(&s.block, shard, &mut |_, m| wanted.push(BlockId(m.block))) {
                            Some(a) => {
                                evictions += u64::from(a.evicted);
                                plans.push(DumpPlan::Stage(s, a.slot));
                            }
                            None => plans.push(DumpPlan::Bypass(s)),
                        }
                    }
                }
            }
        }
        add(&self.c.evictions, evictions);
        self.wb.add(&redirty, false);
        self.lazy_want(wanted);
        let (mut stage, mut bypass) = (vec![], vec![]);
        for p in plans {
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
        let per_job = (COPY_JOB_BYTES / self.cfg.shard_size.max(1)).max(1);
        while !stage.is_empty() {
            let rest = stage.split_off(stage.len().min(per_job));
            let job = std::mem::replace(&mut stage, rest);
            let (me, ctx2) = (self.clone(), ctx.clone());
            let units = job.len();
            let ok = rt
                .copy
                .spawn(move || me.stage_dump(&ctx2, job, prerequisite));
            if !ok {
                // Unreachable in practice (the pool lives until close); the
                // slots stay FILLING until the table is dropped.
                for _ in 0..units {
                    ctx.done(&self.c, Err(UcmError::Closed));
                }
            }
        }
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

    fn stage_dump(&self, ctx: &TaskCtx, items: Vec<(ShardIo, u32)>, prerequisite: u64) {
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
                    .copy_in(self.table.data(*slot), &s.segs, prerequisite)
            };
            results.push(Some(r));
        }
        let mut dirty = Vec::new();
        if let Ok(mut g) = self.table.lock() {
            for ((s, slot), r) in items.iter().zip(&results) {
                if matches!(r, Some(Ok(()))) {
                    g.fill_done(*slot, true);
                    dirty.push((s.block, s.index as u32, *slot));
                } else {
                    g.drop_entry(*slot);
                }
                g.unpin(*slot);
            }
        }
        add(
            &self.c.bytes_dumped_l1,
            (dirty.len() * self.cfg.shard_size) as u64,
        );
        let wb_result = match self.cfg.write_back_policy {
            WriteBackPolicy::Sync if !dirty.is_empty() => {
                let r = self.write_blocks(&dirty);
                match &r {
                    Ok(()) => self.after_written(&dirty),
                    Err(e) => {
                        add(&self.c.write_back_failures, distinct_blocks(&dirty));
                        self.wb.add_failed(
                            &dirty,
                            e,
                            Duration::from_millis(self.cfg.write_back_max_backoff_ms),
                        );
                    }
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
                Some(Ok(())) => ctx.done(&self.c, wb_result.clone()),
                Some(Err(e)) => ctx.done(&self.c, Err(e)),
            }
        }
    }

    fn bypass_dump(&self, ctx: &TaskCtx, items: Vec<ShardIo>, prerequisite: u64) {
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
            let shards = items
                .iter()
                .zip(bufs.iter_mut())
                .map(|(s, b)| ShardIo {
                    block: s.block,
                    index: s.index,
                    segs: vec![MemSeg {
                        addr: b.as_mut_ptr() as usize,
                        len: self.cfg.shard_size,
                    }],
                })
                .collect();
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

    /// Writes dirty slots (block, shard, slot) to the backend and waits.
    fn write_blocks(&self, items: &[(BlockId, u32, u32)]) -> Result<()> {
        let shards = items
            .iter()
            .map(|&(block, shard, slot)| ShardIo {
                block,
                index: shard as usize,
                segs: vec![self.slot_seg(slot)],
            })
            .collect();
        let r = self
            .backend
            .dump(shards, 0)
            .and_then(|t| self.backend.wait(t));
        if r.is_ok() {
            add(
                &self.c.bytes_dumped_l2,
                (items.len() * self.cfg.shard_size) as u64,
            );
            add(&self.c.write_back_blocks, distinct_blocks(items));
        }
        r
    }

    /// The backend has these slots' bytes: clean them, and drop them if
    /// the fill policy does not keep dumped blocks.
    fn after_written(&self, items: &[(BlockId, u32, u32)]) {
        let keep = self.cfg.fill_policy != FillPolicy::NoAllocate;
        if let Ok(mut g) = self.table.lock() {
            for &(_, _, slot) in items {
                g.mark_clean(slot);
                if !keep {
                    g.drop_entry(slot);
                }
            }
        }
    }

    fn write_back_loop(self: Arc<Self>) {
        let interval = Duration::from_millis(self.cfg.write_back_interval_ms);
        let max_backoff = Duration::from_millis(self.cfg.write_back_max_backoff_ms);
        let lazy = self.cfg.write_back_policy == WriteBackPolicy::Lazy;
        let batch = self.cfg.write_back_batch_size;
        let mut last_housekeeping = Instant::now();
        loop {
            if self.cfg.share_buffer_enable && last_housekeeping.elapsed() >= HOUSEKEEPING {
                self.housekeep();
                last_housekeeping = Instant::now();
            }
            let (items, blocks, gen) = {
                let mut st = self.wb.state.lock();
                let now = Instant::now();
                let gen = st.flush_gen;
                let waiting = st
                    .dirty
                    .values()
                    .filter(|e| !e.inflight && e.next_try <= now)
                    .count();
                let mut next_wake = now + HOUSEKEEPING;
                let mut ready: Vec<(Instant, BlockId)> = Vec::new();
                for (b, e) in &st.dirty {
                    if e.inflight {
                        continue;
                    }
                    let flushing = e.tried_in_flush < gen;
                    if !flushing && e.next_try > now {
                        next_wake = next_wake.min(e.next_try);
                        continue;
                    }
                    let due = flushing
                        || e.wanted
                        || (!lazy && (waiting >= batch || e.since + interval <= now));
                    if due {
                        ready.push((e.since, *b));
                    } else if !lazy {
                        next_wake = next_wake.min(e.since + interval);
                    }
                }
                if ready.is_empty() {
                    if st.stop {
                        return;
                    }
                    self.wb.wake.wait_until(&mut st, next_wake);
                    continue;
                }
                ready.sort_unstable_by_key(|(since, _)| *since);
                ready.truncate(batch);
                let mut items = Vec::new();
                let mut blocks = Vec::new();
                for (_, b) in ready {
                    if let Some(e) = st.dirty.get_mut(&b) {
                        e.inflight = true;
                        items.extend(e.shards.iter().map(|(&sh, &slot)| (b, sh, slot)));
                        blocks.push((b, e.shards.keys().copied().collect::<Vec<_>>()));
                    }
                }
                (items, blocks, gen)
            };
            let res = self.write_blocks(&items);
            if res.is_ok() {
                self.after_written(&items);
            }
            let mut st = self.wb.state.lock();
            let now = Instant::now();
            for (b, written) in blocks {
                let Some(e) = st.dirty.get_mut(&b) else {
                    continue;
                };
                e.inflight = false;
                e.tried_in_flush = e.tried_in_flush.max(gen);
                match &res {
                    Ok(()) => {
                        for sh in written {
                            e.shards.remove(&sh);
                        }
                        e.attempts = 0;
                        e.last_error = None;
                        e.wanted = false;
                        if e.shards.is_empty() {
                            st.dirty.remove(&b);
                        }
                    }
                    Err(err) => {
                        add(&self.c.write_back_failures, 1);
                        e.attempts += 1;
                        e.next_try = now + backoff(e.attempts, max_backoff);
                        e.last_error = Some(err.clone());
                    }
                }
            }
            if let Err(e) = &res {
                log::warn!(
                    "write-back of {} shard(s) failed (kept dirty in the cache, will retry): {e}",
                    items.len()
                );
            }
            drop(st);
            self.wb.progress.notify_all();
        }
    }

    fn flush(&self) -> Result<()> {
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
        let failed: Vec<&writeback::Entry> = keys.iter().filter_map(|k| st.dirty.get(k)).collect();
        if failed.is_empty() {
            return Ok(());
        }
        let first = failed
            .iter()
            .find_map(|e| e.last_error.clone())
            .map_or_else(|| "not attempted".to_string(), |e| e.to_string());
        Err(UcmError::TaskFailed(format!(
            "flush: {} block(s) could not be written to the {} backend and stay dirty in \
             the cache (retried with backoff); first error: {first}",
            failed.len(),
            self.backend.name()
        )))
    }

    // ------------------------------------------------------------- prefetch

    fn prefetch(&self, ids: Vec<BlockId>) {
        let missing: Vec<BlockId> = match self.table.lock() {
            Ok(g) => ids
                .into_iter()
                .filter(|id| !self.block_cached(&g, id))
                .collect(),
            Err(_) => return,
        };
        if missing.is_empty() {
            return;
        }
        let present = match self.backend.lookup(&missing) {
            Ok(p) => p,
            Err(e) => {
                log::debug!("prefetch: backend lookup failed: {e}");
                return;
            }
        };
        let mut fills = Vec::new();
        let mut wanted = Vec::new();
        if let Ok(mut g) = self.table.lock() {
            'blocks: for (id, here) in missing.iter().zip(present) {
                if !here {
                    continue;
                }
                for shard in 0..self.shard_count as u32 {
                    if g.find(id, shard).is_some() {
                        continue;
                    }
                    match g.alloc(id, shard, &mut |_, m| wanted.push(BlockId(m.block))) {
                        Some(a) => {
                            add(&self.c.evictions, u64::from(a.evicted));
                            fills.push((*id, shard, a.slot));
                        }
                        None => break 'blocks,
                    }
                }
            }
        }
        self.lazy_want(wanted);
        if fills.is_empty() {
            return;
        }
        let shards = fills
            .iter()
            .map(|&(block, shard, slot)| ShardIo {
                block,
                index: shard as usize,
                segs: vec![self.slot_seg(slot)],
            })
            .collect();
        let res = self.backend.load(shards).and_then(|t| self.backend.wait(t));
        if let Ok(mut g) = self.table.lock() {
            for &(_, _, slot) in &fills {
                if res.is_ok() {
                    g.fill_done(slot, false);
                } else {
                    g.drop_entry(slot);
                }
                g.unpin(slot);
            }
        }
        match res {
            Ok(()) => {
                add(&self.c.prefetch_shards, fills.len() as u64);
                add(
                    &self.c.bytes_loaded_l2,
                    (fills.len() * self.cfg.shard_size) as u64,
                );
            }
            Err(e) => log::debug!("prefetch of {} shard(s) failed: {e}", fills.len()),
        }
    }

    fn stats(&self) -> StoreStats {
        let c = &self.c;
        let mut m = StoreStats::new();
        let load = get(&c.load_shards);
        let l1 = get(&c.l1_hits);
        let l2 = get(&c.l2_hits);
        let ratio = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
        let mut put = |k: &str, v: f64| {
            m.insert(k.to_string(), v);
        };
        put("l1_hit_rate", ratio(l1, load));
        put("l2_hit_rate", ratio(l2, load.saturating_sub(l1)));
        put("avg_load_latency_ms", c.load_latency.mean_ms());
        put("p99_load_latency_ms", c.load_latency.quantile_ms(0.99));
        put("load_tasks", c.load_latency.count() as f64);
        put("load_shards", load as f64);
        put("l1_hits", l1 as f64);
        put("l2_hits", l2 as f64);
        put("l2_misses", get(&c.l2_misses) as f64);
        put("bytes_loaded_l1", get(&c.bytes_loaded_l1) as f64);
        put("bytes_loaded_l2", get(&c.bytes_loaded_l2) as f64);
        put("dump_shards", get(&c.dump_shards) as f64);
        put("dump_dedup", get(&c.dump_dedup) as f64);
        put("bytes_dumped_l1", get(&c.bytes_dumped_l1) as f64);
        put("bytes_dumped_l2", get(&c.bytes_dumped_l2) as f64);
        put("eviction_count", get(&c.evictions) as f64);
        put("fills", get(&c.fills) as f64);
        put("fill_waits", get(&c.fill_waits) as f64);
        put("bypass_loads", get(&c.bypass_loads) as f64);
        put("bypass_dumps", get(&c.bypass_dumps) as f64);
        put("prefetch_shards", get(&c.prefetch_shards) as f64);
        put("write_back_blocks", get(&c.write_back_blocks) as f64);
        put("write_back_failures", get(&c.write_back_failures) as f64);
        put("dirty_blocks", self.wb.dirty_blocks() as f64);
        put("lookups", get(&c.lookups) as f64);
        put("lookup_l1_hits", get(&c.lookup_l1_hits) as f64);
        put("lookup_l2_hits", get(&c.lookup_l2_hits) as f64);
        put("slots", self.table.geometry().n_slots as f64);
        put("capacity_bytes", self.cfg.capacity_bytes as f64);
        if let Ok(g) = self.table.lock() {
            let used = g.used();
            drop(g);
            put("slots_used", f64::from(used));
        }
        m
    }
}

fn distinct_blocks(items: &[(BlockId, u32, u32)]) -> u64 {
    let mut b: Vec<BlockId> = items.iter().map(|i| i.0).collect();
    b.sort_unstable();
    b.dedup();
    b.len() as u64
}

impl Store for CacheStore {
    fn name(&self) -> &'static str {
        "Cache"
    }

    fn lookup(&self, ids: &[BlockId]) -> Result<Vec<bool>> {
        self.ensure_open()?;
        let inner = &self.inner;
        let mut out = Vec::with_capacity(ids.len());
        for chunk in ids.chunks(LOCK_CHUNK) {
            let g = inner.table.lock()?;
            out.extend(chunk.iter().map(|id| inner.block_cached(&g, id)));
        }
        let l1 = out.iter().filter(|h| **h).count();
        let misses: Vec<usize> = (0..ids.len()).filter(|&i| !out[i]).collect();
        let mut l2 = 0;
        if !misses.is_empty() {
            let q: Vec<BlockId> = misses.iter().map(|&i| ids[i]).collect();
            let r = inner.backend.lookup(&q)?;
            for (&i, hit) in misses.iter().zip(r) {
                out[i] = hit;
                l2 += usize::from(hit);
            }
        }
        add(&inner.c.lookups, ids.len() as u64);
        add(&inner.c.lookup_l1_hits, l1 as u64);
        add(&inner.c.lookup_l2_hits, l2 as u64);
        Ok(out)
    }

    fn lookup_on_prefix(&self, ids: &[BlockId]) -> Result<isize> {
        self.ensure_open()?;
        let inner = &self.inner;
        let n = ids.len();
        let (mut i, mut l1, mut l2) = (0usize, 0u64, 0u64);
        let result = loop {
            {
                let g = inner.table.lock()?;
                while i < n && inner.block_cached(&g, &ids[i]) {
                    i += 1;
                    l1 += 1;
                }
            }
            if i == n {
                break n as isize - 1;
            }
            let r = inner.backend.lookup_on_prefix(&ids[i..])?;
            if r < 0 {
                break i as isize - 1;
            }
            i += r as usize + 1;
            l2 += r as u64 + 1;
            if i >= n {
                break n as isize - 1;
            }
        };
        add(&inner.c.lookups, (l1 + l2 + u64::from(i < n)).min(n as u64));
        add(&inner.c.lookup_l1_hits, l1);
        add(&inner.c.lookup_l2_hits, l2);
        Ok(result)
    }

    fn prefetch(&self, ids: &[BlockId]) -> Result<()> {
        self.ensure_open()?;
        if !self.inner.transfers() || ids.is_empty() {
            return Ok(());
        }
        let rt = self.rt.lock();
        let rt = rt.as_ref().ok_or(UcmError::Closed)?;
        let inner = self.inner.clone();
        let ids = ids.to_vec();
        rt.waits.spawn(move || inner.prefetch(ids));
        Ok(())
    }

    fn load(&self, shards: Vec<ShardIo>) -> Result<TaskId> {
        self.check_shards(&shards)?;
        let rt = self.rt.lock();
        let rt = rt.as_ref().ok_or(UcmError::Closed)?;
        Ok(self.inner.load(rt, shards))
    }

    fn dump(&self, shards: Vec<ShardIo>, prerequisite: u64) -> Result<TaskId> {
        self.check_shards(&shards)?;
        let rt = self.rt.lock();
        let rt = rt.as_ref().ok_or(UcmError::Closed)?;
        Ok(self.inner.dump(rt, shards, prerequisite))
    }

    fn wait(&self, task: TaskId) -> Result<()> {
        self.inner.tasks.wait(task)
    }

    fn check(&self, task: TaskId) -> Result<bool> {
        self.inner.tasks.check(task)
    }

    fn flush(&self) -> Result<()> {
        self.ensure_open()?;
        if !self.inner.transfers() {
            return self.inner.backend.flush();
        }
        let mine = self.inner.flush();
        let below = self.inner.backend.flush();
        mine.and(below)
    }

    fn close(&self) -> Result<()> {
        if self.closed.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        let Some(mut rt) = self.rt.lock().take() else {
            return Ok(());
        };
        // Finish queued and running transfers first (joins the pools), then
        // write everything dirty down, then stop the writer.
        drop(rt.copy);
        drop(rt.waits);
        let flushed = if self.inner.transfers() {
            // Dirty slots of departed participants are written by us too.
            self.inner.housekeep();
            self.inner.flush()
        } else {
            Ok(())
        };
        self.inner.wb.state.lock().stop = true;
        self.inner.wb.wake.notify_all();
        if let Some(h) = rt.writer.take() {
            let _ = h.join();
        }
        if let Err(e) = &flushed {
            log::error!("closing the cache: {e}");
        }
        let below = self.inner.backend.close();
        self.inner.table.detach();
        flushed.and(below)
    }

    fn stats(&self) -> StoreStats {
        let mut m = self.inner.stats();
        for (k, v) in self.inner.backend.stats() {
            m.insert(format!("backend.{k}"), v);
        }
        m
    }
}

impl Drop for CacheStore {
    fn drop(&mut self) {
        let _ = self.close();
    }
}
