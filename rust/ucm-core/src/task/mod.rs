//! The asynchronous task engine.
//!
//! A store turns each `load`/`dump` call into one [`Task`] made of units
//! (usually one per shard), returns its [`TaskId`] at once and runs the units
//! on its own threads. Callers then [`TaskRegistry::wait`] (blocking) or
//! [`TaskRegistry::check`] (never blocks).
//!
//! Contract:
//! * The timeout counts from submit. When it passes, queued units of the task
//!   are skipped (they see [`Task::should_skip`]) and `wait` reports
//!   [`UcmError::Timeout`] — but only after every unit that already started
//!   has finished, so no I/O touches the caller's memory once `wait` returned.
//! * The first failing unit fails the task; later units are skipped. `wait`
//!   returns that first error (with its own code: `NoSpace`, `Corrupt`, ...).
//! * `wait` consumes the handle: a second `wait`, or a `check` afterwards,
//!   is `NotFound`.
//! * Handles that are never waited: a finished task stays in the registry so
//!   that a late `wait`/`check` still sees its outcome, but only for
//!   [`UNWAITED_RETENTION`]; after that, or when more than
//!   [`MAX_UNWAITED_FINISHED`] finished tasks pile up, the oldest finished
//!   ones are dropped (logged once per sweep) and their handles become
//!   `NotFound`. Running tasks are never dropped. Memory is therefore bounded
//!   by the number of tasks actually in flight plus a constant.

mod pool;

pub(crate) use pool::lower_own_priority;
pub use pool::{PoolSender, WorkerPool};

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::error::{Result, UcmError};

/// Handle of a submitted task; 0 is never issued (the original's "invalid").
pub type TaskId = u64;

/// How long a finished, never-waited task keeps its outcome.
pub const UNWAITED_RETENTION: Duration = Duration::from_secs(600);
/// How many finished, never-waited tasks are kept at most.
pub const MAX_UNWAITED_FINISHED: usize = 16_384;
/// Slice in which `wait` drains a timed-out task, logging between slices.
const DRAIN_SLICE: Duration = Duration::from_secs(2);

/// Shared state of one task, held by the registry and by each queued unit.
pub struct Task {
    id: TaskId,
    kind: &'static str,
    remaining: AtomicUsize,
    error: Mutex<Option<UcmError>>,
    cancelled: AtomicBool,
    deadline: Option<Instant>,
    finished: Mutex<Option<Instant>>,
    finished_cv: Condvar,
}

impl Task {
    fn new(id: TaskId, kind: &'static str, units: usize, timeout: Option<Duration>) -> Self {
        let now = Instant::now();
        let task = Task {
            id,
            kind,
            remaining: AtomicUsize::new(units),
            error: Mutex::new(None),
            cancelled: AtomicBool::new(false),
            deadline: timeout.map(|t| now + t),
            finished: Mutex::new(None),
            finished_cv: Condvar::new(),
        };
        if units == 0 {
            *task.finished.lock() = Some(now);
        }
        task
    }

    /// The task's handle.
    pub fn id(&self) -> TaskId {
        self.id
    }

    /// What the task does (`"load"`, `"dump"`), for messages.
    pub fn kind(&self) -> &'static str {
        self.kind
    }

    /// When the task times out, if it has a timeout.
    pub fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    fn past_deadline(&self) -> bool {
        self.deadline.is_some_and(|d| Instant::now() >= d)
    }

    /// True when a unit that has not started yet should not start: the task
    /// already failed, was cancelled, or ran past its deadline. A skipped
    /// unit must still call [`Task::skip_unit`].
    pub fn should_skip(&self) -> bool {
        self.cancelled.load(Ordering::Acquire)
            || self.error.lock().is_some()
            || self.past_deadline()
    }

    /// Records the outcome of one unit. The first error wins.
    pub fn complete_unit(&self, outcome: Result<()>) {
        if let Err(e) = outcome {
            self.record_error(e);
        }
        self.count_down();
    }

    /// Records an error (the first one wins) without completing a unit: for
    /// a unit that must fail the task before side effects that other units
    /// of the task could observe (and misreport as their own error).
    pub fn record_error(&self, err: UcmError) {
        let mut slot = self.error.lock();
        if slot.is_none() {
            *slot = Some(err);
        }
    }

    /// Counts down a unit that was skipped because of [`Task::should_skip`].
    pub fn skip_unit(&self) {
        if self.past_deadline() {
            let mut slot = self.error.lock();
            if slot.is_none() {
                *slot = Some(self.timeout_error());
            }
        }
        self.count_down();
    }

    fn count_down(&self) {
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            let mut fin = self.finished.lock();
            *fin = Some(Instant::now());
            self.finished_cv.notify_all();
        }
    }

    /// True once every unit has completed or been skipped.
    pub fn is_finished(&self) -> bool {
        self.finished.lock().is_some()
    }

    fn finished_at(&self) -> Option<Instant> {
        *self.finished.lock()
    }

    fn timeout_error(&self) -> UcmError {
        UcmError::Timeout(format!(
            "task {} ({}) exceeded its timeout",
            self.id, self.kind
        ))
    }

    /// Blocks until finished or `until` (None = forever); true if finished.
    fn block_until(&self, until: Option<Instant>) -> bool {
        let mut fin = self.finished.lock();
        while fin.is_none() {
            match until {
                None => self.finished_cv.wait(&mut fin),
                Some(t) => {
                    if self.finished_cv.wait_until(&mut fin, t).timed_out() {
                        return fin.is_some();
                    }
                }
            }
        }
        true
    }

    fn outcome(&self) -> Result<()> {
        match self.error.lock().clone() {
            None => Ok(()),
            Some(e) => Err(e),
        }
    }
}

