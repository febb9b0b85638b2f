//! The io_uring engine (Linux only), on the `io-uring` crate.
//!
//! # Design: shared submission queue, one completion thread per ring
//!
//! The engine owns `threads` rings of `queue_depth` entries each and spreads
//! requests over them round-robin. For every ring:
//!
//! * **Submitters push SQEs themselves.** A submitting thread takes the
//!   ring's state mutex (which also guards the SQ: every
//!   `submission_shared()` happens under it, so only one `SubmissionQueue`
//!   ever exists at a time, as the crate requires), stores the request in a
//!   slot of the in-flight slab, pushes its SQE, releases the lock and calls
//!   `io_uring_enter` to submit. With O_DIRECT the kernel issues the block
//!   I/O right there, on the submitting thread, without a hand-off.
//! * **One completion thread per ring** (`ucm-uring-N`) blocks in
//!   `submit_and_wait(1)` (no busy polling; no SQPOLL), is the only thread
//!   that ever creates a `CompletionQueue` for its ring, reaps CQEs, retries
//!   short transfers and EAGAIN/EINTR by pushing a new SQE for the same slot,
//!   and runs the callbacks (outside the lock, so callbacks may submit).
//!
//! Concurrent `io_uring_enter` calls from the submitters and the completion
//! thread are fine: the kernel serialises them on the ring's lock and only
//! consumes SQEs up to the published tail, which the crate stores with
//! release ordering after the SQE is written. A dedicated ring thread fed by
//! a channel was not needed; it would add one thread hop per request and a
//! second wake-up mechanism (eventfd) next to the CQ wait.
//!
//! **Back-pressure.** At most `queue_depth` requests per ring are in flight
//! (the slab's size; the SQ has at least that many entries and the CQ twice
//! as many, so the SQ never fills and the CQ never overflows). Requests
//! beyond that wait, in order, in the ring's pending queue and are started
//! by the completion thread as slots free up. `submit` never blocks, like
//! psync's unbounded channel: blocking there could deadlock a callback that
//! submits a follow-up request from the completion thread. Callers bound
//! their outstanding work. (A defensive path still handles a full SQ by
//! submitting queued SQEs and retrying; nothing is ever dropped.)
//!
//! **Buffers.** Vectored requests use READV/WRITEV with the iovec array kept
//! in the request's slab entry (its heap array never moves) until the final
//! CQE; requests longer than `IOV_MAX` segments are issued in pieces. A
//! one-segment request whose `fixed` index names a buffer registered with
//! this engine's rings, and whose memory lies inside that buffer, uses
//! READ_FIXED/WRITE_FIXED; otherwise `fixed` is ignored. The bounce pool's
//! arena is registered with every ring when the kernel allows it
//! (ENOMEM/EPERM from the memlock limit, or anything else: one debug line,
//! and the pool stays unregistered).
//!
//! **Errors.** A negative CQE result is reported through the callback as the
//! OS error, except EAGAIN/EINTR which are retried (bounded). -ECANCELED
//! (which this engine never causes itself) is reported as an error. A read
//! returning 0 is end of file: the callback gets the bytes so far.
//!
//! **Shutdown.** Drop marks every ring closing, pushes a NOP carrying a
//! sentinel `user_data` to wake an idle completion thread, and joins the
//! threads, which exit once their ring has no request in flight or pending:
//! every request submitted before the drop completes and its callback runs.
//!
//! Over 600 lines with its unit tests (the last 146, mostly the checks only
//! io_uring has: tiny queues, large offsets, shutdown with chained submits);
//! the engine itself is 549 lines.

use std::collections::VecDeque;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use io_uring::{opcode, squeue, types, IoUring, Probe};
use parking_lot::Mutex;

use super::psync::{IoVecs, MAX_EAGAIN_RETRIES};
use super::threads::{self, closed, run_callback};
use super::{BounceBuf, BouncePool, IoDone, IoEngine, IoEngineConfig, IoOp, IoRequest};

/// `user_data` of the shutdown NOP (slot indices are far below it).
const WAKE: u64 = u64::MAX;
/// Largest single fixed transfer (a registered buffer is at most 1 GiB).
const MAX_FIXED_LEN: usize = 1 << 30;
/// Largest ring the kernel accepts.
const MAX_ENTRIES: u32 = 32768;

