//! S3-FIFO (Yang et al., SOSP'23): three FIFO queues.
//!
//! * **Small** (10 % of the slots): every new key starts here. A key hit at
//!   least once while in Small is promoted to Main when it reaches the
//!   tail; otherwise it is evicted and its key remembered in Ghost.
//! * **Main**: keys leave from the tail; one with a non-zero frequency
//!   (2 bits, capped at 3) is reinserted at the head with frequency - 1.
//! * **Ghost**: keys recently evicted from Small. A new key found in Ghost
//!   goes straight to Main: it came back, so it was not a one-time access.
//!
//! Ghost is a fixed table of (tag, sequence) pairs indexed by key hash: a key
//! is "in Ghost" if its slot holds its tag and was written within the last
//! `n` ghost insertions. Collisions only forget keys early (a false negative
//! means the key goes to Small, which is always safe), and the table needs
//! no pointers, so it can live in shared memory like the rest.
//!
//! Candidates the cache rejects (pinned or dirty) are rotated to the head of
//! their queue, as a hit would be, so the next pick looks further.

use super::list::{get, set, List};

const IN_SMALL: u32 = 1 << 8;
const IN_MAIN: u32 = 2 << 8;
const QUEUE_MASK: u32 = 3 << 8;
const FREQ_MASK: u32 = 3;

// Layout: prev[n] next[n] meta[n] keylo[n] keyhi[n] | small(head tail len)
// main(head tail len) ghost_seq | ghost[2*g]
fn base(n: u32) -> usize {
    5 * n as usize
}

fn small(n: u32) -> List {
    List::leading(n, base(n))
}

fn main_q(n: u32) -> List {
    List::leading(n, base(n) + 3)
}

fn ghost_seq(n: u32) -> usize {
    base(n) + 6
}

fn ghost_len(n: u32) -> usize {
    (n as usize).max(1).next_power_of_two()
}

fn ghost_off(n: u32) -> usize {
    base(n) + 7
}

fn meta(n: u32, s: u32) -> usize {
    (2 * n as usize).saturating_add(s as usize)
}

pub fn words(n: usize) -> usize {
    5 * n + 7 + 2 * n.max(1).next_power_of_two()
}

pub fn init(w: &mut [u32], n: u32) {
    small(n).clear(w);
    main_q(n).clear(w);
    set(w, ghost_seq(n), 0);
    let g = ghost_off(n);
    if let Some(ghost) = w.get_mut(g..g + 2 * ghost_len(n)) {
        ghost.fill(0);
    }
}

fn tag(key: u64) -> u32 {
    // Never 0, so an all-zero entry matches nothing.
    ((key >> 32) as u32) | 1
}

fn ghost_pos(n: u32, key: u64) -> usize {
    ghost_off(n) + 2 * ((key as usize) & (ghost_len(n) - 1))
}

fn ghost_take(w: &mut [u32], n: u32, key: u64) -> bool {
    let p = ghost_pos(n, key);
    let seq = get(w, ghost_seq(n));
    let hit = get(w, p) == tag(key) && seq.wrapping_sub(get(w, p + 1)) <= n;
    if hit {
        set(w, p, 0);
    }
    hit
}

fn ghost_put(w: &mut [u32], n: u32, key: u64) {
    let p = ghost_pos(n, key);
    let seq = get(w, ghost_seq(n)).wrapping_add(1);
    set(w, ghost_seq(n), seq);
    set(w, p, tag(key));
    set(w, p + 1, seq);
}

/// Positions of slot `s`'s key words (low, high).
fn key_at(n: u32, s: u32) -> (usize, usize) {
    let (n, s) = (n as usize, s as usize);
    ((3 * n).saturating_add(s), (4 * n).saturating_add(s))
}

fn key_of(w: &[u32], n: u32, s: u32) -> u64 {
    let (lo, hi) = key_at(n, s);
    u64::from(get(w, lo)) | (u64::from(get(w, hi)) << 32)
}

pub fn insert(w: &mut [u32], n: u32, slot: u32, key: u64) {
    let (lo, hi) = key_at(n, slot);
    set(w, lo, key as u32);
    set(w, hi, (key >> 32) as u32);
    if ghost_take(w, n, key) {
        set(w, meta(n, slot), IN_MAIN);
        main_q(n).push_front(w, slot);
    } else {
        set(w, meta(n, slot), IN_SMALL);
        small(n).push_front(w, slot);
    }
}

pub fn access(w: &mut [u32], n: u32, slot: u32) {
    let m = get(w, meta(n, slot));
    if m & FREQ_MASK < 3 {
        set(w, meta(n, slot), m + 1);
    }
}

pub fn remove(w: &mut [u32], n: u32, slot: u32) {
    let m = get(w, meta(n, slot));
    match m & QUEUE_MASK {
        IN_SMALL => small(n).unlink(w, slot),
        IN_MAIN => main_q(n).unlink(w, slot),
        _ => {}
    }
    set(w, meta(n, slot), 0);
}

pub fn pick(w: &mut [u32], n: u32, can_evict: &mut dyn FnMut(u32) -> bool) -> Option<u32> {
    let (s, m) = (small(n), main_q(n));
    let small_target = (n / 10).max(1);
    // Rejections in a row per queue: once a whole queue was rejected, look
    // only at the other; when both were, give up.
    let (mut small_rejects, mut main_rejects) = (0u32, 0u32);
    // Every step evicts, rejects, or moves one slot toward a queue head
    // (promotion or frequency decay, at most 3 per slot): bounded work,
    // and never more than the slots allow whatever damaged lengths say.
    let budget = 8 * (s.len(w).min(n) + m.len(w).min(n)) as usize + 8;
    for _ in 0..budget {
        let small_done = small_rejects >= s.len(w);
        let main_done = main_rejects >= m.len(w);
        if small_done && main_done {
            return None;
        }
        let from_small = if small_done {
            false
        } else if main_done {
            true
        } else {
            s.len(w) >= small_target
        };
        if from_small {
            let t = s.tail(w)?;
            let freq = get(w, meta(n, t)) & FREQ_MASK;
            if freq > 0 {
                s.unlink(w, t);
                set(w, meta(n, t), IN_MAIN);
                m.push_front(w, t);
                main_rejects = 0;
            } else if can_evict(t) {
                s.unlink(w, t);
                set(w, meta(n, t), 0);
                ghost_put(w, n, key_of(w, n, t));
                return Some(t);
            } else {
                s.move_to_front(w, t);
                small_rejects += 1;
            }
        } else {
            let t = m.tail(w)?;
            let freq = get(w, meta(n, t)) & FREQ_MASK;
            if freq > 0 {
                set(w, meta(n, t), get(w, meta(n, t)) - 1);
                m.move_to_front(w, t);
            } else if can_evict(t) {
                m.unlink(w, t);
                set(w, meta(n, t), 0);
                return Some(t);
            } else {
                m.move_to_front(w, t);
                main_rejects += 1;
            }
        }
    }
    None
}
