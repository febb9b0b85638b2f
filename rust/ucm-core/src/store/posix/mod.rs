//! The Posix store: one file per block on local (or mounted) file systems.
//!
//! * Layout and file format: [`files`] and [`layout`].
//! * Visibility: a block is written under a temporary name and renamed when
//!   all its shards are in ([`writer`]); readers only ever open final names,
//!   so they never see a partial block, and a killed writer leaves only a
//!   temporary that the next start removes ([`scan`]).
//! * Durability: the commit does not fsync. A crash can at worst leave a
//!   published file whose pages never reached the disk; every load verifies
//!   the shard's header and checksum, so such a file is a load error (and is
//!   removed), never wrong bytes. This keeps dumps at disk speed.
//! * Lookups: an in-memory [`index`]; an index miss falls back to one `stat`
//!   so blocks written by other processes sharing the directory (vLLM's
//!   workers, another engine) are found too.
//! * Capacity: above `capacity_bytes` a background thread evicts the least
//!   recently used unpinned blocks down to 90 % of it ([`evict`]).

mod config;
mod evict;
pub mod files;
pub mod index;
pub mod layout;
pub mod scan;
mod spare;
mod writer;

pub use config::{validate_geometry, PosixConfig, MAX_SHARDS};

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::{Condvar, Mutex};

use self::files::{DirectAlign, Opener, Paths};
use self::index::Index;
use self::layout::{checksum_segs, round_up, Layout, ShardHeader, HEADER_LEN, REGION_ALIGN};
use self::spare::SparePool;
use self::writer::{BlockWriter, Claim};
use super::Store;
use crate::block::{BlockId, MemSeg, ShardIo};
use crate::error::{Result, UcmError};
use crate::io::{build_engine, AlignedBuf, IoEngine, IoEngineConfig, IoOp, IoRequest};
use crate::task::{Task, TaskId, TaskRegistry, WorkerPool};

/// Counters of one store's activity since it was opened.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PosixStats {
    /// Committed blocks in the index.
    pub blocks: u64,
    /// Bytes those blocks hold on disk.
    pub used_bytes: u64,
    /// Shards loaded successfully.
    pub shards_loaded: u64,
    /// Shards written successfully.
    pub shards_dumped: u64,
    /// Blocks published.
    pub blocks_committed: u64,
    /// Blocks evicted for capacity.
    pub evictions: u64,
    /// Loads that failed verification.
    pub corrupt_loads: u64,
    /// Evicted block files kept as spare files for later dumps.
    pub files_recycled: u64,
}

#[derive(Default)]
struct Counters {
    shards_loaded: AtomicU64,
    shards_dumped: AtomicU64,
    blocks_committed: AtomicU64,
    evictions: AtomicU64,
    corrupt_loads: AtomicU64,
    files_recycled: AtomicU64,
}

/// State shared by the caller threads, the workers and I/O completions.
/// Holds no thread handles, so it may be dropped on any thread.
struct Shared {
    cfg: PosixConfig,
    layout: Layout,
    paths: Paths,
    opener: Opener,
    align: DirectAlign,
    index: Arc<Index>,
    writers: Mutex<std::collections::HashMap<BlockId, Arc<BlockWriter>>>,
    tasks: TaskRegistry,
    tmp_seq: AtomicU64,
    zero_pad: AlignedBuf,
    counters: Counters,
    inflight: Mutex<usize>,
    inflight_cv: Condvar,
    max_inflight: usize,
    evict_signal: (Mutex<evict::Signal>, Condvar),
    spares: SparePool,
    /// Held while a dump refills the spare pool by evicting.
    refill_lock: Mutex<()>,
    /// Commits for the committer thread; `None` stops it.
    commits: crossbeam_channel::Sender<Option<CommitJob>>,
}

type CommitJob = Box<dyn FnOnce() + Send + 'static>;

struct Runtime {
    engine: Arc<dyn IoEngine>,
    workers: WorkerPool,
    evictor: Option<JoinHandle<()>>,
    spare_filler: Option<JoinHandle<()>>,
    committer: Option<JoinHandle<()>>,
}

