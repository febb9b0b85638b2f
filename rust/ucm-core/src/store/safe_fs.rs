//! Opening files in directories other users or processes may tamper with.
//!
//! Every store that keeps blocks as files in a shared directory (Posix, NFS
//! through a kernel mount) opens them through these helpers, so that
//! whatever was planted at a block's name (a symlink, FIFO, device, socket
//! or directory) is refused before any byte moves: a new file is never an
//! existing one or a symlink's target, and a file to read is checked to be
//! a regular file without being followed or blocking on open.
//!
//! A store that owns a directory tree holds its directories open as
//! [`Dir`]s and resolves one name at a time relative to them, so that a
//! symbolic link planted anywhere below the root (a block directory, the
//! work directory) can't make it read, write or delete outside the tree.

use std::ffi::{OsStr, OsString};
use std::fs::{File, Metadata, OpenOptions};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, FileType, Mode, OFlags, Stat};

/// Checks that `dir`, which the config key `key` names, is an existing
/// directory; errors name the key.
pub fn require_dir(key: &str, dir: &Path) -> crate::error::Result<()> {
    use crate::error::UcmError;
    let meta = std::fs::metadata(dir).map_err(|e| {
        UcmError::invalid(format!(
            "{key}: directory {} is not usable: {e}",
            dir.display()
        ))
    })?;
    if !meta.is_dir() {
        return Err(UcmError::invalid(format!(
            "{key}: {} is not a directory",
            dir.display()
        )));
    }
    Ok(())
}

/// What a non-regular file is, for messages.
pub fn kind_of(meta: &Metadata) -> &'static str {
    let t = meta.file_type();
    if t.is_symlink() {
        "a symbolic link"
    } else if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_socket() {
        "a socket"
    } else {
        "a regular file"
    }
}

/// Removes whatever sits at `path` without following it (a symlink is
/// removed, not its target); a directory only if it is empty.
pub fn remove_entry(path: &Path) {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => {
            let _ = std::fs::remove_dir(path);
        }
        Ok(_) => {
            let _ = std::fs::remove_file(path);
        }
        Err(_) => {}
    }
}

/// The effective uid of this process.
pub fn euid() -> u32 {
    // SAFETY: geteuid has no failure modes and no arguments.
    unsafe { libc::geteuid() }
}

/// Why `path` can't be read as a block file, or None if it is a regular
/// file (not followed).
pub fn not_regular(path: &Path) -> std::io::Result<Option<&'static str>> {
    let meta = std::fs::symlink_metadata(path)?;
    Ok((!meta.file_type().is_file()).then(|| kind_of(&meta)))
}

/// Opens `path` with `opts` plus `flags`, never following a symlink at its
/// last component and never blocking in `open` (a FIFO), then clears
/// `O_NONBLOCK`: regular files ignore it, but io_uring would not punt a
/// read that must wait for the disk.
pub fn open_nofollow(path: &Path, opts: &OpenOptions, flags: i32) -> std::io::Result<File> {
    let mut o = opts.clone();
    o.custom_flags(flags | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC);
    let file = o.open(path)?;
    set_blocking(&file)?;
    Ok(file)
}

fn set_blocking(file: &File) -> std::io::Result<()> {
    let fd = file.as_raw_fd();
    // SAFETY: plain fcntl calls on a descriptor `file` owns.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags < 0 || libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Opens an existing regular file for reading: anything else at `path`
/// (checked before and after the open) is an `InvalidData` error naming it.
pub fn open_regular(path: &Path, flags: i32) -> std::io::Result<File> {
    let refuse = |what: &str| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{} is {what}, not a block file", path.display()),
        )
    };
    // Not even opened unless it is a regular file: opening a device can
    // have side effects, and a FIFO would block.
    if let Some(what) = not_regular(path)? {
        return Err(refuse(what));
    }
    let mut opts = OpenOptions::new();
    opts.read(true);
    let file = open_nofollow(path, &opts, flags).map_err(|e| match e.raw_os_error() {
        Some(libc::ELOOP) => refuse("a symbolic link"),
        _ => e,
    })?;
    let meta = file.metadata()?;
    if !meta.file_type().is_file() {
        return Err(refuse(kind_of(&meta)));
    }
    Ok(file)
}

/// Creates a new file (mode `mode`) at `path` for writing: never an
/// existing file, never through a symlink.
pub fn create_new(path: &Path, mode: u32, flags: i32) -> std::io::Result<File> {
    let mut opts = OpenOptions::new();
    opts.write(true).create_new(true).mode(mode);
    opts.custom_flags(flags | libc::O_NOFOLLOW | libc::O_CLOEXEC);
    opts.open(path)
}

