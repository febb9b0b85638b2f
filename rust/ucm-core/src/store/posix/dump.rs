//! Dumps: each new block is assembled in a temporary file of the store's
//! work directory (a spare when one is ready) by [`BlockWriter`], whatever
//! order or task its shards arrive in, and published by a rename on a
//! committer thread once every shard is written, after the syncs that the
//! `durability` setting asks for.

use std::collections::{HashMap, HashSet};
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::config::Durability;
use super::temp::TempFile;
use super::tree::Tree;
use super::usage::Part;
use super::writer::{self, BlockWriter, Claim};
use super::{evict, scan, Shared};
use crate::block::{BlockId, MemSeg, ShardIo};
use crate::error::{Result, UcmError};
use crate::io::{BounceBuf, IoEngine, IoOp};
use crate::store::format::carried::{carried, dump_checksum};
use crate::store::format::layout::HEADER_LEN;
use crate::task::Task;

/// The blocks being assembled, and those whose file is still being found.
#[derive(Default)]
pub(super) struct Writers {
    by_block: HashMap<BlockId, Arc<BlockWriter>>,
    /// Blocks whose first shard is finding their file (taking a spare,
    /// recycling cold blocks, or creating one). Each holds, or is about to
    /// hold, a file that neither the index, the pool nor `by_block` counts
    /// yet, so the capacity check counts it here; the block's other shards
    /// wait for its writer instead of finding files of their own.
    opening: HashSet<BlockId>,
}

impl Writers {
    /// Block files held for blocks not yet published, one per block
    /// assembled or opening.
    pub(super) fn files(&self) -> usize {
        self.by_block.len() + self.opening.len()
    }

    /// True when no block is being assembled or opened.
    pub(super) fn is_empty(&self) -> bool {
        self.by_block.is_empty() && self.opening.is_empty()
    }

    /// True when `block` has every shard written and is being published.
    pub(super) fn committing(&self, block: &BlockId) -> bool {
        self.by_block.get(block).is_some_and(|w| w.all_written())
    }

    /// Every writer, leaving none (`opening` is left as it is: its owners
    /// finish or give up on their own).
    pub(super) fn drain(&mut self) -> Vec<Arc<BlockWriter>> {
        self.by_block.drain().map(|(_, w)| w).collect()
    }

    /// The writers that made no progress for `idle`.
    pub(super) fn stale(&self, idle: std::time::Duration) -> Vec<Arc<BlockWriter>> {
        self.by_block
            .values()
            .filter(|w| w.is_stale(idle))
            .cloned()
            .collect()
    }
}

/// A block registered in [`Writers::opening`]: leaving it, by
/// [`Opening::close`] or on drop (an error while finding the file), wakes
/// the block's other shards.
struct Opening<'a> {
    shared: &'a Shared,
    block: BlockId,
    open: bool,
}

impl Opening<'_> {
    fn close(&mut self, writers: &mut Writers) {
        if self.open {
            writers.opening.remove(&self.block);
            self.open = false;
            self.shared.opened.notify_all();
        }
    }
}

