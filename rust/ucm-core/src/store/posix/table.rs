//! A compact hash table of block ids for the Posix store's index: 24 bytes
//! a block, open addressing with linear probing at a load of at most 4/5,
//! and lookups of many ids at once that prefetch their slots.
//!
//! Why not a general-purpose map: at a million blocks the table is far
//! larger than the CPU's caches, so each lookup is a miss to memory
//! (~100 ns); a lookup of 10,000 ids one by one costs a millisecond. Asking
//! for the slots of the next ids while the current one is compared keeps
//! several misses in flight, which a map's API does not allow. And a slot
//! holds just what the index needs (the id, its recency and the mtime this
//! store wrote it with), no size or pin count, which stay constant or live
//! aside: 24 bytes against the 48 to 56 of an entry in a general map, so a
//! million blocks fit in 50 MiB.
//!
//! An all-zero id marks an empty slot; the all-zero id itself (possible in
//! a directory anyone can write to) is kept aside.

use std::sync::atomic::{AtomicU32, Ordering};

use super::table_memory::{Zeroable, ZeroedSlice};
use crate::block::BlockId;

/// Largest share of slots in use before the table grows: 4/5.
const MAX_LOAD_NUM: usize = 4;
const MAX_LOAD_DEN: usize = 5;
/// Ids looked up ahead of the one being compared in a batch.
const PREFETCH_AHEAD: usize = 16;

/// What the index keeps of one block.
#[repr(C)]
#[derive(Debug, Default)]
pub struct Meta {
    /// When it was last used (see the index's clock); 0: never, since
    /// the store opened (found by a listing).
    pub last_use: AtomicU32,
    /// A fold of the file's mtime when this store last wrote it, 0 if it
    /// never did.
    pub own_mtime: AtomicU32,
}

#[repr(C)]
#[derive(Default)]
struct Slot {
    id: [u8; 16],
    meta: Meta,
}

// SAFETY: an array of bytes and two atomic integers; all zero is an empty
// slot.
unsafe impl Zeroable for Slot {}

/// Block ids with their [`Meta`]. Not synchronised: the index wraps it in a
/// lock (a [`Meta`]'s fields are atomics, so readers may update them).
pub struct IdTable {
    slots: ZeroedSlice<Slot>,
    mask: usize,
    len: usize,
    /// The all-zero id's entry, kept aside.
    zero: Option<Box<Slot>>,
    /// Mixes ids into slot numbers, so ids planted to collide can't pile up
    /// in one run of slots.
    seed: u64,
}

impl std::fmt::Debug for IdTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdTable")
            .field("len", &self.len)
            .field("slots", &self.slots.len())
            .finish()
    }
}

fn empty_slots(n: usize) -> ZeroedSlice<Slot> {
    ZeroedSlice::new(n)
}

impl Default for IdTable {
    fn default() -> Self {
        Self::with_slots(16)
    }
}

