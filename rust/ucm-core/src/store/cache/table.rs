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
//! metadata; copies of shard bytes happen outside it, protected by slot
//! states instead:
//!
//! * `FILLING`: one writer (the pinning filler) is producing the bytes;
//!   nobody reads them. Loads of the same shard pin the slot and wait.
//! * `READY`: the bytes are complete and immutable (blocks are
//!   content-addressed, nobody rewrites a ready slot).
//! * `FREE`: not in the index.
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

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};

use xxhash_rust::xxh3::Xxh3;

use super::policy::{Policy, PolicyKind};
use super::region::{fd_size, process_alive, process_start, Mapping, ShmObject};
use crate::block::BlockId;
use crate::error::{Result, UcmError};

/// Most processes that can share one segment at once.
pub const MAX_PARTS: usize = 16;
/// "No slot" / "no participant".
pub const NONE: u32 = u32::MAX;
const MAGIC: u64 = u64::from_le_bytes(*b"UCMCACH1");
/// Version of the header format (bump on any change to the structs here).
const VERSION: u32 = 1;
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
    pins: [u16; MAX_PARTS],
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
        let mut h = Xxh3::new();
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
    detached: std::sync::atomic::AtomicBool,
}

/// Why [`Table::shared`] gave up on an existing segment and starts over.
enum Retry {
    Again,
}

impl Table {
    /// A table in private memory.
    pub fn private(geo: Geometry) -> Result<Self> {
        let map = Mapping::anon(geo.total_len)?;
        let t = Table {
            map,
            geo,
            me: 0,
            shm: None,
            detached: Default::default(),
        };
        t.initialise(std::process::id() as i32)?;
        {
            let mut g = t.lock()?;
            g.register()?;
        }
        Ok(t)
    }

    /// Creates the shared segment for `unique_id`, or attaches to it.
    pub fn shared(unique_id: &str, geo: Geometry) -> Result<Self> {
        let shm = ShmObject::for_id(unique_id)?;
        for _ in 0..50 {
            match Self::try_shared(&shm, &geo)? {
                Ok(t) => return Ok(t),
                Err(Retry::Again) => std::thread::sleep(std::time::Duration::from_millis(20)),
            }
        }
        Err(UcmError::TaskFailed(format!(
            "could not attach to shared cache segment {}: it keeps being replaced",
            shm.path
        )))
    }

