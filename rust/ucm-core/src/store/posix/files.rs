//! Where block files live and how they are opened.
//!
//! Layout under each root:
//!
//! ```text
//! <root>/<2 hex>/<32 hex>            published blocks (the id in lowercase hex)
//! <root>/.work/<token>/lock          held (flock) by the live store instance <token>
//! <root>/.work/<token>/<32 hex>.<n>  a block being written by that instance
//! <root>/.work/<token>/spare.<n>     a spare file (see `spare`)
//! ```
//!
//! The root is picked by the id when there are several. A block is written
//! in its writer's private work directory and renamed to its final name
//! (same file system, so the publish is atomic); readers only ever open
//! final names, so they never see a partial block.
//!
//! The directory is hostile ground: another local user or a second store
//! may have put anything at any of these names. Hence:
//! * every directory below a root is opened one name at a time relative
//!   to an open descriptor, never through a link (`Tree`), and every file
//!   operation names a file relative to its directory's descriptor: a link
//!   at a block or work directory's name can't lead the store outside;
//! * temporaries are created with `O_CREAT|O_EXCL|O_NOFOLLOW` (a planted
//!   file or symlink is never reused or followed), under a random token;
//! * a spare is reopened with `O_NOFOLLOW` and checked with `fstat` (a
//!   regular file of ours with one link) before it is written;
//! * a block file is checked with `lstat`, opened with
//!   `O_NOFOLLOW|O_NONBLOCK` and checked again with `fstat` (a regular file
//!   of the block's exact length) before any read, so a symlink, FIFO,
//!   device, socket or directory at a block's name is an error for that
//!   block at once, never a hang or a read elsewhere;
//! * a work directory's owner is alive exactly while the kernel holds its
//!   `flock`, which works across PID namespaces (containers sharing a
//!   volume), unlike asking whether a pid exists.

use std::ffi::CString;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use rustix::fs::OFlags;

use crate::block::MemSeg;
use crate::error::{Damage, Result, UcmError};
use crate::io::DIRECT_ALIGN;
pub use crate::store::safe_fs::{euid, kind_of, Dir, EntryStat};

/// Directory under each root holding the stores' work directories.
pub const WORK_DIR: &str = ".work";
/// The lock file inside a work directory.
pub const LOCK_FILE: &str = "lock";
/// Marker of the temporary names older versions used inside the block
/// directories (`<32 hex>.tmp.<pid>.<instance>.<seq>`), and of their
/// `.spare` directory; only cleaned up now.
pub const LEGACY_TMP_MARKER: &str = ".tmp.";
/// The spare-file directory of older versions.
pub const LEGACY_SPARE_DIR: &str = ".spare";

/// Alignment O_DIRECT needs on the store's file systems.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DirectAlign {
    /// Alignment of each memory segment's address.
    pub mem: usize,
    /// Alignment of each segment's length (and of offsets).
    pub len: usize,
}

impl DirectAlign {
    /// True when every segment can be handed to O_DIRECT as is.
    pub fn fits(&self, segs: &[MemSeg]) -> bool {
        segs.iter()
            .all(|s| s.addr % self.mem == 0 && s.len % self.len == 0)
    }
}

/// Asks the kernel (statx STATX_DIOALIGN) what O_DIRECT alignment `dir`
/// needs; falls back to 4 KiB, the safe value, when it can't tell.
pub fn direct_align(dir: &Path) -> DirectAlign {
    let fallback = DirectAlign {
        mem: DIRECT_ALIGN,
        len: DIRECT_ALIGN,
    };
    let Ok(c) = CString::new(dir.as_os_str().as_encoded_bytes()) else {
        return fallback;
    };
    // SAFETY: statx is plain old data; zeroed is a valid value.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is NUL-terminated and `stx` is a valid out-pointer.
    let rc = unsafe {
        libc::statx(
            libc::AT_FDCWD,
            c.as_ptr(),
            0,
            libc::STATX_DIOALIGN,
            &mut stx,
        )
    };
    if rc != 0 || stx.stx_mask & libc::STATX_DIOALIGN == 0 || stx.stx_dio_offset_align == 0 {
        return fallback;
    }
    let clamp = |v: u32| (v as usize).clamp(1, DIRECT_ALIGN).next_power_of_two();
    DirectAlign {
        mem: clamp(stx.stx_dio_mem_align),
        len: clamp(stx.stx_dio_offset_align),
    }
}

