//! The memory a cache lives in: one anonymous mapping (private mode) or one
//! POSIX shared-memory object mapped by every participant (shared mode).
//!
//! Both are plain `mmap`s, so the rest of the cache sees one byte range
//! either way. Anonymous mappings use `MAP_NORESERVE`: the data area is
//! committed page by page as slots are first written, so a large
//! `cache_buffer_capacity_gb` costs nothing until it is used. A shared
//! object's pages are reserved in `/dev/shm` when it is created
//! ([`ShmObject::create`]): a page it could not get when first written
//! would be a SIGBUS.

use std::ffi::CString;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;

use crate::error::{Result, UcmError};

/// One `mmap`ed byte range, unmapped on drop.
pub struct Mapping {
    base: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value; concurrent access
// to its contents is coordinated by the cache table's lock and slot states.
unsafe impl Send for Mapping {}
// SAFETY: as above; `&Mapping` only hands out the base address.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Private, zero-filled, lazily committed memory.
    pub fn anon(len: usize) -> Result<Self> {
        // SAFETY: a fresh anonymous mapping touches no existing memory.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        let m = Self::from_raw(p, len, "mmap anonymous")?;
        // Small pages, so the start-up commit (`prefault`) works in short
        // calls that a load arriving meanwhile waits for only briefly: one
        // huge-page fault can hold a CPU for 0.3 s where the hypervisor backs
        // guest memory only as it is first touched. Copies through small
        // pages measured within 2 % of huge pages. Only a hint.
        // SAFETY: the range is exactly the mapping just created.
        unsafe { libc::madvise(m.base().cast(), len, libc::MADV_NOHUGEPAGE) };
        Ok(m)
    }

    /// `len` bytes of the shared-memory object `fd`, shared with every
    /// process that maps it.
    pub fn shared(fd: RawFd, len: usize) -> Result<Self> {
        // SAFETY: maps a file descriptor we own; no existing memory touched.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        Self::from_raw(p, len, "mmap shared")
    }

    fn from_raw(p: *mut libc::c_void, len: usize, op: &'static str) -> Result<Self> {
        if p == libc::MAP_FAILED {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENOMEM) {
                return Err(UcmError::OutOfMemory(format!("{op} of {len} bytes: {e}")));
            }
            return Err(UcmError::os(op, "", e));
        }
        NonNull::new(p.cast::<u8>())
            .map(|base| Mapping { base, len })
            .ok_or_else(|| UcmError::OutOfMemory(format!("{op} returned null")))
    }

    /// Start of the mapping (page-aligned).
    pub fn base(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for an empty mapping (never built).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the range this value mapped; nothing can
        // use it afterwards (the owner is being dropped).
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
}

/// A named POSIX shared-memory object (`/dev/shm/<name>`).
pub struct ShmObject {
    /// The name passed to `shm_open` (with its leading `/`).
    pub name: CString,
    /// Where it shows up in the file system, for messages.
    pub path: String,
}

