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
use std::fs::{File, Metadata, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use crate::block::{BlockId, MemSeg};
use crate::error::{Damage, Result, UcmError};
use crate::io::DIRECT_ALIGN;
use crate::store::safe_fs::open_nofollow;
pub use crate::store::safe_fs::{euid, kind_of, remove_entry};

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

/// Naming of block files under the store's roots.
pub struct Paths {
    roots: Vec<PathBuf>,
    token: String,
}

impl Paths {
    /// `roots` must exist; call [`Paths::create_dirs`] to make subdirs.
    pub fn new(roots: Vec<PathBuf>) -> Self {
        Paths {
            roots,
            token: random_token(),
        }
    }

    /// The token of this store instance (its work directories' name).
    pub fn token(&self) -> &str {
        &self.token
    }

    /// The store's root directories.
    pub fn roots(&self) -> &[PathBuf] {
        &self.roots
    }

    /// Index of the root a block lives under.
    pub fn root_index(&self, id: &BlockId) -> usize {
        (id.prefix_u64() % self.roots.len() as u64) as usize
    }

    fn root_of(&self, id: &BlockId) -> &Path {
        &self.roots[self.root_index(id)]
    }

    /// Directory holding the block.
    pub fn dir(&self, id: &BlockId) -> PathBuf {
        let hex = id.hex();
        self.root_of(id).join(&hex[..2])
    }

    /// Final (published) path of a block.
    pub fn block(&self, id: &BlockId) -> PathBuf {
        let hex = id.hex();
        self.root_of(id).join(&hex[..2]).join(hex)
    }

    /// This instance's work directory under root `root`.
    pub fn work_dir(&self, root: usize) -> PathBuf {
        self.roots[root].join(WORK_DIR).join(&self.token)
    }

    /// A fresh temporary path for writing `id`, in this instance's work
    /// directory of the block's root.
    pub fn temp(&self, id: &BlockId, seq: u64) -> PathBuf {
        self.work_dir(self.root_index(id))
            .join(format!("{}.{seq}", id.hex()))
    }

    /// Creates the 256 block directories of every root, mode 0700.
    pub fn create_dirs(&self) -> Result<()> {
        for root in &self.roots {
            for b in 0..=255u8 {
                make_private_dir(&root.join(format!("{b:02x}")))?;
            }
        }
        Ok(())
    }
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

    /// Opens with `opts` (never following a symlink, never blocking in
    /// `open`) plus O_DIRECT when in effect, falling back to buffered I/O
    /// once for all when the file system refuses O_DIRECT.
    fn open(&self, path: &Path, opts: &OpenOptions) -> std::io::Result<OpenFile> {
        let attempt =
            |direct: bool| open_nofollow(path, opts, if direct { libc::O_DIRECT } else { 0 });
        let direct = self.direct.load(Ordering::Relaxed);
        match attempt(direct) {
            Ok(file) => Ok(OpenFile { file, direct }),
            Err(e) if direct && e.raw_os_error() == Some(libc::EINVAL) => {
                // Some FUSE and network file systems refuse O_DIRECT.
                if self.direct.swap(false, Ordering::Relaxed) {
                    log::warn!(
                        "O_DIRECT is not supported under {}; continuing with buffered I/O",
                        path.display()
                    );
                }
                attempt(false).map(|file| OpenFile {
                    file,
                    direct: false,
                })
            }
            Err(e) => Err(e),
        }
    }

    /// Opens a published block of `len` bytes for reading. Anything at the
    /// path but a regular file of exactly that length (of ours, in strict
    /// mode) is [`UcmError::Corrupt`], found before any byte is read; a
    /// missing file is [`UcmError::NotFound`].
    pub fn read(&self, path: &Path, len: u64) -> Result<OpenFile> {
        // Not even opened unless it looks like a block: opening a device
        // can have side effects, and a FIFO would block.
        let meta = std::fs::symlink_metadata(path).map_err(|e| UcmError::os("stat", path, e))?;
        self.check_block(path, &meta, len)?;
        let mut opts = OpenOptions::new();
        opts.read(true);
        let open = self.open(path, &opts).map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => foreign(path, "a symbolic link"),
            _ => UcmError::os("open", path, e),
        })?;
        // Swapped between the lstat and the open?
        let meta = open
            .file
            .metadata()
            .map_err(|e| UcmError::os("fstat", path, e))?;
        self.check_block(path, &meta, len)?;
        Ok(open)
    }

    fn check_block(&self, path: &Path, meta: &Metadata, len: u64) -> Result<()> {
        if !meta.file_type().is_file() {
            return Err(foreign(path, kind_of(meta)));
        }
        if self.own_files_only && meta.uid() != euid() {
            return Err(foreign(
                path,
                &format!(
                    "a file of uid {} (posix_strict accepts only files of uid {})",
                    meta.uid(),
                    euid()
                ),
            ));
        }
        if meta.len() != len {
            let (damage, what) = if meta.len() < len {
                (Damage::Truncated, "file is truncated")
            } else {
                (Damage::NotBlockFile, "file is longer than a block")
            };
            return Err(UcmError::corrupt(
                damage,
                None,
                None,
                format!("{}: {what} ({} of {len} bytes)", path.display(), meta.len()),
            ));
        }
        Ok(())
    }

    /// Creates a new temporary file (0600) at `path` for writing: never an
    /// existing file, never through a symlink.
    pub fn create(&self, path: &Path) -> Result<OpenFile> {
        let mut opts = OpenOptions::new();
        opts.write(true).create_new(true).mode(0o600);
        self.open(path, &opts)
            .map_err(|e| UcmError::os("create", path, e))
    }

    /// Opens a spare file of this store for writing, after checking it is
    /// what the store made: a regular file owned by this uid with one link
    /// and at most `len` bytes. None (the caller discards it) otherwise.
    pub fn reuse(&self, path: &Path, len: u64) -> Option<OpenFile> {
        let mut opts = OpenOptions::new();
        opts.write(true);
        let open = self.open(path, &opts).ok()?;
        let meta = open.file.metadata().ok()?;
        let ours = meta.file_type().is_file()
            && meta.uid() == euid()
            && meta.nlink() == 1
            && meta.len() <= len;
        if !ours {
            log::warn!(
                "spare file {} was replaced by {} of uid {} with {} link(s); discarded",
                path.display(),
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

/// Paths over one new temporary directory (returned too: it lives as long
/// as the caller keeps it), with the store's directories made.
#[cfg(test)]
pub(crate) fn temp_paths() -> (tempfile::TempDir, Paths) {
    let d = tempfile::tempdir().unwrap();
    let paths = Paths::new(vec![d.path().to_path_buf()]);
    paths.create_dirs().unwrap();
    (d, paths)
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

    #[test]
    fn names_and_modes() {
        let (d, paths) = temp_paths();
        let id = BlockId([0xab; 16]);
        assert_eq!(paths.block(&id), d.path().join("ab").join("ab".repeat(16)));
        let tmp = paths.temp(&id, 3);
        assert!(tmp.starts_with(d.path().join(WORK_DIR).join(paths.token())));
        let mode = std::fs::metadata(d.path().join("ab"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o700);
        make_private_dir(&d.path().join(WORK_DIR)).unwrap();
        make_private_dir(&paths.work_dir(0)).unwrap();
        let opener = Opener::new(false, false);
        drop(opener.create(&tmp).unwrap());
        let mode = std::fs::metadata(&tmp).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        // Never an existing file.
        assert!(opener.create(&tmp).is_err());
        let al = direct_align(d.path());
        assert!(al.mem.is_power_of_two() && al.len.is_power_of_two());
        assert_ne!(random_token(), random_token());
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
        // SAFETY: plain syscalls on an open descriptor.
        let dropped = unsafe {
            libc::fdatasync(f.as_raw_fd());
            libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) == 0
        };
        // SAFETY: `statfs` is plain data, fully written by the call below.
        let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
        let c = CString::new(d.path().as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: valid path and out-pointer.
        let tmpfs =
            unsafe { libc::statfs(c.as_ptr(), &mut fs) } == 0 && fs.f_type == libc::TMPFS_MAGIC;
        if dropped && !tmpfs {
            assert!(!page_cached(&f, 0), "a dropped page reads as cached");
        }
    }

    #[test]
    fn reads_only_regular_files_of_the_block_length() {
        let d = tempfile::tempdir().unwrap();
        let opener = Opener::new(false, false);
        let good = d.path().join("good");
        std::fs::write(&good, [7u8; 100]).unwrap();
        assert!(opener.read(&good, 100).is_ok());
        let short = opener.read(&good, 101).err().unwrap();
        assert_eq!(short.code(), -50011, "{short}");
        let link = d.path().join("link");
        std::os::unix::fs::symlink(&good, &link).unwrap();
        let e = opener.read(&link, 100).err().unwrap();
        assert!(e.to_string().contains("symbolic link"), "{e}");
        let fifo = d.path().join("fifo");
        let c = CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = opener.read(&fifo, 100).err().unwrap();
        assert!(e.to_string().contains("FIFO"), "{e}");
        let e = opener.read(d.path(), 100).err().unwrap();
        assert!(e.to_string().contains("directory"), "{e}");
        assert_eq!(
            opener
                .read(&d.path().join("none"), 100)
                .err()
                .unwrap()
                .code(),
            -50005
        );
        // A symlink planted at a spare's name is not followed.
        let spare = d.path().join("spare");
        std::os::unix::fs::symlink(&good, &spare).unwrap();
        assert!(opener.reuse(&spare, 100).is_none());
        remove_entry(&spare);
        assert!(good.exists() && !spare.exists());
    }
}
