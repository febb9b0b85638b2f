//! A fixed pool of named worker threads running boxed jobs.

use std::thread::JoinHandle;

use crossbeam_channel::{unbounded, Sender};

type Job = Box<dyn FnOnce() + Send + 'static>;

/// Fixed-size thread pool; idle workers block on the channel (no polling).
pub struct WorkerPool {
    tx: Option<Sender<Job>>,
    threads: Vec<JoinHandle<()>>,
}

impl WorkerPool {
    /// Starts `n` (at least one) threads named `{name}-{i}`.
    pub fn new(name: &str, n: usize) -> crate::Result<Self> {
        let (tx, rx) = unbounded::<Job>();
        let mut threads = Vec::new();
        for i in 0..n.max(1) {
            let rx = rx.clone();
            let handle = std::thread::Builder::new()
                .name(format!("{name}-{i}"))
                .spawn(move || {
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

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
