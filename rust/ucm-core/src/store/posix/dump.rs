//! Dumps: each new block is assembled in a temporary file of the store's
//! work directory (a spare when one is ready) by [`BlockWriter`], whatever
//! order or task its shards arrive in, and published by a rename on a
//! committer thread once every shard is written, after the syncs that the
//! `durability` setting asks for.

use std::collections::{HashMap, HashSet};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::config::Durability;
use super::files::{make_private_dir, remove_entry, OpenFile};
use super::writer::{self, BlockWriter, Claim};
use super::{evict, scan, Shared};
use crate::block::{BlockId, MemSeg, ShardIo};
use crate::error::{Result, UcmError};
use crate::io::{BounceBuf, IoEngine, IoOp};
use crate::store::format::layout::{checksum_segs, HEADER_LEN};
use crate::task::Task;

/// The code of [`UcmError::NotFound`].
const NOT_FOUND: i32 = -50005;
/// True when `e` is the OS error `code`.
fn is_os_error(e: &UcmError, code: i32) -> bool {
    matches!(e, UcmError::Os { source, .. } if source.raw_os_error() == Some(code))
}

/// Spares that fail their check in a row before a dump creates a file.
const MAX_BAD_SPARES: usize = 4;
/// Temporary names found taken in a row before a create gives up.
const MAX_TAKEN_NAMES: usize = 16;

