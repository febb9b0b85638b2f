//! Posix store dump/load throughput against a same-run baseline of the
//! same kind.
//!
//! For each I/O engine, O_DIRECT on and off, and shard sizes 64 KiB .. 4 MiB
//! (plus the layer-wise shape: 1 MiB shards made of 32 tensors of 32 KiB),
//! measures the store's dump and load GB/s and, on the same directory in the
//! same run, plain sequential pwrite/pread of the same bytes (from and into
//! the same memory the store moves) in the same I/O size at the same queue
//! depth (`io_threads`). The baseline is of the case's kind: O_DIRECT for
//! an O_DIRECT store, page-cache copies for a buffered one (whose loads of
//! blocks just dumped are served from the page cache, far above what the
//! disk gives; against an O_DIRECT baseline they would read as gains they
//! are not). Prints the ratio store/baseline at the end: the median over
//! pairs of one store run followed by one baseline run, so slow drifts of
//! a shared machine affect both sides of each pair alike.
//!
//! The store runs at capacity, as a cache does in steady state: its
//! `capacity_bytes` holds a few rounds, so each round's dump makes the
//! store evict (and recycle) the blocks of an older one in the background,
//! inside the timed period.
//!
//! Run: `cargo bench -p ucm-core --bench posix_throughput`; the options are
//! in [`HELP`], which the bench prints first.

#![allow(clippy::unwrap_used)] // benchmark code: a panic is a failed run

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use criterion::{criterion_group, Criterion, Throughput};
use ucm_core::io::{AlignedBuf, BaselineFile, IoEngineKind, IoOp};
use ucm_core::store::{PosixConfig, PosixStore, Store};
use ucm_core::{BlockId, MemSeg, ShardIo};

/// Bytes moved per round of a case.
const TOTAL: usize = 128 << 20;
/// Requests the baseline keeps in flight, as the store's engines do.
const QD: usize = 4;
/// Rounds of TOTAL bytes the store holds before it evicts.
const CAPACITY_ROUNDS: usize = 3;

/// What the bench prints before it starts.
const HELP: &str = "\
posix_throughput: Posix store dump/load GB/s against a same-run baseline of the same kind
  UCM_BENCH_CASES=TEXT  run only the cases whose name contains TEXT, e.g. direct/1024
                        (names: psync|uring / direct|buffered / 64KiB..4096KiB[x32t])
  UCM_BENCH_DIR=DIR     measure the file system of DIR (default: ./target, the disk)
  UCM_BENCH_VERBOSE=1   print every store/baseline pair, not only the medians
  baselines: direct cases against plain O_DIRECT pwrite/pread, buffered cases against
  buffered pwrite/pread (page-cache copies); same bytes, I/O size, queue depth
";

fn bench_dir() -> tempfile::TempDir {
    let parent = std::env::var_os("UCM_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("target"));
    std::fs::create_dir_all(&parent).unwrap();
    tempfile::tempdir_in(parent).unwrap()
}

fn id(round: u64, n: u64) -> BlockId {
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&round.to_le_bytes());
    b[8..].copy_from_slice(&n.wrapping_mul(0x9e37_79b9_7f4a_7c15).to_le_bytes());
    BlockId(b)
}

/// One shard per block; each shard is `tensors` equal tensors.
fn shards(buf: &AlignedBuf, shard: usize, tensors: usize, round: u64) -> Vec<ShardIo> {
    let t = shard / tensors;
    (0..TOTAL / shard)
        .map(|n| ShardIo {
            block: id(round, n as u64),
            index: 0,
            segs: (0..tensors)
                .map(|k| MemSeg {
                    addr: buf.as_ptr() as usize + n * shard + k * t,
                    len: t,
                })
                .collect(),
        })
        .collect()
}

