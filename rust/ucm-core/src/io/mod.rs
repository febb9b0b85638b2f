//! I/O engines: how bytes move between memory and files.
//!
//! The stores decide *where* bytes live (paths, offsets, layout); an
//! [`IoEngine`] decides *how* the reads and writes are issued. Two engines
//! implement the one trait: [`psync`] (a `preadv`/`pwritev` thread pool) and
//! [`uring`] (io_uring rings: submitters push SQEs directly, one completion
//! thread per ring runs the callbacks). [`build_engine`] picks one from
//! [`IoEngineKind`], falling back from io_uring to psync with one log line
//! when a ring cannot be set up.
//!
//! Both engines retry short transfers and EINTR, report end of file as a
//! short count, never block in [`IoEngine::submit`] (work beyond the queue
//! depth waits inside the engine), run every callback exactly once (also
//! for requests still queued when the engine is dropped: drop drains them),
//! and hand out [`BounceBuf`]s from a budgeted [`BouncePool`] that is
//! registered with the kernel on io_uring where the memlock limit allows.
//! With the `bench` feature, `baseline` measures plain O_DIRECT throughput
//! for benchmarks.

use std::os::fd::RawFd;
use std::sync::Arc;

use crate::block::MemSeg;

pub mod aligned;
#[cfg(feature = "bench")]
pub mod baseline;
pub mod bulk_copy;
#[cfg(test)]
mod engine_tests;
pub mod inline;
pub mod psync;
mod threads;
#[cfg(target_os = "linux")]
pub mod uring;

pub use aligned::{align_up, AlignedBuf, BounceBuf, BouncePool, DIRECT_ALIGN};
#[cfg(feature = "bench")]
pub use baseline::{baseline_direct_io, BaselineFile};
pub use inline::InlineEngine;
pub use psync::PsyncEngine;
#[cfg(target_os = "linux")]
pub use uring::UringEngine;

/// Direction of one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoOp {
    /// File to memory.
    Read,
    /// Memory to file.
    Write,
}

/// One vectored read or write at a file offset.
///
/// The caller guarantees that `fd` stays open and every segment of `iov`
/// stays valid (and, for reads, unaliased) until the completion callback has
/// run; keeping the owning `File`/buffers inside the callback is the usual
/// way to do that.
#[derive(Debug)]
pub struct IoRequest {
    /// Read or write.
    pub op: IoOp,
    /// Open file descriptor.
    pub fd: RawFd,
    /// Byte offset in the file.
    pub offset: u64,
    /// Memory segments, transferred in order as one contiguous file range.
    pub iov: Vec<MemSeg>,
    /// Index of a kernel-registered buffer when `iov` is exactly one
    /// [`BounceBuf`] that reports one (io_uring uses READ/WRITE_FIXED then).
    pub fixed: Option<u16>,
}

impl IoRequest {
    /// Bytes the request moves (zero: the engines complete it at once).
    pub fn bytes(&self) -> usize {
        self.iov.iter().map(|s| s.len).sum()
    }
}

/// Completion callback: receives the number of bytes transferred (the
/// engines retry short transfers, so anything below the request length means
/// end of file on a read) or the OS error.
pub type IoDone = Box<dyn FnOnce(std::io::Result<usize>) + Send + 'static>;

/// Issues vectored reads and writes asynchronously.
pub trait IoEngine: Send + Sync {
    /// Short name for logs and benchmarks (`"psync"`, `"uring"`).
    fn name(&self) -> &'static str;

    /// Queues one request; `done` runs exactly once, on an engine thread
    /// (or inline on the caller's thread for an empty request, or when the
    /// engine is shutting down). Never blocks on the device: requests beyond
    /// the engine's queue depth wait in an unbounded queue, so callers bound
    /// their outstanding work. `done` may itself call `submit`.
    fn submit(&self, req: IoRequest, done: IoDone);

    /// An aligned buffer of at least `len` bytes (and a multiple of
    /// [`DIRECT_ALIGN`]) for bouncing unaligned caller memory under O_DIRECT.
    /// Comes from the engine's pool (registered with the kernel where the
    /// memlock limit allows) and returns to it on drop.
    fn bounce(&self, len: usize) -> BounceBuf;

    /// Runs one request and waits for it. Convenience for tests and cold paths.
    fn submit_wait(&self, req: IoRequest) -> std::io::Result<usize> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.submit(
            req,
            Box::new(move |res| {
                let _ = tx.send(res);
            }),
        );
        rx.recv()
            .unwrap_or_else(|_| Err(std::io::Error::other("I/O engine dropped a request")))
    }
}

