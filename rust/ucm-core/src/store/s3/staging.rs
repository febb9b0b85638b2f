//! Layer-wise dumps staged in memory: each block's shards are copied into
//! a staging buffer, in whatever order and task they come, within the
//! `staging_bytes` budget; the shard that completes a block starts its one
//! PUT, which every unit still staging the block waits for.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::future::{BoxFuture, FutureExt, Shared as SharedFuture};
use object_store::{ObjectStoreExt, PutPayload};
use parking_lot::Mutex;

use super::S3Backend;
use crate::block::{BlockId, ShardIo};
use crate::error::{Result, UcmError};
use crate::store::format::codec::encode_region;

/// The PUT of a complete block, awaited by every unit that staged part
/// of it.
pub(super) type Upload = SharedFuture<BoxFuture<'static, Result<()>>>;

/// One block whose shards are being assembled.
pub(super) struct Staged {
    buf: Vec<u8>,
    have: Vec<bool>,
    count: usize,
    last_activity: Instant,
    /// Set once the block left the staging map (complete or dropped).
    closed: bool,
}

impl S3Backend {
    /// Drops staged blocks nobody added a shard to for a long time.
    fn sweep_stale(&self) {
        let limit = self.core.stale_after();
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
    async fn reserve(&self) -> Result<()> {
        let need = self.core.layout.file_len();
        let budget = self.cfg.staging_bytes.max(need);
        loop {
            let notified = self.room.notified();
            let cur = self.staged_bytes.load(Ordering::Acquire);
            if cur + need <= budget {
                if self
                    .staged_bytes
                    .compare_exchange(cur, cur + need, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
                {
                    return Ok(());
                }
                continue;
            }
            self.sweep_stale();
            let _ = tokio::time::timeout(Duration::from_millis(100), notified).await;
        }
    }

    fn release(&self, bytes: u64) {
        self.staged_bytes.fetch_sub(bytes, Ordering::AcqRel);
        self.room.notify_waiters();
    }

    /// Stages shards of one block; the unit that completes the block
    /// waits for its upload.
    pub(super) async fn stage(self: Arc<Self>, block: BlockId, shards: Vec<ShardIo>) -> Result<()> {
        if self.core.cache.get(&block) == Some(true) {
            // Content-addressed: the stored block already holds these bytes.
            return Ok(());
        }
        let mut reserved = false;
        let entry = loop {
            {
                let mut map = self.staging.lock();
                let upload = self.uploads.lock().get(&block).cloned();
                if let Some(up) = upload {
                    drop(map);
                    if reserved {
                        self.release(self.core.layout.file_len());
                    }
                    return up.await;
                }
                if let Some(e) = map.get(&block) {
                    if reserved {
                        self.release(self.core.layout.file_len());
                    }
                    break e.clone();
                }
                if reserved {
                    let e = Arc::new(Mutex::new(Staged {
                        buf: vec![0u8; self.core.layout.file_len() as usize],
                        have: vec![false; self.core.layout.shard_count],
                        count: 0,
                        last_activity: Instant::now(),
                        closed: false,
                    }));
                    map.insert(block, e.clone());
                    break e;
                }
            }
            self.reserve().await?;
            reserved = true;
        };
        // Copy the shards in (no await while holding the entry: a cancelled
        // future never leaves a half-copied shard behind).
        let complete = {
            let mut st = entry.lock();
            if st.closed {
                None
            } else {
                Some(self.stage_shards(&mut st, &shards))
            }
        };
        let complete = match complete {
            // Completed or dropped meanwhile: start over (cheap and rare).
            None => return Box::pin(self.clone().stage(block, shards)).await,
            Some(c) => c,
        };
        let Some(buf) = complete else {
            return Ok(());
        };
        let up = self.clone().start_upload(block, buf);
        up.await
    }

    /// Copies shards into a staged block; the whole buffer once complete.
    fn stage_shards(&self, st: &mut Staged, shards: &[ShardIo]) -> Option<Vec<u8>> {
        {
            for s in shards {
                if st.have[s.index] {
                    continue;
                }
                let off = self.core.layout.offset(s.index) as usize;
                let stride = self.core.layout.stride;
                // SAFETY: the caller keeps the segments valid until its task
                // completes; the region lies inside the block buffer.
                unsafe { encode_region(&self.core.layout, s, &mut st.buf[off..off + stride]) };
                st.have[s.index] = true;
                st.count += 1;
            }
            st.last_activity = Instant::now();
            if st.count == self.core.layout.shard_count {
                st.closed = true;
                Some(std::mem::take(&mut st.buf))
            } else {
                None
            }
        }
    }

    /// Moves a complete block from staging to an upload that runs to its end
    /// on the runtime (even if the task that completed it times out).
    fn start_upload(self: Arc<Self>, block: BlockId, buf: Vec<u8>) -> Upload {
        let len = buf.len() as u64;
        let (tx, rx) = tokio::sync::oneshot::channel::<Result<()>>();
        let up: Upload = async move { rx.await.unwrap_or(Err(UcmError::Closed)) }
            .boxed()
            .shared();
        {
            // Registered before the PUT starts, so the PUT's own removal
            // always comes after (a finished upload never lingers).
            let mut map = self.staging.lock();
            map.remove(&block);
            self.uploads.lock().insert(block, up.clone());
        }
        let s = self.clone();
        self.core.handle.spawn(async move {
            let outcome = async {
                s.core.breaker.check(&format!("upload of block {block}"))?;
                let path = s.path(&block);
                let _permit = s.limiter.acquire().await;
                s.counters.puts.fetch_add(1, Ordering::Relaxed);
                match s
                    .client
                    .put(&path, PutPayload::from(Bytes::from(buf)))
                    .await
                {
                    Ok(_) => {
                        s.core.breaker.reset();
                        Ok(())
                    }
                    Err(e) => Err(s.note_err("PUT", &s.url_of(&block), e)),
                }
            }
            .await;
            match &outcome {
                Ok(()) => {
                    s.counters.blocks_uploaded.fetch_add(1, Ordering::Relaxed);
                    s.core
                        .counters
                        .bytes_dumped
                        .fetch_add(len, Ordering::Relaxed);
                    s.core.cache.put(block, true);
                }
                Err(_) => {
                    s.counters.upload_failures.fetch_add(1, Ordering::Relaxed);
                    s.core.cache.forget(&block);
                }
            }
            s.uploads.lock().remove(&block);
            s.release(len);
            let _ = tx.send(outcome);
        });
        up
    }
}
