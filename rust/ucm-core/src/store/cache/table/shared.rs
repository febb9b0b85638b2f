//! Joining and leaving a shared segment, and who takes part in it.
//!
//! The creator initialises the segment and publishes it (magic last). An
//! attacher waits for that, checks that the layout is its own and
//! registers; a segment whose creator died while initialising it, or whose
//! other layout no live process uses, is unlinked and the join starts
//! over. So is one whose lock can't be trusted (its bytes are not a mutex
//! of ours, or it is not free within the lock's bound) when no live
//! process uses it, read without the lock, which is racy but only decides
//! whether to replace it; while one does, the open fails naming them. The last participant to leave removes the segment unless dirty
//! data is still waiting for the backend, or the segment is kept
//! (`share_buffer_keep`) for a process that starts later. Dead participants are reaped
//! (their pins dropped, their half-filled slots freed, their dirty slots
//! orphaned) whenever a participant registers or finds the lock's last
//! holder dead.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::lock::{pid_list, LockFailure};
use super::{
    Geometry, Guard, Header, Participant, SharedHdr, Table, FILLING, INIT_WAIT, MAGIC, MAX_PARTS,
    NONE, READY, VERSION,
};
use crate::error::{Result, UcmError};
use crate::store::cache::region::{fd_size, process_alive, process_start, Mapping, ShmObject};

/// Why [`Table::shared`] gave up on an existing segment and starts over.
enum Retry {
    Again,
}

/// One try at joining: `Ok(Err(Retry::Again))` when the segment went away
/// or was unlinked to be replaced.
type Attempt<T> = Result<std::result::Result<T, Retry>>;

