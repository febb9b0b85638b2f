//! The portable engine: a pool of OS threads doing blocking
//! `preadv`/`pwritev`.
//!
//! `threads` workers (named `ucm-psync-N`) block on one shared crossbeam
//! channel (no polling when idle); each request runs to completion on one
//! worker, retrying short transfers and EINTR, and its callback runs on that
//! worker. The channel is unbounded, so [`IoEngine::submit`] never blocks;
//! callers bound their outstanding work. The worker count is the queue depth
//! this engine presents to the device.
//!
//! Dropping the engine closes the channel; workers finish every request
//! already queued (each callback still runs exactly once) and are joined.

use std::os::fd::RawFd;
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};

use super::threads::{self, closed, run_callback};
use super::{BounceBuf, BouncePool, IoDone, IoEngine, IoEngineConfig, IoOp, IoRequest};
use crate::block::MemSeg;

/// Most iovecs one `preadv`/`pwritev`/READV accepts (Linux `UIO_MAXIOV`);
/// longer requests are issued in pieces.
pub(crate) const IOV_MAX: usize = 1024;

/// How often a transfer is retried after EAGAIN before the error is
/// reported (regular files only see it with non-blocking flags).
pub(crate) const MAX_EAGAIN_RETRIES: u32 = 1000;

/// The iovec array of one request, consumed from the front as bytes
/// transfer.
pub(crate) struct IoVecs {
    v: Vec<libc::iovec>,
    start: usize,
}

// SAFETY: the raw pointers in the iovecs are caller memory that the
// `IoRequest` contract keeps valid until the completion callback runs; this
// type never dereferences them itself, it only hands them to the kernel, so
// moving the array to an engine thread is sound.
unsafe impl Send for IoVecs {}

impl IoVecs {
    /// Builds the array, dropping empty segments.
    pub(crate) fn from_segs(segs: &[MemSeg]) -> Self {
        let v = segs
            .iter()
            .filter(|s| s.len > 0)
            .map(|s| libc::iovec {
                iov_base: s.addr as *mut libc::c_void,
                iov_len: s.len,
            })
            .collect();
        Self { v, start: 0 }
    }

    /// The untransferred iovecs, at most [`IOV_MAX`] of them. The returned
    /// pointer stays valid (the heap array never moves) until the next
    /// [`IoVecs::advance`] or drop.
    pub(crate) fn head(&self) -> &[libc::iovec] {
        let end = self.v.len().min(self.start + IOV_MAX);
        &self.v[self.start..end]
    }

    /// Marks `n` more bytes as transferred.
    pub(crate) fn advance(&mut self, mut n: usize) {
        while n > 0 && self.start < self.v.len() {
            let cur = &mut self.v[self.start];
            if n >= cur.iov_len {
                n -= cur.iov_len;
                self.start += 1;
            } else {
                // Pointer arithmetic on an integer address: no dereference.
                cur.iov_base = (cur.iov_base as usize + n) as *mut libc::c_void;
                cur.iov_len -= n;
                n = 0;
            }
        }
    }
}

fn einval(msg: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidInput, msg.to_string())
}

/// Performs one request synchronously: loops over short transfers, retries
/// EINTR (and EAGAIN a bounded number of times), stops at EOF on reads.
pub(crate) fn run_blocking(
    op: IoOp,
    fd: RawFd,
    offset: u64,
    segs: &[MemSeg],
) -> std::io::Result<usize> {
    let total: usize = segs.iter().map(|s| s.len).sum();
    let mut iov = IoVecs::from_segs(segs);
    let mut done = 0usize;
    let mut eagain = 0u32;
    while done < total {
        let off = offset
            .checked_add(done as u64)
            .and_then(|o| libc::off_t::try_from(o).ok())
            .ok_or_else(|| einval("file offset does not fit in off_t"))?;
        let head = iov.head();
        // `head` has between 1 and IOV_MAX entries, so the cast is lossless.
        let cnt = head.len() as libc::c_int;
        // SAFETY: `head` points to `cnt` initialised iovecs owned by `iov`;
        // the memory they describe is valid (and, for reads, writable and
        // unaliased) per the `IoRequest` contract, and `fd` is open per the
        // same contract. The kernel validates the fd itself.
        let r = unsafe {
            match op {
                IoOp::Read => libc::preadv(fd, head.as_ptr(), cnt, off),
                IoOp::Write => libc::pwritev(fd, head.as_ptr(), cnt, off),
            }
        };
        if r < 0 {
            let err = std::io::Error::last_os_error();
            match err.raw_os_error() {
                Some(libc::EINTR) => continue,
                Some(libc::EAGAIN) if eagain < MAX_EAGAIN_RETRIES => {
                    eagain += 1;
                    std::thread::yield_now();
                    continue;
                }
                _ => return Err(err),
            }
        }
        // `r >= 0` here.
        let n = r as usize;
        if n == 0 {
            match op {
                IoOp::Read => break, // end of file
                IoOp::Write => {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::WriteZero,
                        format!("pwritev wrote 0 bytes at offset {off}"),
                    ))
                }
            }
        }
        done += n;
        iov.advance(n);
    }
    Ok(done)
}