impl ShmObject {
    /// The object for `unique_id`; only `[A-Za-z0-9_.-]` is kept so an id
    /// can never name a path outside `/dev/shm`.
    pub fn for_id(unique_id: &str) -> Result<Self> {
        let clean: String = unique_id
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || "_.-".contains(c) {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        if clean.is_empty() {
            return Err(UcmError::invalid(
                "unique_id: must be non-empty when share_buffer_enable is set",
            ));
        }
        let base = format!("ucm_cache_{clean}");
        let name = CString::new(format!("/{base}"))
            .map_err(|_| UcmError::invalid("unique_id: contains a NUL byte"))?;
        Ok(ShmObject {
            name,
            path: format!("/dev/shm/{base}"),
        })
    }

    /// Creates the object exclusively with `len` bytes, all of them
    /// reserved (`Self::reserve`); `None` if it already exists.
    pub fn create(&self, len: usize) -> Result<Option<OwnedFd>> {
        // SAFETY: `name` is a valid C string for the call.
        let fd = unsafe {
            libc::shm_open(
                self.name.as_ptr(),
                libc::O_CREAT | libc::O_EXCL | libc::O_RDWR | libc::O_CLOEXEC,
                0o600,
            )
        };
        if fd < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EEXIST) {
                return Ok(None);
            }
            return Err(UcmError::os("shm_open", &self.path, e));
        }
        // SAFETY: `fd` was just returned by shm_open and is owned by no one else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: plain syscall on our descriptor.
        if unsafe { libc::ftruncate(std::os::fd::AsRawFd::as_raw_fd(&fd), len as libc::off_t) } != 0
        {
            let e = std::io::Error::last_os_error();
            self.unlink();
            return Err(UcmError::os("ftruncate", &self.path, e));
        }
        let raw = std::os::fd::AsRawFd::as_raw_fd(&fd);
        if let Err(e) = self.reserve(raw) {
            self.unlink();
            return Err(e);
        }
        Ok(Some(fd))
    }

    /// Opens the existing object; `None` if it does not exist (any more).
    pub fn open(&self) -> Result<Option<OwnedFd>> {
        // SAFETY: `name` is a valid C string for the call.
        let fd = unsafe { libc::shm_open(self.name.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC, 0) };
        if fd < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENOENT) {
                return Ok(None);
            }
            return Err(UcmError::os("shm_open", &self.path, e));
        }
        // SAFETY: as in `create`.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let raw = std::os::fd::AsRawFd::as_raw_fd(&fd);
        let st = fstat(raw, &self.path)?;
        self.check_private(&st)?;
        Ok(Some(fd))
    }

    /// Reserves what is not yet reserved of a segment another process
    /// created (`fd`, whose layout is ours): one we created is reserved
    /// whole, but a segment is checked again rather than trusted.
    pub fn reserve_rest(&self, fd: RawFd) -> Result<()> {
        if unreserved(&fstat(fd, &self.path)?) > 0 {
            self.reserve(fd)?;
        }
        Ok(())
    }

    /// Reserves every page of the segment (`fd`, sized already) in its
    /// file system (`fallocate`), or refuses it, naming the figures, when
    /// the file system cannot hold it. A segment is otherwise sparse: a
    /// page is taken from `/dev/shm` when first written, and a write that
    /// finds it full is a SIGBUS, which kills the process long after
    /// start-up, whoever filled it (kept segments of other deployments,
    /// any program). Reserved pages are allocated but not zeroed until
    /// first touched. A file system that cannot reserve has its free
    /// space checked instead, which catches the state the host is in at
    /// start-up only.
    fn reserve(&self, fd: RawFd) -> Result<()> {
        let st = fstat(fd, &self.path)?;
        let needed = unreserved(&st);
        loop {
            // SAFETY: plain syscall on a descriptor the caller owns.
            if unsafe { libc::fallocate(fd, 0, 0, st.st_size) } == 0 {
                return Ok(());
            }
            let e = std::io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) => continue,
                Some(libc::EOPNOTSUPP | libc::ENOSYS) => {
                    let free = self.free_bytes(fd)?;
                    return if needed > free {
                        Err(self.no_room(needed, free))
                    } else {
                        Ok(())
                    };
                }
                Some(libc::ENOSPC | libc::EFBIG | libc::EDQUOT) => {
                    return Err(self.no_room(needed, self.free_bytes(fd)?));
                }
                _ => return Err(UcmError::os("fallocate", &self.path, e)),
            }
        }
    }

    /// Bytes free (for unprivileged users) in the segment's file system.
    fn free_bytes(&self, fd: RawFd) -> Result<u64> {
        // SAFETY: plain data, for which all zeroes is a valid value.
        let mut fs: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: `fd` is a valid descriptor the caller owns; `fs` is a
        // valid out-pointer for the call.
        if unsafe { libc::fstatvfs(fd, &mut fs) } != 0 {
            return Err(UcmError::os(
                "fstatvfs",
                &self.path,
                std::io::Error::last_os_error(),
            ));
        }
        Ok((fs.f_bavail as u64).saturating_mul(fs.f_frsize as u64))
    }

    /// The refusal of a segment that needs `needed` more bytes of a file
    /// system with `free` bytes free.
    fn no_room(&self, needed: u64, free: u64) -> UcmError {
        const MIB: u64 = 1 << 20;
        UcmError::NoSpace(format!(
            "shared cache segment {} needs {} MiB more of its file system, which has {} MiB \
             free: its memory is reserved at start-up so that a full /dev/shm can never crash \
             the process (SIGBUS) later; remove segments no process uses (ls -l \
             /dev/shm/ucm_cache_*) or lower cache_buffer_capacity_gb",
            self.path,
            needed.div_ceil(MIB),
            free / MIB
        ))
    }

    /// Refuses an object another user owns or may open: `/dev/shm` is
    /// writable by everyone, so anyone could create the name first and
    /// have us serve (or overwrite) bytes they control.
    fn check_private(&self, st: &libc::stat) -> Result<()> {
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        if st.st_uid != me {
            return Err(UcmError::InvalidParam(format!(
                "shared cache segment {} belongs to uid {}, not to this process's user (uid \
                 {me}); refusing memory another user controls",
                self.path, st.st_uid
            )));
        }
        if st.st_mode & 0o077 != 0 {
            return Err(UcmError::InvalidParam(format!(
                "shared cache segment {} may be opened by other users (mode {:o}); refusing \
                 it: remove it (rm {}) if no process uses it",
                self.path,
                st.st_mode & 0o777,
                self.path
            )));
        }
        Ok(())
    }

    /// Removes the name (mappings stay valid until unmapped).
    pub fn unlink(&self) {
        // SAFETY: `name` is a valid C string for the call.
        unsafe { libc::shm_unlink(self.name.as_ptr()) };
    }

    /// Removes the name if it still names the object open as `fd`: two
    /// processes that both found the object unusable must not have the
    /// later one remove the replacement the earlier one just made. (Only
    /// a much narrower race remains: both checking before either
    /// unlinks.)
    pub fn unlink_if_same(&self, fd: RawFd) {
        let Ok(ours) = fstat(fd, &self.path) else {
            return;
        };
        let named = match std::fs::metadata(&self.path) {
            Ok(m) => m,
            Err(_) => return, // gone already
        };
        use std::os::unix::fs::MetadataExt;
        if named.dev() == ours.st_dev && named.ino() == ours.st_ino {
            self.unlink();
        }
    }
}

