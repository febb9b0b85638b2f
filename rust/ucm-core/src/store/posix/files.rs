//! Where block files live and how they are opened.
//!
//! Layout: `<root>/<2 hex>/<32 hex>` (the id in lowercase hex, byte order),
//! with the root picked by the id when there are several. A block being
//! written lives next to its final name as
//! `<32 hex>.tmp.<pid>.<instance>.<seq>`, so a rename inside one directory
//! publishes it atomically, two writers (threads, stores of one process, or
//! processes) never share a temporary file, and a restart can tell whose
//! leftovers it is looking at.

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::block::{BlockId, MemSeg};
use crate::error::{Result, UcmError};
use crate::io::DIRECT_ALIGN;

/// Marker between the id and the owner in temporary file names.
pub const TMP_MARKER: &str = ".tmp.";

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

/// Distinguishes the stores of one process (several may share a
/// directory, e.g. vLLM's scheduler and worker run in one process).
static NEXT_INSTANCE: AtomicU64 = AtomicU64::new(1);

/// Naming of block files under the store's roots.
pub struct Paths {
    roots: Vec<PathBuf>,
    instance: u64,
}

impl Paths {
    /// `roots` must exist; call [`Paths::create_dirs`] to make subdirs.
    pub fn new(roots: Vec<PathBuf>) -> Self {
        Paths {
            roots,
            instance: NEXT_INSTANCE.fetch_add(1, Ordering::Relaxed),
        }
    }

    /// `<pid>.<instance>`: the owner part of this store's temporary names.
    pub fn owner(&self) -> String {
        format!("{}.{}", std::process::id(), self.instance)
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

    /// Directory holding the block (and its temporaries).
    pub fn dir(&self, id: &BlockId) -> PathBuf {
        let hex = id.hex();
        self.root_of(id).join(&hex[..2])
    }

    /// Final (published) path of a block.
    pub fn block(&self, id: &BlockId) -> PathBuf {
        let hex = id.hex();
        self.root_of(id).join(&hex[..2]).join(hex)
    }

    /// A fresh temporary path for writing `id`, unique to this process.
    pub fn temp(&self, id: &BlockId, seq: u64) -> PathBuf {
        let hex = id.hex();
        let name = format!("{hex}{TMP_MARKER}{}.{seq}", self.owner());
        self.root_of(id).join(&hex[..2]).join(name)
    }

    /// Creates the 256 subdirectories of every root, mode 0700.
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
}

/// An open block file and whether it was opened with O_DIRECT.
pub struct OpenFile {
    /// The file.
    pub file: File,
    /// O_DIRECT is in effect.
    pub direct: bool,
}

impl Opener {
    /// `direct` requests O_DIRECT.
    pub fn new(direct: bool) -> Self {
        Opener {
            direct: AtomicBool::new(direct),
        }
    }

    fn open(&self, path: &Path, write: bool) -> std::io::Result<OpenFile> {
        let attempt = |direct: bool| {
            let mut o = OpenOptions::new();
            if write {
                o.write(true).create(true).mode(0o600);
            } else {
                o.read(true);
            }
            o.custom_flags(if direct { libc::O_DIRECT } else { 0 });
            o.open(path)
        };
        let direct = self.direct.load(Ordering::Relaxed);
        match attempt(direct) {
            Ok(file) => Ok(OpenFile { file, direct }),
            Err(e) if direct && e.raw_os_error() == Some(libc::EINVAL) => {
                // The file system refuses O_DIRECT (some FUSE and network
                // file systems): keep working without it, once for all.
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

    /// Opens a published block for reading.
    pub fn read(&self, path: &Path) -> Result<OpenFile> {
        self.open(path, false)
            .map_err(|e| UcmError::os("open", path, e))
    }

    /// Opens (creating, 0600) a temporary block file for writing; recreates
    /// the parent directory once if it vanished under us.
    pub fn write(&self, path: &Path) -> Result<OpenFile> {
        match self.open(path, true) {
            Ok(f) => Ok(f),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                if let Some(parent) = path.parent() {
                    make_private_dir(parent)?;
                }
                self.open(path, true)
                    .map_err(|e| UcmError::os("open", path, e))
            }
            Err(e) => Err(UcmError::os("open", path, e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_modes() {
        let d = tempfile::tempdir().unwrap();
        let paths = Paths::new(vec![d.path().to_path_buf()]);
        paths.create_dirs().unwrap();
        let id = BlockId([0xab; 16]);
        assert_eq!(paths.block(&id), d.path().join("ab").join("ab".repeat(16)));
        let tmp = paths.temp(&id, 3);
        let name = tmp.file_name().unwrap().to_string_lossy().to_string();
        assert!(name.starts_with(&"ab".repeat(16)) && name.contains(TMP_MARKER));
        let mode = std::fs::metadata(d.path().join("ab"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o700);
        let f = Opener::new(false).write(&tmp).unwrap();
        drop(f);
        let mode = std::fs::metadata(&tmp).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let al = direct_align(d.path());
        assert!(al.mem.is_power_of_two() && al.len.is_power_of_two());
    }
}
