//! A trace-driven simulator of the eviction policies (no data, no locks):
//! what `benches/cache_eviction.rs` runs to compare hit ratios, and what the
//! unit tests use to check policy behaviour on a scan.

use std::collections::HashMap;

use super::{Policy, PolicyKind};

/// A sequence of keys to access.
pub struct Trace {
    /// What the trace models, for tables.
    pub name: String,
    /// Number of distinct keys that can appear.
    pub keys: u64,
    /// The accesses.
    pub accesses: Vec<u64>,
}

/// Small deterministic generator (splitmix64), so traces need no crate and
/// are identical on every machine.
pub struct Rng(u64);

impl Rng {
    /// Seeds the generator.
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x9e37_79b9_7f4a_7c15)
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Draws ranks 0..n with probability proportional to 1/(rank+1)^alpha.
pub struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    /// Precomputes the distribution over `n` ranks.
    pub fn new(n: u64, alpha: f64) -> Self {
        let mut cdf = Vec::with_capacity(n as usize);
        let mut acc = 0.0;
        for r in 0..n {
            acc += 1.0 / ((r + 1) as f64).powf(alpha);
            cdf.push(acc);
        }
        for c in &mut cdf {
            *c /= acc;
        }
        Zipf { cdf }
    }

    /// One draw.
    pub fn sample(&self, rng: &mut Rng) -> u64 {
        let u = rng.unit();
        self.cdf.partition_point(|&c| c < u) as u64
    }
}

/// Scrambles a rank into a key so popular keys are not neighbours.
fn scramble(x: u64) -> u64 {
    let mut r = Rng(x);
    r.next_u64()
}

impl Trace {
    /// Independent Zipf draws over `keys` keys.
    pub fn zipf(keys: u64, alpha: f64, len: usize, seed: u64) -> Self {
        let z = Zipf::new(keys, alpha);
        let mut rng = Rng::new(seed);
        Trace {
            name: format!("zipf a={alpha}, {}k keys", keys / 1000),
            keys,
            accesses: (0..len).map(|_| scramble(z.sample(&mut rng))).collect(),
        }
    }

    /// Zipf draws interleaved with sequential scans of never-repeated keys:
    /// a fraction `scan` of all accesses belongs to scans of 1-5 % of
    /// `keys` each (one-time blocks, like prompts nobody shares).
    pub fn zipf_with_scans(keys: u64, alpha: f64, scan: f64, len: usize, seed: u64) -> Self {
        let z = Zipf::new(keys, alpha);
        let mut rng = Rng::new(seed);
        let mut fresh = u64::MAX / 2;
        let mut accesses = Vec::with_capacity(len);
        // Start a scan with probability q per step so that scans make up a
        // fraction `scan` of all accesses: q*L / (q*L + 1 - q) = scan, with
        // L the mean scan length (3 % of the keys).
        let mean_run = keys as f64 * 0.03;
        let scan = scan.clamp(0.0, 0.99);
        let q = scan / (mean_run * (1.0 - scan) + scan);
        while accesses.len() < len {
            if rng.unit() < q {
                let run = (keys as f64 * (0.01 + 0.04 * rng.unit())) as u64;
                for _ in 0..run {
                    fresh += 1;
                    accesses.push(scramble(fresh));
                }
            } else {
                accesses.push(scramble(z.sample(&mut rng)));
            }
        }
        accesses.truncate(len);
        Trace {
            name: format!("zipf a={alpha} + {:.0}% scans", scan * 100.0),
            keys,
            accesses,
        }
    }

    /// LLM-serving-like: requests share a Zipf-popular system prompt /
    /// document prefix of 4-32 blocks, followed by 2-16 blocks unique to
    /// the request (dumped once, rarely read again).
    pub fn shared_prefixes(prefixes: u64, len: usize, seed: u64) -> Self {
        let z = Zipf::new(prefixes, 0.9);
        let mut rng = Rng::new(seed);
        let mut fresh = u64::MAX / 2;
        let mut accesses = Vec::with_capacity(len);
        while accesses.len() < len {
            let p = z.sample(&mut rng);
            let plen = 4 + scramble(p) % 29;
            for b in 0..plen {
                accesses.push(scramble(p * 64 + b));
            }
            for _ in 0..2 + rng.next_u64() % 15 {
                fresh += 1;
                accesses.push(scramble(fresh));
            }
        }
        accesses.truncate(len);
        Trace {
            name: "shared prefixes (LLM-like)".into(),
            keys: prefixes * 18,
            accesses,
        }
    }
}

/// Replays `trace` through a cache of `capacity` entries managed by
/// `kind`; returns the hit ratio.
pub fn simulate(kind: PolicyKind, capacity: usize, trace: &Trace) -> f64 {
    let capacity = capacity.max(1);
    let mut words = vec![0u32; kind.words(capacity)];
    let mut policy = Policy::new(kind, &mut words, capacity);
    policy.init();
    let mut where_is: HashMap<u64, u32> = HashMap::with_capacity(capacity * 2);
    let mut owner: Vec<Option<u64>> = vec![None; capacity];
    let mut free: Vec<u32> = (0..capacity as u32).rev().collect();
    let mut hits = 0u64;
    for &key in &trace.accesses {
        if let Some(&slot) = where_is.get(&key) {
            hits += 1;
            policy.access(slot);
            continue;
        }
        let slot = match free.pop() {
            Some(s) => s,
            None => {
                let Some(victim) = policy.pick(&mut |_| true) else {
                    continue;
                };
                if let Some(old) = owner[victim as usize].take() {
                    where_is.remove(&old);
                }
                victim
            }
        };
        owner[slot as usize] = Some(key);
        where_is.insert(key, slot);
        policy.insert(slot, key);
    }
    hits as f64 / trace.accesses.len().max(1) as f64
}
