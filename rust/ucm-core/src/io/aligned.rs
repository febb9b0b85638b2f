//! Page-aligned memory for O_DIRECT: [`AlignedBuf`] (one owned allocation)
//! and [`BouncePool`] (a budgeted pool handing out [`BounceBuf`]s).
//!
//! # Pool design
//!
//! The pool preallocates **one arena** of `budget` bytes (rounded down to
//! [`DIRECT_ALIGN`]) and carves it with a binary buddy allocator whose size
//! classes are powers of two from 4 KiB up to 1 GiB. A request is rounded up
//! to its class; freed blocks are merged with their buddies again, so memory
//! released by small buffers becomes available to large ones and the same
//! addresses are handed out again (lowest address first).
//!
//! One arena (instead of one allocation per buffer) lets the io_uring engine
//! register the whole pool with the kernel as a handful of fixed buffers
//! (one per GiB of arena): [`BounceBuf::fixed_index`] is the index of the
//! GiB chunk a buffer lies in, and READ/WRITE_FIXED accept any address range
//! inside a registered buffer. Buddy blocks never straddle a GiB boundary.
//!
//! **Exhaustion never blocks.** A request larger than the arena's largest
//! block, or one arriving while the arena is fully handed out, gets a fresh,
//! unpooled [`AlignedBuf`] (never registered; freed on drop). Waiting for a
//! buffer instead could deadlock a caller that holds pool buffers while
//! waiting for the buffer it asks for, and the pool cannot know which
//! buffers are about to come back. The budget is therefore a bound on the
//! memory the pool keeps (and pins), not on what callers may hold at once;
//! [`BouncePool::unpooled_count`] shows how often the budget was exceeded.
//!
//! Pooled buffers are **not zeroed on reuse**: a buffer's contents are
//! whatever the previous holder left in it (the arena starts zeroed).
//!
//! Over 600 lines because its unit tests sit beside the pool (the last
//! 110); the code is 510.

use std::alloc::{self, Layout};
use std::collections::BTreeSet;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::block::MemSeg;

/// Alignment (and length granularity) used for O_DIRECT buffers, offsets and
/// lengths. 4096 satisfies every device here (ext4 on virtio asks for 512).
pub const DIRECT_ALIGN: usize = 4096;

/// Rounds `len` up to a multiple of [`DIRECT_ALIGN`] (0 stays 0).
pub fn align_up(len: usize) -> usize {
    len.div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN
}

/// One zero-initialised allocation aligned to [`DIRECT_ALIGN`].
///
/// The length is exactly what was asked for (it may be 0); the allocation
/// behind it is at least one byte so that the pointer is always real.
/// Large buffers are mapped from the kernel rather than taken from the
/// heap: the allocator zeroes an aligned heap block by writing it, which
/// would make a buffer pool resident before anything uses it, while mapped
/// pages are zero and take no memory until they are touched.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    backing: Backing,
}

/// Where an [`AlignedBuf`]'s memory comes from.
enum Backing {
    Heap(Layout),
    /// An anonymous mapping of this many bytes.
    Mapped(usize),
}

/// Buffers from this size on are mapped (see [`AlignedBuf`]).
const MAP_FROM: usize = 1 << 20;