/// A random token naming one store instance's work directories: unique
/// across processes, hosts and PID namespaces sharing the directory.
pub fn random_token() -> String {
    let mut b = [0u8; 8];
    // SAFETY: `b` is a valid, writable buffer of the length passed.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n != b.len() as isize {
        // getrandom can't fail for 8 bytes after boot; mix what else is
        // unique to this instance rather than give up.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        b = (t ^ (u64::from(std::process::id()) << 32) ^ (&b as *const _ as u64)).to_le_bytes();
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Creates `dir` (if missing) with mode 0700.
pub fn make_private_dir(dir: &Path) -> Result<()> {
    match std::fs::create_dir(dir) {
        Ok(()) => std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| UcmError::os("chmod", dir, e)),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(UcmError::os("mkdir", dir, e)),
    }
}

/// Removes `name` in `dir`, something other than a block file found at a
/// block's name (`st`, from `lstat`): a directory only when empty, a link
/// itself, never its target. Says what it removed or had to leave.
pub fn remove_non_block(dir: &Dir, name: &std::ffi::OsStr, st: &EntryStat) -> std::io::Result<()> {
    let removed = if st.is_dir() {
        dir.remove_dir(name)
    } else {
        dir.remove_file(name)
    };
    let path = dir.join(name);
    match &removed {
        Ok(()) => log::warn!(
            "removed {} from the store: it is {}, not a block file",
            path.display(),
            st.describe()
        ),
        Err(e) => log::warn!(
            "left {} in the store ({}, never served as a block): {e}",
            path.display(),
            st.describe()
        ),
    }
    removed
}

/// Opens block files, with O_DIRECT when asked and supported.
pub struct Opener {
    direct: AtomicBool,
    /// Only files owned by this process's uid are block files (`posix_strict`).
    own_files_only: bool,
}

/// An open block file and whether it was opened with O_DIRECT.
pub struct OpenFile {
    /// The file.
    pub file: File,
    /// O_DIRECT is in effect.
    pub direct: bool,
}

impl Opener {
    /// `direct` requests O_DIRECT; `own_files_only` refuses block files
    /// other users own.
    pub fn new(direct: bool, own_files_only: bool) -> Self {
        Opener {
            direct: AtomicBool::new(direct),
            own_files_only,
        }
    }

    /// Runs `open` with O_DIRECT when in effect, falling back to buffered
    /// I/O once for all when the file system refuses O_DIRECT.
    fn open(
        &self,
        dir: &Dir,
        name: &str,
        open: impl Fn(OFlags) -> std::io::Result<File>,
    ) -> std::io::Result<OpenFile> {
        let direct = self.direct.load(Ordering::Relaxed);
        let flags = if direct {
            OFlags::DIRECT
        } else {
            OFlags::empty()
        };
        match open(flags) {
            Ok(file) => Ok(OpenFile { file, direct }),
            Err(e) if direct && e.raw_os_error() == Some(libc::EINVAL) => {
                // Some FUSE and network file systems refuse O_DIRECT.
                if self.direct.swap(false, Ordering::Relaxed) {
                    log::warn!(
                        "O_DIRECT is not supported under {}; continuing with buffered I/O",
                        dir.join(name).display()
                    );
                }
                open(OFlags::empty()).map(|file| OpenFile {
                    file,
                    direct: false,
                })
            }
            Err(e) => Err(e),
        }
    }

    /// Opens the published block `name` of `len` bytes in `dir` for
    /// reading. Anything there but a regular file of exactly that length
    /// (of ours, in strict mode) is [`UcmError::Corrupt`], found before any
    /// byte is read; a missing file is [`UcmError::NotFound`].
    pub fn read(&self, dir: &Dir, name: &str, len: u64) -> Result<OpenFile> {
        let path = || dir.join(name);
        // Not even opened unless it looks like a block: opening a device
        // can have side effects, and a FIFO would block.
        let st = dir
            .lstat(name)
            .map_err(|e| UcmError::os("stat", path(), e))?;
        self.check_block(&path(), &st, len)?;
        let open = self
            .open(dir, name, |flags| {
                dir.open_file(name, OFlags::RDONLY | flags)
            })
            .map_err(|e| match e.raw_os_error() {
                Some(libc::ELOOP) => foreign(&path(), "a symbolic link"),
                _ => UcmError::os("open", path(), e),
            })?;
        // Swapped between the lstat and the open?
        let meta = open
            .file
            .metadata()
            .map_err(|e| UcmError::os("fstat", path(), e))?;
        let st = EntryStat {
            kind: if meta.file_type().is_file() {
                rustix::fs::FileType::RegularFile
            } else {
                rustix::fs::FileType::from_raw_mode(meta.mode() as _)
            },
            len: meta.len(),
            mtime_ns: 0,
            uid: meta.uid(),
            nlink: meta.nlink(),
            ino: meta.ino(),
            dev: meta.dev(),
        };
        self.check_block(&path(), &st, len)?;
        Ok(open)
    }

