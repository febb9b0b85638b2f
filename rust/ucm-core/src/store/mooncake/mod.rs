//! The Mooncake store: blocks in a Mooncake Store pool, the cluster-wide
//! DRAM tier that many engines on many hosts lend memory to and share.
//!
//! # Objects
//!
//! One object per block under `<mooncake_key_prefix>/<block id hex>`, byte
//! for byte a Posix block file ([`codec`]): every shard carries its header
//! and checksum, so a corrupt, truncated or foreign value is a load error,
//! never wrong bytes. A put makes an object visible whole, so layer-wise
//! dumps are staged per block and put when their last shard arrives
//! ([`staging`], as for S3). A load fetches the block, or the byte range
//! of the shards it needs (one ranged get), into a registered slot
//! ([`arena`]) and verifies them before copying them out.
//!
//! # Failures
//!
//! The pool forgets: the master evicts under memory pressure and loses
//! everything when it restarts. Such a block is simply absent (lookups miss
//! after `mooncake_lookup_cache_ttl_ms`; a load fails with `NotFound` and
//! the engine recomputes). A full pool fails the dump with `NoSpace`. A
//! master that does not answer (Mooncake's RPC errors) opens the
//! [`Breaker`]: lookups answer "absent" and transfers fail at once until it
//! answers again; the client reconnects on its own.
//!
//! [`codec`]: crate::store::format::codec
//! [`staging`]: crate::store::remote::staging
//! [`Breaker`]: crate::store::remote::Breaker

pub mod arena;
pub mod client;
pub mod config;

pub use arena::Buf;
pub use client::PoolClient;
pub use config::{MooncakeConfig, KEYS};

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use self::arena::{Arena, SlotBytes};
use self::client::{code, CallPool};
use super::remote::staging::{self, RequestCounters, Stager, Uploader};
use super::remote::{Breaker, LookupCache, RemoteBackend, RemoteCore, RemoteStore, Runtime};
use crate::block::{BlockId, ShardIo};
use crate::error::{Damage, Result, UcmError};
use crate::store::format::codec::{is_layout_mismatch, read_len};

/// Presence probes in flight during a lookup (they reach the client as
/// one call per batch).
const LOOKUP_CONCURRENCY: usize = 64;

/// The Mooncake side of a [`MooncakeStore`].
pub struct MooncakeBackend {
    core: RemoteCore,
    cfg: MooncakeConfig,
    location: String,
    calls: CallPool,
    arena: Arc<Arena>,
    stager: Stager,
    /// Requests to the pool (the shell counts lookups and loads).
    counters: RequestCounters,
    /// Puts refused because the pool was full.
    pool_full: AtomicU64,
}

/// Blocks in a Mooncake Store pool.
pub type MooncakeStore = RemoteStore<MooncakeBackend>;

impl RemoteStore<MooncakeBackend> {
    /// A store over `client`, a Mooncake client already set up (joined to
    /// the pool) by the caller. Registers the staging memory with it.
    pub fn open(cfg: MooncakeConfig, client: Arc<dyn PoolClient>) -> Result<Self> {
        let cfg = cfg.resolved()?;
        let layout = cfg.geometry.layout();
        let block = layout.file_len() as usize;
        // Transfers in flight need a slot each; half the staging budget
        // again, and at least two per thread, so puts and gets never wait
        // on each other for long.
        let slots = ((cfg.staging_bytes / 2) as usize / block).max(2 * cfg.max_concurrency);
        let arena = Arena::new(block, slots)?;
        client.register(arena.whole()).map_err(|e| {
            UcmError::TaskFailed(format!(
                "Mooncake store: could not register {} bytes of staging memory with the \
                 client: {e}",
                arena.whole().len
            ))
        })?;
        let unregister = client.clone();
        arena.on_free(Box::new(move |addr| unregister.unregister(addr)));
        let runtime = Runtime::new("ucm-mooncake-rt", 1)?;
        let calls = CallPool::start(client, cfg.max_concurrency)?;
        let core = RemoteCore::new(
            layout,
            runtime.handle(),
            LookupCache::from_ttl_ms(cfg.lookup_cache_ttl_ms, cfg.negative_cache_ttl_ms),
            Arc::new(Breaker::default()),
            cfg.timeout_ms,
            // Probes in flight: they go together to the size-query thread.
            LOOKUP_CONCURRENCY,
            cfg.transfers_enabled(),
        );
        let backend = MooncakeBackend {
            core,
            location: format!("mooncake://{}/{}", cfg.master, cfg.key_prefix),
            stager: Stager::new(cfg.staging_bytes),
            counters: RequestCounters::default(),
            pool_full: AtomicU64::new(0),
            calls,
            arena,
            cfg,
        };
        log::info!(
            "Mooncake store over {} ({slots} registered slots of {block} bytes)",
            backend.location
        );
        Ok(RemoteStore::new(Arc::new(backend), runtime))
    }
}

impl MooncakeBackend {
    fn key(&self, id: &BlockId) -> String {
        if self.cfg.key_prefix.is_empty() {
            id.hex()
        } else {
            format!("{}/{}", self.cfg.key_prefix, id.hex())
        }
    }

    /// The error of a failed call on `what`; transport failures open the
    /// breaker.
    fn failure(&self, op: &str, what: &str, rc: i64) -> UcmError {
        let transport = matches!(rc, code::RPC_FAIL | code::RPC_TIMEOUT);
        let msg = format!(
            "Mooncake {op} of {what} at {}: {}",
            self.cfg.master,
            describe(rc)
        );
        let err = match rc {
            code::OBJECT_NOT_FOUND | code::LEASE_EXPIRED => UcmError::NotFound(msg),
            code::NO_AVAILABLE_HANDLE => {
                self.pool_full.fetch_add(1, Ordering::Relaxed);
                UcmError::NoSpace(msg)
            }
            code::RPC_TIMEOUT => UcmError::Timeout(msg),
            _ => UcmError::TaskFailed(msg),
        };
        if transport {
            self.counters.request_errors.fetch_add(1, Ordering::Relaxed);
            self.core.breaker.trip(&err.to_string());
        }
        err
    }

