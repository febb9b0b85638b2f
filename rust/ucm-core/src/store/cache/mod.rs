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
//! * `writeback`: what is dirty, retries with backoff, flush.
//! * `integrity`: each slot's checksum, where it comes from and what a
//!   slot that fails it becomes (a miss).
//!
//! # Read path
//!
//! `load` classifies every shard under the table lock: a **hit** (ready
//! slot) is pinned and copied out by a copy thread, which checks the bytes
//! against the slot's checksum as it copies them (a slot that fails is
//! dropped and its shard read from the backend instead); a shard another
//! task is **filling** is pinned and waited for (so two loads of a missing
//! shard read the backend once, and nobody reads half-written memory),
//! except that a local backend holding the block is read instead: such a
//! fill is mostly the slow background one after an earlier load, and
//! waiting for it would make the load slower than the backend alone; a
//! **miss** takes a slot in state FILLING and all misses of the task go to
//! the backend in one `load` aimed at the slots, then are copied out. When
//! `fill_policy` says not to keep load misses, or no slot can be taken
//! (every slot pinned or dirty), the shard is loaded into a staging buffer
//! instead (**bypass**). Under the default `reuse_allocate`, a block that a
//! local backend would read straight into host memory is a bypass on its
//! first load and kept on its second (see `admission`). A miss of a block
//! that still has dirty shards here first has that block written back
//! (read-your-writes: a dump that found slots for only part of a block
//! wrote the rest through, and the backend publishes the block only once
//! the cached part arrives). Lookups answer from the cache first and ask
//! the backend only about the rest.
//!
//! # Write path
//!
//! `dump` copies each new shard into a fresh slot (hashing the engine's
//! bytes in the same pass: the slot's checksum), marks it READY and dirty
//! (dirty slots are never evicted), then per `write_back_policy`: `sync`
//! writes the task's shards to the backend before completing; `async`
//! completes at once and queues them for the write-back thread, which
//! batches; `lazy` completes at once and leaves them until eviction wants
//! the slot, or `flush`/`close`. Shards already cached are not written again
//! (blocks are content-addressed). A write-back checks each slot against
//! its checksum, skips (and drops) one that fails, and hands the checksum
//! down with the slot so the backend stores it unchanged. A shard that
//! finds no slot, or one being filled concurrently, is written through a
//! staging buffer to the backend directly and its task completes only
//! once the backend has it. A failed backend write leaves the shard dirty,
//! counted and retried (see `writeback`); `flush` reports what still
//! fails; `close` flushes.
//!
//! # Threads
//!
//! Copy threads run hits, post-dump copies and waits on concurrent fills;
//! backend threads wait on backend tasks (fills, bypasses). The two pools
//! are separate so a copy thread waiting for a fill can never block the
//! thread that completes it. One write-back thread drains the dirty map
//! and, in shared mode, reaps dead participants and adopts their dirty
//! slots once a second.

mod admission;
mod config;
mod dump;
mod integrity;
mod load;
mod lookup;
pub mod policy;
mod prefault;
mod prefetch;
mod progress;
pub mod region;
mod stats;
pub mod table;
pub mod transport;
mod writeback;

pub use config::{CacheConfig, FillPolicy, WriteBackPolicy, KEYS};
pub use policy::PolicyKind;
pub use transport::DeviceMemory;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use self::progress::{InFlight, TaskCtx};
use self::stats::Counters;
use self::table::{Geometry, Release, Table};
use self::transport::Transport;
use self::writeback::WriteBack;
use super::{Store, StoreDebug, StoreFacts, StoreStats};
use crate::block::{BlockId, MemSeg, ShardIo};
use crate::error::{Result, UcmError};
use crate::io::AlignedBuf;
use crate::store::format::codec::check_shards;
use crate::task::{TaskId, TaskRegistry, WorkerPool};

/// Shards classified per table-lock acquisition, so one huge task does not
/// hold the lock for long.
const LOCK_CHUNK: usize = 256;
/// Bytes of hits copied per copy job: big enough to amortise the job,
/// small enough to spread a task over every copy thread.
const COPY_JOB_BYTES: usize = 4 << 20;
/// How often the write-back thread reaps dead participants (shared mode).
const HOUSEKEEPING: Duration = Duration::from_secs(1);

