//! Where a slot's checksum comes from, and what happens to a slot whose
//! bytes no longer match it (see the table's module docs, "Integrity").
//!
//! * A dump computes it from the engine's memory while copying into the
//!   slot ([`super::transport`]).
//! * A fill from the backend takes the checksum the backend verified
//!   ([`SlotLoad`], through [`crate::store::format::carried`]); a backend
//!   that does not report one (a store written in Python) gets the slot
//!   hashed once its load is complete.
//! * A write-back checks the slot against it and carries it down
//!   ([`SlotWrite`]), so the backend stores it unchanged.
//! * A load out of a slot checks the bytes as it copies them.
//!
//! A slot that fails is dropped from the table, counted in
//! `corrupt_shards`, and its shard is a miss: the load reads the backend
//! instead, and a write-back skips it (its block then never reaches the
//! backend whole, so it stays a miss there too).

use super::stats::add;
use super::table::Release;
use super::Inner;
use crate::block::BlockId;
use crate::error::{Damage, Result, UcmError};
use crate::hashing::xxh3::xxh3_64;
use crate::store::format::carried::{carry, collect, Carried, Collected};
use crate::task::TaskId;

/// A backend load into slots in flight, with the checksum reports it is
/// collecting for them.
pub(super) struct SlotLoad {
    task: Result<TaskId>,
    reports: Vec<(u32, Collected)>,
}

/// A write of slots to the backend in flight. Its slots are pinned, so
/// none is reused while the backend reads it, and their checksums are
/// carried down until it is finished.
pub(super) struct SlotWrite {
    /// Shards handed to the backend: (block, shard, slot).
    pub(super) written: Vec<(BlockId, u32, u32)>,
    /// Shards left out, for good: their slot holds something else now, or
    /// failed its checksum.
    pub(super) skipped: Vec<(BlockId, u32)>,
    /// The backend's task; `None` when nothing was handed to it.
    task: Option<Result<TaskId>>,
    _carried: Vec<Carried>,
}

impl Inner {
    /// The xxh3-64 of a slot's shard bytes.
    pub(super) fn slot_checksum(&self, slot: u32) -> u64 {
        // SAFETY: the slot lies inside the mapping and holds shard_size
        // bytes; callers hold a pin (or own the FILLING slot), so it is
        // not reused meanwhile.
        xxh3_64(unsafe {
            std::slice::from_raw_parts(self.table.data(slot).cast_const(), self.cfg.shard_size)
        })
    }

    /// Starts loading `items` (block, shard index, slot) from the backend
    /// into their FILLING slots (`background`: through
    /// [`crate::store::Store::load_in_background`]).
    pub(super) fn start_slot_load(
        &self,
        items: &[(BlockId, usize, u32)],
        background: bool,
    ) -> SlotLoad {
        let reports = items
            .iter()
            .map(|&(_, _, slot)| (slot, collect(self.slot_seg(slot))))
            .collect();
        let shards = self.slot_shards(items.iter().copied());
        let task = if background {
            self.backend.load_in_background(shards)
        } else {
            self.backend.load(shards)
        };
        SlotLoad { task, reports }
    }

    /// Waits for a [`SlotLoad`]; on success, the checksum of each slot,
    /// in order: the one the backend verified, else the slot's own.
    pub(super) fn finish_slot_load(&self, load: SlotLoad) -> Result<Vec<u64>> {
        self.backend.wait(load.task?)?;
        Ok(load
            .reports
            .iter()
            .map(|(slot, report)| {
                report
                    .verified()
                    .unwrap_or_else(|| self.slot_checksum(*slot))
            })
            .collect())
    }

    /// Starts writing dirty slots (block, shard, slot) to the backend: each
    /// that still holds its shard is pinned, checked against its checksum
    /// and handed down with it; the others are skipped (and a failed one
    /// dropped).
    pub(super) fn start_slot_write(&self, items: &[(BlockId, u32, u32)]) -> SlotWrite {
        let mut held = Vec::with_capacity(items.len());
        let mut skipped = Vec::new();
        match self.table.lock() {
            Ok(mut g) => {
                for &(block, shard, slot) in items {
                    match g.checksum_of(slot, &block, shard) {
                        Some(sum) => {
                            g.pin(slot);
                            held.push(((block, shard, slot), sum));
                        }
                        None => skipped.push((block, shard)),
                    }
                }
            }
            Err(e) => {
                return SlotWrite {
                    written: Vec::new(),
                    skipped: Vec::new(),
                    task: Some(Err(e)),
                    _carried: Vec::new(),
                }
            }
        }
        let (good, bad): (Vec<_>, Vec<_>) = held
            .into_iter()
            .partition(|&((_, _, slot), sum)| self.slot_checksum(slot) == sum);
        let bad: Vec<(BlockId, u32, u32)> = bad.into_iter().map(|(item, _)| item).collect();
        if !bad.is_empty() {
            self.discard_corrupt(&bad, "before its write-back");
            self.unpin_all(bad.iter().map(|&(_, _, slot)| slot));
            skipped.extend(bad.iter().map(|&(block, shard, _)| (block, shard)));
        }
        let carried = good
            .iter()
            .map(|&((_, _, slot), sum)| carry(self.slot_seg(slot), sum))
            .collect();
        let written: Vec<(BlockId, u32, u32)> = good.into_iter().map(|(item, _)| item).collect();
        let task = (!written.is_empty()).then(|| {
            let shards = self.slot_shards(
                written
                    .iter()
                    .map(|&(block, shard, slot)| (block, shard as usize, slot)),
            );
            self.backend.dump(shards, 0)
        });
        SlotWrite {
            written,
            skipped,
            task,
            _carried: carried,
        }
    }

    /// Waits for a [`SlotWrite`] and unpins its slots; on success, cleans
    /// the slots that still hold what was written. Returns the backend's
    /// outcome and the shards that were skipped.
    pub(super) fn finish_slot_write(&self, w: SlotWrite) -> (Result<()>, Vec<(BlockId, u32)>) {
        let SlotWrite {
            written,
            skipped,
            task,
            _carried,
        } = w;
        let mut r = match task {
            Some(t) => t.and_then(|t| self.backend.wait(t)),
            None => Ok(()),
        };
        drop(_carried);
        if r.is_ok() && !written.is_empty() {
            r = self.after_written(&written);
        }
        self.unpin_all(written.iter().map(|&(_, _, slot)| slot));
        (r, skipped)
    }

    /// Drops slots whose bytes failed their checksum (`when`: at what
    /// point, for the log), counting them. Their pins stay with whoever
    /// holds them; the last unpin frees them.
    pub(super) fn discard_corrupt(&self, items: &[(BlockId, u32, u32)], when: &str) {
        if items.is_empty() {
            return;
        }
        add(&self.c.corrupt_shards, items.len() as u64);
        let drops = items
            .iter()
            .map(|&(block, shard, slot)| Release::Drop { slot, block, shard });
        self.table.release(drops.collect());
        let (block, shard, _) = items[0];
        log::warn!(
            "cache: {} shard(s) changed in the cache's memory since they were stored \
             (first: block {block} shard {shard}), found {when}; dropped from the cache, \
             each is a miss",
            items.len()
        );
    }
}

/// The error a load of a shard reports when its slot failed its checksum
/// and the backend could not serve it either.
pub(super) fn corrupt_slot(block: BlockId, shard: usize) -> UcmError {
    UcmError::corrupt(
        Damage::Checksum,
        Some(block),
        Some(shard),
        format!("block {block} shard {shard}: its bytes changed in the cache's memory"),
    )
}
