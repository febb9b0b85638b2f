//! The store's tree of directories under its roots, reached only through
//! open descriptors (see [`Tree`]).

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use super::files::random_token;
use crate::block::BlockId;
use crate::error::{Result, UcmError};
use crate::store::safe_fs::Dir;

/// Lowercase hex names of the 256 block directories under a root.
pub fn bucket_name(b: u8) -> String {
    format!("{b:02x}")
}

/// One root of the store, held open: every directory below it is reached
/// through it one name at a time, never through a link.
struct Root {
    path: PathBuf,
    dir: Dir,
    /// Block directories found replaced by something else, warned about
    /// once each (one bit per directory).
    warned: [AtomicU64; 4],
}

impl Root {
    /// True the first time block directory `b` is reported.
    fn first_warning(&self, b: u8) -> bool {
        let bit = 1u64 << (b % 64);
        self.warned[usize::from(b / 64)].fetch_or(bit, Ordering::Relaxed) & bit == 0
    }
}

/// The store's tree of block files under its roots.
///
/// Directories below a root are opened one name at a time relative to an
/// open descriptor and never followed when they are links (see
/// [`crate::store::safe_fs::Dir`]): a block directory replaced by a link
/// to a folder outside the store is removed as the link itself (by a store
/// that writes) and made again, so nothing ever reads, writes or deletes
/// through it.
pub struct Tree {
    roots: Vec<Root>,
    token: String,
    /// Repair (remove links, make missing directories): stores that write.
    repair: bool,
    /// Sync a directory's parent after making it (`durability: full`).
    sync_dirs: bool,
}

impl Tree {
    /// Opens the roots (which must exist; a root may be a link the user
    /// made). `repair` lets the tree make missing block directories and
    /// replace links at their names; `sync_dirs` makes each new one durable.
    pub fn open(roots: &[PathBuf], repair: bool, sync_dirs: bool) -> Result<Self> {
        let roots = roots
            .iter()
            .enumerate()
            .map(|(i, path)| {
                let dir = Dir::open(path).map_err(|e| {
                    UcmError::invalid(format!(
                        "storage_backends[{i}]: directory {} is not usable: {e}",
                        path.display()
                    ))
                })?;
                Ok(Root {
                    path: path.clone(),
                    dir,
                    warned: Default::default(),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Tree {
            roots,
            token: random_token(),
            repair,
            sync_dirs,
        })
    }

    /// The token of this store instance (its work directories' name).
    pub fn token(&self) -> &str {
        &self.token
    }

    /// The store's root directories, as configured.
    pub fn root_paths(&self) -> Vec<PathBuf> {
        self.roots.iter().map(|r| r.path.clone()).collect()
    }

    /// Number of roots.
    pub fn root_count(&self) -> usize {
        self.roots.len()
    }

    /// Root `i`, open.
    pub fn root(&self, i: usize) -> &Dir {
        &self.roots[i].dir
    }

    /// Index of the root a block lives under.
    pub fn root_index(&self, id: &BlockId) -> usize {
        (id.prefix_u64() % self.roots.len() as u64) as usize
    }

    /// Name of the block's file inside its block directory.
    pub fn block_name(id: &BlockId) -> String {
        id.hex()
    }

    /// Where the block's file is, for messages and tools.
    pub fn block_path(&self, id: &BlockId) -> PathBuf {
        self.roots[self.root_index(id)]
            .path
            .join(bucket_name(id.0[0]))
            .join(id.hex())
    }

    /// The block's directory, open. Missing: made by a store that repairs,
    /// else [`UcmError::NotFound`]. A link or anything else that is not a
    /// directory at its name: a link is removed (the link itself) and the
    /// directory made again by a store that repairs; otherwise the block's
    /// operation fails naming it. Either is logged once per directory.
    pub fn bucket(&self, id: &BlockId) -> Result<Dir> {
        self.bucket_at(self.root_index(id), id.0[0])
    }

    /// Block directory `b` of root `root` (see [`Tree::bucket`]).
    pub fn bucket_at(&self, root: usize, b: u8) -> Result<Dir> {
        let r = &self.roots[root];
        let name = bucket_name(b);
        match r.dir.sub(&name) {
            Ok(d) => Ok(d),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                if !self.repair {
                    return Err(UcmError::NotFound(format!(
                        "block directory {} does not exist",
                        r.dir.join(&name).display()
                    )));
                }
                self.make_bucket(r, &name)
            }
            Err(e) => {
                let is_link = r
                    .dir
                    .lstat(&name)
                    .is_ok_and(|s| s.kind == rustix::fs::FileType::Symlink);
                if is_link && self.repair {
                    if r.first_warning(b) {
                        log::warn!(
                            "{} is a symbolic link, not a block directory: removed the link \
                             (not what it points to) and made the directory again",
                            r.dir.join(&name).display()
                        );
                    }
                    let _ = r.dir.remove_file(&name);
                    return self.make_bucket(r, &name);
                }
                if r.first_warning(b) {
                    log::warn!("{e}: the store neither reads nor writes blocks there");
                }
                Err(UcmError::os("open", r.dir.join(&name), e))
            }
        }
    }

    fn make_bucket(&self, r: &Root, name: &str) -> Result<Dir> {
        let made = r
            .dir
            .mkdir(name, 0o700)
            .map_err(|e| UcmError::os("mkdir", r.dir.join(name), e))?;
        if made && self.sync_dirs {
            r.dir
                .sync()
                .map_err(|e| UcmError::os("fsync", &r.path, e))?;
        }
        r.dir
            .sub(name)
            .map_err(|e| UcmError::os("open", r.dir.join(name), e))
    }

    /// Makes (or repairs) the 256 block directories of every root, mode
    /// 0700; with `sync_dirs`, each root is synced once after.
    pub fn create_dirs(&self) -> Result<()> {
        for (i, r) in self.roots.iter().enumerate() {
            let mut made = false;
            for b in 0..=255u8 {
                let name = bucket_name(b);
                match r.dir.mkdir(&name, 0o700) {
                    Ok(true) => made = true,
                    Ok(false) => {
                        // There already: a directory, or repaired now.
                        self.bucket_at(i, b)?;
                    }
                    Err(e) => return Err(UcmError::os("mkdir", r.dir.join(&name), e)),
                }
            }
            if made && self.sync_dirs {
                r.dir
                    .sync()
                    .map_err(|e| UcmError::os("fsync", &r.path, e))?;
            }
        }
        Ok(())
    }
}

/// A tree over one new temporary directory (returned too: it lives as
/// long as the caller keeps it), with the store's directories made.
#[cfg(test)]
pub(crate) fn temp_tree() -> (tempfile::TempDir, Tree) {
    let d = tempfile::tempdir().unwrap();
    let tree = Tree::open(&[d.path().to_path_buf()], true, false).unwrap();
    tree.create_dirs().unwrap();
    (d, tree)
}