/// Bytes of the pages spanning `[addr, addr + len)` that are backed by
/// memory right now (`mincore`). Reads only the page tables: a range that
/// is not mapped is an error, never a memory access.
pub fn resident_bytes(addr: *const u8, len: usize) -> Result<usize> {
    Ok(resident_runs(addr, len)?.iter().map(|r| r.1).sum())
}

/// The runs `(offset from the first page, length)` of pages spanning
/// `[addr, addr + len)` that are backed by memory (`mincore`). For a shared
/// segment that counts pages another process wrote, mapped here or not.
pub fn resident_runs(addr: *const u8, len: usize) -> Result<Vec<(usize, usize)>> {
    let page = 4096usize;
    let start = addr as usize & !(page - 1);
    let span = addr as usize + len - start;
    let mut vec = vec![0u8; span.div_ceil(page)];
    // SAFETY: mincore writes one byte per page of the range into `vec`,
    // which is that long, and touches no other memory.
    let rc = unsafe { libc::mincore(start as *mut libc::c_void, span, vec.as_mut_ptr()) };
    if rc != 0 {
        return Err(UcmError::os(
            "mincore",
            "cache memory",
            std::io::Error::last_os_error(),
        ));
    }
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for (i, b) in vec.iter().enumerate() {
        if b & 1 == 0 {
            continue;
        }
        match runs.last_mut() {
            Some((off, n)) if *off + *n == i * page => *n += page,
            _ => runs.push((i * page, page)),
        }
    }
    Ok(runs)
}

/// Bytes of a file (`st`, its `fstat`) not yet backed by its file system.
fn unreserved(st: &libc::stat) -> u64 {
    let allocated = (st.st_blocks as u64).saturating_mul(512);
    (st.st_size as u64).saturating_sub(allocated)
}

/// Size of the object behind `fd`.
pub fn fd_size(fd: RawFd) -> Result<usize> {
    Ok(fstat(fd, "")?.st_size as usize)
}

/// `fstat` of `fd`; `path` names it in the error.
fn fstat(fd: RawFd, path: &str) -> Result<libc::stat> {
    // SAFETY: `st` is plain data fully written by fstat on success.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid descriptor and out-pointer.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Err(UcmError::os("fstat", path, std::io::Error::last_os_error()));
    }
    Ok(st)
}

/// Start time of process `pid` (clock ticks since boot, field 22 of
/// `/proc/<pid>/stat`), which tells a live process from a recycled pid.
pub fn process_start(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may contain spaces and parentheses: the
    // fields we want follow its last ')'.
    // A zombie (killed, not yet reaped by its parent) holds nothing.
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    if matches!(fields.next()?, "Z" | "X" | "x") {
        return None;
    }
    fields.nth(18)?.parse().ok()
}

/// True when `pid` is alive and is the process that started at `start`.
pub fn process_alive(pid: i32, start: u64) -> bool {
    if pid <= 0 {
        return false;
    }
    match process_start(pid) {
        Some(s) => s == start,
        None => false,
    }
}

/// The `field` line (in kB) of the mapping starting at `base`, from
/// `/proc/self/smaps`: the first such line after the mapping's header is
/// its own.
#[cfg(test)]
pub(crate) fn smaps_kib(base: *mut u8, field: &str) -> Option<u64> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    let start = format!("{:x}-", base as usize);
    let prefix = format!("{field}:");
    smaps
        .lines()
        .skip_while(|l| !l.starts_with(&start))
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `AnonHugePages` of the mapping starting at `base`, from smaps.
    fn anon_huge_kib(base: *mut u8) -> Option<u64> {
        smaps_kib(base, "AnonHugePages")
    }

    #[test]
    fn the_private_area_is_committed_in_small_pages() {
        let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .unwrap_or_default();
        if thp.is_empty() || thp.contains("[never]") {
            eprintln!("skipped: transparent huge pages are off here");
            return;
        }
        let len = 16 << 20;
        let m = Mapping::anon(len).unwrap();
        // SAFETY: the whole range is the writable mapping just created.
        unsafe { std::ptr::write_bytes(m.base(), 1, len) };
        assert_eq!(
            anon_huge_kib(m.base()),
            Some(0),
            "huge pages back the cache area"
        );
    }
}
