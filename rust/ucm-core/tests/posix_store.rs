//! Posix store behaviour on a real file system (a temporary directory on
//! the build machine's disk), for both I/O engines and O_DIRECT on and off.
//!
//! Longer than most files: one suite with its shared helpers, so every
//! case runs against the same store builders.

// Test helpers outside #[test] fns: a panic here is a test failure.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use ucm_core::error::Damage;
use ucm_core::io::IoEngineKind;
use ucm_core::store::{PosixConfig, PosixStore, Store};
use ucm_core::{BlockId, MemSeg, ShardIo, UcmError};

const SHARD: usize = 64 * 1024;

fn config(dir: &std::path::Path, engine: IoEngineKind, direct: bool) -> PosixConfig {
    PosixConfig {
        storage_backends: vec![dir.to_path_buf()],
        block_size: SHARD * 4,
        shard_size: SHARD,
        tensor_size_list: vec![SHARD / 2, SHARD / 2],
        io_direct: direct,
        io_engine: engine,
        io_threads: 4,
        timeout_ms: 10_000,
        ..Default::default()
    }
}

fn id(n: u32) -> BlockId {
    let mut b = [0u8; 16];
    b[..4].copy_from_slice(&n.to_le_bytes());
    b[8..12].copy_from_slice(&n.wrapping_mul(2_654_435_761).to_le_bytes());
    BlockId(b)
}

/// A page-aligned buffer so O_DIRECT can use caller memory without bouncing.
struct Buf {
    mem: Vec<u8>,
    off: usize,
    len: usize,
}

impl Buf {
    fn new(len: usize, misalign: usize) -> Self {
        let mem = vec![0u8; len + 8192];
        let base = mem.as_ptr() as usize;
        let off = (4096 - base % 4096) % 4096 + misalign;
        Buf { mem, off, len }
    }
    fn filled(len: usize, seed: u32, misalign: usize) -> Self {
        let mut b = Buf::new(len, misalign);
        for (i, x) in b.slice_mut().iter_mut().enumerate() {
            *x = (i as u32)
                .wrapping_mul(31)
                .wrapping_add(seed.wrapping_mul(7919)) as u8;
        }
        b
    }
    fn slice(&self) -> &[u8] {
        &self.mem[self.off..self.off + self.len]
    }
    fn slice_mut(&mut self) -> &mut [u8] {
        let (o, l) = (self.off, self.len);
        &mut self.mem[o..o + l]
    }
    fn shard(&self, block: BlockId, index: usize) -> ShardIo {
        let a = self.slice().as_ptr() as usize;
        ShardIo {
            block,
            index,
            segs: vec![
                MemSeg {
                    addr: a,
                    len: self.len / 2,
                },
                MemSeg {
                    addr: a + self.len / 2,
                    len: self.len / 2,
                },
            ],
        }
    }
}

/// The shards of blocks `ids`, shard `s` of block `ids[i]` in `bufs[i][s]`.
fn block_shards(ids: &[BlockId], bufs: &[Vec<Buf>]) -> Vec<ShardIo> {
    ids.iter()
        .zip(bufs)
        .flat_map(|(i, bufs)| bufs.iter().enumerate().map(move |(s, b)| b.shard(*i, s)))
        .collect()
}

/// A store with the test geometry in a new temporary directory (returned
/// too: the store's files live as long as it does).
fn fresh_store(engine: IoEngineKind, direct: bool) -> (tempfile::TempDir, PosixStore) {
    let dir = tempfile::tempdir().unwrap();
    let store = PosixStore::open(config(dir.path(), engine, direct)).unwrap();
    (dir, store)
}

/// Loads shard `index` of `block` alone into a new buffer and returns it.
fn load_shard(store: &PosixStore, block: BlockId, index: usize) -> Buf {
    let out = Buf::new(SHARD, 0);
    let t = store.load(vec![out.shard(block, index)]).unwrap();
    store.wait(t).unwrap();
    out
}

fn each_mode(f: impl Fn(IoEngineKind, bool)) {
    for engine in [IoEngineKind::Psync, IoEngineKind::Uring] {
        for direct in [false, true] {
            f(engine, direct);
        }
    }
}

