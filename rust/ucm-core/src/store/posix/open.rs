//! Opening a Posix store: preparing its directories (created, trusted,
//! this instance's work directories locked, what stopped instances left
//! reclaimed), rebuilding the index from disk, choosing the I/O engine and
//! starting the threads.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::{Condvar, Mutex};

use super::files::{self, DirectAlign, Opener, Paths};
use super::index::Index;
use super::spare::SparePool;
use super::{evict, scan, trust, work};
use super::{CommitJob, Counters, Durability, PosixConfig, PosixStore, Runtime, Shared};
use crate::error::{Result, UcmError};
use crate::io::{build_engine, AlignedBuf, InlineEngine, IoEngine, IoEngineConfig, IoEngineKind};
use crate::store::format::layout::{Layout, REGION_ALIGN};
use crate::task::{TaskRegistry, WorkerPool};

/// A store's directories, ready for it.
struct Dirs {
    paths: Paths,
    /// This instance's locked work directories (None: lookup-only).
    work: Option<work::WorkDirs>,
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
        let index = Arc::new(Index::default());
        let report = scan::scan(&dirs.paths, &index, file_len, cfg.transfers_enabled());
        log::info!(
            "posix store over {:?}: {} block(s), {} byte(s) found; {}",
            cfg.storage_backends,
            report.blocks,
            report.bytes,
            leftovers(
                dirs.reclaimed + report.removed_temps,
                report.removed_foreign,
                dirs.adopted
            )
        );
        let engine = build_engine(&engine_config(&cfg))?;
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
    /// Creates the block directories (when transfers are enabled), checks
    /// that they can be trusted, locks this instance's work directories and
    /// reclaims those of stopped instances, adopting their spare files.
    fn prepare(cfg: &PosixConfig, file_len: u64) -> Result<Self> {
        let paths = Paths::new(cfg.storage_backends.clone());
        let writes = cfg.transfers_enabled();
        if writes {
            paths.create_dirs()?;
        }
        trust::check_dirs(&cfg.storage_backends, cfg.strict)?;
        let work = if writes {
            Some(work::WorkDirs::create(&paths)?)
        } else {
            None
        };
        let spare_target = if writes { cfg.spare_files } else { 0 };
        let work_dirs: Vec<PathBuf> = (0..paths.roots().len())
            .map(|i| paths.work_dir(i))
            .collect();
        let mut spares = SparePool::new(&work_dirs, spare_target, file_len);
        if cfg.capacity_bytes > 0 {
            // Spares count against the capacity (see `evict`).
            let budget = evict::spare_budget(cfg.capacity_bytes, spare_target, file_len);
            spares = spares.with_max_bytes(budget);
        }
        let (mut reclaimed, mut adopted) = (0, 0);
        if writes {
            for (i, root) in paths.roots().iter().enumerate() {
                let r = work::reclaim(root, &work_dirs[i], spares.capacity(), file_len);
                let offered = r.spares.len();
                let kept = spares.adopt(i, r.spares);
                reclaimed += r.removed + (offered - kept);
                adopted += kept;
            }
        }
        Ok(Dirs {
            paths,
            work,
            spares,
            reclaimed,
            adopted,
        })
    }
}

/// The start-up line's account of what stopped instances left: files
/// removed and, when there were any, spare files adopted.
fn leftovers(removed: usize, foreign: usize, adopted: usize) -> String {
    let mut s = format!(
        "{removed} file(s) of stopped stores and {foreign} non-block file(s) at block names removed"
    );
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
        Shared {
            opener: Opener::new(cfg.io_direct, cfg.strict),
            layout,
            paths: dirs.paths,
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
            file_moves: Mutex::new(()),
            commits,
            work: Mutex::new(dirs.work),
            cfg,
        }
    }
}

impl Runtime {
    /// Starts the committers, the workers, the evictor and the spare
    /// filler around `engine`.
    fn start(
        shared: &Arc<Shared>,
        engine: Arc<dyn IoEngine>,
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
        Ok(Runtime {
            engine,
            workers,
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
        assert_eq!(
            leftovers(2, 1, 0),
            "2 file(s) of stopped stores and 1 non-block file(s) at block names removed"
        );
        assert!(leftovers(0, 0, 3).ends_with("removed; adopted 3 spare file(s)"));
    }
}
