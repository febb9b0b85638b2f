//! Presence: a short-lived cache of lookup results, so a prefix lookup of
//! thousands of ids per scheduler step does not turn into thousands of
//! round trips; ordered, bounded-concurrency probes; grouping shards by block.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use parking_lot::Mutex;

use crate::block::{BlockId, IdMap};

/// Presence results remembered for a short time. Positive and negative
/// results have their own lifetimes (0 disables either).
pub struct LookupCache {
    map: Mutex<IdMap<(bool, Instant)>>,
    positive_ttl: Duration,
    negative_ttl: Duration,
    max_entries: usize,
    hits: AtomicU64,
    misses: AtomicU64,
}

impl LookupCache {
    /// A cache keeping at most `max_entries` results.
    pub fn new(positive_ttl: Duration, negative_ttl: Duration, max_entries: usize) -> Self {
        LookupCache {
            map: Mutex::new(IdMap::default()),
            positive_ttl,
            negative_ttl,
            max_entries: max_entries.max(16),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }

    /// The cache of a remote tier: present results kept `positive_ms`,
    /// absent ones `negative_ms` (its `*_cache_ttl_ms` keys), up to 2^20 ids.
    pub fn from_ttl_ms(positive_ms: u64, negative_ms: u64) -> Self {
        LookupCache::new(
            Duration::from_millis(positive_ms),
            Duration::from_millis(negative_ms),
            1 << 20,
        )
    }

    /// The remembered result, if still fresh.
    pub fn get(&self, id: &BlockId) -> Option<bool> {
        let map = self.map.lock();
        let found = map.get(id).and_then(|(present, at)| {
            let ttl = if *present {
                self.positive_ttl
            } else {
                self.negative_ttl
            };
            (at.elapsed() < ttl).then_some(*present)
        });
        drop(map);
        if found.is_some() {
            self.hits.fetch_add(1, Ordering::Relaxed);
        } else {
            self.misses.fetch_add(1, Ordering::Relaxed);
        }
        found
    }

    /// Remembers a result.
    pub fn put(&self, id: BlockId, present: bool) {
        let ttl = if present {
            self.positive_ttl
        } else {
            self.negative_ttl
        };
        if ttl.is_zero() {
            self.forget(&id);
            return;
        }
        let mut map = self.map.lock();
        if map.len() >= self.max_entries {
            let (p, n) = (self.positive_ttl, self.negative_ttl);
            map.retain(|_, (present, at)| at.elapsed() < if *present { p } else { n });
            if map.len() >= self.max_entries {
                map.clear();
            }
        }
        map.insert(id, (present, Instant::now()));
    }

    /// Drops what is known about `id`.
    pub fn forget(&self, id: &BlockId) {
        self.map.lock().remove(id);
    }

    /// (answered from the cache, had to ask the server).
    pub fn counts(&self) -> (u64, u64) {
        (
            self.hits.load(Ordering::Relaxed),
            self.misses.load(Ordering::Relaxed),
        )
    }
}

/// Presence of every id, probing at most `concurrency` at a time, in order.
pub async fn probe_all<F, Fut>(ids: Vec<BlockId>, concurrency: usize, probe: F) -> Vec<bool>
where
    F: Fn(BlockId) -> Fut,
    Fut: Future<Output = bool>,
{
    futures::stream::iter(ids)
        .map(probe)
        .buffered(concurrency.max(1))
        .collect()
        .await
}

/// Index of the last id of the longest present prefix (-1: none), probing
/// ahead at most `concurrency` ids and stopping at the first miss.
pub async fn probe_prefix<F, Fut>(ids: Vec<BlockId>, concurrency: usize, probe: F) -> isize
where
    F: Fn(BlockId) -> Fut,
    Fut: Future<Output = bool>,
{
    let mut stream = futures::stream::iter(ids)
        .map(probe)
        .buffered(concurrency.max(1));
    let mut last = -1isize;
    while let Some(present) = stream.next().await {
        if !present {
            break;
        }
        last += 1;
    }
    last
}

/// Groups shards by block, keeping each block's first-seen order: stores
/// coalesce the shards of one block into fewer requests.
pub fn group_by_block<T>(items: Vec<T>, block: impl Fn(&T) -> BlockId) -> Vec<(BlockId, Vec<T>)> {
    let mut order: IdMap<usize> = IdMap::default();
    let mut groups: Vec<(BlockId, Vec<T>)> = Vec::new();
    for item in items {
        let id = block(&item);
        match order.get(&id) {
            Some(&i) => groups[i].1.push(item),
            None => {
                order.insert(id, groups.len());
                groups.push((id, vec![item]));
            }
        }
    }
    groups
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::remote::{run_blocking, Runtime};
    use std::sync::Arc;
    #[test]
    fn lookup_cache_ttls() {
        let c = LookupCache::new(Duration::from_secs(60), Duration::ZERO, 100);
        let (a, b) = (BlockId([1; 16]), BlockId([2; 16]));
        c.put(a, true);
        c.put(b, false); // negative ttl 0: not remembered
        assert_eq!(c.get(&a), Some(true));
        assert_eq!(c.get(&b), None);
        c.forget(&a);
        assert_eq!(c.get(&a), None);
        let c = LookupCache::new(Duration::from_millis(1), Duration::from_secs(60), 100);
        c.put(a, true);
        c.put(b, false);
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(c.get(&a), None);
        assert_eq!(c.get(&b), Some(false));
    }

    #[test]
    fn lookup_cache_is_bounded() {
        let c = LookupCache::new(Duration::from_secs(60), Duration::from_secs(60), 16);
        for i in 0..100u8 {
            c.put(BlockId([i; 16]), true);
        }
        assert!(c.map.lock().len() <= 16);
    }

    #[test]
    fn probes_are_ordered_and_prefix_stops() {
        let rt = Runtime::new("t", 1).unwrap();
        let ids: Vec<BlockId> = (0..10u8).map(|i| BlockId([i; 16])).collect();
        let asked = Arc::new(AtomicU64::new(0));
        let a = asked.clone();
        let present = run_blocking(&rt.handle(), async move {
            probe_all(ids.clone(), 3, |id| {
                let a = a.clone();
                async move {
                    a.fetch_add(1, Ordering::Relaxed);
                    id.0[0] % 2 == 0
                }
            })
            .await
        })
        .unwrap();
        assert_eq!(present.iter().filter(|p| **p).count(), 5);
        assert!(present[0] && !present[1]);
        assert_eq!(asked.load(Ordering::Relaxed), 10);
        let ids: Vec<BlockId> = (0..10u8).map(|i| BlockId([i; 16])).collect();
        let last = run_blocking(&rt.handle(), async move {
            probe_prefix(ids, 2, |id| async move { id.0[0] < 4 }).await
        })
        .unwrap();
        assert_eq!(last, 3);
        rt.shutdown(Duration::from_secs(1));
    }

    #[test]
    fn grouping_keeps_order() {
        let items = vec![(1u8, 0), (2, 0), (1, 1), (3, 0), (2, 1)];
        let g = group_by_block(items, |(b, _)| BlockId([*b; 16]));
        assert_eq!(g.len(), 3);
        assert_eq!(g[0].1, vec![(1, 0), (1, 1)]);
        assert_eq!(g[1].1, vec![(2, 0), (2, 1)]);
    }
}
