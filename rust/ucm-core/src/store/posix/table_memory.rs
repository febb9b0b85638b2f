//! The memory of the index's hash table: pages mapped for the table alone,
//! asked to be backed by huge pages.
//!
//! Why not a `Box<[Slot]>`: at a million blocks the table is some 48 MiB,
//! and a batch lookup touches one random slot per id. On 4 KiB pages nearly
//! every one of those touches also misses the TLB (its reach is a few MiB)
//! and walks the page tables, a second miss to memory. On 2 MiB pages the
//! whole table fits the TLB. The allocator gives no way to ask for that
//! before the pages are first written (it zeroes them itself); an
//! [`AlignedBuf`] of this size is mapped from the kernel, zero and untouched
//! until written, which is exactly an empty table.

use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};

use crate::io::AlignedBuf;

/// Tables at least this large ask for huge pages; smaller ones would only
/// round their memory up to one. Above [`AlignedBuf`]'s own threshold for
/// mapping instead of allocating, so the advice always falls on a mapping.
const HUGE_PAGE_MIN: usize = 4 << 20;

/// Types whose all-zero bytes are a valid value.
///
/// # Safety
/// Implement it only for types of which every field is an integer, an
/// atomic integer or an array of those.
pub(super) unsafe trait Zeroable: Sized {}

/// `len` zero-initialised values of `T`.
pub(super) struct ZeroedSlice<T: Zeroable> {
    buf: AlignedBuf,
    len: usize,
    /// Sends and shares as `T` does, like a `Box<[T]>`.
    _values: PhantomData<T>,
}

impl<T: Zeroable> ZeroedSlice<T> {
    /// `len` values of `T`, all zero. Aborts like any allocation when the
    /// memory can't be had.
    pub fn new(len: usize) -> Self {
        let bytes = len.saturating_mul(std::mem::size_of::<T>());
        let mut buf = AlignedBuf::new(bytes);
        if bytes >= HUGE_PAGE_MIN {
            // A hint: without transparent huge pages the table still works
            // on small ones. SAFETY: it changes no byte of the buffer, which
            // is ours alone and starts page-aligned.
            unsafe { libc::madvise(buf.as_mut_ptr().cast(), bytes, libc::MADV_HUGEPAGE) };
        }
        ZeroedSlice {
            buf,
            len,
            _values: PhantomData,
        }
    }
}

impl<T: Zeroable> Deref for ZeroedSlice<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        // SAFETY: the buffer holds `len` values of `T` (page-aligned, so
        // aligned for any `T` a table holds), initialised: zero is a valid
        // `T` (`Zeroable`), and since then only written through `&mut`.
        unsafe { std::slice::from_raw_parts(self.buf.as_ptr().cast::<T>(), self.len) }
    }
}

impl<T: Zeroable> DerefMut for ZeroedSlice<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `deref`, and `&mut self` makes this the only
        // reference to the values.
        unsafe { std::slice::from_raw_parts_mut(self.buf.as_mut_ptr().cast::<T>(), self.len) }
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
