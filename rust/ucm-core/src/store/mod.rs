//! KV block stores.
//!
//! Every store implements the one [`Store`] trait: the v1 API of the original
//! UCM (lookup, prefix lookup, prefetch, asynchronous load/dump returning a
//! task handle, wait, check), plus `flush` and `stats` for tiered stores.
//! Built-in stores: [`posix::PosixStore`] (one file per block on local or
//! mounted file systems), [`s3::S3Store`], [`nfs::NfsStore`] and
//! [`mooncake::MooncakeStore`] (remote tiers over one shell, [`remote`]),
//! [`empty::EmptyStore`], and [`cache::CacheStore`], a host-memory tier
//! composed over any other store. [`registry`] declares each of them as a
//! stage once; [`pipeline`] builds the stacks named by `store_pipeline`
//! (`"Cache|Posix"`, ...) from it.

use crate::block::{BlockId, ShardIo};
use crate::error::Result;
use crate::task::TaskId;

pub mod cache;
pub mod empty;
pub mod format;
pub mod maintain;
pub mod mooncake;
pub mod nfs;
pub mod pipeline;
pub mod posix;
pub mod registry;
pub mod remote;
pub mod s3;
pub mod safe_fs;

pub use cache::{CacheConfig, CacheStore};
pub use empty::EmptyStore;
pub use posix::{PosixConfig, PosixStore};

/// Named figures of a store (counters, rates, latencies), as a sorted map so
/// every store can report what it has without a shared schema; bindings turn
/// it into a dict. Counters are exact up to 2^53.
pub type StoreStats = std::collections::BTreeMap<String, f64>;

/// Named facts about a store that are not numbers (its I/O engine, its
/// directories, a shared segment's path), for `describe` and tooling.
pub type StoreFacts = std::collections::BTreeMap<String, String>;

/// Hooks for tests and tools, outside the store API: what a store can tell
/// about where it keeps a block, and the fault it can inject.
pub trait StoreDebug {
    /// Where the block's file lives, for stores that keep files.
    fn block_path(&self, _id: &BlockId) -> Option<std::path::PathBuf> {
        None
    }

    /// Takes the store's shared lock and never returns, for tests that
    /// kill the process to check recovery; returns at once (false) where
    /// there is no such lock.
    fn hold_lock_forever(&self) -> bool {
        false
    }
}

/// The store interface. All methods are thread-safe.
pub trait Store: Send + Sync {
    /// Human-readable store name (`"Posix"`, `"Empty"`).
    fn name(&self) -> &'static str;

    /// Presence of each block, independently of the others.
    fn lookup(&self, ids: &[BlockId]) -> Result<Vec<bool>>;

    /// Index of the last block of the longest present prefix, -1 if the
    /// first block is missing.
    fn lookup_on_prefix(&self, ids: &[BlockId]) -> Result<isize>;

    /// Hint that these blocks will be loaded soon. Never fails on misses.
    fn prefetch(&self, ids: &[BlockId]) -> Result<()>;

    /// Starts copying the given shards from the store into caller memory.
    fn load(&self, shards: Vec<ShardIo>) -> Result<TaskId>;

    /// [`Store::load`] for a copy nobody waits on soon (a tier above filling
    /// its own memory after a load): a store may run it at the calling
    /// thread's CPU priority instead of on its I/O threads, and return only
    /// once it is done. By default the same as `load`.
    fn load_in_background(&self, shards: Vec<ShardIo>) -> Result<TaskId> {
        self.load(shards)
    }

    /// Starts copying the given shards from caller memory into the store.
    /// `prerequisite` is an event handle to wait on before reading device
    /// memory (0 = none); host-memory stores ignore it.
    fn dump(&self, shards: Vec<ShardIo>, prerequisite: u64) -> Result<TaskId>;

    /// Blocks until the task finishes; consumes the handle.
    fn wait(&self, task: TaskId) -> Result<()>;

    /// True when the task finished (successfully or not); never blocks.
    fn check(&self, task: TaskId) -> Result<bool>;

    /// Finishes in-flight work and stops the store's threads. Later calls
    /// fail with `Closed`. Idempotent.
    fn close(&self) -> Result<()>;

    /// Forces every block accepted by `dump` down to persistent storage and
    /// reports the ones that could not be written. Stores that write
    /// through (every `dump` is durable once waited) have nothing to do.
    fn flush(&self) -> Result<()> {
        Ok(())
    }

    /// True when reading a block again costs no more than a local read (a
    /// file on this host, often from the page cache), so a tier above may
    /// read it twice rather than put a copy on a load's critical path.
    /// Remote stores keep the default: a second read is a second request.
    fn reads_are_local(&self) -> bool {
        false
    }

    /// The store's figures (see [`StoreStats`]); empty by default.
    fn stats(&self) -> StoreStats {
        StoreStats::new()
    }

    /// The store's facts (see [`StoreFacts`]); a store over another one
    /// adds the other's under `backend.`. Empty by default.
    fn describe(&self) -> StoreFacts {
        StoreFacts::new()
    }

    /// The store's test and tooling hooks, if it has any.
    fn debug(&self) -> Option<&dyn StoreDebug> {
        None
    }
}