/// One request in flight: everything the kernel may still read (the iovec
/// array) lives here until the final CQE is reaped.
struct InFlight {
    op: IoOp,
    fd: RawFd,
    /// File offset of the next byte to transfer.
    offset: u64,
    iov: IoVecs,
    fixed: Option<u16>,
    total: usize,
    done: usize,
    retries: u32,
    cb: IoDone,
}

struct State {
    slots: Vec<Option<InFlight>>,
    free: Vec<usize>,
    pending: VecDeque<(IoRequest, IoDone)>,
    closing: bool,
}

struct Ring {
    uring: IoUring,
    /// Guards the slab, the pending queue *and* the submission queue.
    state: Mutex<State>,
    /// `(addr, len)` of each registered fixed buffer, by index.
    fixed_bufs: Vec<(usize, usize)>,
    fixed_ops: AtomicU64,
}

type Finished = Vec<(IoDone, std::io::Result<usize>)>;

impl Ring {
    /// The fixed-buffer index to use for `req`, if it is valid here.
    fn fixed_for(&self, req: &IoRequest) -> Option<u16> {
        let idx = req.fixed?;
        let [seg] = req.iov.as_slice() else {
            return None;
        };
        let &(addr, len) = self.fixed_bufs.get(usize::from(idx))?;
        let end = seg.addr.checked_add(seg.len)?;
        (seg.addr >= addr && end <= addr + len).then_some(idx)
    }

    /// Puts `req` in a free slot and pushes its first SQE. The caller holds
    /// the state lock, has checked that a slot is free, and calls
    /// [`Ring::flush`] after releasing the lock.
    fn start(&self, st: &mut State, req: IoRequest, cb: IoDone) {
        let Some(idx) = st.free.pop() else {
            st.pending.push_front((req, cb));
            return;
        };
        let entry = InFlight {
            op: req.op,
            fd: req.fd,
            offset: req.offset,
            fixed: self.fixed_for(&req),
            iov: IoVecs::from_segs(&req.iov),
            total: req.bytes(),
            done: 0,
            retries: 0,
            cb,
        };
        st.slots[idx] = Some(entry);
        self.push_slot(st, idx);
    }

    /// Pushes the SQE for the untransferred rest of slot `idx`.
    fn push_slot(&self, st: &State, idx: usize) {
        let Some(e) = st.slots.get(idx).and_then(Option::as_ref) else {
            return;
        };
        let fd = types::Fd(e.fd);
        let head = e.iov.head();
        let sqe = match (e.fixed, head) {
            (Some(buf_index), [v]) => {
                self.fixed_ops.fetch_add(1, Ordering::Relaxed);
                // Lossless: bounded by MAX_FIXED_LEN (1 GiB).
                let len = v.iov_len.min(MAX_FIXED_LEN) as u32;
                let ptr = v.iov_base.cast::<u8>();
                match e.op {
                    IoOp::Read => opcode::ReadFixed::new(fd, ptr, len, buf_index)
                        .offset(e.offset)
                        .build(),
                    IoOp::Write => opcode::WriteFixed::new(fd, ptr.cast_const(), len, buf_index)
                        .offset(e.offset)
                        .build(),
                }
            }
            // `head` holds 1..=IOV_MAX entries: the length cast is lossless.
            (_, _) => match e.op {
                IoOp::Read => opcode::Readv::new(fd, head.as_ptr(), head.len() as u32)
                    .offset(e.offset)
                    .build(),
                IoOp::Write => opcode::Writev::new(fd, head.as_ptr(), head.len() as u32)
                    .offset(e.offset)
                    .build(),
            },
        };
        // SAFETY (for `push`): the SQE points at (a) the iovec array owned by
        // slot `idx`, which stays in the slab, unmodified, until this SQE's
        // CQE has been reaped (the slot is only advanced or freed by the
        // completion thread after reaping it; the array's heap buffer never
        // moves); (b) caller memory and (c) `fd`, both of which the
        // `IoRequest` contract keeps valid until the callback, which runs
        // after the final CQE. For fixed ops, `fixed_for` checked that the
        // range lies inside registered buffer `buf_index`.
        unsafe { self.push(&sqe.user_data(idx as u64)) };
    }