#[test]
fn round_trip_all_engines_and_direct_modes() {
    each_mode(|engine, direct| {
        for misalign in [0usize, 64] {
            let (_dir, store) = fresh_store(engine, direct);
            let ids: Vec<BlockId> = (0..8).map(id).collect();
            assert_eq!(store.lookup(&ids).unwrap(), vec![false; 8]);
            let srcs: Vec<Vec<Buf>> = (0..8)
                .map(|b| {
                    (0..4)
                        .map(|s| Buf::filled(SHARD, b * 10 + s, misalign))
                        .collect()
                })
                .collect();
            let shards = block_shards(&ids, &srcs);
            let t = store.dump(shards, 0).unwrap();
            store.wait(t).unwrap();
            assert_eq!(store.lookup(&ids).unwrap(), vec![true; 8]);
            assert_eq!(store.lookup_on_prefix(&ids).unwrap(), 7);
            let dsts: Vec<Vec<Buf>> = (0..8)
                .map(|_| (0..4).map(|_| Buf::new(SHARD, misalign)).collect())
                .collect();
            let shards = block_shards(&ids, &dsts);
            let t = store.load(shards).unwrap();
            store.wait(t).unwrap();
            for (a, b) in srcs.iter().flatten().zip(dsts.iter().flatten()) {
                assert!(
                    a.slice() == b.slice(),
                    "mismatch engine={engine:?} direct={direct}"
                );
            }
            let st = store.counters();
            assert_eq!(st.blocks_committed, 8);
            assert_eq!(st.shards_loaded, 32);
        }
    });
}

#[test]
fn background_loads_run_on_the_calling_thread_and_read_the_same_bytes() {
    each_mode(|engine, direct| {
        let (_dir, store) = fresh_store(engine, direct);
        let ids: Vec<BlockId> = (0..3).map(id).collect();
        let srcs: Vec<Buf> = (0..12).map(|n| Buf::filled(SHARD, n, 0)).collect();
        let shards = |bufs: &[Buf]| -> Vec<ShardIo> {
            bufs.iter()
                .enumerate()
                .map(|(n, b)| b.shard(ids[n / 4], n % 4))
                .collect()
        };
        let t = store.dump(shards(&srcs), 0).unwrap();
        store.wait(t).unwrap();
        let dsts: Vec<Buf> = (0..12).map(|_| Buf::new(SHARD, 0)).collect();
        let t = store.load_in_background(shards(&dsts)).unwrap();
        // Done by the time it returns: the caller's thread did the reads.
        assert!(store.check(t).unwrap(), "engine={engine:?} direct={direct}");
        store.wait(t).unwrap();
        assert!(srcs.iter().zip(&dsts).all(|(a, b)| a.slice() == b.slice()));
        store.close().unwrap();
        let err = store.load_in_background(shards(&dsts)).unwrap_err();
        assert!(matches!(err, ucm_core::UcmError::Closed), "{err}");
    });
}

#[test]
fn lookup_is_per_block_and_prefix_stops_at_first_miss() {
    let (_dir, store) = fresh_store(IoEngineKind::Psync, false);
    let present = [0u32, 1, 3];
    let bufs: Vec<Buf> = (0..4).map(|s| Buf::filled(SHARD, s, 0)).collect();
    for p in present {
        let shards = (0..4).map(|s| bufs[s].shard(id(p), s)).collect();
        let t = store.dump(shards, 0).unwrap();
        store.wait(t).unwrap();
    }
    let ids: Vec<BlockId> = (0..5).map(id).collect();
    assert_eq!(
        store.lookup(&ids).unwrap(),
        vec![true, true, false, true, false]
    );
    assert_eq!(store.lookup_on_prefix(&ids).unwrap(), 1);
    assert_eq!(store.lookup_on_prefix(&ids[2..]).unwrap(), -1);
    assert_eq!(store.lookup_on_prefix(&[]).unwrap(), -1);
}

#[test]
fn block_invisible_until_all_shards_written_in_any_order() {
    let (_dir, store) = fresh_store(IoEngineKind::Uring, true);
    let bufs: Vec<Buf> = (0..4).map(|s| Buf::filled(SHARD, s, 0)).collect();
    // Layer-wise: one task per shard, out of order; the last index is NOT last.
    for s in [3usize, 0, 2] {
        let t = store.dump(vec![bufs[s].shard(id(9), s)], 0).unwrap();
        store.wait(t).unwrap();
        assert_eq!(
            store.lookup(&[id(9)]).unwrap(),
            vec![false],
            "visible after shard {s}"
        );
    }
    let t = store.dump(vec![bufs[1].shard(id(9), 1)], 0).unwrap();
    store.wait(t).unwrap();
    assert_eq!(store.lookup(&[id(9)]).unwrap(), vec![true]);
    let out: Vec<Buf> = (0..4).map(|_| Buf::new(SHARD, 0)).collect();
    let t = store
        .load((0..4).map(|s| out[s].shard(id(9), s)).collect())
        .unwrap();
    store.wait(t).unwrap();
    for s in 0..4 {
        assert_eq!(out[s].slice(), bufs[s].slice());
    }
}