    fn try_shared(shm: &ShmObject, geo: &Geometry) -> Result<std::result::Result<Self, Retry>> {
        let shm_copy = || ShmObject {
            name: shm.name.clone(),
            path: shm.path.clone(),
        };
        if let Some(fd) = shm.create(geo.total_len)? {
            let map = Mapping::shared(std::os::fd::AsRawFd::as_raw_fd(&fd), geo.total_len)?;
            let mut t = Table {
                map,
                geo: geo.clone(),
                me: NONE,
                shm: Some(shm_copy()),
                detached: Default::default(),
            };
            t.initialise(std::process::id() as i32)?;
            let me = {
                let mut g = t.lock()?;
                g.register()?
            };
            t.me = me;
            log::info!(
                "created shared cache segment {} ({} slots, {} bytes)",
                shm.path,
                geo.n_slots,
                geo.total_len
            );
            return Ok(Ok(t));
        }
        let Some(fd) = shm.open()? else {
            return Ok(Err(Retry::Again));
        };
        let raw = std::os::fd::AsRawFd::as_raw_fd(&fd);
        // Wait for the creator to size and initialise it.
        let started = std::time::Instant::now();
        let mut size = fd_size(raw)?;
        while size == 0 {
            if started.elapsed() > INIT_WAIT {
                log::warn!(
                    "shared cache segment {} was never sized; replacing it",
                    shm.path
                );
                shm.unlink();
                return Ok(Err(Retry::Again));
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
            size = fd_size(raw)?;
        }
        let map = Mapping::shared(raw, size)?;
        let mut t = Table {
            map,
            geo: geo.clone(),
            me: NONE,
            shm: Some(shm_copy()),
            detached: Default::default(),
        };
        if size < std::mem::size_of::<Header>() + std::mem::size_of::<SharedHdr>() + 64 {
            return Err(layout_error(&shm.path, "is too small to be a UCM cache"));
        }
        loop {
            if t.header().magic.load(Ordering::Acquire) == MAGIC {
                break;
            }
            let creator = t.header().init_pid.load(Ordering::Acquire);
            let creator_gone = creator > 0 && process_start(creator).is_none();
            if creator_gone || started.elapsed() > INIT_WAIT {
                log::warn!(
                    "shared cache segment {}: its creator (pid {creator}) died while \
                     initialising it; replacing it",
                    shm.path
                );
                shm.unlink();
                return Ok(Err(Retry::Again));
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let h = t.header();
        let same = h.version == VERSION
            && h.fingerprint == geo.fingerprint
            && h.total_len as usize == geo.total_len
            && size == geo.total_len;
        if !same {
            if h.version == VERSION {
                // Same header format: we can tell whether anyone still uses it.
                let live = {
                    let g = t.lock_header_only()?;
                    g.live_participants()
                };
                if live == 0 {
                    log::warn!(
                        "shared cache segment {} has another layout and no live user; replacing it",
                        shm.path
                    );
                    shm.unlink();
                    t.shm = None;
                    return Ok(Err(Retry::Again));
                }
            }
            return Err(layout_error(
                &shm.path,
                &format!(
                    "was created with another layout (version {}, fingerprint {:#x}, {} bytes) \
                     than this process's config (version {VERSION}, fingerprint {:#x}, {} bytes): \
                     every participant must use the same block_size, shard_size, \
                     cache_buffer_capacity_gb and eviction_policy",
                    h.version, h.fingerprint, size, geo.fingerprint, geo.total_len
                ),
            ));
        }
        let me = {
            let mut g = t.lock()?;
            if g.shared.unlinked != 0 {
                None
            } else {
                Some(g.register()?)
            }
        };
        match me {
            Some(me) => {
                t.me = me;
                log::info!(
                    "attached to shared cache segment {} as participant {me}",
                    shm.path
                );
                Ok(Ok(t))
            }
            None => {
                t.shm = None;
                Ok(Err(Retry::Again))
            }
        }
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
            let mut attr: libc::pthread_mutexattr_t = std::mem::zeroed();
            libc::pthread_mutexattr_init(&mut attr);
            libc::pthread_mutexattr_setpshared(&mut attr, libc::PTHREAD_PROCESS_SHARED);
            libc::pthread_mutexattr_setrobust(&mut attr, libc::PTHREAD_MUTEX_ROBUST);
            let rc = libc::pthread_mutex_init((*hdr).lock.get(), &attr);
            libc::pthread_mutexattr_destroy(&mut attr);
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
            for m in g.meta.iter_mut() {
                // SAFETY: SlotMeta is plain data; all-zero is a valid value.
                *m = unsafe { std::mem::zeroed() };
                m.owner = NONE;
            }
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

    fn raw_lock(&self) -> Result<bool> {
        // SAFETY: the mutex was initialised before magic was published and
        // lives as long as the mapping.
        let rc = unsafe { libc::pthread_mutex_lock(self.mutex()) };
        match rc {
            0 => Ok(false),
            libc::EOWNERDEAD => {
                // SAFETY: we own the mutex now (EOWNERDEAD grants it).
                unsafe { libc::pthread_mutex_consistent(self.mutex()) };
                Ok(true)
            }
            e => Err(UcmError::os(
                "pthread_mutex_lock",
                self.shm.as_ref().map_or("", |s| s.path.as_str()),
                std::io::Error::from_raw_os_error(e),
            )),
        }
    }

    /// Takes the table lock, repairing the table if its last holder died.
    pub fn lock(&self) -> Result<Guard<'_>> {
        let repaired = self.raw_lock()?;
        // SAFETY: we hold the mutex.
        let mut g = unsafe { self.views() };
        if repaired {
            log::warn!("cache table: a participant died holding the lock; rebuilding the index");
            g.reap_dead();
            g.rebuild();
        }
        Ok(g)
    }

    /// Locks a segment whose geometry may differ from ours: only the header
    /// and participant list may be looked at.
    fn lock_header_only(&self) -> Result<HeaderGuard<'_>> {
        self.raw_lock()?;
        // SAFETY: we hold the mutex; SharedHdr sits at a fixed offset for a
        // given VERSION, independent of the geometry.
        let shared = unsafe { &mut *(self.map.base().add(self.geo.off_shared) as *mut SharedHdr) };
        Ok(HeaderGuard {
            shared,
            mutex: self.mutex(),
        })
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
}

impl Table {
    /// Leaves a shared segment: drops our pins, orphans our dirty slots
    /// (a live participant adopts them) and, if we were the last live
    /// participant and nothing is dirty, removes the segment. Idempotent;
    /// a no-op in private mode.
    pub fn detach(&self) {
        if self.detached.swap(true, Ordering::AcqRel) {
            return;
        }
        let Some(shm) = self.shm.as_ref() else {
            return;
        };
        if self.me == NONE {
            return;
        }
        let Ok(mut g) = self.lock() else {
            return;
        };
        let dirty = g.leave();
        let live = g.live_participants();
        if live == 0 && dirty == 0 {
            g.shared.unlinked = 1;
            shm.unlink();
            log::info!(
                "last participant left; removed shared cache segment {}",
                shm.path
            );
        } else if live == 0 {
            log::warn!(
                "last participant left shared cache segment {} with {dirty} dirty shard(s) \
                 not in the backend; keeping it so the next process writes them back",
                shm.path
            );
        }
    }
}

impl Drop for Table {
    fn drop(&mut self) {
        self.detach();
    }
}

fn layout_error(path: &str, what: &str) -> UcmError {
    UcmError::invalid(format!(
        "shared cache segment {path} {what}; remove it (rm {path}) if no process uses it"
    ))
}

struct HeaderGuard<'a> {
    shared: &'a mut SharedHdr,
    mutex: *mut libc::pthread_mutex_t,
}

impl HeaderGuard<'_> {
    fn live_participants(&self) -> usize {
        self.shared
            .parts
            .iter()
            .filter(|p| p.pid != 0 && process_alive(p.pid, p.start))
            .count()
    }
}

impl Drop for HeaderGuard<'_> {
    fn drop(&mut self) {
        // SAFETY: we locked it in `lock_header_only`.
        unsafe { libc::pthread_mutex_unlock(self.mutex) };
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

impl Guard<'_> {
    fn policy(&mut self) -> Policy<'_> {
        Policy::new(self.geo.policy, self.policy_words, self.geo.n_slots)
    }