    /// Pushes one SQE, making room if the SQ is full. Caller holds the state
    /// lock.
    ///
    /// # Safety
    /// Everything `sqe` points to must stay valid until its CQE is reaped.
    unsafe fn push(&self, sqe: &squeue::Entry) {
        loop {
            // SAFETY: the caller holds the state mutex, and every
            // `submission_shared` call happens under it, so no other
            // `SubmissionQueue` for this ring exists. The queue is dropped at
            // the end of this block, publishing the new tail.
            let pushed = unsafe {
                let mut sq = self.uring.submission_shared();
                // SAFETY: guaranteed by this function's contract.
                sq.push(sqe).is_ok()
            };
            if pushed {
                return;
            }
            // SQ full (not expected: the slab is no larger than the SQ):
            // hand the queued SQEs to the kernel, which frees their slots.
            self.flush();
        }
    }

    /// Submits the queued SQEs. EINTR is retried; EAGAIN/EBUSY (kernel short
    /// of memory, or CQ overflow) are retried with a short sleep, since an
    /// SQE that stays queued would otherwise wait for an unrelated wake-up.
    fn flush(&self) {
        let mut tries = 0u32;
        loop {
            match self.uring.submit() {
                Ok(_) => return,
                Err(e) => match e.raw_os_error() {
                    Some(libc::EINTR) => {}
                    Some(libc::EAGAIN) | Some(libc::EBUSY) if tries < 100_000 => {
                        tries += 1;
                        std::thread::sleep(Duration::from_micros(20));
                    }
                    _ => {
                        log::error!("io_uring submit failed ({e}); queued requests go out with the next submit");
                        return;
                    }
                },
            }
        }
    }

    /// Handles one CQE of slot `idx`; returns true when it pushed a retry.
    fn on_cqe(&self, st: &mut State, idx: usize, res: i32, finished: &mut Finished) -> bool {
        let Some(e) = st.slots.get_mut(idx).and_then(Option::as_mut) else {
            log::error!("io_uring completion for unknown slot {idx} ignored");
            return false;
        };
        let outcome = if res < 0 {
            let errno = -res;
            if (errno == libc::EAGAIN || errno == libc::EINTR) && e.retries < MAX_EAGAIN_RETRIES {
                e.retries += 1;
                None
            } else {
                Some(Err(std::io::Error::from_raw_os_error(errno)))
            }
        } else if res == 0 {
            match e.op {
                IoOp::Read => Some(Ok(e.done)), // end of file
                IoOp::Write => Some(Err(std::io::Error::new(
                    std::io::ErrorKind::WriteZero,
                    format!("io_uring write returned 0 at offset {}", e.offset),
                ))),
            }
        } else {
            // `res > 0`: the casts are lossless.
            let n = res as usize;
            e.done += n;
            e.offset += n as u64;
            e.iov.advance(n);
            (e.done >= e.total).then_some(Ok(e.done))
        };
        match outcome {
            Some(r) => {
                if let Some(e) = st.slots[idx].take() {
                    finished.push((e.cb, r));
                }
                st.free.push(idx);
                false
            }
            None => {
                self.push_slot(st, idx);
                true
            }
        }
    }
}

fn completion_loop(ring: Arc<Ring>) {
    let cap = ring.state.lock().slots.len();
    let mut cqes: Vec<(u64, i32)> = Vec::with_capacity(cap * 2 + 1);
    let mut finished: Finished = Vec::with_capacity(cap);
    loop {
        if let Err(e) = ring.uring.submitter().submit_and_wait(1) {
            match e.raw_os_error() {
                Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::EBUSY) => {}
                _ => {
                    log::error!("io_uring wait failed: {e}");
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        }
        {
            // SAFETY: this thread is the only one that ever creates a
            // `CompletionQueue` for this ring; it is dropped (syncing the
            // head) at the end of this block.
            let cq = unsafe { ring.uring.completion_shared() };
            cqes.extend(cq.map(|c| (c.user_data(), c.result())));
        }
        let mut pushed = false;
        let exit = {
            let mut st = ring.state.lock();
            for (user_data, res) in cqes.drain(..) {
                if user_data == WAKE {
                    continue;
                }
                // Slot indices are < cap, so the cast is lossless.
                pushed |= ring.on_cqe(&mut st, user_data as usize, res, &mut finished);
            }
            while !st.free.is_empty() {
                let Some((req, cb)) = st.pending.pop_front() else {
                    break;
                };
                ring.start(&mut st, req, cb);
                pushed = true;
            }
            st.closing && st.pending.is_empty() && st.free.len() == st.slots.len()
        };
        if pushed {
            ring.flush();
        }
        for (cb, res) in finished.drain(..) {
            run_callback(cb, res);
        }
        if exit {
            break;
        }
    }
}

/// io_uring engine: `threads` rings, each with a completion thread.
pub struct UringEngine {
    // Field order matters: rings (and their registrations) go before the
    // pool whose arena they reference.
    rings: Vec<Arc<Ring>>,
    threads: Vec<JoinHandle<()>>,
    next: AtomicUsize,
    pool: BouncePool,
}

impl std::fmt::Debug for UringEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UringEngine")
            .field("rings", &self.rings.len())
            .field("pool", &self.pool)
            .finish()
    }
}