#[test]
fn concurrent_writers_of_one_block_leave_one_whole_block() {
    let dir = tempfile::tempdir().unwrap();
    // Two independent stores on one directory stand for two processes.
    let a = Arc::new(PosixStore::open(config(dir.path(), IoEngineKind::Psync, false)).unwrap());
    let b = Arc::new(PosixStore::open(config(dir.path(), IoEngineKind::Uring, false)).unwrap());
    let bufs: Arc<Vec<Buf>> = Arc::new((0..4).map(|s| Buf::filled(SHARD, s, 0)).collect());
    let mut handles = Vec::new();
    for (k, store) in [a.clone(), b.clone(), a.clone(), b.clone()]
        .into_iter()
        .enumerate()
    {
        let bufs = bufs.clone();
        handles.push(std::thread::spawn(move || {
            for round in 0..20u32 {
                let shards = (0..4).map(|s| bufs[s].shard(id(100 + round), s)).collect();
                let t = store.dump(shards, 0).unwrap();
                store.wait(t).unwrap();
                let _ = k;
            }
        }));
    }
    for h in handles {
        h.join().unwrap();
    }
    for round in 0..20u32 {
        for store in [&a, &b] {
            let out: Vec<Buf> = (0..4).map(|_| Buf::new(SHARD, 0)).collect();
            let t = store
                .load((0..4).map(|s| out[s].shard(id(100 + round), s)).collect())
                .unwrap();
            store.wait(t).unwrap();
            for s in 0..4 {
                assert_eq!(out[s].slice(), bufs[s].slice());
            }
        }
    }
    // No temporaries left behind once the stores are closed (the spare
    // files stay for the next store to adopt).
    drop(a);
    drop(b);
    let (_, leftovers) = work_files(dir.path());
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

/// Where a block's file lives (the store's debug hook).
fn block_path(store: &PosixStore, id: &BlockId) -> std::path::PathBuf {
    store
        .debug()
        .and_then(|d| d.block_path(id))
        .expect("a Posix store knows its block paths")
}

/// Files in the stores' work directories: the number of spare files, and
/// every other file but the locks and closed markers (temporaries).
fn work_files(root: &std::path::Path) -> (usize, Vec<String>) {
    let mut spares = 0;
    let mut others = Vec::new();
    for d in std::fs::read_dir(root.join(".work")).unwrap().flatten() {
        for f in std::fs::read_dir(d.path()).unwrap().flatten() {
            let name = f.file_name().to_string_lossy().to_string();
            if name.starts_with("spare.") {
                spares += 1;
            } else if name != "lock" && name != "closed" {
                others.push(f.path().display().to_string());
            }
        }
    }
    (spares, others)
}

#[test]
fn checksum_failure_is_a_load_error_and_clears_the_destination() {
    each_mode(|engine, direct| {
        let (_dir, store) = fresh_store(engine, direct);
        let bufs: Vec<Buf> = (0..4).map(|s| Buf::filled(SHARD, s, 0)).collect();
        let t = store
            .dump((0..4).map(|s| bufs[s].shard(id(1), s)).collect(), 0)
            .unwrap();
        store.wait(t).unwrap();
        // Flip one data byte of shard 2.
        let path = block_path(&store, &id(1));
        let mut raw = std::fs::read(&path).unwrap();
        let off = store.layout().offset(2) as usize + 4096 + 100;
        raw[off] ^= 0xff;
        std::fs::write(&path, raw).unwrap();
        let mut out = Buf::filled(SHARD, 77, 0);
        let t = store.load(vec![out.shard(id(1), 2)]).unwrap();
        let err = store.wait(t).unwrap_err();
        assert_eq!(err.code(), -50011, "{err}");
        assert!(
            out.slice_mut().iter().all(|&x| x == 0),
            "caller memory not cleared"
        );
        // The corrupt block is dropped so it can be written again.
        assert_eq!(store.lookup(&[id(1)]).unwrap(), vec![false]);
        assert_eq!(store.counters().corrupt_loads, 1);
    });
}

#[test]
fn whole_block_loads_verify_every_shard_of_the_coalesced_read() {
    // A whole-block load reads the block's shards with one request; each
    // shard is still verified on its own. A file cut short is refused
    // before any byte is read (and removed).
    each_mode(|engine, direct| {
        let (_dir, store) = fresh_store(engine, direct);
        let bufs: Vec<Buf> = (0..4).map(|s| Buf::filled(SHARD, s, 0)).collect();
        for b in [1, 2] {
            let t = store
                .dump((0..4).map(|s| bufs[s].shard(id(b), s)).collect(), 0)
                .unwrap();
            store.wait(t).unwrap();
        }
        let path = block_path(&store, &id(1));
        let mut raw = std::fs::read(&path).unwrap();
        raw[store.layout().offset(2) as usize + 4096 + 5] ^= 0x01;
        std::fs::write(&path, raw).unwrap();
        let path2 = block_path(&store, &id(2));
        let cut = store.layout().offset(3) + 4096 + 10;
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path2)
            .unwrap()
            .set_len(cut)
            .unwrap();
        for (b, what) in [(1, "checksum"), (2, "truncated")] {
            let mut outs: Vec<Buf> = (0..4).map(|s| Buf::filled(SHARD, 50 + s, 0)).collect();
            let shards = outs
                .iter()
                .enumerate()
                .map(|(s, o)| o.shard(id(b), s))
                .collect();
            let t = store.load(shards).unwrap();
            let err = store.wait(t).unwrap_err();
            assert_eq!(err.code(), -50011, "{err}");
            assert!(err.to_string().contains(what), "{err}");
            if b == 2 {
                assert!(!path2.exists(), "the truncated file stays");
                for (s, o) in outs.iter().enumerate() {
                    let untouched = Buf::filled(SHARD, 50 + s as u32, 0);
                    assert!(o.slice() == untouched.slice(), "shard {s} touched");
                }
                continue;
            }
            for (s, o) in outs.iter_mut().enumerate() {
                if s == 2 {
                    assert!(
                        o.slice_mut().iter().all(|&x| x == 0),
                        "shard {s} not cleared"
                    );
                } else {
                    assert!(o.slice() == bufs[s].slice(), "shard {s} of block {b} wrong");
                }
            }
        }
    });
}

