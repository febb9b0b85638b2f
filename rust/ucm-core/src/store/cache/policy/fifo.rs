//! FIFO: insertion order, hits change nothing. This is what the original
//! UCM's ring cursor amounts to, kept as the baseline of the comparison.

use super::lru;

pub fn words(n: usize) -> usize {
    lru::words(n)
}

pub fn init(w: &mut [u32], n: u32) {
    lru::init(w, n);
}

pub fn insert(w: &mut [u32], n: u32, slot: u32) {
    lru::insert(w, n, slot);
}

pub fn remove(w: &mut [u32], n: u32, slot: u32) {
    lru::remove(w, n, slot);
}

pub fn pick(w: &mut [u32], n: u32, can_evict: &mut dyn FnMut(u32) -> bool) -> Option<u32> {
    // Same walk as LRU; without promotion the tail is the oldest insert.
    lru::pick(w, n, can_evict)
}
