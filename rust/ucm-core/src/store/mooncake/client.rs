//! The pool client the Mooncake store calls, and the threads that call it.
//!
//! Mooncake's client is a C++ library whose calls block; the core sees it
//! through [`PoolClient`] (the Python bindings implement it over
//! `mooncake.store.MooncakeDistributedStore`). Its calls run on threads
//! the store starts when it opens, never on the caller's or the runtime's:
//! a call stuck on a dead master then holds one of those threads, not an
//! engine thread, and sockets the client opens belong to the network
//! namespace the store was opened in. Requests that wait while a call runs
//! are made together in the next one (one batch call per kind).

use std::future::Future;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::arena::{Buf, Slot};
use crate::error::{Result, UcmError};

/// The calls the store makes into a Mooncake pool. Each answer is one
/// Mooncake code per key, as the client returns it: `>= 0` is success (a
/// size, or bytes read), a negative value one of Mooncake's `ErrorCode`s.
/// An `Err` means the call itself failed (the client raised).
pub trait PoolClient: Send + Sync + 'static {
    /// Sizes of the objects under `keys`.
    fn sizes(&self, keys: &[String]) -> Result<Vec<i64>>;
    /// Writes each buffer as the object under its key.
    fn put_from(&self, keys: &[String], bufs: &[Buf]) -> Result<Vec<i64>>;
    /// Reads each whole object into its buffer (at least as long): the
    /// bytes read, or a code.
    fn get_whole(&self, keys: &[String], bufs: &[Buf]) -> Result<Vec<i64>>;
    /// Reads `bufs[i].len` bytes of each object, from byte `offsets[i]`,
    /// into its buffer: the bytes read, or a code.
    fn get_ranges(&self, keys: &[String], bufs: &[Buf], offsets: &[u64]) -> Result<Vec<i64>>;
    /// Removes the objects under `keys`.
    fn remove(&self, keys: &[String]) -> Result<Vec<i64>>;
    /// Registers memory the transfer engine may read and write directly.
    fn register(&self, buf: Buf) -> Result<()>;
    /// Undoes [`PoolClient::register`].
    fn unregister(&self, addr: usize);
    /// Leaves the pool (this client's segment is unmounted).
    fn close(&self);
}

/// Calls that came in while one was running are made together, up to this
/// many keys per client call.
const MAX_BATCH: usize = 64;

type Reply<T> = tokio::sync::oneshot::Sender<T>;

/// One request to the pool. Transfers own their slot until the client
/// call returned; a slot the call may still be using is poisoned before
/// the reply (see [`slot_is_safe_after`]).
enum Call {
    Size(String, Reply<Result<i64>>),
    Get(
        String,
        Slot,
        Option<(u64, usize)>,
        Reply<(Option<Slot>, Result<i64>)>,
    ),
    Put(String, Slot, usize, Reply<Result<i64>>),
    Remove(String, Reply<Result<i64>>),
}

/// Mooncake's `ErrorCode`s the store tells apart.
pub mod code {
    pub const NO_AVAILABLE_HANDLE: i64 = -200;
    pub const INVALID_PARAMS: i64 = -600;
    pub const REPLICA_IS_NOT_READY: i64 = -703;
    pub const OBJECT_NOT_FOUND: i64 = -704;
    pub const OBJECT_ALREADY_EXISTS: i64 = -705;
    pub const LEASE_EXPIRED: i64 = -707;
    pub const RPC_FAIL: i64 = -900;
    pub const RPC_TIMEOUT: i64 = -901;
}

/// True for the outcomes Mooncake reports before a transfer starts or
/// after it ended: the slot is safe to reuse. After any other failure the
/// transfer engine may still be using it.
pub fn slot_is_safe_after(rc: i64) -> bool {
    rc >= 0
        || matches!(
            rc,
            code::NO_AVAILABLE_HANDLE
                | code::INVALID_PARAMS
                | code::REPLICA_IS_NOT_READY
                | code::OBJECT_NOT_FOUND
                | code::OBJECT_ALREADY_EXISTS
                | code::LEASE_EXPIRED
                | code::RPC_FAIL
                | code::RPC_TIMEOUT
        )
}

