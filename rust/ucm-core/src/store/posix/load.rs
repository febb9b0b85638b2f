//! Loads: a block file is opened once per run of adjacent shards, read
//! with one vectored request straight into caller memory (or through a
//! bounce buffer where O_DIRECT can't use it), and every shard's header and
//! checksum are verified before the shard counts as loaded. A shard that
//! fails verification is zeroed in caller memory and its file removed.

use std::sync::Arc;

use super::index;
use super::tree::Tree;
use super::{files, Shared};
use crate::block::{BlockId, MemSeg, ShardIo};
use crate::error::{Damage, Result, UcmError};
use crate::io::{IoEngine, IoOp, IoRequest};
use crate::store::format::layout::{checksum_segs, ShardHeader, HEADER_LEN};
use crate::task::Task;
use std::sync::atomic::Ordering;

/// What a read delivered of one shard's region.
struct Delivered<'a> {
    /// Bytes read, or the OS error.
    res: std::io::Result<usize>,
    /// Bytes a complete read of the shard delivers.
    expected: usize,
    /// The shard's header, followed by its data when `bounced`.
    head: &'a [u8],
    /// The data came through `head`, not straight into caller memory.
    bounced: bool,
}

impl Shared {
    /// Pins `block` (so eviction leaves it alone) and opens its file.
    pub(super) fn open_for_load(&self, block: &BlockId) -> Result<(index::Pin, files::OpenFile)> {
        let pin = match self.index.pin(block) {
            Some(p) => p,
            None if self.present(block) => self
                .index
                .pin(block)
                .ok_or_else(|| UcmError::NotFound(format!("block {block}")))?,
            None => {
                return Err(UcmError::NotFound(format!(
                    "block {block} is not in the store"
                )))
            }
        };
        let opened = self.tree.bucket(block).and_then(|dir| {
            let f = self
                .opener
                .read(&dir, &Tree::block_name(block), self.layout.file_len());
            if let Err(e @ UcmError::Corrupt { .. }) = &f {
                // Not a block file (a symlink, FIFO, device, directory, a
                // file of the wrong size): it would fail every later load,
                // and the next dump of the block replaces it.
                let _moves = self.file_moves.lock(&self.tree, block);
                self.index.remove(block);
                self.counters.corrupt_loads.fetch_add(1, Ordering::Relaxed);
                self.remove_block_file(&dir, block);
                log::warn!("{e}; removed it from the store");
            }
            f
        });
        match opened {
            Ok(f) => Ok((pin, f)),
            Err(e) => {
                if e.code() == -50005 {
                    // Evicted or deleted behind our back.
                    self.index.remove(block);
                }
                Err(e)
            }
        }
    }

    /// Loads a run of adjacent shards of one block (see [`load_runs`]) with
    /// one vectored read: one open, one request and one completion instead
    /// of one per shard. Completes one unit of `task` per shard.
    pub(super) fn start_load_run(
        self: &Arc<Self>,
        engine: &Arc<dyn IoEngine>,
        task: &Arc<Task>,
        run: Vec<ShardIo>,
    ) {
        let single = |shared: &Arc<Self>, run: Vec<ShardIo>| {
            for shard in run {
                if let Err(e) = shared.start_load(engine, task, shard) {
                    task.complete_unit(Err(e));
                }
            }
        };
        if run.len() < 2 {
            return single(self, run);
        }
        let (pin, open) = match self.open_for_load(&run[0].block) {
            Ok(p) => p,
            Err(e) => {
                for _ in 0..run.len() {
                    task.complete_unit(Err(e.clone()));
                }
                return;
            }
        };
        if open.direct && !run.iter().all(|s| self.align.fits(&s.segs)) {
            // Unaligned caller memory bounces shard by shard.
            drop((pin, open));
            return single(self, run);
        }
        let size = self.layout.shard_size;
        let pad = self.padded() - size;
        let mut heads = engine.bounce(HEADER_LEN * run.len());
        // The padding between regions is read into (and overwritten in) one
        // scratch buffer: it carries nothing.
        let mut sink = (pad > 0).then(|| engine.bounce(pad));
        let sink_at = sink.as_mut().map(|s| s.as_mut_ptr() as usize);
        let req = IoRequest {
            op: IoOp::Read,
            fd: std::os::fd::AsRawFd::as_raw_fd(&open.file),
            offset: self.layout.offset(run[0].index),
            iov: run_iov(&run, heads.as_mut_ptr() as usize, sink_at, pad),
            fixed: None,
        };
        let stride = HEADER_LEN + size + pad;
        self.submit_read(engine, task, req, move |shared, task, res| {
            let outcomes = shared.finish_run(&run, &res, &heads, stride, task);
            drop((open, pin, heads, sink));
            for outcome in outcomes {
                shared.complete_load(task, outcome);
            }
        });
    }

