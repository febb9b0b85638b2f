//! The table's lock: one process-shared, robust pthread mutex in the
//! region's header, which nothing in a segment can make a process wait on
//! forever.
//!
//! # A bound on every wait
//!
//! Every lock is taken with a deadline ([`lock_wait`]): on the monotonic
//! clock where the C library has `pthread_mutex_clocklock` (glibc 2.30 and
//! later, looked up at run time so older ones still load the library),
//! else with `pthread_mutex_timedlock` on the wall clock, in slices whose
//! total is measured on the monotonic one. A lock not had in time is an
//! error: the open that needed it decides what the segment is worth (see
//! `shared`), an operation fails or takes its slow path, and releases
//! that cannot wait are deferred to the next lock taken ([`Release`]).
//!
//! # Its bytes, checked before they are trusted
//!
//! A segment is memory any process of its user can write, and a kept one
//! outlives its writers, so the mutex may hold anything. The C library
//! trusts it: a kind field naming a priority-protected mutex made glibc
//! abort, and a lock word naming a live thread waits forever. So before
//! every lock, the words glibc's 64-bit `struct __pthread_mutex_s` never
//! changes after `pthread_mutex_init` (its kind and spin count) are
//! compared with those of a mutex freshly initialised with our attributes,
//! and the words it does change (the lock word and the owner) must name a
//! thread id the kernel can hand out or one of glibc's markers. The rest
//! (count, users, robust-list links) is overwritten by the next locker.
//! Elsewhere than glibc on 64 bits, only the bound applies.

use std::sync::atomic::Ordering;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use super::{Guard, Table, FILLING};
use crate::block::BlockId;
use crate::error::{Result, UcmError};

/// Bound of a lock wait when the store has no `timeout_ms`.
pub const DEFAULT_LOCK_WAIT: Duration = Duration::from_secs(10);
/// Shortest bound, whatever `timeout_ms` says.
const MIN_LOCK_WAIT: Duration = Duration::from_secs(1);
/// Longest single wait of the wall-clock fallback: a step of the wall
/// clock stretches one slice, not the whole bound.
const SLICE: Duration = Duration::from_millis(100);

/// How long a lock of the table may wait, from the store's `timeout_ms`
/// (0: none). Half of it: a load that cannot have the lock in time still
/// has the other half to read its shards from the backend (a miss), and a
/// dump fails well before its caller gives up. At least 1 s: ordinary
/// holds (a joining process checking a large table, a rebuild after a
/// dead holder) take a small fraction of that even on a busy host, and a
/// lock given up too early fails work that would have succeeded. Without
/// a timeout, 10 s: far above any ordinary hold, short enough that a
/// process stuck behind a holder that never lets go says so while
/// someone is still looking.
pub fn lock_wait(timeout_ms: u64) -> Duration {
    if timeout_ms == 0 {
        return DEFAULT_LOCK_WAIT;
    }
    (Duration::from_millis(timeout_ms) / 2).max(MIN_LOCK_WAIT)
}

/// Something a task gives back in the table, which must not be lost when
/// the lock cannot be had: it is deferred to the next lock taken, so no
/// slot stays pinned or half-filled for good because of one timeout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Release {
    /// Drop one of our pins on the slot.
    Unpin(u32),
    /// Our fill of the slot (FILLING, ours) will not complete: it leaves
    /// the index.
    Abandon(u32),
    /// The slot, if it still holds (block, shard), leaves the index: its
    /// bytes failed their check.
    Drop {
        /// The slot.
        slot: u32,
        /// The block it held.
        block: BlockId,
        /// The shard it held.
        shard: u32,
    },
}

impl Guard<'_> {
    /// Applies releases, skipping any whose slot is no longer what it
    /// was when they were made.
    pub fn apply(&mut self, ops: &[Release]) {
        for &op in ops {
            match op {
                Release::Unpin(slot) if (slot as usize) < self.meta.len() => self.unpin(slot),
                Release::Abandon(slot) => {
                    let ours = self
                        .meta
                        .get(slot as usize)
                        .is_some_and(|m| m.state == FILLING && m.owner == self.me);
                    if ours {
                        self.drop_entry(slot);
                    }
                }
                Release::Drop { slot, block, shard } => {
                    let same = self
                        .meta
                        .get(slot as usize)
                        .is_some_and(|m| m.block == block.0 && m.shard == shard);
                    if same {
                        self.drop_entry(slot);
                    }
                }
                Release::Unpin(_) => {}
            }
        }
    }
}