/// Which engine to build (`io_engine` config key).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum IoEngineKind {
    /// io_uring when it can be set up, else psync.
    #[default]
    Auto,
    /// io_uring; fails if unavailable.
    Uring,
    /// pread/pwrite thread pool.
    Psync,
}

impl std::str::FromStr for IoEngineKind {
    type Err = crate::UcmError;
    fn from_str(s: &str) -> crate::Result<Self> {
        match s {
            "auto" => Ok(Self::Auto),
            "uring" | "io_uring" => Ok(Self::Uring),
            "psync" => Ok(Self::Psync),
            other => Err(crate::UcmError::invalid(format!(
                "io_engine: unknown value {other:?}; valid values are \"auto\", \"uring\", \"psync\""
            ))),
        }
    }
}

/// Engine sizing.
#[derive(Clone, Debug)]
pub struct IoEngineConfig {
    /// Which engine.
    pub kind: IoEngineKind,
    /// psync: worker threads (= queue depth). uring: ring threads.
    pub threads: usize,
    /// uring: submission queue entries per ring (the queue depth per ring).
    pub queue_depth: u32,
    /// Bytes of aligned bounce buffers kept in the pool.
    pub bounce_pool_bytes: usize,
}

impl Default for IoEngineConfig {
    fn default() -> Self {
        Self {
            kind: IoEngineKind::Auto,
            threads: 4,
            queue_depth: 64,
            bounce_pool_bytes: 64 << 20,
        }
    }
}

/// Builds the configured engine. `Auto` tries io_uring (ring setup plus a
/// probe for READV/WRITEV) and logs one `info` line when it falls back to
/// psync. `Uring` fails with [`UcmError::Unsupported`](crate::UcmError)
/// naming the OS error when io_uring is unavailable.
pub fn build_engine(cfg: &IoEngineConfig) -> crate::Result<Arc<dyn IoEngine>> {
    match cfg.kind {
        IoEngineKind::Psync => Ok(Arc::new(psync::PsyncEngine::new(cfg)?)),
        IoEngineKind::Uring => build_uring(cfg),
        IoEngineKind::Auto => match build_uring(cfg) {
            Ok(engine) => Ok(engine),
            Err(err) => {
                log::info!("io_uring unavailable ({err}); using the psync I/O engine");
                Ok(Arc::new(psync::PsyncEngine::new(cfg)?))
            }
        },
    }
}

#[cfg(target_os = "linux")]
fn build_uring(cfg: &IoEngineConfig) -> crate::Result<Arc<dyn IoEngine>> {
    Ok(Arc::new(uring::UringEngine::new(cfg)?))
}

#[cfg(not(target_os = "linux"))]
fn build_uring(_cfg: &IoEngineConfig) -> crate::Result<Arc<dyn IoEngine>> {
    Err(crate::UcmError::Unsupported(
        "io_uring is only available on Linux".into(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn build_engine_picks_each_kind() {
        let mut cfg = IoEngineConfig {
            threads: 1,
            bounce_pool_bytes: 1 << 20,
            ..IoEngineConfig::default()
        };
        cfg.kind = IoEngineKind::Psync;
        assert_eq!(build_engine(&cfg).expect("psync").name(), "psync");
        cfg.kind = IoEngineKind::Uring;
        assert_eq!(build_engine(&cfg).expect("uring").name(), "uring");
        cfg.kind = IoEngineKind::Auto;
        assert_eq!(build_engine(&cfg).expect("auto").name(), "uring");
        assert_eq!(
            "io_uring".parse::<IoEngineKind>().expect("parse"),
            IoEngineKind::Uring
        );
        assert!("spdk".parse::<IoEngineKind>().is_err());
    }

    #[test]
    fn engines_are_interchangeable_behind_the_trait() {
        let dir = tempfile::tempdir().expect("tempdir");
        for kind in [IoEngineKind::Psync, IoEngineKind::Uring] {
            let cfg = IoEngineConfig {
                kind,
                threads: 2,
                queue_depth: 8,
                bounce_pool_bytes: 1 << 20,
            };
            let engine = build_engine(&cfg).expect("engine");
            let path = dir.path().join(engine.name());
            let file = std::fs::File::create(&path).expect("create");
            let mut b = engine.bounce(4096);
            b.fill(0x5a);
            let req = engine_tests::bounced(IoOp::Write, &file, 0, &b);
            assert_eq!(engine.submit_wait(req).expect("write"), 4096);
            assert_eq!(std::fs::read(&path).expect("read"), vec![0x5a; 4096]);
        }
    }
}