    pub(super) fn start_load(
        self: &Arc<Self>,
        engine: &Arc<dyn IoEngine>,
        task: &Arc<Task>,
        shard: ShardIo,
    ) -> Result<()> {
        let (pin, open) = self.open_for_load(&shard.block)?;
        let bounce_needed = open.direct && !self.align.fits(&shard.segs);
        let head_len = self.head_len(bounce_needed);
        let mut head = engine.bounce(head_len);
        let mut iov = vec![MemSeg {
            addr: head.as_mut_ptr() as usize,
            len: head_len,
        }];
        if !bounce_needed {
            iov.extend_from_slice(&shard.segs);
        }
        let fd = std::os::fd::AsRawFd::as_raw_fd(&open.file);
        let req = self.shard_request(IoOp::Read, fd, shard.index, &head, iov, bounce_needed);
        let expected = req.bytes();
        self.submit_read(engine, task, req, move |shared, task, res| {
            let got = Delivered {
                res,
                expected,
                head: &head[..],
                bounced: bounce_needed,
            };
            let outcome = shared.finish_load(&shard, got, task);
            drop((open, pin, head));
            shared.complete_load(task, outcome);
        });
        Ok(())
    }

    /// Submits a read counted in flight ([`Shared::begin_io`]); `done` runs
    /// on completion, before the count drops, and must release the file,
    /// pin and buffers the request used.
    fn submit_read(
        self: &Arc<Self>,
        engine: &Arc<dyn IoEngine>,
        task: &Arc<Task>,
        req: IoRequest,
        done: impl FnOnce(&Arc<Self>, &Arc<Task>, std::io::Result<usize>) + Send + 'static,
    ) {
        let shared = self.clone();
        let task = task.clone();
        self.begin_io();
        engine.submit(
            req,
            Box::new(move |res| {
                done(&shared, &task, res);
                shared.end_io();
            }),
        );
    }

    /// The outcome of each shard of a run read with one request (`res`),
    /// its regions `stride` bytes apart and its headers in `heads`.
    fn finish_run(
        &self,
        run: &[ShardIo],
        res: &std::io::Result<usize>,
        heads: &[u8],
        stride: usize,
        task: &Task,
    ) -> Vec<Result<()>> {
        let region = HEADER_LEN + self.layout.shard_size;
        run.iter()
            .enumerate()
            .map(|(j, shard)| {
                let got = Delivered {
                    res: match res {
                        Ok(n) => Ok(n.saturating_sub(j * stride).min(region)),
                        Err(e) => Err(copy_io_error(e)),
                    },
                    expected: region,
                    head: &heads[j * HEADER_LEN..(j + 1) * HEADER_LEN],
                    bounced: false,
                };
                self.finish_load(shard, got, task)
            })
            .collect()
    }

    /// Counts and completes one loaded shard; callers release the file, pin
    /// and buffers first, so a finished task leaves the block evictable.
    pub(super) fn complete_load(&self, task: &Task, outcome: Result<()>) {
        if outcome.is_ok() {
            self.counters.shards_loaded.fetch_add(1, Ordering::Relaxed);
        }
        task.complete_unit(outcome);
    }

    /// The outcome of one shard's read: verified, and copied out of the
    /// bounce buffer when `bounced`; on failure, see [`Shared::load_failed`].
    fn finish_load(&self, shard: &ShardIo, got: Delivered<'_>, task: &Task) -> Result<()> {
        let (head, bounced) = (got.head, got.bounced);
        if let Err(e) = self.verify_load(shard, got) {
            return Err(self.load_failed(shard, e, bounced, task));
        }
        if bounced {
            let mut off = HEADER_LEN;
            for s in &shard.segs {
                // SAFETY: destination valid per the caller's contract;
                // source is inside the bounce buffer we own.
                unsafe {
                    std::ptr::copy_nonoverlapping(head[off..].as_ptr(), s.addr as *mut u8, s.len)
                };
                off += s.len;
            }
        }
        Ok(())
    }

