//! Commits the cache's memory in the background from start-up.
//!
//! A fresh slot is memory the process has never touched: the first dump
//! into it pays a page fault and a zeroed page per 4 KiB, inside the
//! caller's `wait()`. Measured in a fresh process, that first touch is
//! most of the gap between a dump into the cache and a plain `memcpy`.
//! Committing the area ahead of use moves that cost to start-up, where a
//! serving engine is loading its model anyway. `MADV_POPULATE_WRITE`
//! (Linux 5.14) faults pages in without changing their contents, so it is
//! safe while dumps already write into slots; older kernels refuse it and
//! the cache commits memory as it is used, as before.
//!
//! The commit must not slow the requests it is meant to speed up. Each
//! `madvise` holds the process's memory-map lock for reading while it
//! faults pages in; whatever maps memory meanwhile (a thread stack, a large
//! allocation) waits for it, and every page fault of the process queues
//! behind that waiter. Where committing memory is slow (a virtual machine
//! whose host backs guest memory on first touch committed 4 GiB at about
//! 120 MiB/s), one 64 MiB call held the lock for half a second, and a
//! 512 MiB load that overlapped the commit took 5.8 s instead of 0.1 s. So
//! the area is committed in short calls, and none starts while a load or
//! dump of this cache is in flight. A call already running when a load
//! starts still competes with it: one 2 MiB huge-page call took up to
//! 0.32 s in that VM and halved a load that began meanwhile. So the private
//! area uses small pages (see `region`) and a call commits [`CHUNK`] bytes.
//!
//! Nor is the whole area committed: only its first [`LEAD`] bytes, where
//! slots are handed out first. An engine that caches little does not hold
//! (and did not pay for) gigabytes it never uses, and the commit is over
//! while the engine still starts. Committing further as the cache filled
//! ran while the engine computed: in this VM a 40-matmul burst right after
//! a 512 MiB load took 420 to 830 ms instead of 130 ms.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use super::region::resident_runs;
use super::Inner;
use crate::error::{Result, UcmError};

/// Size of one `madvise` call: 16 small pages, so a load arriving
/// meanwhile waits for at most their faults.
const CHUNK: usize = 64 << 10;

/// Bytes committed at start-up: room for the KV cache of a long prompt
/// (8k tokens of a small model are 512 MiB) and then some.
const LEAD: usize = 1 << 30;

/// Bytes of the cache looked at per `mincore` call when mapping resident
/// pages (a 256 KiB vector).
const WINDOW: usize = 1 << 30;

/// How long the commit sleeps before it looks again at a busy cache.
const BUSY_PAUSE: Duration = Duration::from_millis(1);

/// `MADV_POPULATE_WRITE`, which older `libc` crates do not name.
const MADV_POPULATE_WRITE: libc::c_int = 23;

