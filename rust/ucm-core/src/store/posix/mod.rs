//! The Posix store: one file per block on local (or mounted) file systems.
//!
//! * Layout and file format: [`files`] and [`layout`](crate::store::format::layout); the directory is
//!   treated as hostile ground ([`files`], `trust`).
//! * Visibility: a block is written under a temporary name in the store
//!   instance's work directory and renamed when all its shards are in
//!   (`writer`); readers only ever open final names, so they never see a
//!   partial block, and a killed writer leaves only its work directory,
//!   which the next start reclaims (`work`).
//! * Durability (`durability`): by default the commit does not sync. A
//!   power cut can at worst leave a published file whose pages never
//!   reached the disk; every load verifies the shard's header and checksum,
//!   so such a file is a load error (and is removed), never wrong bytes.
//!   `data` syncs the data before the rename, `full` the directory too.
//! * Lookups: an in-memory [`index`]; an index miss falls back to one `stat`
//!   so blocks written by other processes sharing the directory (vLLM's
//!   workers, another engine) are found too.
//! * Capacity: above `capacity_bytes` a background thread evicts the least
//!   recently used unpinned blocks down to 90 % of it (`evict`). The
//!   bytes counted are the directory's, as every store writing there
//!   counts them together ([`usage`]), so stores sharing a directory keep
//!   it within the smallest capacity among them.
//! * Opening (directories, index, engine, threads): `open`; loads and
//!   dumps: `load`, `dump`.

mod config;
mod dump;
mod evict;
pub mod files;
pub mod index;
mod indexer;
mod listing;
mod load;
mod lookup;
mod maintain;
pub mod marker;
mod moves;
mod open;
pub mod scan;
mod spare;
mod table;
mod table_memory;
mod temp;
mod tree;
mod trust;
pub mod usage;
mod work;
mod writer;

pub use config::{Durability, PosixConfig, KEYS};
pub use maintain::PosixMaintenance;

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::{Condvar, Mutex};

use self::files::{DirectAlign, Opener};
use self::index::Index;
use self::load::load_runs;
use self::spare::SparePool;
use self::tree::Tree;
use self::usage::Usage;
use self::work::WorkDirs;
use super::{Store, StoreDebug, StoreFacts, StoreStats};
use crate::block::{BlockId, MemSeg, ShardIo};
use crate::error::{Result, UcmError};
use crate::io::{AlignedBuf, BounceBuf, IoEngine, IoOp, IoRequest};
use crate::store::format::layout::{round_up, Layout, ShardHeader, HEADER_LEN, REGION_ALIGN};
use crate::task::{TaskId, TaskRegistry, WorkerPool};

/// Counters of one store's activity since it was opened.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PosixStats {
    /// Blocks in the index: every block under the roots once the pass
    /// after opening finished (see `indexer`); in a store that writes
    /// without a capacity, those it wrote or looked up.
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
    tree: Tree,
    opener: Opener,
    align: DirectAlign,
    index: Arc<Index>,
    writers: Mutex<dump::Writers>,
    /// Signalled when a block leaves [`dump::Writers::opening`].
    opened: Condvar,
    tasks: TaskRegistry,
    tmp_seq: AtomicU64,
    zero_pad: AlignedBuf,
    counters: Counters,
    inflight: Mutex<usize>,
    inflight_cv: Condvar,
    max_inflight: usize,
    evict_signal: (Mutex<evict::Signal>, Condvar),
    spares: SparePool,
    /// Held while a dump refills the spare pool by evicting, and by the
    /// evictor's pass, so that they never evict for the same excess.
    refill_lock: Mutex<()>,
    /// Orders evictions moving files away with the listings and probes
    /// that index what they find (see [`moves`]).
    file_moves: moves::FileMoves,
    /// Commits for the committer threads; `None` stops one.
    commits: crossbeam_channel::Sender<Option<CommitJob>>,
    /// This instance's locked work directories (None: lookup-only).
    work: Option<Arc<WorkDirs>>,
    /// The bytes under the roots, counted with every store writing there.
    usage: Arc<Usage>,
    /// Which block directories the index has read.
    listing: listing::Listing,
    /// The background pass has read (and, with a capacity, dated) every
    /// block directory: the evictor sees the whole directory.
    indexed: AtomicBool,
    /// Asks the background pass and the watcher to stop (the store closes).
    stopping: AtomicBool,
}