/// One file per block under one or more directories.
pub struct PosixStore {
    shared: Arc<Shared>,
    runtime: Mutex<Option<Runtime>>,
    closed: AtomicBool,
}

impl PosixStore {
    /// Validates `cfg`, prepares the directories, rebuilds the index from
    /// what is on disk and starts the threads.
    pub fn open(cfg: PosixConfig) -> Result<Self> {
        cfg.validate()?;
        let layout = Layout::new(cfg.block_size, cfg.shard_size, &cfg.tensor_size_list);
        let paths = Paths::new(cfg.storage_backends.clone());
        let owner = paths.owner();
        if cfg.transfers_enabled() {
            paths.create_dirs()?;
        }
        let align = cfg
            .storage_backends
            .iter()
            .map(|d| files::direct_align(d))
            .fold(DirectAlign { mem: 1, len: 1 }, |a, b| DirectAlign {
                mem: a.mem.max(b.mem),
                len: a.len.max(b.len),
            });
        let index = Arc::new(Index::default());
        let file_len = layout.file_len();
        let report = scan::scan(&paths, &index, file_len, cfg.transfers_enabled());
        log::info!(
            "posix store over {:?}: {} block(s), {} byte(s) found, {} stale temporary file(s) removed",
            cfg.storage_backends,
            report.blocks,
            report.bytes,
            report.removed_temps
        );
        // `auto` means io_uring for O_DIRECT files only. Buffered I/O gains
        // nothing from io_uring: a read that hits the page cache is copied
        // inline by the submitting thread, and its completion (the checksum
        // pass) runs on the ring's one thread, while psync copies and
        // verifies on all of its threads. Measured on a 2-core VM, 512 MiB of
        // 256 KiB shards from the page cache: psync 8.6 GB/s, io_uring 5.4
        // GB/s; from disk without O_DIRECT both reach the same speed.
        let kind = match (cfg.io_engine, cfg.io_direct) {
            (crate::io::IoEngineKind::Auto, false) => crate::io::IoEngineKind::Psync,
            (kind, _) => kind,
        };
        let engine = build_engine(&IoEngineConfig {
            kind,
            threads: if kind == crate::io::IoEngineKind::Psync {
                cfg.io_threads
            } else {
                cfg.io_threads.div_ceil(4).max(1)
            },
            queue_depth: (cfg.io_threads * 16).clamp(32, 1024) as u32,
            ..IoEngineConfig::default()
        })?;
        let (commits, commit_rx) = crossbeam_channel::unbounded::<Option<CommitJob>>();
        let shared = Arc::new(Shared {
            opener: Opener::new(cfg.io_direct),
            layout,
            paths,
            align,
            index,
            writers: Mutex::new(Default::default()),
            tasks: TaskRegistry::new(cfg.timeout_ms),
            tmp_seq: AtomicU64::new(0),
            zero_pad: AlignedBuf::new(REGION_ALIGN),
            counters: Counters::default(),
            inflight: Mutex::new(0),
            inflight_cv: Condvar::new(),
            max_inflight: (cfg.io_threads * 32).clamp(64, 1024),
            evict_signal: (Mutex::new(evict::Signal::default()), Condvar::new()),
            spares: SparePool::new(
                &cfg.storage_backends,
                if cfg.transfers_enabled() {
                    cfg.spare_files
                } else {
                    0
                },
                owner,
                file_len,
            ),
            refill_lock: Mutex::new(()),
            commits,
            cfg,
        });
        let committer = std::thread::Builder::new()
            .name("ucm-posix-commit".into())
            .spawn(move || {
                while let Ok(Some(job)) = commit_rx.recv() {
                    job();
                }
            })
            .map_err(|e| UcmError::os("spawn thread", "ucm-posix-commit", e))?;
        let workers = WorkerPool::new("ucm-posix", shared.cfg.io_threads)?;
        let evictor = evict::spawn(shared.clone())?;
        let spare_filler = if shared.spares.enabled() {
            let s = shared.clone();
            Some(
                std::thread::Builder::new()
                    .name("ucm-posix-spare".into())
                    .spawn(move || s.spares.run(|| !s.near_capacity()))
                    .map_err(|e| UcmError::os("spawn thread", "ucm-posix-spare", e))?,
            )
        } else {
            None
        };
        Ok(PosixStore {
            shared,
            runtime: Mutex::new(Some(Runtime {
                engine,
                workers,
                evictor: Some(evictor),
                spare_filler,
                committer: Some(committer),
            })),
            closed: AtomicBool::new(false),
        })
    }

