//! Doubly linked lists of slot indices threaded through `u32` words.
//!
//! A policy keeps `prev`/`next` arrays (one word per slot) at fixed offsets
//! of its state and one [`Head`] (head, tail, length words) per list. Several
//! lists may share the same link arrays as long as each slot is on at most
//! one of them (S3-FIFO's small and main queues do).
//!
//! The words live in the cache's region, which in shared mode other
//! processes can damage: every access goes through [`get`] and [`set`],
//! which treat a position outside the state as "no slot" and ignore writes
//! to it, so damaged links cost eviction order (rebuilt when the table is
//! next checked), never a panic. Walks are bounded by their callers.

/// "No slot".
pub const NIL: u32 = u32::MAX;

/// Word `i` of the state, or [`NIL`] when `i` lies outside it.
pub fn get(w: &[u32], i: usize) -> u32 {
    w.get(i).copied().unwrap_or(NIL)
}

/// Sets word `i` of the state; a position outside it is ignored.
pub fn set(w: &mut [u32], i: usize, v: u32) {
    if let Some(x) = w.get_mut(i) {
        *x = v;
    }
}

/// Position `base + s`, saturating (a damaged `s` lands outside the state).
fn at(base: usize, s: u32) -> usize {
    base.saturating_add(s as usize)
}

/// Where a list's link arrays and header words are.
#[derive(Clone, Copy)]
pub struct List {
    /// Offset of the `prev` array.
    pub prev: usize,
    /// Offset of the `next` array.
    pub next: usize,
    /// Word holding the head (most recently pushed) slot.
    pub head: usize,
    /// Word holding the tail (oldest) slot.
    pub tail: usize,
    /// Word holding the length.
    pub len: usize,
}

impl List {
    /// The list whose `prev` and `next` arrays are a policy state's first
    /// `2 * n` words (`n` slots each) and whose header words start at
    /// `header`.
    pub fn leading(n: u32, header: usize) -> Self {
        let n = n as usize;
        List {
            prev: 0,
            next: n,
            head: header,
            tail: header + 1,
            len: header + 2,
        }
    }

    /// Empties the list (links of its members are left as they are).
    pub fn clear(self, w: &mut [u32]) {
        set(w, self.head, NIL);
        set(w, self.tail, NIL);
        set(w, self.len, 0);
    }

    /// Oldest slot, if any.
    pub fn tail(self, w: &[u32]) -> Option<u32> {
        let t = get(w, self.tail);
        (t != NIL).then_some(t)
    }

    /// Number of slots on the list.
    pub fn len(self, w: &[u32]) -> u32 {
        get(w, self.len)
    }

    /// The slot one step toward the head from `s` (NIL at the head).
    pub fn toward_head(self, w: &[u32], s: u32) -> u32 {
        get(w, at(self.prev, s))
    }

    /// Pushes `s` (not on any list sharing these links) at the head.
    pub fn push_front(self, w: &mut [u32], s: u32) {
        let old = get(w, self.head);
        set(w, at(self.prev, s), NIL);
        set(w, at(self.next, s), old);
        if old != NIL {
            set(w, at(self.prev, old), s);
        } else {
            set(w, self.tail, s);
        }
        set(w, self.head, s);
        set(w, self.len, get(w, self.len).wrapping_add(1));
    }

    /// Unlinks `s`, which is on this list.
    pub fn unlink(self, w: &mut [u32], s: u32) {
        let p = get(w, at(self.prev, s));
        let n = get(w, at(self.next, s));
        if p != NIL {
            set(w, at(self.next, p), n);
        } else {
            set(w, self.head, n);
        }
        if n != NIL {
            set(w, at(self.prev, n), p);
        } else {
            set(w, self.tail, p);
        }
        set(w, at(self.prev, s), NIL);
        set(w, at(self.next, s), NIL);
        set(w, self.len, get(w, self.len).saturating_sub(1));
    }

    /// Moves `s` (on this list) to the head.
    pub fn move_to_front(self, w: &mut [u32], s: u32) {
        if get(w, self.head) != s {
            self.unlink(w, s);
            self.push_front(w, s);
        }
    }
}
