//! The NFS store: blocks as files on an NFS export shared by many
//! machines, reached either by the built-in user-space NFSv3 client
//! (`storage_backends: "nfs://server/export/path"`, no kernel mount and no
//! root needed; [`client`]) or through a directory the kernel already
//! mounted (`storage_backends: "/mnt/export/path"`).
//!
//! # Format and visibility
//!
//! Files are Posix block files at the Posix store's paths
//! (`<root>/<2 hex>/<32 hex>`, see [`crate::store::format::codec`]), so every
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

pub use config::{MountOptions, NfsConfig, Target, KEYS};

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nfs3_client::nfs3_types::nfs3::writeverf3;
use parking_lot::Mutex;

use self::fs::{Fs, LocalFs, RemoteFs, TempFile};
use super::format::codec::{block_key, encode_region, is_layout_mismatch};
use super::remote::{run_blocking, Breaker, LookupCache, Runtime};
use super::remote::{RemoteBackend, RemoteCore, RemoteStore};
use crate::block::IdMap;
use crate::block::{BlockId, ShardIo};
use crate::error::{Result, UcmError};
use crate::io::AlignedBuf;
use crate::store::format::layout::Layout;

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

/// Counters of the NFS backend (the shell counts lookups and loads).
#[derive(Default)]
struct Counters {
    shards_dumped: AtomicU64,
    blocks_published: AtomicU64,
    publish_failures: AtomicU64,
    abandoned: AtomicU64,
}

/// The NFS side of an [`NfsStore`]: the export (built-in client or kernel
/// mount) and the blocks being assembled in temporary files.
pub struct NfsBackend {
    core: RemoteCore,
    fs: Fs,
    label: String,
    read_only: bool,
    assemblies: Mutex<IdMap<Arc<Assembly>>>,
    token: String,
    seq: AtomicU64,
    last_sweep: Mutex<Instant>,
    counters: Counters,
}

/// Blocks as files on an NFS export.
pub type NfsStore = RemoteStore<NfsBackend>;

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

impl RemoteStore<NfsBackend> {
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
        // Absent results are never cached: a block another engine publishes
        // is seen by the next lookup.
        let core = RemoteCore::new(
            layout,
            handle,
            LookupCache::new(ttl, Duration::ZERO, 1 << 20),
            breaker,
            cfg.timeout_ms,
            cfg.max_concurrency,
            cfg.transfers_enabled(),
        );
        let shared = Arc::new(NfsBackend {
            core,
            assemblies: Mutex::new(IdMap::default()),
            token: writer_token(),
            seq: AtomicU64::new(0),
            last_sweep: Mutex::new(Instant::now()),
            counters: Counters::default(),
            read_only,
            fs,
            label,
        });
        if !read_only {
            if let Fs::Remote(_) = &shared.fs {
                let s = shared.clone();
                let made = run_blocking(&shared.core.handle, async move {
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
        Ok(RemoteStore::new(shared, runtime))
    }

    /// A block's path relative to the store's root (for tools and tests).
    pub fn block_rel_path(id: &BlockId) -> String {
        let (d, n) = block_key(id);
        format!("{d}/{n}")
    }
}

impl NfsBackend {
    /// Abandons assemblies nobody added a shard to for a long time.
    fn sweep(self: &Arc<Self>) {
        {
            let mut last = self.last_sweep.lock();
            if last.elapsed() < Duration::from_secs(1) {
                return;
            }
            *last = Instant::now();
        }
        let limit = self.core.stale_after();
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
            self.core.handle.spawn(async move {
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
                slots: vec![Slot::Empty; self.core.layout.shard_count],
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

    /// Writes shards of one block into its temporary file; the unit that
    /// completes the block publishes it.
    async fn assemble(self: Arc<Self>, block: BlockId, shards: Vec<ShardIo>) -> Result<()> {
        if self.core.cache.get(&block) == Some(true) {
            // Content-addressed: the published block holds these bytes.
            return Ok(());
        }
        let a = self.assembly(&block);
        // Claim the shards nobody wrote yet and copy them out of caller
        // memory right away (no await before: a cancelled unit never reads
        // caller memory later).
        let stride = self.core.layout.stride;
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
                            unsafe { encode_region(&self.core.layout, s, &mut buf) };
                            mine.push((s.index, Arc::new(buf)));
                        }
                    }
                }
                false
            }
        };
        if restart {
            // Published or failed meanwhile.
            if self.core.cache.get(&block) == Some(true) {
                return Ok(());
            }
            return Box::pin(self.clone().assemble(block, shards)).await;
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
                let off = self.core.layout.offset(*index);
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
                        self.core.cache.put(block, true);
                        self.counters
                            .blocks_published
                            .fetch_add(1, Ordering::Relaxed);
                        self.core
                            .counters
                            .bytes_dumped
                            .fetch_add(self.core.layout.file_len(), Ordering::Relaxed);
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

impl RemoteBackend for NfsBackend {
    const NAME: &'static str = "NFS";
    const PROBE_STAT: &'static str = "lookup_requests";
    type Region = Vec<u8>;

    fn core(&self) -> &RemoteCore {
        &self.core
    }

    fn location(&self) -> &str {
        &self.label
    }

    fn check_dump(&self) -> Result<()> {
        if self.read_only {
            return Err(UcmError::Unsupported(format!(
                "{} is mounted read-only (nfs_mount_options ro)",
                self.label
            )));
        }
        Ok(())
    }

    /// One LOOKUP (its attributes give the size).
    async fn size_of(&self, id: &BlockId) -> Result<Option<u64>> {
        self.fs.size_of(id).await
    }

    async fn read(&self, id: &BlockId, offset: u64, len: usize) -> Result<Vec<u8>> {
        self.fs.read(id, offset, len).await
    }

    async fn discard_corrupt(&self, id: &BlockId, e: &UcmError) {
        self.fs.forget(id);
        if !is_layout_mismatch(e) && !self.read_only {
            log::warn!("{e}; removing the block file from {}", self.label);
            let _ = self.fs.remove(id, &id.hex()).await;
        }
    }

    async fn dump_group(self: Arc<Self>, block: BlockId, shards: Vec<ShardIo>) -> Result<()> {
        self.assemble(block, shards).await
    }

    fn before_shutdown(self: &Arc<Self>) {
        // Remove the temporaries of blocks that will never complete.
        let pending: Vec<(BlockId, String)> = self
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
            let s = self.clone();
            let _ = run_blocking(&self.core.handle, async move {
                let removals = pending.iter().map(|(id, tmp)| s.fs.remove(id, tmp));
                let _ = tokio::time::timeout(
                    Duration::from_secs(2),
                    futures::future::join_all(removals),
                )
                .await;
            });
        }
    }

    fn add_stats(&self, put: &mut dyn FnMut(&str, u64)) {
        let c = &self.counters;
        put("shards_dumped", c.shards_dumped.load(Ordering::Relaxed));
        put(
            "blocks_published",
            c.blocks_published.load(Ordering::Relaxed),
        );
        put(
            "publish_failures",
            c.publish_failures.load(Ordering::Relaxed),
        );
        put("abandoned_blocks", c.abandoned.load(Ordering::Relaxed));
        put("assembling_blocks", self.assemblies.lock().len() as u64);
        if let Fs::Remote(r) = &self.fs {
            put("reconnects", r.client.reconnects());
        }
    }
}