type Job = (IoRequest, IoDone);

/// pread/pwrite thread-pool engine.
pub struct PsyncEngine {
    tx: Option<Sender<Job>>,
    workers: Vec<JoinHandle<()>>,
    pool: BouncePool,
}

impl std::fmt::Debug for PsyncEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PsyncEngine")
            .field("threads", &self.workers.len())
            .field("pool", &self.pool)
            .finish()
    }
}

impl PsyncEngine {
    /// Starts `cfg.threads` workers (at least one) and an unregistered
    /// bounce pool of `cfg.bounce_pool_bytes`. `kind` and `queue_depth` are
    /// ignored.
    pub fn new(cfg: &IoEngineConfig) -> crate::Result<Self> {
        let (tx, rx) = crossbeam_channel::unbounded::<Job>();
        let mut engine = Self {
            tx: Some(tx),
            workers: Vec::new(),
            pool: BouncePool::new(cfg.bounce_pool_bytes),
        };
        threads::spawn_all("ucm-psync", cfg.threads.max(1), &mut engine.workers, |_| {
            let rx = rx.clone();
            move || worker(rx)
        })?;
        Ok(engine)
    }

    /// The engine's bounce pool (never registered).
    pub fn pool(&self) -> &BouncePool {
        &self.pool
    }

    /// Number of worker threads.
    pub fn threads(&self) -> usize {
        self.workers.len()
    }
}

fn worker(rx: Receiver<Job>) {
    // `recv` keeps returning queued jobs after the sender is dropped and
    // fails only once the channel is empty: every queued request completes.
    while let Ok((req, done)) = rx.recv() {
        let res = run_blocking(req.op, req.fd, req.offset, &req.iov);
        run_callback(done, res);
    }
}

impl IoEngine for PsyncEngine {
    fn name(&self) -> &'static str {
        "psync"
    }

    fn submit(&self, req: IoRequest, done: IoDone) {
        if req.bytes() == 0 {
            run_callback(done, Ok(0));
            return;
        }
        match &self.tx {
            Some(tx) => {
                if let Err(crossbeam_channel::SendError((_, done))) = tx.send((req, done)) {
                    run_callback(done, Err(closed()));
                }
            }
            None => run_callback(done, Err(closed())),
        }
    }

    fn bounce(&self, len: usize) -> BounceBuf {
        self.pool.get(len)
    }
}

impl Drop for PsyncEngine {
    fn drop(&mut self) {
        drop(self.tx.take());
        threads::join_all(&mut self.workers, "a psync I/O worker panicked");
    }
}

#[cfg(test)]
mod tests {
    use super::super::engine_tests::{self as suite, engine_test_suite};
    use super::*;

    fn engine() -> PsyncEngine {
        PsyncEngine::new(&IoEngineConfig {
            kind: super::super::IoEngineKind::Psync,
            threads: 4,
            queue_depth: 16,
            bounce_pool_bytes: 1 << 20,
        })
        .expect("psync engine")
    }

    #[test]
    fn iovecs_advance() {
        let segs = [
            MemSeg {
                addr: 1000,
                len: 10,
            },
            MemSeg { addr: 0, len: 0 },
            MemSeg { addr: 2000, len: 5 },
        ];
        let mut v = IoVecs::from_segs(&segs);
        assert_eq!(v.head().len(), 2);
        v.advance(4);
        assert_eq!(v.head()[0].iov_base as usize, 1004);
        assert_eq!(v.head()[0].iov_len, 6);
        v.advance(7);
        assert_eq!(v.head().len(), 1);
        assert_eq!(v.head()[0].iov_base as usize, 2001);
        v.advance(4);
        assert!(v.head().is_empty());
    }

    #[test]
    fn psync_threads_are_named() {
        let e = engine();
        assert_eq!(e.threads(), 4);
        assert_eq!(e.workers[0].thread().name(), Some("ucm-psync-0"));
        assert_eq!(e.name(), "psync");
    }

    engine_test_suite!(engine);

    #[test]
    fn psync_bounce() {
        let e = engine();
        suite::bounce_round_trip(&e);
        assert!(!e.pool().is_registered());
        assert_eq!(e.bounce(4096).fixed_index(), None);
    }
}
