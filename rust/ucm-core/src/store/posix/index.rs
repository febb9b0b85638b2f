//! The in-memory index of published blocks: presence, recency, pins.
//!
//! Lookups are answered from here (a hash probe, no `stat`): the table
//! (`super::table`) prefetches the slots of a batch, so 10,000 ids take
//! a fraction of a millisecond even when a million blocks are indexed.
//! Recency is a logical clock stamped on each entry (an atomic store under
//! the read lock, no list reshuffling), which is what the background
//! evictor sorts by. Blocks found on disk but not yet dated keep stamp 0,
//! the coldest; a scan dates them by mtime with stamps below
//! [`LIVE_START`], where live uses start. Every block has the layout's
//! file length, so sizes are not stored.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};

use super::table::{IdTable, Meta};
use crate::block::BlockId;

/// First stamp of uses since the store opened; stamps below it date blocks
/// found on disk (by their mtime order).
pub const LIVE_START: u32 = 1 << 31;
/// The clock is renumbered when it gets this close to wrapping around.
const RENUMBER_MARGIN: u32 = 1 << 24;

/// Folds a file's mtime (ns since the epoch) into the 32 bits an entry
/// keeps of it: enough to tell a write of this store's from another's.
pub fn fold_mtime(ns: u64) -> u32 {
    ((ns ^ (ns >> 32)) as u32).max(1)
}

/// Published blocks of one store.
pub struct Index {
    map: RwLock<IdTable>,
    clock: AtomicU32,
    /// Bytes of one block file.
    block_len: u64,
    /// Loads in progress, per block: their blocks are not evicted.
    pins: Mutex<HashMap<BlockId, u32>>,
}

impl Default for Index {
    fn default() -> Self {
        Self::new(1)
    }
}

/// Keeps a block from being evicted while a load reads it.
pub struct Pin {
    index: Arc<Index>,
    block: BlockId,
}

impl Drop for Pin {
    fn drop(&mut self) {
        let mut pins = self.index.pins.lock();
        if let Some(n) = pins.get_mut(&self.block) {
            *n -= 1;
            if *n == 0 {
                pins.remove(&self.block);
            }
        }
    }
}

impl Index {
    /// An empty index of blocks of `block_len` bytes each.
    pub fn new(block_len: u64) -> Self {
        Index {
            map: RwLock::new(IdTable::default()),
            clock: AtomicU32::new(LIVE_START),
            block_len,
            pins: Mutex::new(HashMap::new()),
        }
    }

    /// The next stamp. Never called under the table's lock: it may take
    /// it to renumber.
    fn tick(&self) -> u32 {
        loop {
            let t = self.clock.fetch_add(1, Ordering::Relaxed) + 1;
            if t < u32::MAX - RENUMBER_MARGIN {
                return t;
            }
            self.renumber();
        }
    }

    /// Renumbers every live stamp in recency order from [`LIVE_START`]
    /// before the clock wraps around (after some two billion uses).
    fn renumber(&self) {
        let map = self.map.write();
        if self.clock.load(Ordering::Relaxed) < u32::MAX - RENUMBER_MARGIN {
            return; // done by another thread meanwhile
        }
        let mut live: Vec<(u32, &Meta)> = map
            .iter()
            .map(|(_, m)| (m.last_use.load(Ordering::Relaxed), m))
            .filter(|(t, _)| *t >= LIVE_START)
            .collect();
        live.sort_unstable_by_key(|(t, _)| *t);
        for (n, (_, m)) in live.iter().enumerate() {
            m.last_use.store(LIVE_START + n as u32, Ordering::Relaxed);
        }
        self.clock
            .store(LIVE_START + live.len() as u32, Ordering::Relaxed);
    }

    /// True if present; refreshes the block's recency.
    pub fn touch(&self, block: &BlockId) -> bool {
        let stamp = self.tick();
        match self.map.read().get(block) {
            Some(e) => {
                e.last_use.store(stamp, Ordering::Relaxed);
                true
            }
            None => false,
        }
    }

