//! The NFS store: blocks as files on an NFS export shared by many
//! machines, reached either by the built-in user-space NFSv3 client
//! (`storage_backends: "nfs://server/export/path"`, no kernel mount and no
//! root needed; [`client`]) or through a directory the kernel already
//! mounted (`storage_backends: "/mnt/export/path"`).
//!
//! # Format and visibility
//!
//! Files are Posix block files at the Posix store's paths
//! (`<root>/<2 hex>/<32 hex>`, see [`crate::store::s3::codec`]), so every
//! load verifies header, layout fingerprint and checksum. A block is
//! written into a temporary file next to its final name,
//! `<32 hex>.tmp.<random writer token>.<seq>` (unique across machines, not
//! just processes), shard by shard at the shards' offsets, whatever task
//! and order they arrive in (layer-wise dumps); once every shard is in, the
//! writer makes the data stable (COMMIT after UNSTABLE WRITEs, or FILE_SYNC
//! writes with `sync`; `fsync` on a kernel mount) and only then RENAMEs the
//! file to its final name. RENAME within one directory is atomic on the
//! server, so a reader on any machine sees no file or the whole block:
//! close-to-open consistency without relying on any client cache. The unit
//! that completes a block completes after the rename, with its outcome;
//! other units complete once their shard is written (as in the Posix store).
//! If the server restarts between the WRITEs and the COMMIT (the write
//! verifier changes), the block is dropped rather than published.
//!
//! # Lookups
//!
//! One LOOKUP per id (its attributes give the size: a file of another size
//! is another layout's or a leftover, not a hit), `nfs_max_concurrency` at a
//! time, prefix lookups stopping at their first miss. Present results are
//! remembered for `nfs_lookup_cache_ttl_ms` (with the file handle, so loads
//! skip the LOOKUP); absent results never are: a block another engine
//! publishes is seen by the next lookup. On a kernel mount a miss is asked
//! twice, the second time after opening the directory, which makes the
//! kernel revalidate a cached negative entry.
//!
//! # Failures
//!
//! Each request has a timeout (`timeo`, else a tenth of `timeout_ms`, at
//! least 1 s) and is retried `retrans` times on a fresh connection; every
//! task unit is cut off at its task's deadline. Transport failures open a
//! [`Breaker`]: lookups answer "absent" and transfers fail at once for a
//! short, growing pause. Stale file handles (the file was replaced) are
//! looked up again once. An export that does not exist or refuses us fails
//! `open` with a message naming `storage_backends`.

pub mod client;
pub mod config;
pub mod fs;

pub use config::{MountOptions, NfsConfig, Target};

use std::collections::HashMap;
use std::hash::BuildHasherDefault;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nfs3_client::nfs3_types::nfs3::writeverf3;
use parking_lot::Mutex;

use self::fs::{Fs, LocalFs, RemoteFs, TempFile};
use super::s3::codec::{
    block_key, check_shards, decode_region, encode_region, is_layout_mismatch, read_len, runs,
};
use super::s3::shared::{
    group_by_block, probe_all, probe_prefix, run_blocking, spawn_unit, Breaker, LookupCache,
    Runtime, Unit,
};
use super::{Store, StoreStats};
use crate::block::{BlockId, ShardIo};
use crate::error::{Result, UcmError};
use crate::io::AlignedBuf;
use crate::store::posix::index::IdHasher;
use crate::store::posix::layout::Layout;
use crate::task::{TaskId, TaskRegistry};

type IdMap<V> = HashMap<BlockId, V, BuildHasherDefault<IdHasher>>;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Slot {
    Empty,
    InFlight,
    Done,
}

/// One block being assembled in a temporary file.
struct Assembly {
    tmp: String,
    file: tokio::sync::OnceCell<std::result::Result<Arc<TempFile>, UcmError>>,
    state: Mutex<AsmState>,
    changed: tokio::sync::Notify,
}

struct AsmState {
    slots: Vec<Slot>,
    done: usize,
    failed: Option<UcmError>,
    verf: Option<writeverf3>,
    last_activity: Instant,
    /// Set once the block left the map (published, failed or abandoned).
    closed: bool,
    published: bool,
}

#[derive(Default)]
struct Counters {
    lookups: AtomicU64,
    probes: AtomicU64,
    shards_loaded: AtomicU64,
    bytes_loaded: AtomicU64,
    shards_dumped: AtomicU64,
    bytes_dumped: AtomicU64,
    blocks_published: AtomicU64,
    publish_failures: AtomicU64,
    corrupt_loads: AtomicU64,
    abandoned: AtomicU64,
}