// SAFETY: `AlignedBuf` uniquely owns its allocation (like `Box<[u8]>`); the
// raw pointer is never shared with another owner, so moving it to another
// thread is sound.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only hands out `&[u8]` / `*const u8` through `&self`;
// mutation requires `&mut self`, so sharing references across threads is as
// sound as for `Box<[u8]>`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// Allocates `len` zeroed bytes aligned to [`DIRECT_ALIGN`].
    ///
    /// Aborts through [`std::alloc::handle_alloc_error`] if the allocator
    /// fails, like every other std collection; use [`AlignedBuf::try_new`] to
    /// get an error instead.
    pub fn new(len: usize) -> Self {
        match Self::try_new(len) {
            Ok(buf) => buf,
            Err(layout) => alloc::handle_alloc_error(layout),
        }
    }

    /// Like [`AlignedBuf::new`] but returns the failed layout when the
    /// allocation fails (or the size overflows, with a 1-byte layout).
    pub fn try_new(len: usize) -> Result<Self, Layout> {
        let layout =
            Layout::from_size_align(len.max(1), DIRECT_ALIGN).map_err(|_| Layout::new::<u8>())?;
        if len >= MAP_FROM {
            let map_len = align_up(len);
            // SAFETY: a fresh private anonymous mapping: no file, no fixed
            // address, so it can't alias any memory Rust knows of.
            let raw = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    map_len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if raw == libc::MAP_FAILED {
                return Err(layout);
            }
            let ptr = NonNull::new(raw.cast::<u8>()).ok_or(layout)?;
            return Ok(Self {
                ptr,
                len,
                backing: Backing::Mapped(map_len),
            });
        }
        // SAFETY: `layout` has a non-zero size (`len.max(1)`) and a valid
        // power-of-two alignment, as `alloc_zeroed` requires.
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or(layout)?;
        Ok(Self {
            ptr,
            len,
            backing: Backing::Heap(layout),
        })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Start of the buffer (aligned to [`DIRECT_ALIGN`]).
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// Mutable start of the buffer (aligned to [`DIRECT_ALIGN`]).
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` points to an allocation of at least `len` bytes that
        // was zero-initialised at creation and is owned by `self`; the shared
        // borrow of `self` keeps it alive and unmutated for the slice's life.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` guarantees exclusivity.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// The whole buffer as one segment for an [`IoRequest`](super::IoRequest).
    pub fn as_seg(&self) -> MemSeg {
        MemSeg {
            addr: self.ptr.as_ptr() as usize,
            len: self.len,
        }
    }

    /// Raw start pointer for the pool's arena, where disjoint sub-ranges are
    /// handed to different owners and no reference to the whole is formed.
    fn base_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.as_mut_slice()
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        match self.backing {
            // SAFETY: `ptr` was returned by `alloc_zeroed(layout)` and is
            // freed exactly once, here.
            Backing::Heap(layout) => unsafe { alloc::dealloc(self.ptr.as_ptr(), layout) },
            // SAFETY: `ptr` and `map_len` are the mapping made in `try_new`,
            // unmapped exactly once, here; nothing borrows it any more.
            Backing::Mapped(map_len) => unsafe {
                libc::munmap(self.ptr.as_ptr().cast(), map_len);
            },
        }
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .finish()
    }
}

/// Smallest size class (order 0).
const MIN_BLOCK: usize = DIRECT_ALIGN;
/// Largest block and the size of one registered fixed buffer (the kernel
/// caps one registered buffer at 1 GiB).
const MAX_BLOCK: usize = 1 << 30;
const MAX_ORDER: usize = (MAX_BLOCK / MIN_BLOCK).trailing_zeros() as usize;

fn block_size(order: usize) -> usize {
    MIN_BLOCK << order
}

/// Buddy allocator over `[0, arena_len)`; offsets only, no memory.
struct Buddy {
    /// Free block offsets per order (BTreeSet: lowest address first, and
    /// O(log n) buddy lookup).
    free: Vec<BTreeSet<usize>>,
    /// Largest order that exists in this arena.
    top_order: Option<usize>,
}

impl Buddy {
    /// Splits the arena into its binary decomposition, largest block first,
    /// so every block's offset is a multiple of its size and buddies of the
    /// top-level blocks never exist (they would lie past the arena).
    fn new(arena_len: usize) -> Self {
        let mut free = vec![BTreeSet::new(); MAX_ORDER + 1];
        let mut top_order = None;
        let mut offset = 0;
        let mut rest = arena_len / MIN_BLOCK * MIN_BLOCK;
        // Whole GiB blocks first.
        while rest >= MAX_BLOCK {
            free[MAX_ORDER].insert(offset);
            top_order = Some(MAX_ORDER);
            offset += MAX_BLOCK;
            rest -= MAX_BLOCK;
        }
        for order in (0..MAX_ORDER).rev() {
            if rest & block_size(order) != 0 {
                free[order].insert(offset);
                top_order = Some(top_order.map_or(order, |t: usize| t.max(order)));
                offset += block_size(order);
                rest -= block_size(order);
            }
        }
        Self { free, top_order }
    }

    fn alloc(&mut self, order: usize) -> Option<usize> {
        let top = self.top_order?;
        if order > top {
            return None;
        }
        let from = (order..=top).find(|&o| !self.free[o].is_empty())?;
        let offset = self.free[from].pop_first()?;
        // Split down, keeping the lower half and freeing the upper halves.
        for o in (order..from).rev() {
            self.free[o].insert(offset + block_size(o));
        }
        Some(offset)
    }

    fn release(&mut self, mut offset: usize, mut order: usize) {
        while order < MAX_ORDER {
            let buddy = offset ^ block_size(order);
            if !self.free[order].remove(&buddy) {
                break;
            }
            offset = offset.min(buddy);
            order += 1;
        }
        self.free[order].insert(offset);
    }
}

