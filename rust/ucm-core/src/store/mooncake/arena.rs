//! Registered memory that blocks travel through: one allocation,
//! registered with the transfer engine once, cut into block-sized slots.
//!
//! The transfer engine reads and writes a slot directly (no copy through
//! Python objects, and no per-transfer registration, which RDMA needs and
//! which costs a metadata update). A slot belongs to one transfer at a
//! time. A transfer that failed in a way that may leave the engine still
//! writing into the slot *poisons* it: the slot is never handed out again,
//! and the allocation is never freed (it lives until the process exits).

use std::alloc::{alloc_zeroed, dealloc, Layout as AllocLayout};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::error::{Result, UcmError};

const ALIGN: usize = 4096;

/// What runs when the arena is freed, with its base address.
type OnFree = Box<dyn FnOnce(usize) + Send>;

/// One memory range of a transfer: an address and a length in bytes.
#[derive(Clone, Copy, Debug)]
pub struct Buf {
    /// Start address.
    pub addr: usize,
    /// Bytes.
    pub len: usize,
}

/// The slots and who may use them.
pub struct Arena {
    base: *mut u8,
    alloc: AllocLayout,
    slot_len: usize,
    free: Mutex<Vec<usize>>,
    room: tokio::sync::Notify,
    poisoned: AtomicU64,
    /// Called with the base address when the arena is freed.
    on_free: Mutex<Option<OnFree>>,
}

// SAFETY: `base` points to memory this arena owns for its whole life; each
// slot is handed to one `Slot` at a time (the free list is behind a mutex),
// and only that `Slot` reads or writes it.
unsafe impl Send for Arena {}
// SAFETY: as for `Send`: shared access only hands out disjoint slots.
unsafe impl Sync for Arena {}

impl Arena {
    /// `slots` slots of `slot_len` bytes each (4 KiB-aligned), zeroed.
    pub fn new(slot_len: usize, slots: usize) -> Result<Arc<Self>> {
        let slot_len = slot_len.div_ceil(ALIGN) * ALIGN;
        let size = slot_len
            .checked_mul(slots.max(1))
            .ok_or_else(|| UcmError::invalid("mooncake_staging_buffer_gb: too large"))?;
        let alloc = AllocLayout::from_size_align(size, ALIGN)
            .map_err(|e| UcmError::invalid(format!("mooncake_staging_buffer_gb: {e}")))?;
        // SAFETY: `alloc` has a non-zero size (slot_len >= ALIGN, slots >= 1).
        let base = unsafe { alloc_zeroed(alloc) };
        if base.is_null() {
            return Err(UcmError::OutOfMemory(format!(
                "{size} bytes of Mooncake staging memory"
            )));
        }
        Ok(Arc::new(Arena {
            base,
            alloc,
            slot_len,
            free: Mutex::new((0..slots.max(1)).rev().collect()),
            room: tokio::sync::Notify::new(),
            poisoned: AtomicU64::new(0),
            on_free: Mutex::new(None),
        }))
    }

    /// The whole allocation.
    pub fn whole(&self) -> Buf {
        Buf {
            addr: self.base as usize,
            len: self.alloc.size(),
        }
    }

    /// Runs `f` with the base address when the arena is freed (to
    /// unregister it first).
    pub fn on_free(&self, f: OnFree) {
        *self.on_free.lock() = Some(f);
    }

    /// Bytes of one slot.
    pub fn slot_len(&self) -> usize {
        self.slot_len
    }

    /// Slots given up to failed transfers.
    pub fn poisoned(&self) -> u64 {
        self.poisoned.load(Ordering::Relaxed)
    }

    /// A free slot, waiting for one while all are in use.
    pub async fn acquire(self: &Arc<Self>) -> Slot {
        loop {
            let notified = self.room.notified();
            if let Some(index) = self.free.lock().pop() {
                return Slot {
                    arena: self.clone(),
                    index,
                    poisoned: false,
                };
            }
            notified.await;
        }
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        if self.poisoned() > 0 {
            // A transfer may still write here: keep the memory (and its
            // registration) until the process exits.
            return;
        }
        if let Some(f) = self.on_free.lock().take() {
            f(self.base as usize);
        }
        // SAFETY: allocated in `new` with this layout; every `Slot` holds an
        // `Arc` to the arena, so none is alive.
        unsafe { dealloc(self.base, self.alloc) };
    }
}