/// Threads that make the client's calls: each takes the requests waiting
/// and makes one batch call per kind (a ranged get of many blocks is
/// one round of transfers, not many).
pub struct CallPool {
    client: Arc<dyn PoolClient>,
    /// Size queries and removals: never queued behind transfers, so a
    /// scheduler's lookup does not wait for a load.
    meta: Mutex<Option<crossbeam_channel::Sender<Call>>>,
    transfers: Mutex<Option<crossbeam_channel::Sender<Call>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

/// Starts a thread that takes the requests of `rx` in batches.
fn worker(
    name: String,
    client: Arc<dyn PoolClient>,
    rx: crossbeam_channel::Receiver<Call>,
) -> Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name(name)
        .spawn(move || {
            while let Ok(first) = rx.recv() {
                let mut batch = vec![first];
                while batch.len() < MAX_BATCH {
                    match rx.try_recv() {
                        Ok(c) => batch.push(c),
                        Err(_) => break,
                    }
                }
                run_batch(client.as_ref(), batch);
            }
        })
        .map_err(|e| UcmError::os("spawn", "ucm-mooncake thread", e))
}

impl CallPool {
    /// Starts one thread for size queries and removals and `n` for
    /// transfers (`ucm-mooncake-meta`, `ucm-mooncake-{i}`).
    pub fn start(client: Arc<dyn PoolClient>, n: usize) -> Result<Self> {
        let (meta_tx, meta_rx) = crossbeam_channel::unbounded::<Call>();
        let (tx, rx) = crossbeam_channel::unbounded::<Call>();
        let mut threads = vec![worker("ucm-mooncake-meta".into(), client.clone(), meta_rx)?];
        for i in 0..n.max(1) {
            threads.push(worker(
                format!("ucm-mooncake-{i}"),
                client.clone(),
                rx.clone(),
            )?);
        }
        Ok(CallPool {
            client,
            meta: Mutex::new(Some(meta_tx)),
            transfers: Mutex::new(Some(tx)),
            threads: Mutex::new(threads),
        })
    }

    fn send<T>(
        &self,
        call: Call,
        rx: tokio::sync::oneshot::Receiver<T>,
    ) -> impl Future<Output = Result<T>> + Send + 'static
    where
        T: Send + 'static,
    {
        let queue = match call {
            Call::Size(..) | Call::Remove(..) => &self.meta,
            Call::Get(..) | Call::Put(..) => &self.transfers,
        };
        let sent = match queue.lock().as_ref() {
            Some(s) => s.send(call).is_ok(),
            None => false,
        };
        async move {
            if !sent {
                return Err(UcmError::Closed);
            }
            rx.await.map_err(|_| UcmError::Closed)
        }
    }

