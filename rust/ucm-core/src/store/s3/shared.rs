//! Pieces shared by the remote tiers (the S3 store and the NFS store).
//!
//! * [`Runtime`]: a small multi-thread tokio runtime owned by a store; sync
//!   callers hand futures to it and block on a channel (never `block_on`,
//!   so calling from inside someone else's runtime does not panic).
//! * [`Unit`]: completes a task's units exactly once, also when the future
//!   carrying it is cancelled (deadline, shutdown): a task can never hang.
//! * [`LookupCache`]: a short-lived cache of presence results, so a prefix
//!   lookup of thousands of ids per scheduler step does not turn into
//!   thousands of round trips.
//! * [`Breaker`]: after a transport failure, requests fail fast for a short,
//!   growing pause instead of each waiting out its own retries and timeouts.
//! * [`probe_all`] / [`probe_prefix`]: ordered, bounded-concurrency probes.
//! * [`expand_env`]: `${VAR}` / `${VAR:-default}` in config values.

use std::collections::HashMap;
use std::future::Future;
use std::hash::BuildHasherDefault;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use parking_lot::Mutex;

use crate::block::BlockId;
use crate::error::{Result, UcmError};
use crate::store::posix::index::IdHasher;
use crate::task::Task;

/// Expands `${VAR}` and `${VAR:-default}` in a config value from the
/// environment. An unset variable without a default is an error naming the
/// config key and the variable, never the value of anything.
pub fn expand_env(key: &str, value: &str) -> Result<String> {
    let mut out = String::with_capacity(value.len());
    let mut rest = value;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let end = after
            .find('}')
            .ok_or_else(|| UcmError::invalid(format!("{key}: unterminated '${{' in the value")))?;
        let expr = &after[..end];
        let (name, default) = match expr.split_once(":-") {
            Some((n, d)) => (n, Some(d)),
            None => (expr, None),
        };
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return Err(UcmError::invalid(format!(
                "{key}: invalid environment variable name {name:?} in '${{...}}'"
            )));
        }
        match std::env::var(name) {
            Ok(v) if !v.is_empty() => out.push_str(&v),
            _ => match default {
                Some(d) => out.push_str(d),
                None => {
                    return Err(UcmError::invalid(format!(
                        "{key}: environment variable {name} is not set"
                    )))
                }
            },
        }
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

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

type IdMap<V> = HashMap<BlockId, V, BuildHasherDefault<IdHasher>>;

/// Presence results remembered for a short time. Positive and negative
/// results have their own lifetimes (0 disables either).
pub struct LookupCache {
    map: Mutex<IdMap<(bool, Instant)>>,
    positive_ttl: Duration,
    negative_ttl: Duration,
    max_entries: usize,
    hits: AtomicU64,
    misses: AtomicU64,
}

