//! Dumps: each new block is assembled in a temporary file (a spare when
//! one is ready) by [`BlockWriter`], whatever order or task its shards
//! arrive in, and published by a rename on the committer thread once every
//! shard is written.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::layout::{checksum_segs, HEADER_LEN};
use super::writer::{self, BlockWriter, Claim};
use super::{evict, Shared};
use crate::block::{BlockId, MemSeg, ShardIo};
use crate::error::{Result, UcmError};
use crate::io::{IoEngine, IoOp, IoRequest};
use crate::task::Task;

/// Longest a load waits for a commit in progress (a rename and an index
/// insert; the bound only matters if the committing thread is starved).
const COMMIT_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

impl Shared {
    /// The writer assembling `block`, or None when the block is already
    /// published. Checked under the writers lock: a commit inserts into the
    /// index before it forgets its writer, so a shard arriving around a
    /// commit either joins that writer or sees the published block, and
    /// never starts a second writer that would wait forever for shards
    /// already written.
    pub(super) fn writer_for(&self, block: &BlockId) -> Option<Arc<BlockWriter>> {
        let assembling = {
            let writers = self.writers.lock();
            if let Some(w) = writers.get(block) {
                if w.failure().is_none() {
                    return Some(w.clone());
                }
            }
            if self.index.contains(block) {
                return None;
            }
            writers.len()
        };
        // Outside the lock: finding a file may evict (rename) a batch.
        let root = self.paths.root_index(block);
        let spare = self.spare_for_new_block(root, assembling);
        let mut writers = self.writers.lock();
        let existing = writers
            .get(block)
            .filter(|w| w.failure().is_none())
            .cloned();
        if existing.is_some() || self.index.contains(block) {
            if let Some(f) = spare {
                self.spares.put_back(root, f);
            }
            return existing;
        }
        if self.spare_reserve_bytes() > 0 {
            // At capacity the pool is refilled by evicting ahead of need.
            evict::wake(self);
        }
        let tmp = spare.unwrap_or_else(|| {
            let seq = self.tmp_seq.fetch_add(1, Ordering::Relaxed);
            self.paths.temp(block, seq)
        });
        let w = Arc::new(BlockWriter::new(*block, tmp, self.layout.shard_count));
        writers.insert(*block, w.clone());
        Some(w)
    }

    /// A spare file for a new block under root `root`, with `assembling`
    /// other blocks being written. When the pool is empty and the new
    /// block would take the store past its capacity, evicts a batch
    /// of cold blocks into the pool now (one rename each) instead of
    /// creating a file, which on ext4 costs more than writing a 1 MiB
    /// shard, only for the evictor to delete another one right after. A
    /// burst of dumps into a store at capacity thus never creates or
    /// deletes files, whatever the pool's size. None: create a file.
    pub(super) fn spare_for_new_block(&self, root: usize, assembling: usize) -> Option<PathBuf> {
        if let Some(f) = self.spares.take(root) {
            return Some(f);
        }
        let cap = self.cfg.capacity_bytes;
        if cap == 0 || !self.spares.enabled() {
            return None;
        }
        let len = self.layout.file_len().max(1);
        let after = self.index.used_bytes() + (assembling as u64 + 1) * len;
        if after <= cap {
            return None;
        }
        // One refill at a time; the others then find its files.
        let _refilling = self.refill_lock.lock();
        if let Some(f) = self.spares.take(root) {
            return Some(f);
        }
        // Down to the evictor's low watermark, in one batch.
        let band = (cap as f64 * evict::LOW_WATERMARK) as u64;
        let want = (after.saturating_sub(band) / len).clamp(1, self.spares.target() as u64);
        evict::recycle_coldest(self, root, want as usize);
        self.spares.take(root)
    }

    /// True when `block` had all its shards written and its commit, in
    /// progress on another thread, has now finished.
    pub(super) fn commit_settled(&self, block: &BlockId) -> bool {
        let writer = self.writers.lock().get(block).cloned();
        writer.is_some_and(|w| w.all_written() && w.wait_settled(COMMIT_WAIT))
    }

    /// Drops every block still being assembled (at close: their missing
    /// shards can no longer arrive) and removes their temporary files.
    pub(super) fn abandon_writers(&self) {
        let pending: Vec<_> = self.writers.lock().drain().map(|(_, w)| w).collect();
        for w in pending {
            w.abandon();
            let _ = std::fs::remove_file(&w.tmp);
        }
    }

    pub(super) fn forget_writer(&self, w: &Arc<BlockWriter>) {
        let mut writers = self.writers.lock();
        if writers.get(&w.block).is_some_and(|cur| Arc::ptr_eq(cur, w)) {
            writers.remove(&w.block);
        }
    }

    pub(super) fn start_dump(
        self: &Arc<Self>,
        engine: &Arc<dyn IoEngine>,
        task: &Arc<Task>,
        shard: ShardIo,
    ) -> Result<()> {
        let Some(writer) = self.writer_for(&shard.block) else {
            // Content-addressed: the published block already holds these bytes.
            task.complete_unit(Ok(()));
            return Ok(());
        };
        match writer.claim(shard.index, task) {
            Claim::Write => {}
            Claim::AlreadyDone => {
                task.complete_unit(Ok(()));
                return Ok(());
            }
            Claim::Joined => return Ok(()),
            Claim::Failed(e) => return Err(e),
        }
        match self.submit_write(engine, task, &writer, &shard) {
            Ok(()) => Ok(()),
            Err(e) => {
                let done = writer.finish(shard.index, &Err(e.clone()));
                self.after_write(&writer, done, Err(e), task);
                Ok(())
            }
        }
    }

