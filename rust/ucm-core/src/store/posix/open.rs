//! Opening a Posix store: preparing its directories (created, trusted,
//! this instance's work directories locked, what stopped instances left
//! reclaimed), rebuilding the index from disk, choosing the I/O engine and
//! starting the threads.

use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::{Condvar, Mutex};

use super::files::{self, DirectAlign, Opener};
use super::index::Index;
use super::spare::SparePool;
use super::tree::Tree;
use super::usage::Usage;
use super::work::WorkDirs;
use super::{evict, marker, trust, work};
use super::{CommitJob, Counters, Durability, PosixConfig, PosixStore, Runtime, Shared};
use crate::error::{Result, UcmError};
use crate::io::{build_engine, AlignedBuf, InlineEngine, IoEngine, IoEngineConfig, IoEngineKind};
use crate::store::format::layout::{Layout, REGION_ALIGN};
use crate::task::{TaskRegistry, WorkerPool};

/// A store's directories, ready for it.
struct Dirs {
    tree: Tree,
    /// This instance's locked work directories (None: lookup-only).
    work: Option<Arc<WorkDirs>>,
    usage: Arc<Usage>,
    spares: SparePool,
    /// Files of stopped instances removed.
    reclaimed: usize,
    /// Spare files of stopped instances adopted.
    adopted: usize,
}

impl PosixStore {
    /// Validates `cfg`, prepares the directories, rebuilds the index from
    /// what is on disk and starts the threads.
    pub fn open(cfg: PosixConfig) -> Result<Self> {
        cfg.create_missing_roots()?;
        cfg.validate()?;
        let layout = Layout::new(cfg.block_size, cfg.shard_size, &cfg.tensor_size_list);
        let file_len = layout.file_len();
        let dirs = Dirs::prepare(&cfg, file_len)?;
        let align = direct_align(&cfg);
        let index = Arc::new(Index::new(file_len));
        log::info!(
            "posix store over {:?}: {}; indexing in the background",
            cfg.storage_backends,
            leftovers(dirs.reclaimed, dirs.adopted)
        );
        // A store that only looks up moves no bytes: no I/O engine, no
        // buffers.
        let engine = if cfg.transfers_enabled() {
            Some(build_engine(&engine_config(&cfg))?)
        } else {
            None
        };
        let (commits, commit_rx) = crossbeam_channel::unbounded::<Option<CommitJob>>();
        let shared = Arc::new(Shared::new(cfg, layout, dirs, align, index, commits));
        let runtime = Runtime::start(&shared, engine, commit_rx)?;
        Ok(PosixStore {
            shared,
            runtime: Mutex::new(Some(runtime)),
            closed: AtomicBool::new(false),
            // Headers only: runs read straight into aligned cache slots.
            inline: Arc::new(InlineEngine::new(1 << 20)),
        })
    }
}

impl Dirs {
    /// Opens the roots, creates the block directories (when transfers are
    /// enabled) and marks them as a store's, checks that they can be
    /// trusted, locks this instance's work directories and reclaims those
    /// of stopped instances, adopting their spare files.
    fn prepare(cfg: &PosixConfig, file_len: u64) -> Result<Self> {
        let writes = cfg.transfers_enabled();
        let tree = Tree::open(
            &cfg.storage_backends,
            writes,
            cfg.durability == Durability::Full,
        )?;
        if writes {
            tree.create_dirs()?;
            for i in 0..tree.root_count() {
                marker::ensure(tree.root(i))?;
            }
        }
        trust::check_dirs(&cfg.storage_backends, cfg.strict)?;
        let (work, usage) = if writes {
            (
                Some(Arc::new(WorkDirs::create(&tree)?)),
                Arc::new(Usage::open(&tree)?),
            )
        } else {
            (None, Arc::new(Usage::none(tree.root_count())))
        };
        let spare_target = if writes { cfg.spare_files } else { 0 };
        let mut spares = SparePool::new(
            work.clone(),
            usage.clone(),
            tree.root_count(),
            spare_target,
            file_len,
        );
        if cfg.capacity_bytes > 0 {
            // Spares count against the capacity (see `evict`).
            let budget = evict::spare_budget(cfg.capacity_bytes, spare_target, file_len);
            spares = spares.with_max_bytes(budget);
        }
        let (mut reclaimed, mut adopted) = (0, 0);
        if let Some(w) = &work {
            for i in 0..tree.root_count() {
                let own = w.dir(i);
                let r = work::reclaim(
                    tree.root(i),
                    Some((&own, tree.token())),
                    spares.capacity(),
                    file_len,
                );
                drop(own);
                usage.add_to(i, super::usage::Part::Work, -(r.removed_bytes as i64));
                let offered = r.spares.len();
                let kept = spares.adopt(i, r.spares);
                reclaimed += r.removed + (offered - kept);
                adopted += kept;
            }
        }
        Ok(Dirs {
            tree,
            work,
            usage,
            spares,
            reclaimed,
            adopted,
        })
    }
}

