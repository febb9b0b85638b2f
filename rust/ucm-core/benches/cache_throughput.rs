//! Cache load and dump throughput against a same-run memcpy of the same
//! bytes: one thread, and as many threads as the cache copies with (the
//! fair comparison: the ratio columns use it). Each figure is the best of
//! three runs, since the machine may be shared.
//!
//! A `Cache|Empty` pipeline holds the whole data set; a warm-up round
//! faults every slot in and is flushed clean, so the measured dumps (new
//! ids) evict clean slots, as in steady state. Loads are hits. The target
//! is >= 80 % of memcpy for shards >= 256 KiB.
//!
//! Run: `cargo bench -p ucm-core --bench cache_throughput`; the options are
//! in [`HELP`], which the bench prints first.

use std::sync::Arc;
use std::time::Instant;

use ucm_core::store::cache::{CacheConfig, WriteBackPolicy};
use ucm_core::store::{CacheStore, EmptyStore, Store};
use ucm_core::{BlockId, MemSeg, ShardIo};

fn id(round: u32, n: u32) -> BlockId {
    let mut b = [0u8; 16];
    b[..4].copy_from_slice(&n.to_le_bytes());
    b[4..8].copy_from_slice(&round.to_le_bytes());
    b[8..12].copy_from_slice(&n.wrapping_mul(2_654_435_761).to_le_bytes());
    BlockId(b)
}

fn shards(round: u32, bufs: &mut [Vec<u8>], per_block: usize) -> Vec<ShardIo> {
    bufs.iter_mut()
        .enumerate()
        .map(|(i, b)| ShardIo {
            block: id(round, (i / per_block) as u32),
            index: i % per_block,
            segs: vec![MemSeg::of_mut(b)],
        })
        .collect()
}

fn gbps(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}

/// What the bench prints before it starts.
const HELP: &str = "\
cache_throughput: Cache tier dump/load GB/s against a same-run memcpy of the same bytes
  UCM_BENCH_MB=N  data set size in MiB (default 256)
  memcpy1: one thread; memcpyN: as many threads as the cache copies with, the baseline
  of the x columns (a ratio under 1.00x is slower than memcpy)
";

fn main() {
    print!("{HELP}");
    let total_mb: usize = std::env::var("UCM_BENCH_MB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256);
    let total = total_mb << 20;
    let threads = 2;
    println!(
        "{:>9} {:>7} {:>9} {:>9} {:>9} {:>9} {:>7} {:>7}",
        "shard", "shards", "memcpy1", "memcpyN", "dump", "load", "dump/mN", "load/mN"
    );
    for shard in [64 << 10, 256 << 10, 1 << 20, 4 << 20] {
        let per_block = 4;
        let n = total / shard;
        let cfg = CacheConfig {
            block_size: shard * per_block,
            shard_size: shard,
            capacity_bytes: (n * shard.div_ceil(4096) * 4096) as u64,
            write_back_policy: WriteBackPolicy::Lazy,
            copy_threads: threads,
            ..Default::default()
        };
        let cache = CacheStore::open(cfg, Arc::new(EmptyStore::new(0))).expect("open cache");
        let mut src: Vec<Vec<u8>> = (0..n).map(|i| vec![(i % 251) as u8; shard]).collect();
        let mut dst: Vec<Vec<u8>> = (0..n).map(|_| vec![1u8; shard]).collect();
        // Warm-up: fault in every slot, then make them clean.
        let t = cache.dump(shards(0, &mut src, per_block), 0).expect("dump");
        cache.wait(t).expect("wait");
        cache.flush().expect("flush");
        let (mut memcpy1, mut memcpy_n, mut dump, mut load) = (0f64, 0f64, 0f64, 0f64);
        for round in 1..=3u32 {
            // memcpy baselines of the same bytes.
            let start = Instant::now();
            for (s, d) in src.iter().zip(dst.iter_mut()) {
                d.copy_from_slice(s);
            }
            memcpy1 = memcpy1.max(gbps(total, start.elapsed().as_secs_f64()));
            let start = Instant::now();
            std::thread::scope(|sc| {
                let chunk = n.div_ceil(threads);
                for (s, d) in src.chunks(chunk).zip(dst.chunks_mut(chunk)) {
                    sc.spawn(move || {
                        for (a, b) in s.iter().zip(d.iter_mut()) {
                            b.copy_from_slice(a);
                        }
                    });
                }
            });
            memcpy_n = memcpy_n.max(gbps(total, start.elapsed().as_secs_f64()));
            // Dumps of new ids evict the previous round's clean slots.
            let start = Instant::now();
            let t = cache
                .dump(shards(round, &mut src, per_block), 0)
                .expect("dump");
            cache.wait(t).expect("wait");
            dump = dump.max(gbps(total, start.elapsed().as_secs_f64()));
            let start = Instant::now();
            let t = cache
                .load(shards(round, &mut dst, per_block))
                .expect("load");
            cache.wait(t).expect("wait");
            load = load.max(gbps(total, start.elapsed().as_secs_f64()));
            cache.flush().expect("flush");
        }
        assert!(
            src.iter().zip(&dst).all(|(a, b)| a == b),
            "load returned wrong bytes"
        );
        println!(
            "{:>8}K {:>7} {:>7.2}GB {:>7.2}GB {:>7.2}GB {:>7.2}GB {:>6.2}x {:>6.2}x",
            shard >> 10,
            n,
            memcpy1,
            memcpy_n,
            dump,
            load,
            dump / memcpy_n,
            load / memcpy_n
        );
        cache.close().expect("close");
    }
}