impl Table {
    /// Takes the mutex within the bound, its bytes checked first: true
    /// when its last holder died (the table then needs repair).
    pub(super) fn try_raw_lock(&self) -> std::result::Result<bool, LockFailure> {
        let m = self.mutex();
        // SAFETY: the mutex lies in the header, inside the mapping, which
        // lives as long as `self`; its bytes may be anything.
        if let Err(why) = unsafe { check_mutex(m) } {
            return Err(LockFailure::Garbage(why));
        }
        // SAFETY: as above; the C library is given only bytes that passed
        // the checks a mutex of ours passes.
        match unsafe { timed_lock(m, self.lock_wait) } {
            0 => Ok(false),
            libc::EOWNERDEAD => {
                // SAFETY: EOWNERDEAD grants us the mutex.
                unsafe { libc::pthread_mutex_consistent(m) };
                Ok(true)
            }
            libc::ETIMEDOUT => Err(LockFailure::Timeout),
            libc::ENOTRECOVERABLE => Err(LockFailure::Garbage(
                "is marked unrecoverable (a holder died and the next one released it unrepaired)"
                    .into(),
            )),
            libc::EINVAL => Err(LockFailure::Garbage(
                "is no mutex the C library accepts (EINVAL)".into(),
            )),
            e => Err(LockFailure::Os(e)),
        }
    }

    /// Takes the table lock within its bound, repairing the table if its
    /// last holder died and applying deferred releases. A lock not taken
    /// is an error naming the segment and who uses it, also logged.
    pub fn lock(&self) -> Result<Guard<'_>> {
        self.try_lock().map_err(|f| {
            self.lock_failures.fetch_add(1, Ordering::Relaxed);
            let e = self.lock_error(&f);
            log::warn!("{e}");
            e
        })
    }

    /// [`Table::lock`], telling why it failed, without counting or logging.
    pub(super) fn try_lock(&self) -> std::result::Result<Guard<'_>, LockFailure> {
        let repaired = self.try_raw_lock()?;
        // SAFETY: we hold the mutex.
        let mut g = unsafe { self.views() };
        if repaired {
            // It may have died halfway through an update: check the slots
            // before anything walks the index.
            let found = g.check_and_rebuild();
            log::warn!(
                "cache table: a participant died holding the lock; rebuilt the index{}",
                if found.discarded > 0 {
                    format!(" and discarded {} slot(s) it left invalid", found.discarded)
                } else {
                    String::new()
                }
            );
            g.reap_dead();
        }
        if self.has_deferred.load(Ordering::Relaxed) {
            let ops = {
                let mut d = self.deferred.lock();
                self.has_deferred.store(false, Ordering::Relaxed);
                std::mem::take(&mut *d)
            };
            g.apply(&ops);
        }
        Ok(g)
    }

    /// Applies `ops` under the lock, or defers them to the next lock taken
    /// when it cannot be had.
    pub fn release(&self, ops: Vec<Release>) {
        if ops.is_empty() {
            return;
        }
        match self.lock() {
            Ok(mut g) => g.apply(&ops),
            Err(_) => self.defer(ops),
        }
    }

    /// Defers `ops` to the next lock taken (the caller just failed to take
    /// it).
    pub fn defer(&self, ops: impl IntoIterator<Item = Release>) {
        let mut d = self.deferred.lock();
        let before = d.len();
        d.extend(ops);
        if d.len() > before {
            self.has_deferred.store(true, Ordering::Relaxed);
            log::warn!(
                "cache table: {} release(s) of pins and fills wait for the next lock taken",
                d.len() - before
            );
        }
    }

    /// The error an operation gets for a lock not taken.
    fn lock_error(&self, f: &LockFailure) -> UcmError {
        let Some(path) = self.shm_path() else {
            return match f {
                LockFailure::Timeout => UcmError::Timeout(format!(
                    "cache table lock (private memory) not free within {:?}",
                    self.lock_wait
                )),
                LockFailure::Garbage(why) => {
                    UcmError::TaskFailed(format!("cache table lock (private memory) {why}"))
                }
                LockFailure::Os(e) => UcmError::os(
                    "pthread_mutex_timedlock",
                    "cache table",
                    std::io::Error::from_raw_os_error(*e),
                ),
            };
        };
        let users = self.users_note();
        match f {
            LockFailure::Timeout => UcmError::Timeout(format!(
                "shared cache segment {path}: its lock was not free within {:?}{}{users}; a \
                 process holding it without letting go (stuck or stopped) must be stopped",
                self.lock_wait,
                self.holder_note()
            )),
            LockFailure::Garbage(why) => UcmError::TaskFailed(format!(
                "shared cache segment {path}: its lock {why}{users}; stop every process using \
                 it and remove the segment (rm {path})"
            )),
            LockFailure::Os(e) => UcmError::os(
                "pthread_mutex_timedlock",
                path,
                std::io::Error::from_raw_os_error(*e),
            ),
        }
    }

    /// ", held by thread N" when the lock word names one, for messages.
    pub(super) fn holder_note(&self) -> String {
        // SAFETY: the mutex lies in the mapping, which lives as long as
        // `self`.
        match unsafe { holder_tid(self.mutex()) } {
            0 => String::new(),
            tid => format!(" (its lock word names thread {tid} as its holder)"),
        }
    }

    /// ", used by process(es) ..." for messages, from the participants read
    /// without the lock.
    fn users_note(&self) -> String {
        let pids = self.live_pids_unlocked();
        if pids.is_empty() {
            return String::new();
        }
        format!(", used by process(es) {}", pid_list(&pids))
    }
}