/// A directory held open by descriptor. Every operation on a name inside
/// it resolves that single name relative to the descriptor and never
/// follows a symbolic link there: a link is an entry like any other, to be
/// refused or removed, never a way out.
#[derive(Debug)]
pub struct Dir {
    fd: OwnedFd,
    /// Where it was opened, for messages only.
    path: PathBuf,
}

/// What sits at a name, as `lstat` sees it (never followed).
#[derive(Clone, Copy, Debug)]
pub struct EntryStat {
    /// The entry's type.
    pub kind: FileType,
    /// Its length in bytes.
    pub len: u64,
    /// Its modification time, in ns since the epoch (0 before it).
    pub mtime_ns: u64,
    /// Its owner.
    pub uid: u32,
    /// Its hard links.
    pub nlink: u64,
    /// Its inode number.
    pub ino: u64,
    /// Its device.
    pub dev: u64,
}

impl EntryStat {
    // The fields' types differ between architectures: what is a cast to
    // the same type here is a widening one elsewhere.
    #[allow(clippy::unnecessary_cast)]
    fn from_stat(st: &Stat) -> Self {
        let secs = st.st_mtime as i64;
        let nanos = st.st_mtime_nsec as i64;
        let mtime_ns = if secs < 0 {
            0
        } else {
            (secs as u64)
                .saturating_mul(1_000_000_000)
                .saturating_add(nanos.max(0) as u64)
        };
        EntryStat {
            kind: FileType::from_raw_mode(st.st_mode as _),
            len: st.st_size.max(0) as u64,
            mtime_ns,
            uid: st.st_uid as u32,
            nlink: st.st_nlink as u64,
            ino: st.st_ino as u64,
            dev: st.st_dev as u64,
        }
    }

    /// What the entry is, for messages.
    pub fn describe(&self) -> &'static str {
        describe_kind(self.kind)
    }

    /// A regular file (not a link to one).
    pub fn is_file(&self) -> bool {
        self.kind == FileType::RegularFile
    }

    /// A directory (not a link to one).
    pub fn is_dir(&self) -> bool {
        self.kind == FileType::Directory
    }
}

/// What a file type is, for messages.
pub fn describe_kind(kind: FileType) -> &'static str {
    match kind {
        FileType::Symlink => "a symbolic link",
        FileType::Directory => "a directory",
        FileType::Fifo => "a FIFO",
        FileType::CharacterDevice => "a character device",
        FileType::BlockDevice => "a block device",
        FileType::Socket => "a socket",
        FileType::RegularFile => "a regular file",
        _ => "a file of unknown type",
    }
}

/// One entry of a directory listing; `kind` is None where the file system
/// does not say (then `lstat` tells).
#[derive(Clone, Debug)]
pub struct DirEntry {
    /// Its name.
    pub name: OsString,
    /// Its type, as the listing gave it (never followed).
    pub kind: Option<FileType>,
}

fn errno(e: rustix::io::Errno) -> std::io::Error {
    std::io::Error::from(e)
}

/// The error for something other than a directory where one belongs.
pub fn not_a_dir(path: &Path, what: &str) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::InvalidData,
        format!("{} is {what}, not a directory", path.display()),
    )
}

