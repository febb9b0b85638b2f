//! The slot table: which (block, shard) each slot of the cache holds, in
//! what state, who pins it, and the eviction policy's order, all inside the
//! cache's [`region`](super::region) next to the data.
//!
//! # Layout of a region
//!
//! ```text
//! | Header | SharedHdr | SlotMeta[n] | buckets u32[nb] | policy u32[w] | pad to 4 KiB | data: n × stride |
//! ```
//!
//! The data area is page-aligned and every slot's stride is a multiple of
//! 4 KiB, so a slot can be handed to O_DIRECT I/O and registered for DMA as
//! is. Everything but the data is plain `repr(C)` words with no pointers
//! (indices only), because in shared mode each process maps the region at
//! its own address.
//!
//! # Locking
//!
//! One process-shared, robust pthread mutex (in the header) guards all
//! metadata. Every lock of it has a bound, and its bytes are checked
//! before they are trusted (see `lock`). Copies of shard bytes happen
//! outside it, protected by slot states instead:
//!
//! * `FILLING`: one writer (the pinning filler) is producing the bytes;
//!   nobody reads them. Loads of the same shard pin the slot and wait.
//! * `READY`: the bytes are complete and immutable (blocks are
//!   content-addressed, nobody rewrites a ready slot).
//! * `FREE`: not in the index.
//!
//! # Integrity
//!
//! A ready slot carries its shard's checksum, the same xxh3-64 as the
//! block format's header, and a seal binding that checksum to the slot's
//! (block, shard). The checksum is computed once, from the engine's memory
//! when the shard is dumped, or taken from the tier below that verified it
//! when the slot is filled, never from the slot itself: every load out of
//! a slot and every write-back of one checks the bytes against it, and a
//! write-back hands it down unchanged, so bytes changed in the region (a
//! bug, a stray writer of a shared segment) are a miss, never served and
//! never stored below with a checksum of their own. A shared segment's
//! table is checked when a process joins it (see `check`): slots that
//! fail are discarded, and everything derived is rebuilt.
//!
//! A slot is reused only when `refs == 0`, it is `READY` and not dirty, so
//! eviction never takes a slot an in-flight load or dump uses, nor data not
//! yet in the backend. Pins are counted per participant (`pins[p]`), so when
//! a participant dies its pins can be dropped exactly.
//!
//! # Surviving a dead participant
//!
//! If a process dies holding the mutex, the next locker gets `EOWNERDEAD`,
//! marks the mutex consistent and rebuilds everything derived (hash chains,
//! free list, policy order) from the slot metadata, which is the source of
//! truth. Dead participants (found by pid and start time) are reaped: their
//! pins dropped, their half-filled slots freed, their dirty slots orphaned
//! for a live participant to adopt and write back.
//!
//! # Where the code is
//!
//! The table's structures and its initialisation live here; the lock (its
//! bound, its checks, releases deferred past it) is in `lock`, the slot
//! index (lookups, pins, allocation, rebuilding) in `slots`, checking a
//! table found in a segment in `check`, and joining and leaving a shared
//! segment, with the participants, in `shared`.

mod check;
mod lock;
mod shared;
mod slots;

pub use lock::{lock_wait, Release, DEFAULT_LOCK_WAIT};

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::time::Duration;

use crate::hashing::xxh3::Xxh3Stream;

use super::policy::PolicyKind;
use super::region::{Mapping, ShmObject};
use crate::block::BlockId;
use crate::error::{Result, UcmError};

/// Most processes that can share one segment at once.
pub const MAX_PARTS: usize = 16;
/// "No slot" / "no participant".
pub const NONE: u32 = u32::MAX;
const MAGIC: u64 = u64::from_le_bytes(*b"UCMCACH1");
/// Version of the header format (bump on any change to the structs here).
/// 2: slots carry their shard's checksum and a seal.
const VERSION: u32 = 2;
/// How long an attacher waits for the creator to finish initialising.
const INIT_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// State of a slot.
pub const FREE: u32 = 0;
/// Being written by its filler; not readable.
pub const FILLING: u32 = 1;
/// Complete and immutable.
pub const READY: u32 = 2;

