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
//!
//! Over 600 lines: most of it is its unit tests, kept beside the engine.

use std::os::fd::RawFd;
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};

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

/// Runs a callback, containing a panic so that one bad callback cannot take
/// an engine thread down with it.
pub(crate) fn run_callback(done: IoDone, res: std::io::Result<usize>) {
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || done(res)));
    if outcome.is_err() {
        log::error!("an I/O completion callback panicked; the engine thread keeps running");
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
        for i in 0..cfg.threads.max(1) {
            let rx = rx.clone();
            let handle = std::thread::Builder::new()
                .name(format!("ucm-psync-{i}"))
                .spawn(move || worker(rx))
                .map_err(|e| crate::UcmError::os("spawn I/O thread", "", e))?;
            // On error above, dropping `engine` shuts down the started ones.
            engine.workers.push(handle);
        }
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
        if req.is_empty() {
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

fn closed() -> std::io::Error {
    std::io::Error::other("I/O engine is shut down")
}

impl Drop for PsyncEngine {
    fn drop(&mut self) {
        drop(self.tx.take());
        let me = std::thread::current().id();
        for handle in self.workers.drain(..) {
            // The last reference may be dropped inside a callback on a
            // worker: that worker exits on its own once the queue is empty.
            if handle.thread().id() == me {
                continue;
            }
            if handle.join().is_err() {
                log::error!("a psync I/O worker panicked");
            }
        }
    }
}

/// Test helpers shared by both engines' test suites.
#[cfg(test)]
pub(crate) mod test_support {
    use super::*;
    use crate::io::{AlignedBuf, DIRECT_ALIGN};
    use std::fs::{File, OpenOptions};
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    pub fn open(path: &std::path::Path, direct: bool) -> File {
        let mut o = OpenOptions::new();
        o.read(true).write(true).create(true).truncate(false);
        if direct {
            o.custom_flags(libc::O_DIRECT);
        }
        o.open(path).expect("open test file")
    }

    pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    fn seg(b: &AlignedBuf) -> MemSeg {
        b.as_seg()
    }

    fn req(op: IoOp, f: &File, offset: u64, iov: Vec<MemSeg>) -> IoRequest {
        IoRequest {
            op,
            fd: f.as_raw_fd(),
            offset,
            iov,
            fixed: None,
        }
    }

    pub fn round_trip_direct(e: &dyn IoEngine) {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = open(&dir.path().join("d"), true);
        let len = 256 << 10;
        let mut w = AlignedBuf::new(len);
        w.copy_from_slice(&pattern(1, len));
        assert_eq!(
            e.submit_wait(req(IoOp::Write, &f, 4096, vec![seg(&w)]))
                .expect("write"),
            len
        );
        let r = AlignedBuf::new(len);
        assert_eq!(
            e.submit_wait(req(IoOp::Read, &f, 4096, vec![seg(&r)]))
                .expect("read"),
            len
        );
        assert_eq!(&r[..], &w[..]);
    }

    pub fn round_trip_buffered_unaligned(e: &dyn IoEngine) {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = open(&dir.path().join("b"), false);
        let data = pattern(2, 100_003);
        // Deliberately misaligned heap memory and offset.
        let src = data[1..].to_vec();
        let iov = vec![
            MemSeg {
                addr: src.as_ptr() as usize,
                len: 777,
            },
            MemSeg {
                addr: src.as_ptr() as usize + 777,
                len: src.len() - 777,
            },
        ];
        assert_eq!(
            e.submit_wait(req(IoOp::Write, &f, 13, iov)).expect("write"),
            src.len()
        );
        let mut dst = vec![0u8; src.len() + 1];
        let iov = vec![MemSeg {
            addr: dst.as_mut_ptr() as usize + 1,
            len: src.len(),
        }];
        assert_eq!(
            e.submit_wait(req(IoOp::Read, &f, 13, iov)).expect("read"),
            src.len()
        );
        assert_eq!(&dst[1..], &src[..]);
    }

    pub fn vectored_many_segments(e: &dyn IoEngine, direct: bool) {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = open(&dir.path().join("v"), direct);
        let seg_len = 32 << 10;
        let src: Vec<AlignedBuf> = (0..32)
            .map(|i| {
                let mut b = AlignedBuf::new(seg_len);
                b.copy_from_slice(&pattern(100 + i, seg_len));
                b
            })
            .collect();
        let iov = src.iter().map(seg).collect();
        assert_eq!(
            e.submit_wait(req(IoOp::Write, &f, 0, iov)).expect("writev"),
            32 * seg_len
        );
        // Read back as one contiguous buffer, then as 32 separate ones in
        // reverse memory order.
        let whole = AlignedBuf::new(32 * seg_len);
        assert_eq!(
            e.submit_wait(req(IoOp::Read, &f, 0, vec![seg(&whole)]))
                .expect("read"),
            32 * seg_len
        );
        for (i, b) in src.iter().enumerate() {
            assert_eq!(
                &whole[i * seg_len..(i + 1) * seg_len],
                &b[..],
                "segment {i}"
            );
        }
        let dst: Vec<AlignedBuf> = (0..32).map(|_| AlignedBuf::new(seg_len)).collect();
        let iov = dst.iter().rev().map(seg).collect();
        assert_eq!(
            e.submit_wait(req(IoOp::Read, &f, 0, iov)).expect("readv"),
            32 * seg_len
        );
        for (i, b) in dst.iter().rev().enumerate() {
            assert_eq!(&b[..], &src[i][..], "segment {i}");
        }
    }

    pub fn more_than_iov_max_segments(e: &dyn IoEngine) {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = open(&dir.path().join("m"), false);
        let n = IOV_MAX * 2 + 7;
        let src = pattern(5, n * 3);
        let iov = (0..n)
            .map(|i| MemSeg {
                addr: src.as_ptr() as usize + i * 3,
                len: 3,
            })
            .collect();
        assert_eq!(
            e.submit_wait(req(IoOp::Write, &f, 0, iov)).expect("write"),
            n * 3
        );
        let mut dst = vec![0u8; n * 3];
        let iov = vec![MemSeg {
            addr: dst.as_mut_ptr() as usize,
            len: dst.len(),
        }];
        assert_eq!(
            e.submit_wait(req(IoOp::Read, &f, 0, iov)).expect("read"),
            n * 3
        );
        assert_eq!(dst, src);
    }

    pub fn concurrent(e: Arc<dyn IoEngine>, direct: bool) {
        const THREADS: usize = 8;
        const PER: usize = 200;
        const LEN: usize = 8192;
        let dir = tempfile::tempdir().expect("tempdir");
        let f = Arc::new(open(&dir.path().join("c"), direct));
        std::thread::scope(|s| {
            for t in 0..THREADS {
                let e = Arc::clone(&e);
                let f = Arc::clone(&f);
                s.spawn(move || {
                    let bufs: Vec<AlignedBuf> = (0..PER)
                        .map(|i| {
                            let mut b = AlignedBuf::new(LEN);
                            b.copy_from_slice(&pattern((t * PER + i) as u64, LEN));
                            b
                        })
                        .collect();
                    // One `op` request per buffer (buffer i at this thread's
                    // i-th slot), all in flight at once, then every completion.
                    let submit_all = |op: IoOp, bufs: &[AlignedBuf], what: &str| {
                        let (tx, rx) = crossbeam_channel::unbounded();
                        for (i, b) in bufs.iter().enumerate() {
                            let tx = tx.clone();
                            let off = ((t * PER + i) * LEN) as u64;
                            e.submit(
                                req(op, &f, off, vec![b.as_seg()]),
                                Box::new(move |r| {
                                    let _ = tx.send(r);
                                }),
                            );
                        }
                        for _ in 0..bufs.len() {
                            assert_eq!(rx.recv().expect("completion").expect(what), LEN);
                        }
                    };
                    submit_all(IoOp::Write, &bufs, "write");
                    let outs: Vec<AlignedBuf> = (0..PER).map(|_| AlignedBuf::new(LEN)).collect();
                    submit_all(IoOp::Read, &outs, "read");
                    for (i, b) in outs.iter().enumerate() {
                        assert_eq!(&b[..], &bufs[i][..], "thread {t} request {i}");
                    }
                });
            }
        });
    }

    pub fn read_past_eof(e: &dyn IoEngine) {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = open(&dir.path().join("eof"), true);
        let mut w = AlignedBuf::new(8192);
        w.copy_from_slice(&pattern(9, 8192));
        assert_eq!(
            e.submit_wait(req(IoOp::Write, &f, 0, vec![w.as_seg()]))
                .expect("write"),
            8192
        );
        let r = AlignedBuf::new(16384);
        assert_eq!(
            e.submit_wait(req(IoOp::Read, &f, 4096, vec![r.as_seg()]))
                .expect("read"),
            4096
        );
        assert_eq!(&r[..4096], &w[4096..]);
        // Entirely past the end: 0 bytes.
        assert_eq!(
            e.submit_wait(req(IoOp::Read, &f, 1 << 20, vec![r.as_seg()]))
                .expect("read"),
            0
        );
        // Split across segments.
        let a = AlignedBuf::new(4096);
        let b = AlignedBuf::new(8192);
        assert_eq!(
            e.submit_wait(req(IoOp::Read, &f, 0, vec![a.as_seg(), b.as_seg()]))
                .expect("readv"),
            8192
        );
        assert_eq!(&b[..4096], &w[4096..]);
    }

    pub fn errors_reach_callback(e: &dyn IoEngine) {
        let buf = AlignedBuf::new(4096);
        // Bad fd.
        let err = e
            .submit_wait(IoRequest {
                op: IoOp::Read,
                fd: -1,
                offset: 0,
                iov: vec![buf.as_seg()],
                fixed: None,
            })
            .expect_err("bad fd must fail");
        assert_eq!(err.raw_os_error(), Some(libc::EBADF));
        // O_DIRECT with a misaligned length (on ext4: EINVAL).
        let dir = tempfile::tempdir().expect("tempdir");
        let f = open(&dir.path().join("e"), true);
        let seg = MemSeg {
            addr: buf.as_ptr() as usize,
            len: 100,
        };
        let err = e
            .submit_wait(req(IoOp::Write, &f, 0, vec![seg]))
            .expect_err("misaligned O_DIRECT write");
        assert_eq!(err.raw_os_error(), Some(libc::EINVAL));
        // Read-only descriptor written to.
        let ro = File::open(dir.path().join("e")).expect("open ro");
        let err = e
            .submit_wait(req(IoOp::Write, &ro, 0, vec![buf.as_seg()]))
            .expect_err("write to ro fd");
        assert_eq!(err.raw_os_error(), Some(libc::EBADF));
        // Zero-length requests complete immediately with 0.
        assert_eq!(
            e.submit_wait(req(IoOp::Read, &f, 0, vec![]))
                .expect("empty"),
            0
        );
        // The engine still works afterwards.
        let w = AlignedBuf::new(4096);
        assert_eq!(
            e.submit_wait(req(IoOp::Write, &f, 0, vec![w.as_seg()]))
                .expect("write"),
            4096
        );
    }

    pub fn bounce_round_trip(e: &dyn IoEngine) {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = open(&dir.path().join("bb"), true);
        let mut b = e.bounce(10_000);
        assert_eq!(b.len(), 12288);
        assert_eq!(b.as_ptr() as usize % DIRECT_ALIGN, 0);
        let data = pattern(11, b.len());
        b.copy_from_slice(&data);
        let wr = IoRequest {
            op: IoOp::Write,
            fd: f.as_raw_fd(),
            offset: 0,
            iov: vec![b.as_seg(b.len())],
            fixed: b.fixed_index(),
        };
        assert_eq!(e.submit_wait(wr).expect("write"), b.len());
        drop(b);
        let r = e.bounce(12288);
        let rd = IoRequest {
            op: IoOp::Read,
            fd: f.as_raw_fd(),
            offset: 0,
            iov: vec![r.as_seg(r.len())],
            fixed: r.fixed_index(),
        };
        assert_eq!(e.submit_wait(rd).expect("read"), 12288);
        assert_eq!(&r[..], &data[..]);
    }

    /// Submits many requests and drops the engine at once: every callback
    /// must have run by the time drop returns.
    pub fn shutdown_with_requests_in_flight(e: Box<dyn IoEngine>) {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = Arc::new(open(&dir.path().join("s"), true));
        let count = Arc::new(AtomicUsize::new(0));
        let ok = Arc::new(AtomicUsize::new(0));
        const N: usize = 500;
        for i in 0..N {
            let mut b = AlignedBuf::new(16384);
            b.fill(i as u8);
            let req = IoRequest {
                op: IoOp::Write,
                fd: f.as_raw_fd(),
                offset: (i * 16384) as u64,
                iov: vec![b.as_seg()],
                fixed: None,
            };
            let (count, ok, f) = (Arc::clone(&count), Arc::clone(&ok), Arc::clone(&f));
            e.submit(
                req,
                Box::new(move |r| {
                    // Keep the buffer and the file alive until completion.
                    let _keep = (b, f);
                    if r.map(|n| n == 16384).unwrap_or(false) {
                        ok.fetch_add(1, Ordering::SeqCst);
                    }
                    count.fetch_add(1, Ordering::SeqCst);
                }),
            );
        }
        drop(e);
        assert_eq!(count.load(Ordering::SeqCst), N);
        assert_eq!(ok.load(Ordering::SeqCst), N);
    }

    /// The last engine reference is dropped inside a callback (on an engine
    /// thread): must not deadlock or panic.
    pub fn drop_inside_callback(e: Arc<dyn IoEngine>) {
        let (tx, rx) = crossbeam_channel::bounded(1);
        let (go_tx, go_rx) = crossbeam_channel::bounded::<()>(1);
        let buf = AlignedBuf::new(4096);
        let req = IoRequest {
            op: IoOp::Read,
            fd: -1,
            offset: 0,
            iov: vec![buf.as_seg()],
            fixed: None,
        };
        let holder = Arc::clone(&e);
        e.submit(
            req,
            Box::new(move |r| {
                // Wait until the test thread has dropped its reference, so
                // that this drop is the last one.
                let _ = go_rx.recv();
                drop(holder);
                let _ = tx.send(r.is_err());
            }),
        );
        drop(e);
        let _ = go_tx.send(());
        assert_eq!(
            rx.recv_timeout(std::time::Duration::from_secs(10)),
            Ok(true)
        );
    }

    /// Callbacks may submit follow-up requests from the engine thread.
    pub fn chained_submit_from_callback(e: Arc<dyn IoEngine>) {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = Arc::new(open(&dir.path().join("chain"), false));
        let data = Arc::new(pattern(21, 4096));
        let (tx, rx) = crossbeam_channel::unbounded();
        fn step(
            e: Arc<dyn IoEngine>,
            f: Arc<File>,
            data: Arc<Vec<u8>>,
            i: usize,
            tx: crossbeam_channel::Sender<usize>,
        ) {
            if i == 300 {
                let _ = tx.send(i);
                return;
            }
            let req = IoRequest {
                op: IoOp::Write,
                fd: f.as_raw_fd(),
                offset: (i * 4096) as u64,
                iov: vec![MemSeg {
                    addr: data.as_ptr() as usize,
                    len: data.len(),
                }],
                fixed: None,
            };
            let e2 = Arc::clone(&e);
            e.submit(
                req,
                Box::new(move |r| {
                    assert_eq!(r.expect("chained write"), 4096);
                    step(e2, f, data, i + 1, tx);
                }),
            );
        }
        step(Arc::clone(&e), Arc::clone(&f), Arc::clone(&data), 0, tx);
        assert_eq!(rx.recv_timeout(std::time::Duration::from_secs(30)), Ok(300));
        assert_eq!(f.metadata().expect("stat").len(), 300 * 4096);
    }
}

#[cfg(test)]
mod tests {
    use super::test_support as ts;
    use super::*;
    use std::sync::Arc;

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

    #[test]
    fn psync_round_trip_direct() {
        ts::round_trip_direct(&engine());
    }

    #[test]
    fn psync_round_trip_buffered_unaligned() {
        ts::round_trip_buffered_unaligned(&engine());
    }

    #[test]
    fn psync_vectored() {
        ts::vectored_many_segments(&engine(), true);
        ts::vectored_many_segments(&engine(), false);
        ts::more_than_iov_max_segments(&engine());
    }

    #[test]
    fn psync_concurrent() {
        ts::concurrent(Arc::new(engine()), true);
        ts::concurrent(Arc::new(engine()), false);
    }

    #[test]
    fn psync_read_past_eof() {
        ts::read_past_eof(&engine());
    }

    #[test]
    fn psync_errors() {
        ts::errors_reach_callback(&engine());
    }

    #[test]
    fn psync_bounce() {
        let e = engine();
        ts::bounce_round_trip(&e);
        assert!(!e.pool().is_registered());
        assert_eq!(e.bounce(4096).fixed_index(), None);
    }

    #[test]
    fn psync_shutdown() {
        ts::shutdown_with_requests_in_flight(Box::new(engine()));
        ts::drop_inside_callback(Arc::new(engine()));
    }

    #[test]
    fn psync_chained() {
        ts::chained_submit_from_callback(Arc::new(engine()));
    }
}
