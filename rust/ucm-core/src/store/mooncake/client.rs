//! The pool client the Mooncake store calls, and the threads that call it.
//!
//! Mooncake's client is a C++ library whose calls block; the core sees it
//! through [`PoolClient`] (the Python bindings implement it over
//! `mooncake.store.MooncakeDistributedStore`). Its calls run on threads
//! the store starts when it opens, never on the caller's or the runtime's:
//! a call stuck on a dead master then holds one of those threads, not an
//! engine thread, and sockets the client opens belong to the network
//! namespace the store was opened in.

use std::future::Future;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::error::{Result, UcmError};

/// One memory range of a transfer: an address and a length in bytes.
#[derive(Clone, Copy, Debug)]
pub struct Buf {
    /// Start address.
    pub addr: usize,
    /// Bytes.
    pub len: usize,
}

/// The calls the store makes into a Mooncake pool. Each answer is one
/// Mooncake code per key, as the client returns it: `>= 0` is success (a
/// size, or bytes read), a negative value one of Mooncake's `ErrorCode`s.
/// An `Err` means the call itself failed (the client raised).
pub trait PoolClient: Send + Sync + 'static {
    /// Sizes of the objects under `keys`.
    fn sizes(&self, keys: &[String]) -> Result<Vec<i64>>;
    /// Writes each buffer as the object under its key.
    fn put_from(&self, keys: &[String], bufs: &[Buf]) -> Result<Vec<i64>>;
    /// Reads each object into its buffer (which must be at least as long).
    fn get_into(&self, keys: &[String], bufs: &[Buf]) -> Result<Vec<i64>>;
    /// Removes the objects under `keys`.
    fn remove(&self, keys: &[String]) -> Result<Vec<i64>>;
    /// Registers memory the transfer engine may read and write directly.
    fn register(&self, buf: Buf) -> Result<()>;
    /// Undoes [`PoolClient::register`].
    fn unregister(&self, addr: usize);
    /// Leaves the pool (this client's segment is unmounted).
    fn close(&self);
}

type Job = Box<dyn FnOnce(&dyn PoolClient) + Send>;

/// Threads that make the client's calls, `n` at a time.
pub struct CallPool {
    client: Arc<dyn PoolClient>,
    tx: Mutex<Option<crossbeam_channel::Sender<Job>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl CallPool {
    /// Starts `n` threads named `ucm-mooncake-{i}`.
    pub fn start(client: Arc<dyn PoolClient>, n: usize) -> Result<Self> {
        let (tx, rx) = crossbeam_channel::unbounded::<Job>();
        let mut threads = Vec::with_capacity(n);
        for i in 0..n.max(1) {
            let rx = rx.clone();
            let client = client.clone();
            let t = std::thread::Builder::new()
                .name(format!("ucm-mooncake-{i}"))
                .spawn(move || {
                    while let Ok(job) = rx.recv() {
                        job(client.as_ref());
                    }
                })
                .map_err(|e| UcmError::os("spawn", "ucm-mooncake thread", e))?;
            threads.push(t);
        }
        Ok(CallPool {
            client,
            tx: Mutex::new(Some(tx)),
            threads: Mutex::new(threads),
        })
    }

    /// The client, for calls made while opening and closing.
    pub fn client(&self) -> &dyn PoolClient {
        self.client.as_ref()
    }

    /// Runs `f` on one of the pool's threads. The call runs to its end even
    /// if the returned future is dropped (a deadline); whatever `f` owns
    /// is released only then.
    pub fn call<T: Send + 'static>(
        &self,
        f: impl FnOnce(&dyn PoolClient) -> T + Send + 'static,
    ) -> impl Future<Output = Result<T>> + Send + 'static {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let job: Job = Box::new(move |c| {
            let _ = tx.send(f(c));
        });
        let sent = match self.tx.lock().as_ref() {
            Some(s) => s.send(job).is_ok(),
            None => false,
        };
        async move {
            if !sent {
                return Err(UcmError::Closed);
            }
            rx.await.map_err(|_| UcmError::Closed)
        }
    }

    /// Stops taking calls and waits up to `grace` for those running; closes
    /// the client when every thread is done. A thread still inside the
    /// client (a master that does not answer) is left running, and the
    /// client open, rather than closing it under that call.
    pub fn shutdown(&self, grace: Duration) {
        self.tx.lock().take();
        let until = Instant::now() + grace;
        let mut threads = self.threads.lock();
        while threads.iter().any(|t| !t.is_finished()) && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
        }
        if threads.iter().all(|t| t.is_finished()) {
            for t in threads.drain(..) {
                let _ = t.join();
            }
            self.client.close();
        } else {
            log::warn!(
                "Mooncake store closed while a client call was still running; the client stays \
                 open until it returns"
            );
        }
    }
}