struct Inner {
    cfg: CacheConfig,
    // Declared before `table`: it unregisters the table's memory on drop.
    transport: Transport,
    table: Table,
    backend: Arc<dyn Store>,
    tasks: TaskRegistry,
    c: Counters,
    wb: Arc<WriteBack>,
    in_flight: Arc<InFlight>,
    /// Blocks loaded once, for `reuse_allocate`.
    seen_once: admission::SeenOnce,
    shard_count: usize,
}

struct Runtime {
    prefault: Option<prefault::Prefault>,
    copy: WorkerPool,
    waits: WorkerPool,
    /// Cache fills after loads that went straight to the caller, at low
    /// CPU priority: they must not slow the engine computing meanwhile.
    fills: WorkerPool,
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

/// `items` cut, in order, into pieces of `size` (the last may be
/// shorter), moving each item once.
fn chunks_of<T>(items: Vec<T>, size: usize) -> Vec<Vec<T>> {
    let size = size.max(1);
    let mut chunks = Vec::with_capacity(items.len().div_ceil(size));
    let mut it = items.into_iter();
    loop {
        let chunk: Vec<T> = it.by_ref().take(size).collect();
        if chunk.is_empty() {
            return chunks;
        }
        chunks.push(chunk);
    }
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
        let geo_slots = geo.n_slots;
        let lock_wait = table::lock_wait(cfg.timeout_ms);
        let table = if cfg.share_buffer_enable {
            Table::shared(&cfg.unique_id, geo, cfg.share_buffer_keep, lock_wait)?
        } else {
            Table::private(geo, lock_wait)?
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
            wb: Arc::default(),
            in_flight: Arc::default(),
            seen_once: admission::SeenOnce::new(geo_slots),
            cfg,
        });
        if inner.transfers() {
            inner.housekeep();
        }
        let prefault = if inner.cfg.prefault && inner.transfers() {
            Some(prefault::Prefault::start(inner.clone())?)
        } else {
            None
        };
        let copy = WorkerPool::new("ucm-cache-copy", inner.cfg.copy_threads)?;
        let waits = WorkerPool::new("ucm-cache-wait", inner.cfg.backend_threads)?;
        let fills = WorkerPool::background("ucm-cache-fill", 1)?;
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
                prefault,
                copy,
                waits,
                fills,
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

    /// Bytes of the data area backed by memory right now (`mincore`), to
    /// see what start-up committed.
    pub fn resident_data_bytes(&self) -> Result<usize> {
        let (base, len) = self.inner.table.data_area();
        region::resident_bytes(base, len)
    }

    /// Whether every shard of `id` is in the cache (ready), without asking
    /// the backend.
    pub fn cached(&self, id: &BlockId) -> Result<bool> {
        let g = self.inner.table.lock()?;
        Ok(self.inner.block_cached(&g, id))
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
        check_shards(self.inner.shard_count, self.inner.cfg.shard_size, shards)
    }
}

impl Inner {
    fn transfers(&self) -> bool {
        self.cfg.device_id >= 0
    }

    /// Drops our pins on `slots` (later, if the lock can't be had now).
    fn unpin_all(&self, slots: impl IntoIterator<Item = u32>) {
        self.table
            .release(slots.into_iter().map(Release::Unpin).collect());
    }

    fn slot_seg(&self, slot: u32) -> MemSeg {
        MemSeg {
            addr: self.table.data(slot) as usize,
            len: self.cfg.shard_size,
        }
    }

    /// Backend transfers into or out of slots: (block, shard index, slot).
    fn slot_shards(&self, items: impl IntoIterator<Item = (BlockId, usize, u32)>) -> Vec<ShardIo> {
        items
            .into_iter()
            .map(|(block, index, slot)| ShardIo {
                block,
                index,
                segs: vec![self.slot_seg(slot)],
            })
            .collect()
    }

    /// Backend transfers of `items`' shards through `bufs`, one each.
    fn staged_shards(&self, items: &[ShardIo], bufs: &mut [AlignedBuf]) -> Vec<ShardIo> {
        items
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
            .collect()
    }