#[test]
fn foreign_block_and_other_layout_are_rejected() {
    let (dir, store) = fresh_store(IoEngineKind::Psync, false);
    let bufs: Vec<Buf> = (0..4).map(|s| Buf::filled(SHARD, s, 0)).collect();
    let t = store
        .dump((0..4).map(|s| bufs[s].shard(id(1), s)).collect(), 0)
        .unwrap();
    store.wait(t).unwrap();
    // Copy block 1's file under block 2's name: a "foreign" block.
    std::fs::create_dir_all(block_path(&store, &id(2)).parent().unwrap()).unwrap();
    std::fs::copy(block_path(&store, &id(1)), block_path(&store, &id(2))).unwrap();
    let out = Buf::new(SHARD, 0);
    let t = store.load(vec![out.shard(id(2), 0)]).unwrap();
    let err = store.wait(t).unwrap_err();
    assert!(err.to_string().contains("foreign"), "{err}");
    drop(store);
    // Same bytes, store configured with other tensor sizes: layout mismatch.
    let mut cfg = config(dir.path(), IoEngineKind::Psync, false);
    cfg.tensor_size_list = vec![SHARD];
    let other = PosixStore::open(cfg).unwrap();
    let t = other
        .load(vec![ShardIo {
            block: id(1),
            index: 0,
            segs: vec![MemSeg {
                addr: out.slice().as_ptr() as usize,
                len: SHARD,
            }],
        }])
        .unwrap();
    let err = other.wait(t).unwrap_err();
    assert!(err.to_string().contains("another layout"), "{err}");
    // Valid for the store that wrote it: refused, never deleted.
    assert!(matches!(
        err,
        UcmError::Corrupt {
            damage: Damage::OtherLayout,
            ..
        }
    ));
    assert!(block_path(&other, &id(1)).exists());
}

