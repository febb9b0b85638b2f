//! Prefetch: blocks about to be loaded are filled into the cache from the
//! backend in the background (under `reuse_allocate` over a local backend,
//! the hint goes to the backend instead).

use super::stats::add;
use super::{FillPolicy, Inner};
use crate::block::BlockId;

impl Inner {
    pub(super) fn prefetch(&self, ids: Vec<BlockId>) {
        let missing: Vec<BlockId> = match self.table.lock() {
            Ok(g) => ids
                .into_iter()
                .filter(|id| !self.block_cached(&g, id))
                .collect(),
            Err(_) => return,
        };
        if missing.is_empty() {
            return;
        }
        if self.cfg.fill_policy == FillPolicy::ReuseAllocate && self.backend.reads_are_local() {
            // Filling slots here is the second read and first touch of slot
            // memory that reuse_allocate keeps away from a block's first
            // load (the load reads straight into the caller); the backend's
            // own hint (read-ahead into the page cache, for files) readies
            // that read instead.
            if let Err(e) = self.backend.prefetch(&missing) {
                log::debug!("prefetch: backend hint failed: {e}");
            }
            return;
        }
        let present = match self.backend.lookup(&missing) {
            Ok(p) => p,
            Err(e) => {
                log::debug!("prefetch: backend lookup failed: {e}");
                return;
            }
        };
        let mut fills = Vec::new();
        let mut wanted = Vec::new();
        if let Ok(mut g) = self.table.lock() {
            'blocks: for (id, here) in missing.iter().zip(present) {
                if !here {
                    continue;
                }
                for shard in 0..self.shard_count as u32 {
                    if g.find(id, shard).is_some() {
                        continue;
                    }
                    match g.alloc(id, shard, &mut |_, m| wanted.push(BlockId(m.block))) {
                        Some(a) => {
                            add(&self.c.evictions, u64::from(a.evicted));
                            fills.push((*id, shard, a.slot));
                        }
                        None => break 'blocks,
                    }
                }
            }
        }
        self.lazy_want(wanted);
        if fills.is_empty() {
            return;
        }
        let items: Vec<_> = fills
            .iter()
            .map(|&(b, shard, slot)| (b, shard as usize, slot))
            .collect();
        let res = self.finish_slot_load(self.start_slot_load(&items, false));
        let slots: Vec<u32> = fills.iter().map(|&(_, _, slot)| slot).collect();
        self.end_fills(&slots, res.as_deref().ok());
        match res {
            Ok(_) => {
                add(&self.c.prefetch_shards, fills.len() as u64);
                add(
                    &self.c.bytes_loaded_l2,
                    (fills.len() * self.cfg.shard_size) as u64,
                );
            }
            Err(e) => log::debug!("prefetch of {} shard(s) failed: {e}", fills.len()),
        }
    }
}
