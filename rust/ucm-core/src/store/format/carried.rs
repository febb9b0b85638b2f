//! Shard checksums that travel between tiers with the memory they describe.
//!
//! A tier that keeps shards in its own memory (the Cache tier's slots) knows
//! each one's checksum: it computed it when the engine dumped the shard,
//! from the engine's memory, or took it from the tier below that verified
//! it. Computing it again from that memory when the shard moves down would
//! give any byte changed there since (a bug, a stray writer of a shared
//! segment) a fresh, valid checksum, and the corruption would become
//! permanent. So the tier registers the checksum against the slot's
//! address for as long as a lower tier writes from it ([`carry`]), and the
//! block format's writers take the registered value ([`dump_checksum`])
//! instead of hashing the memory: a byte changed there fails verification
//! on every later load.
//!
//! The other way, a tier filling a slot from below asks to be told the
//! checksum the lower tier verified ([`collect`]); the format's readers
//! report it ([`report_verified`]) once a shard's bytes matched its header,
//! so the slot is sealed with the stored value rather than one recomputed
//! from the slot.
//!
//! Ranges are keyed by start address and length: a slot is one segment.
//! Both tables are empty unless a cache sits above a store; a store then
//! looks once per shard (a lock and a tree lookup, next to moving the
//! shard's bytes).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::Mutex;

use crate::block::MemSeg;

use super::layout::checksum_segs;

/// Registered ranges of one direction: start address -> (length, checksum
/// known or reported so far), with a count read without the lock so that
/// stores with no cache above pay nothing.
struct Table {
    entries: Mutex<BTreeMap<usize, (usize, Option<u64>)>>,
    count: AtomicUsize,
}

impl Table {
    const fn new() -> Self {
        Table {
            entries: parking_lot::const_mutex(BTreeMap::new()),
            count: AtomicUsize::new(0),
        }
    }

    fn insert(&self, seg: MemSeg, sum: Option<u64>) {
        let mut e = self.entries.lock();
        if e.insert(seg.addr, (seg.len, sum)).is_none() {
            self.count.fetch_add(1, Ordering::AcqRel);
        }
    }

    fn remove(&self, addr: usize) {
        let mut e = self.entries.lock();
        if e.remove(&addr).is_some() {
            self.count.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// The entry for exactly `segs` (one segment, same start and length).
    fn get(&self, segs: &[MemSeg]) -> Option<Option<u64>> {
        let [one] = segs else { return None };
        if self.count.load(Ordering::Acquire) == 0 {
            return None;
        }
        let e = self.entries.lock();
        e.get(&one.addr)
            .filter(|(len, _)| *len == one.len)
            .map(|(_, sum)| *sum)
    }

    fn set(&self, segs: &[MemSeg], sum: u64) {
        let [one] = segs else { return };
        if self.count.load(Ordering::Acquire) == 0 {
            return;
        }
        let mut e = self.entries.lock();
        if let Some(entry) = e.get_mut(&one.addr).filter(|(len, _)| *len == one.len) {
            entry.1 = Some(sum);
        }
    }
}

static CARRIED: Table = Table::new();
static COLLECTED: Table = Table::new();

/// A checksum registered for a range while a lower tier writes from it;
/// unregistered on drop.
#[must_use = "the checksum is carried only while this value lives"]
pub struct Carried {
    addr: usize,
}

impl Drop for Carried {
    fn drop(&mut self) {
        CARRIED.remove(self.addr);
    }
}

/// Registers `checksum` as the one of the shard bytes in `seg` until the
/// returned value is dropped: keep it until the lower tier's write of
/// `seg` is complete.
pub fn carry(seg: MemSeg, checksum: u64) -> Carried {
    CARRIED.insert(seg, Some(checksum));
    Carried { addr: seg.addr }
}

/// The checksum a tier above carries for the shard in `segs`, if any.
pub fn carried(segs: &[MemSeg]) -> Option<u64> {
    CARRIED.get(segs).flatten()
}

/// The checksum to store for a shard written from `segs`: the one carried
/// for that memory, or else the checksum of the bytes there.
///
/// # Safety
/// As [`checksum_segs`]: every segment is valid for reads of its length.
pub unsafe fn dump_checksum(segs: &[MemSeg]) -> u64 {
    // SAFETY: forwarded caller contract.
    carried(segs).unwrap_or_else(|| unsafe { checksum_segs(segs) })
}

/// A range whose loader reports the checksum it verified; unregistered on
/// drop.
#[must_use = "the report is collected only while this value lives"]
pub struct Collected {
    addr: usize,
    len: usize,
}

impl Collected {
    /// The checksum a lower tier verified for the bytes it loaded into the
    /// range, if it reported one.
    pub fn verified(&self) -> Option<u64> {
        COLLECTED
            .get(&[MemSeg {
                addr: self.addr,
                len: self.len,
            }])
            .flatten()
    }
}

impl Drop for Collected {
    fn drop(&mut self) {
        COLLECTED.remove(self.addr);
    }
}

/// Asks the store that loads into `seg` to report the checksum it verified
/// there, until the returned value is dropped.
pub fn collect(seg: MemSeg) -> Collected {
    COLLECTED.insert(seg, None);
    Collected {
        addr: seg.addr,
        len: seg.len,
    }
}

/// Called by a store once the shard it loaded into `segs` matched
/// `checksum` (its stored header's): tells a tier above that asked.
pub fn report_verified(segs: &[MemSeg], checksum: u64) {
    COLLECTED.set(segs, checksum);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hashing::xxh3::xxh3_64;

    #[test]
    fn a_carried_checksum_replaces_the_memory_s_own_while_registered() {
        let bytes = vec![7u8; 4096];
        let seg = MemSeg::of(&bytes);
        // SAFETY: `bytes` is live for the whole test.
        assert_eq!(unsafe { dump_checksum(&[seg]) }, xxh3_64(&bytes));
        {
            let _c = carry(seg, 42);
            // SAFETY: as above.
            assert_eq!(unsafe { dump_checksum(&[seg]) }, 42);
            // Only the exact range: a shorter one, or two segments, hash.
            let half = MemSeg { len: 2048, ..seg };
            assert_eq!(carried(&[half]), None);
            assert_eq!(carried(&[seg, seg]), None);
        }
        assert_eq!(carried(&[seg]), None, "unregistered on drop");
    }

    #[test]
    fn a_verified_checksum_reaches_only_a_registered_collector() {
        let mut bytes = vec![1u8; 4096];
        let seg = MemSeg::of_mut(&mut bytes);
        report_verified(&[seg], 5); // nobody asked: ignored
        let c = collect(seg);
        assert_eq!(c.verified(), None);
        report_verified(&[seg], 9);
        assert_eq!(c.verified(), Some(9));
        drop(c);
        let again = collect(seg);
        assert_eq!(again.verified(), None, "a new collection starts empty");
    }
}
