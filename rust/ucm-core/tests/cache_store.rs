//! Cache store behaviour: round trips over Empty/Posix/an in-memory test
//! backend, fill-once, eviction under pressure, write-back policies, a
//! failing backend, prefetch, statistics, restart, and shared-memory mode
//! (including a participant killed while holding the lock).
//!
//! Longer than most files: one suite with its shared helpers (the
//! in-memory backend, block builders), so every case uses the same ones.

// Test helpers outside #[test] fns: a panic here is a test failure.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use ucm_core::store::cache::table::Geometry;
use ucm_core::store::cache::{CacheConfig, FillPolicy, PolicyKind, WriteBackPolicy};
use ucm_core::store::{CacheStore, EmptyStore, PosixConfig, PosixStore, Store};
use ucm_core::task::TaskRegistry;
use ucm_core::{BlockId, MemSeg, ShardIo, UcmError};

const SHARD: usize = 16 * 1024;
const SHARDS: usize = 4;

fn id(n: u32) -> BlockId {
    let mut b = [0u8; 16];
    b[..4].copy_from_slice(&n.to_le_bytes());
    b[8..12].copy_from_slice(&n.wrapping_mul(2_654_435_761).to_le_bytes());
    BlockId(b)
}

fn content(block: u32, shard: usize) -> Vec<u8> {
    (0..SHARD)
        .map(|i| (i as u32 ^ block.wrapping_mul(131) ^ (shard as u32 * 7)) as u8)
        .collect()
}

fn cfg(slots: usize) -> CacheConfig {
    CacheConfig {
        block_size: SHARD * SHARDS,
        shard_size: SHARD,
        capacity_bytes: (slots * SHARD) as u64,
        write_back_interval_ms: 20,
        write_back_max_backoff_ms: 100,
        timeout_ms: 20_000,
        copy_threads: 2,
        backend_threads: 4,
        ..Default::default()
    }
}

/// One block's worth of caller memory, split in two segments per shard.
struct Blk {
    data: Vec<Vec<u8>>,
}

impl Blk {
    fn filled(n: u32) -> Self {
        Blk {
            data: (0..SHARDS).map(|s| content(n, s)).collect(),
        }
    }
    fn empty() -> Self {
        Blk {
            data: (0..SHARDS).map(|_| vec![0u8; SHARD]).collect(),
        }
    }
    fn shards(&mut self, n: u32) -> Vec<ShardIo> {
        self.data
            .iter_mut()
            .enumerate()
            .map(|(s, d)| ShardIo {
                block: id(n),
                index: s,
                segs: vec![
                    MemSeg {
                        addr: d.as_mut_ptr() as usize,
                        len: SHARD / 2,
                    },
                    MemSeg {
                        addr: d.as_mut_ptr() as usize + SHARD / 2,
                        len: SHARD / 2,
                    },
                ],
            })
            .collect()
    }
    fn check(&self, n: u32) {
        for (s, d) in self.data.iter().enumerate() {
            assert!(d == &content(n, s), "block {n} shard {s} differs");
        }
    }
}

fn dump(store: &dyn Store, n: u32) -> Result<(), UcmError> {
    let mut b = Blk::filled(n);
    let t = store.dump(b.shards(n), 0)?;
    store.wait(t)
}

fn load(store: &dyn Store, n: u32) -> Result<(), UcmError> {
    let mut b = Blk::empty();
    let t = store.load(b.shards(n))?;
    store.wait(t)?;
    b.check(n);
    Ok(())
}

/// An in-memory backend with counters, injected failures and latency.
#[derive(Default)]
struct MemBackend {
    data: Mutex<HashMap<(BlockId, usize), Vec<u8>>>,
    tasks: TaskRegistryHolder,
    loads: AtomicU64,
    dumps: AtomicU64,
    fail_dumps: AtomicBool,
    delay_ms: AtomicU64,
    /// Answers `reads_are_local` (as a Posix store would).
    local: AtomicBool,
    /// Dumps complete only when waited for, as a backend with I/O in
    /// flight would; counts how many were open at once.
    deferred_dumps: AtomicBool,
    open_dumps: Mutex<HashMap<u64, Arc<ucm_core::task::Task>>>,
    most_open_dumps: AtomicU64,
}

struct TaskRegistryHolder(TaskRegistry);

impl Default for TaskRegistryHolder {
    fn default() -> Self {
        TaskRegistryHolder(TaskRegistry::new(20_000))
    }
}

impl MemBackend {
    fn has(&self, n: u32) -> bool {
        let d = self.data.lock();
        (0..SHARDS).all(|s| d.contains_key(&(id(n), s)))
    }
}

impl Store for MemBackend {
    fn name(&self) -> &'static str {
        "Mem"
    }
    fn reads_are_local(&self) -> bool {
        self.local.load(Ordering::SeqCst)
    }
    fn lookup(&self, ids: &[BlockId]) -> ucm_core::Result<Vec<bool>> {
        let d = self.data.lock();
        Ok(ids
            .iter()
            .map(|b| (0..SHARDS).all(|s| d.contains_key(&(*b, s))))
            .collect())
    }
    fn lookup_on_prefix(&self, ids: &[BlockId]) -> ucm_core::Result<isize> {
        let hits = self.lookup(ids)?;
        Ok(hits.iter().position(|h| !h).unwrap_or(hits.len()) as isize - 1)
    }
    fn prefetch(&self, _ids: &[BlockId]) -> ucm_core::Result<()> {
        Ok(())
    }
    fn load(&self, shards: Vec<ShardIo>) -> ucm_core::Result<u64> {
        self.loads.fetch_add(shards.len() as u64, Ordering::SeqCst);
        let task = self.tasks.0.create("load", 1);
        std::thread::sleep(Duration::from_millis(self.delay_ms.load(Ordering::SeqCst)));
        let d = self.data.lock();
        let mut res = Ok(());
        for s in &shards {
            match d.get(&(s.block, s.index)) {
                Some(v) => {
                    let mut off = 0;
                    for g in &s.segs {
                        // SAFETY (test): segments are valid per the Store contract.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                v[off..].as_ptr(),
                                g.addr as *mut u8,
                                g.len,
                            )
                        };
                        off += g.len;
                    }
                }
                None => res = Err(UcmError::NotFound(format!("{} {}", s.block, s.index))),
            }
        }
        task.complete_unit(res);
        Ok(task.id())
    }
    fn dump(&self, shards: Vec<ShardIo>, _p: u64) -> ucm_core::Result<u64> {
        let task = self.tasks.0.create("dump", 1);
        if self.fail_dumps.load(Ordering::SeqCst) {
            task.complete_unit(Err(UcmError::NoSpace("injected".into())));
            return Ok(task.id());
        }
        self.dumps.fetch_add(shards.len() as u64, Ordering::SeqCst);
        let mut d = self.data.lock();
        for s in &shards {
            let mut v = Vec::with_capacity(SHARD);
            for g in &s.segs {
                // SAFETY (test): segments are valid per the Store contract.
                v.extend_from_slice(unsafe {
                    std::slice::from_raw_parts(g.addr as *const u8, g.len)
                });
            }
            d.insert((s.block, s.index), v);
        }
        if self.deferred_dumps.load(Ordering::SeqCst) {
            let mut open = self.open_dumps.lock();
            open.insert(task.id(), task.clone());
            self.most_open_dumps
                .fetch_max(open.len() as u64, Ordering::SeqCst);
        } else {
            task.complete_unit(Ok(()));
        }
        Ok(task.id())
    }
    fn wait(&self, t: u64) -> ucm_core::Result<()> {
        let deferred = self.open_dumps.lock().remove(&t);
        if let Some(task) = deferred {
            std::thread::sleep(Duration::from_millis(2));
            task.complete_unit(Ok(()));
        }
        self.tasks.0.wait(t)
    }
    fn check(&self, t: u64) -> ucm_core::Result<bool> {
        self.tasks.0.check(t)
    }
    fn close(&self) -> ucm_core::Result<()> {
        Ok(())
    }
}

