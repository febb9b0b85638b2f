//! I/O engines: how bytes move between memory and files.
//!
//! The stores decide *where* bytes live (paths, offsets, layout); an
//! [`IoEngine`] decides *how* the reads and writes are issued. Two engines
//! implement the one trait: [`psync`] (a pread/pwrite thread pool) and
//! [`uring`] (io_uring rings owned by a few threads). [`build_engine`] picks
//! one from [`IoEngineKind`], falling back from io_uring to psync with one log
//! line when a ring cannot be set up.

use std::os::fd::RawFd;
use std::sync::Arc;

use crate::block::MemSeg;

pub mod aligned;
pub mod psync;
#[cfg(target_os = "linux")]
pub mod uring;

pub use aligned::{AlignedBuf, BounceBuf, BouncePool, DIRECT_ALIGN};

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
    /// Total length of the request in bytes.
    pub fn len(&self) -> usize {
        self.iov.iter().map(|s| s.len).sum()
    }

    /// True when the request moves no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
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

    /// Queues one request; `done` runs exactly once, on an engine thread.
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
        rx.recv().unwrap_or_else(|_| {
            Err(std::io::Error::other("I/O engine dropped a request"))
        })
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

/// Builds the configured engine. `Auto` tries io_uring and logs one line
/// when it falls back to psync.
pub fn build_engine(cfg: &IoEngineConfig) -> crate::Result<Arc<dyn IoEngine>> {
    todo_build_engine(cfg)
}
