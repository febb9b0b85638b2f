//! Passes over every block directory of a store.
//!
//! The background pass of a store that just opened reads every block
//! directory into the index (lookups don't wait for it: they read the
//! directories they need themselves, see [`super::listing`]). A store with
//! a capacity also dates the blocks by mtime for its evictor and removes
//! what is not a block at a block's name; the first store to find the
//! directory's usage record uncounted counts the directory's bytes. A store
//! that writes without a capacity, over a counted record, skips the pass.
//! The evictor runs the same pass again when it must learn blocks other
//! stores wrote (see `evict`).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use super::files::{LEGACY_TMP_MARKER, WORK_DIR};
use super::listing::{list_dir, Listed};
use super::scan::{is_stale_legacy, work_bytes};
use super::usage::Part;
use super::Shared;
use crate::block::BlockId;
use crate::error::{Result, UcmError};

/// What a pass does besides reading the directories into the index.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Pass {
    /// Remove what is not a block at a block's name, and stale temporaries
    /// of older versions.
    pub clean: bool,
    /// Date the blocks by mtime (for the evictor's order).
    pub date: bool,
    /// Count the roots' bytes into their usage records.
    pub count: bool,
}

/// What a pass found.
#[derive(Debug, Default)]
pub(super) struct Report {
    /// Blocks of this layout found.
    pub blocks: usize,
    /// Blocks the index did not hold before.
    pub new_blocks: usize,
    /// Bytes counted under all roots.
    pub bytes: u64,
    /// Entries at block names that were not block files, removed.
    pub removed_foreign: usize,
    /// Stale temporaries of older versions, removed.
    pub removed_temps: usize,
}

/// One read of a block directory.
struct BucketRead {
    listed: Listed,
    /// Its blocks.
    blocks: Vec<BlockId>,
    /// Each regular file at a block name: mtime, id, length (when asked).
    stats: Vec<(u64, BlockId, u64)>,
    /// Their bytes.
    bytes: u64,
}

fn read_bucket(dir: &super::files::Dir, stat: bool) -> BucketRead {
    let listed = list_dir(dir);
    let blocks = listed.blocks.clone();
    let mut stats = Vec::new();
    let mut bytes = 0;
    if stat {
        for id in &blocks {
            let Ok(st) = dir.lstat(id.hex()) else {
                continue;
            };
            if st.is_file() {
                bytes += st.len;
                stats.push((st.mtime_ns, *id, st.len));
            }
        }
    }
    BucketRead {
        listed,
        blocks,
        stats,
        bytes,
    }
}

/// Removes what is not a block at a block's name, and stale temporaries of
/// older versions.
fn clean_bucket(dir: &super::files::Dir, listed: &Listed, report: &mut Report) {
    for name in &listed.foreign {
        // A directory goes only when empty. A regular file here became one
        // since the listing (a store published a block meanwhile): left.
        let Ok(st) = dir.lstat(name) else {
            continue;
        };
        if st.is_file() {
            continue;
        }
        if super::files::remove_non_block(dir, name, &st).is_ok() {
            report.removed_foreign += 1;
        }
    }
    for name in &listed.other {
        if name.to_string_lossy().contains(LEGACY_TMP_MARKER)
            && dir
                .lstat(name)
                .is_ok_and(|st| st.is_file() && is_stale_legacy(st.mtime_ns))
            && dir.remove_file(name).is_ok()
        {
            report.removed_temps += 1;
        }
    }
}

/// Starts the background pass of a store that just opened.
pub(super) fn spawn(shared: Arc<Shared>) -> Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("ucm-posix-index".into())
        .spawn(move || at_open(&shared))
        .map_err(|e| UcmError::os("spawn thread", "ucm-posix-index", e))
}