    /// Activity counters.
    pub fn stats(&self) -> PosixStats {
        let c = &self.shared.counters;
        PosixStats {
            blocks: self.shared.index.len() as u64,
            used_bytes: self.shared.index.used_bytes(),
            shards_loaded: c.shards_loaded.load(Ordering::Relaxed),
            shards_dumped: c.shards_dumped.load(Ordering::Relaxed),
            blocks_committed: c.blocks_committed.load(Ordering::Relaxed),
            evictions: c.evictions.load(Ordering::Relaxed),
            corrupt_loads: c.corrupt_loads.load(Ordering::Relaxed),
            files_recycled: c.files_recycled.load(Ordering::Relaxed),
        }
    }

    /// The file geometry in use.
    pub fn layout(&self) -> &Layout {
        &self.shared.layout
    }

    /// Path of a block's published file (for tools and tests).
    pub fn block_path(&self, id: &BlockId) -> std::path::PathBuf {
        self.shared.paths.block(id)
    }

    /// The name of the I/O engine in use.
    pub fn engine_name(&self) -> &'static str {
        self.runtime
            .lock()
            .as_ref()
            .map_or("closed", |r| r.engine.name())
    }

    fn check_shards(&self, shards: &[ShardIo]) -> Result<()> {
        if self.closed.load(Ordering::Acquire) {
            return Err(UcmError::Closed);
        }
        if !self.shared.cfg.transfers_enabled() {
            return Err(UcmError::Unsupported(
                "load/dump are disabled in the lookup-only role (device_id = -1)".into(),
            ));
        }
        let l = &self.shared.layout;
        for (i, s) in shards.iter().enumerate() {
            if s.index >= l.shard_count {
                return Err(UcmError::invalid(format!(
                    "shard_index[{i}] = {} is out of range: blocks have {} shard(s)",
                    s.index, l.shard_count
                )));
            }
            if s.len() != l.shard_size {
                return Err(UcmError::invalid(format!(
                    "shard {i} (block {}): tensors sum to {} bytes, expected shard_size {}",
                    s.block,
                    s.len(),
                    l.shard_size
                )));
            }
            if s.segs.iter().any(|g| g.addr == 0) {
                return Err(UcmError::invalid(format!("shard {i}: null memory address")));
            }
        }
        Ok(())
    }

    fn submit(&self, kind: &'static str, shards: Vec<ShardIo>) -> Result<TaskId> {
        self.check_shards(&shards)?;
        let rt = self.runtime.lock();
        let rt = rt.as_ref().ok_or(UcmError::Closed)?;
        let task = self.shared.tasks.create(kind, shards.len());
        let load = kind == "load";
        let runs = if load {
            load_runs(shards)
        } else {
            shards.into_iter().map(|s| vec![s]).collect()
        };
        for run in runs {
            let shared = self.shared.clone();
            let engine = rt.engine.clone();
            let job_task = task.clone();
            let units = run.len();
            let queued = rt.workers.spawn(move || {
                if job_task.should_skip() {
                    for _ in 0..run.len() {
                        job_task.skip_unit();
                    }
                } else if load {
                    shared.start_load_run(&engine, &job_task, run);
                } else {
                    for shard in run {
                        if let Err(e) = shared.start_dump(&engine, &job_task, shard) {
                            job_task.complete_unit(Err(e));
                        }
                    }
                }
            });
            if !queued {
                for _ in 0..units {
                    task.complete_unit(Err(UcmError::Closed));
                }
            }
        }
        Ok(task.id())
    }

    fn present(&self, id: &BlockId) -> bool {
        self.shared.present(id)
    }
}

impl Shared {
    fn present(&self, id: &BlockId) -> bool {
        if self.index.touch(id) {
            return true;
        }
        // Written by another process sharing the directory?
        if scan::probe(&self.paths.block(id), self.layout.file_len()) {
            self.index.insert(*id, self.layout.file_len(), None);
            return true;
        }
        // Fully written, being committed by another thread right now?
        self.commit_settled(id) && self.index.touch(id)
    }

