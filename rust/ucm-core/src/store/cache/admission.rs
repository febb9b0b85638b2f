//! Which load misses earn a slot under `reuse_allocate`: a block read
//! straight from a local backend into the caller is kept only when it is
//! loaded a second time.
//!
//! Keeping a block that was read straight into the caller costs a second
//! read of the backend into the slot, and on a fresh process the first
//! touch of the slot's memory. That work runs while the engine computes
//! the token the load was for, and on a small host it took a fresh
//! engine's first-token time from below vLLM's own prefix hit to above it.
//! A block loaded once after a restart is usually never loaded again: the
//! engine's own prefix cache keeps it. So the first load only records the
//! block here (the "doorkeeper" of TinyLFU-style admission) and reads like
//! the backend alone; a second load within the window keeps it.

use std::collections::{HashSet, VecDeque};

use parking_lot::Mutex;

use crate::block::BlockId;

/// Blocks loaded once recently, oldest forgotten first.
pub(super) struct SeenOnce {
    inner: Mutex<Window>,
}

struct Window {
    seen: HashSet<BlockId>,
    order: VecDeque<BlockId>,
    capacity: usize,
}

impl SeenOnce {
    /// Remembers up to `capacity` blocks (at least one).
    pub(super) fn new(capacity: usize) -> Self {
        SeenOnce {
            inner: Mutex::new(Window {
                seen: HashSet::new(),
                order: VecDeque::new(),
                capacity: capacity.max(1),
            }),
        }
    }

    /// The blocks among `blocks` not seen before this call, which are
    /// remembered from now on. Shards of one block in one call count once.
    pub(super) fn first_sightings(
        &self,
        blocks: impl IntoIterator<Item = BlockId>,
    ) -> HashSet<BlockId> {
        let mut w = self.inner.lock();
        let mut first = HashSet::new();
        for b in blocks {
            if first.contains(&b) || !w.seen.insert(b) {
                continue;
            }
            first.insert(b);
            w.order.push_back(b);
            if w.order.len() > w.capacity {
                if let Some(old) = w.order.pop_front() {
                    w.seen.remove(&old);
                }
            }
        }
        first
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::block::test_id as id;

    #[test]
    fn a_block_is_a_first_sighting_once_per_window() {
        let s = SeenOnce::new(2);
        let first = s.first_sightings([id(1), id(1), id(2)]);
        assert_eq!(first, HashSet::from([id(1), id(2)]));
        assert!(s.first_sightings([id(1), id(2)]).is_empty());
        // A third block pushes the oldest out of the window.
        assert_eq!(s.first_sightings([id(3)]), HashSet::from([id(3)]));
        assert_eq!(s.first_sightings([id(1)]), HashSet::from([id(1)]));
        assert!(s.first_sightings([id(3)]).is_empty());
    }
}