struct PoolInner {
    arena: AlignedBuf,
    buddy: Mutex<Buddy>,
    registered: AtomicBool,
    unpooled: AtomicU64,
}

/// A budgeted pool of [`DIRECT_ALIGN`]-aligned buffers (see the module docs
/// for the allocation and exhaustion policy). Cloning shares the pool.
#[derive(Clone)]
pub struct BouncePool {
    inner: Arc<PoolInner>,
}

impl std::fmt::Debug for BouncePool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BouncePool")
            .field("capacity", &self.capacity())
            .field("registered", &self.is_registered())
            .field("unpooled", &self.unpooled_count())
            .finish()
    }
}

impl BouncePool {
    /// A pool keeping at most `budget_bytes` (rounded down to 4 KiB) of
    /// preallocated memory. The arena is allocated zeroed up front; the OS
    /// backs it lazily unless it gets registered (which pins it). A budget of
    /// 0 makes every buffer unpooled.
    pub fn new(budget_bytes: usize) -> Self {
        let arena_len = budget_bytes / MIN_BLOCK * MIN_BLOCK;
        let (arena, arena_len) = match AlignedBuf::try_new(arena_len) {
            Ok(buf) => (buf, arena_len),
            Err(_) => {
                log::warn!(
                    "bounce pool: cannot allocate {arena_len} bytes; every bounce buffer will be unpooled"
                );
                (AlignedBuf::new(0), 0)
            }
        };
        Self {
            inner: Arc::new(PoolInner {
                arena,
                buddy: Mutex::new(Buddy::new(arena_len)),
                registered: AtomicBool::new(false),
                unpooled: AtomicU64::new(0),
            }),
        }
    }

    /// Bytes of pooled memory (the arena).
    pub fn capacity(&self) -> usize {
        self.inner.arena.len()
    }

    /// A buffer of at least `len` bytes, its length rounded up to
    /// [`DIRECT_ALIGN`] (a request for 0 bytes gets 4 KiB). Never blocks:
    /// falls back to an unpooled allocation when the pool cannot serve it.
    pub fn get(&self, len: usize) -> BounceBuf {
        let want = align_up(len.max(1));
        let order = want
            .div_ceil(MIN_BLOCK)
            .next_power_of_two()
            .trailing_zeros() as usize;
        if order <= MAX_ORDER {
            if let Some(offset) = self.inner.buddy.lock().alloc(order) {
                return BounceBuf {
                    kind: Kind::Pooled {
                        pool: Arc::clone(&self.inner),
                        offset,
                        order,
                    },
                    len: want,
                };
            }
        }
        self.inner.unpooled.fetch_add(1, Ordering::Relaxed);
        BounceBuf {
            kind: Kind::Unpooled(AlignedBuf::new(want)),
            len: want,
        }
    }

    /// Whether the arena is currently registered with an io_uring.
    pub fn is_registered(&self) -> bool {
        self.inner.registered.load(Ordering::Acquire)
    }

    /// How many buffers were handed out unpooled (pool exhausted, or request
    /// larger than the largest pool block) since the pool was created.
    pub fn unpooled_count(&self) -> u64 {
        self.inner.unpooled.load(Ordering::Relaxed)
    }

    /// The arena as fixed-buffer iovecs (one per GiB), for
    /// `register_buffers`. Empty when the pool has no arena.
    pub(crate) fn registration_iovecs(&self) -> Vec<libc::iovec> {
        let base = self.inner.arena.base_ptr();
        let len = self.inner.arena.len();
        (0..len)
            .step_by(MAX_BLOCK)
            .map(|start| libc::iovec {
                // SAFETY: `start < len`, so the offset stays inside the arena
                // allocation.
                iov_base: unsafe { base.add(start) }.cast(),
                iov_len: (len - start).min(MAX_BLOCK),
            })
            .collect()
    }

    /// Records whether the arena is registered (set by the io_uring engine
    /// after `register_buffers` succeeded on all its rings).
    pub(crate) fn set_registered(&self, registered: bool) {
        self.inner.registered.store(registered, Ordering::Release);
    }

    /// Buffers currently free in the pool, in bytes (for tests and stats).
    pub fn free_bytes(&self) -> usize {
        let buddy = self.inner.buddy.lock();
        buddy
            .free
            .iter()
            .enumerate()
            .map(|(order, set)| set.len() * block_size(order))
            .sum()
    }
}