impl Table {
    /// Creates the shared segment for `unique_id`, or attaches to it;
    /// `keep` leaves it in place when the last participant leaves; every
    /// lock waits at most `lock_wait`.
    pub fn shared(unique_id: &str, geo: Geometry, keep: bool, lock_wait: Duration) -> Result<Self> {
        let shm = ShmObject::for_id(unique_id)?;
        for _ in 0..50 {
            match Self::try_shared(&shm, &geo, lock_wait)? {
                Ok(mut t) => {
                    t.keep = keep;
                    return Ok(t);
                }
                Err(Retry::Again) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
        Err(UcmError::TaskFailed(format!(
            "could not attach to shared cache segment {}: it keeps being replaced",
            shm.path
        )))
    }

    fn try_shared(shm: &ShmObject, geo: &Geometry, lock_wait: Duration) -> Attempt<Self> {
        if let Some(fd) = shm.create(geo.total_len)? {
            return Self::create_shared(shm, geo, &fd, lock_wait).map(Ok);
        }
        let Some(fd) = shm.open()? else {
            return Ok(Err(Retry::Again));
        };
        Self::attach(shm, geo, &fd, lock_wait)
    }

    /// The segment `fd` (of `shm`) mapped, `len` bytes; not yet joined.
    fn mapped(
        shm: &ShmObject,
        geo: &Geometry,
        fd: RawFd,
        len: usize,
        lock_wait: Duration,
    ) -> Result<Self> {
        let map = Mapping::shared(fd, len)?;
        let shm = ShmObject {
            name: shm.name.clone(),
            path: shm.path.clone(),
        };
        Ok(Table::in_map(map, geo.clone(), Some(shm), lock_wait))
    }

    /// Initialises the segment we just created and joins it.
    fn create_shared(
        shm: &ShmObject,
        geo: &Geometry,
        fd: &OwnedFd,
        lock_wait: Duration,
    ) -> Result<Self> {
        let mut t = Self::mapped(shm, geo, fd.as_raw_fd(), geo.total_len, lock_wait)?;
        t.initialise(std::process::id() as i32)?;
        let me = {
            let mut g = t.lock()?;
            g.register()?
        };
        t.me = me;
        log::info!(
            "created shared cache segment {} ({} slots, {} bytes)",
            shm.path,
            geo.n_slots,
            geo.total_len
        );
        Ok(t)
    }

    /// Joins a segment another process created, once it is initialised
    /// and if it has our layout.
    fn attach(shm: &ShmObject, geo: &Geometry, fd: &OwnedFd, lock_wait: Duration) -> Attempt<Self> {
        let raw = fd.as_raw_fd();
        let started = Instant::now();
        let Some(size) = wait_sized(shm, raw, started)? else {
            return Ok(Err(Retry::Again));
        };
        let mut t = Self::mapped(shm, geo, raw, size, lock_wait)?;
        if size < std::mem::size_of::<Header>() + std::mem::size_of::<SharedHdr>() + 64 {
            return Err(layout_error(&shm.path, "is too small to be a UCM cache"));
        }
        if !t.wait_initialised(shm, started) {
            return Ok(Err(Retry::Again));
        }
        if let Err(retry) = t.check_layout(shm, geo, size, raw)? {
            return Ok(Err(retry));
        }
        shm.reserve_rest(raw)?;
        t.join(shm, raw)
    }

    /// Waits for the creator to publish the segment (its magic); false,
    /// with the segment unlinked, when the creator died first or took too
    /// long.
    fn wait_initialised(&self, shm: &ShmObject, started: Instant) -> bool {
        loop {
            if self.header().magic.load(Ordering::Acquire) == MAGIC {
                return true;
            }
            let creator = self.header().init_pid.load(Ordering::Acquire);
            let creator_gone = creator > 0 && process_start(creator).is_none();
            if creator_gone || started.elapsed() > INIT_WAIT {
                log::warn!(
                    "shared cache segment {}: its creator (pid {creator}) died while \
                     initialising it; replacing it",
                    shm.path
                );
                shm.unlink();
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Checks that the segment (`size` bytes, open as `fd`) has our
    /// layout. One of another layout is an error while anyone uses it, and
    /// is unlinked to be replaced once nobody does.
    fn check_layout(
        &mut self,
        shm: &ShmObject,
        geo: &Geometry,
        size: usize,
        fd: RawFd,
    ) -> Attempt<()> {
        let h = self.header();
        let same = h.version == VERSION
            && h.fingerprint == geo.fingerprint
            && h.total_len as usize == geo.total_len
            && size == geo.total_len;
        if same {
            return Ok(Ok(()));
        }
        if h.version == VERSION {
            // Same header format: we can tell whether anyone still uses it.
            let locked = self.lock_header_only().map(|g| g.live_participants());
            let live = match locked {
                Ok(live) => live,
                Err(f) => return self.untrusted(shm, fd, &f),
            };
            if live == 0 {
                log::warn!(
                    "shared cache segment {} has another layout and no live user; replacing it",
                    shm.path
                );
                shm.unlink();
                self.shm = None;
                return Ok(Err(Retry::Again));
            }
        }
        Err(layout_error(
            &shm.path,
            &format!(
                "was created with another layout (version {}, fingerprint {:#x}, {} bytes) \
                 than this process's config (version {VERSION}, fingerprint {:#x}, {} bytes): \
                 every participant must use the same block_size, shard_size, \
                 cache_buffer_capacity_gb and eviction_policy",
                h.version, h.fingerprint, size, geo.fingerprint, geo.total_len
            ),
        ))
    }

    /// Checks the table (see `check`) and registers as a participant,
    /// unless the last one left and unlinked the segment meanwhile.
    fn join(mut self, shm: &ShmObject, fd: RawFd) -> Attempt<Self> {
        let joined = match self.try_lock() {
            Ok(mut g) => {
                let found = g.check_and_rebuild();
                let me = if g.shared.unlinked != 0 {
                    None
                } else {
                    Some(g.register()?)
                };
                Ok((me, found))
            }
            Err(f) => Err(f),
        };
        let (me, found) = match joined {
            Ok(joined) => joined,
            Err(f) => return self.untrusted(shm, fd, &f),
        };
        if found.any() {
            log::warn!(
                "shared cache segment {}: its slot table was damaged; discarded {} slot(s) with \
                 invalid metadata (their bytes are never served) and rebuilt the index",
                shm.path,
                found.discarded
            );
            self.discarded_at_join = found.discarded;
        }
        match me {
            Some(me) => {
                self.me = me;
                log::info!(
                    "attached to shared cache segment {} as participant {me}",
                    shm.path
                );
                Ok(Ok(self))
            }
            None => {
                self.shm = None;
                Ok(Err(Retry::Again))
            }
        }
    }

    /// A segment whose lock could not be taken at open (`f`, not an OS
    /// error): unlinked to be replaced when no live process uses it (read
    /// without the lock: racy, but it only decides this), with one warning;
    /// otherwise an error naming the segment, those processes and what to
    /// do.
    fn untrusted<T>(&mut self, shm: &ShmObject, fd: RawFd, f: &LockFailure) -> Attempt<T> {
        let path = &shm.path;
        let why = match f {
            LockFailure::Os(e) => {
                return Err(UcmError::os(
                    "pthread_mutex_timedlock",
                    path,
                    std::io::Error::from_raw_os_error(*e),
                ))
            }
            LockFailure::Timeout => format!(
                "was not free within {:?}{}",
                self.lock_wait,
                self.holder_note()
            ),
            LockFailure::Garbage(why) => why.clone(),
        };
        let live = self.live_pids_unlocked();
        if live.is_empty() {
            log::warn!(
                "shared cache segment {path}: its lock {why}, and no live process uses it; \
                 replacing it with a fresh one (what it held is dropped)"
            );
            shm.unlink_if_same(fd);
            self.shm = None;
            return Ok(Err(Retry::Again));
        }
        let pids = pid_list(&live);
        Err(match f {
            LockFailure::Timeout => UcmError::Timeout(format!(
                "shared cache segment {path}: its lock {why}, and process(es) {pids} use the \
                 segment: one of them holds the lock without letting go (stuck or stopped). \
                 Stop them, or once none of them runs, remove the segment (rm {path})"
            )),
            _ => UcmError::InvalidParam(format!(
                "shared cache segment {path}: its lock {why}, and process(es) {pids} use the \
                 segment. Stop them and remove the segment (rm {path})"
            )),
        })
    }

    /// Pids of the segment's live participants, read without the lock:
    /// for decisions that only replace a segment nobody uses, and for
    /// messages.
    pub(super) fn live_pids_unlocked(&self) -> Vec<i32> {
        // SAFETY: SharedHdr sits at a fixed offset for a given VERSION,
        // inside every mapping that got this far (its size was checked).
        let parts = unsafe {
            std::ptr::addr_of!(
                (*(self.map.base().add(self.geo.off_shared) as *const SharedHdr)).parts
            )
        };
        (0..MAX_PARTS)
            .filter_map(|i| {
                // SAFETY: `i` is inside the array. Other processes may
                // write it meanwhile: volatile reads of plain integers,
                // where a torn value at worst names a wrong process.
                let p = unsafe { parts.cast::<Participant>().add(i).read_volatile() };
                (p.pid != 0 && process_alive(p.pid, p.start)).then_some(p.pid)
            })
            .collect()
    }

    /// Locks a segment whose geometry may differ from ours: only the header
    /// and participant list may be looked at.
    fn lock_header_only(&self) -> std::result::Result<HeaderGuard<'_>, LockFailure> {
        self.try_raw_lock()?;
        // SAFETY: we hold the mutex; SharedHdr sits at a fixed offset for a
        // given VERSION, independent of the geometry.
        let shared = unsafe { &mut *(self.map.base().add(self.geo.off_shared) as *mut SharedHdr) };
        Ok(HeaderGuard {
            shared,
            mutex: self.mutex(),
        })
    }

    /// Leaves a shared segment: drops our pins, orphans our dirty slots
    /// (a live participant adopts them) and, if we were the last live
    /// participant, nothing is dirty and the segment is not kept, removes
    /// it. Idempotent; a no-op in private mode.
    pub fn detach(&self) {
        if self.detached.swap(true, Ordering::AcqRel) {
            return;
        }
        let Some(shm) = self.shm.as_ref() else {
            return;
        };
        if self.me == NONE {
            return;
        }
        let mut g = match self.lock() {
            Ok(g) => g,
            Err(e) => {
                log::warn!(
                    "could not leave shared cache segment {} ({e}): the others drop this \
                     process's pins and adopt its dirty slots once it has exited",
                    shm.path
                );
                return;
            }
        };
        let dirty = g.leave();
        let live = g.live_participants();
        if live == 0 && dirty == 0 && self.keep {
            log::info!(
                "last participant left; kept shared cache segment {} for the next process \
                 (share_buffer_keep)",
                shm.path
            );
        } else if live == 0 && dirty == 0 {
            g.shared.unlinked = 1;
            shm.unlink();
            log::info!(
                "last participant left; removed shared cache segment {}",
                shm.path
            );
        } else if live == 0 {
            log::warn!(
                "last participant left shared cache segment {} with {dirty} dirty shard(s) \
                 not in the backend; keeping it so the next process writes them back",
                shm.path
            );
        }
    }
}

/// Waits for the creator to size the segment; `None`, with the segment
/// unlinked, when it never does.
fn wait_sized(shm: &ShmObject, fd: RawFd, started: Instant) -> Result<Option<usize>> {
    let mut size = fd_size(fd)?;
    while size == 0 {
        if started.elapsed() > INIT_WAIT {
            log::warn!(
                "shared cache segment {} was never sized; replacing it",
                shm.path
            );
            shm.unlink();
            return Ok(None);
        }
        std::thread::sleep(Duration::from_millis(1));
        size = fd_size(fd)?;
    }
    Ok(Some(size))
}

impl Drop for Table {
    fn drop(&mut self) {
        self.detach();
    }
}

fn layout_error(path: &str, what: &str) -> UcmError {
    UcmError::invalid(format!(
        "shared cache segment {path} {what}; remove it (rm {path}) if no process uses it"
    ))
}

struct HeaderGuard<'a> {
    shared: &'a mut SharedHdr,
    mutex: *mut libc::pthread_mutex_t,
}

impl HeaderGuard<'_> {
    fn live_participants(&self) -> usize {
        self.shared
            .parts
            .iter()
            .filter(|p| p.pid != 0 && process_alive(p.pid, p.start))
            .count()
    }
}

impl Drop for HeaderGuard<'_> {
    fn drop(&mut self) {
        // SAFETY: we locked it in `lock_header_only`.
        unsafe { libc::pthread_mutex_unlock(self.mutex) };
    }
}

impl Guard<'_> {
    /// Number of participants whose process is alive.
    pub fn live_participants(&self) -> usize {
        self.shared
            .parts
            .iter()
            .filter(|p| p.pid != 0 && process_alive(p.pid, p.start))
            .count()
    }

