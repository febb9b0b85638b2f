//! What the remote-store tests (`s3_store.rs`, `nfs_store.rs`) check the
//! same way for both stores: the block fixtures, the round trip, layer-wise
//! dumps, refused corrupt blocks and a server outage. The servers, and the
//! checks of how each store lays its blocks out, stay in the test files.

use std::time::{Duration, Instant};

use ucm_core::store::Store;
use ucm_core::{BlockId, MemSeg, ShardIo};

pub const SHARD: usize = 16 * 1024;
pub const SHARDS: usize = 4;
pub const ALL: [usize; SHARDS] = [0, 1, 2, 3];

/// The id of test block `n`.
pub fn id(n: u32) -> BlockId {
    let mut b = [0x5au8; 16];
    b[..4].copy_from_slice(&n.to_le_bytes());
    BlockId(b)
}

/// Host memory for whole blocks, each `SHARDS` shards of two tensors.
pub struct Blocks {
    pub data: Vec<Vec<u8>>,
}

impl Blocks {
    /// Blocks `ids`, filled deterministically (differently per block).
    pub fn filled(ids: &[u32]) -> Self {
        let data = ids
            .iter()
            .map(|&b| {
                (0..SHARD * SHARDS)
                    .map(|i| (i as u32).wrapping_mul(2654435761).wrapping_add(b) as u8)
                    .collect()
            })
            .collect();
        Blocks { data }
    }

    /// `n` blocks of zeros.
    pub fn zeroed(n: usize) -> Self {
        Blocks {
            data: vec![vec![0u8; SHARD * SHARDS]; n],
        }
    }

    /// Shards of block `i` (id `ids[i]`) with the given indices.
    pub fn shards(&mut self, ids: &[u32], which: &[usize]) -> Vec<ShardIo> {
        let mut out = Vec::new();
        for (i, &b) in ids.iter().enumerate() {
            for &s in which {
                let base = self.data[i].as_mut_ptr() as usize + s * SHARD;
                out.push(ShardIo {
                    block: id(b),
                    index: s,
                    segs: vec![
                        MemSeg {
                            addr: base,
                            len: SHARD / 2,
                        },
                        MemSeg {
                            addr: base + SHARD / 2,
                            len: SHARD / 2,
                        },
                    ],
                });
            }
        }
        out
    }
}

/// Blocks 1, 2 and 3 dumped by `writer` are seen and read back by `reader`
/// (another store over the same location, or the same store): lookups,
/// prefix lookups, whole and single-shard loads; block 77 is missing.
/// Returns the blocks written.
/// Asserts that opening a store failed with an error naming `what` (the
/// key or variable at fault).
pub fn open_fails_naming<S>(opened: ucm_core::Result<S>, what: &str) {
    let e = opened.err().expect("open must fail");
    assert!(e.to_string().contains(what), "{e}");
}

pub fn round_trip(writer: &dyn Store, reader: &dyn Store) -> Blocks {
    let ids = [1, 2, 3];
    assert_eq!(writer.lookup(&[id(1), id(2)]).unwrap(), vec![false, false]);
    let mut src = Blocks::filled(&ids);
    let t = writer.dump(src.shards(&ids, &ALL), 0).unwrap();
    writer.wait(t).unwrap();
    assert_eq!(
        reader.lookup(&[id(1), id(9), id(3)]).unwrap(),
        vec![true, false, true]
    );
    assert_eq!(
        reader
            .lookup_on_prefix(&[id(1), id(2), id(9), id(3)])
            .unwrap(),
        1
    );
    assert_eq!(reader.lookup_on_prefix(&[]).unwrap(), -1);
    let mut dst = Blocks::zeroed(3);
    let t = reader.load(dst.shards(&ids, &ALL)).unwrap();
    reader.wait(t).unwrap();
    assert_eq!(src.data, dst.data);
    // single shards, out of order, duplicated
    let mut one = Blocks::zeroed(1);
    let t = reader.load(one.shards(&[2], &[3, 1, 3])).unwrap();
    reader.wait(t).unwrap();
    assert_eq!(one.data[0][SHARD..2 * SHARD], src.data[1][SHARD..2 * SHARD]);
    assert_eq!(one.data[0][3 * SHARD..], src.data[1][3 * SHARD..]);
    // a missing block fails the load with NotFound
    let mut none = Blocks::zeroed(1);
    let t = reader.load(none.shards(&[77], &[0])).unwrap();
    assert_eq!(reader.wait(t).unwrap_err().code(), -50005);
    src
}