    /// Counts a request in flight, first waiting while the store already
    /// has [`Shared::max_inflight`] of them: engines queue without bound, so
    /// this is what keeps bounce buffers and queued requests bounded when a
    /// task has thousands of shards. Only worker threads call it; engine
    /// threads (which must never block) only call [`Shared::end_io`].
    fn begin_io(&self) {
        let mut n = self.inflight.lock();
        while *n >= self.max_inflight {
            self.inflight_cv.wait(&mut n);
        }
        *n += 1;
    }

    /// Runs `job` on the committer thread, or here once it has stopped.
    fn defer(&self, job: CommitJob) {
        if let Err(crossbeam_channel::SendError(Some(job))) = self.commits.send(Some(job)) {
            job();
        }
    }

    fn end_io(&self) {
        let mut n = self.inflight.lock();
        *n -= 1;
        self.inflight_cv.notify_all();
    }

    /// Bytes of the data part of a region as written (padded to 4 KiB).
    fn padded(&self) -> usize {
        round_up(self.layout.shard_size, REGION_ALIGN)
    }

    fn header_for(&self, shard: &ShardIo, checksum: u64) -> ShardHeader {
        ShardHeader {
            block: shard.block,
            index: shard.index as u32,
            count: self.layout.shard_count as u32,
            shard_size: self.layout.shard_size as u64,
            fingerprint: self.layout.fingerprint,
            checksum,
        }
    }

