//! The slot index inside the table: hash chains from (block, shard) to
//! slot, pins, the free list, allocation through the eviction policy, and
//! rebuilding all of it from the slot metadata.
//!
//! Every slot number read from the region (a bucket, a chain link, the
//! free list's head, a policy's victim) is checked against the slot count
//! and every walk is bounded by it, so damaged links cost a miss, never a
//! panic or a loop; the table's next check rebuilds them.

use super::{key_hash, seal, Allocated, Guard, SlotMeta, FILLING, FREE, MAX_PARTS, NONE, READY};
use crate::block::BlockId;
use crate::store::cache::policy::Policy;

impl Guard<'_> {
    fn policy(&mut self) -> Policy<'_> {
        Policy::new(self.geo.policy, self.policy_words, self.geo.n_slots)
    }

    fn bucket_of(&self, block: &BlockId, shard: u32) -> usize {
        (key_hash(block, shard) as usize) & (self.buckets.len() - 1)
    }

    /// The slot holding (block, shard), FILLING or READY.
    pub fn find(&self, block: &BlockId, shard: u32) -> Option<u32> {
        let mut cur = self.buckets[self.bucket_of(block, shard)];
        for _ in 0..self.meta.len() {
            let m = self.meta.get(cur as usize)?;
            if m.shard == shard && m.block == block.0 && m.state != FREE {
                return Some(cur);
            }
            cur = m.hnext;
        }
        None
    }

    /// A slot's metadata.
    pub fn meta(&self, slot: u32) -> &SlotMeta {
        &self.meta[slot as usize]
    }

    /// Slots in use.
    pub fn used(&self) -> u32 {
        self.shared.used
    }

    /// Pins a slot (it cannot be reused until unpinned).
    pub fn pin(&mut self, slot: u32) {
        let me = self.me as usize;
        let m = &mut self.meta[slot as usize];
        m.refs += 1;
        m.pins[me] = m.pins[me].saturating_add(1);
    }

    /// Drops one of our pins; a freed slot whose last pin goes returns to
    /// the free list.
    pub fn unpin(&mut self, slot: u32) {
        let me = self.me as usize;
        let m = &mut self.meta[slot as usize];
        if m.pins[me] > 0 {
            m.pins[me] -= 1;
            m.refs = m.refs.saturating_sub(1);
        }
        if m.refs == 0 && m.state == FREE {
            self.push_free(slot);
        }
    }

    /// Records a hit for the eviction policy.
    pub fn access(&mut self, slot: u32) {
        self.policy().access(slot);
    }

    fn push_free(&mut self, slot: u32) {
        self.meta[slot as usize].hnext = self.shared.free_head;
        self.shared.free_head = slot;
    }

    fn link(&mut self, slot: u32) {
        let m = self.meta[slot as usize];
        let b = self.bucket_of(&BlockId(m.block), m.shard);
        self.meta[slot as usize].hnext = self.buckets[b];
        self.buckets[b] = slot;
    }

    fn unlink(&mut self, slot: u32) {
        let m = self.meta[slot as usize];
        let b = self.bucket_of(&BlockId(m.block), m.shard);
        let mut prev = NONE;
        let mut cur = self.buckets[b];
        for _ in 0..self.meta.len() {
            let Some(next) = self.meta.get(cur as usize).map(|m| m.hnext) else {
                break;
            };
            if cur == slot {
                if prev == NONE {
                    self.buckets[b] = next;
                } else {
                    self.meta[prev as usize].hnext = next;
                }
                break;
            }
            prev = cur;
            cur = next;
        }
        self.meta[slot as usize].hnext = NONE;
    }

    /// Takes a slot for (block, shard): a free one, else the policy's
    /// victim among unpinned, clean, ready slots. Dirty slots the policy
    /// offers are reported to `on_dirty` (lazy write-back writes them so
    /// they can go next time). `None` when every slot is pinned or dirty.
    pub fn alloc(
        &mut self,
        block: &BlockId,
        shard: u32,
        on_dirty: &mut dyn FnMut(u32, &SlotMeta),
    ) -> Option<Allocated> {
        let mut evicted = false;
        let head = self.shared.free_head;
        let free_next = self
            .meta
            .get(head as usize)
            .filter(|m| m.state == FREE && m.refs == 0)
            .map(|m| m.hnext);
        if free_next.is_none() {
            // Empty, or damaged: evict instead; the next rebuild relinks it.
            self.shared.free_head = NONE;
        }
        let slot = if let Some(next) = free_next {
            self.shared.free_head = next;
            self.shared.used += 1;
            head
        } else {
            let meta: &[SlotMeta] = self.meta;
            let words = &mut *self.policy_words;
            let mut p = Policy::new(self.geo.policy, words, self.geo.n_slots);
            let victim = p.pick(&mut |s| {
                let Some(m) = meta.get(s as usize) else {
                    return false;
                };
                if m.refs == 0 && m.state == READY && m.dirty != 0 {
                    on_dirty(s, m);
                }
                m.refs == 0 && m.state == READY && m.dirty == 0
            })?;
            self.unlink(victim);
            evicted = true;
            victim
        };
        let me = self.me;
        let m = &mut self.meta[slot as usize];
        m.block = block.0;
        m.shard = shard;
        m.state = FILLING;
        m.dirty = 0;
        m.owner = me;
        m.gen = m.gen.wrapping_add(1);
        m.checksum = 0;
        m.seal = 0;
        m.refs = 0;
        m.pins = [0; MAX_PARTS];
        self.link(slot);
        self.pin(slot);
        let key = key_hash(block, shard);
        self.policy().insert(slot, key);
        Some(Allocated { slot, evicted })
    }

    /// The filler finished writing the slot's bytes, whose checksum is
    /// `checksum` (computed from where they came from, not from the slot).
    pub fn fill_done(&mut self, slot: u32, dirty: bool, checksum: u64) {
        let me = self.me;
        let m = &mut self.meta[slot as usize];
        m.state = READY;
        m.dirty = u32::from(dirty);
        m.owner = if dirty { me } else { NONE };
        m.checksum = checksum;
        m.seal = seal(&m.block, m.shard, checksum);
    }

    /// The checksum of the READY slot holding (block, shard) at `slot`;
    /// `None` when the slot holds something else now, or its metadata is
    /// damaged (see [`SlotMeta::sealed_checksum`]).
    pub fn checksum_of(&self, slot: u32, block: &BlockId, shard: u32) -> Option<u64> {
        let m = self.meta.get(slot as usize)?;
        if m.block != block.0 || m.shard != shard {
            return None;
        }
        m.sealed_checksum()
    }

    /// Takes the slot out of the index (a failed fill, or a clean entry the
    /// fill policy does not keep). Pins stay; the last unpin frees it.
    pub fn drop_entry(&mut self, slot: u32) {
        if self.meta[slot as usize].state == FREE {
            return;
        }
        self.unlink(slot);
        self.policy().remove(slot);
        let m = &mut self.meta[slot as usize];
        m.state = FREE;
        m.dirty = 0;
        m.owner = NONE;
        m.seal = 0;
        self.shared.used = self.shared.used.saturating_sub(1);
        if self.meta[slot as usize].refs == 0 {
            self.push_free(slot);
        }
    }

    /// The slot's bytes must reach the backend (again): a dump of a block
    /// the cache holds clean, which the backend may have dropped since.
    pub fn mark_dirty(&mut self, slot: u32) {
        let me = self.me;
        let m = &mut self.meta[slot as usize];
        m.dirty = 1;
        m.owner = me;
    }

    /// The slot's bytes reached the backend.
    pub fn mark_clean(&mut self, slot: u32) {
        let m = &mut self.meta[slot as usize];
        m.dirty = 0;
        m.owner = NONE;
    }

    /// Dirty slots that nobody alive owns: taken over by us.
    pub fn adopt_orphans(&mut self) -> Vec<(u32, BlockId, u32)> {
        let me = self.me;
        let mut out = Vec::new();
        for (i, m) in self.meta.iter_mut().enumerate() {
            if m.state == READY && m.dirty != 0 && m.owner == NONE {
                m.owner = me;
                out.push((i as u32, BlockId(m.block), m.shard));
            }
        }
        out
    }

    /// Rebuilds hash chains, free list, use count and policy order from the
    /// slot metadata.
    pub(super) fn rebuild(&mut self) {
        self.buckets.fill(NONE);
        self.policy().init();
        self.shared.free_head = NONE;
        self.shared.used = 0;
        for i in (0..self.meta.len()).rev() {
            let s = i as u32;
            if self.meta[i].state == FREE {
                if self.meta[i].refs == 0 {
                    self.push_free(s);
                }
            } else {
                self.link(s);
                let m = self.meta[i];
                let key = key_hash(&BlockId(m.block), m.shard);
                self.policy().insert(s, key);
                self.shared.used += 1;
            }
        }
    }
}