enum Kind {
    Pooled {
        pool: Arc<PoolInner>,
        offset: usize,
        order: usize,
    },
    Unpooled(AlignedBuf),
}

/// An aligned buffer from a [`BouncePool`]; derefs to its bytes and returns
/// to the pool on drop.
///
/// Its length is the requested length rounded up to [`DIRECT_ALIGN`] (the
/// underlying pool block may be larger). Contents are unspecified on
/// arrival (not zeroed on reuse).
pub struct BounceBuf {
    kind: Kind,
    len: usize,
}

// SAFETY: a pooled `BounceBuf` exclusively owns the byte range
// `[offset, offset + block)` of the arena (the buddy allocator never hands
// out overlapping blocks) and keeps the arena alive through the `Arc`; an
// unpooled one owns an `AlignedBuf`. Either way it behaves like a
// `Box<[u8]>` and may move between threads.
unsafe impl Send for BounceBuf {}
// SAFETY: as for `AlignedBuf`: `&self` only yields shared views.
unsafe impl Sync for BounceBuf {}

impl BounceBuf {
    /// Length in bytes (a multiple of [`DIRECT_ALIGN`]).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true (a bounce buffer holds at least 4 KiB); for clippy.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Start of the buffer (aligned to [`DIRECT_ALIGN`]).
    pub fn as_ptr(&self) -> *const u8 {
        self.raw_ptr()
    }

    /// Mutable start of the buffer.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.raw_ptr()
    }

    fn raw_ptr(&self) -> *mut u8 {
        match &self.kind {
            // SAFETY: `offset + block_size(order) <= arena.len()` by the
            // buddy allocator's construction, so the pointer stays in bounds.
            Kind::Pooled { pool, offset, .. } => unsafe { pool.arena.base_ptr().add(*offset) },
            Kind::Unpooled(buf) => buf.base_ptr(),
        }
    }

    /// The first `len` bytes as a segment for an
    /// [`IoRequest`](super::IoRequest).
    ///
    /// # Panics
    /// If `len` exceeds [`BounceBuf::len`].
    pub fn as_seg(&self, len: usize) -> MemSeg {
        assert!(
            len <= self.len,
            "bounce segment of {len} bytes exceeds the buffer's {} bytes",
            self.len
        );
        MemSeg {
            addr: self.raw_ptr() as usize,
            len,
        }
    }

    /// Index of the kernel-registered buffer holding this one, when the pool
    /// is registered with the engine's io_uring (put it in
    /// [`IoRequest::fixed`](super::IoRequest::fixed)); `None` otherwise.
    pub fn fixed_index(&self) -> Option<u16> {
        match &self.kind {
            Kind::Pooled { pool, offset, .. } if pool.registered.load(Ordering::Acquire) => {
                u16::try_from(offset / MAX_BLOCK).ok()
            }
            _ => None,
        }
    }

    /// True when the buffer came from the pool (false: unpooled fallback).
    pub fn is_pooled(&self) -> bool {
        matches!(self.kind, Kind::Pooled { .. })
    }
}

impl Deref for BounceBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: the range `[raw_ptr, raw_ptr + len)` lies inside memory
        // this buffer exclusively owns (see the `Send` impl), initialised
        // (zeroed arena or earlier writes), and alive while `self` is.
        unsafe { std::slice::from_raw_parts(self.raw_ptr(), self.len) }
    }
}