    pub(super) fn register(&mut self) -> Result<u32> {
        self.reap_dead();
        let pid = std::process::id() as i32;
        let start = process_start(pid).unwrap_or(0);
        let idx = self
            .shared
            .parts
            .iter()
            .position(|p| p.pid == 0)
            .ok_or_else(|| {
                UcmError::invalid(format!(
                    "share_buffer_enable: {MAX_PARTS} processes already share this cache"
                ))
            })?;
        self.shared.parts[idx] = Participant {
            pid,
            _pad: 0,
            start,
        };
        self.me = idx as u32;
        Ok(idx as u32)
    }

    /// Leaves the table: drops our pins and orphans our dirty slots.
    /// Returns the number of dirty slots left in the table.
    fn leave(&mut self) -> usize {
        let me = self.me as usize;
        self.forget_participant(me);
        self.rebuild();
        self.meta
            .iter()
            .filter(|m| m.state == READY && m.dirty != 0)
            .count()
    }

    /// Drops participant `p`'s pins, half-filled slots and dirty-slot
    /// ownership. The free list is left stale: callers rebuild.
    fn forget_participant(&mut self, p: usize) {
        for i in 0..self.meta.len() {
            let m = self.meta[i];
            if m.pins[p] > 0 {
                let mm = &mut self.meta[i];
                mm.refs = mm.refs.saturating_sub(u32::from(mm.pins[p]));
                mm.pins[p] = 0;
            }
            if m.state == FILLING && m.owner == p as u32 {
                // Half-written: nobody may read it.
                self.drop_entry(i as u32);
            } else if m.state == READY && m.dirty != 0 && m.owner == p as u32 {
                self.meta[i].owner = NONE;
            }
        }
        self.shared.parts[p] = Participant {
            pid: 0,
            _pad: 0,
            start: 0,
        };
    }

    /// Forgets participants whose process is gone. Returns how many.
    pub fn reap_dead(&mut self) -> usize {
        let mut n = 0;
        for p in 0..MAX_PARTS {
            let part = self.shared.parts[p];
            if part.pid != 0 && !process_alive(part.pid, part.start) {
                log::warn!(
                    "cache participant {p} (pid {}) died; dropping its pins and fills",
                    part.pid
                );
                self.forget_participant(p);
                n += 1;
            }
        }
        if n > 0 {
            // Rebuilding is O(slots) and makes the free list exact again.
            self.rebuild();
        }
        n
    }
}