fn unsupported(what: &str, e: std::io::Error) -> crate::UcmError {
    crate::UcmError::Unsupported(format!("io_uring {what}: {e}"))
}

impl UringEngine {
    /// Sets up `cfg.threads` rings (at least one) of `cfg.queue_depth`
    /// entries (clamped to 1..=32768), probes that READV, WRITEV and NOP are
    /// supported, registers a `cfg.bounce_pool_bytes` bounce pool when the
    /// kernel allows it, and starts the completion threads.
    ///
    /// Fails with [`UcmError::Unsupported`](crate::UcmError::Unsupported)
    /// (carrying the OS error) when io_uring is unavailable: disabled by
    /// sysctl, blocked by seccomp, or missing an opcode.
    pub fn new(cfg: &IoEngineConfig) -> crate::Result<Self> {
        let qd = cfg.queue_depth.clamp(1, MAX_ENTRIES);
        let mut urings = Vec::new();
        for _ in 0..cfg.threads.max(1) {
            let u = IoUring::builder()
                .dontfork()
                .build(qd)
                .map_err(|e| unsupported("setup", e))?;
            urings.push(u);
        }
        let fixed_supported = probe(&urings[0])?;
        let pool = BouncePool::new(cfg.bounce_pool_bytes);
        let fixed_bufs = if fixed_supported {
            register(&urings, &pool)
        } else {
            Vec::new()
        };
        let rings: Vec<Arc<Ring>> = urings
            .into_iter()
            .map(|uring| {
                let cap = (qd as usize).min(uring.params().sq_entries() as usize);
                Arc::new(Ring {
                    uring,
                    state: Mutex::new(State {
                        slots: (0..cap).map(|_| None).collect(),
                        free: (0..cap).rev().collect(),
                        pending: VecDeque::new(),
                        closing: false,
                    }),
                    fixed_bufs: fixed_bufs.clone(),
                    fixed_ops: AtomicU64::new(0),
                })
            })
            .collect();
        let mut engine = Self {
            rings,
            threads: Vec::new(),
            next: AtomicUsize::new(0),
            pool,
        };
        let rings = &engine.rings;
        threads::spawn_all("ucm-uring", rings.len(), &mut engine.threads, |i| {
            let ring = Arc::clone(&rings[i]);
            move || completion_loop(ring)
        })?;
        Ok(engine)
    }

    /// The engine's bounce pool (registered with the rings when
    /// [`BouncePool::is_registered`] says so).
    pub fn pool(&self) -> &BouncePool {
        &self.pool
    }

    /// Number of rings (= completion threads).
    pub fn rings(&self) -> usize {
        self.rings.len()
    }

    /// READ_FIXED/WRITE_FIXED SQEs issued so far (stats and tests).
    pub fn fixed_ops(&self) -> u64 {
        self.rings
            .iter()
            .map(|r| r.fixed_ops.load(Ordering::Relaxed))
            .sum()
    }
}

/// Checks the opcodes the engine needs; returns whether the fixed-buffer
/// opcodes are there too.
fn probe(uring: &IoUring) -> crate::Result<bool> {
    let mut probe = Probe::new();
    uring
        .submitter()
        .register_probe(&mut probe)
        .map_err(|e| unsupported("probe", e))?;
    for (code, name) in [
        (opcode::Readv::CODE, "READV"),
        (opcode::Writev::CODE, "WRITEV"),
        (opcode::Nop::CODE, "NOP"),
    ] {
        if !probe.is_supported(code) {
            return Err(crate::UcmError::Unsupported(format!(
                "io_uring: the kernel does not support {name}"
            )));
        }
    }
    Ok(probe.is_supported(opcode::ReadFixed::CODE) && probe.is_supported(opcode::WriteFixed::CODE))
}