    /// Pins `block` (so eviction leaves it alone) and opens its file.
    fn open_for_load(&self, block: &BlockId) -> Result<(index::Pin, files::OpenFile)> {
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
        match self.opener.read(&self.paths.block(block)) {
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
    fn start_load_run(
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
        let region = HEADER_LEN + size;
        let pad = self.padded() - size;
        let n = run.len();
        let mut heads = engine.bounce(HEADER_LEN * n);
        // The padding between regions is read into (and overwritten in) one
        // scratch buffer: it carries nothing.
        let mut sink = (pad > 0).then(|| engine.bounce(pad));
        let mut iov = Vec::with_capacity(n * (run[0].segs.len() + 2));
        for (j, shard) in run.iter().enumerate() {
            if j > 0 {
                if let Some(sink) = sink.as_mut() {
                    iov.push(MemSeg {
                        addr: sink.as_mut_ptr() as usize,
                        len: pad,
                    });
                }
            }
            iov.push(MemSeg {
                addr: heads.as_mut_ptr() as usize + j * HEADER_LEN,
                len: HEADER_LEN,
            });
            iov.extend_from_slice(&shard.segs);
        }
        let req = IoRequest {
            op: IoOp::Read,
            fd: std::os::fd::AsRawFd::as_raw_fd(&open.file),
            offset: self.layout.offset(run[0].index),
            iov,
            fixed: None,
        };
        let stride = region + pad;
        let shared = self.clone();
        let task = task.clone();
        self.begin_io();
        engine.submit(
            req,
            Box::new(move |res| {
                let outcomes: Vec<Result<()>> = run
                    .iter()
                    .enumerate()
                    .map(|(j, shard)| {
                        // What the read delivered of this shard's region.
                        let got = match &res {
                            Ok(n) => Ok(n.saturating_sub(j * stride).min(region)),
                            Err(e) => Err(copy_io_error(e)),
                        };
                        let head = &heads[j * HEADER_LEN..(j + 1) * HEADER_LEN];
                        shared.finish_load(shard, got, region, head, false, &task)
                    })
                    .collect();
                drop((open, pin, heads, sink));
                for outcome in outcomes {
                    shared.complete_load(&task, outcome);
                }
                shared.end_io();
            }),
        );
    }

    fn start_load(
        self: &Arc<Self>,
        engine: &Arc<dyn IoEngine>,
        task: &Arc<Task>,
        shard: ShardIo,
    ) -> Result<()> {
        let (pin, open) = self.open_for_load(&shard.block)?;
        let bounce_needed = open.direct && !self.align.fits(&shard.segs);
        let mut head = engine.bounce(if bounce_needed {
            HEADER_LEN + self.padded()
        } else {
            HEADER_LEN
        });
        let mut iov = vec![MemSeg {
            addr: head.as_mut_ptr() as usize,
            len: if bounce_needed {
                HEADER_LEN + self.padded()
            } else {
                HEADER_LEN
            },
        }];
        if !bounce_needed {
            iov.extend_from_slice(&shard.segs);
        }
        let fixed = if bounce_needed {
            head.fixed_index()
        } else {
            None
        };
        let expected: usize = iov.iter().map(|s| s.len).sum();
        let req = IoRequest {
            op: IoOp::Read,
            fd: std::os::fd::AsRawFd::as_raw_fd(&open.file),
            offset: self.layout.offset(shard.index),
            iov,
            fixed,
        };
        let shared = self.clone();
        let task = task.clone();
        self.begin_io();
        engine.submit(
            req,
            Box::new(move |res| {
                let outcome =
                    shared.finish_load(&shard, res, expected, &head[..], bounce_needed, &task);
                drop((open, pin, head));
                shared.complete_load(&task, outcome);
                shared.end_io();
            }),
        );
        Ok(())
    }

    /// Counts and completes one loaded shard; callers release the file, pin
    /// and buffers first, so a finished task leaves the block evictable.
    fn complete_load(&self, task: &Task, outcome: Result<()>) {
        if outcome.is_ok() {
            self.counters.shards_loaded.fetch_add(1, Ordering::Relaxed);
        }
        task.complete_unit(outcome);
    }

    fn finish_load(
        &self,
        shard: &ShardIo,
        res: std::io::Result<usize>,
        expected: usize,
        head: &[u8],
        bounced: bool,
        task: &Task,
    ) -> Result<()> {
        let size = self.layout.shard_size;
        let path = || self.paths.block(&shard.block);
        let verdict = match res {
            Err(e) => Err(UcmError::os("read", path(), e)),
            Ok(n) if n < expected => Err(UcmError::Corrupt(format!(
                "block {} shard {}: file is truncated ({n} of {expected} bytes)",
                shard.block, shard.index
            ))),
            Ok(_) => ShardHeader::decode_expect(head, &shard.block, shard.index, &self.layout)
                .and_then(|hdr| {
                    let sum = if bounced {
                        xxhash_rust::xxh3::xxh3_64(&head[HEADER_LEN..HEADER_LEN + size])
                    } else {
                        // SAFETY: the caller guarantees the segments are valid
                        // until its task completes, which happens after this.
                        unsafe { checksum_segs(&shard.segs) }
                    };
                    if sum != hdr.checksum {
                        return Err(UcmError::Corrupt(format!(
                            "block {} shard {}: data checksum mismatch",
                            shard.block, shard.index
                        )));
                    }
                    Ok(())
                }),
        };
        match verdict {
            Ok(()) => {
                if bounced {
                    let mut off = HEADER_LEN;
                    for s in &shard.segs {
                        // SAFETY: destination valid per the caller's contract;
                        // source is inside the bounce buffer we own.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                head[off..].as_ptr(),
                                s.addr as *mut u8,
                                s.len,
                            )
                        };
                        off += s.len;
                    }
                }
                Ok(())
            }
            Err(e) => {
                if !bounced {
                    // Don't leave foreign or corrupt bytes in caller memory.
                    for s in &shard.segs {
                        // SAFETY: as above.
                        unsafe { std::ptr::write_bytes(s.addr as *mut u8, 0, s.len) };
                    }
                }
                if matches!(e, UcmError::Corrupt(_)) && !bounced && self.file_verifies(shard) {
                    // The bytes were verified in the caller's memory, which
                    // the caller changed while they were arriving (a race in
                    // the caller, e.g. writing a block it is loading): the
                    // stored block is intact and stays.
                    let e = UcmError::Corrupt(format!(
                        "block {} shard {}: the destination memory changed while the shard \
                         was being loaded (the stored block is intact)",
                        shard.block, shard.index
                    ));
                    task.record_error(e.clone());
                    log::warn!("{e}");
                    return Err(e);
                }
                if matches!(e, UcmError::Corrupt(_)) {
                    // Fail the task first: once the file is gone, the task's
                    // other shards would report "not found" instead.
                    task.record_error(e.clone());
                    self.counters.corrupt_loads.fetch_add(1, Ordering::Relaxed);
                    // A corrupt file would fail every later load: drop it so
                    // the next dump of this block rewrites it.
                    self.index.remove(&shard.block);
                    let _ = std::fs::remove_file(path());
                    log::warn!("{e}; the block file was removed");
                }
                Err(e)
            }
        }
    }

