//! Work directories: where a store instance writes its temporary and spare
//! files, and how other instances tell whether it is still alive.
//!
//! Each writing store instance owns `<root>/.work/<token>/` under every
//! root, and holds an exclusive `flock` on its `lock` file for as long as
//! it is open. The kernel drops the lock when the process dies, however it
//! dies, so an instance that can take another's lock knows the owner is
//! gone, whatever PID namespace either runs in. It then adopts the dead
//! instance's spare files (a clean restart keeps its pool) and removes the
//! rest of its directory.
//!
//! On NFS a `flock` may be local to each host (`local_lock=flock`, or no
//! lock manager), so there a lock that can be taken is only believed when
//! the owner also marked its directory closed, or stopped refreshing its
//! lock file's mtime (every [`HEARTBEAT`]) for [`NFS_STALE_AFTER`].
//!
//! A directory is created under a hidden name, locked, then renamed into
//! place, so nobody ever sees a live instance's directory unlocked.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use super::files::{make_private_dir, remove_entry, try_lock, Opener, Paths, LOCK_FILE, WORK_DIR};
use crate::error::{Result, UcmError};

/// How often a live instance refreshes its lock file's mtime.
pub const HEARTBEAT: Duration = Duration::from_secs(30);
/// On NFS, a lock that can be taken is believed only after this long
/// without a heartbeat.
pub const NFS_STALE_AFTER: Duration = Duration::from_secs(120);
/// A directory being created (hidden name) that is older than this was
/// left by a creator that died.
const CREATING_MAX_AGE: Duration = Duration::from_secs(3600);
/// Marker a cleanly closed instance leaves in its directory.
const CLOSED_FILE: &str = "closed";
/// Prefix of spare files inside a work directory.
pub const SPARE_PREFIX: &str = "spare.";

/// The work directories of one live instance, one per root, locked.
pub struct WorkDirs {
    dirs: Vec<PathBuf>,
    locks: Vec<File>,
    nfs: Vec<bool>,
}

impl WorkDirs {
    /// Creates and locks this instance's directory under every root.
    pub fn create(paths: &Paths) -> Result<Self> {
        let mut dirs = Vec::new();
        let mut locks = Vec::new();
        let mut nfs = Vec::new();
        for (i, root) in paths.roots().iter().enumerate() {
            let parent = root.join(WORK_DIR);
            make_private_dir(&parent)?;
            let hidden = parent.join(format!(".{}.new", paths.token()));
            std::fs::create_dir(&hidden).map_err(|e| UcmError::os("mkdir", &hidden, e))?;
            // Created, then held open read-only: a file open for writing
            // would keep the file system from being remounted read-only.
            let lock_path = hidden.join(LOCK_FILE);
            drop(Opener::new(false, false).create(&lock_path)?);
            let lock = File::open(&lock_path).map_err(|e| UcmError::os("open", &lock_path, e))?;
            if !try_lock(&lock) {
                return Err(UcmError::os(
                    "flock",
                    hidden.join(LOCK_FILE),
                    std::io::Error::last_os_error(),
                ));
            }
            let dir = paths.work_dir(i);
            std::fs::rename(&hidden, &dir).map_err(|e| UcmError::os("rename", &hidden, e))?;
            nfs.push(on_nfs(root));
            dirs.push(dir);
            locks.push(lock);
        }
        Ok(WorkDirs { dirs, locks, nfs })
    }

    /// Refreshes the lock files' mtime where other hosts may need it (NFS).
    pub fn heartbeat(&self) {
        for (lock, nfs) in self.locks.iter().zip(&self.nfs) {
            if *nfs {
                let _ = lock.set_modified(SystemTime::now());
            }
        }
    }

    /// Marks every directory closed (its spares are for the next instance
    /// to adopt) and releases the locks.
    pub fn close(self) {
        for dir in &self.dirs {
            let _ = File::create(dir.join(CLOSED_FILE));
        }
        drop(self.locks);
    }
}

/// What [`reclaim`] did under one root.
#[derive(Debug, Default)]
pub struct Reclaimed {
    /// Spare files of dead instances, now inside the caller's directory.
    pub spares: Vec<PathBuf>,
    /// Files of dead instances removed: temporaries and spares beyond the
    /// pool's room, not the lock files and `closed` markers every stopped
    /// instance leaves (those say nothing about what it left undone).
    pub removed: usize,
}