impl LookupCache {
    /// A cache keeping at most `max_entries` results.
    pub fn new(positive_ttl: Duration, negative_ttl: Duration, max_entries: usize) -> Self {
        LookupCache {
            map: Mutex::new(IdMap::default()),
            positive_ttl,
            negative_ttl,
            max_entries: max_entries.max(16),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }

    /// The remembered result, if still fresh.
    pub fn get(&self, id: &BlockId) -> Option<bool> {
        let map = self.map.lock();
        let found = map.get(id).and_then(|(present, at)| {
            let ttl = if *present {
                self.positive_ttl
            } else {
                self.negative_ttl
            };
            (at.elapsed() < ttl).then_some(*present)
        });
        drop(map);
        if found.is_some() {
            self.hits.fetch_add(1, Ordering::Relaxed);
        } else {
            self.misses.fetch_add(1, Ordering::Relaxed);
        }
        found
    }

    /// Remembers a result.
    pub fn put(&self, id: BlockId, present: bool) {
        let ttl = if present {
            self.positive_ttl
        } else {
            self.negative_ttl
        };
        if ttl.is_zero() {
            self.forget(&id);
            return;
        }
        let mut map = self.map.lock();
        if map.len() >= self.max_entries {
            let (p, n) = (self.positive_ttl, self.negative_ttl);
            map.retain(|_, (present, at)| at.elapsed() < if *present { p } else { n });
            if map.len() >= self.max_entries {
                map.clear();
            }
        }
        map.insert(id, (present, Instant::now()));
    }

    /// Drops what is known about `id`.
    pub fn forget(&self, id: &BlockId) {
        self.map.lock().remove(id);
    }

    /// (answered from the cache, had to ask the server).
    pub fn counts(&self) -> (u64, u64) {
        (
            self.hits.load(Ordering::Relaxed),
            self.misses.load(Ordering::Relaxed),
        )
    }
}

/// Fails requests fast while the server is known to be unreachable.
///
/// A transport failure (connection refused or reset, timeout) opens the
/// breaker for a pause that starts at 250 ms and doubles up to 5 s; any
/// success closes it. While open, lookups answer "absent" and transfers fail
/// at once with the last error, so a dead server costs the engine nothing
/// but recomputation (and a `Cache` tier keeps dirty blocks for later).
pub struct Breaker {
    epoch: Instant,
    open_until_ms: AtomicU64,
    pause_ms: AtomicU64,
    last_error: Mutex<String>,
    trips: AtomicU64,
}

impl Default for Breaker {
    fn default() -> Self {
        Breaker {
            epoch: Instant::now(),
            open_until_ms: AtomicU64::new(0),
            pause_ms: AtomicU64::new(0),
            last_error: Mutex::new(String::new()),
            trips: AtomicU64::new(0),
        }
    }
}

impl Breaker {
    const MIN_PAUSE_MS: u64 = 250;
    const MAX_PAUSE_MS: u64 = 5_000;

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// `Err` with the last transport error while the breaker is open.
    pub fn check(&self, what: &str) -> Result<()> {
        if self.now_ms() < self.open_until_ms.load(Ordering::Acquire) {
            return Err(UcmError::TaskFailed(format!(
                "{what}: server unavailable ({}); retrying shortly",
                self.last_error.lock()
            )));
        }
        Ok(())
    }

    /// True while open.
    pub fn is_open(&self) -> bool {
        self.now_ms() < self.open_until_ms.load(Ordering::Acquire)
    }

    /// Records a transport failure.
    pub fn trip(&self, error: &str) {
        let pause = (self.pause_ms.load(Ordering::Relaxed) * 2)
            .clamp(Self::MIN_PAUSE_MS, Self::MAX_PAUSE_MS);
        self.pause_ms.store(pause, Ordering::Relaxed);
        *self.last_error.lock() = error.to_string();
        self.open_until_ms
            .store(self.now_ms() + pause, Ordering::Release);
        if self.trips.fetch_add(1, Ordering::Relaxed) % 64 == 0 {
            log::warn!("remote store unreachable ({error}); failing fast for {pause} ms");
        }
    }

    /// Records a success.
    pub fn reset(&self) {
        if self.pause_ms.swap(0, Ordering::Relaxed) != 0 {
            self.open_until_ms.store(0, Ordering::Release);
            log::info!("remote store reachable again");
        }
    }