    fn bucket_of(&self, block: &BlockId, shard: u32) -> usize {
        (key_hash(block, shard) as usize) & (self.buckets.len() - 1)
    }

    /// The slot holding (block, shard), FILLING or READY.
    pub fn find(&self, block: &BlockId, shard: u32) -> Option<u32> {
        let mut cur = self.buckets[self.bucket_of(block, shard)];
        while cur != NONE {
            let m = &self.meta[cur as usize];
            if m.shard == shard && m.block == block.0 && m.state != FREE {
                return Some(cur);
            }
            cur = m.hnext;
        }
        None
    }

    /// A slot's metadata.
    pub fn meta(&self, slot: u32) -> &SlotMeta {
        &self.meta[slot as usize]
    }

    /// Slots in use.
    pub fn used(&self) -> u32 {
        self.shared.used
    }

    /// Pins a slot (it cannot be reused until unpinned).
    pub fn pin(&mut self, slot: u32) {
        let me = self.me as usize;
        let m = &mut self.meta[slot as usize];
        m.refs += 1;
        m.pins[me] = m.pins[me].saturating_add(1);
    }

    /// Drops one of our pins; a freed slot whose last pin goes returns to
    /// the free list.
    pub fn unpin(&mut self, slot: u32) {
        let me = self.me as usize;
        let m = &mut self.meta[slot as usize];
        if m.pins[me] > 0 {
            m.pins[me] -= 1;
            m.refs = m.refs.saturating_sub(1);
        }
        if m.refs == 0 && m.state == FREE {
            self.push_free(slot);
        }
    }

    /// Records a hit for the eviction policy.
    pub fn access(&mut self, slot: u32) {
        self.policy().access(slot);
    }

    fn push_free(&mut self, slot: u32) {
        self.meta[slot as usize].hnext = self.shared.free_head;
        self.shared.free_head = slot;
    }