impl DerefMut for BounceBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`; `&mut self` makes the view exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.raw_ptr(), self.len) }
    }
}

impl Drop for BounceBuf {
    fn drop(&mut self) {
        if let Kind::Pooled {
            pool,
            offset,
            order,
        } = &self.kind
        {
            pool.buddy.lock().release(*offset, *order);
        }
    }
}

impl std::fmt::Debug for BounceBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BounceBuf")
            .field("ptr", &self.raw_ptr())
            .field("len", &self.len)
            .field("pooled", &self.is_pooled())
            .field("fixed", &self.fixed_index())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    /// Pages of `buf` resident in memory (mincore).
    fn resident_pages(buf: &AlignedBuf) -> usize {
        let pages = align_up(buf.len()) / 4096;
        let mut vec = vec![0u8; pages];
        // SAFETY: the range is the buffer's own page-aligned mapping and
        // `vec` has one byte per page, as mincore requires.
        let rc = unsafe { libc::mincore(buf.ptr.as_ptr().cast(), pages * 4096, vec.as_mut_ptr()) };
        assert_eq!(rc, 0);
        vec.iter().filter(|b| **b & 1 == 1).count()
    }

    /// A large buffer (a pool's arena) takes no memory until it is used.
    #[test]
    fn a_large_buffer_is_not_resident_until_touched() {
        let mut buf = AlignedBuf::new(64 << 20);
        assert_eq!(resident_pages(&buf), 0);
        assert!(buf.as_slice().iter().step_by(4096).all(|b| *b == 0));
        buf.as_mut_slice()[..8192].fill(7);
        assert!(resident_pages(&buf) >= 2);
        assert_eq!(buf.as_ptr() as usize % DIRECT_ALIGN, 0);
    }

    use super::*;

    #[test]
    fn aligned_buf_is_aligned_and_zeroed() {
        for len in [0, 1, 100, 4096, 65536 + 3] {
            let mut b = AlignedBuf::new(len);
            assert_eq!(b.len(), len);
            assert_eq!(b.as_ptr() as usize % DIRECT_ALIGN, 0);
            assert!(b.iter().all(|&x| x == 0));
            b.as_mut_slice().fill(7);
            assert!(b.as_slice().iter().all(|&x| x == 7));
        }
    }

    #[test]
    fn pool_rounds_up_and_aligns() {
        let pool = BouncePool::new(1 << 20);
        let b = pool.get(100);
        assert_eq!(b.len(), 4096);
        assert_eq!(b.as_ptr() as usize % DIRECT_ALIGN, 0);
        assert!(b.is_pooled());
        let b = pool.get(5000);
        assert_eq!(b.len(), 8192);
        let b = pool.get(0);
        assert_eq!(b.len(), 4096);
        assert_eq!(
            b.fixed_index(),
            None,
            "unregistered pool has no fixed index"
        );
    }

    #[test]
    fn pool_reuses_buffers() {
        let pool = BouncePool::new(1 << 20);
        let addr = {
            let b = pool.get(8192);
            b.as_ptr() as usize
        };
        for _ in 0..100 {
            let b = pool.get(8192);
            assert_eq!(b.as_ptr() as usize, addr);
        }
        assert_eq!(pool.unpooled_count(), 0);
        assert_eq!(pool.free_bytes(), 1 << 20);
    }

    #[test]
    fn pool_exhaustion_falls_back_without_blocking() {
        let pool = BouncePool::new(64 << 10);
        let held: Vec<_> = (0..16).map(|_| pool.get(4096)).collect();
        assert!(held.iter().all(|b| b.is_pooled()));
        // Distinct, non-overlapping blocks.
        let mut addrs: Vec<_> = held.iter().map(|b| b.as_ptr() as usize).collect();
        addrs.sort_unstable();
        addrs.dedup();
        assert_eq!(addrs.len(), 16);
        assert_eq!(pool.free_bytes(), 0);
        let mut extra = pool.get(4096);
        assert!(!extra.is_pooled());
        extra.fill(3);
        assert_eq!(pool.unpooled_count(), 1);
        // Larger than the whole budget: unpooled too.
        let big = pool.get(1 << 20);
        assert!(!big.is_pooled());
        assert_eq!(big.len(), 1 << 20);
        drop(held);
        // Everything merged back: one 64 KiB block is available again.
        assert_eq!(pool.free_bytes(), 64 << 10);
        let whole = pool.get(64 << 10);
        assert!(whole.is_pooled());
    }

    #[test]
    fn pool_odd_budget_and_zero_budget() {
        // 12 KiB + change: blocks of 8 KiB and 4 KiB.
        let pool = BouncePool::new(12 * 1024 + 100);
        assert_eq!(pool.capacity(), 12 * 1024);
        let a = pool.get(8192);
        let b = pool.get(4096);
        assert!(a.is_pooled() && b.is_pooled());
        assert!(!pool.get(4096).is_pooled());
        drop((a, b));
        assert_eq!(pool.free_bytes(), 12 * 1024);
        let none = BouncePool::new(0);
        let mut b = none.get(10);
        assert!(!b.is_pooled());
        b[0] = 1;
    }

    #[test]
    fn pool_is_shared_across_threads() {
        let pool = BouncePool::new(256 << 10);
        std::thread::scope(|s| {
            for t in 0..4u8 {
                let pool = pool.clone();
                s.spawn(move || {
                    for i in 0..500usize {
                        let mut b = pool.get(4096 << (i % 4));
                        b.fill(t);
                        assert!(b.iter().all(|&x| x == t));
                    }
                });
            }
        });
        assert_eq!(pool.free_bytes(), 256 << 10);
    }
}