/// Lets a test keep a handle on the backend it gave the cache.
struct Shared(Arc<MemBackend>);

impl Store for Shared {
    fn name(&self) -> &'static str {
        "Mem"
    }
    fn reads_are_local(&self) -> bool {
        self.0.reads_are_local()
    }
    fn lookup(&self, ids: &[BlockId]) -> ucm_core::Result<Vec<bool>> {
        self.0.lookup(ids)
    }
    fn lookup_on_prefix(&self, ids: &[BlockId]) -> ucm_core::Result<isize> {
        self.0.lookup_on_prefix(ids)
    }
    fn prefetch(&self, ids: &[BlockId]) -> ucm_core::Result<()> {
        self.0.prefetch(ids)
    }
    fn load(&self, s: Vec<ShardIo>) -> ucm_core::Result<u64> {
        self.0.load(s)
    }
    fn dump(&self, s: Vec<ShardIo>, p: u64) -> ucm_core::Result<u64> {
        self.0.dump(s, p)
    }
    fn wait(&self, t: u64) -> ucm_core::Result<()> {
        self.0.wait(t)
    }
    fn check(&self, t: u64) -> ucm_core::Result<bool> {
        self.0.check(t)
    }
    fn close(&self) -> ucm_core::Result<()> {
        Ok(())
    }
}

fn mem_cache(c: CacheConfig) -> (CacheStore, Arc<MemBackend>) {
    let be = Arc::new(MemBackend::default());
    let cache = CacheStore::open(c, Arc::new(Shared(be.clone()))).unwrap();
    (cache, be)
}

