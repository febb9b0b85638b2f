//! The part of the remote tiers (the S3 store and the NFS store) that does
//! not depend on where the blocks live: one [`RemoteStore`] shell over a
//! [`RemoteBackend`] that knows how to probe, read and write block objects.
//!
//! Both tiers store a block in the shared block format ([`codec`]) addressed
//! by its id, look blocks up with one bounded-concurrency probe per id
//! behind a [`LookupCache`], load by reading the contiguous shards of a
//! block in one request and verifying every shard before a byte reaches
//! caller memory, run each block of a task as one [`Unit`] on their own
//! [`Runtime`] under the task's deadline, and fail fast through a
//! [`Breaker`] while the server is unreachable. How a block is written
//! (staged and PUT whole, or assembled in a temporary file and renamed)
//! and what closing must clean up are the backend's.
//!
//! [`codec`]: crate::store::format::codec

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

pub mod breaker;
pub mod env;
pub mod lookup;
pub mod runtime;
pub mod staging;

pub use breaker::Breaker;
pub use env::expand_env;
pub use lookup::{group_by_block, probe_all, probe_prefix, LookupCache};
pub use runtime::{run_blocking, spawn_unit, Runtime, Unit};

use super::{Store, StoreStats};
use crate::block::{BlockId, ShardIo};
use crate::error::{Result, UcmError};
use crate::store::format::codec::{check_shards, decode_region, read_len, runs};
use crate::store::format::Layout;
use crate::task::{TaskId, TaskRegistry};

/// Counters every remote tier reports (see [`RemoteStore::stats`]); the
/// backend adds its own.
#[derive(Default)]
pub struct RemoteCounters {
    pub(crate) lookups: AtomicU64,
    /// Presence probes that went to the server (cache misses).
    pub(crate) probes: AtomicU64,
    pub(crate) shards_loaded: AtomicU64,
    pub(crate) bytes_loaded: AtomicU64,
    /// Bytes of blocks made visible to readers (counted by the backend).
    pub(crate) bytes_dumped: AtomicU64,
    pub(crate) corrupt_loads: AtomicU64,
}

/// State a remote backend shares with its [`RemoteStore`] shell. Only this
/// crate can build one, which keeps [`RemoteBackend`] implementable here
/// only.
pub struct RemoteCore {
    pub(crate) layout: Layout,
    pub(crate) handle: tokio::runtime::Handle,
    pub(crate) tasks: TaskRegistry,
    pub(crate) cache: LookupCache,
    pub(crate) breaker: Arc<Breaker>,
    pub(crate) counters: RemoteCounters,
    pub(crate) timeout_ms: u64,
    pub(crate) max_concurrency: usize,
    pub(crate) transfers_enabled: bool,
}

impl RemoteCore {
    /// `cache` holds presence results; `breaker` is shared with whatever
    /// part of the backend sees transport failures.
    pub(crate) fn new(
        layout: Layout,
        handle: tokio::runtime::Handle,
        cache: LookupCache,
        breaker: Arc<Breaker>,
        timeout_ms: u64,
        max_concurrency: usize,
        transfers_enabled: bool,
    ) -> Self {
        RemoteCore {
            layout,
            handle,
            tasks: TaskRegistry::new(timeout_ms),
            cache,
            breaker,
            counters: RemoteCounters::default(),
            timeout_ms,
            max_concurrency,
            transfers_enabled,
        }
    }

    /// How long a partially dumped block may go without a new shard before
    /// it is dropped: layer-wise dumps of one block span many tasks, so
    /// well beyond one task's timeout.
    pub(crate) fn stale_after(&self) -> Duration {
        Duration::from_millis((self.timeout_ms * 2).max(60_000))
    }
}