    fn check_block(&self, path: &Path, st: &EntryStat, len: u64) -> Result<()> {
        if !st.is_file() {
            return Err(foreign(path, st.describe()));
        }
        if self.own_files_only && st.uid != euid() {
            return Err(foreign(
                path,
                &format!(
                    "a file of uid {} (posix_strict accepts only files of uid {})",
                    st.uid,
                    euid()
                ),
            ));
        }
        if st.len != len {
            let (damage, what) = if st.len < len {
                (Damage::Truncated, "file is truncated")
            } else {
                (Damage::NotBlockFile, "file is longer than a block")
            };
            return Err(UcmError::corrupt(
                damage,
                None,
                None,
                format!("{}: {what} ({} of {len} bytes)", path.display(), st.len),
            ));
        }
        Ok(())
    }

    /// Creates a new temporary file (0600) `name` in `dir` for writing:
    /// never an existing file, never through a link.
    pub fn create(&self, dir: &Dir, name: &str) -> Result<OpenFile> {
        self.open(dir, name, |flags| dir.create_file(name, 0o600, flags))
            .map_err(|e| UcmError::os("create", dir.join(name), e))
    }

    /// Opens the spare file `name` of this store in `dir` for writing,
    /// after checking it is what the store made: a regular file owned by
    /// this uid with one link and at most `len` bytes. None (the caller
    /// discards it) otherwise.
    pub fn reuse(&self, dir: &Dir, name: &str, len: u64) -> Option<OpenFile> {
        let open = self
            .open(dir, name, |flags| {
                dir.open_file(name, OFlags::WRONLY | flags)
            })
            .ok()?;
        let meta = open.file.metadata().ok()?;
        let ours = meta.file_type().is_file()
            && meta.uid() == euid()
            && meta.nlink() == 1
            && meta.len() <= len;
        if !ours {
            log::warn!(
                "spare file {} was replaced by {} of uid {} with {} link(s); discarded",
                dir.join(name).display(),
                kind_of(&meta),
                meta.uid(),
                meta.nlink()
            );
            return None;
        }
        Some(open)
    }
}

fn foreign(path: &Path, what: &str) -> UcmError {
    UcmError::corrupt(
        Damage::NotBlockFile,
        None,
        None,
        format!(
            "{} is {what}, not a block file this store reads",
            path.display()
        ),
    )
}

/// Takes an exclusive `flock` on `file` without waiting: true when taken.
pub fn try_lock(file: &File) -> bool {
    // SAFETY: flock on a descriptor `file` owns; no memory is passed.
    unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) == 0 }
}

