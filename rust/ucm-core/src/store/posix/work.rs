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
//! place, so nobody ever sees a live instance's directory unlocked. Every
//! directory here is opened without following links: `.work` replaced by
//! a link is removed as the link and made again, and an instance keeps its
//! own directory open, so a link put at its name later leads nowhere.

use std::fs::File;
use std::time::{Duration, SystemTime};

use parking_lot::{Mutex, RwLock, RwLockReadGuard};
use rustix::fs::OFlags;

use super::files::{try_lock, Dir, Opener, LOCK_FILE, WORK_DIR};
use super::tree::Tree;
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
pub const CLOSED_FILE: &str = "closed";
/// Prefix of spare files inside a work directory.
pub const SPARE_PREFIX: &str = "spare.";

/// One root's work directory of this instance.
struct Own {
    dir: RwLock<Dir>,
    lock: Mutex<Option<File>>,
    nfs: bool,
}

/// The work directories of one live instance, one per root, locked.
pub struct WorkDirs {
    token: String,
    roots: Vec<Own>,
    /// Each root, open, to make the directory again if it is removed.
    tree_roots: Vec<Dir>,
}

/// `<root>/.work`, open. A link there is removed (the link itself) and the
/// directory made again when `repair`; missing, it is made when `repair`.
pub fn work_parent(root: &Dir, repair: bool) -> Result<Dir> {
    match root.sub(WORK_DIR) {
        Ok(d) => return Ok(d),
        Err(e) if !repair => return Err(UcmError::os("open", root.join(WORK_DIR), e)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            let is_link = root
                .lstat(WORK_DIR)
                .is_ok_and(|s| s.kind == rustix::fs::FileType::Symlink);
            if !is_link {
                return Err(UcmError::os("open", root.join(WORK_DIR), e));
            }
            log::warn!(
                "{} is a symbolic link, not the store's work directory: removed the link \
                 (not what it points to) and made the directory again",
                root.join(WORK_DIR).display()
            );
            let _ = root.remove_file(WORK_DIR);
        }
    }
    root.mkdir(WORK_DIR, 0o700)
        .map_err(|e| UcmError::os("mkdir", root.join(WORK_DIR), e))?;
    root.sub(WORK_DIR)
        .map_err(|e| UcmError::os("open", root.join(WORK_DIR), e))
}

/// Makes and locks this instance's directory `token` under `root`'s
/// `.work`: made under a hidden name, locked, then renamed into place.
fn make_own(root: &Dir, token: &str) -> Result<(Dir, File)> {
    let parent = work_parent(root, true)?;
    let hidden = format!(".{token}.new");
    let made = parent
        .mkdir(&hidden, 0o700)
        .map_err(|e| UcmError::os("mkdir", parent.join(&hidden), e))?;
    if !made {
        return Err(UcmError::os(
            "mkdir",
            parent.join(&hidden),
            std::io::Error::from_raw_os_error(libc::EEXIST),
        ));
    }
    let dir = parent
        .sub(&hidden)
        .map_err(|e| UcmError::os("open", parent.join(&hidden), e))?;
    // Created, then held open read-only: a file open for writing would
    // keep the file system from being remounted read-only.
    drop(
        dir.create_file(LOCK_FILE, 0o600, OFlags::empty())
            .map_err(|e| UcmError::os("create", dir.join(LOCK_FILE), e))?,
    );
    let lock = dir
        .open_file(LOCK_FILE, OFlags::RDONLY)
        .map_err(|e| UcmError::os("open", dir.join(LOCK_FILE), e))?;
    if !try_lock(&lock) {
        return Err(UcmError::os(
            "flock",
            dir.join(LOCK_FILE),
            std::io::Error::last_os_error(),
        ));
    }
    parent
        .rename(&hidden, &parent, token)
        .map_err(|e| UcmError::os("rename", parent.join(&hidden), e))?;
    let dir = parent
        .sub(token)
        .map_err(|e| UcmError::os("open", parent.join(token), e))?;
    Ok((dir, lock))
}

impl WorkDirs {
    /// Creates and locks this instance's directory under every root.
    pub fn create(tree: &Tree) -> Result<Self> {
        let mut roots = Vec::new();
        let mut tree_roots = Vec::new();
        for i in 0..tree.root_count() {
            let root = tree
                .root(i)
                .try_clone()
                .map_err(|e| UcmError::os("dup", tree.root(i).path(), e))?;
            let (dir, lock) = make_own(&root, tree.token())?;
            roots.push(Own {
                dir: RwLock::new(dir),
                lock: Mutex::new(Some(lock)),
                nfs: root.on_nfs(),
            });
            tree_roots.push(root);
        }
        Ok(WorkDirs {
            token: tree.token().to_string(),
            roots,
            tree_roots,
        })
    }

