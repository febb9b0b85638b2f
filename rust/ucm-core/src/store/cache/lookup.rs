//! Lookups: answered from the cache first (a block is cached when all its
//! shards are ready), and by the backend only for the rest.

use super::stats::add;
use super::table::{Guard, READY};
use super::{Inner, LOCK_CHUNK};
use crate::block::BlockId;
use crate::error::Result;

impl Inner {
    /// Whether every shard of `id` is ready in the cache.
    pub(super) fn block_cached(&self, g: &Guard<'_>, id: &BlockId) -> bool {
        (0..self.shard_count as u32).all(|s| {
            g.find(id, s)
                .is_some_and(|slot| g.meta(slot).state == READY)
        })
    }

    pub(super) fn lookup(&self, ids: &[BlockId]) -> Result<Vec<bool>> {
        let inner = self;
        let mut out = Vec::with_capacity(ids.len());
        for chunk in ids.chunks(LOCK_CHUNK) {
            let g = inner.table.lock()?;
            out.extend(chunk.iter().map(|id| inner.block_cached(&g, id)));
        }
        let l1 = out.iter().filter(|h| **h).count();
        let misses: Vec<usize> = (0..ids.len()).filter(|&i| !out[i]).collect();
        let mut l2 = 0;
        if !misses.is_empty() {
            let q: Vec<BlockId> = misses.iter().map(|&i| ids[i]).collect();
            let r = inner.backend.lookup(&q)?;
            for (&i, hit) in misses.iter().zip(r) {
                out[i] = hit;
                l2 += usize::from(hit);
            }
        }
        add(&inner.c.lookups, ids.len() as u64);
        add(&inner.c.lookup_l1_hits, l1 as u64);
        add(&inner.c.lookup_l2_hits, l2 as u64);
        Ok(out)
    }

    pub(super) fn lookup_on_prefix(&self, ids: &[BlockId]) -> Result<isize> {
        let inner = self;
        let n = ids.len();
        let (mut i, mut l1, mut l2) = (0usize, 0u64, 0u64);
        let result = loop {
            {
                let g = inner.table.lock()?;
                while i < n && inner.block_cached(&g, &ids[i]) {
                    i += 1;
                    l1 += 1;
                }
            }
            if i == n {
                break n as isize - 1;
            }
            let r = inner.backend.lookup_on_prefix(&ids[i..])?;
            if r < 0 {
                break i as isize - 1;
            }
            i += r as usize + 1;
            l2 += r as u64 + 1;
            if i >= n {
                break n as isize - 1;
            }
        };
        add(&inner.c.lookups, (l1 + l2 + u64::from(i < n)).min(n as u64));
        add(&inner.c.lookup_l1_hits, l1);
        add(&inner.c.lookup_l2_hits, l2);
        Ok(result)
    }
}