impl Drop for Opening<'_> {
    fn drop(&mut self) {
        if self.open {
            let shared = self.shared;
            let mut writers = shared.writers.lock();
            self.close(&mut writers);
        }
    }
}

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
    ///
    /// The shards of a new block arrive on several workers at once: the
    /// first finds the block's file, the others wait for its writer. Were
    /// each to find one, a block would take several spares (its siblings'
    /// only to give them back), and files held that way, counted nowhere,
    /// would make a store at capacity look as if it had room to create.
    pub(super) fn writer_for(&self, block: &BlockId) -> Result<Option<Arc<BlockWriter>>> {
        let mut opening = {
            let mut writers = self.writers.lock();
            loop {
                if let Some(w) = writers.by_block.get(block) {
                    if w.failure().is_none() {
                        return Ok(Some(w.clone()));
                    }
                }
                if self.published(block) && self.dumped_again(block) {
                    return Ok(None);
                }
                if !writers.opening.contains(block) {
                    break;
                }
                self.opened.wait(&mut writers);
            }
            writers.opening.insert(*block);
            Opening {
                shared: self,
                block: *block,
                open: true,
            }
        };
        // Outside the lock: finding a file may evict (rename) a batch, and
        // creating one is slow on some file systems.
        let root = self.tree.root_index(block);
        let temp = self.temp_file(block, root)?;
        let mut writers = self.writers.lock();
        let existing = writers
            .by_block
            .get(block)
            .filter(|w| w.failure().is_none())
            .cloned();
        if existing.is_some() || (self.published(block) && self.dumped_again(block)) {
            let TempFile { temp, file, spare } = temp;
            drop(file);
            // Still opening, so the file stays counted until it is back.
            if spare {
                self.spares.put_back(root, &temp.name);
            } else {
                self.discard_temp(&temp);
            }
            opening.close(&mut writers);
            return Ok(existing);
        }
        if self.spare_reserve_bytes() > 0 {
            // At capacity the pool is refilled by evicting ahead of need.
            evict::wake(self);
        }
        let w = Arc::new(BlockWriter::new(
            *block,
            temp.temp,
            temp.file,
            self.layout.shard_count,
        ));
        writers.by_block.insert(*block, w.clone());
        opening.close(&mut writers);
        Ok(Some(w))
    }

    /// True when `block` is published, as far as this store can tell
    /// without reading its directory: in the index, or, in a directory the
    /// index does not know whole, found at its name (one `stat`).
    fn published(&self, block: &BlockId) -> bool {
        if self.index.contains(block) {
            return true;
        }
        let bucket = (self.tree.root_index(block), block.0[0]);
        !self.listing.complete(bucket)
            && self.tree.bucket(block).is_ok_and(|dir| {
                scan::probe(&dir, &Tree::block_name(block), self.layout.file_len()).is_some()
            })
    }

    /// A dump of a block already published: its bytes are there already
    /// (content addressing), but its file's mtime is set to now, which is
    /// what tells every store sharing the directory that it was just
    /// dumped (see `evict`), and its recency here is refreshed. False when
    /// the file is gone (another store evicted it): the dump must write it.
    fn dumped_again(&self, block: &BlockId) -> bool {
        let name = Tree::block_name(block);
        let touched = self.tree.bucket(block).ok().and_then(|dir| {
            dir.touch(&name).ok()?;
            dir.lstat(&name).ok()
        });
        match touched {
            Some(st) if st.is_file() && st.len == self.layout.file_len() => {
                self.index.insert(*block, Some(st.mtime_ns));
                true
            }
            _ => {
                self.index.remove(block);
                false
            }
        }
    }

    /// True when `block` had all its shards written and its commit, in
    /// progress on another thread, has now finished.
    pub(super) fn commit_settled(&self, block: &BlockId) -> bool {
        let writer = self.writers.lock().by_block.get(block).cloned();
        writer.is_some_and(|w| w.all_written() && w.wait_settled(COMMIT_WAIT))
    }

    /// Removes what sits at a block's name in `dir` when it is not a block
    /// file (a link itself, a FIFO, a device, an empty directory, a file of
    /// another length), so that the block can be published there; true
    /// when something was removed.
    fn remove_foreign(&self, dir: &super::files::Dir, name: &str, root: usize, part: Part) -> bool {
        let Ok(st) = dir.lstat(name) else {
            return false;
        };
        if st.is_file() && st.len == self.layout.file_len() {
            return false; // a block: published by another store meanwhile
        }
        let removed = super::files::remove_non_block(dir, name.as_ref(), &st);
        if removed.is_ok() && st.is_file() {
            // Scans count every regular file at a block's name.
            self.usage.add_to(root, part, -(st.len as i64));
        }
        removed.is_ok()
    }

    /// Drops every block still being assembled (at close: their missing
    /// shards can no longer arrive) and removes their temporary files.
    pub(super) fn abandon_writers(&self) {
        let pending = self.writers.lock().drain();
        for w in pending {
            w.abandon();
            self.discard_temp(&w.tmp);
        }
    }

    pub(super) fn forget_writer(&self, w: &Arc<BlockWriter>) {
        let mut writers = self.writers.lock();
        if writers
            .by_block
            .get(&w.block)
            .is_some_and(|cur| Arc::ptr_eq(cur, w))
        {
            writers.by_block.remove(&w.block);
        }
    }

    pub(super) fn start_dump(
        self: &Arc<Self>,
        engine: &Arc<dyn IoEngine>,
        task: &Arc<Task>,
        shard: ShardIo,
    ) -> Result<()> {
        let Some(writer) = self.writer_for(&shard.block)? else {
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
        let bounce_needed = writer.file.direct && !self.align.fits(&shard.segs);
        let (mut head, head_len) = self.shard_head(engine, shard, bounce_needed);
        let iov = self.write_iov(&mut head, head_len, shard, bounce_needed);
        // The writer (and so the file) lives until the completion.
        let fd = writer.file.file.as_raw_fd();
        let req = self.shard_request(IoOp::Write, fd, shard.index, &head, iov, bounce_needed);
        let expected = req.bytes();
        let shared = self.clone();
        let task = task.clone();
        let writer = writer.clone();
        let index = shard.index;
        self.begin_io();
        engine.submit(
            req,
            Box::new(move |res| {
                drop(head);
                let result = write_outcome(res, expected, &writer);
                shared.written(writer, index, result, task);
            }),
        );
        Ok(())
    }

    /// The buffer written first for a shard, and its length: the shard
    /// header, followed under O_DIRECT with unaligned caller memory
    /// (`bounce_needed`) by a zero-padded copy of the shard's bytes.
    fn shard_head(
        &self,
        engine: &Arc<dyn IoEngine>,
        shard: &ShardIo,
        bounce_needed: bool,
    ) -> (BounceBuf, usize) {
        let size = self.layout.shard_size;
        let head_len = self.head_len(bounce_needed);
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
            // A checksum carried down by a tier above is stored as is.
            carried(&shard.segs).unwrap_or_else(|| {
                crate::hashing::xxh3::xxh3_64(&head[HEADER_LEN..HEADER_LEN + size])
            })
        } else {
            // SAFETY: valid per the caller's contract.
            unsafe { dump_checksum(&shard.segs) }
        };
        head[..HEADER_LEN].fill(0);
        self.header_for(shard, checksum)
            .encode(&mut head[..HEADER_LEN]);
        (head, head_len)
    }

    /// What one shard's write gathers: its head, then, unless the head
    /// already holds the bytes, the caller's segments and the zero padding.
    fn write_iov(
        &self,
        head: &mut BounceBuf,
        head_len: usize,
        shard: &ShardIo,
        bounce_needed: bool,
    ) -> Vec<MemSeg> {
        let size = self.layout.shard_size;
        let padded = self.padded();
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
        iov
    }

    /// Records a finished shard write and completes it, or, when it was
    /// the block's last, has the committer thread publish and complete it.
    fn written(
        self: &Arc<Self>,
        writer: Arc<BlockWriter>,
        index: usize,
        result: Result<()>,
        task: Arc<Task>,
    ) {
        if result.is_ok() {
            self.counters.shards_dumped.fetch_add(1, Ordering::Relaxed);
        }
        let done = writer.finish(index, &result);
        let complete = done.complete;
        let s = self.clone();
        let finish = move || {
            s.after_write(&writer, done, result, &task);
            s.end_io();
        };
        if complete {
            // The rename goes to the committer thread: an I/O
            // thread (io_uring has one) that renamed would leave
            // the queue without new writes meanwhile.
            self.defer(Box::new(finish));
        } else {
            finish();
        }
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
            self.discard_temp(&writer.tmp);
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
        let tmp = &writer.tmp;
        let file_len = self.layout.file_len();
        let synced = match self.cfg.durability {
            Durability::None => Ok(()),
            Durability::Data | Durability::Full => writer
                .file
                .file
                .sync_data()
                .map_err(|e| UcmError::os("fdatasync", &tmp.path, e)),
        };
        let bucket = synced.and_then(|()| self.tree.bucket(&writer.block));
        let bucket = match bucket {
            Ok(b) => b,
            Err(e) => {
                self.discard_temp(tmp);
                return Err(e);
            }
        };
        let name = Tree::block_name(&writer.block);
        let Some(work) = &self.work else {
            return Err(UcmError::Closed);
        };
        let part = Part::Bucket(writer.block.0[0]);
        let changing = self.usage.changing(tmp.root, &[part]);
        let publish = || {
            let dir = work.dir(tmp.root);
            match dir.rename_noreplace(&tmp.name, &bucket, &name) {
                // A file system without the flag (NFS): a plain rename, which
                // may replace a copy another store published meanwhile.
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    dir.rename(&tmp.name, &bucket, &name)
                }
                r => r,
            }
        };
        let mut renamed = publish();
        if renamed
            .as_ref()
            .is_err_and(|e| e.kind() == std::io::ErrorKind::AlreadyExists)
            && self.remove_foreign(&bucket, &name, tmp.root, part)
        {
            renamed = publish();
        }
        match renamed {
            Ok(()) => self.usage.add_to(tmp.root, part, file_len as i64),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                // Published meanwhile by another store: the same bytes (the
                // id is their hash). Ours goes; theirs counts as dumped now.
                self.discard_temp(tmp);
                return if self.dumped_again(&writer.block) {
                    Ok(())
                } else {
                    Err(UcmError::os("rename", &tmp.path, e))
                };
            }
            Err(e) => {
                self.discard_temp(tmp);
                return Err(UcmError::os("rename", &tmp.path, e));
            }
        }
        drop(changing);
        if self.cfg.durability == Durability::Full {
            // The block is in the index only once its name is durable;
            // a failed sync leaves it unpublished (the rename may or may
            // not survive a crash, and its checksum covers either case).
            if let Err(e) = bucket.sync() {
                let _changing = self.usage.changing(tmp.root, &[part]);
                if bucket.remove_file(&name).is_ok() {
                    self.usage.add_to(tmp.root, part, -(file_len as i64));
                }
                return Err(UcmError::os("fsync", bucket.path(), e));
            }
        }
        // The file's mtime as this store wrote it: a store sharing the
        // directory that dumps the block again changes it (see evict).
        let mtime = writer
            .file
            .file
            .metadata()
            .and_then(|m| m.modified())
            .map_or(0, scan::nanos);
        self.index.insert(writer.block, Some(mtime));
        self.counters
            .blocks_committed
            .fetch_add(1, Ordering::Relaxed);
        // The wake when this writer took its spare came before this block
        // counted as used: at the capacity, the pool is refilled only now.
        if self.cfg.capacity_bytes > 0
            && (self.blocks_bytes() > self.cfg.capacity_bytes || self.spare_reserve_bytes() > 0)
        {
            evict::wake(self);
        }
        Ok(())
    }
}

/// A shard write's outcome: all `expected` bytes written, or why not.
fn write_outcome(res: std::io::Result<usize>, expected: usize, writer: &BlockWriter) -> Result<()> {
    match res {
        Ok(n) if n == expected => Ok(()),
        Ok(n) => Err(UcmError::Os {
            op: "pwrite",
            path: writer.tmp.path.display().to_string(),
            source: Arc::new(std::io::Error::other(format!(
                "short write: {n} of {expected} bytes"
            ))),
        }),
        Err(e) => Err(UcmError::os("pwrite", &writer.tmp.path, e)),
    }
}