type CommitJob = Box<dyn FnOnce() + Send + 'static>;

struct Runtime {
    /// None in a store that only looks up.
    engine: Option<Arc<dyn IoEngine>>,
    workers: WorkerPool,
    indexer: Option<JoinHandle<()>>,
    watcher: Option<JoinHandle<()>>,
    evictor: Option<JoinHandle<()>>,
    spare_filler: Option<JoinHandle<()>>,
    committers: Vec<JoinHandle<()>>,
}

/// One file per block under one or more directories.
pub struct PosixStore {
    shared: Arc<Shared>,
    runtime: Mutex<Option<Runtime>>,
    closed: AtomicBool,
    /// Runs [`Store::load_in_background`] on the caller's thread.
    inline: Arc<dyn IoEngine>,
}

impl PosixStore {
    /// Activity counters.
    pub fn counters(&self) -> PosixStats {
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

    /// Waits (at most `timeout`) for the background pass that reads every
    /// block directory after the store opened; true once it finished.
    pub fn wait_indexed(&self, timeout: std::time::Duration) -> bool {
        let deadline = std::time::Instant::now() + timeout;
        while !self.shared.indexed.load(Ordering::Acquire) {
            if std::time::Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        true
    }

    /// The file geometry in use.
    pub fn layout(&self) -> &Layout {
        &self.shared.layout
    }

    /// The name of the I/O engine in use.
    pub fn engine_name(&self) -> &'static str {
        self.runtime
            .lock()
            .as_ref()
            .map_or("closed", |r| r.engine.as_ref().map_or("none", |e| e.name()))
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
        let layout = &self.shared.layout;
        crate::store::format::codec::check_shards(layout.shard_count, layout.shard_size, shards)
    }

    fn submit(&self, kind: &'static str, shards: Vec<ShardIo>) -> Result<TaskId> {
        self.check_shards(&shards)?;
        let rt = self.runtime.lock();
        let rt = rt.as_ref().ok_or(UcmError::Closed)?;
        let engine = rt.engine.clone().ok_or(UcmError::Closed)?;
        let task = self.shared.tasks.create(kind, shards.len());
        let load = kind == "load";
        let runs = if load {
            load_runs(shards)
        } else {
            shards.into_iter().map(|s| vec![s]).collect()
        };
        for run in runs {
            let shared = self.shared.clone();
            let engine = engine.clone();
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

    /// Bytes of the buffer a shard's transfer starts with: its header, and
    /// when the shard bounces (O_DIRECT with unaligned caller memory) its
    /// padded data as well.
    fn head_len(&self, bounce_needed: bool) -> usize {
        if bounce_needed {
            HEADER_LEN + self.padded()
        } else {
            HEADER_LEN
        }
    }

    /// The request that moves shard `index`'s region through `iov`, whose
    /// first segment is `head`: a bounced shard moves through `head` alone,
    /// which may then be one of the engine's registered buffers.
    fn shard_request(
        &self,
        op: IoOp,
        fd: RawFd,
        index: usize,
        head: &BounceBuf,
        iov: Vec<MemSeg>,
        bounce_needed: bool,
    ) -> IoRequest {
        let fixed = if bounce_needed {
            head.fixed_index()
        } else {
            None
        };
        IoRequest {
            op,
            fd,
            offset: self.layout.offset(index),
            iov,
            fixed,
        }
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
}

impl Store for PosixStore {
    fn name(&self) -> &'static str {
        "Posix"
    }

    fn reads_are_local(&self) -> bool {
        true
    }

    fn lookup(&self, ids: &[BlockId]) -> Result<Vec<bool>> {
        if self.closed.load(Ordering::Acquire) {
            return Err(UcmError::Closed);
        }
        Ok(self.shared.present_all(ids))
    }

    fn lookup_on_prefix(&self, ids: &[BlockId]) -> Result<isize> {
        if self.closed.load(Ordering::Acquire) {
            return Err(UcmError::Closed);
        }
        // The index answers runs of present blocks under one lock; a block it
        // lacks is looked for as a lookup does (another process may have
        // written it).
        let mut i = 0;
        loop {
            i += self.shared.index.touch_prefix(&ids[i..]);
            if i == ids.len() || !self.present(&ids[i]) {
                return Ok(i as isize - 1);
            }
            i += 1;
        }
    }

    fn prefetch(&self, ids: &[BlockId]) -> Result<()> {
        let rt = self.runtime.lock();
        let rt = rt.as_ref().ok_or(UcmError::Closed)?;
        let present: Vec<BlockId> = ids.iter().filter(|id| self.present(id)).copied().collect();
        let shared = self.shared.clone();
        // Ask the kernel to start reading the files into the page cache.
        // Files already there are skipped: WILLNEED walks every page of
        // the file in the page cache even when all are present, and that
        // walk took a quarter of a CPU from the load it was meant to help
        // (a 1 GiB prompt served from memory, on 2 CPUs).
        let opener = Opener::new(false, self.shared.cfg.strict);
        let len = self.shared.layout.file_len();
        rt.workers.spawn(move || {
            for id in present {
                let Ok(dir) = shared.tree.bucket(&id) else {
                    continue;
                };
                if let Ok(files::OpenFile { file: f, .. }) =
                    opener.read(&dir, &Tree::block_name(&id), len)
                {
                    if files::page_cached(&f, 0) && files::page_cached(&f, len.saturating_sub(1)) {
                        continue;
                    }
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

    /// Reads on the calling thread, one run at a time, so the copy runs at
    /// the caller's priority (a cache's nice-19 fill thread) and holds at
    /// most one of the store's in-flight slots: it never starves the I/O
    /// threads' loads on a machine with few cores.
    fn load_in_background(&self, shards: Vec<ShardIo>) -> Result<TaskId> {
        self.check_shards(&shards)?;
        if self.closed.load(Ordering::Acquire) {
            return Err(UcmError::Closed);
        }
        let task = self.shared.tasks.create("load", shards.len());
        for run in load_runs(shards) {
            if self.closed.load(Ordering::Acquire) {
                for _ in 0..run.len() {
                    task.complete_unit(Err(UcmError::Closed));
                }
                continue;
            }
            self.shared.start_load_run(&self.inline, &task, run);
        }
        Ok(task.id())
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

    fn stats(&self) -> StoreStats {
        let s = self.counters();
        let indexed = self.shared.indexed.load(Ordering::Acquire);
        [
            ("blocks", s.blocks),
            ("used_bytes", s.used_bytes),
            // What the index takes in memory, and whether the pass after
            // opening has read every block directory (0 or 1).
            ("index_bytes", self.shared.index.memory_bytes() as u64),
            ("indexed", u64::from(indexed)),
            ("shards_loaded", s.shards_loaded),
            ("shards_dumped", s.shards_dumped),
            ("blocks_committed", s.blocks_committed),
            ("evictions", s.evictions),
            ("corrupt_loads", s.corrupt_loads),
            ("files_recycled", s.files_recycled),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v as f64))
        .collect()
    }

    fn describe(&self) -> StoreFacts {
        let cfg = &self.shared.cfg;
        let dirs: Vec<String> = cfg
            .storage_backends
            .iter()
            .map(|d| d.display().to_string())
            .collect();
        [
            ("io_engine", self.engine_name().to_string()),
            ("storage_backends", dirs.join(":")),
            ("durability", format!("{:?}", cfg.durability).to_lowercase()),
            ("work_token", self.shared.tree.token().to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }

    fn debug(&self) -> Option<&dyn StoreDebug> {
        Some(self)
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
        self.shared.stopping.store(true, Ordering::Release);
        for h in [rt.indexer.take(), rt.watcher.take()].into_iter().flatten() {
            let _ = h.join();
        }
        // Every commit was queued before its request counted as done.
        for _ in &rt.committers {
            let _ = self.shared.commits.send(None);
        }
        for h in rt.committers.drain(..) {
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
        self.shared.abandon_writers();
        // The spares stay for the next instance, which adopts them.
        if let Some(work) = &self.shared.work {
            work.close();
        }
        drop(rt.engine);
        Ok(())
    }
}

impl StoreDebug for PosixStore {
    fn block_path(&self, id: &BlockId) -> Option<std::path::PathBuf> {
        Some(self.shared.tree.block_path(id))
    }
}

impl Drop for PosixStore {
    fn drop(&mut self) {
        let _ = self.close();
    }
}