    /// This instance's work directory under root `root`.
    pub fn dir(&self, root: usize) -> RwLockReadGuard<'_, Dir> {
        self.roots[root].dir.read()
    }

    /// Makes this instance's directory under root `root` again after it was
    /// removed under the running store (its temporaries and spares went
    /// with it); a no-op while it is still there.
    pub fn remake(&self, root: usize) -> Result<()> {
        let own = &self.roots[root];
        let mut dir = own.dir.write();
        if dir.stat().is_ok_and(|s| s.nlink > 0) {
            return Ok(());
        }
        let (new_dir, lock) = make_own(&self.tree_roots[root], &self.token)?;
        log::warn!(
            "the store's work directory {} was removed while it ran; made it again",
            new_dir.path().display()
        );
        *dir = new_dir;
        *own.lock.lock() = Some(lock);
        Ok(())
    }

    /// Refreshes the lock files' mtime where other hosts may need it (NFS).
    pub fn heartbeat(&self) {
        for own in &self.roots {
            if own.nfs {
                if let Some(lock) = own.lock.lock().as_ref() {
                    let _ = lock.set_modified(SystemTime::now());
                }
            }
        }
    }

    /// Marks every directory closed (its spares are for the next instance
    /// to adopt) and releases the locks.
    pub fn close(&self) {
        for own in &self.roots {
            let _ = own
                .dir
                .read()
                .create_file(CLOSED_FILE, 0o600, OFlags::empty());
            own.lock.lock().take();
        }
    }
}

/// What [`reclaim`] did under one root.
#[derive(Debug, Default)]
pub struct Reclaimed {
    /// Spare files of dead instances, now inside the caller's directory
    /// (their names there).
    pub spares: Vec<String>,
    /// Files of dead instances removed: temporaries and spares beyond the
    /// pool's room, not the lock files and `closed` markers every stopped
    /// instance leaves (those say nothing about what it left undone).
    pub removed: usize,
    /// Bytes of the spare files removed (the roots' usage counted them;
    /// a temporary counts only once published).
    pub removed_bytes: u64,
}

/// Reclaims the work directories of dead instances under `root`: their
/// spares (checked like any spare, at most `max_spares`, each at most
/// `spare_len` bytes) move into `ours` (this instance's directory, named
/// `ours_name` in `.work`), the rest is removed. Nothing is followed: a
/// link in `.work` is left alone, and `.work` itself must be a directory.
pub fn reclaim(
    root: &Dir,
    ours: Option<(&Dir, &str)>,
    max_spares: usize,
    spare_len: u64,
) -> Reclaimed {
    let mut out = Reclaimed::default();
    let Ok(parent) = root.sub(WORK_DIR) else {
        return out;
    };
    let Ok(entries) = parent.entries() else {
        return out;
    };
    let nfs = root.on_nfs();
    let mut seq = 0u64;
    for entry in entries {
        let name = entry.name.to_string_lossy().to_string();
        if ours.is_some_and(|(_, n)| n == name) {
            continue;
        }
        if parent.kind_of(&entry) != Some(rustix::fs::FileType::Directory) {
            continue;
        }
        let Ok(dir) = parent.sub(&entry.name) else {
            continue; // replaced meanwhile
        };
        if name.starts_with('.') {
            // Being created; or left by a creator that died midway.
            if older_than(&dir, ".", CREATING_MAX_AGE) {
                out.removed += remove_dir_files(&dir);
                let _ = parent.remove_dir(&entry.name);
            }
            continue;
        }
        let Ok(lock) = dir.open_file(LOCK_FILE, OFlags::RDONLY) else {
            continue; // not a work directory of ours
        };
        if !lock.metadata().is_ok_and(|m| m.file_type().is_file()) || !try_lock(&lock) {
            continue; // its owner is alive
        }
        let closed = dir.lstat(CLOSED_FILE).is_ok();
        if nfs && !closed && !older_than(&dir, LOCK_FILE, NFS_STALE_AFTER) {
            continue; // a lock local to another host: trust the heartbeat
        }
        let opener = Opener::new(false, false);
        for f in dir.entries().into_iter().flatten() {
            let fname = f.name.to_string_lossy().to_string();
            if let Some((ours, _)) = ours {
                if fname.starts_with(SPARE_PREFIX) && out.spares.len() < max_spares {
                    // Checked as any spare before it is handed out; moved now
                    // so that the directory can go.
                    if opener.reuse(&dir, &fname, spare_len).is_some() {
                        let to = format!("{SPARE_PREFIX}a{seq}");
                        seq += 1;
                        if dir.rename_noreplace(&f.name, ours, &to).is_ok() {
                            out.spares.push(to);
                            continue;
                        }
                    }
                }
            }
            if fname.starts_with(SPARE_PREFIX) {
                if let Ok(st) = dir.lstat(&f.name) {
                    if st.is_file() {
                        out.removed_bytes += st.len;
                    }
                }
            }
            dir.remove_entry(&f.name);
            out.removed += usize::from(!is_marker(&fname));
        }
        let _ = parent.remove_dir(&entry.name);
    }
    out
}

