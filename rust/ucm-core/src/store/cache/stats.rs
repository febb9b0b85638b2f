//! Counters of the cache tier, a lock-free load-latency histogram, and the
//! statistics reported from them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::store::StoreStats;

/// Sub-buckets per power of two: the histogram's relative error is 1/8.
const SUB: usize = 8;
const BUCKETS: usize = 64 * SUB;

/// Log-linear histogram of durations in microseconds.
pub struct Histogram {
    counts: Vec<AtomicU64>,
    sum_us: AtomicU64,
    n: AtomicU64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            counts: (0..BUCKETS).map(|_| AtomicU64::new(0)).collect(),
            sum_us: AtomicU64::new(0),
            n: AtomicU64::new(0),
        }
    }
}

fn bucket(us: u64) -> usize {
    if us < SUB as u64 {
        return us as usize;
    }
    let e = 63 - us.leading_zeros() as usize; // >= 3
    let sub = ((us >> (e - 3)) & (SUB as u64 - 1)) as usize;
    ((e - 2) * SUB + sub).min(BUCKETS - 1)
}

/// Upper bound (µs) of bucket `b`.
fn upper(b: usize) -> u64 {
    if b < SUB {
        return b as u64;
    }
    let e = b / SUB + 2;
    let sub = (b % SUB) as u64;
    ((SUB as u64 + sub + 1) << (e - 3)) - 1
}

impl Histogram {
    /// Adds one observation.
    pub fn record(&self, d: Duration) {
        let us = d.as_micros().min(u128::from(u64::MAX)) as u64;
        self.counts[bucket(us)].fetch_add(1, Ordering::Relaxed);
        self.sum_us.fetch_add(us, Ordering::Relaxed);
        self.n.fetch_add(1, Ordering::Relaxed);
    }

    /// Number of observations.
    pub fn count(&self) -> u64 {
        self.n.load(Ordering::Relaxed)
    }

    /// Mean in milliseconds (0 when empty).
    pub fn mean_ms(&self) -> f64 {
        let n = self.count();
        if n == 0 {
            return 0.0;
        }
        self.sum_us.load(Ordering::Relaxed) as f64 / n as f64 / 1000.0
    }

    /// The `q` quantile in milliseconds (upper bound of its bucket).
    pub fn quantile_ms(&self, q: f64) -> f64 {
        let n = self.count();
        if n == 0 {
            return 0.0;
        }
        let target = ((n as f64) * q).ceil().max(1.0) as u64;
        let mut acc = 0;
        for (b, c) in self.counts.iter().enumerate() {
            acc += c.load(Ordering::Relaxed);
            if acc >= target {
                return upper(b) as f64 / 1000.0;
            }
        }
        upper(BUCKETS - 1) as f64 / 1000.0
    }
}

/// Every counter of one cache store.
#[derive(Default)]
pub struct Counters {
    pub load_shards: AtomicU64,
    pub l1_hits: AtomicU64,
    pub l2_hits: AtomicU64,
    pub l2_misses: AtomicU64,
    pub bytes_loaded_l1: AtomicU64,
    pub bytes_loaded_l2: AtomicU64,
    pub dump_shards: AtomicU64,
    pub dump_dedup: AtomicU64,
    pub bytes_dumped_l1: AtomicU64,
    pub bytes_dumped_l2: AtomicU64,
    pub evictions: AtomicU64,
    pub fills: AtomicU64,
    pub fills_after_load: AtomicU64,
    pub first_loads_not_kept: AtomicU64,
    pub fill_waits: AtomicU64,
    pub fills_read_past: AtomicU64,
    pub bypass_loads: AtomicU64,
    pub bypass_dumps: AtomicU64,
    pub prefetch_shards: AtomicU64,
    pub write_back_blocks: AtomicU64,
    pub write_back_failures: AtomicU64,
    /// Shards whose slot failed its checksum (or whose metadata no longer
    /// vouched for it), dropped as misses.
    pub corrupt_shards: AtomicU64,
    pub lookups: AtomicU64,
    pub lookup_l1_hits: AtomicU64,
    pub lookup_l2_hits: AtomicU64,
    pub load_latency: Histogram,
}

