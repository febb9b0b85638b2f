//! LRU: one list, hits move to the head, victims come from the tail.
//!
//! Rejected candidates (pinned or dirty slots) stay where they are, so a
//! dirty block under lazy write-back keeps its place as "next to go" until
//! it has been written back.

use super::list::List;

fn list(n: u32) -> List {
    List::leading(n, 2 * n as usize)
}

pub fn words(n: usize) -> usize {
    2 * n + 3
}

pub fn init(w: &mut [u32], n: u32) {
    list(n).clear(w);
}

pub fn insert(w: &mut [u32], n: u32, slot: u32) {
    list(n).push_front(w, slot);
}

pub fn access(w: &mut [u32], n: u32, slot: u32) {
    list(n).move_to_front(w, slot);
}

pub fn remove(w: &mut [u32], n: u32, slot: u32) {
    list(n).unlink(w, slot);
}

/// Walks from the tail toward the head; the first acceptable slot goes.
/// At most `n` steps: damaged links may loop.
pub fn pick(w: &mut [u32], n: u32, can_evict: &mut dyn FnMut(u32) -> bool) -> Option<u32> {
    let l = list(n);
    let mut cur = l.tail(w)?;
    for _ in 0..n {
        if can_evict(cur) {
            l.unlink(w, cur);
            return Some(cur);
        }
        cur = l.toward_head(w, cur);
        if cur == super::list::NIL {
            return None;
        }
    }
    None
}
