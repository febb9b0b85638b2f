//! The tests every I/O engine must pass, and the helpers they use.
//!
//! Each check takes an engine behind the trait; [`engine_test_suite!`]
//! turns them into one `#[test]` per check for a given engine, and an
//! engine's own test module adds the checks that only apply to it.

use super::psync::IOV_MAX;
use super::{AlignedBuf, BounceBuf, IoEngine, IoOp, IoRequest, DIRECT_ALIGN};
use crate::block::MemSeg;
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

/// A request on `f` at `offset` through `iov`, naming no registered buffer.
pub fn req(op: IoOp, f: &File, offset: u64, iov: Vec<MemSeg>) -> IoRequest {
    req_fixed(op, f, offset, iov, None)
}

/// A request on `f` at `offset` through `iov` that names registered buffer
/// `fixed` (which the engine uses only when `iov` lies inside it).
pub fn req_fixed(
    op: IoOp,
    f: &File,
    offset: u64,
    iov: Vec<MemSeg>,
    fixed: Option<u16>,
) -> IoRequest {
    IoRequest {
        op,
        fd: f.as_raw_fd(),
        offset,
        iov,
        fixed,
    }
}

/// A request on `f` at `offset` through the whole of bounce buffer `b`,
/// naming its registered index when it has one.
pub fn bounced(op: IoOp, f: &File, offset: u64, b: &BounceBuf) -> IoRequest {
    req_fixed(op, f, offset, vec![b.as_seg(b.len())], b.fixed_index())
}

pub fn round_trip_direct(e: &dyn IoEngine) {
    let dir = tempfile::tempdir().expect("tempdir");
    let f = open(&dir.path().join("d"), true);
    let len = 256 << 10;
    let mut w = AlignedBuf::new(len);
    w.copy_from_slice(&pattern(1, len));
    assert_eq!(
        e.submit_wait(req(IoOp::Write, &f, 4096, vec![w.as_seg()]))
            .expect("write"),
        len
    );
    let r = AlignedBuf::new(len);
    assert_eq!(
        e.submit_wait(req(IoOp::Read, &f, 4096, vec![r.as_seg()]))
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
    let iov = src.iter().map(AlignedBuf::as_seg).collect();
    assert_eq!(
        e.submit_wait(req(IoOp::Write, &f, 0, iov)).expect("writev"),
        32 * seg_len
    );
    // Read back as one contiguous buffer, then as 32 separate ones in
    // reverse memory order.
    let whole = AlignedBuf::new(32 * seg_len);
    assert_eq!(
        e.submit_wait(req(IoOp::Read, &f, 0, vec![whole.as_seg()]))
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
    let iov = dst.iter().rev().map(AlignedBuf::as_seg).collect();
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
    let iov = vec![MemSeg::of_mut(&mut dst)];
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
    assert_eq!(
        e.submit_wait(bounced(IoOp::Write, &f, 0, &b))
            .expect("write"),
        b.len()
    );
    drop(b);
    let r = e.bounce(12288);
    assert_eq!(
        e.submit_wait(bounced(IoOp::Read, &f, 0, &r)).expect("read"),
        12288
    );
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
        let req = req(IoOp::Write, &f, (i * 16384) as u64, vec![b.as_seg()]);
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
        let iov = vec![MemSeg::of(&data)];
        let req = req(IoOp::Write, &f, (i * 4096) as u64, iov);
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

/// Defines one `#[test]` per engine-independent check, each on fresh engines
/// from `$engine` (a function returning the engine by value).
macro_rules! engine_test_suite {
    ($engine:path) => {
        $crate::io::engine_tests::engine_test_suite!(@each
            round_trip_direct => round_trip_direct(&$engine()),
            round_trip_buffered_unaligned => round_trip_buffered_unaligned(&$engine()),
            vectored => {
                vectored_many_segments(&$engine(), true);
                vectored_many_segments(&$engine(), false);
                more_than_iov_max_segments(&$engine());
            },
            concurrent => {
                concurrent(std::sync::Arc::new($engine()), true);
                concurrent(std::sync::Arc::new($engine()), false);
            },
            read_past_eof => read_past_eof(&$engine()),
            errors => errors_reach_callback(&$engine()),
            shutdown => {
                shutdown_with_requests_in_flight(Box::new($engine()));
                drop_inside_callback(std::sync::Arc::new($engine()));
            },
            chained => chained_submit_from_callback(std::sync::Arc::new($engine())),
        );
    };
    (@each $($name:ident => $check:expr),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                use $crate::io::engine_tests::*;
                $check;
            }
        )*
    };
}
pub(crate) use engine_test_suite;