    /// [`Index::touch`] of many blocks under one lock and one recency
    /// stamp: sets `found[i]` for each present `blocks[i]`.
    pub fn touch_all(&self, blocks: &[BlockId], found: &mut [bool]) {
        let stamp = self.tick();
        self.map.read().get_many(blocks, |i, e| {
            e.last_use.store(stamp, Ordering::Relaxed);
            found[i] = true;
        });
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
        self.map.read().get(block).is_some()
    }

    /// Adds (or refreshes) a published block as the most recent. `own_mtime`
    /// is the file's mtime when this store just wrote it (None: found, not
    /// written here; an entry keeps what it knew).
    pub fn insert(&self, block: BlockId, own_mtime: Option<u64>) {
        let stamp = self.tick();
        let mut map = self.map.write();
        let (e, _) = map.insert(&block);
        e.last_use.store(stamp, Ordering::Relaxed);
        if let Some(m) = own_mtime {
            e.own_mtime.store(fold_mtime(m), Ordering::Relaxed);
        }
    }

    /// Adds a block another process just published, as the most recent,
    /// unless it is indexed already (then nothing changes).
    pub fn note_published(&self, block: BlockId) {
        if self.contains(&block) {
            return;
        }
        let stamp = self.tick();
        let mut map = self.map.write();
        let (e, added) = map.insert(&block);
        if added {
            e.last_use.store(stamp, Ordering::Relaxed);
        }
    }

    /// Adds blocks found on disk, undated (the coldest), unless indexed
    /// already; returns how many were added.
    pub fn insert_found(&self, blocks: &[BlockId]) -> usize {
        let mut map = self.map.write();
        blocks.iter().filter(|b| map.insert(b).1).count()
    }

    /// Dates blocks found on disk that nobody used since the store opened,
    /// in the order given (oldest first), below [`LIVE_START`].
    pub fn date_found(&self, oldest_first: &[BlockId]) {
        let map = self.map.read();
        for (n, block) in oldest_first.iter().enumerate() {
            if let Some(e) = map.get(block) {
                let stamp = (n as u32 + 1).min(LIVE_START - 1);
                let _ = e
                    .last_use
                    .compare_exchange(0, stamp, Ordering::Relaxed, Ordering::Relaxed);
            }
        }
    }

    /// The fold of the file mtime this store knew when it last wrote
    /// `block` (0: it never did); None when the block is not indexed.
    pub fn own_mtime(&self, block: &BlockId) -> Option<u32> {
        self.map
            .read()
            .get(block)
            .map(|e| e.own_mtime.load(Ordering::Relaxed))
    }

    /// Pins a present block (refreshing recency); None if absent.
    pub fn pin(self: &Arc<Self>, block: &BlockId) -> Option<Pin> {
        if !self.touch(block) {
            return None;
        }
        *self.pins.lock().entry(*block).or_default() += 1;
        Some(Pin {
            index: self.clone(),
            block: *block,
        })
    }

    /// Removes a block unconditionally (it turned out corrupt or missing);
    /// true when it was indexed.
    pub fn remove(&self, block: &BlockId) -> bool {
        self.map.write().remove(block)
    }

    /// Removes a block unless a load holds a pin on it; true when removed.
    pub fn remove_if_unpinned(&self, block: &BlockId) -> bool {
        let pins = self.pins.lock();
        if pins.contains_key(block) {
            return false;
        }
        let removed = self.map.write().remove(block);
        drop(pins);
        removed
    }

    /// Keeps only the blocks for which `keep` holds (pinned ones stay).
    pub fn retain(&self, mut keep: impl FnMut(&BlockId) -> bool) {
        let pins = self.pins.lock();
        self.map.write().retain(|b| pins.contains_key(b) || keep(b));
    }

    /// Unpinned blocks, least recently used first, until `bytes` are
    /// covered. Selects rather than sorts the whole index: the cost stays
    /// linear in the index's size and small in what is evicted.
    pub fn coldest(&self, bytes: u64) -> Vec<BlockId> {
        let want = bytes.div_ceil(self.block_len.max(1)) as usize;
        if want == 0 {
            return Vec::new();
        }
        let pins = self.pins.lock().clone();
        let map = self.map.read();
        let mut all: Vec<(u32, BlockId)> = map
            .iter()
            .filter(|(id, _)| !pins.contains_key(id))
            .map(|(id, e)| (e.last_use.load(Ordering::Relaxed), id))
            .collect();
        drop(map);
        if all.len() > want {
            all.select_nth_unstable_by_key(want - 1, |(t, _)| *t);
            all.truncate(want);
        }
        all.sort_unstable_by_key(|(t, _)| *t);
        all.into_iter().map(|(_, id)| id).collect()
    }