    /// Checks what a read delivered of one shard: all `expected` bytes, a
    /// header of this shard and this layout, and the data's checksum (of
    /// the bounce buffer when `bounced`, else of caller memory).
    fn verify_load(&self, shard: &ShardIo, got: Delivered<'_>) -> Result<()> {
        let Delivered {
            res,
            expected,
            head,
            bounced,
        } = got;
        let n = res.map_err(|e| UcmError::os("read", self.tree.block_path(&shard.block), e))?;
        if n < expected {
            return Err(UcmError::corrupt(
                Damage::Truncated,
                Some(shard.block),
                Some(shard.index),
                format!(
                    "block {} shard {}: file is truncated ({n} of {expected} bytes)",
                    shard.block, shard.index
                ),
            ));
        }
        let hdr = ShardHeader::decode_expect(head, &shard.block, shard.index, &self.layout)?;
        let sum = if bounced {
            crate::hashing::xxh3::xxh3_64(&head[HEADER_LEN..HEADER_LEN + self.layout.shard_size])
        } else {
            // SAFETY: the caller guarantees the segments are valid
            // until its task completes, which happens after this.
            unsafe { checksum_segs(&shard.segs) }
        };
        if sum != hdr.checksum {
            return Err(UcmError::shard_checksum(shard.block, shard.index));
        }
        // A tier above filling its memory keeps the stored checksum.
        crate::store::format::carried::report_verified(&shard.segs, hdr.checksum);
        Ok(())
    }

    /// Handles a shard that failed to load with `e`: clears what arrived
    /// in caller memory, then keeps a stored block that is intact (the
    /// caller's memory changed under the read) or of another layout, and
    /// removes a corrupt one. Returns the error to complete the shard with.
    fn load_failed(&self, shard: &ShardIo, e: UcmError, bounced: bool, task: &Task) -> UcmError {
        if !bounced {
            // Don't leave foreign or corrupt bytes in caller memory.
            for s in &shard.segs {
                // SAFETY: destination valid per the caller's contract.
                unsafe { std::ptr::write_bytes(s.addr as *mut u8, 0, s.len) };
            }
        }
        let damage = match &e {
            UcmError::Corrupt { damage, .. } => Some(*damage),
            _ => None,
        };
        if damage.is_some() && !bounced && self.file_verifies(shard) {
            // The bytes were verified in the caller's memory, which
            // the caller changed while they were arriving (a race in
            // the caller, e.g. writing a block it is loading): the
            // stored block is intact and stays.
            let e = UcmError::corrupt(
                Damage::DestinationChanged,
                Some(shard.block),
                Some(shard.index),
                format!(
                    "block {} shard {}: the destination memory changed while the \
                     shard was being loaded (the stored block is intact)",
                    shard.block, shard.index
                ),
            );
            task.record_error(e.clone());
            log::warn!("{e}");
            return e;
        }
        if damage == Some(Damage::OtherLayout) {
            // Valid for the store that wrote it (a differently
            // configured engine sharing the directory): left alone.
            task.record_error(e.clone());
        } else if damage.is_some() {
            // Fail the task first: once the file is gone, the task's
            // other shards would report "not found" instead.
            task.record_error(e.clone());
            self.counters.corrupt_loads.fetch_add(1, Ordering::Relaxed);
            // A corrupt file would fail every later load: drop it so
            // the next dump of this block rewrites it.
            let _moves = self.file_moves.lock(&self.tree, &shard.block);
            self.index.remove(&shard.block);
            if let Ok(dir) = self.tree.bucket(&shard.block) {
                self.remove_block_file(&dir, &shard.block);
            }
            log::warn!("{e}; the block file was removed");
        }
        e
    }

    /// Removes whatever sits at `block`'s name in `dir` (the block's
    /// directory), never following it, and what the root's usage counted
    /// for it: a regular file's length (every store counts those).
    pub(super) fn remove_block_file(&self, dir: &files::Dir, block: &BlockId) {
        let name = Tree::block_name(block);
        let counted = dir
            .lstat(&name)
            .ok()
            .filter(|st| st.is_file())
            .map_or(0, |st| st.len);
        let part = super::usage::Part::Bucket(block.0[0]);
        let root = self.tree.root_index(block);
        let _changing = self.usage.changing(root, &[part]);
        if dir.remove_file(&name).is_ok() {
            self.usage.add_to(root, part, -(counted as i64));
        }
    }