impl IdTable {
    fn with_slots(n: usize) -> Self {
        let n = n.next_power_of_two().max(16);
        IdTable {
            slots: empty_slots(n),
            mask: n - 1,
            len: 0,
            zero: None,
            seed: crate::store::posix::files::random_token()
                .bytes()
                .fold(0x9e37_79b9_7f4a_7c15u64, |h, b| {
                    (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
                }),
        }
    }

    /// Number of ids held.
    pub fn len(&self) -> usize {
        self.len + usize::from(self.zero.is_some())
    }

    /// Bytes the table takes.
    pub fn bytes(&self) -> usize {
        self.slots.len() * std::mem::size_of::<Slot>() + std::mem::size_of::<Self>()
    }

    fn home(&self, id: &[u8; 16]) -> usize {
        let lo = u64::from_le_bytes(id[..8].try_into().unwrap_or_default());
        let hi = u64::from_le_bytes(id[8..].try_into().unwrap_or_default());
        let x = (lo ^ self.seed).wrapping_mul(0xff51_afd7_ed55_8ccd)
            ^ (hi ^ self.seed.rotate_left(32)).wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        ((x ^ (x >> 29)) as usize) & self.mask
    }

    fn find(&self, id: &[u8; 16]) -> Option<usize> {
        let mut i = self.home(id);
        loop {
            let s = &self.slots[i];
            if s.id == *id {
                return Some(i);
            }
            if s.id == [0; 16] {
                return None;
            }
            i = (i + 1) & self.mask;
        }
    }

    /// The id's entry.
    pub fn get(&self, id: &BlockId) -> Option<&Meta> {
        if id.0 == [0; 16] {
            return self.zero.as_ref().map(|s| &s.meta);
        }
        self.find(&id.0).map(|i| &self.slots[i].meta)
    }

    /// Calls `found(i, meta)` for each `ids[i]` present, looking up the
    /// slots of the ids ahead while comparing the current one.
    pub fn get_many(&self, ids: &[BlockId], mut found: impl FnMut(usize, &Meta)) {
        for id in ids.iter().take(PREFETCH_AHEAD) {
            self.prefetch(id);
        }
        for (i, id) in ids.iter().enumerate() {
            if let Some(next) = ids.get(i + PREFETCH_AHEAD) {
                self.prefetch(next);
            }
            if let Some(m) = self.get(id) {
                found(i, m);
            }
        }
    }

    fn prefetch(&self, id: &BlockId) {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            let p = &self.slots[self.home(&id.0)] as *const Slot as *const i8;
            // A slot (24 bytes) straddles two cache lines one time in three:
            // ask for the line of its last byte too.
            let last = p.wrapping_add(std::mem::size_of::<Slot>() - 1);
            // SAFETY: a prefetch is a hint that never faults, and both
            // pointers point into the table's own memory.
            unsafe {
                _mm_prefetch(p, _MM_HINT_T0);
                _mm_prefetch(last, _MM_HINT_T0);
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = id;
    }

    /// Adds the id (or finds it): its entry, and true when it was added.
    pub fn insert(&mut self, id: &BlockId) -> (&Meta, bool) {
        if id.0 == [0; 16] {
            let added = self.zero.is_none();
            let slot = self.zero.get_or_insert_with(Default::default);
            return (&slot.meta, added);
        }
        if let Some(i) = self.find(&id.0) {
            return (&self.slots[i].meta, false);
        }
        if (self.len + 1) * MAX_LOAD_DEN > self.slots.len() * MAX_LOAD_NUM {
            self.grow();
        }
        let mut i = self.home(&id.0);
        while self.slots[i].id != [0; 16] {
            i = (i + 1) & self.mask;
        }
        self.slots[i].id = id.0;
        self.len += 1;
        (&self.slots[i].meta, true)
    }

    fn grow(&mut self) {
        let bigger = empty_slots(self.slots.len() * 2);
        let old = std::mem::replace(&mut self.slots, bigger);
        self.mask = self.slots.len() - 1;
        for s in old.iter().filter(|s| s.id != [0; 16]) {
            let mut i = self.home(&s.id);
            while self.slots[i].id != [0; 16] {
                i = (i + 1) & self.mask;
            }
            let slot = &mut self.slots[i];
            slot.id = s.id;
            slot.meta = Meta {
                last_use: AtomicU32::new(s.meta.last_use.load(Ordering::Relaxed)),
                own_mtime: AtomicU32::new(s.meta.own_mtime.load(Ordering::Relaxed)),
            };
        }
    }

    /// Removes the id; true when it was there. Later entries of its run
    /// move back into the hole (no tombstones: lookups stay short).
    pub fn remove(&mut self, id: &BlockId) -> bool {
        if id.0 == [0; 16] {
            return self.zero.take().is_some();
        }
        let Some(mut hole) = self.find(&id.0) else {
            return false;
        };
        let mut i = hole;
        loop {
            i = (i + 1) & self.mask;
            if self.slots[i].id == [0; 16] {
                break;
            }
            let home = self.home(&self.slots[i].id);
            // Move back unless its home lies cyclically in (hole, i].
            let stays = if hole <= i {
                hole < home && home <= i
            } else {
                hole < home || home <= i
            };
            if !stays {
                self.slots.swap(hole, i);
                hole = i;
            }
        }
        self.slots[hole] = Slot::default();
        self.len -= 1;
        true
    }

    /// Every id with its entry.
    pub fn iter(&self) -> impl Iterator<Item = (BlockId, &Meta)> {
        self.slots
            .iter()
            .filter(|s| s.id != [0; 16])
            .chain(self.zero.as_deref())
            .map(|s| (BlockId(s.id), &s.meta))
    }

    /// Keeps only the ids for which `keep` holds.
    pub fn retain(&mut self, mut keep: impl FnMut(&BlockId) -> bool) {
        let gone: Vec<BlockId> = self
            .iter()
            .map(|(id, _)| id)
            .filter(|id| !keep(id))
            .collect();
        for id in gone {
            self.remove(&id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: u32) -> BlockId {
        let mut b = [0u8; 16];
        b[..4].copy_from_slice(&n.to_le_bytes());
        b[15] = 1;
        BlockId(b)
    }

    #[test]
    fn inserts_finds_removes_and_grows() {
        let mut t = IdTable::default();
        for n in 0..10_000 {
            let (m, added) = t.insert(&id(n));
            assert!(added);
            m.last_use.store(n, Ordering::Relaxed);
        }
        assert!(!t.insert(&id(7)).1);
        assert_eq!(t.len(), 10_000);
        for n in (0..10_000).step_by(3) {
            assert!(t.remove(&id(n)), "{n}");
        }
        assert!(!t.remove(&id(0)));
        for n in 0..10_000 {
            let m = t.get(&id(n));
            assert_eq!(m.is_some(), n % 3 != 0, "{n}");
            if let Some(m) = m {
                assert_eq!(m.last_use.load(Ordering::Relaxed), n);
            }
        }
        let ids: Vec<_> = (0..100).map(id).collect();
        let mut seen = Vec::new();
        t.get_many(&ids, |i, _| seen.push(i));
        assert_eq!(seen, (0..100).filter(|n| n % 3 != 0).collect::<Vec<_>>());
        // The all-zero id is kept aside.
        let zero = BlockId([0; 16]);
        assert!(t.get(&zero).is_none());
        assert!(t.insert(&zero).1);
        assert!(t.get(&zero).is_some());
        assert_eq!(t.iter().count(), t.len());
        t.retain(|i| *i != zero && i.0[0] % 2 == 0);
        assert!(t.iter().all(|(i, _)| i.0[0] % 2 == 0));
        assert!(t.get(&zero).is_none());
    }

    /// Removing from the middle of long runs (wrapping around the end of
    /// the table too) never loses an id: checked against a reference set.
    #[test]
    fn removals_keep_every_other_id_reachable() {
        let mut t = IdTable::with_slots(64);
        let mut reference = std::collections::HashSet::new();
        let mut x = 12345u64;
        for step in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let n = (x % 60) as u32;
            if step % 3 == 0 {
                assert_eq!(t.remove(&id(n)), reference.remove(&n));
            } else {
                assert_eq!(t.insert(&id(n)).1, reference.insert(n));
            }
            if step % 97 == 0 {
                for m in 0..60 {
                    assert_eq!(t.get(&id(m)).is_some(), reference.contains(&m));
                }
            }
        }
    }

    #[test]
    fn a_slot_takes_24_bytes() {
        assert_eq!(std::mem::size_of::<Slot>(), 24);
    }
}
