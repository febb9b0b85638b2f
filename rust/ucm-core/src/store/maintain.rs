//! Looking after a store's contents from outside an engine (`ucm store`):
//! list the blocks, verify them, remove the corrupt ones and what stopped
//! stores left behind, or every block. Works beside running engines: it
//! never touches the work directories of live stores, and removing a block
//! an engine still indexes only costs that engine a miss.
//!
//! Every removal keeps one rule: only what ucm wrote goes.
//! * A block goes only after what sits at its place was read and its first
//!   header checked ([`check_header`]: the magic, the header's own
//!   checksum, and that it names this very block), right before the removal
//!   itself. A link, FIFO, directory, user's file or another block's copy
//!   at a block's name is reported and left alone.
//! * The work files of stores that stopped go only by the names those
//!   stores give them, inside a work directory whose owner is gone.
//! * A Posix directory is first recognised as a store: it carries the
//!   marker stores write (`.ucm-store`), or, written before the marker
//!   existed, its sampled block files verify; otherwise it is refused
//!   before anything is read or changed (see the Posix maintenance).
//!
//! The long jobs ([`verify_all`], the plans and [`execute`]) run on a pool
//! of threads ([`map_parallel`]) and report how far they got through a
//! shared [`Progress`].

mod jobs;
mod parallel;
mod verify;

use std::time::SystemTime;

use crate::block::BlockId;
use crate::error::{Result, UcmError};

pub use jobs::{
    execute, plan_blocks, plan_clear, plan_gc, summarize, verify_all, Item, ItemKind, Outcome,
    Plan, Summary, Tally, Target, VerifyReport,
};
pub use parallel::{map_parallel, Progress};
pub use verify::{check_header, BlockVerifier, HEADER_READ};

/// One stored block.
#[derive(Clone, Debug, PartialEq)]
pub struct BlockEntry {
    /// Its id.
    pub id: BlockId,
    /// Bytes it takes, where the listing read them.
    pub bytes: Option<u64>,
    /// When it was last written (or dumped again), where the listing read it.
    pub modified: Option<SystemTime>,
}

/// Something found where the store keeps blocks that is not a block of
/// it, and is left alone: where it is and what it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Kept {
    /// Its path or URL.
    pub label: String,
    /// Why it stays.
    pub reason: String,
}

impl Kept {
    /// `label`, left alone for `reason`.
    pub fn new(label: impl Into<String>, reason: impl Into<String>) -> Self {
        Kept {
            label: label.into(),
            reason: reason.into(),
        }
    }
}

/// The blocks of a store, and what sits at block names without being one.
#[derive(Clone, Debug, Default)]
pub struct Listing {
    /// The blocks (regular files or objects at block names).
    pub blocks: Vec<BlockEntry>,
    /// What was found at block names or block directories' names that is
    /// not a block file (links, FIFOs, directories): never followed.
    pub odd: Vec<Kept>,
}

/// How a place was recognised as a store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Identity {
    /// It carries the store marker of this on-disk format (or an older one).
    Marked {
        /// The format the marker declares.
        format: u32,
    },
    /// It has no marker (written before markers), and every block file
    /// sampled verifies as a ucm block: the first removal marks it.
    Adoptable {
        /// Block files sampled.
        sampled: usize,
    },
    /// An object store or export without a marker: each object is checked
    /// on its own before it is removed.
    PerObject,
}

/// What sits at a block's place, as a removal sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Check {
    /// A ucm block file of that block, of this many bytes.
    Ours {
        /// Its length.
        bytes: u64,
    },
    /// Nothing (removed meanwhile).
    Gone,
    /// Something ucm did not write there (why).
    NotOurs(String),
}

/// What one removal did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Removal {
    /// Removed, freeing this many bytes.
    Removed {
        /// Bytes freed.
        bytes: u64,
    },
    /// Already gone.
    Gone,
    /// Found not to be ucm's (or no longer removable) and left alone: why.
    Kept(String),
}

/// A file (or directory of files) a stopped store left behind.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Leftover {
    /// Its path or URL.
    pub label: String,
    /// Bytes it holds.
    pub bytes: u64,
    /// Files it is.
    pub files: usize,
    /// What it is.
    pub kind: ItemKind,
    /// Where it is, as the backend finds it again.
    pub place: Place,
}

/// Where a [`Leftover`] is, below the store's root.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Place {
    /// A stopped store's work directory `.work/<name>` under root `root`
    /// and the files in it that the store wrote (by their names).
    WorkDir {
        /// The root.
        root: usize,
        /// The directory's name in `.work`.
        name: String,
        /// The files to remove.
        files: Vec<String>,
        /// A directory whose creator died before it was locked (no lock
        /// to take: its age tells).
        unlocked: bool,
    },
    /// A temporary file `name` in block directory `dir` of root `root`.
    Temp {
        /// The root.
        root: usize,
        /// The block directory.
        dir: String,
        /// The file.
        name: String,
        /// The block it was being written for.
        block: BlockId,
    },
}

/// The maintenance operations of a store's contents.
pub trait Maintenance: Send + Sync {
    /// Where the store lives, for messages.
    fn location(&self) -> String;

    /// How each root (or the object store) was recognised as a store. By
    /// default: one location whose every object is checked on its own
    /// (object stores, where nobody else's files sit beside ours).
    fn identity(&self) -> Vec<(String, Identity)> {
        vec![(self.location(), Identity::PerObject)]
    }

    /// Marks every root recognised by its blocks alone
    /// ([`Identity::Adoptable`]) with the store marker, before the first
    /// removal; the roots marked. By default none: nothing to mark.
    fn adopt(&self) -> Result<Vec<String>> {
        Ok(Vec::new())
    }

    /// Every block. With `detail`, each block's size and modification
    /// time (one `stat` each where the listing does not give them);
    /// without, the sizes of a sample (and what the listing gives anyway).
    fn list(&self, detail: bool) -> Result<Listing>;

    /// Where block `id` is, for messages.
    fn block_label(&self, id: &BlockId) -> String;

    /// Reads the whole block and checks every shard's header and checksum
    /// (a [`crate::UcmError::Corrupt`] if any fails).
    fn verify(&self, id: &BlockId) -> Result<()>;

    /// Reads the first header of what sits at block `id`'s place and tells
    /// whether it is a ucm block file of that block.
    fn check(&self, id: &BlockId) -> Result<Check>;

    /// Removes block `id` if what sits at its place is a ucm block file of
    /// that block, checked right before the removal.
    fn remove(&self, id: &BlockId) -> Result<Removal>;

    /// What stores that are no longer running left behind, and what was
    /// found there but is not theirs to remove.
    fn leftovers(&self) -> Result<(Vec<Leftover>, Vec<Kept>)>;

    /// Removes a leftover, checking again that its store is gone.
    fn remove_leftover(&self, leftover: &Leftover) -> Result<Removal>;

    /// Called once after a batch of removals (to settle what they changed).
    fn finish(&self) {}

    /// Threads worth running its jobs on.
    fn threads(&self) -> usize;
}

/// True when `e` says the block is not there (removed meanwhile).
pub fn is_gone(e: &UcmError) -> bool {
    match e {
        UcmError::NotFound(_) => true,
        UcmError::Os { source, .. } => source.kind() == std::io::ErrorKind::NotFound,
        _ => false,
    }
}

/// The threads a job over local files runs on: every core, twice over,
/// since a cold read waits on the disk rather than the CPU.
pub fn local_threads() -> usize {
    let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
    (2 * cores).clamp(4, 64)
}