    pub(super) fn submit_write(
        self: &Arc<Self>,
        engine: &Arc<dyn IoEngine>,
        task: &Arc<Task>,
        writer: &Arc<BlockWriter>,
        shard: &ShardIo,
    ) -> Result<()> {
        let open = self.opener.write(&writer.tmp)?;
        let size = self.layout.shard_size;
        let padded = self.padded();
        let bounce_needed = open.direct && !self.align.fits(&shard.segs);
        let head_len = if bounce_needed {
            HEADER_LEN + padded
        } else {
            HEADER_LEN
        };
        let mut head = engine.bounce(head_len);
        let checksum = if bounce_needed {
            let mut off = HEADER_LEN;
            for s in &shard.segs {
                // SAFETY: source valid per the caller's contract; the
                // destination range lies inside the bounce buffer.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        s.addr as *const u8,
                        head[off..].as_mut_ptr(),
                        s.len,
                    )
                };
                off += s.len;
            }
            head[HEADER_LEN + size..head_len].fill(0);
            xxhash_rust::xxh3::xxh3_64(&head[HEADER_LEN..HEADER_LEN + size])
        } else {
            // SAFETY: valid per the caller's contract.
            unsafe { checksum_segs(&shard.segs) }
        };
        head[..HEADER_LEN].fill(0);
        self.header_for(shard, checksum)
            .encode(&mut head[..HEADER_LEN]);
        let mut iov = vec![MemSeg {
            addr: head.as_mut_ptr() as usize,
            len: head_len,
        }];
        if !bounce_needed {
            iov.extend_from_slice(&shard.segs);
            if padded > size {
                iov.push(MemSeg {
                    addr: self.zero_pad.as_ptr() as usize,
                    len: padded - size,
                });
            }
        }
        let fixed = if bounce_needed {
            head.fixed_index()
        } else {
            None
        };
        let expected: usize = iov.iter().map(|s| s.len).sum();
        let req = IoRequest {
            op: IoOp::Write,
            fd: std::os::fd::AsRawFd::as_raw_fd(&open.file),
            offset: self.layout.offset(shard.index),
            iov,
            fixed,
        };
        let shared = self.clone();
        let task = task.clone();
        let writer = writer.clone();
        let index = shard.index;
        self.begin_io();
        engine.submit(
            req,
            Box::new(move |res| {
                drop(head);
                drop(open);
                let result = match res {
                    Ok(n) if n == expected => Ok(()),
                    Ok(n) => Err(UcmError::Os {
                        op: "pwrite",
                        path: writer.tmp.display().to_string(),
                        source: Arc::new(std::io::Error::other(format!(
                            "short write: {n} of {expected} bytes"
                        ))),
                    }),
                    Err(e) => Err(UcmError::os("pwrite", &writer.tmp, e)),
                };
                if result.is_ok() {
                    shared
                        .counters
                        .shards_dumped
                        .fetch_add(1, Ordering::Relaxed);
                }
                let done = writer.finish(index, &result);
                let complete = done.complete;
                let s = shared.clone();
                let finish = move || {
                    s.after_write(&writer, done, result, &task);
                    s.end_io();
                };
                if complete {
                    // The rename goes to the committer thread: an I/O
                    // thread (io_uring has one) that renamed would leave
                    // the queue without new writes meanwhile.
                    shared.defer(Box::new(finish));
                } else {
                    finish();
                }
            }),
        );
        Ok(())
    }

    /// Publishes or discards the block as the write outcome says, then
    /// completes the writing task and every task that joined the write.
    pub(super) fn after_write(
        &self,
        writer: &Arc<BlockWriter>,
        done: writer::Finished,
        result: Result<()>,
        task: &Arc<Task>,
    ) {
        let mut outcome = result;
        if done.complete {
            outcome = self.commit(writer);
            self.forget_writer(writer);
            writer.settle();
        } else if done.failed_now {
            self.forget_writer(writer);
            let _ = std::fs::remove_file(&writer.tmp);
            writer.settle();
        } else if outcome.is_ok() {
            if let Some(e) = writer.failure() {
                outcome = Err(e);
            }
        }
        for t in done.joined {
            t.complete_unit(outcome.clone());
        }
        task.complete_unit(outcome);
    }

    pub(super) fn commit(&self, writer: &BlockWriter) -> Result<()> {
        let dst = self.paths.block(&writer.block);
        if let Err(e) = std::fs::rename(&writer.tmp, &dst) {
            let _ = std::fs::remove_file(&writer.tmp);
            return Err(UcmError::os("rename", &writer.tmp, e));
        }
        self.index
            .insert(writer.block, self.layout.file_len(), None);
        self.counters
            .blocks_committed
            .fetch_add(1, Ordering::Relaxed);
        if self.cfg.capacity_bytes > 0 && self.index.used_bytes() > self.cfg.capacity_bytes {
            evict::wake(self);
        }
        Ok(())
    }
}