#[repr(C)]
struct Header {
    magic: AtomicU64,
    version: u32,
    policy: u32,
    fingerprint: u64,
    total_len: u64,
    init_pid: AtomicI32,
    _pad: u32,
    lock: UnsafeCell<libc::pthread_mutex_t>,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct Participant {
    pid: i32,
    _pad: u32,
    start: u64,
}

/// Metadata guarded by the lock, shared by all participants.
#[repr(C)]
struct SharedHdr {
    free_head: u32,
    used: u32,
    unlinked: u32,
    _pad: u32,
    parts: [Participant; MAX_PARTS],
}

/// One slot's metadata.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct SlotMeta {
    /// Block held (valid unless FREE).
    pub block: [u8; 16],
    /// Shard index held.
    pub shard: u32,
    /// FREE, FILLING or READY.
    pub state: u32,
    /// 1 when the bytes have not reached the backend yet.
    pub dirty: u32,
    /// Participant filling the slot, or owning its write-back; NONE.
    pub owner: u32,
    /// Next slot in the hash chain or the free list.
    hnext: u32,
    /// Pins by everyone.
    pub refs: u32,
    /// Bumped at every reuse.
    pub gen: u32,
    _pad: u32,
    /// xxh3-64 of the shard's bytes (READY slots), as in the block
    /// format's header.
    pub checksum: u64,
    /// [`seal`] of (block, shard, checksum): a READY slot whose seal does
    /// not match has damaged metadata and is never trusted.
    seal: u64,
    pins: [u16; MAX_PARTS],
}

/// Binds a slot's checksum to the shard it holds, so a flipped block id,
/// shard index or checksum in the metadata is caught like flipped data.
fn seal(block: &[u8; 16], shard: u32, checksum: u64) -> u64 {
    let mut raw = [0u8; 28];
    raw[..16].copy_from_slice(block);
    raw[16..20].copy_from_slice(&shard.to_le_bytes());
    raw[20..].copy_from_slice(&checksum.to_le_bytes());
    // Never 0, so a zeroed slot is never sealed.
    crate::hashing::xxh3::xxh3_64(&raw) | 1
}

impl SlotMeta {
    /// A free slot, as initialisation leaves it.
    fn empty() -> Self {
        SlotMeta {
            block: [0; 16],
            shard: 0,
            state: FREE,
            dirty: 0,
            owner: NONE,
            hnext: NONE,
            refs: 0,
            gen: 0,
            _pad: 0,
            checksum: 0,
            seal: 0,
            pins: [0; MAX_PARTS],
        }
    }

    /// The checksum of a READY slot whose seal holds; `None` otherwise.
    pub fn sealed_checksum(&self) -> Option<u64> {
        (self.state == READY && self.seal == seal(&self.block, self.shard, self.checksum))
            .then_some(self.checksum)
    }
}

fn align(n: usize, a: usize) -> usize {
    n.div_ceil(a) * a
}

/// Sizes and offsets of a region, derived from the config.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Geometry {
    /// Number of slots.
    pub n_slots: usize,
    n_buckets: usize,
    /// Bytes of one shard.
    pub shard_size: usize,
    /// Shards in a block.
    pub shard_count: usize,
    /// Distance between slots in the data area (multiple of 4 KiB).
    pub stride: usize,
    /// Eviction policy.
    pub policy: PolicyKind,
    off_shared: usize,
    off_meta: usize,
    off_buckets: usize,
    off_policy: usize,
    /// Offset of slot 0's data.
    pub off_data: usize,
    /// Total bytes of the region.
    pub total_len: usize,
    /// Hash of everything above plus the struct sizes and block geometry.
    pub fingerprint: u64,
}