/// Where and how one remote tier keeps block objects. Implemented by the
/// S3 and NFS backends of this crate.
pub trait RemoteBackend: Send + Sync + Sized + 'static {
    /// The store's name ([`Store::name`]), also heading task messages.
    const NAME: &'static str;
    /// The stats key counting presence probes sent to the server.
    const PROBE_STAT: &'static str;
    /// Bytes read from a block object.
    type Region: AsRef<[u8]> + Send + Sync + 'static;

    /// The state shared with the shell.
    fn core(&self) -> &RemoteCore;

    /// Where the blocks live, for messages (`s3://bucket/prefix`, ...).
    fn location(&self) -> &str;

    /// Refuses dumps the backend cannot take (a read-only export).
    fn check_dump(&self) -> Result<()> {
        Ok(())
    }

    /// Size of a block's object, `None` when absent. Transport failures are
    /// already recorded (breaker, counters) in the error returned.
    fn size_of(&self, id: &BlockId) -> impl Future<Output = Result<Option<u64>>> + Send;

    /// `len` bytes at `offset` of a block's object (fewer at its end);
    /// `UcmError::NotFound` when the object is absent.
    fn read(
        &self,
        id: &BlockId,
        offset: u64,
        len: usize,
    ) -> impl Future<Output = Result<Self::Region>> + Send;

    /// A load found the block's object corrupt (`e`): drop what the backend
    /// knows of it and, unless it is only another layout's, remove it so
    /// the next dump rewrites it.
    fn discard_corrupt(&self, id: &BlockId, e: &UcmError) -> impl Future<Output = ()> + Send;

    /// Writes the given shards of one block; a block becomes visible to
    /// readers only once all its shards are in.
    fn dump_group(
        self: Arc<Self>,
        block: BlockId,
        shards: Vec<ShardIo>,
    ) -> impl Future<Output = Result<()>> + Send;

    /// Called once by `close`, before the runtime stops: finish or clean up
    /// blocks still being written.
    fn before_shutdown(self: &Arc<Self>);

    /// Adds the backend's own figures to the store's stats.
    fn add_stats(&self, put: &mut dyn FnMut(&str, u64));
}

/// A store over a remote backend: the [`Store`] API, task plumbing,
/// lookups and verified loads. `S3Store` and `NfsStore` are instances.
pub struct RemoteStore<B: RemoteBackend> {
    backend: Arc<B>,
    runtime: Mutex<Option<Runtime>>,
    closed: AtomicBool,
}

impl<B: RemoteBackend> RemoteStore<B> {
    /// A store over `backend`, whose futures run on `runtime`.
    pub(crate) fn new(backend: Arc<B>, runtime: Runtime) -> Self {
        RemoteStore {
            backend,
            runtime: Mutex::new(Some(runtime)),
            closed: AtomicBool::new(false),
        }
    }

    pub(crate) fn backend(&self) -> &Arc<B> {
        &self.backend
    }

    /// Runs the future `f` makes of the backend on the store's runtime and
    /// waits for its result (maintenance work, outside any task).
    pub(crate) fn run_on_backend<T, F>(&self, f: impl FnOnce(Arc<B>) -> F) -> Result<T>
    where
        F: Future<Output = Result<T>> + Send + 'static,
        T: Send + 'static,
    {
        let b = Arc::clone(&self.backend);
        let handle = b.core().handle.clone();
        run_blocking(&handle, f(b))?
    }

    /// The block layout in use.
    pub fn layout(&self) -> &Layout {
        &self.backend.core().layout
    }

    fn ensure_open(&self) -> Result<()> {
        if self.closed.load(Ordering::Acquire) {
            return Err(UcmError::Closed);
        }
        Ok(())
    }

    fn check_transfer(&self, shards: &[ShardIo], dump: bool) -> Result<()> {
        self.ensure_open()?;
        let core = self.backend.core();
        if !core.transfers_enabled {
            return Err(UcmError::Unsupported(
                "load/dump are disabled in the lookup-only role (device_id = -1)".into(),
            ));
        }
        if dump {
            self.backend.check_dump()?;
        }
        check_shards(core.layout.shard_count, core.layout.shard_size, shards)
    }

