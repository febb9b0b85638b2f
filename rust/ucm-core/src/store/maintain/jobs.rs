//! The jobs of `ucm store` over a whole store: its summary, every block
//! verified, and removals planned (so they can be shown, asked about or
//! listed by a dry run) and then carried out, each removal checking its
//! file again right before it goes.

use std::time::{Duration, SystemTime};

use super::parallel::{map_parallel, Progress};
use super::{is_gone, Check, Kept, Leftover, Maintenance, Removal};
use crate::block::BlockId;
use crate::error::{Result, UcmError};

/// What `ucm store info` shows.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Summary {
    /// Blocks.
    pub blocks: u64,
    /// Bytes of every block, where each block's size was read.
    pub bytes: Option<u64>,
    /// Otherwise: the blocks times the mean size of a sample of them.
    pub estimated_bytes: Option<u64>,
    /// Blocks whose size was read.
    pub sized: u64,
    /// Blocks per age bucket (younger than each bound, then the rest),
    /// where every block's modification time was read.
    pub ages: Option<Vec<u64>>,
    /// What sits at block names without being a block file.
    pub odd: Vec<Kept>,
}

/// Summarizes the store: with `detail`, every block's size and age is read
/// (ages bucketed by `bounds` as of `now`); without, the sizes of a sample.
pub fn summarize(
    m: &dyn Maintenance,
    detail: bool,
    bounds: &[Duration],
    now: SystemTime,
) -> Result<Summary> {
    let listing = m.list(detail)?;
    let blocks = listing.blocks.len() as u64;
    let sizes: Vec<u64> = listing.blocks.iter().filter_map(|b| b.bytes).collect();
    let sum: u128 = sizes.iter().map(|&s| u128::from(s)).sum();
    let all_sized = sizes.len() as u64 == blocks;
    let estimated = (!all_sized && !sizes.is_empty())
        .then(|| u64::try_from(sum * u128::from(blocks) / sizes.len() as u128).unwrap_or(u64::MAX));
    let ages = listing
        .blocks
        .iter()
        .map(|b| b.modified)
        .collect::<Option<Vec<_>>>()
        .map(|times| {
            let mut counts = vec![0u64; bounds.len() + 1];
            for t in times {
                let age = now.duration_since(t).unwrap_or_default();
                let i = bounds.iter().position(|b| age < *b).unwrap_or(bounds.len());
                counts[i] += 1;
            }
            counts
        });
    Ok(Summary {
        blocks,
        bytes: all_sized.then(|| u64::try_from(sum).unwrap_or(u64::MAX)),
        estimated_bytes: estimated,
        sized: sizes.len() as u64,
        ages,
        odd: listing.odd,
    })
}

/// What verifying every block found.
#[derive(Clone, Debug, Default)]
pub struct VerifyReport {
    /// Blocks listed.
    pub blocks: usize,
    /// The blocks that failed, with why (by id).
    pub failures: Vec<(BlockId, UcmError)>,
    /// Blocks removed while the job ran (an engine evicted them).
    pub vanished: usize,
    /// What sits at block names without being a block file.
    pub odd: Vec<Kept>,
}

fn cancelled() -> UcmError {
    UcmError::TaskFailed("cancelled".into())
}

/// Verifies every block of the store on the store's threads.
pub fn verify_all(m: &dyn Maintenance, progress: &Progress) -> Result<VerifyReport> {
    progress.start("listing", None);
    let listing = m.list(false)?;
    let ids: Vec<BlockId> = listing.blocks.iter().map(|b| b.id).collect();
    progress.start("verifying", Some(ids.len()));
    let found = map_parallel(&ids, m.threads(), progress, |id| match m.verify(id) {
        Ok(()) => None,
        Err(e) if is_gone(&e) => Some(None),
        Err(e) => Some(Some((*id, e))),
    });
    if progress.cancelled() {
        return Err(cancelled());
    }
    let vanished = found.iter().filter(|f| f.is_none()).count();
    let mut failures: Vec<_> = found.into_iter().flatten().collect();
    failures.sort_by_key(|(id, _)| *id);
    Ok(VerifyReport {
        blocks: ids.len(),
        failures,
        vanished,
        odd: listing.odd,
    })
}

/// Why something is to be removed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ItemKind {
    /// A block (`clear`).
    Block,
    /// A block that failed verification.
    Corrupt,
    /// The work directory of a store that stopped.
    StoppedStore,
    /// A temporary file a writer abandoned.
    IdleTemp,
}

impl ItemKind {
    /// A short name (`block`, `corrupt`, `work`, `temp`).
    pub fn name(self) -> &'static str {
        match self {
            ItemKind::Block => "block",
            ItemKind::Corrupt => "corrupt",
            ItemKind::StoppedStore => "work",
            ItemKind::IdleTemp => "temp",
        }
    }
}

/// What an [`Item`] removes.
#[derive(Clone, Debug)]
pub enum Target {
    /// A block.
    Block(BlockId),
    /// What a stopped store left.
    Leftover(Leftover),
}

/// One thing a plan removes.
#[derive(Clone, Debug)]
pub struct Item {
    /// What.
    pub target: Target,
    /// Its path or URL.
    pub label: String,
    /// Bytes it holds.
    pub bytes: u64,
    /// Files it is.
    pub files: usize,
    /// Why it goes.
    pub kind: ItemKind,
    /// More about why (a corrupt block's failure).
    pub detail: String,
}

/// What a destructive command removes, and what it found and leaves.
#[derive(Clone, Debug, Default)]
pub struct Plan {
    /// To remove, each checked to be ucm's.
    pub remove: Vec<Item>,
    /// Left alone, with why.
    pub keep: Vec<Kept>,
}

