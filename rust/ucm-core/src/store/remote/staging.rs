//! Layer-wise dumps staged in memory, for tiers that write a block as one
//! object (S3, Mooncake): each block's shards are copied into a staging
//! buffer, in whatever order and task they come, within a byte budget; the
//! shard that completes a block starts its one write ([`Uploader::put_block`]),
//! which every unit still staging the block waits for.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::{BoxFuture, FutureExt, Shared as SharedFuture};
use parking_lot::Mutex;

use super::{RemoteBackend, RemoteCore};
use crate::block::{BlockId, IdMap, ShardIo};
use crate::error::{Result, UcmError};
use crate::store::format::codec::encode_region;

/// The write of a complete block, awaited by every unit that staged part
/// of it.
type Upload = SharedFuture<BoxFuture<'static, Result<()>>>;

/// One block whose shards are being assembled.
struct Staged {
    buf: Vec<u8>,
    have: Vec<bool>,
    count: usize,
    last_activity: Instant,
    /// Set once the block left the staging map (complete or dropped).
    closed: bool,
}

#[derive(Default)]
struct Counters {
    blocks_uploaded: AtomicU64,
    upload_failures: AtomicU64,
    stale_dropped: AtomicU64,
}

/// The staging state of one store: blocks being assembled, writes in
/// flight and the memory they hold.
pub struct Stager {
    budget: u64,
    staging: Mutex<IdMap<Arc<Mutex<Staged>>>>,
    uploads: Mutex<IdMap<Upload>>,
    staged_bytes: AtomicU64,
    room: tokio::sync::Notify,
    counters: Counters,
}

/// A remote backend that writes each block whole, as one object.
pub trait Uploader: RemoteBackend {
    /// The backend's staging state.
    fn stager(&self) -> &Stager;

    /// Writes a complete block (`buf` is the whole block object); readers
    /// must see all of it or nothing. Transport failures are recorded
    /// (breaker, counters) in the error returned.
    fn put_block(
        self: Arc<Self>,
        block: BlockId,
        buf: Vec<u8>,
    ) -> impl Future<Output = Result<()>> + Send;

    /// At close: lets the writes already started finish, bounded by the task
    /// timeout (at least a second).
    fn drain_uploads(&self) {
        let grace = Duration::from_millis(self.core().timeout_ms.max(1000));
        self.stager().drain(Self::NAME, grace);
    }
}

/// Requests of a backend that reads and writes whole block objects, as its
/// stats report them.
#[derive(Default)]
pub struct RequestCounters {
    pub(crate) gets: AtomicU64,
    pub(crate) puts: AtomicU64,
    /// Failed requests (transport errors and the server's own).
    pub(crate) request_errors: AtomicU64,
}

impl RequestCounters {
    /// Adds the request figures to a store's stats.
    pub fn add_stats(&self, put: &mut dyn FnMut(&str, u64)) {
        put("get_requests", self.gets.load(Ordering::Relaxed));
        put("put_requests", self.puts.load(Ordering::Relaxed));
        put(
            "request_errors",
            self.request_errors.load(Ordering::Relaxed),
        );
    }
}

impl Stager {
    /// Staging within `budget` bytes (at least one block is always let in).
    pub fn new(budget: u64) -> Self {
        Stager {
            budget,
            staging: Mutex::new(IdMap::default()),
            uploads: Mutex::new(IdMap::default()),
            staged_bytes: AtomicU64::new(0),
            room: tokio::sync::Notify::new(),
            counters: Counters::default(),
        }
    }

    /// Drops staged blocks nobody added a shard to for a long time.
    fn sweep_stale(&self, core: &RemoteCore) {
        let limit = core.stale_after();
        let mut map = self.staging.lock();
        let before = map.len();
        map.retain(|_, st| {
            let mut st = st.lock();
            if st.last_activity.elapsed() < limit {
                return true;
            }
            st.closed = true;
            self.staged_bytes
                .fetch_sub(st.buf.len() as u64, Ordering::AcqRel);
            st.buf = Vec::new();
            false
        });
        let dropped = before - map.len();
        if dropped > 0 {
            self.counters
                .stale_dropped
                .fetch_add(dropped as u64, Ordering::Relaxed);
            log::warn!(
                "dropped {dropped} partially dumped block(s): their other shards never came"
            );
            self.room.notify_waiters();
        }
    }

    /// Reserves staging room for one block, waiting while the buffer is full.
    async fn reserve(&self, core: &RemoteCore) {
        let need = core.layout.file_len();
        let budget = self.budget.max(need);
        loop {
            let notified = self.room.notified();
            let cur = self.staged_bytes.load(Ordering::Acquire);
            if cur + need <= budget {
                if self
                    .staged_bytes
                    .compare_exchange(cur, cur + need, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
                {
                    return;
                }
                continue;
            }
            self.sweep_stale(core);
            let _ = tokio::time::timeout(Duration::from_millis(100), notified).await;
        }
    }

    fn release(&self, bytes: u64) {
        self.staged_bytes.fetch_sub(bytes, Ordering::AcqRel);
        self.room.notify_waiters();
    }

    /// Waits up to `grace` for the writes in flight (at close); blocks whose
    /// shards never all came are dropped, with a warning naming `store`.
    pub fn drain(&self, store: &str, grace: Duration) {
        let until = Instant::now() + grace;
        while !self.uploads.lock().is_empty() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
        }
        let partial = self.staging.lock().len();
        if partial > 0 {
            log::warn!(
                "{store} store closed with {partial} partially dumped block(s); they are dropped"
            );
        }
    }

