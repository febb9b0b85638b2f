//! SIEVE (Zhang et al., NSDI'24): a FIFO list with one visited bit per slot
//! and a hand that sweeps from the tail toward the head. A visited slot
//! survives the sweep (its bit is cleared); the first unvisited, evictable
//! slot is the victim. Hits only set a bit, so they never reorder the list.

use super::list::{get, set, List, NIL};

// Layout: prev[n] next[n] visited[n] head tail len hand
fn list(n: u32) -> List {
    List::leading(n, 3 * n as usize)
}

fn hand(n: u32) -> usize {
    3 * n as usize + 3
}

fn visited(n: u32, s: u32) -> usize {
    (2 * n as usize).saturating_add(s as usize)
}

pub fn words(n: usize) -> usize {
    3 * n + 4
}

pub fn init(w: &mut [u32], n: u32) {
    list(n).clear(w);
    set(w, hand(n), NIL);
}

pub fn insert(w: &mut [u32], n: u32, slot: u32) {
    set(w, visited(n, slot), 0);
    list(n).push_front(w, slot);
}

pub fn access(w: &mut [u32], n: u32, slot: u32) {
    set(w, visited(n, slot), 1);
}

pub fn remove(w: &mut [u32], n: u32, slot: u32) {
    let l = list(n);
    if get(w, hand(n)) == slot {
        set(w, hand(n), l.toward_head(w, slot));
    }
    l.unlink(w, slot);
}

pub fn pick(w: &mut [u32], n: u32, can_evict: &mut dyn FnMut(u32) -> bool) -> Option<u32> {
    let l = list(n);
    // A damaged length cannot make the sweep longer than the slots.
    let len = l.len(w).min(n);
    if len == 0 {
        return None;
    }
    let mut cur = match get(w, hand(n)) {
        NIL => l.tail(w)?,
        h => h,
    };
    // Two full sweeps: the first may only clear visited bits.
    for _ in 0..2 * len as usize + 1 {
        let next = match l.toward_head(w, cur) {
            NIL => l.tail(w).unwrap_or(NIL),
            p => p,
        };
        if get(w, visited(n, cur)) != 0 {
            set(w, visited(n, cur), 0);
        } else if can_evict(cur) {
            set(w, hand(n), if next == cur { NIL } else { next });
            l.unlink(w, cur);
            return Some(cur);
        }
        if next == NIL {
            return None;
        }
        cur = next;
    }
    set(w, hand(n), cur);
    None
}