#[test]
fn spare_files_are_used_and_cleaned_up() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path(), IoEngineKind::Psync, true);
    cfg.spare_files = 4;
    let store = PosixStore::open(cfg.clone()).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while work_files(dir.path()).0 < 4 {
        assert!(
            std::time::Instant::now() < deadline,
            "spares were not created"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let bufs: Vec<Buf> = (0..4).map(|s| Buf::filled(SHARD, s, 0)).collect();
    for n in 0..8 {
        let t = store
            .dump((0..4).map(|s| bufs[s].shard(id(n), s)).collect(), 0)
            .unwrap();
        store.wait(t).unwrap();
        let len = std::fs::metadata(block_path(&store, &id(n))).unwrap().len();
        assert_eq!(len, store.layout().file_len());
    }
    let out = load_shard(&store, id(7), 2);
    assert_eq!(out.slice(), bufs[2].slice());
    drop(store);
    // The pool outlives a clean close, and the next store adopts it
    // (moves the files into its own work directory) instead of creating.
    let (left, temps) = work_files(dir.path());
    assert!(left >= 1 && temps.is_empty(), "{left} spares, {temps:?}");
    let before = inodes(&dir.path().join(".work"));
    let store = PosixStore::open(cfg.clone()).unwrap();
    let dirs = std::fs::read_dir(dir.path().join(".work")).unwrap().count();
    assert_eq!(dirs, 1, "the closed store's work directory is gone");
    let adopted = inodes(&dir.path().join(".work"));
    assert!(
        before.intersection(&adopted).count() >= left.min(4),
        "spares were recreated"
    );
    drop(store);
    // A store without a pool removes them.
    cfg.spare_files = 0;
    let store = PosixStore::open(cfg).unwrap();
    assert_eq!(work_files(dir.path()).0, 0);
    let ids: Vec<BlockId> = (0..8).map(id).collect();
    assert_eq!(store.lookup(&ids).unwrap(), vec![true; 8]);
}

#[test]
fn missing_block_load_fails_with_not_found() {
    let (_dir, store) = fresh_store(IoEngineKind::Uring, false);
    let out = Buf::new(SHARD, 0);
    let t = store.load(vec![out.shard(id(5), 0)]).unwrap();
    assert_eq!(store.wait(t).unwrap_err().code(), -50005);
}

/// `cfg` with a capacity of `files` block files; also returns a file's length.
fn with_capacity(mut cfg: PosixConfig, files: u64) -> (PosixConfig, u64) {
    let file_len = ucm_core::store::format::layout::Layout::new(
        cfg.block_size,
        cfg.shard_size,
        &cfg.tensor_size_list,
    )
    .file_len();
    cfg.capacity_bytes = file_len * files;
    (cfg, file_len)
}

/// A psync store config keeping `spare_files` spares, with room for `files`
/// block files; and the length of one.
fn with_spares_and_capacity(
    dir: &std::path::Path,
    direct: bool,
    spare_files: usize,
    files: u64,
) -> (PosixConfig, u64) {
    let mut cfg = config(dir, IoEngineKind::Psync, direct);
    cfg.spare_files = spare_files;
    with_capacity(cfg, files)
}

#[test]
fn capacity_evicts_least_recently_used_and_restart_restores_state() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, file_len) = with_capacity(config(dir.path(), IoEngineKind::Psync, false), 10);
    let store = PosixStore::open(cfg.clone()).unwrap();
    let bufs: Vec<Buf> = (0..4).map(|s| Buf::filled(SHARD, s, 0)).collect();
    let put = |store: &PosixStore, n: u32| {
        let t = store
            .dump((0..4).map(|s| bufs[s].shard(id(n), s)).collect(), 0)
            .unwrap();
        store.wait(t).unwrap();
    };
    for n in 0..10 {
        put(&store, n);
    }
    // Refresh block 0: it must survive the eviction of the oldest blocks.
    assert!(store.lookup(&[id(0)]).unwrap()[0]);
    for n in 10..14 {
        put(&store, n);
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while store.counters().used_bytes > cfg.capacity_bytes && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let st = store.counters();
    assert!(st.used_bytes <= cfg.capacity_bytes, "{st:?}");
    assert!(st.evictions >= 4, "{st:?}");
    let present = store.lookup(&(0..14).map(id).collect::<Vec<_>>()).unwrap();
    assert!(present[0], "recently used block was evicted: {present:?}");
    assert!(!present[1], "oldest block survived: {present:?}");
    assert!(present[13]);
    drop(store);
    // Restart: contents and usage come back from the directory (the
    // evictor may have made room for spares since the lookup above).
    let store = PosixStore::open(cfg.clone()).unwrap();
    assert!(store.wait_indexed(Duration::from_secs(10)));
    let st = store.counters();
    let kept = store
        .lookup(&(0..14).map(id).collect::<Vec<_>>())
        .unwrap()
        .iter()
        .filter(|p| **p)
        .count();
    assert!(kept >= 8, "{kept} blocks kept");
    assert_eq!(st.blocks as usize, kept);
    assert_eq!(st.used_bytes, kept as u64 * file_len);
    let out = load_shard(&store, id(13), 3);
    assert_eq!(out.slice(), bufs[3].slice());
}

/// Shard `s` of block `n` in the recycling tests: every block has its own
/// bytes.
fn data(n: u32, s: usize) -> Buf {
    Buf::filled(SHARD, n * 4 + s as u32, 0)
}

