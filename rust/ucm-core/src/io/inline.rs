//! An engine that runs each request on the submitting thread.
//!
//! For work nobody waits on: the thread that submits (a low-priority
//! background thread) does the blocking `preadv`/`pwritev` itself, so the
//! copy runs at that thread's CPU priority rather than on the store's
//! normal-priority I/O threads, and there is never more than one such
//! request in flight.

use super::psync::run_blocking;
use super::threads::run_callback;
use super::{BounceBuf, BouncePool, IoDone, IoEngine, IoRequest};

/// Runs requests inline, in `submit`.
#[derive(Debug)]
pub struct InlineEngine {
    pool: BouncePool,
}

impl InlineEngine {
    /// An engine with an unregistered bounce pool of `bounce_pool_bytes`.
    pub fn new(bounce_pool_bytes: usize) -> Self {
        Self {
            pool: BouncePool::new(bounce_pool_bytes),
        }
    }
}

impl IoEngine for InlineEngine {
    fn name(&self) -> &'static str {
        "inline"
    }

    fn submit(&self, req: IoRequest, done: IoDone) {
        let res = if req.bytes() == 0 {
            Ok(0)
        } else {
            run_blocking(req.op, req.fd, req.offset, &req.iov)
        };
        run_callback(done, res);
    }

    fn bounce(&self, len: usize) -> BounceBuf {
        self.pool.get(len)
    }
}
