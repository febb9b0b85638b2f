//! A fixed pool of named worker threads running boxed jobs.

use std::thread::JoinHandle;

use crossbeam_channel::{unbounded, Sender};

type Job = Box<dyn FnOnce() + Send + 'static>;

/// Fixed-size thread pool; idle workers block on the channel (no polling).
pub struct WorkerPool {
    tx: Option<Sender<Job>>,
    threads: Vec<JoinHandle<()>>,
}

/// A cloneable way to queue jobs on a [`WorkerPool`] from other threads.
#[derive(Clone)]
pub struct PoolSender(Sender<Job>);

impl PoolSender {
    /// Queues a job. Returns false once the pool has shut down.
    pub fn spawn(&self, job: impl FnOnce() + Send + 'static) -> bool {
        self.0.send(Box::new(job)).is_ok()
    }
}

impl WorkerPool {
    /// Starts `n` (at least one) threads named `{name}-{i}`.
    pub fn new(name: &str, n: usize) -> crate::Result<Self> {
        Self::start(name, n, false)
    }

    /// Like [`WorkerPool::new`], but its threads run at the lowest CPU
    /// priority (nice 19): for work that must not take CPU time from the
    /// caller's own threads (an inference engine computing on every core).
    pub fn background(name: &str, n: usize) -> crate::Result<Self> {
        Self::start(name, n, true)
    }

    fn start(name: &str, n: usize, background: bool) -> crate::Result<Self> {
        let (tx, rx) = unbounded::<Job>();
        let mut threads = Vec::new();
        for i in 0..n.max(1) {
            let rx = rx.clone();
            let handle = std::thread::Builder::new()
                .name(format!("{name}-{i}"))
                .spawn(move || {
                    if background {
                        lower_own_priority();
                    }
                    while let Ok(job) = rx.recv() {
                        job();
                    }
                })
                .map_err(|e| crate::UcmError::os("spawn thread", name, e))?;
            threads.push(handle);
        }
        Ok(WorkerPool {
            tx: Some(tx),
            threads,
        })
    }

    /// Queues a job. Returns false if the pool is shutting down.
    pub fn spawn(&self, job: impl FnOnce() + Send + 'static) -> bool {
        match &self.tx {
            Some(tx) => tx.send(Box::new(job)).is_ok(),
            None => false,
        }
    }

    /// A handle that queues jobs here from other threads; jobs sent after
    /// the pool shut down are refused.
    pub fn sender(&self) -> Option<PoolSender> {
        self.tx.clone().map(PoolSender)
    }

    /// Number of worker threads.
    pub fn size(&self) -> usize {
        self.threads.len()
    }
}

impl Drop for WorkerPool {
    fn drop(&mut self) {
        // Closing the channel lets workers finish queued jobs and exit.
        self.tx.take();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Sets the calling thread's nice value to 19. On Linux the nice value is
/// per thread, so this leaves the rest of the process alone; raising it
/// needs no privilege. Failure only means normal priority.
pub(crate) fn lower_own_priority() {
    // SAFETY: plain syscalls on the calling thread.
    let rc = unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, 19)
    };
    if rc != 0 {
        log::debug!(
            "setpriority(19) of a background thread: {}",
            std::io::Error::last_os_error()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    fn own_nice() -> i32 {
        // SAFETY: plain syscalls on the calling thread.
        unsafe {
            let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
            libc::getpriority(libc::PRIO_PROCESS, tid)
        }
    }

    #[test]
    fn background_threads_run_at_the_lowest_priority_and_others_do_not() {
        let (tx, rx) = crossbeam_channel::unbounded();
        let bg = WorkerPool::background("bg", 1).unwrap();
        let tx2 = tx.clone();
        assert!(bg
            .sender()
            .unwrap()
            .spawn(move || tx2.send(own_nice()).unwrap()));
        assert_eq!(rx.recv().unwrap(), 19);
        let normal = WorkerPool::new("fg", 1).unwrap();
        let before = own_nice();
        assert!(normal.spawn(move || tx.send(own_nice()).unwrap()));
        assert_eq!(rx.recv().unwrap(), before);
        drop(bg);
        assert_eq!(own_nice(), before, "the caller's own thread is left alone");
    }

    #[test]
    fn runs_all_jobs_before_drop_returns() {
        let counter = Arc::new(AtomicUsize::new(0));
        {
            let pool = WorkerPool::new("t", 3).unwrap();
            for _ in 0..100 {
                let c = counter.clone();
                assert!(pool.spawn(move || {
                    c.fetch_add(1, Ordering::SeqCst);
                }));
            }
        }
        assert_eq!(counter.load(Ordering::SeqCst), 100);
    }
}