/// The background commit of one memory range; stopped on drop.
pub(super) struct Prefault {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Prefault {
    /// Starts committing the first [`LEAD`] bytes of the cache's data
    /// area, where slots are handed out first. The thread holds `inner`, so
    /// the mapping outlives it; dropping this value stops and joins it.
    pub(super) fn start(inner: Arc<Inner>) -> Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("ucm-cache-prefault".into())
            .spawn(move || {
                // The first request may arrive before the commit is done:
                // zeroing pages must not take the CPU its forward pass needs.
                crate::task::lower_own_priority();
                let (base, len) = inner.table.data_area();
                let busy = || inner.in_flight.any();
                if inner.table.shm_path().is_some() {
                    // SAFETY: the data area lies inside the cache's
                    // mapping, kept mapped by the `inner` this thread holds.
                    unsafe { map_resident(base, len, &flag, busy) };
                }
                // SAFETY: as above.
                unsafe { populate(base, len.min(LEAD), &flag, busy) };
            })
            .map_err(|e| UcmError::os("spawn thread", "ucm-cache-prefault", e))?;
        Ok(Prefault {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Prefault {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Maps in the pages of `[base, base + len)` that already hold data: in a
/// shared segment that a process before us filled (and kept), the blocks
/// a restarted engine reads first. Unmapped, each 4 KiB of them would cost
/// a page fault inside the first load that reads it: loads of a 1 GiB
/// prompt ran at a third of the copy speed. Looks at one [`WINDOW`] at a
/// time, so its `mincore` vector stays small for any capacity.
///
/// # Safety
/// As [`populate`].
unsafe fn map_resident(base: *mut u8, len: usize, stop: &AtomicBool, busy: impl Fn() -> bool) {
    let mut off = 0;
    while off < len && !stop.load(Ordering::Acquire) {
        let win = WINDOW.min(len - off);
        // SAFETY: [base + off, + win) lies inside the range the caller
        // keeps mapped.
        let at = unsafe { base.add(off) };
        let runs = match resident_runs(at, win) {
            Ok(runs) => runs,
            Err(e) => {
                log::debug!("cache memory: resident pages not mapped ahead: {e}");
                return;
            }
        };
        for (run, n) in runs {
            // SAFETY: each run lies inside the window (`resident_runs`
            // counts from `at`, which is page-aligned in the data area).
            unsafe { populate(at.add(run), n, stop, &busy) };
        }
        off += win;
    }
}

/// Faults in `[base, base + len)` chunk by chunk, waiting while `busy()`
/// holds, until done or `stop` is set. Returns the bytes committed.
///
/// # Safety
/// The range must lie inside one writable mapping that stays mapped until
/// this returns.
unsafe fn populate(base: *mut u8, len: usize, stop: &AtomicBool, busy: impl Fn() -> bool) -> usize {
    let page = 4096;
    let start = base as usize & !(page - 1);
    let end = base as usize + len;
    let mut at = start;
    let t0 = std::time::Instant::now();
    while at < end && !stop.load(Ordering::Acquire) {
        if busy() {
            std::thread::sleep(BUSY_PAUSE);
            continue;
        }
        // Up to the next chunk boundary, so calls cover whole chunks.
        let len = (CHUNK - at % CHUNK).min(end - at);
        // SAFETY: [at, at + len) lies inside the mapping (the data area
        // starts page-aligned in it), which the caller keeps mapped;
        // MADV_POPULATE_WRITE changes no byte of it.
        let rc = unsafe { libc::madvise(at as *mut libc::c_void, len, MADV_POPULATE_WRITE) };
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            log::debug!("cache memory committed as used: madvise(MADV_POPULATE_WRITE): {e}");
            return at - start;
        }
        at += len;
    }
    let done = at.min(end) - start;
    log::debug!(
        "cache memory: {} MiB committed in {:.2} s",
        done >> 20,
        t0.elapsed().as_secs_f64()
    );
    done
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsRawFd;

    use super::super::region::{resident_bytes, Mapping, ShmObject};
    use super::*;

    /// Commits the whole range when left alone, nothing beyond the chunk
    /// in progress while the cache is busy, and resumes when it is idle.
    #[test]
    fn commits_everything_but_waits_while_busy() {
        let len = 64 << 20;
        let map = Mapping::anon(len).unwrap();
        let (base, stop) = (map.base() as usize, AtomicBool::new(false));
        let busy = AtomicBool::new(true);
        std::thread::scope(|s| {
            let worker = s.spawn(|| {
                // SAFETY: `map` outlives the scope.
                unsafe { populate(base as *mut u8, len, &stop, || busy.load(Ordering::Acquire)) }
            });
            std::thread::sleep(Duration::from_millis(300));
            let held = resident_bytes(map.base(), len).unwrap();
            assert_eq!(held, 0, "committed while busy");
            busy.store(false, Ordering::Release);
            let done = worker.join().unwrap();
            if done == 0 {
                // A kernel without MADV_POPULATE_WRITE commits as used.
                return;
            }
            assert_eq!(done, len);
            assert_eq!(resident_bytes(map.base(), len).unwrap(), len);
        });
    }

    /// `Rss` of the mapping starting at `base`, from smaps: the pages this
    /// process has mapped, not those the segment holds.
    fn rss_kib(base: *mut u8) -> u64 {
        crate::store::cache::region::smaps_kib(base, "Rss").unwrap()
    }

    /// A second mapping of a segment (a process attaching later) maps in
    /// the pages the first one wrote, and allocates none of the holes.
    #[test]
    fn maps_in_what_a_segment_holds_and_nothing_else() {
        let shm = ShmObject::for_id(&format!("prefault-test-{}", std::process::id())).unwrap();
        let len = 16 << 20;
        let fd = shm.create(len).unwrap().unwrap();
        let writer = Mapping::shared(fd.as_raw_fd(), len).unwrap();
        // Two runs of data: 1 MiB at 2 MiB, and 4 KiB at 9 MiB.
        // SAFETY: both ranges lie inside the writable mapping.
        unsafe {
            std::ptr::write_bytes(writer.base().add(2 << 20), 5, 1 << 20);
            std::ptr::write_bytes(writer.base().add(9 << 20), 6, 4096);
        }
        let reader = Mapping::shared(fd.as_raw_fd(), len).unwrap();
        shm.unlink();
        assert_eq!(rss_kib(reader.base()), 0);
        let stop = AtomicBool::new(false);
        let probe = Mapping::anon(4096).unwrap();
        // SAFETY: `probe` outlives the call.
        if unsafe { populate(probe.base(), 4096, &stop, || false) } == 0 {
            eprintln!("skipped: this kernel has no MADV_POPULATE_WRITE");
            return;
        }
        // SAFETY: `reader` outlives the call.
        unsafe { map_resident(reader.base(), len, &stop, || false) };
        assert_eq!(
            rss_kib(reader.base()),
            1024 + 4,
            "mapped other pages than the data"
        );
        assert_eq!(
            resident_bytes(reader.base(), len).unwrap(),
            (1 << 20) + 4096,
            "allocated holes"
        );
        // SAFETY: inside the mapping.
        assert_eq!(unsafe { *reader.base().add(9 << 20) }, 6);
    }

    /// `stop` ends the commit early.
    #[test]
    fn stops_when_asked() {
        let len = 8 << 20;
        let map = Mapping::anon(len).unwrap();
        let stop = AtomicBool::new(true);
        // SAFETY: `map` outlives the call.
        let done = unsafe { populate(map.base(), len, &stop, || false) };
        assert_eq!(done, 0);
        assert_eq!(resident_bytes(map.base(), len).unwrap(), 0);
    }
}