    /// How many times it opened.
    pub fn trips(&self) -> u64 {
        self.trips.load(Ordering::Relaxed)
    }
}

/// Presence of every id, probing at most `concurrency` at a time, in order.
pub async fn probe_all<F, Fut>(ids: Vec<BlockId>, concurrency: usize, probe: F) -> Vec<bool>
where
    F: Fn(BlockId) -> Fut,
    Fut: Future<Output = bool>,
{
    futures::stream::iter(ids)
        .map(probe)
        .buffered(concurrency.max(1))
        .collect()
        .await
}

/// Index of the last id of the longest present prefix (-1: none), probing
/// ahead at most `concurrency` ids and stopping at the first miss.
pub async fn probe_prefix<F, Fut>(ids: Vec<BlockId>, concurrency: usize, probe: F) -> isize
where
    F: Fn(BlockId) -> Fut,
    Fut: Future<Output = bool>,
{
    let mut stream = futures::stream::iter(ids)
        .map(probe)
        .buffered(concurrency.max(1));
    let mut last = -1isize;
    while let Some(present) = stream.next().await {
        if !present {
            break;
        }
        last += 1;
    }
    last
}

/// Groups shards by block, keeping each block's first-seen order: stores
/// coalesce the shards of one block into fewer requests.
pub fn group_by_block<T>(items: Vec<T>, block: impl Fn(&T) -> BlockId) -> Vec<(BlockId, Vec<T>)> {
    let mut order: IdMap<usize> = IdMap::default();
    let mut groups: Vec<(BlockId, Vec<T>)> = Vec::new();
    for item in items {
        let id = block(&item);
        match order.get(&id) {
            Some(&i) => groups[i].1.push(item),
            None => {
                order.insert(id, groups.len());
                groups.push((id, vec![item]));
            }
        }
    }
    groups
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_expansion() {
        std::env::set_var("UCM_TEST_EXPAND_A", "alpha");
        std::env::remove_var("UCM_TEST_EXPAND_MISSING");
        assert_eq!(
            expand_env("k", "x${UCM_TEST_EXPAND_A}y").unwrap(),
            "xalphay"
        );
        assert_eq!(expand_env("k", "plain").unwrap(), "plain");
        assert_eq!(
            expand_env("k", "${UCM_TEST_EXPAND_MISSING:-dflt}").unwrap(),
            "dflt"
        );
        let e = expand_env("s3_access_key", "${UCM_TEST_EXPAND_MISSING}").unwrap_err();
        assert!(
            e.to_string().contains("s3_access_key")
                && e.to_string().contains("UCM_TEST_EXPAND_MISSING"),
            "{e}"
        );
        assert!(expand_env("k", "${UNTERMINATED").is_err());
        assert!(expand_env("k", "${bad name}").is_err());
    }

    #[test]
    fn lookup_cache_ttls() {
        let c = LookupCache::new(Duration::from_secs(60), Duration::ZERO, 100);
        let (a, b) = (BlockId([1; 16]), BlockId([2; 16]));
        c.put(a, true);
        c.put(b, false); // negative ttl 0: not remembered
        assert_eq!(c.get(&a), Some(true));
        assert_eq!(c.get(&b), None);
        c.forget(&a);
        assert_eq!(c.get(&a), None);
        let c = LookupCache::new(Duration::from_millis(1), Duration::from_secs(60), 100);
        c.put(a, true);
        c.put(b, false);
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(c.get(&a), None);
        assert_eq!(c.get(&b), Some(false));
    }

    #[test]
    fn lookup_cache_is_bounded() {
        let c = LookupCache::new(Duration::from_secs(60), Duration::from_secs(60), 16);
        for i in 0..100u8 {
            c.put(BlockId([i; 16]), true);
        }
        assert!(c.map.lock().len() <= 16);
    }

    #[test]
    fn breaker_opens_and_closes() {
        let b = Breaker::default();
        assert!(b.check("x").is_ok());
        b.trip("connection refused");
        let e = b.check("load").unwrap_err().to_string();
        assert!(e.contains("connection refused"), "{e}");
        b.reset();
        assert!(b.check("x").is_ok());
    }

    #[test]
    fn probes_are_ordered_and_prefix_stops() {
        let rt = Runtime::new("t", 1).unwrap();
        let ids: Vec<BlockId> = (0..10u8).map(|i| BlockId([i; 16])).collect();
        let asked = Arc::new(AtomicU64::new(0));
        let a = asked.clone();
        let present = run_blocking(&rt.handle(), async move {
            probe_all(ids.clone(), 3, |id| {
                let a = a.clone();
                async move {
                    a.fetch_add(1, Ordering::Relaxed);
                    id.0[0] % 2 == 0
                }
            })
            .await
        })
        .unwrap();
        assert_eq!(present.iter().filter(|p| **p).count(), 5);
        assert!(present[0] && !present[1]);
        assert_eq!(asked.load(Ordering::Relaxed), 10);
        let ids: Vec<BlockId> = (0..10u8).map(|i| BlockId([i; 16])).collect();
        let last = run_blocking(&rt.handle(), async move {
            probe_prefix(ids, 2, |id| async move { id.0[0] < 4 }).await
        })
        .unwrap();
        assert_eq!(last, 3);
        rt.shutdown(Duration::from_secs(1));
    }

    #[test]
    fn dropped_units_fail_closed() {
        let reg = crate::task::TaskRegistry::new(0);
        let t = reg.create("load", 2);
        drop(Unit::new(t.clone(), 2));
        assert_eq!(reg.wait(t.id()).unwrap_err().code(), -50012);
    }

    #[test]
    fn grouping_keeps_order() {
        let items = vec![(1u8, 0), (2, 0), (1, 1), (3, 0), (2, 1)];
        let g = group_by_block(items, |(b, _)| BlockId([*b; 16]));
        assert_eq!(g.len(), 3);
        assert_eq!(g[0].1, vec![(1, 0), (1, 1)]);
        assert_eq!(g[1].1, vec![(2, 0), (2, 1)]);
    }
}