    /// Runs `query` (over the ids, the probe concurrency and the backend)
    /// on the runtime and waits for its answer.
    fn run_lookup<T, Fut>(
        &self,
        ids: &[BlockId],
        query: impl FnOnce(Vec<BlockId>, usize, Arc<B>) -> Fut,
    ) -> Result<T>
    where
        Fut: Future<Output = T> + Send + 'static,
        T: Send + 'static,
    {
        self.ensure_open()?;
        let core = self.backend.core();
        core.counters.lookups.fetch_add(1, Ordering::Relaxed);
        let fut = query(ids.to_vec(), core.max_concurrency, self.backend.clone());
        run_blocking(&core.handle, fut)
    }

    /// Starts a `kind` task: one unit per block, running `per_block` on the
    /// runtime under the task's deadline.
    fn start_task<Fut>(
        &self,
        kind: &'static str,
        shards: Vec<ShardIo>,
        per_block: impl Fn(Arc<B>, BlockId, Vec<ShardIo>) -> Fut,
    ) -> Result<TaskId>
    where
        Fut: Future<Output = Result<()>> + Send + 'static,
    {
        let core = self.backend.core();
        let task = core.tasks.create(kind, shards.len());
        let deadline = (core.timeout_ms > 0)
            .then(|| tokio::time::Instant::now() + Duration::from_millis(core.timeout_ms));
        for (block, group) in group_by_block(shards, |s| s.block) {
            let unit = Unit::new(task.clone(), group.len());
            let fut = per_block(self.backend.clone(), block, group);
            spawn_unit(
                &core.handle,
                unit,
                deadline,
                format!("{} {kind} of block {block}", B::NAME),
                fut,
            );
        }
        Ok(task.id())
    }
}

/// Presence of one block: cache, else a probe. Errors count as absent (the
/// engine recomputes; a lookup never fails because the server did).
async fn present<B: RemoteBackend>(backend: Arc<B>, id: BlockId) -> bool {
    let core = backend.core();
    if let Some(p) = core.cache.get(&id) {
        return p;
    }
    if core.breaker.is_open() {
        return false;
    }
    core.counters.probes.fetch_add(1, Ordering::Relaxed);
    match backend.size_of(&id).await {
        Ok(size) => {
            // An object of another size is another layout's (or a
            // leftover), not a hit.
            let present = size == Some(core.layout.file_len());
            core.cache.put(id, present);
            present
        }
        Err(e) => {
            log::debug!("lookup of block {id} counted as a miss: {e}");
            false
        }
    }
}

/// Loads the given shards of one block: the contiguous ones in one read,
/// every shard verified before any caller memory is written.
async fn load_group<B: RemoteBackend>(
    backend: Arc<B>,
    block: BlockId,
    shards: Vec<ShardIo>,
) -> Result<()> {
    let core = backend.core();
    core.breaker.check(&format!("load of block {block}"))?;
    let layout = &core.layout;
    let stride = layout.stride;
    let mut idx: Vec<usize> = shards.iter().map(|s| s.index).collect();
    idx.sort_unstable();
    let reads = runs(&idx).into_iter().map(|(first, n)| {
        let backend = backend.clone();
        async move {
            let layout = &backend.core().layout;
            let len = (n - 1) * layout.stride + read_len(layout);
            let r = backend.read(&block, layout.offset(first), len).await;
            (first, n, r)
        }
    });
    let fetched = futures::future::join_all(reads).await;
    let mut regions = Vec::with_capacity(fetched.len());
    for (first, n, r) in fetched {
        match r {
            Ok(region) => regions.push((first, n, region)),
            Err(UcmError::NotFound(_)) => {
                // The server answered, so it is reachable.
                core.breaker.reset();
                core.cache.put(block, false);
                return Err(UcmError::NotFound(format!(
                    "block {block} is not in {}",
                    backend.location()
                )));
            }
            Err(e) => return Err(e),
        }
    }
    core.breaker.reset();
    let region_of = |index: usize| -> Option<&[u8]> {
        regions.iter().find_map(|(first, n, region)| {
            (index >= *first && index < first + n).then(|| {
                let bytes = region.as_ref();
                &bytes[((index - first) * stride).min(bytes.len())..]
            })
        })
    };
    for s in &shards {
        let raw = region_of(s.index).ok_or_else(|| {
            UcmError::TaskFailed(format!("block {block} shard {}: not fetched", s.index))
        })?;
        // SAFETY: the caller keeps the segments valid until its task
        // completes, which happens after this returns.
        if let Err(e) = unsafe { decode_region(layout, s, raw) } {
            core.counters.corrupt_loads.fetch_add(1, Ordering::Relaxed);
            core.cache.forget(&block);
            backend.discard_corrupt(&block, &e).await;
            return Err(e);
        }
        core.counters.shards_loaded.fetch_add(1, Ordering::Relaxed);
        core.counters
            .bytes_loaded
            .fetch_add(layout.shard_size as u64, Ordering::Relaxed);
    }
    Ok(())
}