/// Issues task handles and keeps tasks until they are waited.
pub struct TaskRegistry {
    next_id: AtomicU64,
    tasks: Mutex<HashMap<TaskId, Arc<Task>>>,
    timeout: Option<Duration>,
    creations: AtomicU64,
}

impl TaskRegistry {
    /// `timeout_ms == 0` means tasks never time out.
    pub fn new(timeout_ms: u64) -> Self {
        TaskRegistry {
            next_id: AtomicU64::new(1),
            tasks: Mutex::new(HashMap::new()),
            timeout: (timeout_ms > 0).then(|| Duration::from_millis(timeout_ms)),
            creations: AtomicU64::new(0),
        }
    }

    /// Registers a task of `units` units; its deadline starts now.
    pub fn create(&self, kind: &'static str, units: usize) -> Arc<Task> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let task = Arc::new(Task::new(id, kind, units, self.timeout));
        let mut tasks = self.tasks.lock();
        tasks.insert(id, task.clone());
        // Sweep on a schedule rather than per call to keep submit O(1).
        let n = self.creations.fetch_add(1, Ordering::Relaxed);
        if n % 1024 == 1023 || tasks.len() > MAX_UNWAITED_FINISHED {
            Self::sweep(&mut tasks);
        }
        task
    }

    /// Drops finished tasks nobody waited for (see the module docs).
    fn sweep(tasks: &mut HashMap<TaskId, Arc<Task>>) {
        let now = Instant::now();
        let before = tasks.len();
        tasks.retain(|_, t| match t.finished_at() {
            Some(at) => now.duration_since(at) < UNWAITED_RETENTION,
            None => true,
        });
        let mut finished: Vec<(Instant, TaskId)> = tasks
            .iter()
            .filter_map(|(id, t)| t.finished_at().map(|at| (at, *id)))
            .collect();
        // Trim to three quarters of the cap so sweeps stay amortised O(1).
        let keep = MAX_UNWAITED_FINISHED / 4 * 3;
        if finished.len() > keep && tasks.len() > MAX_UNWAITED_FINISHED {
            finished.sort_unstable();
            let excess = finished.len() - keep;
            for (_, id) in finished.into_iter().take(excess) {
                tasks.remove(&id);
            }
        }
        let dropped = before - tasks.len();
        if dropped > 0 {
            log::warn!("dropped {dropped} finished task handle(s) that were never waited");
        }
    }

    /// True when the task has finished (successfully or not). Never blocks.
    pub fn check(&self, id: TaskId) -> Result<bool> {
        let task = self.tasks.lock().get(&id).cloned();
        match task {
            Some(t) => Ok(t.is_finished()),
            None => Err(unknown(id)),
        }
    }

    /// Blocks until the task finishes or its deadline passes, consumes the
    /// handle, and returns the task's outcome.
    pub fn wait(&self, id: TaskId) -> Result<()> {
        let task = self.tasks.lock().remove(&id).ok_or_else(|| unknown(id))?;
        if task.block_until(task.deadline) {
            return task.outcome();
        }
        // Timed out: stop queued units, then drain the ones already running
        // so none of them touches the caller's memory after we return.
        task.cancelled.store(true, Ordering::Release);
        {
            let mut slot = task.error.lock();
            if slot.is_none() {
                *slot = Some(task.timeout_error());
            }
        }
        let started = Instant::now();
        while !task.block_until(Some(Instant::now() + DRAIN_SLICE)) {
            log::warn!(
                "task {} ({}) timed out; still draining {} unit(s) after {:?}",
                id,
                task.kind,
                task.remaining.load(Ordering::Acquire),
                started.elapsed()
            );
        }
        Err(task.timeout_error())
    }