impl Geometry {
    /// Lays out a region of `n_slots` slots of `shard_size` bytes.
    pub fn new(n_slots: usize, shard_size: usize, block_size: usize, policy: PolicyKind) -> Self {
        let stride = align(shard_size.max(1), 4096);
        let n_buckets = n_slots.max(1).next_power_of_two();
        let off_shared = align(std::mem::size_of::<Header>(), 64);
        let off_meta = align(off_shared + std::mem::size_of::<SharedHdr>(), 64);
        let off_buckets = align(off_meta + n_slots * std::mem::size_of::<SlotMeta>(), 64);
        let off_policy = align(off_buckets + 4 * n_buckets, 64);
        let off_data = align(off_policy + 4 * policy.words(n_slots), 4096);
        let total_len = off_data + n_slots * stride;
        let mut h = Xxh3Stream::new();
        for v in [
            u64::from(VERSION),
            n_slots as u64,
            n_buckets as u64,
            shard_size as u64,
            stride as u64,
            block_size as u64,
            u64::from(policy.code()),
            std::mem::size_of::<SlotMeta>() as u64,
            std::mem::size_of::<SharedHdr>() as u64,
            std::mem::size_of::<Header>() as u64,
            MAX_PARTS as u64,
            total_len as u64,
        ] {
            h.update(&v.to_le_bytes());
        }
        Geometry {
            n_slots,
            n_buckets,
            shard_size,
            shard_count: block_size / shard_size.max(1),
            stride,
            policy,
            off_shared,
            off_meta,
            off_buckets,
            off_policy,
            off_data,
            total_len,
            fingerprint: h.digest(),
        }
    }
}

impl Geometry {
    /// Byte range of the slot table in the region (slot metadata, hash
    /// buckets, policy state), which a process joining a segment checks:
    /// for tests and tools that look into a segment.
    pub fn slot_table(&self) -> std::ops::Range<usize> {
        self.off_meta..self.off_policy + 4 * self.policy.words(self.n_slots)
    }

    /// Byte range of the table's lock (a process-shared pthread mutex) in
    /// the region: for tests and tools that look into a segment.
    pub fn lock_bytes(&self) -> std::ops::Range<usize> {
        let start = std::mem::offset_of!(Header, lock);
        start..start + std::mem::size_of::<libc::pthread_mutex_t>()
    }
}

/// Hash of a (block, shard) key: the id is already a uniform hash, so one
/// multiply-xorshift round to fold the shard in is enough.
pub fn key_hash(block: &BlockId, shard: u32) -> u64 {
    let x = block.prefix_u64()
        ^ u64::from_le_bytes(block.0[8..16].try_into().unwrap_or([0; 8])).rotate_left(17)
        ^ u64::from(shard).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let x = (x ^ (x >> 33)).wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^ (x >> 29)
}

/// A cache's slot table in its region.
pub struct Table {
    map: Mapping,
    geo: Geometry,
    me: u32,
    shm: Option<ShmObject>,
    /// Leave the shared segment in place when the last participant leaves.
    keep: bool,
    detached: AtomicBool,
    /// Slots found invalid, and discarded, when this process joined.
    discarded_at_join: usize,
    /// Bound of every wait for the lock.
    lock_wait: Duration,
    /// Releases that could not have the lock, for the next lock taken.
    deferred: parking_lot::Mutex<Vec<Release>>,
    /// `deferred` is not empty (a hint, read without its mutex).
    has_deferred: AtomicBool,
    /// Locks not taken (timed out, or refused).
    lock_failures: AtomicU64,
}

impl Table {
    /// A table in `map`, not yet joined (`me` is NONE).
    fn in_map(map: Mapping, geo: Geometry, shm: Option<ShmObject>, lock_wait: Duration) -> Self {
        Table {
            map,
            geo,
            me: NONE,
            shm,
            keep: false,
            detached: AtomicBool::new(false),
            discarded_at_join: 0,
            lock_wait,
            deferred: parking_lot::Mutex::new(Vec::new()),
            has_deferred: AtomicBool::new(false),
            lock_failures: AtomicU64::new(0),
        }
    }