    /// Reads one shard of a block file again into private memory and checks
    /// its header and checksum: true when the stored shard is intact.
    fn file_verifies(&self, shard: &ShardIo) -> bool {
        use std::os::unix::fs::FileExt;
        let size = self.layout.shard_size;
        let Ok(file) = std::fs::File::open(self.paths.block(&shard.block)) else {
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
            .is_ok_and(|hdr| xxhash_rust::xxh3::xxh3_64(&buf[HEADER_LEN..]) == hdr.checksum)
    }

    /// Spare files a store with a capacity keeps by recycling evicted block
    /// files: the pool's target, at most a tenth of the capacity (0: no
    /// capacity, or no pool).
    fn recycled_spares(&self) -> u64 {
        let cap = self.cfg.capacity_bytes;
        let len = self.layout.file_len().max(1);
        (self.spares.target() as u64).min(cap / 10 / len)
    }

    /// True when the filler must not create spare files: the store has
    /// reached its capacity once (it evicted), or creating would take it
    /// there. From then on the pool is refilled by eviction only (see
    /// [`evict`] and [`Shared::spare_for_new_block`]), so a store at
    /// capacity keeps a fixed set of files: a create after the evictor's
    /// batch freed room would only make a later eviction delete a file.
    fn near_capacity(&self) -> bool {
        let reserve = self.recycled_spares() * self.layout.file_len();
        reserve > 0
            && (self.counters.evictions.load(Ordering::Relaxed) > 0
                || self.index.used_bytes() + reserve > self.cfg.capacity_bytes)
    }

    /// Bytes of capacity the evictor keeps free while the spare pool misses
    /// files: [`Shared::recycled_spares`] files, the same margin at which
    /// the filler stops creating ([`Shared::near_capacity`]), so one of the
    /// two always refills the pool. A store at capacity then dumps into
    /// recycled files: it neither creates nor deletes files.
    fn spare_reserve_bytes(&self) -> u64 {
        if self.spares.deficit() == 0 {
            return 0;
        }
        self.recycled_spares() * self.layout.file_len()
    }

    /// The writer assembling `block`, or None when the block is already
    /// published. Checked under the writers lock: a commit inserts into the
    /// index before it forgets its writer, so a shard arriving around a
    /// commit either joins that writer or sees the published block, and
    /// never starts a second writer that would wait forever for shards
    /// already written.
    fn writer_for(&self, block: &BlockId) -> Option<Arc<BlockWriter>> {
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
    fn spare_for_new_block(&self, root: usize, assembling: usize) -> Option<PathBuf> {
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
    fn commit_settled(&self, block: &BlockId) -> bool {
        let writer = self.writers.lock().get(block).cloned();
        writer.is_some_and(|w| w.all_written() && w.wait_settled(COMMIT_WAIT))
    }

    /// Drops every block still being assembled (at close: their missing
    /// shards can no longer arrive) and removes their temporary files.
    fn abandon_writers(&self) {
        let pending: Vec<_> = self.writers.lock().drain().map(|(_, w)| w).collect();
        for w in pending {
            w.abandon();
            let _ = std::fs::remove_file(&w.tmp);
        }
    }

    fn forget_writer(&self, w: &Arc<BlockWriter>) {
        let mut writers = self.writers.lock();
        if writers.get(&w.block).is_some_and(|cur| Arc::ptr_eq(cur, w)) {
            writers.remove(&w.block);
        }
    }

    fn start_dump(
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

    fn submit_write(
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
    fn after_write(
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

    fn commit(&self, writer: &BlockWriter) -> Result<()> {
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

/// Longest a load waits for a commit in progress (a rename and an index
/// insert; the bound only matters if the committing thread is starved).
const COMMIT_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Most shards one coalesced read covers: a run needs up to three iovecs
/// per shard plus the tensors, well under IOV_MAX (1024).
const MAX_RUN_SHARDS: usize = 64;
/// Most iovecs in one coalesced read.
const MAX_RUN_IOVECS: usize = 1000;

/// Splits a load into runs of consecutive shards of one block with
/// consecutive indices (whole-block and multi-layer loads, which the
/// connector submits block-major), each read with one request.
fn load_runs(shards: Vec<ShardIo>) -> Vec<Vec<ShardIo>> {
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

/// `std::io::Error` is not `Clone`; keeps the OS code where there is one.
fn copy_io_error(e: &std::io::Error) -> std::io::Error {
    match e.raw_os_error() {
        Some(code) => std::io::Error::from_raw_os_error(code),
        None => std::io::Error::new(e.kind(), e.to_string()),
    }
}

impl Store for PosixStore {
    fn name(&self) -> &'static str {
        "Posix"
    }

    fn lookup(&self, ids: &[BlockId]) -> Result<Vec<bool>> {
        if self.closed.load(Ordering::Acquire) {
            return Err(UcmError::Closed);
        }
        Ok(ids.iter().map(|id| self.present(id)).collect())
    }

    fn lookup_on_prefix(&self, ids: &[BlockId]) -> Result<isize> {
        if self.closed.load(Ordering::Acquire) {
            return Err(UcmError::Closed);
        }
        for (i, id) in ids.iter().enumerate() {
            if !self.present(id) {
                return Ok(i as isize - 1);
            }
        }
        Ok(ids.len() as isize - 1)
    }

    fn prefetch(&self, ids: &[BlockId]) -> Result<()> {
        let rt = self.runtime.lock();
        let rt = rt.as_ref().ok_or(UcmError::Closed)?;
        let paths: Vec<_> = ids
            .iter()
            .filter(|id| self.present(id))
            .map(|id| self.shared.paths.block(id))
            .collect();
        // Ask the kernel to start reading the files into the page cache.
        rt.workers.spawn(move || {
            for p in paths {
                if let Ok(f) = std::fs::File::open(&p) {
                    // SAFETY: fd is open for the duration of the call.
                    unsafe {
                        libc::posix_fadvise(
                            std::os::fd::AsRawFd::as_raw_fd(&f),
                            0,
                            0,
                            libc::POSIX_FADV_WILLNEED,
                        )
                    };
                }
            }
        });
        Ok(())
    }

    fn load(&self, shards: Vec<ShardIo>) -> Result<TaskId> {
        self.submit("load", shards)
    }

    fn dump(&self, shards: Vec<ShardIo>, _prerequisite: u64) -> Result<TaskId> {
        self.submit("dump", shards)
    }

    fn wait(&self, task: TaskId) -> Result<()> {
        self.shared.tasks.wait(task)
    }

    fn check(&self, task: TaskId) -> Result<bool> {
        self.shared.tasks.check(task)
    }

    fn close(&self) -> Result<()> {
        self.closed.store(true, Ordering::Release);
        let Some(mut rt) = self.runtime.lock().take() else {
            return Ok(());
        };
        // Order matters: workers first (no new I/O after they are joined),
        // then in-flight I/O, then the evictor, and the engine last, from
        // this thread, so no engine thread ever joins itself.
        drop(rt.workers);
        {
            let mut n = self.shared.inflight.lock();
            while *n > 0 {
                self.shared.inflight_cv.wait(&mut n);
            }
        }
        // Every commit was queued before its request counted as done.
        let _ = self.shared.commits.send(None);
        if let Some(h) = rt.committer.take() {
            let _ = h.join();
        }
        evict::stop(&self.shared);
        if let Some(h) = rt.evictor.take() {
            let _ = h.join();
        }
        self.shared.spares.stop();
        if let Some(h) = rt.spare_filler.take() {
            let _ = h.join();
        }
        self.shared.spares.discard();
        self.shared.abandon_writers();
        drop(rt.engine);
        Ok(())
    }
}

impl Drop for PosixStore {
    fn drop(&mut self) {
        let _ = self.close();
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