/// A temporary file opened for a new block.
struct TempFile {
    path: PathBuf,
    file: OpenFile,
    /// It came from the spare pool (and goes back there if unused).
    spare: bool,
}

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
    fn files(&self) -> usize {
        self.by_block.len() + self.opening.len()
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
                if self.index.contains(block) && self.dumped_again(block) {
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
        let root = self.paths.root_index(block);
        let temp = self.temp_file(block, root)?;
        let mut writers = self.writers.lock();
        let existing = writers
            .by_block
            .get(block)
            .filter(|w| w.failure().is_none())
            .cloned();
        if existing.is_some() || (self.index.contains(block) && self.dumped_again(block)) {
            let TempFile { path, file, spare } = temp;
            drop(file);
            // Still opening, so the file stays counted until it is back.
            if spare {
                self.spares.put_back(root, path);
            } else {
                let _ = std::fs::remove_file(path);
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
            temp.path,
            temp.file,
            self.layout.shard_count,
        ));
        writers.by_block.insert(*block, w.clone());
        opening.close(&mut writers);
        Ok(Some(w))
    }

    /// A dump of a block already published: its bytes are there already
    /// (content addressing), but its file's mtime is set to now, which is
    /// what tells every store sharing the directory that it was just
    /// dumped (see `evict`), and its recency here is refreshed. False when
    /// the file is gone (another store evicted it): the dump must write it.
    fn dumped_again(&self, block: &BlockId) -> bool {
        let path = self.paths.block(block);
        let Ok(c) = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()) else {
            return false;
        };
        // SAFETY: `c` is a valid NUL-terminated path; a null `times` means
        // "now" for both timestamps.
        let rc = unsafe {
            libc::utimensat(
                libc::AT_FDCWD,
                c.as_ptr(),
                std::ptr::null(),
                libc::AT_SYMLINK_NOFOLLOW,
            )
        };
        if rc != 0 {
            self.index.remove(block);
            return false;
        }
        let now = scan::nanos(std::time::SystemTime::now());
        self.index.insert(*block, self.layout.file_len(), None, now);
        true
    }

    /// An open file to assemble `block` in: a checked spare when the pool
    /// has one (a spare that fails the check is removed), else a new file.
    fn temp_file(&self, block: &BlockId, root: usize) -> Result<TempFile> {
        for _ in 0..MAX_BAD_SPARES {
            let Some(path) = self.spare_for_new_block(root) else {
                break;
            };
            if let Some(file) = self.opener.reuse(&path, self.layout.file_len()) {
                return Ok(TempFile {
                    path,
                    file,
                    spare: true,
                });
            }
            remove_entry(&path);
        }
        let mut attempt = 0;
        loop {
            let seq = self.tmp_seq.fetch_add(1, Ordering::Relaxed);
            let path = self.paths.temp(block, seq);
            match self.opener.create(&path) {
                Ok(file) => {
                    return Ok(TempFile {
                        path,
                        file,
                        spare: false,
                    })
                }
                // Something was planted at this name: never reuse it.
                Err(e) if is_os_error(&e, libc::EEXIST) && attempt < MAX_TAKEN_NAMES => {}
                Err(e) if e.code() == NOT_FOUND && attempt == 0 => {
                    // The work directory was removed under us: make it again.
                    if let Some(dir) = path.parent() {
                        if let Some(parent) = dir.parent() {
                            make_private_dir(parent)?;
                        }
                        make_private_dir(dir)?;
                    }
                }
                Err(e) => return Err(e),
            }
            attempt += 1;
        }
    }

    /// A spare file for a new block under root `root` (registered in
    /// [`Writers::opening`]). When the pool is empty and the new
    /// block would take the store past its capacity, evicts a batch
    /// of cold blocks into the pool now (one rename each) instead of
    /// creating a file, which on ext4 costs more than writing a 1 MiB
    /// shard, only for the evictor to delete another one right after. A
    /// burst of dumps into a store at capacity thus never creates or
    /// deletes files, whatever the pool's size. None: create a file.
    pub(super) fn spare_for_new_block(&self, root: usize) -> Option<PathBuf> {
        if let Some(f) = self.spares.take(root) {
            return Some(f);
        }
        let cap = self.cfg.capacity_bytes;
        if cap == 0 || !self.spares.enabled() {
            return None;
        }
        let len = self.layout.file_len().max(1);
        let after = self.bytes_with_unpublished_files();
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
        // No more than the pool may hold: beyond it, evicted files are deleted.
        let room = self.recycled_spares().max(1);
        let want = (after.saturating_sub(band) / len).clamp(1, room);
        evict::recycle_coldest(self, root, want as usize);
        self.spares.take(root)
    }

    /// Bytes of the store's files: blocks, spares, and one block file per
    /// block assembled or opening (the caller's new block included, as it
    /// is opening). Read under the writers lock, in the order files move
    /// through them: a file leaves the index for the pool only once the pool
    /// counts it (see `evict`), leaves the pool for a block already opening,
    /// and leaves the writers only once the index counts it (`commit`), so
    /// a file in motion is counted twice at worst, never missed, and no
    /// create is taken for room that is not there.
    fn bytes_with_unpublished_files(&self) -> u64 {
        let writers = self.writers.lock();
        let used = self.index.used_bytes();
        let spares = self.spares.bytes();
        used + spares + writers.files() as u64 * self.layout.file_len()
    }

    /// True when `block` had all its shards written and its commit, in
    /// progress on another thread, has now finished.
    pub(super) fn commit_settled(&self, block: &BlockId) -> bool {
        let writer = self.writers.lock().by_block.get(block).cloned();
        writer.is_some_and(|w| w.all_written() && w.wait_settled(COMMIT_WAIT))
    }

    /// Drops every block still being assembled (at close: their missing
    /// shards can no longer arrive) and removes their temporary files.
    pub(super) fn abandon_writers(&self) {
        let pending = self.writers.lock().drain();
        for w in pending {
            w.abandon();
            let _ = std::fs::remove_file(&w.tmp);
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
            crate::hashing::xxh3::xxh3_64(&head[HEADER_LEN..HEADER_LEN + size])
        } else {
            // SAFETY: valid per the caller's contract.
            unsafe { checksum_segs(&shard.segs) }
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
        let synced = match self.cfg.durability {
            Durability::None => Ok(()),
            Durability::Data | Durability::Full => writer
                .file
                .file
                .sync_data()
                .map_err(|e| UcmError::os("fdatasync", &writer.tmp, e)),
        };
        if let Err(e) = synced {
            let _ = std::fs::remove_file(&writer.tmp);
            return Err(e);
        }
        if let Err(e) = std::fs::rename(&writer.tmp, &dst) {
            let _ = std::fs::remove_file(&writer.tmp);
            return Err(UcmError::os("rename", &writer.tmp, e));
        }
        if self.cfg.durability == Durability::Full {
            if let Some(dir) = dst.parent() {
                // The block is in the index only once its name is durable;
                // a failed sync leaves it unpublished (the rename may or may
                // not survive a crash, and its checksum covers either case).
                sync_dir(dir).inspect_err(|_| {
                    let _ = std::fs::remove_file(&dst);
                })?;
            }
        }
        // The file's mtime as this store knows it: a later one means another
        // store sharing the directory dumped the block since (see evict).
        let mtime = writer
            .file
            .file
            .metadata()
            .and_then(|m| m.modified())
            .map_or(0, scan::nanos);
        self.index
            .insert(writer.block, self.layout.file_len(), None, mtime);
        self.counters
            .blocks_committed
            .fetch_add(1, Ordering::Relaxed);
        // The wake when this writer took its spare came before this block
        // counted as used: at the capacity, the pool is refilled only now.
        if self.cfg.capacity_bytes > 0
            && (self.index.used_bytes() > self.cfg.capacity_bytes || self.spare_reserve_bytes() > 0)
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
            path: writer.tmp.display().to_string(),
            source: Arc::new(std::io::Error::other(format!(
                "short write: {n} of {expected} bytes"
            ))),
        }),
        Err(e) => Err(UcmError::os("pwrite", &writer.tmp, e)),
    }
}

/// Makes the entries of `dir` durable (`fsync` of the directory).
fn sync_dir(dir: &Path) -> Result<()> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| UcmError::os("fsync", dir, e))
}
