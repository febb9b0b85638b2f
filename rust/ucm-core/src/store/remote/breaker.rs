//! The circuit breaker of a remote store: after a transport failure,
//! requests fail fast for a short, growing pause instead of each waiting out
//! its own retries and timeouts.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use parking_lot::Mutex;

use crate::error::{Result, UcmError};

/// Fails requests fast while the server is known to be unreachable.
///
/// A transport failure (connection refused or reset, timeout) opens the
/// breaker for a pause that starts at 250 ms and doubles up to 5 s; any
/// success closes it. While open, lookups answer "absent" and transfers fail
/// at once with the last error, so a dead server costs the engine nothing
/// but recomputation (and a `Cache` tier keeps dirty blocks for later).
pub struct Breaker {
    epoch: Instant,
    open_until_ms: AtomicU64,
    pause_ms: AtomicU64,
    last_error: Mutex<String>,
    trips: AtomicU64,
}

impl Default for Breaker {
    fn default() -> Self {
        Breaker {
            epoch: Instant::now(),
            open_until_ms: AtomicU64::new(0),
            pause_ms: AtomicU64::new(0),
            last_error: Mutex::new(String::new()),
            trips: AtomicU64::new(0),
        }
    }
}

impl Breaker {
    const MIN_PAUSE_MS: u64 = 250;
    const MAX_PAUSE_MS: u64 = 5_000;

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// `Err` with the last transport error while the breaker is open.
    pub fn check(&self, what: &str) -> Result<()> {
        if self.now_ms() < self.open_until_ms.load(Ordering::Acquire) {
            return Err(UcmError::TaskFailed(format!(
                "{what}: server unavailable ({}); retrying shortly",
                self.last_error.lock()
            )));
        }
        Ok(())
    }

    /// True while open.
    pub fn is_open(&self) -> bool {
        self.now_ms() < self.open_until_ms.load(Ordering::Acquire)
    }

    /// Records a transport failure.
    pub fn trip(&self, error: &str) {
        let pause = (self.pause_ms.load(Ordering::Relaxed) * 2)
            .clamp(Self::MIN_PAUSE_MS, Self::MAX_PAUSE_MS);
        self.pause_ms.store(pause, Ordering::Relaxed);
        *self.last_error.lock() = error.to_string();
        self.open_until_ms
            .store(self.now_ms() + pause, Ordering::Release);
        if self.trips.fetch_add(1, Ordering::Relaxed) % 64 == 0 {
            log::warn!("remote store unreachable ({error}); failing fast for {pause} ms");
        }
    }

    /// Records a success.
    pub fn reset(&self) {
        if self.pause_ms.swap(0, Ordering::Relaxed) != 0 {
            self.open_until_ms.store(0, Ordering::Release);
            log::info!("remote store reachable again");
        }
    }

    /// How many times it opened.
    pub fn trips(&self) -> u64 {
        self.trips.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn breaker_opens_and_closes() {
        let b = Breaker::default();
        assert!(b.check("x").is_ok());
        b.trip("connection refused");
        let e = b.check("load").unwrap_err().to_string();
        assert!(e.contains("connection refused"), "{e}");
        b.reset();
        assert!(b.check("x").is_ok());
    }
}