    /// A table in private memory, whose locks wait at most `lock_wait`.
    pub fn private(geo: Geometry, lock_wait: Duration) -> Result<Self> {
        let map = Mapping::anon(geo.total_len)?;
        let mut t = Table::in_map(map, geo, None, lock_wait);
        t.me = 0;
        t.initialise(std::process::id() as i32)?;
        {
            let mut g = t.lock()?;
            g.register()?;
        }
        Ok(t)
    }

    fn header(&self) -> &Header {
        // SAFETY: the region starts with a Header (it is at least that long,
        // checked at attach, and page-aligned). Fields other than the atomics
        // and the UnsafeCell'd mutex are written only before `magic` is
        // published, so shared references to them are sound afterwards.
        unsafe { &*(self.map.base() as *const Header) }
    }

    fn mutex(&self) -> *mut libc::pthread_mutex_t {
        self.header().lock.get()
    }

    /// Fills in a fresh region and publishes it (magic last).
    fn initialise(&self, pid: i32) -> Result<()> {
        let base = self.map.base();
        let hdr = base as *mut Header;
        // SAFETY: we are the only user of a region nobody can see yet (a
        // private mapping, or a shared one whose magic is not published);
        // every pointer below stays inside `total_len` per `Geometry::new`.
        unsafe {
            (*hdr).init_pid.store(pid, Ordering::Release);
            (*hdr).version = VERSION;
            (*hdr).policy = self.geo.policy.code();
            (*hdr).fingerprint = self.geo.fingerprint;
            (*hdr).total_len = self.geo.total_len as u64;
            let rc = lock::init_mutex((*hdr).lock.get());
            if rc != 0 {
                return Err(UcmError::os(
                    "pthread_mutex_init",
                    "",
                    std::io::Error::from_raw_os_error(rc),
                ));
            }
        }
        {
            // SAFETY: as above; the lock is not needed before publication,
            // but taking the views through a guard keeps one code path.
            let mut g = unsafe { self.views() };
            g.meta.fill(SlotMeta::empty());
            g.shared.parts = [Participant {
                pid: 0,
                _pad: 0,
                start: 0,
            }; MAX_PARTS];
            g.shared.unlinked = 0;
            g.rebuild();
            std::mem::forget(g);
        }
        self.header().magic.store(MAGIC, Ordering::Release);
        Ok(())
    }

    /// The metadata views, without locking.
    ///
    /// # Safety
    /// The caller holds the mutex, or is the only user of the region.
    unsafe fn views(&self) -> Guard<'_> {
        let base = self.map.base();
        let g = &self.geo;
        // SAFETY: offsets and lengths come from `Geometry::new`, which keeps
        // them inside `total_len` and suitably aligned for u32 / repr(C)
        // structs of 8-byte alignment; exclusivity is the caller's promise.
        unsafe {
            Guard {
                shared: &mut *(base.add(g.off_shared) as *mut SharedHdr),
                meta: std::slice::from_raw_parts_mut(
                    base.add(g.off_meta) as *mut SlotMeta,
                    g.n_slots,
                ),
                buckets: std::slice::from_raw_parts_mut(
                    base.add(g.off_buckets) as *mut u32,
                    g.n_buckets,
                ),
                policy_words: std::slice::from_raw_parts_mut(
                    base.add(g.off_policy) as *mut u32,
                    g.policy.words(g.n_slots),
                ),
                geo: g,
                me: self.me,
                mutex: self.mutex(),
            }
        }
    }

    /// The geometry.
    pub fn geometry(&self) -> &Geometry {
        &self.geo
    }

    /// This process's participant index.
    pub fn me(&self) -> u32 {
        self.me
    }

    /// Start of slot `slot`'s bytes.
    pub fn data(&self, slot: u32) -> *mut u8 {
        debug_assert!((slot as usize) < self.geo.n_slots);
        // SAFETY: inside the mapping per `Geometry::new`.
        unsafe {
            self.map
                .base()
                .add(self.geo.off_data + slot as usize * self.geo.stride)
        }
    }

    /// The data area (for page-locking): start and length.
    pub fn data_area(&self) -> (*mut u8, usize) {
        (self.data(0), self.geo.n_slots * self.geo.stride)
    }

    /// Path of the shared segment, if any.
    pub fn shm_path(&self) -> Option<&str> {
        self.shm.as_ref().map(|s| s.path.as_str())
    }

    /// Slots whose metadata was invalid when this process joined the
    /// segment, discarded then.
    pub fn discarded_at_join(&self) -> usize {
        self.discarded_at_join
    }

    /// Locks of the table not taken (timed out, or refused), by this
    /// process.
    pub fn lock_failures(&self) -> u64 {
        self.lock_failures.load(Ordering::Relaxed)
    }
}