/// "1, 2, 3".
pub(super) fn pid_list(pids: &[i32]) -> String {
    pids.iter()
        .map(i32::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Why a lock was not taken.
#[derive(Clone, Debug)]
pub(super) enum LockFailure {
    /// Not free within the bound.
    Timeout,
    /// The mutex's bytes are not those of a mutex of ours, or the C
    /// library refused them: what is wrong, as the end of a sentence.
    Garbage(String),
    /// Another error of the C library.
    Os(i32),
}

/// Initialises the mutex at `m` with the table's attributes: shared
/// between processes, robust (its holder's death is reported to the next
/// locker instead of blocking it). Returns the C library's error number.
///
/// # Safety
/// `m` is valid for writes and nobody else uses the mutex meanwhile.
pub(super) unsafe fn init_mutex(m: *mut libc::pthread_mutex_t) -> libc::c_int {
    // SAFETY: `attr` is initialised before use and destroyed after; `m`
    // is the caller's promise.
    unsafe {
        let mut attr: libc::pthread_mutexattr_t = std::mem::zeroed();
        libc::pthread_mutexattr_init(&mut attr);
        libc::pthread_mutexattr_setpshared(&mut attr, libc::PTHREAD_PROCESS_SHARED);
        libc::pthread_mutexattr_setrobust(&mut attr, libc::PTHREAD_MUTEX_ROBUST);
        let rc = libc::pthread_mutex_init(m, &attr);
        libc::pthread_mutexattr_destroy(&mut attr);
        rc
    }
}

/// Locks `m` within `wait`: 0, `EOWNERDEAD` (the lock is ours, its last
/// holder died), `ETIMEDOUT`, or another error number.
///
/// # Safety
/// `m` points to mapped memory the size of a mutex for the whole call.
pub(super) unsafe fn timed_lock(m: *mut libc::pthread_mutex_t, wait: Duration) -> libc::c_int {
    let start = Instant::now();
    let clocklock = clocklock();
    loop {
        let left = wait.saturating_sub(start.elapsed());
        let rc = match clocklock {
            Some(f) => {
                let at = deadline(libc::CLOCK_MONOTONIC, left);
                // SAFETY: `f` is pthread_mutex_clocklock (see `clocklock`);
                // `m` is the caller's promise; `at` is a valid timespec.
                unsafe { f(m, libc::CLOCK_MONOTONIC, &at) }
            }
            None => {
                let at = deadline(libc::CLOCK_REALTIME, left.min(SLICE));
                // SAFETY: as above, for pthread_mutex_timedlock.
                unsafe { libc::pthread_mutex_timedlock(m, &at) }
            }
        };
        if rc != libc::ETIMEDOUT || start.elapsed() >= wait {
            return rc;
        }
    }
}

/// `after` from now on `clock`, as an absolute time.
fn deadline(clock: libc::clockid_t, after: Duration) -> libc::timespec {
    // SAFETY: plain data, for which all zeroes is a valid value.
    let mut now: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: `now` is a valid out-pointer; both clocks always exist.
    unsafe { libc::clock_gettime(clock, &mut now) };
    let nanos = now.tv_nsec as u64 + u64::from(after.subsec_nanos());
    now.tv_sec = now
        .tv_sec
        .saturating_add((after.as_secs() + nanos / 1_000_000_000) as libc::time_t);
    now.tv_nsec = (nanos % 1_000_000_000) as _;
    now
}

type ClockLock = unsafe extern "C" fn(
    *mut libc::pthread_mutex_t,
    libc::clockid_t,
    *const libc::timespec,
) -> libc::c_int;

/// `pthread_mutex_clocklock`, where the C library has it.
fn clocklock() -> Option<ClockLock> {
    static FOUND: OnceLock<Option<ClockLock>> = OnceLock::new();
    *FOUND.get_or_init(|| {
        if !cfg!(all(target_env = "gnu", target_pointer_width = "64")) {
            // Elsewhere the symbol may take another timespec.
            return None;
        }
        // SAFETY: looks a symbol up by its NUL-terminated name; no code
        // runs.
        let p = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"pthread_mutex_clocklock".as_ptr()) };
        if p.is_null() {
            return None;
        }
        // SAFETY: glibc's pthread_mutex_clocklock has exactly this
        // signature (POSIX 2024), and the library stays loaded.
        Some(unsafe { std::mem::transmute::<*mut libc::c_void, ClockLock>(p) })
    })
}