/// Dumps blocks `ns`, shards from [`data`], in one task.
fn dump_blocks(store: &PosixStore, ns: std::ops::Range<u32>) {
    let bufs: Vec<Vec<Buf>> = ns
        .clone()
        .map(|n| (0..4).map(|s| data(n, s)).collect())
        .collect();
    let ids: Vec<BlockId> = ns.map(id).collect();
    let t = store.dump(block_shards(&ids, &bufs), 0).unwrap();
    store.wait(t).unwrap();
}

/// A store with room for `files` block files and a spare pool of 2 (so at
/// most 4 x 2 recycled files), for the recycling tests.
fn recycling_store(dir: &std::path::Path, direct: bool, files: u64) -> (PosixConfig, PosixStore) {
    let (cfg, _) = with_spares_and_capacity(dir, direct, 2, files);
    let store = PosixStore::open(cfg.clone()).unwrap();
    (cfg, store)
}

/// Loads each shard of block `n` alone and compares it with [`data`].
fn assert_block_loads(store: &PosixStore, n: u32) {
    for s in 0..4 {
        let out = load_shard(store, id(n), s);
        assert_eq!(out.slice(), data(n, s).slice(), "block {n} shard {s}");
    }
}

/// A burst of dumps larger than the spare pool, into a store at capacity:
/// the dumps take the files of cold blocks (evicted on the spot) instead of
/// creating files, and every block of the burst is whole.
#[test]
fn a_burst_at_capacity_reuses_cold_files_instead_of_creating() {
    let dir = tempfile::tempdir().unwrap();
    let (_, store) = recycling_store(dir.path(), false, 30);
    for n in 0..40 {
        dump_blocks(&store, n..n + 1);
    }
    assert!(store.counters().evictions > 0);
    let before = inodes(dir.path());
    dump_blocks(&store, 100..120);
    let created = inodes(dir.path()).difference(&before).count();
    assert_eq!(created, 0, "{created} file(s) created by the burst");
    for n in 100..120 {
        assert_block_loads(&store, n);
    }
}

#[test]
fn evicted_files_are_recycled_and_rewritten_whole() {
    let dir = tempfile::tempdir().unwrap();
    // Room for 20 files, so the pool (a tenth of the capacity) has 2.
    let (cfg, store) = recycling_store(dir.path(), true, 20);
    // Every block has its own bytes (`data`), so a recycled file still
    // holding its old block's data would fail the comparison below.
    for n in 0..40u32 {
        dump_blocks(&store, n..n + 1);
        // Let the evictor keep up, so recycled files are reused.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while disk_bytes(dir.path()) > cfg.capacity_bytes && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    // The last commit woke the evictor to refill the pool (2 files) from
    // cold blocks: let it finish, so no block leaves between the lookup
    // and the loads below.
    let deadline = std::time::Instant::now() + Duration::from_secs(3);
    while work_files(dir.path()).0 < 2 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(2));
    }
    let st = store.counters();
    assert!(st.evictions >= 20, "{st:?}");
    assert!(st.files_recycled >= 10, "{st:?}");
    // The spare directory never holds more than the pool's cap (4 x 2).
    let spares = work_files(dir.path()).0;
    assert!(spares <= 8, "{spares} spare files");
    assert!(disk_bytes(dir.path()) <= cfg.capacity_bytes);
    let present = store.lookup(&(0..40).map(id).collect::<Vec<_>>()).unwrap();
    assert!(present[39] && !present[0], "{present:?}");
    for n in (0..40u32).filter(|n| present[*n as usize]) {
        assert_block_loads(&store, n);
    }
}

/// The metadata of every file under `root` (blocks and spares; not the
/// store's marker and usage record, which hold a few bytes each).
fn files_under(root: &std::path::Path) -> Vec<std::fs::Metadata> {
    let mut files = Vec::new();
    let mut dirs = vec![root.to_path_buf()];
    while let Some(d) = dirs.pop() {
        // An entry may move or go while it is listed (see `settled`).
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let Ok(m) = e.metadata() else {
                continue;
            };
            if m.is_dir() {
                dirs.push(e.path());
            } else if d != root || !e.file_name().to_string_lossy().starts_with(".ucm-") {
                files.push(m);
            }
        }
    }
    files
}

/// `read` repeated until two reads in a row agree. A walk of the store's
/// directories is not atomic: a file the evictor renames from a block
/// directory into the spare pool meanwhile can be seen twice or not at all.
fn settled<T: PartialEq>(read: impl Fn() -> T) -> T {
    let mut last = read();
    loop {
        let now = read();
        if now == last {
            return now;
        }
        last = now;
    }
}