    /// Adds the staging figures to a store's stats.
    pub fn add_stats(&self, put: &mut dyn FnMut(&str, u64)) {
        let c = &self.counters;
        put("blocks_uploaded", c.blocks_uploaded.load(Ordering::Relaxed));
        put("upload_failures", c.upload_failures.load(Ordering::Relaxed));
        put(
            "stale_staged_dropped",
            c.stale_dropped.load(Ordering::Relaxed),
        );
        put("staged_blocks", self.staging.lock().len() as u64);
        put("staged_bytes", self.staged_bytes.load(Ordering::Relaxed));
    }

    /// Copies shards into a staged block; the whole buffer once complete.
    fn stage_shards(core: &RemoteCore, st: &mut Staged, shards: &[ShardIo]) -> Option<Vec<u8>> {
        for s in shards {
            if st.have[s.index] {
                continue;
            }
            let off = core.layout.offset(s.index) as usize;
            let stride = core.layout.stride;
            // SAFETY: the caller keeps the segments valid until its task
            // completes; the region lies inside the block buffer.
            unsafe { encode_region(&core.layout, s, &mut st.buf[off..off + stride]) };
            st.have[s.index] = true;
            st.count += 1;
        }
        st.last_activity = Instant::now();
        if st.count == core.layout.shard_count {
            st.closed = true;
            Some(std::mem::take(&mut st.buf))
        } else {
            None
        }
    }
}

/// Stages shards of one block; the unit that completes the block waits for
/// its write.
pub async fn stage<B: Uploader>(
    backend: Arc<B>,
    block: BlockId,
    shards: Vec<ShardIo>,
) -> Result<()> {
    let core = backend.core();
    let stager = backend.stager();
    if core.cache.get(&block) == Some(true) {
        // Content-addressed: the stored block already holds these bytes.
        return Ok(());
    }
    let file_len = core.layout.file_len();
    let mut reserved = false;
    let entry = loop {
        {
            let mut map = stager.staging.lock();
            let upload = stager.uploads.lock().get(&block).cloned();
            if let Some(up) = upload {
                drop(map);
                if reserved {
                    stager.release(file_len);
                }
                return up.await;
            }
            if let Some(e) = map.get(&block) {
                if reserved {
                    stager.release(file_len);
                }
                break e.clone();
            }
            if reserved {
                let e = Arc::new(Mutex::new(Staged {
                    buf: vec![0u8; file_len as usize],
                    have: vec![false; core.layout.shard_count],
                    count: 0,
                    last_activity: Instant::now(),
                    closed: false,
                }));
                map.insert(block, e.clone());
                break e;
            }
        }
        stager.reserve(core).await;
        reserved = true;
    };
    // Copy the shards in (no await while holding the entry: a cancelled
    // future never leaves a half-copied shard behind).
    let complete = {
        let mut st = entry.lock();
        if st.closed {
            None
        } else {
            Some(Stager::stage_shards(core, &mut st, &shards))
        }
    };
    let complete = match complete {
        // Completed or dropped meanwhile: start over (cheap and rare).
        None => return Box::pin(stage(backend.clone(), block, shards)).await,
        Some(c) => c,
    };
    let Some(buf) = complete else {
        return Ok(());
    };
    start_upload(backend.clone(), block, buf).await
}

/// Moves a complete block from staging to a write that runs to its end on
/// the runtime (even if the task that completed it times out).
fn start_upload<B: Uploader>(backend: Arc<B>, block: BlockId, buf: Vec<u8>) -> Upload {
    let len = buf.len() as u64;
    let (tx, rx) = tokio::sync::oneshot::channel::<Result<()>>();
    let up: Upload = async move { rx.await.unwrap_or(Err(UcmError::Closed)) }
        .boxed()
        .shared();
    {
        // Registered before the write starts, so the write's own removal
        // always comes after (a finished upload never lingers).
        let stager = backend.stager();
        let mut map = stager.staging.lock();
        map.remove(&block);
        stager.uploads.lock().insert(block, up.clone());
    }
    let handle = backend.core().handle.clone();
    handle.spawn(async move {
        let outcome = match backend
            .core()
            .breaker
            .check(&format!("upload of block {block}"))
        {
            Ok(()) => backend.clone().put_block(block, buf).await,
            Err(e) => Err(e),
        };
        let (core, stager) = (backend.core(), backend.stager());
        match &outcome {
            Ok(()) => {
                core.breaker.reset();
                stager
                    .counters
                    .blocks_uploaded
                    .fetch_add(1, Ordering::Relaxed);
                core.counters.bytes_dumped.fetch_add(len, Ordering::Relaxed);
                core.cache.put(block, true);
            }
            Err(_) => {
                stager
                    .counters
                    .upload_failures
                    .fetch_add(1, Ordering::Relaxed);
                core.cache.forget(&block);
            }
        }
        stager.uploads.lock().remove(&block);
        stager.release(len);
        let _ = tx.send(outcome);
    });
    up
}