fn gbps(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

/// How long `op` takes.
fn timed(op: impl FnOnce()) -> Duration {
    let t0 = Instant::now();
    op();
    t0.elapsed()
}

/// Runs `iters` rounds of `round`, which returns how long its store run
/// took and the GB/s of a baseline run made right after it (the pair sees
/// the same machine state, so their ratio is robust to drift). Records each
/// pair's GB/s in `pairs`; returns the store runs' total time, which is what
/// criterion measures.
fn paired_rounds(
    iters: u64,
    pairs: &mut Vec<(f64, f64)>,
    mut round: impl FnMut() -> (Duration, f64),
) -> Duration {
    let mut total = Duration::ZERO;
    for _ in 0..iters {
        let (d, base) = round();
        total += d;
        pairs.push((gbps(TOTAL, d), base));
    }
    total
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn run_case(c: &mut Criterion, engine: IoEngineKind, direct: bool, shard: usize, tensors: usize) {
    let dir = bench_dir();
    let case = case_name(engine, direct, shard, tensors);
    let store = PosixStore::open(PosixConfig {
        storage_backends: vec![dir.path().to_path_buf()],
        block_size: shard,
        shard_size: shard,
        tensor_size_list: vec![shard / tensors; tensors],
        io_direct: direct,
        io_engine: engine,
        io_threads: QD,
        timeout_ms: 0,
        capacity_bytes: (CAPACITY_ROUNDS * TOTAL) as u64 + (TOTAL / shard) as u64 * 8192,
        ..Default::default()
    })
    .unwrap();
    // One baseline file per case, overwritten and read again each time.
    let file = if direct {
        BaselineFile::create(dir.path(), TOTAL, shard, QD)
    } else {
        BaselineFile::create_buffered(dir.path(), TOTAL, shard, QD)
    };
    let baseline = Mutex::new(file.unwrap());
    let mut src = AlignedBuf::new(TOTAL);
    for (i, x) in src.as_mut_slice().iter_mut().enumerate() {
        *x = (i * 131 + 7) as u8;
    }
    let mut dst = AlignedBuf::new(TOTAL);
    let mut round = 1u64;
    let mut dumps = Vec::new();
    let mut loads = Vec::new();
    let mut g = c.benchmark_group(format!("posix/{case}"));
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(200))
        .measurement_time(Duration::from_secs(2))
        .throughput(Throughput::Bytes(TOTAL as u64));
    g.bench_function("dump", |b| {
        b.iter_custom(|iters| {
            paired_rounds(iters, &mut dumps, || {
                round += 1;
                let work = shards(&src, shard, tensors, round);
                let d = timed(|| {
                    let t = store.dump(work, 0).unwrap();
                    store.wait(t).unwrap();
                });
                (d, base(&baseline, IoOp::Write, &mut src))
            })
        })
    });
    // Load the last dumped round again (kept on disk).
    round += 1;
    let t = store.dump(shards(&src, shard, tensors, round), 0).unwrap();
    store.wait(t).unwrap();
    g.bench_function("load", |b| {
        b.iter_custom(|iters| {
            paired_rounds(iters, &mut loads, || {
                let d = timed(|| {
                    let t = store.load(shards(&dst, shard, tensors, round)).unwrap();
                    store.wait(t).unwrap();
                });
                (d, base(&baseline, IoOp::Read, &mut dst))
            })
        })
    });
    g.finish();
    // The baseline's reads went into `dst` too: check a store load alone.
    dst.as_mut_slice().fill(0);
    let t = store.load(shards(&dst, shard, tensors, round)).unwrap();
    store.wait(t).unwrap();
    assert_eq!(
        src.as_slice(),
        dst.as_slice(),
        "{case}: loaded bytes differ"
    );
    drop(store);
    if std::env::var_os("UCM_BENCH_VERBOSE").is_some() {
        eprintln!("{case} dump/base pairs: {dumps:.2?}");
        eprintln!("{case} load/base pairs: {loads:.2?}");
    }
    let ratio = |v: &[(f64, f64)]| median(v.iter().map(|(s, b)| s / b).collect());
    ROWS.lock().unwrap().push(Row {
        case,
        dump: median(dumps.iter().map(|p| p.0).collect()),
        load: median(loads.iter().map(|p| p.0).collect()),
        base_write: median(dumps.iter().map(|p| p.1).collect()),
        base_read: median(loads.iter().map(|p| p.1).collect()),
        dump_ratio: ratio(&dumps),
        load_ratio: ratio(&loads),
    });
}

fn base(file: &Mutex<BaselineFile>, op: IoOp, mem: &mut AlignedBuf) -> f64 {
    file.lock().unwrap().measure_mem(op, mem).unwrap()
}

fn benches(c: &mut Criterion) {
    let only = std::env::var("UCM_BENCH_CASES").unwrap_or_default();
    for engine in [IoEngineKind::Psync, IoEngineKind::Uring] {
        for direct in [true, false] {
            for (shard, tensors) in [
                (64 << 10, 1),
                (256 << 10, 1),
                (1 << 20, 1),
                (4 << 20, 1),
                (1 << 20, 32),
            ] {
                if case_name(engine, direct, shard, tensors).contains(&only) {
                    run_case(c, engine, direct, shard, tensors);
                }
            }
        }
    }
}

/// One printed line: a case's GB/s and its ratios to the baseline.
struct Row {
    case: String,
    dump: f64,
    load: f64,
    base_write: f64,
    base_read: f64,
    dump_ratio: f64,
    load_ratio: f64,
}

static ROWS: Mutex<Vec<Row>> = Mutex::new(Vec::new());

fn case_name(engine: IoEngineKind, direct: bool, shard: usize, tensors: usize) -> String {
    format!(
        "{}/{}/{}KiB{}",
        if engine == IoEngineKind::Uring {
            "uring"
        } else {
            "psync"
        },
        if direct { "direct" } else { "buffered" },
        shard >> 10,
        if tensors > 1 {
            format!("x{tensors}t")
        } else {
            String::new()
        }
    )
}

criterion_group!(group, benches);

fn main() {
    print!("{HELP}");
    group();
    Criterion::default().configure_from_args().final_summary();
    println!(
        "\nPosix store / baseline of the same kind, same bytes, I/O size, queue depth {QD} (GB/s, medians)"
    );
    println!("baseline: direct cases: plain O_DIRECT pwrite/pread; buffered cases: buffered pwrite/pread");
    println!(
        "(copies into and out of the page cache). A ratio under 1.00x is slower than its baseline."
    );
    println!(
        "{:<28} {:>7} {:>7} {:>7}   {:>7} {:>7} {:>7}",
        "case", "dump", "base_w", "ratio", "load", "base_r", "ratio"
    );
    for r in ROWS.lock().unwrap().iter() {
        println!(
            "{:<28} {:>7.2} {:>7.2} {:>6.2}x   {:>7.2} {:>7.2} {:>6.2}x",
            r.case, r.dump, r.base_write, r.dump_ratio, r.load, r.base_read, r.load_ratio
        );
    }
}