    fn link(&mut self, slot: u32) {
        let m = self.meta[slot as usize];
        let b = self.bucket_of(&BlockId(m.block), m.shard);
        self.meta[slot as usize].hnext = self.buckets[b];
        self.buckets[b] = slot;
    }

    fn unlink(&mut self, slot: u32) {
        let m = self.meta[slot as usize];
        let b = self.bucket_of(&BlockId(m.block), m.shard);
        let mut prev = NONE;
        let mut cur = self.buckets[b];
        while cur != NONE {
            let next = self.meta[cur as usize].hnext;
            if cur == slot {
                if prev == NONE {
                    self.buckets[b] = next;
                } else {
                    self.meta[prev as usize].hnext = next;
                }
                break;
            }
            prev = cur;
            cur = next;
        }
        self.meta[slot as usize].hnext = NONE;
    }

    /// Takes a slot for (block, shard): a free one, else the policy's
    /// victim among unpinned, clean, ready slots. Dirty slots the policy
    /// offers are reported to `on_dirty` (lazy write-back writes them so
    /// they can go next time). `None` when every slot is pinned or dirty.
    pub fn alloc(
        &mut self,
        block: &BlockId,
        shard: u32,
        on_dirty: &mut dyn FnMut(u32, &SlotMeta),
    ) -> Option<Allocated> {
        let mut evicted = false;
        let slot = if self.shared.free_head != NONE {
            let s = self.shared.free_head;
            self.shared.free_head = self.meta[s as usize].hnext;
            self.shared.used += 1;
            s
        } else {
            let meta: &[SlotMeta] = self.meta;
            let words = &mut *self.policy_words;
            let mut p = Policy::new(self.geo.policy, words, self.geo.n_slots);
            let victim = p.pick(&mut |s| {
                let m = &meta[s as usize];
                if m.refs == 0 && m.state == READY && m.dirty != 0 {
                    on_dirty(s, m);
                }
                m.refs == 0 && m.state == READY && m.dirty == 0
            })?;
            self.unlink(victim);
            evicted = true;
            victim
        };
        let me = self.me;
        let m = &mut self.meta[slot as usize];
        m.block = block.0;
        m.shard = shard;
        m.state = FILLING;
        m.dirty = 0;
        m.owner = me;
        m.gen = m.gen.wrapping_add(1);
        m.refs = 0;
        m.pins = [0; MAX_PARTS];
        self.link(slot);
        self.pin(slot);
        let key = key_hash(block, shard);
        self.policy().insert(slot, key);
        Some(Allocated { slot, evicted })
    }

    /// The filler finished writing the slot's bytes.
    pub fn fill_done(&mut self, slot: u32, dirty: bool) {
        let me = self.me;
        let m = &mut self.meta[slot as usize];
        m.state = READY;
        m.dirty = u32::from(dirty);
        m.owner = if dirty { me } else { NONE };
    }

    /// Takes the slot out of the index (a failed fill, or a clean entry the
    /// fill policy does not keep). Pins stay; the last unpin frees it.
    pub fn drop_entry(&mut self, slot: u32) {
        if self.meta[slot as usize].state == FREE {
            return;
        }
        self.unlink(slot);
        self.policy().remove(slot);
        let m = &mut self.meta[slot as usize];
        m.state = FREE;
        m.dirty = 0;
        m.owner = NONE;
        self.shared.used = self.shared.used.saturating_sub(1);
        if self.meta[slot as usize].refs == 0 {
            self.push_free(slot);
        }
    }

    /// The slot's bytes must reach the backend (again): a dump of a block
    /// the cache holds clean, which the backend may have dropped since.
    pub fn mark_dirty(&mut self, slot: u32) {
        let me = self.me;
        let m = &mut self.meta[slot as usize];
        m.dirty = 1;
        m.owner = me;
    }

    /// The slot's bytes reached the backend.
    pub fn mark_clean(&mut self, slot: u32) {
        let m = &mut self.meta[slot as usize];
        m.dirty = 0;
        m.owner = NONE;
    }

    /// Dirty slots that nobody alive owns: taken over by us.
    pub fn adopt_orphans(&mut self) -> Vec<(u32, BlockId, u32)> {
        let me = self.me;
        let mut out = Vec::new();
        for (i, m) in self.meta.iter_mut().enumerate() {
            if m.state == READY && m.dirty != 0 && m.owner == NONE {
                m.owner = me;
                out.push((i as u32, BlockId(m.block), m.shard));
            }
        }
        out
    }