/// True when the page at `offset` of `file` is in the page cache: a
/// 4 KiB read that may not wait for the disk (`RWF_NOWAIT`) got it all.
/// False on any error, including kernels without the flag.
pub fn page_cached(file: &File, offset: u64) -> bool {
    let mut page = [0u8; 4096];
    let iov = libc::iovec {
        iov_base: page.as_mut_ptr().cast(),
        iov_len: page.len(),
    };
    // SAFETY: one iovec over `page`, which lives for the call; the fd is
    // open for as long as `file` is borrowed.
    let n = unsafe {
        libc::preadv2(
            std::os::fd::AsRawFd::as_raw_fd(file),
            &iov,
            1,
            (offset & !4095) as libc::off_t,
            libc::RWF_NOWAIT,
        )
    };
    n == page.len() as isize
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::BlockId;
    use crate::store::posix::tree::{temp_tree, Tree};

    #[test]
    fn names_and_modes() {
        let (d, tree) = temp_tree();
        let id = BlockId([0xab; 16]);
        assert_eq!(
            tree.block_path(&id),
            d.path().join("ab").join("ab".repeat(16))
        );
        let mode = std::fs::metadata(d.path().join("ab"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o700);
        let bucket = tree.bucket(&id).unwrap();
        let opener = Opener::new(false, false);
        drop(opener.create(&bucket, "t").unwrap());
        let mode = std::fs::metadata(d.path().join("ab/t"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        // Never an existing file.
        assert!(opener.create(&bucket, "t").is_err());
        let al = direct_align(d.path());
        assert!(al.mem.is_power_of_two() && al.len.is_power_of_two());
        assert_ne!(random_token(), random_token());
    }

    /// A block directory replaced by a link to a folder outside the store
    /// is never followed: a store that repairs removes the link and makes
    /// the directory again; one that doesn't (lookup-only) refuses it.
    #[test]
    fn a_linked_block_directory_is_never_followed() {
        let (d, tree) = temp_tree();
        let outside = tempfile::tempdir().unwrap();
        let id = BlockId([0xab; 16]);
        std::fs::write(outside.path().join(id.hex()), b"planted").unwrap();
        std::fs::remove_dir(d.path().join("ab")).unwrap();
        std::os::unix::fs::symlink(outside.path(), d.path().join("ab")).unwrap();
        let lookup_only = Tree::open(&[d.path().to_path_buf()], false, false).unwrap();
        let e = lookup_only.bucket(&id).unwrap_err();
        assert!(e.to_string().contains("symbolic link"), "{e}");
        let bucket = tree.bucket(&id).unwrap();
        assert!(
            bucket.lstat(id.hex()).is_err(),
            "nothing of outside is seen"
        );
        assert!(std::fs::symlink_metadata(d.path().join("ab"))
            .unwrap()
            .is_dir());
        assert!(outside.path().join(id.hex()).exists(), "the target stays");
        // A regular file at a block directory's name is not ours to remove.
        std::fs::remove_dir(d.path().join("cd")).unwrap();
        std::fs::write(d.path().join("cd"), b"user data").unwrap();
        assert!(tree.bucket(&BlockId([0xcd; 16])).is_err());
        assert_eq!(std::fs::read(d.path().join("cd")).unwrap(), b"user data");
    }

    /// A page just written is cached; one past the end never is; one
    /// dropped from the page cache is not (where the file system drops it).
    #[test]
    fn page_cached_tells_cached_pages_from_the_rest() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("f");
        std::fs::write(&path, vec![7u8; 64 << 10]).unwrap();
        let f = File::open(&path).unwrap();
        assert!(page_cached(&f, 0) && page_cached(&f, (64 << 10) - 1));
        assert!(!page_cached(&f, 64 << 10));
        f.sync_all().unwrap();
        // DONTNEED may leave a page that another CPU still batches for its
        // LRU list: ask a few times, and believe `mincore`, which reads the
        // page cache another way, about whether the page left.
        let mut dropped = false;
        for _ in 0..20 {
            // SAFETY: plain syscalls on an open descriptor.
            unsafe {
                libc::fdatasync(f.as_raw_fd());
                libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED);
            }
            if !resident(&f) {
                dropped = true;
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        if dropped {
            assert!(!page_cached(&f, 0), "a dropped page reads as cached");
        }
    }

    /// The first page of `f` is in the page cache, by `mincore` over a map.
    fn resident(f: &File) -> bool {
        // SAFETY: a private read-only map of an open file's first page,
        // unmapped before return; `mincore` writes one byte into `vec`.
        unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            );
            if p == libc::MAP_FAILED {
                return true;
            }
            let mut vec = 0u8;
            let rc = libc::mincore(p, 4096, &mut vec);
            libc::munmap(p, 4096);
            rc != 0 || vec & 1 == 1
        }
    }

    #[test]
    fn reads_only_regular_files_of_the_block_length() {
        let d = tempfile::tempdir().unwrap();
        let dir = Dir::open(d.path()).unwrap();
        let opener = Opener::new(false, false);
        std::fs::write(d.path().join("good"), [7u8; 100]).unwrap();
        assert!(opener.read(&dir, "good", 100).is_ok());
        let short = opener.read(&dir, "good", 101).err().unwrap();
        assert_eq!(short.code(), -50011, "{short}");
        std::os::unix::fs::symlink(d.path().join("good"), d.path().join("link")).unwrap();
        let e = opener.read(&dir, "link", 100).err().unwrap();
        assert!(e.to_string().contains("symbolic link"), "{e}");
        let fifo = d.path().join("fifo");
        let c = CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = opener.read(&dir, "fifo", 100).err().unwrap();
        assert!(e.to_string().contains("FIFO"), "{e}");
        std::fs::create_dir(d.path().join("sub")).unwrap();
        let e = opener.read(&dir, "sub", 100).err().unwrap();
        assert!(e.to_string().contains("directory"), "{e}");
        assert_eq!(opener.read(&dir, "none", 100).err().unwrap().code(), -50005);
        // A symlink planted at a spare's name is not followed.
        std::os::unix::fs::symlink(d.path().join("good"), d.path().join("spare")).unwrap();
        assert!(opener.reuse(&dir, "spare", 100).is_none());
        dir.remove_entry("spare");
        assert!(d.path().join("good").exists() && !d.path().join("spare").exists());
    }
}