/// Layer-wise dump of blocks `ids` by `writer`: one task per shard, out of
/// order. `reader` sees none of them until their last shard is in;
/// `partial` runs just before that last shard is dumped. Then `reader`
/// reads them back whole. Returns the blocks written.
pub fn dump_layer_wise(
    writer: &dyn Store,
    reader: &dyn Store,
    ids: &[u32],
    partial: &dyn Fn(),
) -> Blocks {
    let mut src = Blocks::filled(ids);
    let block_ids: Vec<BlockId> = ids.iter().map(|&n| id(n)).collect();
    // one task per layer (shard), last layer first
    for s in [3, 0, 2] {
        let t = writer.dump(src.shards(ids, &[s]), 0).unwrap();
        writer.wait(t).unwrap();
        assert_eq!(reader.lookup(&block_ids).unwrap(), vec![false; ids.len()]);
    }
    partial();
    let t = writer.dump(src.shards(ids, &[1]), 0).unwrap();
    writer.wait(t).unwrap();
    // another engine (another node) sees the blocks and reads them back
    assert_eq!(reader.lookup(&block_ids).unwrap(), vec![true; ids.len()]);
    let mut dst = Blocks::zeroed(ids.len());
    let t = reader.load(dst.shards(ids, &[3, 1, 0, 2])).unwrap();
    reader.wait(t).unwrap();
    assert_eq!(src.data, dst.data);
    src
}

/// Loading shard `shard` of block `block`, whose stored bytes the caller
/// corrupted, fails with a checksum error without touching caller memory,
/// and the block then reads as absent (the store removed it).
pub fn corrupt_load_is_refused(store: &dyn Store, block: u32, shard: usize) {
    let mut dst = Blocks::zeroed(1);
    let t = store.load(dst.shards(&[block], &[shard])).unwrap();
    let e = store.wait(t).unwrap_err();
    assert_eq!(e.code(), -50011, "{e}");
    assert!(
        dst.data[0].iter().all(|&b| b == 0),
        "no corrupt bytes delivered"
    );
    assert_eq!(store.lookup(&[id(block)]).unwrap(), vec![false]);
}

/// A test server the outage check can pause and stop.
pub trait TestServer {
    /// Stops answering (SIGSTOP) without closing connections.
    fn pause(&mut self);
    /// Answers again after `pause`.
    fn resume(&mut self);
    /// Goes away.
    fn stop(&mut self);
    /// Comes back after `stop`, ready for the store's location.
    fn restart(&mut self);
}

/// A store (short timeouts, no lookup cache) through a slow server, a
/// stopped server and its restart: every call returns in bounded time,
/// lookups miss, transfers fail, and dumps go through again within
/// `recover_within` of the restart. Uses blocks `kept` (dumped first) and
/// `added` (dumped during the outage); `kept` must read back after the
/// restart when `restart_keeps_blocks`.
pub fn survive_outage(
    store: &dyn Store,
    server: &mut dyn TestServer,
    kept: u32,
    added: u32,
    restart_keeps_blocks: bool,
    recover_within: Duration,
) {
    let mut src = Blocks::filled(&[kept]);
    let t = store.dump(src.shards(&[kept], &ALL), 0).unwrap();
    store.wait(t).unwrap();

    // Slow server: it stops answering; every call returns within timeout_ms.
    server.pause();
    let started = Instant::now();
    let mut dst = Blocks::zeroed(1);
    let t = store.load(dst.shards(&[kept], &ALL)).unwrap();
    let e = store.wait(t).unwrap_err();
    assert!(
        started.elapsed() < Duration::from_millis(4000),
        "{:?}",
        started.elapsed()
    );
    assert!(matches!(e.code(), -50010 | -1), "{e}");
    assert_eq!(store.lookup(&[id(kept)]).unwrap(), vec![false]);
    server.resume();

    // Stopped server: loads and dumps fail (no hang, no crash), lookups miss.
    server.stop();
    let started = Instant::now();
    let t = store.load(dst.shards(&[kept], &ALL)).unwrap();
    assert!(store.wait(t).is_err());
    let mut more = Blocks::filled(&[added]);
    let t = store.dump(more.shards(&[added], &ALL), 0).unwrap();
    assert!(store.wait(t).is_err());
    assert_eq!(
        store.lookup(&[id(kept), id(added)]).unwrap(),
        vec![false, false]
    );
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "{:?}",
        started.elapsed()
    );
    assert!(store.stats()["breaker_trips"] >= 1.0);

    // Back again: dumps go through.
    server.restart();
    let until = Instant::now() + recover_within;
    loop {
        let t = store.dump(more.shards(&[added], &ALL), 0).unwrap();
        if store.wait(t).is_ok() {
            break;
        }
        assert!(Instant::now() < until, "dumps never recovered");
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(store.lookup(&[id(added)]).unwrap(), vec![true]);
    let mut back = Blocks::zeroed(1);
    let t = store.load(back.shards(&[added], &ALL)).unwrap();
    store.wait(t).unwrap();
    assert_eq!(back.data, more.data);
    if restart_keeps_blocks {
        assert_eq!(store.lookup(&[id(kept)]).unwrap(), vec![true]);
        let mut back = Blocks::zeroed(1);
        let t = store.load(back.shards(&[kept], &ALL)).unwrap();
        store.wait(t).unwrap();
        assert_eq!(back.data, src.data);
    }
    assert!(store.stats()["breaker_trips"] >= 1.0);
}