/// Checks the mutex at `m` before it is locked (see the module docs):
/// what is wrong, as the end of a sentence starting "its lock".
///
/// # Safety
/// `m` points to mapped memory the size of a mutex.
pub(super) unsafe fn check_mutex(m: *const libc::pthread_mutex_t) -> Result<(), String> {
    #[cfg(all(target_os = "linux", target_env = "gnu", target_pointer_width = "64"))]
    {
        // SAFETY: the caller's promise.
        unsafe { glibc::check(m) }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu", target_pointer_width = "64")))]
    {
        let _ = m;
        Ok(())
    }
}

#[cfg(all(target_os = "linux", target_env = "gnu", target_pointer_width = "64"))]
mod glibc {
    use std::sync::OnceLock;

    /// Word offsets in glibc's 64-bit `struct __pthread_mutex_s`: `__lock`
    /// (the futex word: owner's thread id and two flags), `__owner`, and
    /// `__kind` then `__spins`, which `pthread_mutex_init` writes and
    /// nothing changes after (`__kind` stays where static initialisers
    /// put it, for binary compatibility).
    const LOCK: usize = 0;
    const OWNER: usize = 2;
    const KIND: usize = 4;
    const SPINS: usize = 5;
    /// The thread id bits of the lock word (`FUTEX_TID_MASK`).
    const TID_MASK: u32 = 0x3fff_ffff;
    /// Highest thread id the kernel hands out (`PID_MAX_LIMIT`, 64 bits).
    const TID_MAX: u32 = 1 << 22;
    /// glibc's `__owner` markers: died holding it, not recoverable.
    const INCONSISTENT: u32 = 0x7fff_ffff;
    const NOT_RECOVERABLE: u32 = 0x7fff_fffe;

    /// The mutex's ten words. Other processes may write them meanwhile:
    /// volatile word reads, and a torn view only changes a decision made
    /// on garbage anyway.
    ///
    /// # Safety
    /// `m` points to mapped memory the size of a mutex.
    unsafe fn words(m: *const libc::pthread_mutex_t) -> [u32; 10] {
        let p = m.cast::<u32>();
        // SAFETY: pthread_mutex_t is 40 bytes and 8-aligned here, and
        // mapped per the caller's promise.
        std::array::from_fn(|i| unsafe { p.add(i).read_volatile() })
    }

    /// A mutex freshly initialised with the table's attributes.
    fn fresh() -> [u32; 10] {
        static FRESH: OnceLock<[u32; 10]> = OnceLock::new();
        *FRESH.get_or_init(|| {
            // SAFETY: plain data, initialised below and destroyed after.
            let mut m: libc::pthread_mutex_t = unsafe { std::mem::zeroed() };
            // SAFETY: a local mutex nobody else sees, initialised, read
            // and destroyed (never locked) in turn.
            unsafe {
                super::init_mutex(&mut m);
                let w = words(&m);
                libc::pthread_mutex_destroy(&mut m);
                w
            }
        })
    }

    /// See [`super::check_mutex`].
    ///
    /// # Safety
    /// `m` points to mapped memory the size of a mutex.
    pub(super) unsafe fn check(m: *const libc::pthread_mutex_t) -> Result<(), String> {
        // SAFETY: the caller's promise.
        let (w, f) = (unsafe { words(m) }, fresh());
        if (w[KIND], w[SPINS]) != (f[KIND], f[SPINS]) {
            return Err(format!(
                "is not a mutex of ours (kind and spin words {:#x} {:#x}, not {:#x} {:#x})",
                w[KIND], w[SPINS], f[KIND], f[SPINS]
            ));
        }
        if w[LOCK] & TID_MASK > TID_MAX {
            return Err(format!(
                "names no thread (lock word {:#010x}): it was overwritten",
                w[LOCK]
            ));
        }
        let owner = w[OWNER];
        if owner > TID_MAX && owner != INCONSISTENT && owner != NOT_RECOVERABLE {
            return Err(format!(
                "names no owner (owner word {owner:#010x}): it was overwritten"
            ));
        }
        Ok(())
    }

    /// The thread id in the lock word of `m` (0 when free).
    ///
    /// # Safety
    /// `m` points to mapped memory the size of a mutex.
    pub(super) unsafe fn holder(m: *const libc::pthread_mutex_t) -> u32 {
        // SAFETY: the caller's promise.
        (unsafe { words(m) })[LOCK] & TID_MASK
    }
}

/// The thread id the lock word of `m` names as its holder, where known
/// (0 when free or unknown), for messages.
///
/// # Safety
/// `m` points to mapped memory the size of a mutex.
pub(super) unsafe fn holder_tid(m: *const libc::pthread_mutex_t) -> u32 {
    #[cfg(all(target_os = "linux", target_env = "gnu", target_pointer_width = "64"))]
    {
        // SAFETY: the caller's promise.
        unsafe { glibc::holder(m) }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu", target_pointer_width = "64")))]
    {
        let _ = m;
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A heap mutex with the table's attributes.
    fn mutex() -> Box<libc::pthread_mutex_t> {
        // SAFETY: plain data, initialised at once.
        let mut m = Box::new(unsafe { std::mem::zeroed::<libc::pthread_mutex_t>() });
        // SAFETY: our own, unshared.
        assert_eq!(unsafe { init_mutex(&mut *m) }, 0);
        m
    }

    fn words(m: &mut libc::pthread_mutex_t) -> &mut [u32; 10] {
        // SAFETY: pthread_mutex_t is 40 bytes, 8-aligned, on 64-bit glibc.
        unsafe { &mut *(m as *mut libc::pthread_mutex_t).cast::<[u32; 10]>() }
    }

    #[test]
    fn the_bound_comes_from_the_timeout() {
        assert_eq!(lock_wait(0), DEFAULT_LOCK_WAIT);
        assert_eq!(lock_wait(30_000), Duration::from_secs(15));
        assert_eq!(lock_wait(100), MIN_LOCK_WAIT);
    }

    #[test]
    fn a_held_lock_times_out_within_its_bound() {
        let mut m = mutex();
        // SAFETY: our own mutex, alive for the whole test.
        unsafe {
            assert_eq!(timed_lock(&mut *m, Duration::from_millis(10)), 0);
            let start = Instant::now();
            let rc = timed_lock(&mut *m, Duration::from_millis(300));
            assert_eq!(rc, libc::ETIMEDOUT);
            assert!(start.elapsed() >= Duration::from_millis(300));
            libc::pthread_mutex_unlock(&mut *m);
            assert_eq!(timed_lock(&mut *m, Duration::from_millis(10)), 0);
            libc::pthread_mutex_unlock(&mut *m);
        }
    }

    #[cfg(all(target_os = "linux", target_env = "gnu", target_pointer_width = "64"))]
    #[test]
    fn a_mutex_in_use_passes_and_overwritten_words_do_not() {
        let mut m = mutex();
        let check = |m: &libc::pthread_mutex_t| {
            // SAFETY: a live mutex of our own.
            unsafe { check_mutex(m) }
        };
        assert_eq!(check(&m), Ok(()));
        // The kind word carries the attributes: it is where the check looks.
        // SAFETY: plain data, then a default mutex of our own, never locked.
        let mut plain: libc::pthread_mutex_t = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        unsafe { libc::pthread_mutex_init(&mut plain, std::ptr::null()) };
        assert_ne!(words(&mut plain)[4], words(&mut m)[4]);
        // SAFETY: our own mutex, locked and unlocked by this thread.
        unsafe { assert_eq!(timed_lock(&mut *m, Duration::from_millis(10)), 0) };
        assert_eq!(check(&m), Ok(()), "held");
        // SAFETY: gettid has no preconditions; `m` is our own mutex.
        let (tid, holder) = unsafe { (libc::gettid() as u32, holder_tid(&*m)) };
        assert_eq!(holder, tid);
        // SAFETY: we hold it.
        unsafe { libc::pthread_mutex_unlock(&mut *m) };
        assert_eq!(check(&m), Ok(()), "released");
        for (word, value) in [(4, 0x1234), (5, 7), (0, 0x1fff_ffff), (2, 0x4000_0000)] {
            let mut bad = mutex();
            words(&mut bad)[word] = value;
            assert!(check(&bad).is_err(), "word {word}");
        }
    }
}