/// Reclaims the work directories of dead instances under `root`: their
/// spares (checked like any spare, at most `max_spares`, each at most
/// `spare_len` bytes) move into `ours`, the rest is removed.
pub fn reclaim(root: &Path, ours: &Path, max_spares: usize, spare_len: u64) -> Reclaimed {
    let mut out = Reclaimed::default();
    let parent = root.join(WORK_DIR);
    let Ok(entries) = std::fs::read_dir(&parent) else {
        return out;
    };
    let nfs = on_nfs(root);
    let mut seq = 0u64;
    for entry in entries.flatten() {
        let dir = entry.path();
        if dir == ours || !entry.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let name = entry.file_name().to_string_lossy().to_string();
        if name.starts_with('.') {
            // Being created; or left by a creator that died midway.
            if older_than(&dir, CREATING_MAX_AGE) {
                out.removed += remove_dir_files(&dir);
            }
            continue;
        }
        let Ok(lock) = File::open(dir.join(LOCK_FILE)) else {
            continue; // not a work directory of ours
        };
        if !try_lock(&lock) {
            continue; // its owner is alive
        }
        let closed = dir.join(CLOSED_FILE).exists();
        if nfs && !closed && !older_than(&dir.join(LOCK_FILE), NFS_STALE_AFTER) {
            continue; // a lock local to another host: trust the heartbeat
        }
        let opener = Opener::new(false, false);
        for f in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let path = f.path();
            let fname = f.file_name().to_string_lossy().to_string();
            if fname.starts_with(SPARE_PREFIX) && out.spares.len() < max_spares {
                // Checked as any spare before it is handed out; moved now so
                // that the directory can go.
                if opener.reuse(&path, spare_len).is_some() {
                    let to = ours.join(format!("{SPARE_PREFIX}a{seq}"));
                    seq += 1;
                    if std::fs::rename(&path, &to).is_ok() {
                        out.spares.push(to);
                        continue;
                    }
                }
            }
            remove_entry(&path);
            out.removed += usize::from(!is_marker(&fname));
        }
        let _ = std::fs::remove_dir(&dir);
    }
    out
}

/// The lock file and the `closed` marker: bookkeeping of a work
/// directory, not files its instance left behind.
fn is_marker(name: &str) -> bool {
    name == LOCK_FILE || name == CLOSED_FILE
}

fn remove_dir_files(dir: &Path) -> usize {
    let mut n = 0;
    for f in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        remove_entry(&f.path());
        n += usize::from(!is_marker(&f.file_name().to_string_lossy()));
    }
    let _ = std::fs::remove_dir(dir);
    n
}

fn older_than(path: &Path, age: Duration) -> bool {
    std::fs::symlink_metadata(path)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.elapsed().ok())
        .is_some_and(|a| a >= age)
}

/// True when `dir` is on NFS, where `flock` may not reach other hosts.
fn on_nfs(dir: &Path) -> bool {
    const NFS_SUPER_MAGIC: i64 = 0x6969;
    let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()) else {
        return false;
    };
    // SAFETY: statfs is plain old data; zeroed is a valid value, and `c`
    // is a valid NUL-terminated path for the duration of the call.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    (unsafe { libc::statfs(c.as_ptr(), &mut st) }) == 0 && st.f_type as i64 == NFS_SUPER_MAGIC
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn live_instances_are_left_alone_and_dead_ones_reclaimed() {
        let d = tempfile::tempdir().unwrap();
        let roots = vec![d.path().to_path_buf()];
        let (a, b) = (Paths::new(roots.clone()), Paths::new(roots.clone()));
        let wa = WorkDirs::create(&a).unwrap();
        let wb = WorkDirs::create(&b).unwrap();
        std::fs::write(a.work_dir(0).join("spare.1"), [0u8; 10]).unwrap();
        std::fs::write(a.work_dir(0).join("0011.1"), b"x").unwrap();
        // A is alive: B takes nothing.
        let r = reclaim(d.path(), &b.work_dir(0), 8, 100);
        assert!(r.spares.is_empty() && r.removed == 0);
        assert!(a.work_dir(0).join("spare.1").exists());
        wa.close();
        let r = reclaim(d.path(), &b.work_dir(0), 8, 100);
        assert_eq!(r.spares.len(), 1);
        assert!(r.spares[0].starts_with(b.work_dir(0)));
        assert_eq!(
            r.removed, 1,
            "the temporary; not the lock or the closed marker"
        );
        assert!(!a.work_dir(0).exists());
        drop(wb);
        // Killed (no closed marker, lock released by the kernel).
        let c = Paths::new(roots);
        let _wc = WorkDirs::create(&c).unwrap();
        let r = reclaim(d.path(), &c.work_dir(0), 8, 100);
        assert_eq!(r.spares.len(), 1, "B's adopted spare");
    }
}
