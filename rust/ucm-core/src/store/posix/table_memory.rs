//! The memory of the index's hash table: pages mapped for the table alone,
//! asked to be backed by huge pages.
//!
//! Why not a `Box<[Slot]>`: at a million blocks the table is some 48 MiB,
//! and a batch lookup touches one random slot per id. On 4 KiB pages nearly
//! every one of those touches also misses the TLB (its reach is a few MiB)
//! and walks the page tables, a second miss to memory. On 2 MiB pages the
//! whole table fits the TLB. The allocator gives no way to ask for that
//! before the pages are first written (it zeroes them itself), so the table
//! maps its own: anonymous pages, zero until written, which is exactly an
//! empty table.

use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

/// Tables at least this large ask for huge pages; smaller ones would only
/// round their memory up to one.
const HUGE_PAGE_MIN: usize = 4 << 20;

/// Types whose all-zero bytes are a valid value.
///
/// # Safety
/// Implement it only for types of which every field is an integer, an
/// atomic integer or an array of those.
pub(super) unsafe trait Zeroable: Sized {}

/// `len` zero-initialised values of `T` in their own mapping.
pub(super) struct ZeroedSlice<T: Zeroable> {
    ptr: NonNull<T>,
    len: usize,
    map_len: usize,
}

// SAFETY: the slice owns its mapping alone, as a `Box<[T]>` owns its
// allocation, so it can move to and be shared with other threads exactly
// when `T` can.
unsafe impl<T: Zeroable + Send> Send for ZeroedSlice<T> {}
// SAFETY: as above; `&ZeroedSlice<T>` hands out only `&[T]`.
unsafe impl<T: Zeroable + Sync> Sync for ZeroedSlice<T> {}

impl<T: Zeroable> ZeroedSlice<T> {
    /// `len` values of `T`, all zero. Aborts like any allocation when the
    /// memory can't be had.
    pub fn new(len: usize) -> Self {
        let bytes = len.max(1).saturating_mul(std::mem::size_of::<T>());
        let page = 4096;
        let map_len = bytes.div_ceil(page).saturating_mul(page);
        // SAFETY: a new private anonymous mapping touches no existing
        // memory; the result is checked before use.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        let layout = std::alloc::Layout::from_size_align(map_len, page)
            .unwrap_or(std::alloc::Layout::new::<u8>());
        if p == libc::MAP_FAILED {
            std::alloc::handle_alloc_error(layout);
        }
        if map_len >= HUGE_PAGE_MIN {
            // A hint: without transparent huge pages the table still works
            // on small ones. SAFETY: it changes no byte of the mapping,
            // which is ours alone.
            unsafe { libc::madvise(p, map_len, libc::MADV_HUGEPAGE) };
        }
        let Some(ptr) = NonNull::new(p.cast::<T>()) else {
            std::alloc::handle_alloc_error(layout);
        };
        ZeroedSlice { ptr, len, map_len }
    }
}

impl<T: Zeroable> Deref for ZeroedSlice<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        // SAFETY: the mapping holds `len` values of `T` (page-aligned, so
        // aligned for any `T` a table holds), initialised: zero is a valid
        // `T` (`Zeroable`), and since then only written through `&mut`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Zeroable> DerefMut for ZeroedSlice<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `deref`, and `&mut self` makes this the only
        // reference to the values.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Zeroable> Drop for ZeroedSlice<T> {
    fn drop(&mut self) {
        // `T` owns nothing (`Zeroable`): unmapping is all the cleanup.
        // SAFETY: the mapping was made by `new` with this length and no
        // reference into it outlives `self`.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.map_len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq)]
    struct Pair(u64, [u8; 8]);
    // SAFETY: two integer fields.
    unsafe impl Zeroable for Pair {}

    #[test]
    fn starts_zero_and_keeps_what_is_written() {
        for len in [0usize, 1, 3, 1000, (HUGE_PAGE_MIN / 16) + 5] {
            let mut s = ZeroedSlice::<Pair>::new(len);
            assert_eq!(s.len(), len);
            assert!(s.iter().all(|p| *p == Pair(0, [0; 8])));
            for (i, p) in s.iter_mut().enumerate() {
                *p = Pair(i as u64, [i as u8; 8]);
            }
            assert!(s.iter().enumerate().all(|(i, p)| p.0 == i as u64));
        }
    }
}