/// One slot, owned by one transfer; back to the free list when dropped
/// (unless poisoned).
pub struct Slot {
    arena: Arc<Arena>,
    index: usize,
    poisoned: bool,
}

impl Slot {
    /// The slot's memory.
    pub fn buf(&self) -> Buf {
        Buf {
            addr: self.arena.base as usize + self.index * self.arena.slot_len,
            len: self.arena.slot_len,
        }
    }

    /// The slot's bytes.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: the slot lies inside the allocation and belongs to this
        // `Slot` alone. A transfer into it runs inside a call that owns the
        // `Slot` (moved into the call), so none runs while it can be read
        // here; a slot a failed transfer may still write is poisoned in
        // that call and never reaches a reader.
        unsafe {
            std::slice::from_raw_parts(
                self.arena.base.add(self.index * self.arena.slot_len),
                self.arena.slot_len,
            )
        }
    }

    /// The slot's bytes, to fill.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as for `bytes`, and `&mut self` makes the access unique.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.arena.base.add(self.index * self.arena.slot_len),
                self.arena.slot_len,
            )
        }
    }

    /// Gives the slot up: a failed transfer may still be writing to it.
    pub fn poison(mut self) {
        self.poisoned = true;
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if self.poisoned {
            self.arena.poisoned.fetch_add(1, Ordering::Relaxed);
            return;
        }
        self.arena.free.lock().push(self.index);
        self.arena.room.notify_one();
    }
}

/// `len` bytes at `start` of a slot that holds a fetched block.
pub struct SlotBytes {
    slot: Slot,
    start: usize,
    len: usize,
}

impl SlotBytes {
    /// The bytes `start..start + len` of `slot` (clamped to the slot).
    pub fn new(slot: Slot, start: usize, len: usize) -> Self {
        let start = start.min(slot.arena.slot_len);
        let len = len.min(slot.arena.slot_len - start);
        SlotBytes { slot, start, len }
    }
}

impl AsRef<[u8]> for SlotBytes {
    fn as_ref(&self) -> &[u8] {
        &self.slot.bytes()[self.start..self.start + self.len]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
            .block_on(f)
    }

    /// How many times the arena's memory has been freed (its hook called).
    fn count_frees(arena: &Arena) -> Arc<AtomicU64> {
        let freed = Arc::new(AtomicU64::new(0));
        let f = freed.clone();
        arena.on_free(Box::new(move |_| {
            f.fetch_add(1, Ordering::Relaxed);
        }));
        freed
    }

    #[test]
    fn slots_are_disjoint_aligned_and_reused() {
        let arena = Arena::new(5000, 2).expect("arena");
        assert_eq!(arena.slot_len(), 8192);
        let (mut a, b) = block_on(async { (arena.acquire().await, arena.acquire().await) });
        assert_ne!(a.buf().addr, b.buf().addr);
        assert_eq!(a.buf().addr % ALIGN, 0);
        a.bytes_mut()[0] = 7;
        assert_eq!(b.bytes()[0], 0);
        let addr = a.buf().addr;
        drop(a);
        let c = block_on(arena.acquire());
        assert_eq!(c.buf().addr, addr);
    }

    #[test]
    fn a_poisoned_slot_is_never_handed_out_and_the_memory_is_kept() {
        let arena = Arena::new(4096, 2).expect("arena");
        let freed = count_frees(&arena);
        let a = block_on(arena.acquire());
        let bad = a.buf().addr;
        a.poison();
        assert_eq!(arena.poisoned(), 1);
        let b = block_on(arena.acquire());
        assert_ne!(b.buf().addr, bad);
        drop(b);
        let c = block_on(arena.acquire());
        assert_ne!(c.buf().addr, bad);
        drop(c);
        drop(arena);
        assert_eq!(
            freed.load(Ordering::Relaxed),
            0,
            "poisoned memory must not be freed"
        );
    }

    #[test]
    fn an_unpoisoned_arena_unregisters_when_freed() {
        let arena = Arena::new(4096, 1).expect("arena");
        let freed = count_frees(&arena);
        let slot = block_on(arena.acquire());
        drop(arena);
        assert_eq!(
            freed.load(Ordering::Relaxed),
            0,
            "a slot still holds the arena"
        );
        drop(slot);
        assert_eq!(freed.load(Ordering::Relaxed), 1);
    }
}