/// The start-up line's account of what stopped instances left: files
/// removed and, when there were any, spare files adopted.
fn leftovers(removed: usize, adopted: usize) -> String {
    let mut s = format!("{removed} file(s) of stopped stores removed");
    if adopted > 0 {
        s.push_str(&format!("; adopted {adopted} spare file(s)"));
    }
    s
}

/// The O_DIRECT alignment that suits every directory of the store.
fn direct_align(cfg: &PosixConfig) -> DirectAlign {
    cfg.storage_backends
        .iter()
        .map(|d| files::direct_align(d))
        .fold(DirectAlign { mem: 1, len: 1 }, |a, b| DirectAlign {
            mem: a.mem.max(b.mem),
            len: a.len.max(b.len),
        })
}

/// The I/O engine the config asks for.
fn engine_config(cfg: &PosixConfig) -> IoEngineConfig {
    // `auto` means io_uring for O_DIRECT files only. Buffered I/O gains
    // nothing from io_uring: a read that hits the page cache is copied
    // inline by the submitting thread, and its completion (the checksum
    // pass) runs on the ring's one thread, while psync copies and
    // verifies on all of its threads. Measured on a 2-core VM, 512 MiB of
    // 256 KiB shards from the page cache: psync 8.6 GB/s, io_uring 5.4
    // GB/s; from disk without O_DIRECT both reach the same speed.
    let kind = match (cfg.io_engine, cfg.io_direct) {
        (IoEngineKind::Auto, false) => IoEngineKind::Psync,
        (kind, _) => kind,
    };
    IoEngineConfig {
        kind,
        threads: if kind == IoEngineKind::Psync {
            cfg.io_threads
        } else {
            cfg.io_threads.div_ceil(4).max(1)
        },
        queue_depth: (cfg.io_threads * 16).clamp(32, 1024) as u32,
        ..IoEngineConfig::default()
    }
}

impl Shared {
    fn new(
        cfg: PosixConfig,
        layout: Layout,
        dirs: Dirs,
        align: DirectAlign,
        index: Arc<Index>,
        commits: crossbeam_channel::Sender<Option<CommitJob>>,
    ) -> Self {
        let listing = super::listing::Listing::new(&dirs.tree);
        let file_moves = super::moves::FileMoves::new(dirs.tree.root_count());
        Shared {
            opener: Opener::new(cfg.io_direct, cfg.strict),
            layout,
            tree: dirs.tree,
            align,
            index,
            writers: Mutex::new(Default::default()),
            opened: Condvar::new(),
            tasks: TaskRegistry::new(cfg.timeout_ms),
            tmp_seq: AtomicU64::new(0),
            zero_pad: AlignedBuf::new(REGION_ALIGN),
            counters: Counters::default(),
            inflight: Mutex::new(0),
            inflight_cv: Condvar::new(),
            max_inflight: (cfg.io_threads * 32).clamp(64, 1024),
            evict_signal: (Mutex::new(evict::Signal::default()), Condvar::new()),
            spares: dirs.spares,
            refill_lock: Mutex::new(()),
            file_moves,
            commits,
            listing,
            work: dirs.work,
            usage: dirs.usage,
            indexed: AtomicBool::new(false),
            stopping: AtomicBool::new(false),
            cfg,
        }
    }
}

impl Runtime {
    /// Starts the committers, the workers, the evictor and the spare
    /// filler around `engine`.
    fn start(
        shared: &Arc<Shared>,
        engine: Option<Arc<dyn IoEngine>>,
        commit_rx: crossbeam_channel::Receiver<Option<CommitJob>>,
    ) -> Result<Self> {
        let committers = start_committers(shared, &commit_rx)?;
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
        let indexer = Some(super::indexer::spawn(shared.clone())?);
        let watcher = Some(super::indexer::spawn_watcher(shared.clone())?);
        Ok(Runtime {
            engine,
            workers,
            indexer,
            watcher,
            evictor: Some(evictor),
            spare_filler,
            committers,
        })
    }
}

/// The threads that run commits (renames, and syncs per `durability`).
fn start_committers(
    shared: &Shared,
    commit_rx: &crossbeam_channel::Receiver<Option<CommitJob>>,
) -> Result<Vec<JoinHandle<()>>> {
    // One committer renames fast enough; syncing commits (durability)
    // wait for the disk, so they get one thread per I/O thread.
    let committer_count = match shared.cfg.durability {
        Durability::None => 1,
        _ => shared.cfg.io_threads,
    };
    let mut committers = Vec::with_capacity(committer_count);
    for _ in 0..committer_count {
        let rx = commit_rx.clone();
        committers.push(
            std::thread::Builder::new()
                .name("ucm-posix-commit".into())
                .spawn(move || {
                    while let Ok(Some(job)) = rx.recv() {
                        job();
                    }
                })
                .map_err(|e| UcmError::os("spawn thread", "ucm-posix-commit", e))?,
        );
    }
    Ok(committers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_start_up_line_names_adopted_spares_only_when_there_are_some() {
        assert_eq!(leftovers(2, 0), "2 file(s) of stopped stores removed");
        assert!(leftovers(0, 3).ends_with("removed; adopted 3 spare file(s)"));
    }
}