/// Registers the pool's arena with every ring; all or nothing. Returns the
/// registered `(addr, len)` table (empty when unregistered).
fn register(urings: &[IoUring], pool: &BouncePool) -> Vec<(usize, usize)> {
    let iovecs = pool.registration_iovecs();
    if iovecs.is_empty() {
        return Vec::new();
    }
    for (i, u) in urings.iter().enumerate() {
        // SAFETY: the iovecs describe the pool's arena, which is owned by an
        // `Arc` shared by the pool and every `BounceBuf`; the engine holds
        // the pool (declared after the rings, so dropped after them), and no
        // arena memory is freed before the last of them goes.
        if let Err(e) = unsafe { u.submitter().register_buffers(&iovecs) } {
            log::debug!(
                "io_uring: cannot register the {}-byte bounce pool ({e}); using unregistered buffers",
                pool.capacity()
            );
            for u in &urings[..i] {
                let _ = u.submitter().unregister_buffers();
            }
            return Vec::new();
        }
    }
    pool.set_registered(true);
    iovecs
        .iter()
        .map(|v| (v.iov_base as usize, v.iov_len))
        .collect()
}

impl IoEngine for UringEngine {
    fn name(&self) -> &'static str {
        "uring"
    }

    fn submit(&self, req: IoRequest, done: IoDone) {
        if req.bytes() == 0 {
            run_callback(done, Ok(0));
            return;
        }
        // io_uring reads an offset of -1 as "the current file position";
        // reject offsets that do not fit in off_t instead.
        let in_range = req
            .offset
            .checked_add(req.bytes() as u64)
            .is_some_and(|end| end <= i64::MAX as u64);
        if !in_range {
            run_callback(
                done,
                Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    "file offset does not fit in off_t",
                )),
            );
            return;
        }
        let ring = &self.rings[self.next.fetch_add(1, Ordering::Relaxed) % self.rings.len()];
        let mut st = ring.state.lock();
        if st.closing {
            drop(st);
            run_callback(done, Err(closed()));
            return;
        }
        if st.free.is_empty() || !st.pending.is_empty() {
            st.pending.push_back((req, done));
            return;
        }
        ring.start(&mut st, req, done);
        drop(st);
        ring.flush();
    }

    fn bounce(&self, len: usize) -> BounceBuf {
        self.pool.get(len)
    }
}

impl Drop for UringEngine {
    fn drop(&mut self) {
        for ring in &self.rings {
            let mut st = ring.state.lock();
            st.closing = true;
            let nop = opcode::Nop::new().build().user_data(WAKE);
            // SAFETY: a NOP references no memory.
            unsafe { ring.push(&nop) };
            drop(st);
            ring.flush();
        }
        threads::join_all(&mut self.threads, "an io_uring completion thread panicked");
        self.pool.set_registered(false);
    }
}

#[cfg(test)]
mod tests {
    use super::super::engine_tests::{self as suite, engine_test_suite};
    use super::super::{AlignedBuf, IoEngineKind};
    use super::*;
    use crate::block::MemSeg;

    fn cfg(threads: usize, qd: u32, pool: usize) -> IoEngineConfig {
        IoEngineConfig {
            kind: IoEngineKind::Uring,
            threads,
            queue_depth: qd,
            bounce_pool_bytes: pool,
        }
    }

    fn engine() -> UringEngine {
        UringEngine::new(&cfg(2, 32, 1 << 20)).expect("io_uring engine")
    }

    #[test]
    fn uring_threads_are_named() {
        let e = engine();
        assert_eq!(e.rings(), 2);
        assert_eq!(e.threads[1].thread().name(), Some("ucm-uring-1"));
        assert_eq!(e.name(), "uring");
    }

    engine_test_suite!(engine);

    #[test]
    fn uring_concurrent_with_tiny_queues() {
        // Most requests wait in the pending queue.
        suite::concurrent(
            Arc::new(UringEngine::new(&cfg(1, 2, 0)).expect("engine")),
            true,
        );
    }