fn until(what: &str, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "timed out: {what}"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn cache_over_empty_is_a_memory_store() {
    let cache = CacheStore::open(cfg(64), Arc::new(EmptyStore::new(1000))).unwrap();
    assert_eq!(cache.lookup(&[id(1)]).unwrap(), vec![false]);
    dump(&cache, 1).unwrap();
    dump(&cache, 2).unwrap();
    assert_eq!(
        cache.lookup(&[id(1), id(3), id(2)]).unwrap(),
        vec![true, false, true]
    );
    assert_eq!(cache.lookup_on_prefix(&[id(1), id(2), id(3)]).unwrap(), 1);
    load(&cache, 1).unwrap();
    load(&cache, 2).unwrap();
    let e = load(&cache, 3).unwrap_err();
    assert_eq!(e.code(), -50005, "{e}");
    cache.flush().unwrap();
    cache.close().unwrap();
    assert_eq!(cache.lookup(&[id(1)]).unwrap_err().code(), -50012);
}

#[test]
fn stats_follow_a_scripted_sequence() {
    let (cache, _be) = mem_cache(cfg(64));
    dump(&cache, 1).unwrap(); // 4 shards into the cache
    dump(&cache, 1).unwrap(); // all deduplicated
    load(&cache, 1).unwrap(); // 4 l1 hits
    assert!(load(&cache, 7).is_err()); // 4 misses, backend misses too
    cache.flush().unwrap();
    load(&cache, 1).unwrap(); // 4 more l1 hits
    let s = cache.stats();
    assert_eq!(s["load_shards"], 12.0);
    assert_eq!(s["l1_hits"], 8.0);
    assert_eq!(s["l2_hits"], 0.0);
    assert_eq!(s["l2_misses"], 4.0);
    assert!((s["l1_hit_rate"] - 8.0 / 12.0).abs() < 1e-9);
    assert_eq!(s["l2_hit_rate"], 0.0);
    assert_eq!(s["dump_shards"], 8.0);
    assert_eq!(s["dump_dedup"], 4.0);
    assert_eq!(s["bytes_dumped_l1"], (4 * SHARD) as f64);
    assert_eq!(s["bytes_dumped_l2"], (4 * SHARD) as f64);
    assert_eq!(s["bytes_loaded_l1"], (8 * SHARD) as f64);
    assert_eq!(s["write_back_blocks"], 1.0);
    assert_eq!(s["dirty_blocks"], 0.0);
    assert_eq!(s["eviction_count"], 0.0);
    assert_eq!(s["load_tasks"], 3.0);
    assert!(s["p99_load_latency_ms"] >= s["avg_load_latency_ms"] * 0.5);
    // The failed fill left no slot behind: 4 for block 1 only.
    assert_eq!(s["slots_used"], 4.0);
}

#[test]
fn misses_fill_from_the_backend_and_then_hit() {
    let (cache, be) = mem_cache(cfg(64));
    {
        let mut b = Blk::filled(5);
        be.wait(be.dump(b.shards(5), 0).unwrap()).unwrap();
    }
    assert_eq!(cache.lookup(&[id(5)]).unwrap(), vec![true]);
    assert!(!cache.cached(&id(5)).unwrap());
    load(&cache, 5).unwrap();
    assert!(cache.cached(&id(5)).unwrap());
    load(&cache, 5).unwrap();
    assert_eq!(be.loads.load(Ordering::SeqCst), SHARDS as u64);
    let s = cache.stats();
    assert_eq!(s["l1_hit_rate"], 0.5);
    assert_eq!(s["l2_hit_rate"], 1.0);
    assert_eq!(s["bytes_loaded_l2"], (SHARDS * SHARD) as f64);
}

#[test]
fn two_loads_of_a_missing_block_fill_it_once() {
    let (cache, be) = mem_cache(cfg(64));
    {
        let mut b = Blk::filled(9);
        be.wait(be.dump(b.shards(9), 0).unwrap()).unwrap();
    }
    be.delay_ms.store(150, Ordering::SeqCst);
    let cache = Arc::new(cache);
    let threads: Vec<_> = (0..6)
        .map(|_| {
            let c = cache.clone();
            std::thread::spawn(move || load(&*c, 9).unwrap())
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(
        be.loads.load(Ordering::SeqCst),
        SHARDS as u64,
        "filled more than once"
    );
    assert!(cache.stats()["fill_waits"] > 0.0 || cache.stats()["l1_hits"] > 0.0);
}

/// Over a backend that reads locally, a load that finds its block's slots
/// still being filled (here the fill after a first load, which re-reads
/// the block in the background) reads the backend itself instead of
/// waiting for that fill: never slower than the backend alone.
#[test]
fn a_load_over_a_local_backend_reads_past_a_fill_in_progress() {
    let (cache, be) = mem_cache(CacheConfig {
        fill_policy: FillPolicy::ReadAllocate,
        ..cfg(64)
    });
    be.local.store(true, Ordering::SeqCst);
    dump(be.as_ref(), 9).unwrap();
    be.delay_ms.store(300, Ordering::SeqCst);
    let cache = Arc::new(cache);
    let first = {
        let c = cache.clone();
        std::thread::spawn(move || load(&*c, 9).unwrap())
    };
    until("the first load's slots", || {
        cache.stats()["fills"] == SHARDS as f64
    });
    load(&*cache, 9).unwrap();
    let s = cache.stats();
    assert_eq!(s["fill_waits"], 0.0);
    assert_eq!(s["fills_read_past"], SHARDS as f64);
    assert_eq!(s["bypass_loads"], SHARDS as f64);
    first.join().unwrap();
    until("the fill after the first load", || {
        cache.stats()["fills_after_load"] == SHARDS as f64
    });
    load(&*cache, 9).unwrap();
    assert_eq!(cache.stats()["l1_hits"], SHARDS as f64);
}

#[test]
fn write_back_policies() {
    // sync: the backend has the block when wait returns.
    let (cache, be) = mem_cache(CacheConfig {
        write_back_policy: WriteBackPolicy::Sync,
        ..cfg(64)
    });
    dump(&cache, 1).unwrap();
    assert!(be.has(1));
    assert_eq!(cache.stats()["dirty_blocks"], 0.0);
    drop(cache);

    // async: queued, written in the background (interval 20 ms).
    let (cache, be) = mem_cache(CacheConfig {
        write_back_policy: WriteBackPolicy::Async,
        write_back_interval_ms: 60_000,
        write_back_batch_size: 2,
        ..cfg(64)
    });
    dump(&cache, 1).unwrap();
    // One dirty block is below the batch size and far from the interval.
    std::thread::sleep(Duration::from_millis(50));
    assert!(!be.has(1));
    dump(&cache, 2).unwrap(); // the batch is full now
    until("async batch written", || be.has(1) && be.has(2));
    drop(cache);

    // lazy: nothing is written until eviction wants the slot or flush.
    let (cache, be) = mem_cache(CacheConfig {
        write_back_policy: WriteBackPolicy::Lazy,
        eviction_policy: PolicyKind::Lru,
        ..cfg(3 * SHARDS)
    });
    for n in 0..3 {
        dump(&cache, n).unwrap();
    }
    std::thread::sleep(Duration::from_millis(60));
    assert_eq!(be.dumps.load(Ordering::SeqCst), 0);
    // A fourth block finds every slot dirty: it goes straight through to the
    // backend, and the eviction attempt asks for the oldest to be written.
    dump(&cache, 3).unwrap();
    assert!(be.has(3));
    until("lazy victim written", || be.has(0));
    cache.flush().unwrap();
    for n in 0..4 {
        assert!(be.has(n), "block {n}");
    }
}

#[test]
fn write_back_keeps_a_second_batch_in_flight_and_loses_nothing() {
    // One block per batch, lazy: only the flush makes them due, all at
    // once. The backend holds each write open until it is waited for.
    let (cache, be) = mem_cache(CacheConfig {
        write_back_policy: WriteBackPolicy::Lazy,
        write_back_batch_size: 1,
        ..cfg(64)
    });
    be.deferred_dumps.store(true, Ordering::SeqCst);
    for n in 0..8 {
        dump(&cache, n).unwrap();
    }
    cache.flush().unwrap();
    for n in 0..8 {
        assert!(be.has(n), "block {n}");
    }
    assert_eq!(cache.stats()["dirty_blocks"], 0.0);
    // The next batch went to the backend before the previous one was
    // waited for, and never more than two at once.
    assert_eq!(be.most_open_dumps.load(Ordering::SeqCst), 2);
    drop(cache);
}

#[test]
fn eviction_under_pressure_never_drops_dirty_data() {
    let (cache, be) = mem_cache(CacheConfig {
        write_back_policy: WriteBackPolicy::Async,
        ..cfg(4 * SHARDS)
    });
    be.fail_dumps.store(true, Ordering::SeqCst);
    let mut accepted = Vec::new();
    for n in 0..12 {
        // Once the cache is full of dirty blocks, dumps go through to the
        // failing backend and say so; none of them is silently dropped.
        if dump(&cache, n).is_ok() {
            accepted.push(n);
        }
    }
    assert_eq!(accepted.len(), 4, "{accepted:?}");
    until("failures counted", || {
        cache.stats()["write_back_failures"] > 0.0
    });
    let e = cache.flush().unwrap_err();
    assert!(e.to_string().contains("stay dirty"), "{e}");
    // Each block that stays dirty is named.
    for &n in &accepted {
        assert!(e.to_string().contains(&id(n).hex()), "{e}");
    }
    assert_eq!(cache.stats()["dirty_blocks"], 4.0);
    for &n in &accepted {
        load(&cache, n).unwrap(); // still served from the cache
    }
    be.fail_dumps.store(false, Ordering::SeqCst);
    cache.flush().unwrap();
    for &n in &accepted {
        assert!(be.has(n), "block {n} lost");
    }
    assert_eq!(cache.stats()["dirty_blocks"], 0.0);
    // Clean now: new dumps evict them.
    for n in 100..104 {
        dump(&cache, n).unwrap();
    }
    assert!(cache.stats()["eviction_count"] >= 4.0);
}

#[test]
fn sync_write_failure_is_reported_and_retried() {
    let (cache, be) = mem_cache(CacheConfig {
        write_back_policy: WriteBackPolicy::Sync,
        ..cfg(64)
    });
    be.fail_dumps.store(true, Ordering::SeqCst);
    assert_eq!(dump(&cache, 1).unwrap_err().code(), -50009);
    // Kept in the cache, dirty, and retried in the background.
    assert!(cache.cached(&id(1)).unwrap());
    assert_eq!(cache.stats()["dirty_blocks"], 1.0);
    be.fail_dumps.store(false, Ordering::SeqCst);
    until("retry succeeded", || be.has(1));
    until("clean", || cache.stats()["dirty_blocks"] == 0.0);
}

#[test]
fn fill_policies() {
    let (cache, be) = mem_cache(CacheConfig {
        fill_policy: FillPolicy::NoAllocate,
        write_back_policy: WriteBackPolicy::Sync,
        ..cfg(64)
    });
    dump(&cache, 1).unwrap();
    assert!(be.has(1));
    assert!(!cache.cached(&id(1)).unwrap(), "no_allocate keeps nothing");
    load(&cache, 1).unwrap();
    assert!(!cache.cached(&id(1)).unwrap());
    drop(cache);

    let (cache, be) = mem_cache(CacheConfig {
        fill_policy: FillPolicy::WriteAllocate,
        ..cfg(64)
    });
    dump(&cache, 1).unwrap();
    assert!(cache.cached(&id(1)).unwrap(), "write_allocate keeps dumps");
    let mut b = Blk::filled(2);
    be.wait(be.dump(b.shards(2), 0).unwrap()).unwrap();
    load(&cache, 2).unwrap();
    assert!(
        !cache.cached(&id(2)).unwrap(),
        "write_allocate does not fill loads"
    );
}

#[test]
fn prefetch_fills_in_the_background() {
    let (cache, be) = mem_cache(cfg(64));
    for n in 0..3 {
        let mut b = Blk::filled(n);
        be.wait(be.dump(b.shards(n), 0).unwrap()).unwrap();
    }
    cache.prefetch(&[id(0), id(1), id(2), id(42)]).unwrap();
    until("prefetched", || {
        (0..3).all(|n| cache.cached(&id(n)).unwrap())
    });
    let before = be.loads.load(Ordering::SeqCst);
    for n in 0..3 {
        load(&cache, n).unwrap();
    }
    assert_eq!(
        be.loads.load(Ordering::SeqCst),
        before,
        "loads hit the cache"
    );
    assert_eq!(cache.stats()["prefetch_shards"], (3 * SHARDS) as f64);
}

#[test]
fn many_threads_overlapping_ids_every_policy() {
    for policy in PolicyKind::ALL {
        let (cache, _be) = mem_cache(CacheConfig {
            eviction_policy: policy,
            write_back_batch_size: 1,
            ..cfg(6 * SHARDS)
        });
        let cache = Arc::new(cache);
        let threads: Vec<_> = (0..6u32)
            .map(|t| {
                let c = cache.clone();
                std::thread::spawn(move || {
                    let mut x = t.wrapping_mul(2_654_435_761) | 1;
                    for _ in 0..60 {
                        x ^= x << 13;
                        x ^= x >> 17;
                        x ^= x << 5;
                        let n = x % 16;
                        if x % 3 == 0 || !c.lookup(&[id(n)]).unwrap()[0] {
                            dump(&*c, n).unwrap();
                        }
                        load(&*c, n).unwrap();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        cache.flush().unwrap();
        // Everything is clean now: new blocks must evict.
        for n in 1000..1008 {
            dump(&*cache, n).unwrap();
            load(&*cache, n).unwrap();
        }
        let s = cache.stats();
        assert!(s["eviction_count"] > 0.0, "{policy}: {s:?}");
        assert!(s["slots_used"] <= (6 * SHARDS) as f64);
    }
}

/// A Posix backend with the cache tests' geometry under `dir`.
fn posix_cfg(dir: &std::path::Path) -> PosixConfig {
    PosixConfig {
        storage_backends: vec![dir.to_path_buf()],
        block_size: SHARD * SHARDS,
        shard_size: SHARD,
        tensor_size_list: vec![SHARD / 2, SHARD / 2],
        timeout_ms: 10_000,
        ..Default::default()
    }
}

#[test]
fn restart_after_flush_finds_everything_in_posix() {
    let dir = tempfile::tempdir().unwrap();
    let pcfg = posix_cfg(dir.path());
    {
        let posix = Arc::new(PosixStore::open(pcfg.clone()).unwrap());
        let cache = CacheStore::open(
            CacheConfig {
                write_back_interval_ms: 60_000,
                write_back_policy: WriteBackPolicy::Lazy,
                ..cfg(64)
            },
            posix,
        )
        .unwrap();
        for n in 0..8 {
            dump(&cache, n).unwrap();
        }
        cache.flush().unwrap();
        cache.close().unwrap();
    }
    let posix = PosixStore::open(pcfg).unwrap();
    for n in 0..8 {
        assert!(posix.lookup(&[id(n)]).unwrap()[0]);
        load(&posix, n).unwrap();
    }
}

/// The cache's memory is committed in the background from start-up, so a
/// dump into a fresh process's cache pays no first-touch page faults; with
/// `prefault: false` it is committed as slots are used.
#[test]
fn cache_memory_is_committed_at_start_up_unless_disabled() {
    let area = 256 * SHARD;
    let (cache, _) = mem_cache(cfg(256));
    until("the data area committed", || {
        cache.resident_data_bytes().unwrap() >= area
    });
    cache.close().unwrap();
    let (lazy, _) = mem_cache(CacheConfig {
        prefault: false,
        ..cfg(256)
    });
    std::thread::sleep(Duration::from_millis(200));
    assert!(lazy.resident_data_bytes().unwrap() < area / 4);
    dump(&lazy, 1).unwrap();
    assert!(lazy.resident_data_bytes().unwrap() >= SHARDS * SHARD);
    lazy.close().unwrap();
}

/// The start-up commit of the cache's memory waits while a load is in
/// flight: each commit call holds the process's memory map, which the load
/// needs too. It resumes once the load is done.
#[test]
fn the_start_up_commit_waits_while_a_load_is_in_flight() {
    let slots = 16 * 1024;
    let area = slots * SHARD;
    let (cache, be) = mem_cache(cfg(slots));
    dump(be.as_ref(), 1).unwrap();
    be.delay_ms.store(1500, Ordering::SeqCst);
    std::thread::scope(|s| {
        let loading = s.spawn(|| load(&cache, 1));
        std::thread::sleep(Duration::from_millis(200));
        let before = cache.resident_data_bytes().unwrap();
        std::thread::sleep(Duration::from_millis(800));
        let after = cache.resident_data_bytes().unwrap();
        assert!(
            before < area,
            "all {area} bytes committed before the load began"
        );
        // At most the one huge page in progress when the load began.
        assert!(
            after - before <= 2 << 20,
            "{} bytes committed during the load",
            after - before
        );
        loading.join().unwrap().unwrap();
    });
    until("the data area committed", || {
        cache.resident_data_bytes().unwrap() >= area
    });
    cache.close().unwrap();
}

/// A Posix store in `dir` holding blocks `blocks`.
fn posix_holding(dir: &std::path::Path, blocks: &[u32]) -> Arc<PosixStore> {
    let posix = Arc::new(PosixStore::open(posix_cfg(dir)).unwrap());
    for &n in blocks {
        dump(posix.as_ref(), n).unwrap();
    }
    posix
}

/// A 64-slot cache with `fill` over a Posix store holding blocks 0 to 3,
/// in a new temporary directory (returned too: the blocks live there).
fn cache_over_posix(fill: FillPolicy) -> (tempfile::TempDir, CacheStore) {
    let dir = tempfile::tempdir().unwrap();
    let posix = posix_holding(dir.path(), &[0, 1, 2, 3]);
    let cache = CacheStore::open(
        CacheConfig {
            fill_policy: fill,
            ..cfg(64)
        },
        posix,
    )
    .unwrap();
    (dir, cache)
}

/// A load the cache does not keep (here `write_allocate`) reads a local
/// backend straight into the caller's memory: the right bytes, counted as
/// backend reads, nothing cached; an absent block fails and is counted.
#[test]
fn a_bypassed_load_over_posix_reads_into_the_caller() {
    let (_dir, cache) = cache_over_posix(FillPolicy::WriteAllocate);
    for n in 0..4 {
        load(&cache, n).unwrap();
        assert!(!cache.cached(&id(n)).unwrap());
    }
    assert!(load(&cache, 9).is_err());
    let s = cache.stats();
    assert_eq!(s["bypass_loads"], (5 * SHARDS) as f64);
    assert_eq!(s["l2_hits"], (4 * SHARDS) as f64);
    assert_eq!(s["l2_misses"], SHARDS as f64);
    assert_eq!(s["bytes_loaded_l2"], (4 * SHARDS * SHARD) as f64);
}

/// A cold load over a local backend reads straight into the caller's
/// memory and fills the cache afterwards, so the caller never waits for
/// the slot's first touch or a second copy. The cache is filled all the
/// same: the next load of the block is a hit with the same bytes.
#[test]
fn a_cold_load_over_posix_reads_into_the_caller_then_fills_the_cache() {
    let (_dir, cache) = cache_over_posix(FillPolicy::ReadAllocate);
    for n in 0..4 {
        load(&cache, n).unwrap();
    }
    until("the fills after the loads", || {
        cache.stats()["fills_after_load"] == (4 * SHARDS) as f64
    });
    for n in 0..4 {
        assert!(cache.cached(&id(n)).unwrap());
        load(&cache, n).unwrap();
    }
    let s = cache.stats();
    assert_eq!(s["l1_hit_rate"], 0.5);
    assert_eq!(s["bytes_loaded_l2"], (4 * SHARDS * SHARD) as f64);
    cache.close().unwrap();
}

/// Under the default reuse_allocate, the first load of a block a local
/// backend reads into host memory keeps nothing (no second read, no slot
/// touched); the second load keeps it, and the third is a hit. Blocks
/// this process dumped stay cached as before; a prefetch keeps nothing.
#[test]
fn reuse_allocate_keeps_a_loaded_block_on_its_second_load() {
    let dir = tempfile::tempdir().unwrap();
    let posix = posix_holding(dir.path(), &[0, 1, 2, 3, 5]);
    let cache = CacheStore::open(cfg(64), posix).unwrap();
    assert_eq!(cache.config().fill_policy, FillPolicy::ReuseAllocate);
    dump(&cache, 7).unwrap();
    // A prefetch fills no slot either: the hint goes to the backend.
    cache.prefetch(&[id(5)]).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert!(!cache.cached(&id(5)).unwrap());
    assert_eq!(cache.stats()["prefetch_shards"], 0.0);
    for n in 0..4 {
        load(&cache, n).unwrap();
        assert!(!cache.cached(&id(n)).unwrap());
    }
    let s = cache.stats();
    assert_eq!(s["first_loads_not_kept"], (4 * SHARDS) as f64);
    assert_eq!(s["fills"], 0.0);
    assert_eq!(s["slots_used"], SHARDS as f64);
    for n in 0..4 {
        load(&cache, n).unwrap();
    }
    until("the fills after the second loads", || {
        cache.stats()["fills_after_load"] == (4 * SHARDS) as f64
    });
    for n in [0, 1, 2, 3, 7] {
        assert!(cache.cached(&id(n)).unwrap());
        load(&cache, n).unwrap();
    }
    let s = cache.stats();
    assert_eq!(s["first_loads_not_kept"], (4 * SHARDS) as f64);
    assert_eq!(s["l1_hits"], (5 * SHARDS) as f64);
    assert_eq!(s["bytes_loaded_l2"], (8 * SHARDS * SHARD) as f64);
    cache.close().unwrap();
}

/// A dump that finds slots for only some shards of a block writes the rest
/// through to the backend, where the block stays unpublished until the
/// cached shards are written back. A load of that block right after the
/// dump must still succeed: it waits for the block's write-back instead of
/// asking the backend for a block that is only half there.
#[test]
fn a_block_split_between_cache_and_backend_loads_right_after_its_dump() {
    for policy in [WriteBackPolicy::Async, WriteBackPolicy::Lazy] {
        let dir = tempfile::tempdir().unwrap();
        let posix = PosixStore::open(posix_cfg(dir.path())).unwrap();
        let cache = CacheStore::open(
            CacheConfig {
                write_back_interval_ms: 60_000,
                write_back_policy: policy,
                ..cfg(SHARDS + 2)
            },
            Arc::new(posix),
        )
        .unwrap();
        dump(&cache, 0).unwrap(); // four dirty slots, never evicted
        dump(&cache, 1).unwrap(); // two staged, two written through
        assert_eq!(cache.stats()["bypass_dumps"], 2.0, "{policy:?}");
        load(&cache, 1).unwrap_or_else(|e| panic!("{policy:?}: {e}"));
        load(&cache, 0).unwrap();
        cache.close().unwrap();
    }
}

// ------------------------------------------------------------ shared mode

fn shm_cfg(uid: &str) -> CacheConfig {
    CacheConfig {
        share_buffer_enable: true,
        unique_id: uid.into(),
        ..cfg(32)
    }
}

fn uid(tag: &str) -> String {
    format!("rs-test-{tag}-{}", std::process::id())
}

#[test]
fn shared_segment_is_seen_by_a_second_attacher_and_removed_by_the_last() {
    let u = uid("two");
    let a = CacheStore::open(shm_cfg(&u), Arc::new(EmptyStore::new(1000))).unwrap();
    let path = a.shm_path().unwrap().to_string();
    assert!(std::path::Path::new(&path).exists());
    let b = CacheStore::open(shm_cfg(&u), Arc::new(EmptyStore::new(1000))).unwrap();
    dump(&a, 1).unwrap();
    assert!(b.cached(&id(1)).unwrap());
    load(&b, 1).unwrap();
    // A different layout is rejected while someone uses the segment.
    let e = CacheStore::open(
        CacheConfig {
            capacity_bytes: (64 * SHARD) as u64,
            ..shm_cfg(&u)
        },
        Arc::new(EmptyStore::new(1000)),
    )
    .err()
    .unwrap();
    assert!(e.to_string().contains("another layout"), "{e}");
    a.close().unwrap();
    assert!(std::path::Path::new(&path).exists());
    b.close().unwrap();
    assert!(!std::path::Path::new(&path).exists(), "segment leaked");
}

/// `share_buffer_keep`: the last process to leave keeps the segment, and a
/// process opened later serves the blocks from it, without its backend.
#[test]
fn a_kept_segment_outlives_its_last_process_and_serves_the_next() {
    let u = uid("keep");
    let kept = || CacheConfig {
        share_buffer_keep: true,
        write_back_policy: WriteBackPolicy::Sync,
        ..shm_cfg(&u)
    };
    let a = CacheStore::open(kept(), Arc::new(MemBackend::default())).unwrap();
    let path = a.shm_path().unwrap().to_string();
    dump(&a, 1).unwrap();
    dump(&a, 2).unwrap();
    a.close().unwrap();
    drop(a);
    assert!(std::path::Path::new(&path).exists(), "kept segment removed");

    // An empty backend: whatever the next process loads comes from the segment.
    let backend = Arc::new(MemBackend::default());
    let b = CacheStore::open(kept(), backend.clone()).unwrap();
    assert_eq!(
        b.lookup(&[id(1), id(2), id(3)]).unwrap(),
        [true, true, false]
    );
    load(&b, 1).unwrap();
    load(&b, 2).unwrap();
    assert_eq!(backend.loads.load(Ordering::SeqCst), 0, "read the backend");
    b.close().unwrap();
    drop(b);
    assert!(std::path::Path::new(&path).exists());

    // Without `keep`, the last one out removes it, kept blocks and all.
    let c = CacheStore::open(shm_cfg(&u), Arc::new(MemBackend::default())).unwrap();
    load(&c, 2).unwrap();
    c.close().unwrap();
    drop(c);
    assert!(!std::path::Path::new(&path).exists(), "segment leaked");
}

#[test]
fn share_buffer_keep_needs_a_shared_segment() {
    let e = CacheStore::open(
        CacheConfig {
            share_buffer_keep: true,
            ..cfg(32)
        },
        Arc::new(EmptyStore::new(1000)),
    )
    .err()
    .unwrap();
    assert!(e.to_string().contains("share_buffer_keep"), "{e}");
}

/// `/dev/shm` is writable by every local user: a segment someone else
/// could have written is refused, with its path in the message, and left
/// alone.
#[test]
fn a_segment_other_users_can_open_or_own_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let u = uid("foreign");
    let path = format!("/dev/shm/ucm_cache_{u}");
    std::fs::write(&path, vec![0u8; 1 << 20]).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).unwrap();
    let e = CacheStore::open(shm_cfg(&u), Arc::new(EmptyStore::new(1000)))
        .err()
        .unwrap();
    assert!(
        e.to_string().contains("other users") && e.to_string().contains(&path),
        "{e}"
    );
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::os::unix::fs::chown(&path, Some(65534), None).unwrap();
        let e = CacheStore::open(shm_cfg(&u), Arc::new(EmptyStore::new(1000)))
            .err()
            .unwrap();
        assert!(e.to_string().contains("uid 65534"), "{e}");
    }
    assert_eq!(std::fs::read(&path).unwrap(), vec![0u8; 1 << 20], "touched");
    std::fs::remove_file(&path).unwrap();
}

/// Helper run in a child process: attaches, takes the table lock and
/// hangs until killed.
#[test]
#[ignore = "helper for shared_mode_survives_a_participant_killed_holding_the_lock"]
fn helper_hold_lock() {
    let Ok(u) = std::env::var("UCM_CACHE_TEST_UID") else {
        return;
    };
    let c = CacheStore::open(shm_cfg(&u), Arc::new(EmptyStore::new(1000))).unwrap();
    dump(&c, 77).unwrap();
    // Pin a slot through a load that never finishes being consumed, then
    // hold the lock.
    println!("LOCKED");
    use std::io::Write;
    std::io::stdout().flush().unwrap();
    c.debug().map(|d| d.hold_lock_forever());
}

#[test]
fn shared_mode_survives_a_participant_killed_holding_the_lock() {
    let u = uid("kill");
    let a = CacheStore::open(shm_cfg(&u), Arc::new(EmptyStore::new(1000))).unwrap();
    let path = a.shm_path().unwrap().to_string();
    dump(&a, 1).unwrap();
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "helper_hold_lock",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("UCM_CACHE_TEST_UID", &u)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    {
        use std::io::BufRead;
        let out = child.stdout.take().unwrap();
        let mut lines = std::io::BufReader::new(out).lines();
        loop {
            let l = lines.next().unwrap().unwrap();
            if l.contains("LOCKED") {
                break;
            }
        }
    }
    std::thread::sleep(Duration::from_millis(50));
    child.kill().unwrap();
    child.wait().unwrap();
    // The lock comes back (EOWNERDEAD), the table is rebuilt, and both our
    // block and the dead child's are still there.
    load(&a, 1).unwrap();
    load(&a, 77).unwrap();
    dump(&a, 2).unwrap();
    load(&a, 2).unwrap();
    a.close().unwrap();
    assert!(!std::path::Path::new(&path).exists(), "segment leaked");
}

// ------------------------------------------------------ integrity of slots

/// A cache kept in the shared segment `u` over a Posix store in `dir`.
fn kept_over_posix(u: &str, dir: &std::path::Path, policy: WriteBackPolicy) -> CacheStore {
    kept_over_posix_within(u, dir, policy, shm_cfg(u).timeout_ms)
}

/// [`kept_over_posix`] with its `timeout_ms`, which bounds its lock.
fn kept_over_posix_within(
    u: &str,
    dir: &std::path::Path,
    policy: WriteBackPolicy,
    timeout_ms: u64,
) -> CacheStore {
    let posix = PosixStore::open(posix_cfg(dir)).unwrap();
    CacheStore::open(
        CacheConfig {
            share_buffer_keep: true,
            write_back_policy: policy,
            write_back_interval_ms: 60_000,
            timeout_ms,
            ..shm_cfg(u)
        },
        Arc::new(posix),
    )
    .unwrap()
}

/// Offset in the segment file `path` of the slot holding `bytes` (slots
/// start at 4 KiB boundaries).
fn slot_offset(path: &str, bytes: &[u8]) -> usize {
    let raw = std::fs::read(path).unwrap();
    (0..raw.len().saturating_sub(bytes.len()))
        .step_by(4096)
        .find(|&off| &raw[off..off + bytes.len()] == bytes)
        .unwrap_or_else(|| panic!("shard bytes not found in {path}"))
}

/// Flips one byte of the file `path` at `off`, as a stray writer would.
fn flip_byte(path: &str, off: usize) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .write(true)
        .read(true)
        .open(path)
        .unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, off as u64).unwrap();
    f.write_all_at(&[b[0] ^ 0x40], off as u64).unwrap();
}

/// Overwrites `range` of the file `path` with pseudo-random bytes.
fn garble(path: &str, range: std::ops::Range<usize>, seed: u64) {
    use std::os::unix::fs::FileExt;
    let mut x = seed | 1;
    let junk: Vec<u8> = range
        .clone()
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(&junk, range.start as u64).unwrap();
}

/// A byte changed in a kept segment after its last process left is
/// never served: the next process's load finds the slot failing its
/// checksum, drops it, and reads that shard from Posix instead.
#[test]
fn a_byte_flipped_in_a_kept_segment_is_a_miss_served_from_posix() {
    let u = uid("flip-data");
    let dir = tempfile::tempdir().unwrap();
    let a = kept_over_posix(&u, dir.path(), WriteBackPolicy::Sync);
    let path = a.shm_path().unwrap().to_string();
    dump(&a, 1).unwrap();
    dump(&a, 2).unwrap();
    a.close().unwrap();
    drop(a);
    flip_byte(&path, slot_offset(&path, &content(1, 2)) + 1234);

    let b = kept_over_posix(&u, dir.path(), WriteBackPolicy::Sync);
    load(&b, 1).unwrap();
    load(&b, 2).unwrap();
    let s = b.stats();
    assert_eq!(s["corrupt_shards"], 1.0, "{s:?}");
    assert_eq!(s["bypass_loads"], 1.0, "the flipped shard came from Posix");
    assert_eq!(s["l1_hits"], (2 * SHARDS) as f64);
    // Dropped from the cache: the next load reads Posix again, right.
    load(&b, 1).unwrap();
    assert_eq!(b.stats()["corrupt_shards"], 1.0);
    b.close().unwrap();
    drop(b);
    std::fs::remove_file(&path).unwrap();
}

/// Helper run in a child process: dumps block 1 into the kept segment
/// under lazy write-back and exits at once, as a killed engine would,
/// leaving the block dirty in the segment.
#[test]
#[ignore = "helper for a_byte_flipped_before_write_back_never_reaches_posix"]
fn helper_dump_and_exit() {
    let (Ok(u), Ok(dir)) = (
        std::env::var("UCM_CACHE_TEST_UID"),
        std::env::var("UCM_CACHE_TEST_DIR"),
    ) else {
        return;
    };
    let c = kept_over_posix(&u, std::path::Path::new(&dir), WriteBackPolicy::Lazy);
    dump(&c, 1).unwrap();
    assert!(
        !c.backend().lookup(&[id(1)]).unwrap()[0],
        "written back early"
    );
    println!("DUMPED");
    use std::io::Write;
    std::io::stdout().flush().unwrap();
    std::process::exit(0);
}

/// A byte changed in a dirty slot before its write-back: the process that
/// adopts the slot finds it failing its checksum and never writes it, so
/// Posix holds no copy of the block (a miss), and a load of it fails
/// instead of returning the changed bytes.
#[test]
fn a_byte_flipped_before_write_back_never_reaches_posix() {
    let u = uid("flip-dirty");
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "helper_dump_and_exit",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("UCM_CACHE_TEST_UID", &u)
        .env("UCM_CACHE_TEST_DIR", dir.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("DUMPED"),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let path = format!("/dev/shm/ucm_cache_{u}");
    flip_byte(&path, slot_offset(&path, &content(1, 2)) + 77);

    // The next process adopts the dead one's dirty slots and writes them.
    let b = kept_over_posix(&u, dir.path(), WriteBackPolicy::Lazy);
    b.flush().unwrap();
    let s = b.stats();
    assert_eq!(s["corrupt_shards"], 1.0, "{s:?}");
    assert_eq!(s["dirty_blocks"], 0.0, "{s:?}");
    assert!(load(&b, 1).is_err(), "a load served the flipped block");
    b.close().unwrap();
    drop(b);
    std::fs::remove_file(&path).unwrap();
    let posix = PosixStore::open(posix_cfg(dir.path())).unwrap();
    assert!(
        !posix.lookup(&[id(1)]).unwrap()[0],
        "the flipped block reached Posix"
    );
    assert!(load(&posix, 1).is_err());
}

/// A Posix store under a cache, where the slot's bytes change while the
/// store writes them (armed once): stands for a stray writer of the
/// cache's memory striking after the write-back checked the slot.
struct ChangedWhileWritten {
    posix: Arc<PosixStore>,
    armed: AtomicBool,
    changed: Mutex<Option<(BlockId, usize)>>,
}

impl Store for ChangedWhileWritten {
    fn name(&self) -> &'static str {
        "Posix"
    }
    fn reads_are_local(&self) -> bool {
        true
    }
    fn lookup(&self, ids: &[BlockId]) -> ucm_core::Result<Vec<bool>> {
        self.posix.lookup(ids)
    }
    fn lookup_on_prefix(&self, ids: &[BlockId]) -> ucm_core::Result<isize> {
        self.posix.lookup_on_prefix(ids)
    }
    fn prefetch(&self, ids: &[BlockId]) -> ucm_core::Result<()> {
        self.posix.prefetch(ids)
    }
    fn load(&self, s: Vec<ShardIo>) -> ucm_core::Result<u64> {
        self.posix.load(s)
    }
    fn dump(&self, s: Vec<ShardIo>, p: u64) -> ucm_core::Result<u64> {
        if self.armed.swap(false, Ordering::SeqCst) {
            let seg = s[0].segs[0];
            // SAFETY (test): the segment is a slot of the cache above,
            // valid and pinned while this write runs.
            unsafe { *(seg.addr as *mut u8).add(100) ^= 0x40 };
            *self.changed.lock() = Some((s[0].block, s[0].index));
        }
        self.posix.dump(s, p)
    }
    fn wait(&self, t: u64) -> ucm_core::Result<()> {
        self.posix.wait(t)
    }
    fn check(&self, t: u64) -> ucm_core::Result<bool> {
        self.posix.check(t)
    }
    fn close(&self) -> ucm_core::Result<()> {
        self.posix.close()
    }
}

/// The checksum Posix stores for a written-back shard is the one the
/// cache computed from the engine's memory at dump time, never one taken
/// from the slot: bytes changed in the slot while Posix writes them give a
/// block that fails verification (a miss), never one that verifies.
#[test]
fn a_write_back_stores_the_checksum_computed_at_dump_time() {
    write_back_stores_the_dump_time_checksum(true);
}

/// A private tier's memory is trusted on load, but its write-back hands
/// down the dump-time checksum all the same: bytes changed in its memory
/// never reach the tier below as a block that verifies.
#[test]
fn a_private_tier_s_write_back_stores_the_checksum_computed_at_dump_time() {
    write_back_stores_the_dump_time_checksum(false);
}

fn write_back_stores_the_dump_time_checksum(shared: bool) {
    use ucm_core::hashing::xxh3::xxh3_64;
    use ucm_core::store::format::{Layout, ShardHeader, HEADER_LEN};
    let dir = tempfile::tempdir().unwrap();
    let posix = Arc::new(PosixStore::open(posix_cfg(dir.path())).unwrap());
    let backend = Arc::new(ChangedWhileWritten {
        posix: posix.clone(),
        armed: AtomicBool::new(true),
        changed: Mutex::new(None),
    });
    // Shared: a segment's loads check every shard (a private tier trusts
    // its own memory; its write-back is what this test is about).
    let cache = CacheStore::open(
        CacheConfig {
            write_back_policy: WriteBackPolicy::Sync,
            share_buffer_enable: shared,
            unique_id: uid("changed-while-written"),
            ..cfg(64)
        },
        backend.clone(),
    )
    .unwrap();
    dump(&cache, 1).unwrap();
    let (block, shard) = backend.changed.lock().unwrap();
    assert_eq!(block, id(1));

    // The header in the file holds the checksum of the engine's bytes.
    let file = std::fs::read(posix.debug().unwrap().block_path(&block).unwrap()).unwrap();
    let layout = Layout::new(SHARD * SHARDS, SHARD, &[SHARD / 2, SHARD / 2]);
    let at = layout.offset(shard) as usize;
    let hdr = ShardHeader::decode(&file[at..at + HEADER_LEN], &block, shard).unwrap();
    assert_eq!(hdr.checksum, xxh3_64(&content(1, shard)));
    assert_ne!(
        xxh3_64(&file[at + HEADER_LEN..at + HEADER_LEN + SHARD]),
        hdr.checksum,
        "the changed bytes were stored with a checksum of their own"
    );
    // So neither the cache nor Posix ever returns them.
    if shared {
        assert!(
            load(&cache, 1).is_err(),
            "the cache served the changed slot"
        );
        assert_eq!(cache.stats()["corrupt_shards"], 1.0);
    }
    assert!(load(posix.as_ref(), 1).is_err());
    cache.close().unwrap();
}

/// Garbage in a kept segment's slot table is found when the next process
/// joins it: damaged links (buckets, policy state) are rebuilt from the
/// slots, and slots whose metadata is damaged are discarded, their blocks
/// read from Posix instead. Never a panic, never wrong bytes.
#[test]
fn a_garbled_slot_table_is_discarded_and_rebuilt_at_open() {
    use ucm_core::store::cache::table::SlotMeta;
    let u = uid("garble");
    let dir = tempfile::tempdir().unwrap();
    let blocks = [0, 1, 2, 3, 4];
    let a = kept_over_posix(&u, dir.path(), WriteBackPolicy::Sync);
    let path = a.shm_path().unwrap().to_string();
    for n in blocks {
        dump(&a, n).unwrap();
    }
    let c = a.config();
    let geo = Geometry::new(c.slots(), c.shard_size, c.block_size, c.eviction_policy);
    a.close().unwrap();
    drop(a);
    let table = geo.slot_table();
    let links = table.start + geo.n_slots * std::mem::size_of::<SlotMeta>()..table.end;

    // Links only: every slot is still good, and every load a hit.
    garble(&path, links, 0x5eed);
    let b = kept_over_posix(&u, dir.path(), WriteBackPolicy::Sync);
    assert_eq!(b.stats()["slots_discarded_at_join"], 0.0);
    for n in blocks {
        load(&b, n).unwrap();
    }
    assert_eq!(b.stats()["l1_hits"], (blocks.len() * SHARDS) as f64);
    dump(&b, 9).unwrap();
    load(&b, 9).unwrap();
    b.close().unwrap();
    drop(b);

    // The whole table: every slot is discarded, the blocks come from Posix.
    garble(&path, table, 0xbad);
    let b = kept_over_posix(&u, dir.path(), WriteBackPolicy::Sync);
    let s = b.stats();
    assert!(s["slots_discarded_at_join"] > 0.0, "{s:?}");
    for n in blocks {
        load(&b, n).unwrap();
    }
    assert_eq!(b.stats()["l1_hits"], 0.0);
    dump(&b, 9).unwrap();
    load(&b, 9).unwrap();
    b.close().unwrap();
    drop(b);
    std::fs::remove_file(&path).unwrap();
}

/// A shared segment's memory is reserved in `/dev/shm` when it is created
/// (not only checked against the free space), so a `/dev/shm` that fills
/// up later can never take a page the cache then writes (a SIGBUS).
#[test]
fn a_shared_segment_is_reserved_when_created() {
    use std::os::unix::fs::MetadataExt;
    let u = uid("reserve");
    let a = CacheStore::open(
        CacheConfig {
            prefault: false,
            ..shm_cfg(&u)
        },
        Arc::new(EmptyStore::new(1000)),
    )
    .unwrap();
    let meta = std::fs::metadata(a.shm_path().unwrap()).unwrap();
    assert!(
        meta.blocks() * 512 >= meta.len(),
        "{} of {} bytes reserved",
        meta.blocks() * 512,
        meta.len()
    );
    a.close().unwrap();
}

// ------------------------------------------------ a lock nobody can take

/// A child process running one of the `helper_*` tests, its output in
/// files: killed when dropped, so a test that fails leaves no process.
struct Helper {
    child: std::process::Child,
    out: tempfile::NamedTempFile,
    err: tempfile::NamedTempFile,
}

impl Helper {
    fn spawn(name: &str, env: &[(&str, String)]) -> Self {
        let (out, err) = (
            tempfile::NamedTempFile::new().unwrap(),
            tempfile::NamedTempFile::new().unwrap(),
        );
        let child = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", name, "--ignored", "--nocapture"])
            .args(["--test-threads=1"])
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .stdin(std::process::Stdio::piped())
            .stdout(out.reopen().unwrap())
            .stderr(err.reopen().unwrap())
            .spawn()
            .unwrap();
        Helper { child, out, err }
    }

    fn stdout(&self) -> String {
        std::fs::read_to_string(self.out.path()).unwrap()
    }

    fn logs(&self) -> String {
        format!(
            "stdout:\n{}\nstderr:\n{}",
            self.stdout(),
            std::fs::read_to_string(self.err.path()).unwrap()
        )
    }

    /// Waits for `marker` in its output; fails if it exits first or takes
    /// longer than `limit`.
    fn wait_for(&mut self, marker: &str, limit: Duration) {
        let start = Instant::now();
        while !self.stdout().contains(marker) {
            if let Some(st) = self.child.try_wait().unwrap() {
                panic!("helper exited ({st}) before {marker}\n{}", self.logs());
            }
            assert!(
                start.elapsed() < limit,
                "no {marker} within {limit:?}\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn tell(&mut self, line: &str) {
        use std::io::Write;
        let stdin = self.child.stdin.as_mut().unwrap();
        writeln!(stdin, "{line}").unwrap();
        stdin.flush().unwrap();
    }

    /// Waits for it to exit successfully within `limit` (killing it if it
    /// hangs): its stdout.
    fn finish(mut self, limit: Duration) -> String {
        let start = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                assert!(st.success(), "helper failed ({st})\n{}", self.logs());
                return self.stdout();
            }
            if start.elapsed() > limit {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!(
                    "helper hung: still running after {limit:?}\n{}",
                    self.logs()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// `UCM_CACHE_TEST_*` variables of a helper, read back.
fn helper_env(key: &str) -> Option<String> {
    std::env::var(format!("UCM_CACHE_TEST_{key}")).ok()
}

/// Overwrites the file `path` at `off` with `bytes`.
fn write_at(path: &str, off: usize, bytes: &[u8]) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(bytes, off as u64).unwrap();
}

fn inode(path: &str) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).unwrap().ino()
}

/// Helper run in a child process: opens the kept segment over Posix with
/// the `TIMEOUT_MS` given, loads every block of `BLOCKS` (checking their
/// bytes) and reports where they came from.
#[test]
#[ignore = "helper for garbage_in_a_kept_segments_lock_is_replaced_at_the_next_open"]
fn helper_open_kept_and_load() {
    let (Some(u), Some(dir), Some(ms), Some(blocks)) = (
        helper_env("UID"),
        helper_env("DIR"),
        helper_env("TIMEOUT_MS"),
        helper_env("BLOCKS"),
    ) else {
        return;
    };
    let c = kept_over_posix_within(
        &u,
        std::path::Path::new(&dir),
        WriteBackPolicy::Sync,
        ms.parse().unwrap(),
    );
    for n in blocks.split(',') {
        load(&c, n.parse().unwrap()).unwrap();
    }
    let s = c.stats();
    println!("L1-HITS {} BYPASS {}", s["l1_hits"], s["bypass_loads"]);
    c.close().unwrap();
}

/// Garbage over the lock of a kept segment (a stray writer, a write cut
/// short when a process died) never hangs, crashes or fails the next
/// open: the segment is replaced by a fresh one, its blocks read from
/// Posix. Bytes that cannot be a mutex of ours are seen at once; a lock
/// word that only looks taken (naming a live thread that is no
/// participant) costs the lock's bound, here 1 s (half the timeout). On a segment that
/// trusted its lock, the first hung and the second could crash.
#[test]
fn garbage_in_a_kept_segments_lock_is_replaced_at_the_next_open() {
    let u = uid("lock-garbage");
    let dir = tempfile::tempdir().unwrap();
    let a = kept_over_posix(&u, dir.path(), WriteBackPolicy::Sync);
    let path = a.shm_path().unwrap().to_string();
    dump(&a, 1).unwrap();
    dump(&a, 2).unwrap();
    let lock = a.config().clone();
    let lock = Geometry::new(
        lock.slots(),
        lock.shard_size,
        lock.block_size,
        lock.eviction_policy,
    )
    .lock_bytes();
    a.close().unwrap();
    drop(a);
    let env = |ms: u64| {
        vec![
            ("UCM_CACHE_TEST_UID", u.clone()),
            ("UCM_CACHE_TEST_DIR", dir.path().display().to_string()),
            ("UCM_CACHE_TEST_TIMEOUT_MS", ms.to_string()),
            ("UCM_CACHE_TEST_BLOCKS", "1,2".to_string()),
        ]
    };

    // Random bytes over the whole mutex, with a bound (half the timeout)
    // far above the child's limit: seen without waiting for it.
    let before = inode(&path);
    garble(&path, lock.clone(), 0xbad5eed);
    let out =
        Helper::spawn("helper_open_kept_and_load", &env(600_000)).finish(Duration::from_secs(60));
    assert!(out.contains("L1-HITS 0 BYPASS 8"), "{out}");
    assert_ne!(inode(&path), before, "the garbled segment was kept");

    // A well-formed mutex that looks held by a live thread (this process)
    // nobody registered: the lock is not taken within its bound.
    let before = inode(&path);
    let me = std::process::id().to_le_bytes();
    write_at(&path, lock.start, &me); // the lock word
    write_at(&path, lock.start + 8, &me); // its owner
    let out =
        Helper::spawn("helper_open_kept_and_load", &env(2000)).finish(Duration::from_secs(60));
    assert!(out.contains("BYPASS 8"), "{out}");
    assert_ne!(inode(&path), before, "the segment was kept");
    std::fs::remove_file(&path).unwrap();
}

/// Helper run in a child process: tries to open the shared cache
/// `UID` with the `TIMEOUT_MS` given and reports how that went.
#[test]
#[ignore = "helper for a_live_process_holding_the_lock_fails_a_new_open_and_bounds_the_others"]
fn helper_try_open() {
    let (Some(u), Some(ms)) = (helper_env("UID"), helper_env("TIMEOUT_MS")) else {
        return;
    };
    let c = CacheConfig {
        timeout_ms: ms.parse().unwrap(),
        ..shm_cfg(&u)
    };
    match CacheStore::open(c, Arc::new(EmptyStore::new(1000))) {
        Ok(_) => println!("OPENED"),
        Err(e @ UcmError::Timeout(_)) => println!("TIMEOUT-ERROR {e}"),
        Err(e) => println!("OTHER-ERROR {e}"),
    }
}

/// Helper run in a child process: a participant of the shared cache
/// `UID` (bound `TIMEOUT_MS`, sync write-back to its own memory) that
/// stores block 1, says READY, and once told on stdin, tries a lookup, a
/// dump and a load and reports each outcome.
#[test]
#[ignore = "helper for a_live_process_holding_the_lock_fails_a_new_open_and_bounds_the_others"]
fn helper_participant() {
    let (Some(u), Some(ms)) = (helper_env("UID"), helper_env("TIMEOUT_MS")) else {
        return;
    };
    let (c, backend) = mem_cache(CacheConfig {
        timeout_ms: ms.parse().unwrap(),
        write_back_policy: WriteBackPolicy::Sync,
        ..shm_cfg(&u)
    });
    dump(&c, 1).unwrap();
    assert!(backend.has(1));
    println!("READY");
    use std::io::Write;
    std::io::stdout().flush().unwrap();
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    match c.lookup(&[id(1), id(2)]) {
        Ok(v) => println!("LOOKUP Ok {v:?}"),
        Err(e @ UcmError::Timeout(_)) => println!("LOOKUP Timeout {e}"),
        Err(e) => println!("LOOKUP Error {e}"),
    }
    match dump(&c, 2) {
        Ok(()) => println!("DUMP Ok"),
        Err(e @ UcmError::Timeout(_)) => println!("DUMP Timeout {e}"),
        Err(e) => println!("DUMP Error {e}"),
    }
    assert!(!backend.has(2), "a failed dump reached the backend");
    // The cache can't be read: the load is a miss, served by the backend.
    match load(&c, 1) {
        Ok(()) => println!("LOAD Ok"),
        Err(e) => println!("LOAD Error {e}"),
    }
    println!("BYPASS {}", c.stats()["bypass_loads"]);
    let _ = c.close();
    println!("CLOSED");
}

/// A live process that holds the lock forever (stuck, stopped in a
/// debugger) never hangs the others: a new open fails within the lock's
/// bound with a timeout naming the segment, the live processes and what
/// to do; a participant's lookup and dump fail within it, and its load is
/// a miss, read from its backend. On a segment whose lock waits forever,
/// each of them hung.
#[test]
fn a_live_process_holding_the_lock_fails_a_new_open_and_bounds_the_others() {
    let u = uid("lock-held");
    let path = format!("/dev/shm/ucm_cache_{u}");
    let env = vec![
        ("UCM_CACHE_TEST_UID", u.clone()),
        // A 1 s bound: half of it (see `lock_wait`).
        ("UCM_CACHE_TEST_TIMEOUT_MS", "2000".to_string()),
    ];
    let mut part = Helper::spawn("helper_participant", &env);
    part.wait_for("READY", Duration::from_secs(60));
    let mut holder = Helper::spawn("helper_hold_lock", &env);
    holder.wait_for("LOCKED", Duration::from_secs(60));

    let out = Helper::spawn("helper_try_open", &env).finish(Duration::from_secs(60));
    assert!(out.contains("TIMEOUT-ERROR"), "{out}");
    for needle in [
        path.clone(),
        holder.pid().to_string(),
        part.pid().to_string(),
        format!("rm {path}"),
    ] {
        assert!(out.contains(&needle), "no {needle} in: {out}");
    }

    part.tell("GO");
    let out = part.finish(Duration::from_secs(60));
    for needle in [
        "LOOKUP Timeout",
        "DUMP Timeout",
        "LOAD Ok",
        "BYPASS 4",
        "CLOSED",
    ] {
        assert!(out.contains(needle), "no {needle} in: {out}");
    }
    drop(holder);
    let _ = std::fs::remove_file(&path);
}
