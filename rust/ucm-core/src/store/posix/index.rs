//! The in-memory index of committed blocks: presence, size, recency, pins.
//!
//! Lookups are answered from here (a hash probe, no `stat`), so 10,000 ids
//! take well under a millisecond. Recency is a logical clock stamped on each
//! entry (an atomic store under the read lock, no list reshuffling), which
//! is what the background evictor sorts by.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::RwLock;

use crate::block::{BlockId, IdMap};

struct Entry {
    size: u64,
    last_use: AtomicU64,
    pins: AtomicU32,
    /// The file's mtime (ns since the epoch) when this store last wrote or
    /// saw it: a later mtime means another store sharing the directory
    /// wrote (or dumped) the block since.
    mtime: AtomicU64,
}

/// Committed blocks of one store.
#[derive(Default)]
pub struct Index {
    map: RwLock<IdMap<Entry>>,
    clock: AtomicU64,
    used: AtomicU64,
}

/// Keeps a block from being evicted while a load reads it.
pub struct Pin {
    index: Arc<Index>,
    block: BlockId,
}

impl Drop for Pin {
    fn drop(&mut self) {
        if let Some(e) = self.index.map.read().get(&self.block) {
            e.pins.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl Index {
    fn tick(&self) -> u64 {
        self.clock.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// True if present; refreshes the block's recency.
    pub fn touch(&self, block: &BlockId) -> bool {
        match self.map.read().get(block) {
            Some(e) => {
                e.last_use.store(self.tick(), Ordering::Relaxed);
                true
            }
            None => false,
        }
    }

    /// [`Index::touch`] of many blocks under one lock and one recency
    /// stamp: sets `found[i]` for each present `blocks[i]`.
    pub fn touch_all(&self, blocks: &[BlockId], found: &mut [bool]) {
        let stamp = self.tick();
        let map = self.map.read();
        for (block, found) in blocks.iter().zip(found.iter_mut()) {
            if let Some(e) = map.get(block) {
                e.last_use.store(stamp, Ordering::Relaxed);
                *found = true;
            }
        }
    }

    /// [`Index::touch`] of the longest present prefix of `blocks`, under one
    /// lock and one recency stamp: its length.
    pub fn touch_prefix(&self, blocks: &[BlockId]) -> usize {
        let stamp = self.tick();
        let map = self.map.read();
        let mut n = 0;
        for block in blocks {
            match map.get(block) {
                Some(e) => e.last_use.store(stamp, Ordering::Relaxed),
                None => break,
            }
            n += 1;
        }
        n
    }

    /// True if present, without touching recency.
    pub fn contains(&self, block: &BlockId) -> bool {
        self.map.read().contains_key(block)
    }

    /// Adds (or refreshes) a committed block whose file has mtime `mtime`
    /// (ns since the epoch). `recency` orders blocks found by a restart
    /// scan; `None` stamps it as the most recent.
    pub fn insert(&self, block: BlockId, size: u64, recency: Option<u64>, mtime: u64) {
        let stamp = recency.unwrap_or_else(|| self.tick());
        let mut map = self.map.write();
        match map.get(&block) {
            Some(e) => {
                e.last_use.store(stamp, Ordering::Relaxed);
                e.mtime.fetch_max(mtime, Ordering::Relaxed);
            }
            None => {
                map.insert(
                    block,
                    Entry {
                        size,
                        last_use: AtomicU64::new(stamp),
                        pins: AtomicU32::new(0),
                        mtime: AtomicU64::new(mtime),
                    },
                );
                self.used.fetch_add(size, Ordering::AcqRel);
            }
        }
    }

    /// The file mtime this store last knew for `block`.
    pub fn known_mtime(&self, block: &BlockId) -> Option<u64> {
        self.map
            .read()
            .get(block)
            .map(|e| e.mtime.load(Ordering::Relaxed))
    }

    /// Advances the clock past `stamp` (after a restart scan assigned stamps).
    pub fn advance_clock(&self, stamp: u64) {
        self.clock.fetch_max(stamp, Ordering::AcqRel);
    }

    /// Pins a present block (refreshing recency); None if absent.
    pub fn pin(self: &Arc<Self>, block: &BlockId) -> Option<Pin> {
        let map = self.map.read();
        let e = map.get(block)?;
        e.pins.fetch_add(1, Ordering::AcqRel);
        e.last_use.store(self.tick(), Ordering::Relaxed);
        Some(Pin {
            index: self.clone(),
            block: *block,
        })
    }

    /// Removes a block unconditionally (it turned out corrupt or missing).
    pub fn remove(&self, block: &BlockId) -> Option<u64> {
        let e = self.map.write().remove(block)?;
        self.used.fetch_sub(e.size, Ordering::AcqRel);
        Some(e.size)
    }

    /// Removes a block unless a load holds a pin on it.
    pub fn remove_if_unpinned(&self, block: &BlockId) -> Option<u64> {
        let mut map = self.map.write();
        if map.get(block)?.pins.load(Ordering::Acquire) > 0 {
            return None;
        }
        let e = map.remove(block)?;
        self.used.fetch_sub(e.size, Ordering::AcqRel);
        Some(e.size)
    }

    /// Unpinned blocks, least recently used first, until `bytes` are covered.
    pub fn coldest(&self, bytes: u64) -> Vec<BlockId> {
        let map = self.map.read();
        let mut all: Vec<(u64, BlockId, u64)> = map
            .iter()
            .filter(|(_, e)| e.pins.load(Ordering::Acquire) == 0)
            .map(|(id, e)| (e.last_use.load(Ordering::Relaxed), *id, e.size))
            .collect();
        drop(map);
        all.sort_unstable_by_key(|(t, _, _)| *t);
        let mut out = Vec::new();
        let mut covered = 0u64;
        for (_, id, size) in all {
            if covered >= bytes {
                break;
            }
            covered += size;
            out.push(id);
        }
        out
    }

    /// Bytes held by committed blocks.
    pub fn used_bytes(&self) -> u64 {
        self.used.load(Ordering::Acquire)
    }

    /// Number of committed blocks.
    pub fn len(&self) -> usize {
        self.map.read().len()
    }

    /// True when no block is indexed.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::block::test_id as id;

    #[test]
    fn touch_all_finds_the_present_blocks_and_makes_them_most_recent() {
        let idx = Index::default();
        for n in 0..4 {
            idx.insert(id(n), 10, None, 0);
        }
        let mut found = [false; 3];
        idx.touch_all(&[id(0), id(9), id(1)], &mut found);
        assert_eq!(found, [true, false, true]);
        assert_eq!(idx.coldest(15), vec![id(2), id(3)]);
    }

    #[test]
    fn touch_prefix_stops_at_the_first_absent_block() {
        let idx = Index::default();
        for n in 0..4 {
            idx.insert(id(n), 10, None, 0);
        }
        assert_eq!(idx.touch_prefix(&[id(0), id(1), id(9), id(2)]), 2);
        assert_eq!(idx.touch_prefix(&[]), 0);
        assert_eq!(idx.touch_prefix(&[id(9)]), 0);
        // The prefix became the most recent; the rest stays cold.
        assert_eq!(idx.coldest(15), vec![id(2), id(3)]);
    }

    #[test]
    fn lru_order_and_pins() {
        let idx = Arc::new(Index::default());
        for n in 0..4 {
            idx.insert(id(n), 10, None, 0);
        }
        assert_eq!(idx.used_bytes(), 40);
        assert!(idx.touch(&id(0))); // 0 becomes most recent
        assert_eq!(idx.coldest(15), vec![id(1), id(2)]);
        let pin = idx.pin(&id(1)).unwrap();
        assert_eq!(idx.coldest(15), vec![id(2), id(3)]);
        assert_eq!(idx.remove_if_unpinned(&id(1)), None);
        drop(pin);
        assert_eq!(idx.remove_if_unpinned(&id(1)), Some(10));
        assert_eq!(idx.used_bytes(), 30);
        assert!(!idx.contains(&id(1)));
        // re-insert of a present block doesn't double count
        idx.insert(id(2), 10, None, 7);
        assert_eq!(idx.used_bytes(), 30);
        assert_eq!(idx.known_mtime(&id(2)), Some(7));
    }
}