/// Bytes of every file under `root` (blocks and spares).
fn disk_bytes(root: &std::path::Path) -> u64 {
    settled(|| {
        let mut files: Vec<(u64, u64)> = files_under(root)
            .iter()
            .map(|m| (std::os::unix::fs::MetadataExt::ino(m), m.len()))
            .collect();
        files.sort_unstable();
        files
    })
    .iter()
    .map(|(_, len)| len)
    .sum()
}

/// Spare files take disk space like blocks: a store with a capacity keeps
/// blocks and spares together within it, the spares a stopped store left
/// included.
#[test]
fn blocks_and_spare_files_together_stay_within_the_capacity() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, file_len) = with_spares_and_capacity(dir.path(), false, 8, 20);
    // A stopped store without a capacity left 16 spares of full length.
    let spare_dir = dir.path().join(".work").join("stopped");
    std::fs::create_dir_all(&spare_dir).unwrap();
    std::fs::write(spare_dir.join("lock"), b"").unwrap();
    std::fs::write(spare_dir.join("closed"), b"").unwrap();
    for n in 0..16 {
        let f = std::fs::File::create(spare_dir.join(format!("spare.{n}"))).unwrap();
        f.set_len(file_len).unwrap();
    }
    let store = PosixStore::open(cfg.clone()).unwrap();
    assert!(
        disk_bytes(dir.path()) <= cfg.capacity_bytes,
        "adopted spares beyond the capacity's share: {} byte(s)",
        disk_bytes(dir.path())
    );
    let settle = || {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while disk_bytes(dir.path()) > cfg.capacity_bytes && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    for n in 0..60 {
        dump_blocks(&store, n..n + 1);
        settle();
        let on_disk = disk_bytes(dir.path());
        assert!(
            on_disk <= cfg.capacity_bytes,
            "after block {n}: {on_disk} byte(s) on disk, capacity {}",
            cfg.capacity_bytes
        );
    }
    let st = store.counters();
    assert!(st.files_recycled > 0, "evicted files became spares: {st:?}");
    // Spares took no more than their share: most of the room holds blocks.
    assert!(st.blocks >= 14, "{st:?}");
    assert_block_loads(&store, 59);
}

/// Inode numbers of every file under `root` (blocks and spares).
fn inodes(root: &std::path::Path) -> std::collections::BTreeSet<u64> {
    use std::os::unix::fs::MetadataExt;
    settled(|| files_under(root).iter().map(|m| m.ino()).collect())
}

#[test]
fn a_store_at_capacity_dumps_into_recycled_files_without_creating_any() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, _) = with_spares_and_capacity(dir.path(), false, 4, 40);
    let store = PosixStore::open(cfg.clone()).unwrap();
    let data = Buf::filled(SHARD, 5, 0);
    let settle = |store: &PosixStore| {
        // Evictions keep up with the dumps: within the capacity, and the
        // spare pool (4 files) refilled by recycling. Each commit wakes the
        // evictor, so this takes milliseconds; the bound is below the
        // evictor's periodic pass (5 s), which must not be what refills it.
        let deadline = std::time::Instant::now() + Duration::from_secs(3);
        let spares = || work_files(dir.path()).0;
        let behind = || store.counters().used_bytes > cfg.capacity_bytes || spares() < 4;
        while behind() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(2));
        }
        assert!(
            !behind(),
            "spare pool not refilled within 3 s: {} spare(s), {:?}",
            spares(),
            store.counters()
        );
    };
    let put = |store: &PosixStore, n: u32| {
        let t = store
            .dump((0..4).map(|s| data.shard(id(n), s)).collect(), 0)
            .unwrap();
        store.wait(t).unwrap();
        settle(store);
    };
    for n in 0..60 {
        put(&store, n);
    }
    let before = inodes(dir.path());
    let recycled = store.counters().files_recycled;
    for n in 60..100 {
        put(&store, n);
    }
    let st = store.counters();
    // About one eviction per dump (give or take a batch of look-ahead).
    assert!(st.files_recycled >= recycled + 30, "{st:?}");
    assert!(st.used_bytes <= cfg.capacity_bytes, "{st:?}");
    let after = inodes(dir.path());
    let created: Vec<_> = after.difference(&before).collect();
    assert!(
        created.is_empty(),
        "{} file(s) created at capacity",
        created.len()
    );
    let out = load_shard(&store, id(99), 1);
    assert_eq!(out.slice(), data.slice());
}