impl Dir {
    /// Opens `path` as a directory. A symbolic link is followed here: the
    /// root of a tree is chosen by the user, and may be a link they made.
    pub fn open(path: &Path) -> std::io::Result<Dir> {
        let fd = rustix::fs::open(
            path,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(errno)?;
        Ok(Dir {
            fd,
            path: path.to_path_buf(),
        })
    }

    /// Where the directory was opened (for messages).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `name` inside this directory, as a path (for messages).
    pub fn join(&self, name: impl AsRef<OsStr>) -> PathBuf {
        self.path.join(name.as_ref())
    }

    /// Another descriptor of the same directory.
    pub fn try_clone(&self) -> std::io::Result<Dir> {
        Ok(Dir {
            fd: self.fd.try_clone()?,
            path: self.path.clone(),
        })
    }

    /// The subdirectory `name`, never through a link: a link or anything
    /// else that is not a directory is an `InvalidData` error naming it;
    /// a missing one is `NotFound`.
    pub fn sub(&self, name: impl AsRef<OsStr>) -> std::io::Result<Dir> {
        let name = name.as_ref();
        let opened = rustix::fs::openat(
            &self.fd,
            name,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        );
        match opened {
            Ok(fd) => Ok(Dir {
                fd,
                path: self.join(name),
            }),
            Err(e) if e == rustix::io::Errno::LOOP || e == rustix::io::Errno::NOTDIR => {
                let what = self.lstat(name).map_or("not a directory", |s| s.describe());
                Err(not_a_dir(&self.join(name), what))
            }
            Err(e) => Err(errno(e)),
        }
    }

    /// Creates the subdirectory `name` with `mode` (exactly: the umask is
    /// undone); false when something already sits at the name.
    pub fn mkdir(&self, name: impl AsRef<OsStr>, mode: u32) -> std::io::Result<bool> {
        let name = name.as_ref();
        match rustix::fs::mkdirat(&self.fd, name, Mode::from_raw_mode(mode as _)) {
            Ok(()) => {
                let dir = self.sub(name)?;
                rustix::fs::fchmod(&dir.fd, Mode::from_raw_mode(mode as _)).map_err(errno)?;
                Ok(true)
            }
            Err(rustix::io::Errno::EXIST) => Ok(false),
            Err(e) => Err(errno(e)),
        }
    }

    /// True when the directory is on NFS: other hosts' changes raise no
    /// inotify event here, and `flock` may not reach them.
    pub fn on_nfs(&self) -> bool {
        const NFS_SUPER_MAGIC: i64 = 0x6969;
        // `f_type`'s type differs between architectures.
        #[allow(clippy::unnecessary_cast)]
        let nfs = |t: rustix::fs::StatFs| t.f_type as i64 == NFS_SUPER_MAGIC;
        rustix::fs::fstatfs(&self.fd).is_ok_and(nfs)
    }

    /// What sits at `name`, not followed.
    pub fn lstat(&self, name: impl AsRef<OsStr>) -> std::io::Result<EntryStat> {
        rustix::fs::statat(&self.fd, name.as_ref(), AtFlags::SYMLINK_NOFOLLOW)
            .map(|st| EntryStat::from_stat(&st))
            .map_err(errno)
    }

    /// This directory's own status.
    pub fn stat(&self) -> std::io::Result<EntryStat> {
        rustix::fs::fstat(&self.fd)
            .map(|st| EntryStat::from_stat(&st))
            .map_err(errno)
    }

    /// Opens the existing entry `name` with `flags` (access mode and
    /// extras such as `O_DIRECT`), never following a link and never
    /// blocking in `open` (a FIFO); `O_NONBLOCK` is cleared afterwards:
    /// regular files ignore it, but io_uring would not punt a read that
    /// must wait for the disk. A link is an `ELOOP` error.
    pub fn open_file(&self, name: impl AsRef<OsStr>, flags: OFlags) -> std::io::Result<File> {
        let fd = rustix::fs::openat(
            &self.fd,
            name.as_ref(),
            flags | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(errno)?;
        let file = File::from(fd);
        set_blocking(&file)?;
        Ok(file)
    }

    /// Creates a new file `name` (`mode`) for writing, with `flags` added:
    /// never an existing file, never through a link.
    pub fn create_file(
        &self,
        name: impl AsRef<OsStr>,
        mode: u32,
        flags: OFlags,
    ) -> std::io::Result<File> {
        let fd = rustix::fs::openat(
            &self.fd,
            name.as_ref(),
            flags
                | OFlags::WRONLY
                | OFlags::CREATE
                | OFlags::EXCL
                | OFlags::NOFOLLOW
                | OFlags::CLOEXEC,
            Mode::from_raw_mode(mode as _),
        )
        .map_err(errno)?;
        Ok(File::from(fd))
    }

    /// Removes the entry `name` if it is not a directory (a link itself,
    /// never its target).
    pub fn remove_file(&self, name: impl AsRef<OsStr>) -> std::io::Result<()> {
        rustix::fs::unlinkat(&self.fd, name.as_ref(), AtFlags::empty()).map_err(errno)
    }

    /// Removes the empty directory `name` (never through a link).
    pub fn remove_dir(&self, name: impl AsRef<OsStr>) -> std::io::Result<()> {
        rustix::fs::unlinkat(&self.fd, name.as_ref(), AtFlags::REMOVEDIR).map_err(errno)
    }

    /// Removes whatever sits at `name` without following it: a directory
    /// only if it is empty. Best effort.
    pub fn remove_entry(&self, name: impl AsRef<OsStr>) {
        let name = name.as_ref();
        if self.remove_file(name).is_err() {
            let _ = self.remove_dir(name);
        }
    }

    /// Renames `from` here to `to_name` in `to` (replacing what is there).
    pub fn rename(
        &self,
        from: impl AsRef<OsStr>,
        to: &Dir,
        to_name: impl AsRef<OsStr>,
    ) -> std::io::Result<()> {
        rustix::fs::renameat(&self.fd, from.as_ref(), &to.fd, to_name.as_ref()).map_err(errno)
    }

    /// [`Dir::rename`] that fails (`AlreadyExists`) rather than replace.
    pub fn rename_noreplace(
        &self,
        from: impl AsRef<OsStr>,
        to: &Dir,
        to_name: impl AsRef<OsStr>,
    ) -> std::io::Result<()> {
        rustix::fs::renameat_with(
            &self.fd,
            from.as_ref(),
            &to.fd,
            to_name.as_ref(),
            rustix::fs::RenameFlags::NOREPLACE,
        )
        .map_err(errno)
    }

    /// Sets the modification (and access) time of `name` to now, without
    /// following a link.
    pub fn touch(&self, name: impl AsRef<OsStr>) -> std::io::Result<()> {
        let now = rustix::fs::Timespec {
            tv_sec: 0,
            tv_nsec: rustix::fs::UTIME_NOW,
        };
        let times = rustix::fs::Timestamps {
            last_access: now,
            last_modification: now,
        };
        rustix::fs::utimensat(&self.fd, name.as_ref(), &times, AtFlags::SYMLINK_NOFOLLOW)
            .map_err(errno)
    }

    /// The entries of the directory (not `.` and `..`).
    pub fn entries(&self) -> std::io::Result<Vec<DirEntry>> {
        let listing = rustix::fs::Dir::read_from(&self.fd).map_err(errno)?;
        let mut out = Vec::new();
        for entry in listing {
            let entry = entry.map_err(errno)?;
            let name = entry.file_name().to_bytes();
            if name == b"." || name == b".." {
                continue;
            }
            let kind = match entry.file_type() {
                FileType::Unknown => None,
                k => Some(k),
            };
            out.push(DirEntry {
                name: OsStr::from_bytes(name).to_os_string(),
                kind,
            });
        }
        Ok(out)
    }

    /// The type of `entry` of this directory: the listing's, or `lstat`'s
    /// where the listing did not say.
    pub fn kind_of(&self, entry: &DirEntry) -> Option<FileType> {
        entry
            .kind
            .or_else(|| self.lstat(&entry.name).ok().map(|s| s.kind))
    }

    /// Makes the directory's entries durable (`fsync`).
    pub fn sync(&self) -> std::io::Result<()> {
        rustix::fs::fsync(&self.fd).map_err(errno)
    }
}

impl AsFd for Dir {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dir_never_follows_a_link_below_it() {
        let d = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("f"), b"outside").unwrap();
        let root = Dir::open(d.path()).unwrap();
        assert!(root.mkdir("sub", 0o700).unwrap());
        assert!(!root.mkdir("sub", 0o700).unwrap(), "already there");
        std::os::unix::fs::symlink(outside.path(), d.path().join("link")).unwrap();
        let e = root.sub("link").unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
        assert!(e.to_string().contains("symbolic link"), "{e}");
        assert_eq!(
            root.sub("none").unwrap_err().kind(),
            std::io::ErrorKind::NotFound
        );
        std::os::unix::fs::symlink(outside.path().join("f"), d.path().join("flink")).unwrap();
        let e = root.open_file("flink", OFlags::RDONLY).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ELOOP));
        assert!(root.create_file("flink", 0o600, OFlags::empty()).is_err());
        assert!(root.lstat("flink").unwrap().kind == FileType::Symlink);
        root.remove_file("flink").unwrap();
        root.remove_entry("link");
        assert!(outside.path().join("f").exists(), "the target stays");
        let sub = root.sub("sub").unwrap();
        let mut f = sub.create_file("x", 0o600, OFlags::empty()).unwrap();
        std::io::Write::write_all(&mut f, b"abc").unwrap();
        sub.rename("x", &root, "y").unwrap();
        std::fs::write(d.path().join("z"), b"").unwrap();
        let e = root.rename_noreplace("y", &root, "z").unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::AlreadyExists);
        root.touch("y").unwrap();
        let st = root.lstat("y").unwrap();
        assert!(st.is_file() && st.len == 3 && st.mtime_ns > 0);
        let mut names: Vec<_> = root
            .entries()
            .unwrap()
            .into_iter()
            .map(|e| e.name)
            .collect();
        names.sort();
        assert_eq!(names, ["sub", "y", "z"]);
        let mode = std::fs::metadata(d.path().join("sub")).unwrap();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&mode.permissions()) & 0o777,
            0o700
        );
    }
}
