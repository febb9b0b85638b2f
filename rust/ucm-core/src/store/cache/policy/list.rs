//! Doubly linked lists of slot indices threaded through `u32` words.
//!
//! A policy keeps `prev`/`next` arrays (one word per slot) at fixed offsets
//! of its state and one [`Head`] (head, tail, length words) per list. Several
//! lists may share the same link arrays as long as each slot is on at most
//! one of them (S3-FIFO's small and main queues do).

/// "No slot".
pub const NIL: u32 = u32::MAX;

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
        w[self.head] = NIL;
        w[self.tail] = NIL;
        w[self.len] = 0;
    }

    /// Oldest slot, if any.
    pub fn tail(self, w: &[u32]) -> Option<u32> {
        let t = w[self.tail];
        (t != NIL).then_some(t)
    }

    /// Number of slots on the list.
    pub fn len(self, w: &[u32]) -> u32 {
        w[self.len]
    }

    /// The slot one step toward the head from `s` (NIL at the head).
    pub fn toward_head(self, w: &[u32], s: u32) -> u32 {
        w[self.prev + s as usize]
    }

    /// Pushes `s` (not on any list sharing these links) at the head.
    pub fn push_front(self, w: &mut [u32], s: u32) {
        let old = w[self.head];
        w[self.prev + s as usize] = NIL;
        w[self.next + s as usize] = old;
        if old != NIL {
            w[self.prev + old as usize] = s;
        } else {
            w[self.tail] = s;
        }
        w[self.head] = s;
        w[self.len] += 1;
    }

    /// Unlinks `s`, which is on this list.
    pub fn unlink(self, w: &mut [u32], s: u32) {
        let p = w[self.prev + s as usize];
        let n = w[self.next + s as usize];
        if p != NIL {
            w[self.next + p as usize] = n;
        } else {
            w[self.head] = n;
        }
        if n != NIL {
            w[self.prev + n as usize] = p;
        } else {
            w[self.tail] = p;
        }
        w[self.prev + s as usize] = NIL;
        w[self.next + s as usize] = NIL;
        w[self.len] -= 1;
    }

    /// Moves `s` (on this list) to the head.
    pub fn move_to_front(self, w: &mut [u32], s: u32) {
        if w[self.head] != s {
            self.unlink(w, s);
            self.push_front(w, s);
        }
    }
}