    /// Number of tasks currently held (running or finished-unwaited).
    pub fn len(&self) -> usize {
        self.tasks.lock().len()
    }

    /// True when no task is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn unknown(id: TaskId) -> UcmError {
    UcmError::NotFound(format!("task {id} is unknown or was already waited"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::thread;

    /// Runs `unit` on `task` from another thread, `ms` milliseconds from now.
    fn after_ms(
        ms: u64,
        task: &Arc<Task>,
        unit: impl FnOnce(&Task) + Send + 'static,
    ) -> thread::JoinHandle<()> {
        let task = Arc::clone(task);
        thread::spawn(move || {
            thread::sleep(Duration::from_millis(ms));
            unit(&task);
        })
    }

    #[test]
    fn success_and_handle_consumed() {
        let reg = TaskRegistry::new(1000);
        let t = reg.create("load", 3);
        assert!(!reg.check(t.id()).unwrap());
        for _ in 0..3 {
            t.complete_unit(Ok(()));
        }
        assert!(reg.check(t.id()).unwrap());
        reg.wait(t.id()).unwrap();
        assert_eq!(reg.wait(t.id()).unwrap_err().code(), -50005);
        assert_eq!(reg.check(t.id()).unwrap_err().code(), -50005);
        assert!(reg.is_empty());
    }

    #[test]
    fn zero_unit_task_is_finished() {
        let reg = TaskRegistry::new(1000);
        let t = reg.create("dump", 0);
        assert!(reg.check(t.id()).unwrap());
        reg.wait(t.id()).unwrap();
    }

    #[test]
    fn first_failure_wins_and_skips_the_rest() {
        let reg = TaskRegistry::new(1000);
        let t = reg.create("dump", 3);
        t.complete_unit(Err(UcmError::NoSpace("disk".into())));
        assert!(t.should_skip());
        t.complete_unit(Err(UcmError::corrupt(
            crate::error::Damage::Checksum,
            None,
            None,
            "later",
        )));
        t.skip_unit();
        let err = reg.wait(t.id()).unwrap_err();
        assert_eq!(err.code(), -50009);
    }

    #[test]
    fn timeout_counts_from_submit_and_drains_running_units() {
        let reg = Arc::new(TaskRegistry::new(50));
        let t = reg.create("load", 2);
        // One unit is already running and finishes 200 ms after submit...
        let a = after_ms(200, &t, |running| running.complete_unit(Ok(())));
        // ...the other is still queued when the deadline passes.
        let b = after_ms(80, &t, |queued| {
            assert!(queued.should_skip());
            queued.skip_unit();
        });
        let start = Instant::now();
        let err = reg.wait(t.id()).unwrap_err();
        assert_eq!(err.code(), -50010);
        // wait returned only after the running unit finished.
        assert!(t.is_finished());
        assert!(start.elapsed() >= Duration::from_millis(140));
        a.join().unwrap();
        b.join().unwrap();
    }

    #[test]
    fn timeout_error_code_after_cancel() {
        let reg = Arc::new(TaskRegistry::new(30));
        let t = reg.create("load", 1);
        // A queued unit that only looks at the task after the deadline.
        let h = after_ms(60, &t, |worker| {
            assert!(worker.should_skip());
            worker.skip_unit();
        });
        let err = reg.wait(t.id()).unwrap_err();
        assert_eq!(err.code(), -50010);
        h.join().unwrap();
    }

    #[test]
    fn zero_timeout_waits_forever() {
        let reg = Arc::new(TaskRegistry::new(0));
        let t = reg.create("load", 1);
        let h = after_ms(50, &t, |w| w.complete_unit(Ok(())));
        reg.wait(t.id()).unwrap();
        h.join().unwrap();
    }

    #[test]
    fn never_waited_handles_are_bounded() {
        let reg = TaskRegistry::new(1000);
        for _ in 0..(MAX_UNWAITED_FINISHED + 2048) {
            let t = reg.create("dump", 0);
            drop(t);
        }
        assert!(reg.len() <= MAX_UNWAITED_FINISHED + 1);
    }
}