fn at_open(shared: &Shared) {
    let started = Instant::now();
    let writes = shared.work.is_some();
    let capacity = writes && shared.cfg.capacity_bytes > 0;
    // A record nobody counted yet (new, or damaged) is counted here, by
    // whatever store comes first, capacity or not.
    let count = writes && shared.usage.take_stale();
    if writes && !capacity && !count {
        // A store that writes without a capacity needs no index of the
        // whole directory: it looks a block up where it dumps it. On a
        // host, the engine's scheduler (which only looks up) reads the
        // directories; its workers don't read them again.
        shared.indexed.store(true, Ordering::Release);
        return;
    }
    let report = pass(
        shared,
        Pass {
            clean: capacity,
            date: capacity,
            count,
        },
    );
    if shared.stopping.load(Ordering::Acquire) {
        return;
    }
    shared.indexed.store(true, Ordering::Release);
    log::info!(
        "posix store over {:?}: indexed {} block(s) in {:.2} s; {} non-block file(s) at \
         block names and {} stale temporary file(s) removed",
        shared.cfg.storage_backends,
        shared.index.len(),
        started.elapsed().as_secs_f64(),
        report.removed_foreign,
        report.removed_temps
    );
}

/// Reads every block directory into the index, and does what `what` asks
/// besides. Stops early (with what it did) when the store closes.
pub(super) fn pass(shared: &Shared, what: Pass) -> Report {
    let file_len = shared.layout.file_len();
    let stat = what.date || what.count;
    let mut found: Vec<(u64, BlockId)> = Vec::new();
    let mut report = Report::default();
    for root in 0..shared.tree.root_count() {
        let mut count = if what.count {
            shared.usage.start_count(root)
        } else {
            None
        };
        for b in 0..=255u8 {
            if shared.stopping.load(Ordering::Acquire) {
                return report;
            }
            let moves = shared.file_moves.of_bucket(root, b);
            shared
                .listing
                .ensure(&shared.tree, &shared.index, moves, (root, b));
            if !what.clean && !stat {
                continue;
            }
            let Ok(dir) = shared.tree.bucket_at(root, b) else {
                continue;
            };
            // Until what this read found is indexed, no eviction moves a
            // file away here (see `moves`); taken before the usage's part,
            // in the order an eviction takes them.
            let _moves = moves.lock();
            // Read again while this store changed the directory during the
            // read: its own changes then count once, not twice or never.
            let read = match count.as_mut() {
                None => read_bucket(&dir, stat),
                Some(c) => {
                    let part = Part::Bucket(b);
                    let read = c.read(&shared.usage, part, || read_bucket(&dir, stat));
                    c.found(part, read.bytes);
                    read
                }
            };
            report.new_blocks += shared.index.insert_found(&read.blocks);
            report.bytes += read.bytes;
            if what.clean {
                clean_bucket(&dir, &read.listed, &mut report);
            }
            for (mtime, id, len) in read.stats {
                if len == file_len {
                    found.push((mtime, id));
                } else {
                    // Not a block of this layout: never served, never counted
                    // as this store's.
                    shared.index.remove(&id);
                }
            }
        }
        if let Some(mut c) = count {
            if let Ok(work) = shared.tree.root(root).sub(WORK_DIR) {
                let bytes = c.read(&shared.usage, Part::Work, || work_bytes(&work));
                c.found(Part::Work, bytes);
                report.bytes += bytes;
            }
            shared.usage.finish_count(c);
        }
    }
    report.blocks = found.len();
    if what.date {
        found.sort_unstable_by_key(|(t, _)| *t);
        let oldest_first: Vec<BlockId> = found.iter().map(|(_, id)| *id).collect();
        shared.index.date_found(&oldest_first);
    }
    report
}

/// Starts the thread that applies, as they come, the changes other
/// processes make in the watched block directories, so that few wait for
/// the lookup that needs them and the kernel's queue never overflows.
pub(super) fn spawn_watcher(shared: Arc<Shared>) -> Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("ucm-posix-watch".into())
        .spawn(move || {
            while !shared.stopping.load(Ordering::Acquire) {
                if shared.listing.wait(std::time::Duration::from_millis(200)) {
                    shared.catch_up();
                }
            }
        })
        .map_err(|e| UcmError::os("spawn thread", "ucm-posix-watch", e))
}