/// Exclusive access to the table's metadata; unlocks on drop.
pub struct Guard<'a> {
    shared: &'a mut SharedHdr,
    meta: &'a mut [SlotMeta],
    buckets: &'a mut [u32],
    policy_words: &'a mut [u32],
    geo: &'a Geometry,
    me: u32,
    mutex: *mut libc::pthread_mutex_t,
}

impl Drop for Guard<'_> {
    fn drop(&mut self) {
        // SAFETY: a Guard only exists while its creator holds the mutex.
        unsafe { libc::pthread_mutex_unlock(self.mutex) };
    }
}

/// What [`Guard::alloc`] did to find a slot.
pub struct Allocated {
    /// The slot, now FILLING, pinned once by us.
    pub slot: u32,
    /// True when a ready slot was evicted for it.
    pub evicted: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::block::test_id as id;

    #[test]
    fn alloc_find_evict_and_pins() {
        let geo = Geometry::new(4, 4096, 8192, PolicyKind::Lru);
        let t = Table::private(geo, DEFAULT_LOCK_WAIT).unwrap();
        let mut g = t.lock().unwrap();
        let mut slots = Vec::new();
        for n in 0..4 {
            let a = g.alloc(&id(n), 0, &mut |_, _| {}).unwrap();
            assert!(!a.evicted);
            g.fill_done(a.slot, n == 1, 7);
            slots.push(a.slot);
        }
        assert_eq!(g.find(&id(2), 0), Some(slots[2]));
        // All pinned: nothing can be evicted.
        assert!(g.alloc(&id(9), 0, &mut |_, _| {}).is_none());
        for &s in &slots {
            g.unpin(s);
        }
        // Slot 1 is dirty: LRU offers 0 first (clean) -> evicted.
        let a = g.alloc(&id(9), 0, &mut |_, _| {}).unwrap();
        assert!(a.evicted);
        assert_eq!(a.slot, slots[0]);
        assert_eq!(g.find(&id(0), 0), None);
        g.fill_done(a.slot, false, 7);
        g.unpin(a.slot);
        // Next victim skips the dirty block 1 and reports it.
        let mut dirty_seen = Vec::new();
        let a = g.alloc(&id(10), 0, &mut |s, _| dirty_seen.push(s)).unwrap();
        assert_eq!(dirty_seen, vec![slots[1]]);
        assert_eq!(a.slot, slots[2]);
        g.drop_entry(a.slot);
        assert_eq!(g.find(&id(10), 0), None);
        g.unpin(a.slot);
        // The freed slot comes back first.
        let b = g.alloc(&id(11), 1, &mut |_, _| {}).unwrap();
        assert_eq!(b.slot, a.slot);
        assert!(!b.evicted);
    }

    #[test]
    fn rebuild_preserves_entries() {
        let geo = Geometry::new(8, 4096, 4096, PolicyKind::S3Fifo);
        let t = Table::private(geo, DEFAULT_LOCK_WAIT).unwrap();
        let mut g = t.lock().unwrap();
        for n in 0..5 {
            let a = g.alloc(&id(n), 3, &mut |_, _| {}).unwrap();
            g.fill_done(a.slot, false, 7);
            g.unpin(a.slot);
        }
        g.rebuild();
        for n in 0..5 {
            assert!(g.find(&id(n), 3).is_some());
        }
        assert_eq!(g.used(), 5);
        for n in 20..28 {
            assert!(g.alloc(&id(n), 0, &mut |_, _| {}).is_some());
        }
    }
}