    /// Number of participants whose process is alive.
    pub fn live_participants(&self) -> usize {
        self.shared
            .parts
            .iter()
            .filter(|p| p.pid != 0 && process_alive(p.pid, p.start))
            .count()
    }

    fn register(&mut self) -> Result<u32> {
        self.reap_dead();
        let pid = std::process::id() as i32;
        let start = process_start(pid).unwrap_or(0);
        let idx = self
            .shared
            .parts
            .iter()
            .position(|p| p.pid == 0)
            .ok_or_else(|| {
                UcmError::invalid(format!(
                    "share_buffer_enable: {MAX_PARTS} processes already share this cache"
                ))
            })?;
        self.shared.parts[idx] = Participant {
            pid,
            _pad: 0,
            start,
        };
        self.me = idx as u32;
        Ok(idx as u32)
    }

    /// Leaves the table: drops our pins and orphans our dirty slots.
    /// Returns the number of dirty slots left in the table.
    fn leave(&mut self) -> usize {
        let me = self.me as usize;
        self.forget_participant(me);
        self.rebuild();
        self.meta
            .iter()
            .filter(|m| m.state == READY && m.dirty != 0)
            .count()
    }

    /// Drops participant `p`'s pins, half-filled slots and dirty-slot
    /// ownership. The free list is left stale: callers rebuild.
    fn forget_participant(&mut self, p: usize) {
        for i in 0..self.meta.len() {
            let m = self.meta[i];
            if m.pins[p] > 0 {
                let mm = &mut self.meta[i];
                mm.refs = mm.refs.saturating_sub(u32::from(mm.pins[p]));
                mm.pins[p] = 0;
            }
            if m.state == FILLING && m.owner == p as u32 {
                // Half-written: nobody may read it.
                self.drop_entry(i as u32);
            } else if m.state == READY && m.dirty != 0 && m.owner == p as u32 {
                self.meta[i].owner = NONE;
            }
        }
        self.shared.parts[p] = Participant {
            pid: 0,
            _pad: 0,
            start: 0,
        };
    }

    /// Forgets participants whose process is gone. Returns how many.
    pub fn reap_dead(&mut self) -> usize {
        let mut n = 0;
        for p in 0..MAX_PARTS {
            let part = self.shared.parts[p];
            if part.pid != 0 && !process_alive(part.pid, part.start) {
                log::warn!(
                    "cache participant {p} (pid {}) died; dropping its pins and fills",
                    part.pid
                );
                self.forget_participant(p);
                n += 1;
            }
        }
        if n > 0 {
            // Rebuilding is O(slots) and makes the free list exact again.
            self.rebuild();
        }
        n
    }

    /// Rebuilds hash chains, free list, use count and policy order from the
    /// slot metadata.
    fn rebuild(&mut self) {
        self.buckets.fill(NONE);
        self.policy().init();
        self.shared.free_head = NONE;
        self.shared.used = 0;
        for i in (0..self.meta.len()).rev() {
            let s = i as u32;
            if self.meta[i].state == FREE {
                if self.meta[i].refs == 0 {
                    self.push_free(s);
                }
            } else {
                self.link(s);
                let m = self.meta[i];
                let key = key_hash(&BlockId(m.block), m.shard);
                self.policy().insert(s, key);
                self.shared.used += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: u8) -> BlockId {
        BlockId([n; 16])
    }

    #[test]
    fn alloc_find_evict_and_pins() {
        let geo = Geometry::new(4, 4096, 8192, PolicyKind::Lru);
        let t = Table::private(geo).unwrap();
        let mut g = t.lock().unwrap();
        let mut slots = Vec::new();
        for n in 0..4 {
            let a = g.alloc(&id(n), 0, &mut |_, _| {}).unwrap();
            assert!(!a.evicted);
            g.fill_done(a.slot, n == 1);
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
        g.fill_done(a.slot, false);
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
        let t = Table::private(geo).unwrap();
        let mut g = t.lock().unwrap();
        for n in 0..5 {
            let a = g.alloc(&id(n), 3, &mut |_, _| {}).unwrap();
            g.fill_done(a.slot, false);
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