    /// Every indexed block.
    pub fn ids(&self) -> Vec<BlockId> {
        self.map.read().iter().map(|(id, _)| id).collect()
    }

    /// Bytes held by the indexed blocks.
    pub fn used_bytes(&self) -> u64 {
        self.len() as u64 * self.block_len
    }

    /// Bytes the index itself takes in memory.
    pub fn memory_bytes(&self) -> usize {
        self.map.read().bytes()
    }

    /// Number of indexed blocks.
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

    fn index() -> Index {
        let idx = Index::new(10);
        for n in 0..4 {
            idx.insert(id(n), None);
        }
        idx
    }

    #[test]
    fn touch_all_finds_the_present_blocks_and_makes_them_most_recent() {
        let idx = index();
        let mut found = [false; 3];
        idx.touch_all(&[id(0), id(9), id(1)], &mut found);
        assert_eq!(found, [true, false, true]);
        assert_eq!(idx.coldest(15), vec![id(2), id(3)]);
    }

    #[test]
    fn touch_prefix_stops_at_the_first_absent_block() {
        let idx = index();
        assert_eq!(idx.touch_prefix(&[id(0), id(1), id(9), id(2)]), 2);
        assert_eq!(idx.touch_prefix(&[]), 0);
        assert_eq!(idx.touch_prefix(&[id(9)]), 0);
        // The prefix became the most recent; the rest stays cold.
        assert_eq!(idx.coldest(15), vec![id(2), id(3)]);
    }

    #[test]
    fn lru_order_and_pins() {
        let idx = Arc::new(index());
        assert_eq!(idx.used_bytes(), 40);
        assert!(idx.touch(&id(0))); // 0 becomes most recent
        assert_eq!(idx.coldest(15), vec![id(1), id(2)]);
        let pin = idx.pin(&id(1)).unwrap();
        assert_eq!(idx.coldest(15), vec![id(2), id(3)]);
        assert!(!idx.remove_if_unpinned(&id(1)));
        drop(pin);
        assert!(idx.remove_if_unpinned(&id(1)));
        assert_eq!(idx.used_bytes(), 30);
        assert!(!idx.contains(&id(1)));
        // re-insert of a present block doesn't double count
        idx.insert(id(2), Some(7));
        assert_eq!(idx.used_bytes(), 30);
        assert_eq!(idx.own_mtime(&id(2)), Some(fold_mtime(7)));
        idx.insert(id(2), None);
        assert_eq!(
            idx.own_mtime(&id(2)),
            Some(fold_mtime(7)),
            "a lookup keeps what it knew"
        );
        assert_eq!(idx.insert_found(&[id(2), id(9)]), 1);
        assert_eq!(idx.own_mtime(&id(9)), Some(0));
    }

    /// Blocks found on disk are the coldest until dated, then ordered by
    /// the dates given, and stay colder than anything used since.
    #[test]
    fn found_blocks_are_dated_below_live_uses() {
        let idx = Index::new(1);
        idx.insert(id(1), None);
        idx.insert_found(&[id(2), id(3), id(4)]);
        assert_eq!(idx.coldest(3).len(), 3);
        assert!(!idx.coldest(3).contains(&id(1)));
        idx.date_found(&[id(4), id(2), id(1), id(3)]);
        assert_eq!(idx.coldest(4), vec![id(4), id(2), id(3), id(1)]);
    }

    #[test]
    fn the_clock_is_renumbered_before_it_wraps() {
        let idx = index();
        idx.touch(&id(2));
        idx.clock
            .store(u32::MAX - RENUMBER_MARGIN - 1, Ordering::Relaxed);
        idx.touch(&id(0));
        idx.touch(&id(1));
        assert!(idx.clock.load(Ordering::Relaxed) < LIVE_START + 10);
        assert_eq!(idx.coldest(40), vec![id(3), id(2), id(0), id(1)]);
    }
}
