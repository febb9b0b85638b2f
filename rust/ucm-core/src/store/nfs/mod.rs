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
pub mod maintain;

mod assembly;

pub use config::{MountOptions, NfsConfig, Target, KEYS};

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use self::assembly::Assembly;
use self::fs::{Fs, LocalFs, RemoteFs};
use super::format::codec::{block_key, is_layout_mismatch};
use super::remote::{run_blocking, Breaker, LookupCache, Runtime};
use super::remote::{RemoteBackend, RemoteCore, RemoteStore};
use crate::block::IdMap;
use crate::block::{BlockId, ShardIo};
use crate::error::{Result, UcmError};

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
        let runtime = Runtime::new("ucm-nfs", cfg.io_threads)?;
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
                let client = match connect(&cfg, &opts, host, path, &label, &runtime, !read_only) {
                    Ok(c) => c,
                    Err(e) => {
                        runtime.shutdown(Duration::from_secs(1));
                        return Err(e);
                    }
                };
                let remote = RemoteFs::new(client, opts.sync, ttl, breaker.clone(), label.clone());
                (Fs::Remote(Box::new(remote)), label)
            }
            Target::Mounted(dir) => (
                Fs::Local(mounted(dir, cfg.io_direct)?),
                dir.display().to_string(),
            ),
        };
        let shared = Arc::new(NfsBackend::new(
            &cfg,
            runtime.handle(),
            (fs, label),
            breaker,
            ttl,
            read_only,
        ));
        if !read_only {
            if let Err(e) = shared.create_dirs() {
                runtime.shutdown(Duration::from_secs(1));
                return Err(e);
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

/// Mounts `host:path` with the built-in client (creating the export's
/// directory when `create`).
fn connect(
    cfg: &NfsConfig,
    opts: &MountOptions,
    host: &str,
    path: &str,
    label: &str,
    runtime: &Runtime,
    create: bool,
) -> Result<client::Client> {
    let rpc_timeout = opts
        .timeo
        .unwrap_or_else(|| Duration::from_millis((cfg.timeout_ms / 10).clamp(1000, 10_000)));
    let (h, p, o, conc) = (
        host.to_string(),
        path.to_string(),
        opts.clone(),
        cfg.max_concurrency,
    );
    let client = run_blocking(&runtime.handle(), async move {
        client::Client::connect(&h, &p, &o, conc, rpc_timeout, create).await
    })?
    .map_err(|e| UcmError::invalid(format!("storage_backends: cannot use {label}: {e}")))?;
    log::info!(
        "NFS store over {label} (mounted {}, rtmax {} wtmax {})",
        client.mounted,
        client.rtmax,
        client.wtmax
    );
    Ok(client)
}

/// The kernel-mounted directory `dir`, which must exist.
fn mounted(dir: &std::path::Path, io_direct: bool) -> Result<LocalFs> {
    crate::store::safe_fs::require_dir("storage_backends", dir)?;
    Ok(LocalFs::new(dir.to_path_buf(), io_direct))
}

impl NfsBackend {
    fn new(
        cfg: &NfsConfig,
        handle: tokio::runtime::Handle,
        (fs, label): (Fs, String),
        breaker: Arc<Breaker>,
        ttl: Duration,
        read_only: bool,
    ) -> Self {
        let layout = cfg.geometry.layout();
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
        NfsBackend {
            core,
            assemblies: Mutex::new(IdMap::default()),
            token: writer_token(),
            seq: AtomicU64::new(0),
            last_sweep: Mutex::new(Instant::now()),
            counters: Counters::default(),
            read_only,
            fs,
            label,
        }
    }

    /// Creates the block directories under the root.
    fn create_dirs(self: &Arc<Self>) -> Result<()> {
        let made = match &self.fs {
            Fs::Local(l) => l.create_dirs(),
            Fs::Remote(_) => {
                let s = self.clone();
                run_blocking(&self.core.handle, async move {
                    match &s.fs {
                        Fs::Remote(r) => r.create_dirs().await,
                        Fs::Local(_) => Ok(()),
                    }
                })
                .and_then(|r| r)
            }
        };
        made.map_err(|e| {
            UcmError::invalid(format!(
                "storage_backends: cannot create the block directories under {}: {e}",
                self.label
            ))
        })
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
        self.drop_pending();
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