/// `counter += n`.
pub fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// Current value.
pub fn get(c: &AtomicU64) -> u64 {
    c.load(Ordering::Relaxed)
}

impl super::Inner {
    /// The cache's own statistics (the backend's are added by the caller).
    pub(super) fn stats(&self) -> StoreStats {
        let c = &self.c;
        let mut m = StoreStats::new();
        let load = get(&c.load_shards);
        let l1 = get(&c.l1_hits);
        let l2 = get(&c.l2_hits);
        let ratio = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
        let mut put = |k: &str, v: f64| {
            m.insert(k.to_string(), v);
        };
        put("l1_hit_rate", ratio(l1, load));
        put("l2_hit_rate", ratio(l2, load.saturating_sub(l1)));
        put("avg_load_latency_ms", c.load_latency.mean_ms());
        put("p99_load_latency_ms", c.load_latency.quantile_ms(0.99));
        put("load_tasks", c.load_latency.count() as f64);
        put("load_shards", load as f64);
        put("l1_hits", l1 as f64);
        put("l2_hits", l2 as f64);
        put("l2_misses", get(&c.l2_misses) as f64);
        put("bytes_loaded_l1", get(&c.bytes_loaded_l1) as f64);
        put("bytes_loaded_l2", get(&c.bytes_loaded_l2) as f64);
        put("dump_shards", get(&c.dump_shards) as f64);
        put("dump_dedup", get(&c.dump_dedup) as f64);
        put("bytes_dumped_l1", get(&c.bytes_dumped_l1) as f64);
        put("bytes_dumped_l2", get(&c.bytes_dumped_l2) as f64);
        put("eviction_count", get(&c.evictions) as f64);
        put("fills", get(&c.fills) as f64);
        put("fills_after_load", get(&c.fills_after_load) as f64);
        put("first_loads_not_kept", get(&c.first_loads_not_kept) as f64);
        put("fill_waits", get(&c.fill_waits) as f64);
        put("fills_read_past", get(&c.fills_read_past) as f64);
        put("bypass_loads", get(&c.bypass_loads) as f64);
        put("bypass_dumps", get(&c.bypass_dumps) as f64);
        put("prefetch_shards", get(&c.prefetch_shards) as f64);
        put("write_back_blocks", get(&c.write_back_blocks) as f64);
        put("write_back_failures", get(&c.write_back_failures) as f64);
        put("corrupt_shards", get(&c.corrupt_shards) as f64);
        put(
            "slots_discarded_at_join",
            self.table.discarded_at_join() as f64,
        );
        put("lock_failures", self.table.lock_failures() as f64);
        put("dirty_blocks", self.wb.dirty_blocks() as f64);
        put("lookups", get(&c.lookups) as f64);
        put("lookup_l1_hits", get(&c.lookup_l1_hits) as f64);
        put("lookup_l2_hits", get(&c.lookup_l2_hits) as f64);
        put("slots", self.table.geometry().n_slots as f64);
        put("capacity_bytes", self.cfg.capacity_bytes as f64);
        if let Ok(g) = self.table.lock() {
            let used = g.used();
            drop(g);
            put("slots_used", f64::from(used));
        }
        m
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_monotonic_and_bound_their_values() {
        let mut last = 0;
        for us in [0u64, 1, 7, 8, 9, 15, 16, 100, 1000, 12345, 1 << 30] {
            let b = bucket(us);
            assert!(b >= last);
            last = b;
            assert!(upper(b) >= us, "{us} -> {b} -> {}", upper(b));
            assert!(
                upper(b) as f64 <= us as f64 * 1.13 + 1.0,
                "{us} {}",
                upper(b)
            );
        }
    }

    #[test]
    fn quantiles() {
        let h = Histogram::default();
        for i in 1..=100u64 {
            h.record(Duration::from_millis(i));
        }
        assert!((h.mean_ms() - 50.5).abs() < 0.01);
        let p99 = h.quantile_ms(0.99);
        assert!((99.0..=112.0).contains(&p99), "{p99}");
    }
}