#[test]
fn a_destination_changed_during_a_load_fails_it_but_keeps_the_block() {
    use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
    let (_dir, store) = fresh_store(IoEngineKind::Psync, false);
    let data = Buf::filled(SHARD, 3, 0);
    let t = store
        .dump((0..4).map(|s| data.shard(id(1), s)).collect(), 0)
        .unwrap();
    store.wait(t).unwrap();
    let out = Buf::new(SHARD, 0);
    let first = out.slice().as_ptr() as usize;
    let stop = AtomicBool::new(false);
    let mut errors = Vec::new();
    std::thread::scope(|s| {
        // The caller's own bug: it keeps writing a byte of the destination.
        s.spawn(|| {
            // SAFETY: the byte lies inside `out`, alive for the scope; the
            // atomic has the layout of a u8.
            let byte = unsafe { &*(first as *const AtomicU8) };
            let mut v = 0u8;
            while !stop.load(Ordering::Relaxed) {
                v = v.wrapping_add(1) | 1;
                byte.store(v, Ordering::Relaxed);
            }
        });
        // The window is short (between the read and the checksum): try
        // until a load sees it, for up to a few seconds on a busy machine.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while errors.is_empty() && std::time::Instant::now() < deadline {
            match store.load(vec![out.shard(id(1), 0)]) {
                Ok(t) => errors.extend(store.wait(t).err()),
                Err(e) => errors.push(e),
            }
        }
        stop.store(true, Ordering::Relaxed);
    });
    assert!(
        !errors.is_empty(),
        "no load noticed the changing destination"
    );
    for e in &errors {
        assert_eq!(e.code(), -50011, "{e}");
        assert!(e.to_string().contains("stored block is intact"), "{e}");
    }
    // The block was not taken for corrupt: it is still there and loads.
    assert!(store.lookup(&[id(1)]).unwrap()[0]);
    assert_eq!(store.counters().corrupt_loads, 0);
    let clean = load_shard(&store, id(1), 0);
    assert_eq!(clean.slice(), data.slice());
}

#[test]
fn auto_engine_is_io_uring_for_direct_io_and_psync_for_buffered_io() {
    let dir = tempfile::tempdir().unwrap();
    let buffered = PosixStore::open(config(dir.path(), IoEngineKind::Auto, false)).unwrap();
    assert_eq!(buffered.engine_name(), "psync");
    drop(buffered);
    let direct = PosixStore::open(config(dir.path(), IoEngineKind::Auto, true)).unwrap();
    assert_eq!(direct.engine_name(), "uring");
}

#[test]
fn lookup_only_role_refuses_transfers() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path(), IoEngineKind::Psync, false);
    cfg.device_id = -1;
    let store = PosixStore::open(cfg).unwrap();
    let b = Buf::new(SHARD, 0);
    let err = store.dump(vec![b.shard(id(1), 0)], 0).unwrap_err();
    assert_eq!(err.code(), -50008);
    assert!(err.to_string().contains("device_id"));
}

#[test]
fn bad_shards_are_rejected_at_submit() {
    let (_dir, store) = fresh_store(IoEngineKind::Psync, false);
    let b = Buf::new(SHARD, 0);
    let mut s = b.shard(id(1), 0);
    s.segs.pop();
    let err = store.dump(vec![s], 0).unwrap_err();
    assert!(err.to_string().contains("shard_size"), "{err}");
    let err = store.load(vec![b.shard(id(1), 4)]).unwrap_err();
    assert!(err.to_string().contains("out of range"), "{err}");
}

#[test]
fn timeout_fails_the_task() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path(), IoEngineKind::Psync, false);
    cfg.timeout_ms = 1;
    cfg.io_threads = 1;
    let store = PosixStore::open(cfg).unwrap();
    let bufs: Vec<Buf> = (0..4).map(|s| Buf::filled(SHARD, s, 0)).collect();
    // Many blocks on one thread cannot finish within 1 ms.
    let shards: Vec<ShardIo> = (0..400u32)
        .flat_map(|n| bufs.iter().enumerate().map(move |(s, b)| b.shard(id(n), s)))
        .collect();
    let t = store.dump(shards, 0).unwrap();
    std::thread::sleep(Duration::from_millis(5));
    let err = store.wait(t).unwrap_err();
    assert_eq!(err.code(), -50010, "{err}");
    // Whatever was committed is whole.
    let ids: Vec<BlockId> = (0..400).map(id).collect();
    let present = store.lookup(&ids).unwrap();
    assert!(present.iter().filter(|p| **p).count() < 400);
    for (n, p) in present.iter().enumerate() {
        if *p {
            let out = Buf::new(SHARD, 0);
            let t = store.load(vec![out.shard(id(n as u32), 3)]).unwrap();
            // With a 1 ms timeout a single load may itself time out on a slow
            // machine; a success must return the whole shard.
            if store.wait(t).is_ok() {
                assert_eq!(out.slice(), bufs[3].slice());
            }
        }
    }
}