    /// Ends background fills of `slots`: ready, with their checksums,
    /// when `filled` has them, otherwise out of the index; unpinned either
    /// way.
    /// A lock not had leaves them out of the index (later).
    fn end_fills(&self, slots: &[u32], filled: Option<&[u64]>) {
        match self.table.lock() {
            Ok(mut g) => {
                for (i, &slot) in slots.iter().enumerate() {
                    match filled.and_then(|sums| sums.get(i)) {
                        Some(&sum) => g.fill_done(slot, false, sum),
                        None => g.drop_entry(slot),
                    }
                    g.unpin(slot);
                }
            }
            Err(_) => self.table.defer(
                slots
                    .iter()
                    .flat_map(|&s| [Release::Abandon(s), Release::Unpin(s)]),
            ),
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
            Err(_) => return, // logged by the lock; tried again in a second
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

    /// `items` (one a shard) cut into copy jobs of about [`COPY_JOB_BYTES`].
    /// Each item is moved once: splitting the rest off again for every job
    /// moved the whole remainder each time, megabytes of `memmove` into
    /// freshly grown heap on the caller's thread for a load of 2,048 shards.
    fn copy_jobs<T>(&self, items: Vec<T>) -> Vec<Vec<T>> {
        chunks_of(items, (COPY_JOB_BYTES / self.cfg.shard_size.max(1)).max(1))
    }

    /// When a wait for the backend on behalf of `ctx` gives up.
    fn deadline(&self, ctx: &TaskCtx) -> Instant {
        ctx.task
            .deadline()
            .unwrap_or_else(|| Instant::now() + Duration::from_millis(self.cfg.timeout_ms.max(1)))
    }

    fn lazy_want(&self, wanted: Vec<BlockId>) {
        if self.cfg.write_back_policy == WriteBackPolicy::Lazy && !wanted.is_empty() {
            self.wb.want(&wanted);
        }
    }
}

impl Store for CacheStore {
    fn name(&self) -> &'static str {
        "Cache"
    }

    fn lookup(&self, ids: &[BlockId]) -> Result<Vec<bool>> {
        self.ensure_open()?;
        self.inner.lookup(ids)
    }

    fn lookup_on_prefix(&self, ids: &[BlockId]) -> Result<isize> {
        self.ensure_open()?;
        self.inner.lookup_on_prefix(ids)
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
        drop(rt.prefault.take());
        drop(rt.copy);
        drop(rt.waits);
        drop(rt.fills);
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

    fn describe(&self) -> StoreFacts {
        let mut m = StoreFacts::new();
        m.insert("slots".into(), self.slots().to_string());
        m.insert(
            "capacity_bytes".into(),
            self.inner.cfg.capacity_bytes.to_string(),
        );
        if let Some(p) = self.shm_path() {
            m.insert("shm_path".into(), p.to_string());
            // Where the slot table and its lock lie in the segment file, for tools
            // (and tests) that look into a segment.
            let t = self.inner.table.geometry().slot_table();
            m.insert("shm_slot_table".into(), format!("{}..{}", t.start, t.end));
            let l = self.inner.table.geometry().lock_bytes();
            m.insert("shm_lock".into(), format!("{}..{}", l.start, l.end));
        }
        for (k, v) in self.inner.backend.describe() {
            m.insert(format!("backend.{k}"), v);
        }
        m
    }

    fn debug(&self) -> Option<&dyn StoreDebug> {
        Some(self)
    }
}

impl StoreDebug for CacheStore {
    fn block_path(&self, id: &BlockId) -> Option<std::path::PathBuf> {
        self.inner.backend.debug()?.block_path(id)
    }

    /// Takes the table lock and never returns (the process is expected to
    /// be killed), to exercise recovery from a dead lock owner and the
    /// bound on waits for a live one.
    fn hold_lock_forever(&self) -> bool {
        let _g = loop {
            if let Ok(g) = self.inner.table.lock() {
                break g;
            }
        };
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    }
}

impl Drop for CacheStore {
    fn drop(&mut self) {
        let _ = self.close();
    }
}

#[cfg(test)]
mod tests {
    use super::chunks_of;

    #[test]
    fn chunks_keep_order_and_cover_every_item_once() {
        let jobs = chunks_of((0..10).collect(), 4);
        assert_eq!(jobs, vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7], vec![8, 9]]);
        assert!(chunks_of(Vec::<u8>::new(), 4).is_empty());
        assert_eq!(chunks_of(vec![1, 2], 0), vec![vec![1], vec![2]]);
    }
}