    /// Reads one shard of a block file again into private memory and checks
    /// its header and checksum: true when the stored shard is intact.
    pub(super) fn file_verifies(&self, shard: &ShardIo) -> bool {
        use std::os::unix::fs::FileExt;
        let size = self.layout.shard_size;
        let buffered = files::Opener::new(false, self.cfg.strict);
        let Ok(dir) = self.tree.bucket(&shard.block) else {
            return false;
        };
        let Ok(files::OpenFile { file, .. }) = buffered.read(
            &dir,
            &Tree::block_name(&shard.block),
            self.layout.file_len(),
        ) else {
            return false;
        };
        let mut buf = vec![0u8; HEADER_LEN + size];
        if file
            .read_exact_at(&mut buf, self.layout.offset(shard.index))
            .is_err()
        {
            return false;
        }
        ShardHeader::decode_expect(&buf[..HEADER_LEN], &shard.block, shard.index, &self.layout)
            .is_ok_and(|hdr| crate::hashing::xxh3::xxh3_64(&buf[HEADER_LEN..]) == hdr.checksum)
    }
}

/// Most shards one coalesced read covers: a run needs up to three iovecs
/// per shard plus the tensors, well under IOV_MAX (1024).
const MAX_RUN_SHARDS: usize = 64;
/// Most iovecs in one coalesced read.
const MAX_RUN_IOVECS: usize = 1000;

/// Splits a load into runs of consecutive shards of one block with
/// consecutive indices (whole-block and multi-layer loads, which the
/// connector submits block-major), each read with one request.
pub(super) fn load_runs(shards: Vec<ShardIo>) -> Vec<Vec<ShardIo>> {
    let mut runs: Vec<Vec<ShardIo>> = Vec::new();
    let mut iovecs = 0;
    for shard in shards {
        let cost = shard.segs.len() + 2;
        if let Some(run) = runs.last_mut() {
            let last = &run[run.len() - 1];
            if last.block == shard.block
                && last.index + 1 == shard.index
                && run.len() < MAX_RUN_SHARDS
                && iovecs + cost <= MAX_RUN_IOVECS
            {
                iovecs += cost;
                run.push(shard);
                continue;
            }
        }
        iovecs = cost;
        runs.push(vec![shard]);
    }
    runs
}

/// The iov of one read of a run: each shard's header into `heads` (one
/// after the other), its bytes into caller memory, and the padding between
/// regions into the scratch buffer at `sink` (none when `pad` is 0).
fn run_iov(run: &[ShardIo], heads: usize, sink: Option<usize>, pad: usize) -> Vec<MemSeg> {
    let mut iov = Vec::with_capacity(run.len() * (run[0].segs.len() + 2));
    for (j, shard) in run.iter().enumerate() {
        if j > 0 {
            if let Some(sink) = sink {
                iov.push(MemSeg {
                    addr: sink,
                    len: pad,
                });
            }
        }
        iov.push(MemSeg {
            addr: heads + j * HEADER_LEN,
            len: HEADER_LEN,
        });
        iov.extend_from_slice(&shard.segs);
    }
    iov
}

/// `std::io::Error` is not `Clone`; keeps the OS code where there is one.
fn copy_io_error(e: &std::io::Error) -> std::io::Error {
    match e.raw_os_error() {
        Some(code) => std::io::Error::from_raw_os_error(code),
        None => std::io::Error::new(e.kind(), e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shard(block: u8, index: usize) -> ShardIo {
        ShardIo {
            block: BlockId([block; 16]),
            index,
            segs: vec![MemSeg { addr: 4096, len: 8 }],
        }
    }

    #[test]
    fn load_runs_group_adjacent_shards_of_one_block() {
        let shape = |shards: Vec<ShardIo>| -> Vec<Vec<(u8, usize)>> {
            load_runs(shards)
                .into_iter()
                .map(|r| r.iter().map(|s| (s.block.0[0], s.index)).collect())
                .collect()
        };
        let got = shape(vec![
            shard(1, 0),
            shard(1, 1),
            shard(1, 2),
            shard(2, 3),
            shard(2, 4),
            shard(2, 6),
            shard(2, 5),
        ]);
        assert_eq!(
            got,
            vec![
                vec![(1, 0), (1, 1), (1, 2)],
                vec![(2, 3), (2, 4)],
                vec![(2, 6)],
                vec![(2, 5)],
            ]
        );
        let long = shape((0..MAX_RUN_SHARDS + 3).map(|i| shard(3, i)).collect());
        assert_eq!(long.len(), 2);
        assert_eq!(long[0].len(), MAX_RUN_SHARDS);
    }
}
