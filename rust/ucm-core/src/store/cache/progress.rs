//! Progress of the tasks in flight: which loads and dumps still have jobs
//! queued or running, and each task's remaining units and load latency.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use super::stats::Counters;
use crate::error::Result;
use crate::task::Task;

/// Loads and dumps whose jobs are queued or running. Background work that
/// competes with them for the process's memory map (the start-up commit of
/// the cache's memory) waits while any is in flight.
#[derive(Default)]
pub(super) struct InFlight(AtomicUsize);

impl InFlight {
    pub(super) fn any(&self) -> bool {
        self.0.load(Ordering::Acquire) > 0
    }
}

/// Counts one task in [`InFlight`] until dropped.
struct InFlightGuard(Arc<InFlight>);

impl InFlightGuard {
    fn new(count: &Arc<InFlight>) -> Self {
        count.0.fetch_add(1, Ordering::AcqRel);
        InFlightGuard(count.clone())
    }
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        self.0 .0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Per-task completion bookkeeping (latency of loads). Its jobs share it,
/// so it lives, and counts as in flight, until the last of them ends.
pub(super) struct TaskCtx {
    pub(super) task: Arc<Task>,
    start: Instant,
    remaining: AtomicUsize,
    is_load: bool,
    _in_flight: InFlightGuard,
}

impl TaskCtx {
    pub(super) fn new(
        task: Arc<Task>,
        units: usize,
        is_load: bool,
        in_flight: &Arc<InFlight>,
    ) -> Arc<Self> {
        Arc::new(TaskCtx {
            task,
            start: Instant::now(),
            remaining: AtomicUsize::new(units),
            is_load,
            _in_flight: InFlightGuard::new(in_flight),
        })
    }

    fn finish_one(&self, c: &Counters) {
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 && self.is_load {
            c.load_latency.record(self.start.elapsed());
        }
    }

    // Bookkeeping first: once the last unit completes, the caller's `wait`
    // returns and may read the stats.
    pub(super) fn done(&self, c: &Counters, outcome: Result<()>) {
        self.finish_one(c);
        self.task.complete_unit(outcome);
    }

    pub(super) fn skip(&self, c: &Counters) {
        self.finish_one(c);
        self.task.skip_unit();
    }
}
