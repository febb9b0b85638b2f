//! Looking after a store's contents from outside an engine (`ucm store`):
//! list the blocks, verify them, remove the corrupt ones and what dead
//! stores left behind, or everything. Works beside running engines: it
//! never touches the work directories of live stores, and removing a block
//! an engine still indexes only costs that engine a miss.

use std::time::SystemTime;

use crate::block::BlockId;
use crate::error::Result;

/// One stored block.
#[derive(Clone, Debug, PartialEq)]
pub struct BlockEntry {
    /// Its id.
    pub id: BlockId,
    /// Bytes it takes.
    pub bytes: u64,
    /// When it was last written (or dumped again).
    pub modified: SystemTime,
}

/// What a clean-up removed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GcReport {
    /// Temporary and spare files of stores that are no longer running.
    pub temporaries: usize,
    /// Entries at block names that were not block files (symlinks, FIFOs...).
    pub foreign: usize,
}

/// The maintenance operations of a store's contents.
pub trait Maintenance: Send + Sync {
    /// Every stored block.
    fn blocks(&self) -> Result<Vec<BlockEntry>>;

    /// Reads the whole block and checks every shard's header and checksum
    /// (a [`crate::UcmError::Corrupt`] if any fails).
    fn verify(&self, id: &BlockId) -> Result<()>;

    /// Removes a block; false if it was not there.
    fn remove(&self, id: &BlockId) -> Result<bool>;

    /// Removes what stores that are no longer running left behind.
    fn gc(&self) -> Result<GcReport>;

    /// Where the store lives, for messages.
    fn location(&self) -> String;
}
