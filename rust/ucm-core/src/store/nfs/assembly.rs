//! Blocks assembled in temporary files: shards claimed and written by
//! whichever unit brings them, the block published (made stable, then
//! renamed) by the unit that writes its last shard, and assemblies nobody
//! finishes swept away.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nfs3_client::nfs3_types::nfs3::writeverf3;
use parking_lot::Mutex;

use super::fs::TempFile;
use super::NfsBackend;
use crate::block::{BlockId, ShardIo};
use crate::error::{Result, UcmError};
use crate::io::AlignedBuf;
use crate::store::format::codec::encode_region;
use crate::store::remote::run_blocking;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Slot {
    Empty,
    InFlight,
    Done,
}

/// One block being assembled in a temporary file.
pub(super) struct Assembly {
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

/// Shards of this unit, each copied out of caller memory, by index.
type Copied = Vec<(usize, Arc<AlignedBuf>)>;

/// What a unit found when it claimed its shards.
enum Claim {
    /// The assembly was closed meanwhile (published or failed).
    Closed,
    /// The shards this unit writes, and those another unit is writing.
    Shards { mine: Copied, others: Vec<usize> },
}

impl Assembly {
    /// Waits until none of `shards` is in flight; fails with the block.
    async fn settled(&self, shards: &[usize]) -> Result<()> {
        loop {
            let notified = self.changed.notified();
            {
                let st = self.state.lock();
                if let Some(e) = &st.failed {
                    return Err(e.clone());
                }
                if shards.iter().all(|i| st.slots[*i] != Slot::InFlight) {
                    return Ok(());
                }
            }
            notified.await;
        }
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

    /// Removes the temporaries of blocks that will never complete (the
    /// store is closing).
    pub(super) fn drop_pending(self: &Arc<Self>) {
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
    pub(super) async fn assemble(
        self: Arc<Self>,
        block: BlockId,
        shards: Vec<ShardIo>,
    ) -> Result<()> {
        if self.core.cache.get(&block) == Some(true) {
            // Content-addressed: the published block holds these bytes.
            return Ok(());
        }
        let a = self.assembly(&block);
        // Claimed shards are copied out of caller memory right away (no
        // await before: a cancelled unit never reads caller memory later).
        let (mine, others) = match self.claim(&a, &shards)? {
            Claim::Shards { mine, others } => (mine, others),
            Claim::Closed => {
                // Published or failed meanwhile.
                if self.core.cache.get(&block) == Some(true) {
                    return Ok(());
                }
                return Box::pin(self.clone().assemble(block, shards)).await;
            }
        };
        if !mine.is_empty() {
            let file = self.temp_file(&block, &a).await?;
            if self.write_shards(&block, &a, &file, &mine).await? {
                return self.publish(&block, &a, &file).await;
            }
        }
        // Shards another task is writing: this unit completes with them.
        a.settled(&others).await
    }

    /// Claims the shards nobody wrote yet, copying them out of caller
    /// memory, and notes those another unit is writing.
    fn claim(&self, a: &Assembly, shards: &[ShardIo]) -> Result<Claim> {
        let stride = self.core.layout.stride;
        let mut st = a.state.lock();
        if st.closed {
            return Ok(Claim::Closed);
        }
        if let Some(e) = &st.failed {
            return Err(e.clone());
        }
        st.last_activity = Instant::now();
        let mut mine = Vec::new();
        let mut others = Vec::new();
        for s in shards {
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
        Ok(Claim::Shards { mine, others })
    }

    /// The block's temporary file, created by the first unit that needs
    /// it; failing to create it fails the block.
    async fn temp_file(
        self: &Arc<Self>,
        block: &BlockId,
        a: &Arc<Assembly>,
    ) -> Result<Arc<TempFile>> {
        let file = a
            .file
            .get_or_init(|| {
                let s = self.clone();
                let tmp = a.tmp.clone();
                let block = *block;
                async move { s.fs.create(&block, &tmp).await }
            })
            .await
            .clone();
        if let Err(e) = &file {
            self.fail(block, a, e).await;
        }
        file
    }

    /// Writes this unit's shards at their offsets and records them; true
    /// when they were the block's last. A failed write fails the block.
    async fn write_shards(
        self: &Arc<Self>,
        block: &BlockId,
        a: &Arc<Assembly>,
        file: &Arc<TempFile>,
        mine: &Copied,
    ) -> Result<bool> {
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
                    self.fail(block, a, &e).await;
                    return Err(e);
                }
            }
        }
        self.counters
            .shards_dumped
            .fetch_add(mine.len() as u64, Ordering::Relaxed);
        self.record_written(block, a, mine, verf).await
    }

    /// Marks written shards done; true when the block is complete. Unstable
    /// writes before a server restart (the write verifier changed) may be
    /// lost, so such a block fails instead.
    async fn record_written(
        &self,
        block: &BlockId,
        a: &Arc<Assembly>,
        mine: &Copied,
        verf: Option<writeverf3>,
    ) -> Result<bool> {
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
            self.fail(block, a, &e).await;
            return Err(e);
        }
        let complete = {
            let mut st = a.state.lock();
            st.verf = st.verf.or(verf);
            for (index, _) in mine {
                st.slots[*index] = Slot::Done;
                st.done += 1;
            }
            st.last_activity = Instant::now();
            st.done == st.slots.len()
        };
        a.changed.notify_waiters();
        Ok(complete)
    }

    /// Makes a complete block stable and renames it to its name.
    async fn publish(&self, block: &BlockId, a: &Arc<Assembly>, file: &TempFile) -> Result<()> {
        let verf = a.state.lock().verf;
        match self.fs.publish(block, &a.tmp, file, verf).await {
            Ok(()) => {
                {
                    let mut st = a.state.lock();
                    st.published = true;
                    st.closed = true;
                }
                self.forget_assembly(block, a);
                a.changed.notify_waiters();
                self.core.cache.put(*block, true);
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
                self.fail(block, a, &e).await;
                Err(e)
            }
        }
    }
}