/// The lock file and the `closed` marker: bookkeeping of a work
/// directory, not files its instance left behind.
fn is_marker(name: &str) -> bool {
    name == LOCK_FILE || name == CLOSED_FILE
}

fn remove_dir_files(dir: &Dir) -> usize {
    let mut n = 0;
    for f in dir.entries().into_iter().flatten() {
        dir.remove_entry(&f.name);
        n += usize::from(!is_marker(&f.name.to_string_lossy()));
    }
    n
}

/// True when `name` in `dir` was last modified at least `age` ago.
pub(super) fn older_than(dir: &Dir, name: &str, age: Duration) -> bool {
    let Ok(st) = dir.lstat(name) else {
        return false;
    };
    let now = super::scan::nanos(SystemTime::now());
    now.saturating_sub(st.mtime_ns) >= age.as_nanos() as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::posix::tree::Tree;

    fn tree(d: &std::path::Path) -> Tree {
        Tree::open(&[d.to_path_buf()], true, false).unwrap()
    }

    #[test]
    fn live_instances_are_left_alone_and_dead_ones_reclaimed() {
        let d = tempfile::tempdir().unwrap();
        let (a, b) = (tree(d.path()), tree(d.path()));
        let wa = WorkDirs::create(&a).unwrap();
        let wb = WorkDirs::create(&b).unwrap();
        let a_dir = d.path().join(WORK_DIR).join(a.token());
        std::fs::write(a_dir.join("spare.1"), [0u8; 10]).unwrap();
        std::fs::write(a_dir.join("0011.1"), b"x").unwrap();
        let root = a.root(0);
        // A is alive: B takes nothing.
        let r = reclaim(root, Some((&wb.dir(0), b.token())), 8, 100);
        assert!(r.spares.is_empty() && r.removed == 0);
        assert!(a_dir.join("spare.1").exists());
        wa.close();
        let r = reclaim(root, Some((&wb.dir(0), b.token())), 8, 100);
        assert_eq!(r.spares.len(), 1);
        assert!(d
            .path()
            .join(WORK_DIR)
            .join(b.token())
            .join(&r.spares[0])
            .exists());
        assert_eq!(
            r.removed, 1,
            "the temporary; not the lock or the closed marker"
        );
        assert!(!a_dir.exists());
        drop(wb);
        // Killed (no closed marker, lock released by the kernel).
        let c = tree(d.path());
        let wc = WorkDirs::create(&c).unwrap();
        let r = reclaim(c.root(0), Some((&wc.dir(0), c.token())), 8, 100);
        assert_eq!(r.spares.len(), 1, "B's adopted spare");
    }

    /// `.work` replaced by a link to a user's folder holding files named
    /// like a dead instance's: nothing there is read, moved or deleted.
    #[test]
    fn a_linked_work_directory_is_never_followed() {
        let d = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let victim = outside.path().join("folder");
        std::fs::create_dir(&victim).unwrap();
        for f in [LOCK_FILE, CLOSED_FILE, "spare.1", "notes.txt"] {
            std::fs::write(victim.join(f), b"user data").unwrap();
        }
        std::os::unix::fs::symlink(outside.path(), d.path().join(WORK_DIR)).unwrap();
        let t = tree(d.path());
        let w = WorkDirs::create(&t).unwrap();
        let r = reclaim(t.root(0), Some((&w.dir(0), t.token())), 8, 100);
        assert!(r.spares.is_empty() && r.removed == 0);
        for f in [LOCK_FILE, CLOSED_FILE, "spare.1", "notes.txt"] {
            assert_eq!(std::fs::read(victim.join(f)).unwrap(), b"user data");
        }
        assert!(std::fs::symlink_metadata(d.path().join(WORK_DIR))
            .unwrap()
            .is_dir());
        // The instance's own directory replaced by a link: it keeps
        // writing where it was.
        let own = d.path().join(WORK_DIR).join(t.token());
        std::fs::rename(&own, d.path().join(WORK_DIR).join("moved")).unwrap();
        std::os::unix::fs::symlink(&victim, &own).unwrap();
        w.dir(0).create_file("t", 0o600, OFlags::empty()).unwrap();
        assert!(!victim.join("t").exists());
        assert!(d.path().join(WORK_DIR).join("moved").join("t").exists());
    }

    #[test]
    fn a_removed_work_directory_is_made_again() {
        let d = tempfile::tempdir().unwrap();
        let t = tree(d.path());
        let w = WorkDirs::create(&t).unwrap();
        std::fs::remove_dir_all(d.path().join(WORK_DIR)).unwrap();
        assert!(w.dir(0).create_file("t", 0o600, OFlags::empty()).is_err());
        w.remake(0).unwrap();
        w.dir(0).create_file("t", 0o600, OFlags::empty()).unwrap();
        assert!(d.path().join(WORK_DIR).join(t.token()).join("t").exists());
        assert!(d
            .path()
            .join(WORK_DIR)
            .join(t.token())
            .join(LOCK_FILE)
            .exists());
    }
}