    /// The size of the object under `key` (a Mooncake code when negative).
    pub fn size(&self, key: String) -> impl Future<Output = Result<Result<i64>>> + Send + 'static {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.send(Call::Size(key, tx), rx)
    }

    /// Reads the object under `key` into the start of `slot`: all of it
    /// (`range` None), or `len` bytes from byte `offset`. Answers the bytes
    /// read (or a code), and the slot back unless the call may still be
    /// writing it. The call runs to its end even if the future is dropped.
    pub fn get(
        &self,
        key: String,
        slot: Slot,
        range: Option<(u64, usize)>,
    ) -> impl Future<Output = Result<(Option<Slot>, Result<i64>)>> + Send + 'static {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.send(Call::Get(key, slot, range, tx), rx)
    }

    /// Writes the first `len` bytes of `slot` as the object under `key`.
    pub fn put(
        &self,
        key: String,
        slot: Slot,
        len: usize,
    ) -> impl Future<Output = Result<Result<i64>>> + Send + 'static {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.send(Call::Put(key, slot, len, tx), rx)
    }

    /// Removes the object under `key`.
    pub fn remove(
        &self,
        key: String,
    ) -> impl Future<Output = Result<Result<i64>>> + Send + 'static {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.send(Call::Remove(key, tx), rx)
    }

    /// Stops taking calls and waits up to `grace` for those running; closes
    /// the client when every thread is done. A thread still inside the
    /// client (a master that does not answer) is left running, and the
    /// client open, rather than closing it under that call.
    pub fn shutdown(&self, grace: Duration) {
        self.meta.lock().take();
        self.transfers.lock().take();
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

/// The i-th code of a batch answer (a short answer is a client bug:
/// reported as invalid parameters for the missing keys).
fn nth(codes: &Result<Vec<i64>>, i: usize) -> Result<i64> {
    match codes {
        Ok(v) => Ok(v.get(i).copied().unwrap_or(code::INVALID_PARAMS)),
        Err(e) => Err(e.clone()),
    }
}

/// Splits `items` into rounds in which no key appears twice: Mooncake's
/// batch calls must not see a key twice (a `batch_get_into` that names one
/// key for two buffers fills only the last and reports success for both).
fn unique_rounds<T>(items: Vec<T>, key: impl Fn(&T) -> &str) -> Vec<Vec<T>> {
    let mut rounds: Vec<Vec<T>> = Vec::new();
    for item in items {
        let k = key(&item).to_string();
        match rounds.iter_mut().find(|r| r.iter().all(|x| key(x) != k)) {
            Some(r) => r.push(item),
            None => rounds.push(vec![item]),
        }
    }
    rounds
}

/// Makes the calls of one batch, one client call per kind (and per round
/// of distinct keys), and replies.
fn run_batch(client: &dyn PoolClient, batch: Vec<Call>) {
    let (mut sizes, mut gets, mut puts, mut removes) = (vec![], vec![], vec![], vec![]);
    for c in batch {
        match c {
            Call::Size(k, r) => sizes.push((k, r)),
            Call::Get(k, s, range, r) => gets.push((k, s, range, r)),
            Call::Put(k, s, n, r) => puts.push((k, s, n, r)),
            Call::Remove(k, r) => removes.push((k, r)),
        }
    }
    // Whole blocks go through batch_get_into, which is faster for them;
    // parts of blocks (a layer's shard) through ranged gets.
    let (whole, ranged): (Vec<GetCall>, Vec<GetCall>) = gets
        .into_iter()
        .partition(|(_, _, range, _)| range.is_none());
    for round in unique_rounds(whole, |(k, ..)| k) {
        get_round(client, round);
    }
    for round in unique_rounds(ranged, |(k, ..)| k) {
        get_round(client, round);
    }
    for round in unique_rounds(puts, |(k, _, _, _)| k) {
        put_round(client, round);
    }
    if !sizes.is_empty() {
        let keys: Vec<String> = sizes.iter().map(|(k, _)| k.clone()).collect();
        let codes = client.sizes(&keys);
        for (i, (_, r)) in sizes.into_iter().enumerate() {
            let _ = r.send(nth(&codes, i));
        }
    }
    if !removes.is_empty() {
        let keys: Vec<String> = removes.iter().map(|(k, _)| k.clone()).collect();
        let codes = client.remove(&keys);
        for (i, (_, r)) in removes.into_iter().enumerate() {
            let _ = r.send(nth(&codes, i));
        }
    }
}

type GetCall = (
    String,
    Slot,
    Option<(u64, usize)>,
    Reply<(Option<Slot>, Result<i64>)>,
);
type PutCall = (String, Slot, usize, Reply<Result<i64>>);

/// One client call for gets that are all whole or all ranged.
fn get_round(client: &dyn PoolClient, gets: Vec<GetCall>) {
    let keys: Vec<String> = gets.iter().map(|(k, ..)| k.clone()).collect();
    let bufs: Vec<Buf> = gets
        .iter()
        .map(|(_, s, range, _)| Buf {
            addr: s.buf().addr,
            len: range.map_or(s.buf().len, |(_, n)| n.min(s.buf().len)),
        })
        .collect();
    let codes = if gets.first().is_some_and(|(_, _, range, _)| range.is_none()) {
        client.get_whole(&keys, &bufs)
    } else {
        let offsets: Vec<u64> = gets
            .iter()
            .map(|(_, _, range, _)| range.map_or(0, |(o, _)| o))
            .collect();
        client.get_ranges(&keys, &bufs, &offsets)
    };
    for (i, (_, slot, _, r)) in gets.into_iter().enumerate() {
        let rc = nth(&codes, i);
        let slot = keep_or_poison(slot, &rc);
        let _ = r.send((slot, rc));
    }
}

fn put_round(client: &dyn PoolClient, puts: Vec<PutCall>) {
    let keys: Vec<String> = puts.iter().map(|(k, _, _, _)| k.clone()).collect();
    let bufs: Vec<Buf> = puts
        .iter()
        .map(|(_, s, n, _)| Buf {
            addr: s.buf().addr,
            len: (*n).min(s.buf().len),
        })
        .collect();
    let codes = client.put_from(&keys, &bufs);
    for (i, (_, slot, _, r)) in puts.into_iter().enumerate() {
        let rc = nth(&codes, i);
        drop(keep_or_poison(slot, &rc));
        let _ = r.send(rc);
    }
}

/// The slot back after a transfer, or None (poisoned) when the transfer
/// engine may still be using it.
fn keep_or_poison(slot: Slot, rc: &Result<i64>) -> Option<Slot> {
    match rc {
        Ok(rc) if slot_is_safe_after(*rc) => Some(slot),
        _ => {
            slot.poison();
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::unique_rounds;

    #[test]
    fn no_round_names_a_key_twice_and_order_is_kept() {
        let items = vec!["a", "b", "a", "c", "a", "b"];
        let rounds = unique_rounds(items, |k| k);
        assert_eq!(rounds, vec![vec!["a", "b", "c"], vec!["a", "b"], vec!["a"]]);
    }
}