    #[test]
    fn uring_rejects_offsets_beyond_off_t() {
        // An offset io_uring would misread as "current position".
        let e = engine();
        let b = AlignedBuf::new(4096);
        let req = IoRequest {
            op: IoOp::Read,
            fd: 0,
            offset: u64::MAX,
            iov: vec![b.as_seg()],
            fixed: None,
        };
        let err = e.submit_wait(req).expect_err("offset out of range");
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput);
    }

    #[test]
    fn uring_bounce_and_fixed_buffers() {
        let e = engine();
        // Root has CAP_IPC_LOCK here, so registration is expected to work;
        // where it does not, the engine must still do the I/O unregistered.
        let registered = e.pool().is_registered();
        suite::bounce_round_trip(&e);
        if !registered {
            eprintln!("bounce pool not registered here; fixed path not exercised");
            return;
        }
        assert_eq!(e.fixed_ops(), 2, "bounce round trip used READ/WRITE_FIXED");

        let dir = tempfile::tempdir().expect("tempdir");
        let f = suite::open(&dir.path().join("fx"), true);
        let mut w = e.bounce(64 << 10);
        assert_eq!(w.fixed_index(), Some(0));
        w.copy_from_slice(&suite::pattern(33, 64 << 10));
        let req = suite::bounced(IoOp::Write, &f, 8192, &w);
        assert_eq!(e.submit_wait(req).expect("write fixed"), 64 << 10);
        // Short read through the fixed path: 64 KiB in the file after 8 KiB.
        let r = e.bounce(128 << 10);
        let req = suite::bounced(IoOp::Read, &f, 8192, &r);
        assert_eq!(e.submit_wait(req).expect("read fixed"), 64 << 10);
        assert_eq!(&r[..64 << 10], &w[..]);
        assert_eq!(e.fixed_ops(), 2 + 3, "write + read + the EOF retry");

        // A fixed index with memory outside the registered buffer is
        // ignored (plain READV), not handed to the kernel.
        let heap = AlignedBuf::new(4096);
        let before = e.fixed_ops();
        let req = suite::req_fixed(IoOp::Read, &f, 8192, vec![heap.as_seg()], Some(0));
        assert_eq!(e.submit_wait(req).expect("read"), 4096);
        assert_eq!(&heap[..], &w[..4096]);
        let req = suite::req_fixed(IoOp::Read, &f, 8192, vec![r.as_seg(4096)], Some(7));
        assert_eq!(e.submit_wait(req).expect("read"), 4096);
        assert_eq!(e.fixed_ops(), before);

        // Unpooled fallback buffers are never "fixed".
        assert_eq!(e.bounce(4 << 20).fixed_index(), None);
        drop(e);
        assert_eq!(w.fixed_index(), None, "engine gone: pool unregistered");
    }

    #[test]
    fn uring_zero_pool_is_unregistered() {
        let e = UringEngine::new(&cfg(1, 8, 0)).expect("engine");
        assert!(!e.pool().is_registered());
        let b = e.bounce(4096);
        assert_eq!(b.fixed_index(), None);
        suite::bounce_round_trip(&e);
        assert_eq!(e.fixed_ops(), 0);
    }

    #[test]
    fn uring_shutdown_and_chained_with_tiny_queues() {
        suite::shutdown_with_requests_in_flight(Box::new(
            UringEngine::new(&cfg(1, 4, 0)).expect("engine"),
        ));
        suite::chained_submit_from_callback(Arc::new(
            UringEngine::new(&cfg(1, 1, 0)).expect("engine"),
        ));
    }

    #[test]
    fn uring_segments_in_iov_max_pieces_with_short_reads() {
        // 3000 segments of 4 KiB, file holds only 2500 of them.
        let e = engine();
        let dir = tempfile::tempdir().expect("tempdir");
        let f = suite::open(&dir.path().join("p"), true);
        let data = AlignedBuf::new(2500 * 4096);
        assert_eq!(
            e.submit_wait(suite::req(IoOp::Write, &f, 0, vec![data.as_seg()]))
                .expect("write"),
            2500 * 4096
        );
        let dst = AlignedBuf::new(3000 * 4096);
        let iov = (0..3000)
            .map(|i| MemSeg {
                addr: dst.as_ptr() as usize + i * 4096,
                len: 4096,
            })
            .collect();
        let n = e
            .submit_wait(suite::req(IoOp::Read, &f, 0, iov))
            .expect("read");
        assert_eq!(n, 2500 * 4096);
    }
}
