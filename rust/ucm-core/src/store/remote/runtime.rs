//! The runtime of a remote store and the units it completes.
//!
//! * [`Runtime`]: a small multi-thread tokio runtime owned by a store; sync
//!   callers hand futures to it and block on a channel (never `block_on`,
//!   so calling from inside someone else's runtime does not panic).
//! * [`Unit`]: completes a task's units exactly once, also when the future
//!   carrying it is cancelled (deadline, shutdown): a task can never hang.

use std::future::Future;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::error::{Result, UcmError};
use crate::task::Task;

/// A tokio runtime owned by one store.
pub struct Runtime {
    rt: tokio::runtime::Runtime,
}

impl Runtime {
    /// Starts `threads` worker threads named `{name}-{i}`.
    pub fn new(name: &str, threads: usize) -> Result<Self> {
        let name = name.to_string();
        let seq = Arc::new(AtomicU32::new(0));
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads.max(1))
            .max_blocking_threads(threads.max(1) * 4)
            .thread_name_fn(move || format!("{name}-{}", seq.fetch_add(1, Ordering::Relaxed)))
            .enable_all()
            .build()
            .map_err(|e| UcmError::os("start runtime", "tokio", e))?;
        Ok(Runtime { rt })
    }

    /// A handle to spawn on (cheap to clone, safe to drop anywhere).
    pub fn handle(&self) -> tokio::runtime::Handle {
        self.rt.handle().clone()
    }

    /// Stops the runtime; futures still pending are dropped (their
    /// [`Unit`]s then fail with `Closed`).
    pub fn shutdown(self, grace: Duration) {
        self.rt.shutdown_timeout(grace);
    }
}

/// Runs `fut` on `handle` and blocks the calling (non-runtime) thread until
/// it finishes. Works from any thread, including another runtime's.
pub fn run_blocking<F>(handle: &tokio::runtime::Handle, fut: F) -> Result<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    let (tx, rx) = crossbeam_channel::bounded(1);
    handle.spawn(async move {
        let _ = tx.send(fut.await);
    });
    rx.recv().map_err(|_| UcmError::Closed)
}

/// `units` units of one task, completed exactly once: by [`Unit::finish`],
/// or with `Closed` when dropped unfinished (a cancelled future).
pub struct Unit {
    task: Arc<Task>,
    units: usize,
    done: bool,
}

impl Unit {
    /// Wraps `units` units of `task`.
    pub fn new(task: Arc<Task>, units: usize) -> Self {
        Unit {
            task,
            units,
            done: false,
        }
    }

    /// The task.
    pub fn task(&self) -> &Arc<Task> {
        &self.task
    }

    /// Completes every unit with `outcome`.
    pub fn finish(mut self, outcome: Result<()>) {
        self.complete(outcome);
    }

    fn complete(&mut self, outcome: Result<()>) {
        if self.done {
            return;
        }
        self.done = true;
        for _ in 0..self.units {
            self.task.complete_unit(outcome.clone());
        }
    }
}

impl Drop for Unit {
    fn drop(&mut self) {
        self.complete(Err(UcmError::Closed));
    }
}

/// Runs `fut` for `unit` on `handle` under an optional deadline; a future
/// still running at the deadline is dropped and its units fail with
/// `Timeout` (nothing it would have written reaches caller memory: every
/// copy into caller memory happens between two awaits, all at once).
pub fn spawn_unit<F>(
    handle: &tokio::runtime::Handle,
    unit: Unit,
    deadline: Option<tokio::time::Instant>,
    what: String,
    fut: F,
) where
    F: Future<Output = Result<()>> + Send + 'static,
{
    handle.spawn(async move {
        if unit.task().should_skip() {
            let mut unit = unit;
            unit.done = true;
            for _ in 0..unit.units {
                unit.task.skip_unit();
            }
            return;
        }
        let outcome = match deadline {
            None => fut.await,
            Some(d) => match tokio::time::timeout_at(d, fut).await {
                Ok(r) => r,
                Err(_) => Err(UcmError::Timeout(format!(
                    "{what}: no answer before the task's timeout_ms"
                ))),
            },
        };
        unit.finish(outcome);
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn dropped_units_fail_closed() {
        let reg = crate::task::TaskRegistry::new(0);
        let t = reg.create("load", 2);
        drop(Unit::new(t.clone(), 2));
        assert_eq!(reg.wait(t.id()).unwrap_err().code(), -50012);
    }
}
