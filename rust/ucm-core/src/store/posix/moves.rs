//! One lock per block directory, held by whatever moves a block's file away
//! from its name and by whatever reads the directory into the index.
//!
//! An eviction takes the block out of the index, then moves its file out
//! of the block's name. A listing (or a probe) in between would still find
//! the file there and index a block whose file is about to become a spare:
//! a hit no load can serve. Holding the directory's lock from the index
//! change until the file has left, and from a listing until what it found
//! is indexed, orders the two. One lock per directory keeps an eviction
//! from waiting on the listing of another directory.

use parking_lot::{Mutex, MutexGuard};

use super::tree::Tree;
use crate::block::BlockId;

pub(super) struct FileMoves(Vec<[Mutex<()>; 256]>);

impl FileMoves {
    pub fn new(roots: usize) -> Self {
        FileMoves(
            (0..roots)
                .map(|_| std::array::from_fn(|_| Mutex::new(())))
                .collect(),
        )
    }

    /// The lock of block directory `b` of root `root`.
    pub fn of_bucket(&self, root: usize, b: u8) -> &Mutex<()> {
        &self.0[root][usize::from(b)]
    }

    /// Holds the lock of `id`'s block directory.
    pub fn lock(&self, tree: &Tree, id: &BlockId) -> MutexGuard<'_, ()> {
        self.of_bucket(tree.root_index(id), id.0[0]).lock()
    }
}