struct Shared {
    cfg: NfsConfig,
    layout: Layout,
    fs: Fs,
    label: String,
    read_only: bool,
    handle: tokio::runtime::Handle,
    tasks: TaskRegistry,
    cache: LookupCache,
    breaker: Arc<Breaker>,
    assemblies: Mutex<IdMap<Arc<Assembly>>>,
    token: String,
    seq: AtomicU64,
    last_sweep: Mutex<Instant>,
    counters: Counters,
}

/// Blocks as files on an NFS export.
pub struct NfsStore {
    shared: Arc<Shared>,
    runtime: Mutex<Option<Runtime>>,
    closed: AtomicBool,
}

fn writer_token() -> String {
    let mut b = [0u8; 8];
    let random = std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b))
        .is_ok();
    if !random {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        b = ((t as u64) ^ u64::from(std::process::id()).rotate_left(32)).to_le_bytes();
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

impl NfsStore {
    /// Validates `cfg`, connects (mounting with the built-in client, or
    /// checking the mounted directory) and creates the block directories
    /// when transfers are enabled.
    pub fn open(cfg: NfsConfig) -> Result<Self> {
        let (target, opts, ignored) = cfg.validate()?;
        if !ignored.is_empty() {
            log::info!("nfs_mount_options: ignoring {}", ignored.join(","));
        }
        let layout = Layout::new(cfg.block_size, cfg.shard_size, &cfg.tensor_size_list);
        let runtime = Runtime::new("ucm-nfs", cfg.io_threads)?;
        let handle = runtime.handle();
        let breaker = Arc::new(Breaker::default());
        let read_only = opts.read_only || !cfg.transfers_enabled();
        let ttl = if opts.lookupcache_none {
            Duration::ZERO
        } else {
            Duration::from_millis(cfg.lookup_cache_ttl_ms)
        };
        let (fs, label) = match &target {
            Target::Remote { host, path } => {
                let label = format!("nfs://{host}{path}");
                let rpc_timeout = opts.timeo.unwrap_or_else(|| {
                    Duration::from_millis((cfg.timeout_ms / 10).clamp(1000, 10_000))
                });
                let (h, p, o, conc) = (
                    host.clone(),
                    path.clone(),
                    opts.clone(),
                    cfg.max_concurrency,
                );
                let create = !read_only;
                let connected = run_blocking(&handle, async move {
                    client::Client::connect(&h, &p, &o, conc, rpc_timeout, create).await
                });
                let client = match connected {
                    Ok(Ok(c)) => c,
                    Ok(Err(e)) => {
                        runtime.shutdown(Duration::from_secs(1));
                        return Err(UcmError::invalid(format!(
                            "storage_backends: cannot use {label}: {e}"
                        )));
                    }
                    Err(e) => {
                        runtime.shutdown(Duration::from_secs(1));
                        return Err(e);
                    }
                };
                log::info!(
                    "NFS store over {label} (mounted {}, rtmax {} wtmax {})",
                    client.mounted,
                    client.rtmax,
                    client.wtmax
                );
                let remote = RemoteFs::new(client, opts.sync, ttl, breaker.clone(), label.clone());
                (Fs::Remote(Box::new(remote)), label)
            }
            Target::Mounted(dir) => {
                let meta = std::fs::metadata(dir).map_err(|e| {
                    UcmError::invalid(format!(
                        "storage_backends: directory {} is not usable: {e}",
                        dir.display()
                    ))
                })?;
                if !meta.is_dir() {
                    return Err(UcmError::invalid(format!(
                        "storage_backends: {} is not a directory",
                        dir.display()
                    )));
                }
                (
                    Fs::Local(LocalFs::new(dir.clone(), cfg.io_direct)),
                    dir.display().to_string(),
                )
            }
        };
        if !read_only {
            let made = match &fs {
                Fs::Local(l) => l.create_dirs(),
                Fs::Remote(_) => Ok(()),
            };
            if let Err(e) = made {
                runtime.shutdown(Duration::from_secs(1));
                return Err(UcmError::invalid(format!(
                    "storage_backends: cannot create the block directories under {label}: {e}"
                )));
            }
        }
        let shared = Arc::new(Shared {
            tasks: TaskRegistry::new(cfg.timeout_ms),
            cache: LookupCache::new(ttl, Duration::ZERO, 1 << 20),
            breaker,
            assemblies: Mutex::new(IdMap::default()),
            token: writer_token(),
            seq: AtomicU64::new(0),
            last_sweep: Mutex::new(Instant::now()),
            counters: Counters::default(),
            read_only,
            layout,
            fs,
            label,
            handle,
            cfg,
        });
        if !read_only {
            if let Fs::Remote(_) = &shared.fs {
                let s = shared.clone();
                let made = run_blocking(&shared.handle, async move {
                    match &s.fs {
                        Fs::Remote(r) => r.create_dirs().await,
                        Fs::Local(_) => Ok(()),
                    }
                })
                .and_then(|r| r);
                if let Err(e) = made {
                    runtime.shutdown(Duration::from_secs(1));
                    return Err(UcmError::invalid(format!(
                        "storage_backends: cannot create the block directories under {}: {e}",
                        shared.label
                    )));
                }
            }
        }
        Ok(NfsStore {
            shared,
            runtime: Mutex::new(Some(runtime)),
            closed: AtomicBool::new(false),
        })
    }

    /// The file layout in use.
    pub fn layout(&self) -> &Layout {
        &self.shared.layout
    }

    /// A block's path relative to the store's root (for tools and tests).
    pub fn block_rel_path(id: &BlockId) -> String {
        let (d, n) = block_key(id);
        format!("{d}/{n}")
    }

    fn check_transfer(&self, shards: &[ShardIo], dump: bool) -> Result<()> {
        if self.closed.load(Ordering::Acquire) {
            return Err(UcmError::Closed);
        }
        if !self.shared.cfg.transfers_enabled() {
            return Err(UcmError::Unsupported(
                "load/dump are disabled in the lookup-only role (device_id = -1)".into(),
            ));
        }
        if dump && self.shared.read_only {
            return Err(UcmError::Unsupported(format!(
                "{} is mounted read-only (nfs_mount_options ro)",
                self.shared.label
            )));
        }
        check_shards(&self.shared.layout, shards)
    }

    fn deadline(&self) -> Option<tokio::time::Instant> {
        (self.shared.cfg.timeout_ms > 0).then(|| {
            tokio::time::Instant::now() + Duration::from_millis(self.shared.cfg.timeout_ms)
        })
    }
}

impl Shared {
    async fn present(self: Arc<Self>, id: BlockId) -> bool {
        if self.cache.get(&id) == Some(true) {
            return true;
        }
        if self.breaker.is_open() {
            return false;
        }
        self.counters.probes.fetch_add(1, Ordering::Relaxed);
        match self.fs.size_of(&id).await {
            Ok(Some(size)) if size == self.layout.file_len() => {
                self.cache.put(id, true);
                true
            }
            Ok(_) => false,
            Err(e) => {
                log::debug!("lookup of block {id} counted as a miss: {e}");
                false
            }
        }
    }

    async fn load_group(self: Arc<Self>, block: BlockId, shards: Vec<ShardIo>) -> Result<()> {
        self.breaker.check(&format!("load of block {block}"))?;
        let mut idx: Vec<usize> = shards.iter().map(|s| s.index).collect();
        idx.sort_unstable();
        let stride = self.layout.stride;
        let reads = runs(&idx).into_iter().map(|(first, n)| {
            let s = self.clone();
            async move {
                let len = (n - 1) * stride + read_len(&s.layout);
                let r = s.fs.read(&block, s.layout.offset(first), len).await;
                (first, n, r)
            }
        });
        let fetched = futures::future::join_all(reads).await;
        let mut regions = Vec::with_capacity(fetched.len());
        for (first, n, r) in fetched {
            match r {
                Ok(b) => regions.push((first, n, b)),
                Err(e) => {
                    if e.code() == -50005 {
                        self.cache.forget(&block);
                        return Err(UcmError::NotFound(format!(
                            "block {block} is not in {}",
                            self.label
                        )));
                    }
                    return Err(e);
                }
            }
        }
        let region_of = |index: usize| -> Option<&[u8]> {
            regions.iter().find_map(|(first, n, b)| {
                (index >= *first && index < first + n).then(|| {
                    let off = (index - first) * stride;
                    &b[off.min(b.len())..]
                })
            })
        };
        for s in &shards {
            let raw = region_of(s.index).ok_or_else(|| {
                UcmError::TaskFailed(format!("block {block} shard {}: not read", s.index))
            })?;
            // SAFETY: the caller keeps the segments valid until its task
            // completes, which happens after this returns.
            if let Err(e) = unsafe { decode_region(&self.layout, s, raw) } {
                self.counters.corrupt_loads.fetch_add(1, Ordering::Relaxed);
                self.cache.forget(&block);
                self.fs.forget(&block);
                if !is_layout_mismatch(&e) && !self.read_only {
                    log::warn!("{e}; removing the block file from {}", self.label);
                    let _ = self.fs.remove(&block, &block.hex()).await;
                }
                return Err(e);
            }
            self.counters.shards_loaded.fetch_add(1, Ordering::Relaxed);
            self.counters
                .bytes_loaded
                .fetch_add(self.layout.shard_size as u64, Ordering::Relaxed);
        }
        Ok(())
    }

    fn stale_after(&self) -> Duration {
        Duration::from_millis((self.cfg.timeout_ms * 2).max(60_000))
    }

    /// Abandons assemblies nobody added a shard to for a long time.
    fn sweep(self: &Arc<Self>) {
        {
            let mut last = self.last_sweep.lock();
            if last.elapsed() < Duration::from_secs(1) {
                return;
            }
            *last = Instant::now();
        }
        let limit = self.stale_after();
        let mut dropped = Vec::new();
        self.assemblies.lock().retain(|id, a| {
            let mut st = a.state.lock();
            let idle = st.last_activity.elapsed() >= limit && !st.slots.contains(&Slot::InFlight);
            if idle {
                st.closed = true;
                st.failed.get_or_insert_with(|| {
                    UcmError::TaskFailed(format!(
                        "block {id}: abandoned, its other shards never came"
                    ))
                });
                dropped.push((*id, a.tmp.clone()));
            }
            !idle
        });
        if !dropped.is_empty() {
            self.counters
                .abandoned
                .fetch_add(dropped.len() as u64, Ordering::Relaxed);
            log::warn!(
                "dropped {} partially dumped block(s) on {}: their other shards never came",
                dropped.len(),
                self.label
            );
            let s = self.clone();
            self.handle.spawn(async move {
                for (id, tmp) in dropped {
                    let _ = s.fs.remove(&id, &tmp).await;
                }
            });
        }
    }

    fn assembly(self: &Arc<Self>, block: &BlockId) -> Arc<Assembly> {
        self.sweep();
        let mut map = self.assemblies.lock();
        if let Some(a) = map.get(block) {
            return a.clone();
        }
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let a = Arc::new(Assembly {
            tmp: format!("{}.tmp.{}.{seq}", block.hex(), self.token),
            file: tokio::sync::OnceCell::new(),
            state: Mutex::new(AsmState {
                slots: vec![Slot::Empty; self.layout.shard_count],
                done: 0,
                failed: None,
                verf: None,
                last_activity: Instant::now(),
                closed: false,
                published: false,
            }),
            changed: tokio::sync::Notify::new(),
        });
        map.insert(*block, a.clone());
        a
    }

    fn forget_assembly(&self, block: &BlockId, a: &Arc<Assembly>) {
        let mut map = self.assemblies.lock();
        if map.get(block).is_some_and(|cur| Arc::ptr_eq(cur, a)) {
            map.remove(block);
        }
    }

    /// Fails an assembly: no more writes, its temporary file removed.
    async fn fail(&self, block: &BlockId, a: &Arc<Assembly>, e: &UcmError) {
        let first = {
            let mut st = a.state.lock();
            st.closed = true;
            if st.failed.is_none() {
                st.failed = Some(e.clone());
                true
            } else {
                false
            }
        };
        a.changed.notify_waiters();
        if first {
            self.forget_assembly(block, a);
            let _ = self.fs.remove(block, &a.tmp).await;
        }
    }

    async fn dump_group(self: Arc<Self>, block: BlockId, shards: Vec<ShardIo>) -> Result<()> {
        if self.cache.get(&block) == Some(true) {
            // Content-addressed: the published block holds these bytes.
            return Ok(());
        }
        let a = self.assembly(&block);
        // Claim the shards nobody wrote yet and copy them out of caller
        // memory right away (no await before: a cancelled unit never reads
        // caller memory later).
        let stride = self.layout.stride;
        let mut mine: Vec<(usize, Arc<AlignedBuf>)> = Vec::new();
        let mut others = Vec::new();
        let restart = {
            let mut st = a.state.lock();
            if st.closed {
                true
            } else {
                if let Some(e) = &st.failed {
                    return Err(e.clone());
                }
                st.last_activity = Instant::now();
                for s in &shards {
                    match st.slots[s.index] {
                        Slot::Done => {}
                        Slot::InFlight => others.push(s.index),
                        Slot::Empty => {
                            st.slots[s.index] = Slot::InFlight;
                            let mut buf = AlignedBuf::new(stride);
                            // SAFETY: the caller keeps the segments valid until
                            // its task completes; `buf` is one region long.
                            unsafe { encode_region(&self.layout, s, &mut buf) };
                            mine.push((s.index, Arc::new(buf)));
                        }
                    }
                }
                false
            }
        };
        if restart {
            // Published or failed meanwhile.
            if self.cache.get(&block) == Some(true) {
                return Ok(());
            }
            return Box::pin(self.clone().dump_group(block, shards)).await;
        }
        if !mine.is_empty() {
            let file = a
                .file
                .get_or_init(|| {
                    let s = self.clone();
                    let tmp = a.tmp.clone();
                    async move { s.fs.create(&block, &tmp).await }
                })
                .await
                .clone();
            let file = match file {
                Ok(f) => f,
                Err(e) => {
                    self.fail(&block, &a, &e).await;
                    return Err(e);
                }
            };
            let writes = mine.iter().map(|(index, buf)| {
                let s = self.clone();
                let file = file.clone();
                let buf = buf.clone();
                let off = self.layout.offset(*index);
                async move { s.fs.write(&file, off, buf).await }
            });
            let results = futures::future::join_all(writes).await;
            let mut verf = None;
            for r in results {
                match r {
                    Ok(v) => verf = verf.or(v),
                    Err(e) => {
                        self.fail(&block, &a, &e).await;
                        return Err(e);
                    }
                }
            }
            self.counters
                .shards_dumped
                .fetch_add(mine.len() as u64, Ordering::Relaxed);
            let verf_changed = {
                let st = a.state.lock();
                if let Some(e) = &st.failed {
                    return Err(e.clone());
                }
                matches!((st.verf, verf), (Some(prev), Some(v)) if prev != v)
            };
            if verf_changed {
                let e = UcmError::TaskFailed(format!(
                    "{}: the server restarted while block {block} was written; it is dropped",
                    self.label
                ));
                self.fail(&block, &a, &e).await;
                return Err(e);
            }
            let complete = {
                let mut st = a.state.lock();
                st.verf = st.verf.or(verf);
                for (index, _) in &mine {
                    st.slots[*index] = Slot::Done;
                    st.done += 1;
                }
                st.last_activity = Instant::now();
                st.done == st.slots.len()
            };
            a.changed.notify_waiters();
            if complete {
                let verf = a.state.lock().verf;
                let published = self.fs.publish(&block, &a.tmp, &file, verf).await;
                return match published {
                    Ok(()) => {
                        {
                            let mut st = a.state.lock();
                            st.published = true;
                            st.closed = true;
                        }
                        self.forget_assembly(&block, &a);
                        a.changed.notify_waiters();
                        self.cache.put(block, true);
                        self.counters
                            .blocks_published
                            .fetch_add(1, Ordering::Relaxed);
                        self.counters
                            .bytes_dumped
                            .fetch_add(self.layout.file_len(), Ordering::Relaxed);
                        Ok(())
                    }
                    Err(e) => {
                        self.counters
                            .publish_failures
                            .fetch_add(1, Ordering::Relaxed);
                        self.fail(&block, &a, &e).await;
                        Err(e)
                    }
                };
            }
        }
        // Shards another task is writing: this unit completes with them.
        loop {
            let notified = a.changed.notified();
            {
                let st = a.state.lock();
                if let Some(e) = &st.failed {
                    return Err(e.clone());
                }
                if others.iter().all(|i| st.slots[*i] != Slot::InFlight) {
                    return Ok(());
                }
            }
            notified.await;
        }
    }
}

impl Store for NfsStore {
    fn name(&self) -> &'static str {
        "NFS"
    }

    fn lookup(&self, ids: &[BlockId]) -> Result<Vec<bool>> {
        if self.closed.load(Ordering::Acquire) {
            return Err(UcmError::Closed);
        }
        let s = self.shared.clone();
        s.counters.lookups.fetch_add(1, Ordering::Relaxed);
        let ids = ids.to_vec();
        let conc = s.cfg.max_concurrency;
        run_blocking(&s.handle.clone(), async move {
            probe_all(ids, conc, |id| s.clone().present(id)).await
        })
    }

    fn lookup_on_prefix(&self, ids: &[BlockId]) -> Result<isize> {
        if self.closed.load(Ordering::Acquire) {
            return Err(UcmError::Closed);
        }
        let s = self.shared.clone();
        s.counters.lookups.fetch_add(1, Ordering::Relaxed);
        let ids = ids.to_vec();
        let conc = s.cfg.max_concurrency;
        run_blocking(&s.handle.clone(), async move {
            probe_prefix(ids, conc, |id| s.clone().present(id)).await
        })
    }

    fn prefetch(&self, _ids: &[BlockId]) -> Result<()> {
        if self.closed.load(Ordering::Acquire) {
            return Err(UcmError::Closed);
        }
        Ok(())
    }

    fn load(&self, shards: Vec<ShardIo>) -> Result<TaskId> {
        self.check_transfer(&shards, false)?;
        let task = self.shared.tasks.create("load", shards.len());
        let deadline = self.deadline();
        for (block, group) in group_by_block(shards, |s| s.block) {
            let unit = Unit::new(task.clone(), group.len());
            let fut = self.shared.clone().load_group(block, group);
            spawn_unit(
                &self.shared.handle,
                unit,
                deadline,
                format!("NFS load of block {block}"),
                fut,
            );
        }
        Ok(task.id())
    }

    fn dump(&self, shards: Vec<ShardIo>, _prerequisite: u64) -> Result<TaskId> {
        self.check_transfer(&shards, true)?;
        let task = self.shared.tasks.create("dump", shards.len());
        let deadline = self.deadline();
        for (block, group) in group_by_block(shards, |s| s.block) {
            let unit = Unit::new(task.clone(), group.len());
            let fut = self.shared.clone().dump_group(block, group);
            spawn_unit(
                &self.shared.handle,
                unit,
                deadline,
                format!("NFS dump of block {block}"),
                fut,
            );
        }
        Ok(task.id())
    }

    fn wait(&self, task: TaskId) -> Result<()> {
        self.shared.tasks.wait(task)
    }

    fn check(&self, task: TaskId) -> Result<bool> {
        self.shared.tasks.check(task)
    }

    fn close(&self) -> Result<()> {
        self.closed.store(true, Ordering::Release);
        let Some(rt) = self.runtime.lock().take() else {
            return Ok(());
        };
        // Remove the temporaries of blocks that will never complete.
        let pending: Vec<(BlockId, String)> = self
            .shared
            .assemblies
            .lock()
            .drain()
            .map(|(id, a)| (id, a.tmp.clone()))
            .collect();
        if !pending.is_empty() {
            log::warn!(
                "NFS store closed with {} partially dumped block(s); they are dropped",
                pending.len()
            );
            let s = self.shared.clone();
            let _ = run_blocking(&self.shared.handle, async move {
                let removals = pending.iter().map(|(id, tmp)| s.fs.remove(id, tmp));
                let _ = tokio::time::timeout(
                    Duration::from_secs(2),
                    futures::future::join_all(removals),
                )
                .await;
            });
        }
        rt.shutdown(Duration::from_secs(2));
        Ok(())
    }

    fn stats(&self) -> StoreStats {
        let c = &self.shared.counters;
        let mut s = StoreStats::new();
        let mut put = |k: &str, v: u64| {
            s.insert(k.to_string(), v as f64);
        };
        put("lookups", c.lookups.load(Ordering::Relaxed));
        put("lookup_requests", c.probes.load(Ordering::Relaxed));
        put("shards_loaded", c.shards_loaded.load(Ordering::Relaxed));
        put("bytes_loaded", c.bytes_loaded.load(Ordering::Relaxed));
        put("shards_dumped", c.shards_dumped.load(Ordering::Relaxed));
        put("bytes_dumped", c.bytes_dumped.load(Ordering::Relaxed));
        put(
            "blocks_published",
            c.blocks_published.load(Ordering::Relaxed),
        );
        put(
            "publish_failures",
            c.publish_failures.load(Ordering::Relaxed),
        );
        put("corrupt_loads", c.corrupt_loads.load(Ordering::Relaxed));
        put("abandoned_blocks", c.abandoned.load(Ordering::Relaxed));
        put("breaker_trips", self.shared.breaker.trips());
        put(
            "assembling_blocks",
            self.shared.assemblies.lock().len() as u64,
        );
        if let Fs::Remote(r) = &self.shared.fs {
            put("reconnects", r.client.reconnects());
        }
        let (hit, miss) = self.shared.cache.counts();
        put("lookup_cache_hits", hit);
        put("lookup_cache_misses", miss);
        s
    }
}

impl Drop for NfsStore {
    fn drop(&mut self) {
        let _ = self.close();
    }
}
