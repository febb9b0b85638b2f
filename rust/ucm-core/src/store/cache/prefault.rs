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

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use super::Inner;
use crate::error::{Result, UcmError};

/// Size of one `madvise` call: small enough that `close` is not held up.
const CHUNK: usize = 64 << 20;

/// `MADV_POPULATE_WRITE`, which older `libc` crates do not name.
const MADV_POPULATE_WRITE: libc::c_int = 23;

/// The background commit of one memory range; stopped on drop.
pub(super) struct Prefault {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Prefault {
    /// Starts committing the cache's data area from its start, where
    /// slots are handed out first. The thread holds `inner`, so the mapping
    /// outlives it; dropping this value stops and joins it.
    pub(super) fn start(inner: Arc<Inner>) -> Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("ucm-cache-prefault".into())
            .spawn(move || {
                // The first request may arrive before the commit is done:
                // zeroing pages must not take the CPU its forward pass needs.
                crate::task::lower_own_priority();
                populate(&inner, &flag)
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

fn populate(inner: &Inner, stop: &AtomicBool) {
    let (base, len) = inner.table.data_area();
    let page = 4096;
    let start = base as usize & !(page - 1);
    let end = base as usize + len;
    let mut at = start;
    let t0 = std::time::Instant::now();
    while at < end && !stop.load(Ordering::Acquire) {
        let len = CHUNK.min(end - at);
        // SAFETY: [at, at + len) lies inside the cache's mapping (the data
        // area starts page-aligned in it), kept mapped by the `inner` this
        // thread holds; MADV_POPULATE_WRITE changes no byte of it.
        let rc = unsafe { libc::madvise(at as *mut libc::c_void, len, MADV_POPULATE_WRITE) };
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            log::debug!("cache memory committed as used: madvise(MADV_POPULATE_WRITE): {e}");
            return;
        }
        at += len;
    }
    log::debug!(
        "cache memory: {} MiB committed in {:.2} s",
        (at.min(end) - start) >> 20,
        t0.elapsed().as_secs_f64()
    );
}