impl<B: RemoteBackend> Store for RemoteStore<B> {
    fn name(&self) -> &'static str {
        B::NAME
    }

    fn lookup(&self, ids: &[BlockId]) -> Result<Vec<bool>> {
        self.run_lookup(ids, |ids, conc, b| {
            probe_all(ids, conc, move |id| present(b.clone(), id))
        })
    }

    fn lookup_on_prefix(&self, ids: &[BlockId]) -> Result<isize> {
        self.run_lookup(ids, |ids, conc, b| {
            probe_prefix(ids, conc, move |id| present(b.clone(), id))
        })
    }

    fn prefetch(&self, _ids: &[BlockId]) -> Result<()> {
        // A hint; loads read exactly the ranges they need, so there is
        // nothing worth fetching ahead.
        self.ensure_open()
    }

    fn load(&self, shards: Vec<ShardIo>) -> Result<TaskId> {
        self.check_transfer(&shards, false)?;
        self.start_task("load", shards, load_group::<B>)
    }

    fn dump(&self, shards: Vec<ShardIo>, _prerequisite: u64) -> Result<TaskId> {
        self.check_transfer(&shards, true)?;
        self.start_task("dump", shards, B::dump_group)
    }

    fn wait(&self, task: TaskId) -> Result<()> {
        self.backend.core().tasks.wait(task)
    }

    fn check(&self, task: TaskId) -> Result<bool> {
        self.backend.core().tasks.check(task)
    }

    fn close(&self) -> Result<()> {
        self.closed.store(true, Ordering::Release);
        let Some(rt) = self.runtime.lock().take() else {
            return Ok(());
        };
        self.backend.before_shutdown();
        rt.shutdown(Duration::from_secs(2));
        Ok(())
    }

    fn stats(&self) -> StoreStats {
        let core = self.backend.core();
        let c = &core.counters;
        let mut s = StoreStats::new();
        let mut put = |k: &str, v: u64| {
            s.insert(k.to_string(), v as f64);
        };
        put("lookups", c.lookups.load(Ordering::Relaxed));
        put(B::PROBE_STAT, c.probes.load(Ordering::Relaxed));
        put("shards_loaded", c.shards_loaded.load(Ordering::Relaxed));
        put("bytes_loaded", c.bytes_loaded.load(Ordering::Relaxed));
        put("bytes_dumped", c.bytes_dumped.load(Ordering::Relaxed));
        put("corrupt_loads", c.corrupt_loads.load(Ordering::Relaxed));
        put("breaker_trips", core.breaker.trips());
        let (hit, miss) = core.cache.counts();
        put("lookup_cache_hits", hit);
        put("lookup_cache_misses", miss);
        self.backend.add_stats(&mut put);
        s
    }
}

impl<B: RemoteBackend> Drop for RemoteStore<B> {
    fn drop(&mut self) {
        let _ = self.close();
    }
}
