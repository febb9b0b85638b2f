//! Opening files in directories other users or processes may tamper with.
//!
//! Every store that keeps blocks as files in a shared directory (Posix, NFS
//! through a kernel mount) opens them through these helpers, so that
//! whatever was planted at a block's name (a symlink, FIFO, device, socket
//! or directory) is refused before any byte moves: a new file is never an
//! existing one or a symlink's target, and a file to read is checked to be
//! a regular file without being followed or blocking on open.

use std::fs::{File, Metadata, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

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
