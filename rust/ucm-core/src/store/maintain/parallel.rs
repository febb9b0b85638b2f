//! A job over many blocks on a pool of threads, and how far it got.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use parking_lot::Mutex;

/// How far a long job got, shared with whoever shows it (a progress bar)
/// and whoever may cancel it.
#[derive(Debug)]
pub struct Progress {
    phase: Mutex<&'static str>,
    /// Items of this phase; `u64::MAX` while not known.
    total: AtomicU64,
    done: AtomicU64,
    cancelled: AtomicBool,
}

impl Default for Progress {
    fn default() -> Self {
        Progress {
            phase: Mutex::new("starting"),
            total: AtomicU64::new(u64::MAX),
            done: AtomicU64::new(0),
            cancelled: AtomicBool::new(false),
        }
    }
}

impl Progress {
    /// Starts phase `phase` of `total` items (None: not known yet).
    pub fn start(&self, phase: &'static str, total: Option<usize>) {
        let mut p = self.phase.lock();
        *p = phase;
        self.done.store(0, Ordering::Release);
        let total = total.map_or(u64::MAX, |n| n as u64);
        self.total.store(total, Ordering::Release);
    }

    /// Counts `n` more items done.
    pub fn advance(&self, n: u64) {
        self.done.fetch_add(n, Ordering::AcqRel);
    }

    /// The phase running.
    pub fn phase(&self) -> &'static str {
        *self.phase.lock()
    }

    /// Items of the phase, where known.
    pub fn total(&self) -> Option<u64> {
        let t = self.total.load(Ordering::Acquire);
        (t != u64::MAX).then_some(t)
    }

    /// Items of the phase done.
    pub fn done(&self) -> u64 {
        self.done.load(Ordering::Acquire)
    }

    /// Asks the job to stop at its next item.
    pub fn cancel(&self) {
        self.cancelled.store(true, Ordering::Release);
    }

    /// True once [`Progress::cancel`] was called.
    pub fn cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Acquire)
    }
}

/// Runs `f` on every item on up to `threads` threads, counting the items
/// done in `progress`, and stops early once it is cancelled. The results
/// `f` gave, in no particular order.
pub fn map_parallel<T: Sync, R: Send>(
    items: &[T],
    threads: usize,
    progress: &Progress,
    f: impl Fn(&T) -> Option<R> + Sync,
) -> Vec<R> {
    if items.is_empty() {
        return Vec::new();
    }
    let threads = threads.clamp(1, items.len());
    // Small grabs keep the threads busy to the end; large ones keep the
    // shared counter cold.
    let chunk = (items.len() / (threads * 16)).clamp(1, 256);
    let next = AtomicUsize::new(0);
    let work = || {
        let mut out = Vec::new();
        while !progress.cancelled() {
            let start = next.fetch_add(chunk, Ordering::Relaxed);
            if start >= items.len() {
                break;
            }
            let end = (start + chunk).min(items.len());
            out.extend(items[start..end].iter().filter_map(&f));
            progress.advance((end - start) as u64);
        }
        out
    };
    std::thread::scope(|s| {
        let workers: Vec<_> = (1..threads).map(|_| s.spawn(work)).collect();
        let mut all = work();
        for w in workers {
            all.extend(w.join().unwrap_or_else(|e| std::panic::resume_unwind(e)));
        }
        all
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_item_once_on_many_threads() {
        let items: Vec<u64> = (0..10_000).collect();
        let p = Progress::default();
        p.start("adding", Some(items.len()));
        let mut got = map_parallel(&items, 8, &p, |x| (x % 3 == 0).then_some(*x));
        got.sort_unstable();
        let want: Vec<u64> = (0..10_000).filter(|x| x % 3 == 0).collect();
        assert_eq!(got, want);
        assert_eq!(
            (p.phase(), p.total(), p.done()),
            ("adding", Some(10_000), 10_000)
        );
        p.start("next", None);
        assert_eq!((p.total(), p.done()), (None, 0));
    }

    #[test]
    fn a_cancelled_job_stops() {
        let items: Vec<u64> = (0..100_000).collect();
        let p = Progress::default();
        p.cancel();
        assert!(map_parallel(&items, 4, &p, |x| Some(*x)).is_empty());
        assert!(map_parallel::<u64, u64>(&[], 4, &Progress::default(), |x| Some(*x)).is_empty());
    }
}