    /// The error of a call the client raised on.
    fn raised(&self, op: &str, what: &str, e: UcmError) -> UcmError {
        self.counters.request_errors.fetch_add(1, Ordering::Relaxed);
        let err = UcmError::TaskFailed(format!("Mooncake {op} of {what}: {e}"));
        self.core.breaker.trip(&err.to_string());
        err
    }
}

/// A Mooncake code in words.
fn describe(rc: i64) -> String {
    let what = match rc {
        code::NO_AVAILABLE_HANDLE => {
            "the pool is full (no segment has room; the master evicts at its high watermark)"
        }
        code::INVALID_PARAMS => "invalid parameters (a value of another size?)",
        code::REPLICA_IS_NOT_READY => "the object is still being written",
        code::OBJECT_NOT_FOUND => {
            "no such object (never written, evicted, or the master restarted)"
        }
        code::OBJECT_ALREADY_EXISTS => "the object already exists",
        code::LEASE_EXPIRED => "the object's lease expired during the read",
        code::RPC_FAIL => "the master did not answer",
        code::RPC_TIMEOUT => "the master timed out",
        _ => "error",
    };
    format!("{what} (code {rc})")
}

impl RemoteBackend for MooncakeBackend {
    const NAME: &'static str = "Mooncake";
    const PROBE_STAT: &'static str = "size_queries";
    type Region = SlotBytes;

    fn core(&self) -> &RemoteCore {
        &self.core
    }

    fn location(&self) -> &str {
        &self.location
    }

    async fn size_of(&self, id: &BlockId) -> Result<Option<u64>> {
        let what = format!("block {id}");
        let rc = self
            .calls
            .size(self.key(id))
            .await?
            .map_err(|e| self.raised("size query", &what, e))?;
        match rc {
            n if n >= 0 => Ok(Some(n as u64)),
            code::OBJECT_NOT_FOUND | code::REPLICA_IS_NOT_READY => Ok(None),
            rc => Err(self.failure("size query", &what, rc)),
        }
    }

    /// One get into a slot: the whole block when all its shards are asked
    /// for, else a ranged get of just those (a layer-wise load reads one
    /// shard per layer).
    async fn read(&self, id: &BlockId, offset: u64, len: usize) -> Result<SlotBytes> {
        let layout = &self.core.layout;
        let whole_read = layout.offset(layout.shard_count - 1) as usize + read_len(layout);
        let range = (offset != 0 || len < whole_read).then_some((offset, len));
        let slot = self.arena.acquire().await;
        self.counters.gets.fetch_add(1, Ordering::Relaxed);
        let outcome = self.calls.get(self.key(id), slot, range).await?;
        let what = format!("block {id}");
        match outcome {
            (Some(slot), Ok(n)) if n >= 0 => {
                // A shorter object reads as a truncated block below.
                let n = (n as usize).min(len);
                Ok(SlotBytes::new(slot, 0, n))
            }
            (_, Ok(code::INVALID_PARAMS)) => Err(UcmError::Corrupt {
                block: Some(*id),
                shard: None,
                damage: Damage::Truncated,
                detail: format!(
                    "{what} in {}: the stored value is not the size of a block of this layout",
                    self.location
                ),
            }),
            (_, Ok(rc)) => Err(self.failure("get", &what, rc)),
            (_, Err(e)) => Err(self.raised("get", &what, e)),
        }
    }

    async fn discard_corrupt(&self, id: &BlockId, e: &UcmError) {
        if !is_layout_mismatch(e) {
            log::warn!("{e}; removing {} from the pool", self.key(id));
            let _ = self.calls.remove(self.key(id)).await;
        }
    }

    async fn dump_group(self: Arc<Self>, block: BlockId, shards: Vec<ShardIo>) -> Result<()> {
        staging::stage(self, block, shards).await
    }

    fn before_shutdown(self: &Arc<Self>) {
        self.drain_uploads();
        self.calls.shutdown(Duration::from_millis(
            self.cfg.timeout_ms.clamp(1000, 10_000),
        ));
    }

    fn add_stats(&self, put: &mut dyn FnMut(&str, u64)) {
        self.counters.add_stats(put);
        put("pool_full", self.pool_full.load(Ordering::Relaxed));
        put("poisoned_slots", self.arena.poisoned());
        self.stager.add_stats(put);
    }
}

impl Uploader for MooncakeBackend {
    fn stager(&self) -> &Stager {
        &self.stager
    }

    /// Copies the block into a registered slot and puts it.
    async fn put_block(self: Arc<Self>, block: BlockId, buf: Vec<u8>) -> Result<()> {
        let mut slot = self.arena.acquire().await;
        slot.bytes_mut()[..buf.len()].copy_from_slice(&buf);
        let len = buf.len();
        drop(buf);
        self.counters.puts.fetch_add(1, Ordering::Relaxed);
        let r = self.calls.put(self.key(&block), slot, len).await?;
        let what = format!("block {block}");
        match r {
            Ok(rc) if rc >= 0 || rc == code::OBJECT_ALREADY_EXISTS => Ok(()),
            Ok(rc) => Err(self.failure("put", &what, rc)),
            Err(e) => Err(self.raised("put", &what, e)),
        }
    }
}