/// Plans the removal of `blocks` (id, why, detail): each is checked to be
/// a ucm block file of that block; what is not is kept, with why.
pub fn plan_blocks(
    m: &dyn Maintenance,
    blocks: Vec<(BlockId, ItemKind, String)>,
    progress: &Progress,
) -> Result<Plan> {
    progress.start("checking", Some(blocks.len()));
    let checked = map_parallel(&blocks, m.threads(), progress, |(id, kind, detail)| {
        let label = m.block_label(id);
        match m.check(id) {
            Ok(Check::Ours { bytes }) => Some(Ok(Item {
                target: Target::Block(*id),
                label,
                bytes,
                files: 1,
                kind: *kind,
                detail: detail.clone(),
            })),
            Ok(Check::Gone) => None,
            Err(e) if is_gone(&e) => None,
            Ok(Check::NotOurs(why)) => Some(Err(Kept::new(label, why))),
            Err(e) => Some(Err(Kept::new(label, format!("could not be checked: {e}")))),
        }
    });
    if progress.cancelled() {
        return Err(cancelled());
    }
    let mut plan = Plan::default();
    for c in checked {
        match c {
            Ok(item) => plan.remove.push(item),
            Err(kept) => plan.keep.push(kept),
        }
    }
    plan.remove.sort_by(|a, b| a.label.cmp(&b.label));
    plan.keep.sort_by(|a, b| a.label.cmp(&b.label));
    Ok(plan)
}

/// Plans `clear`: every block file of the store.
pub fn plan_clear(m: &dyn Maintenance, progress: &Progress) -> Result<Plan> {
    progress.start("listing", None);
    let listing = m.list(false)?;
    let blocks = listing
        .blocks
        .into_iter()
        .map(|b| (b.id, ItemKind::Block, String::new()))
        .collect();
    let mut plan = plan_blocks(m, blocks, progress)?;
    plan.keep.extend(listing.odd);
    Ok(plan)
}

/// Plans `gc`: what stopped stores left, and the blocks that fail
/// verification (their corruption found; blocks that could not be read
/// for another reason are kept, with it).
pub fn plan_gc(m: &dyn Maintenance, progress: &Progress) -> Result<Plan> {
    progress.start("looking for what stopped stores left", None);
    let (leftovers, kept) = m.leftovers()?;
    let report = verify_all(m, progress)?;
    let mut unreadable = Vec::new();
    let mut corrupt = Vec::new();
    for (id, e) in report.failures {
        if matches!(e, UcmError::Corrupt { .. }) {
            corrupt.push((id, ItemKind::Corrupt, e.to_string()));
        } else {
            unreadable.push(Kept::new(
                m.block_label(&id),
                format!("could not be verified: {e}"),
            ));
        }
    }
    let mut plan = plan_blocks(m, corrupt, progress)?;
    plan.remove.extend(leftovers.into_iter().map(|l| Item {
        label: l.label.clone(),
        bytes: l.bytes,
        files: l.files,
        kind: l.kind,
        detail: String::new(),
        target: Target::Leftover(l),
    }));
    plan.keep.extend(kept);
    plan.keep.extend(unreadable);
    plan.keep.extend(report.odd);
    Ok(plan)
}

/// Removed items of one kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    /// Items.
    pub items: usize,
    /// Files.
    pub files: usize,
    /// Bytes.
    pub bytes: u64,
}

/// What carrying out a plan did.
#[derive(Clone, Debug, Default)]
pub struct Outcome {
    /// Removed, per kind.
    pub removed: Vec<(ItemKind, Tally)>,
    /// Already gone when their turn came.
    pub gone: usize,
    /// Found, at their turn, not to be ucm's (or not removable): left.
    pub kept: Vec<Kept>,
    /// Failed to be removed, with the error.
    pub failed: Vec<Kept>,
    /// Roots marked as stores first (adopted).
    pub marked: Vec<String>,
}

/// Carries out `plan`: marks the roots that are adopted, then removes each
/// item after checking it again. A cancelled run stops at its next item
/// and tells what it removed until then.
pub fn execute(m: &dyn Maintenance, plan: &Plan, progress: &Progress) -> Result<Outcome> {
    let marked = m.adopt()?;
    progress.start("removing", Some(plan.remove.len()));
    enum Done {
        Removed(ItemKind, usize, u64),
        Gone,
        Kept(Kept),
        Failed(Kept),
    }
    let done = map_parallel(&plan.remove, m.threads(), progress, |item| {
        let r = match &item.target {
            Target::Block(id) => m.remove(id),
            Target::Leftover(l) => m.remove_leftover(l),
        };
        Some(match r {
            Ok(Removal::Removed { bytes }) => Done::Removed(item.kind, item.files, bytes),
            Ok(Removal::Gone) => Done::Gone,
            Err(e) if is_gone(&e) => Done::Gone,
            Ok(Removal::Kept(why)) => Done::Kept(Kept::new(item.label.clone(), why)),
            Err(e) => Done::Failed(Kept::new(item.label.clone(), e.to_string())),
        })
    });
    m.finish();
    let mut out = Outcome {
        marked,
        ..Default::default()
    };
    let mut tallies = std::collections::BTreeMap::<ItemKind, Tally>::new();
    for d in done {
        match d {
            Done::Removed(kind, files, bytes) => {
                let t = tallies.entry(kind).or_default();
                t.items += 1;
                t.files += files;
                t.bytes += bytes;
            }
            Done::Gone => out.gone += 1,
            Done::Kept(k) => out.kept.push(k),
            Done::Failed(k) => out.failed.push(k),
        }
    }
    out.removed = tallies.into_iter().collect();
    Ok(out)
}
