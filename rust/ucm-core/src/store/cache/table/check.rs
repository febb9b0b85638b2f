//! Checking a slot table found in a shared segment before trusting it.
//!
//! A shared segment is memory every process of its user can write, and a
//! kept one outlives the processes that wrote it: a bug, a stray writer or
//! a process that died mid-update can leave anything in it. So a process
//! joining one checks every slot's metadata against the geometry (state,
//! shard index, owner, pins) and a ready slot's seal; a slot that fails is
//! discarded (its bytes are never served), a key held twice keeps its first
//! slot, and everything derived from the slots (hash chains, free list,
//! policy order, use count) is rebuilt from those that pass. A slot's bytes
//! are checked on every load and write-back, against its checksum.

use std::collections::HashSet;

use super::{Guard, SlotMeta, FILLING, FREE, MAX_PARTS, NONE, READY};

/// What [`Guard::check_and_rebuild`] found wrong.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Findings {
    /// Slots whose metadata was invalid, now free.
    pub discarded: usize,
    /// Links of the index (buckets, chains, free list) or counters of the
    /// header were out of range.
    pub index_damaged: bool,
}

impl Findings {
    /// True when anything was wrong.
    pub fn any(&self) -> bool {
        self.discarded > 0 || self.index_damaged
    }
}

impl Guard<'_> {
    /// Checks every slot, frees those that fail, and rebuilds the index
    /// from the rest (see the module docs).
    pub(super) fn check_and_rebuild(&mut self) -> Findings {
        let n = self.meta.len();
        let in_range = |v: u32| v == NONE || (v as usize) < n;
        let index_damaged = !in_range(self.shared.free_head)
            || self.buckets.iter().any(|&b| !in_range(b))
            || self.meta.iter().any(|m| !in_range(m.hnext))
            || self.shared.used as usize > n
            || self.shared.unlinked > 1;
        if self.shared.unlinked > 1 {
            // Only ever 0 or 1: anything else is damage, and the segment
            // is in place (we opened it by name).
            self.shared.unlinked = 0;
        }
        let mut keys = HashSet::with_capacity(self.shared.used.min(n as u32) as usize);
        let mut discarded = 0;
        for i in 0..n {
            let m = self.meta[i];
            let valid = self.slot_valid(&m) && (m.state == FREE || keys.insert((m.block, m.shard)));
            if !valid {
                self.meta[i] = SlotMeta::empty();
                discarded += 1;
            }
        }
        self.rebuild();
        Findings {
            discarded,
            index_damaged,
        }
    }

    /// Whether a slot's metadata is one the table's code could have
    /// written: pins that add up, a known state, and for a held slot a
    /// shard of this geometry, an owner that is a participant (or none),
    /// and for a ready one, its seal.
    fn slot_valid(&self, m: &SlotMeta) -> bool {
        let pins: u32 = m.pins.iter().map(|&p| u32::from(p)).sum();
        let shard_ok = (m.shard as usize) < self.geo.shard_count;
        let owner_ok = m.owner == NONE || (m.owner as usize) < MAX_PARTS;
        m.refs == pins
            && match m.state {
                FREE => true,
                FILLING => shard_ok && owner_ok && m.owner != NONE && m.dirty == 0,
                READY => {
                    shard_ok
                        && owner_ok
                        && m.sealed_checksum().is_some()
                        && (m.dirty == 1 || (m.dirty == 0 && m.owner == NONE))
                }
                _ => false,
            }
    }
}
