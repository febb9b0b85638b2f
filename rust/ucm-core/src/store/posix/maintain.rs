//! [`Maintenance`] of Posix directories: the block files under each root's
//! 256 block directories, verified with the format's self-describing check
//! (no layout needed: the headers declare it).
//!
//! A directory is a store's only when it says so. It carries the marker
//! every store writes when it first opens there ([`marker`]); or it was
//! written before markers existed, and then the block files sampled from it
//! (the first of each block directory, up to [`ADOPT_SAMPLE`]) must all
//! carry a ucm block header naming their block: such a directory is marked
//! by the first command that removes something. Any other directory is
//! refused, naming it and why, before anything there is changed.
//!
//! Everything below a root is reached through open directories one name at
//! a time, never through a link ([`Dir`]): a block directory that is a link
//! is reported, not followed. A block file is removed only after it was
//! opened without following a link, found to be a regular file, and its
//! first header found to name that block; its name is then checked to
//! still be that very file (device and inode) and unlinked in its
//! directory. Someone who swaps the file between that check and the unlink
//! can write the block directory, and so could remove it anyway.

mod leftovers;

use std::ffi::OsStr;
use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, UNIX_EPOCH};

use rustix::fs::{FileType, OFlags};

use super::files::{kind_of, Dir};
use super::marker::{self, MARKER_FILE};
use super::tree::{bucket_name, Tree};
use super::usage::{Usage, USAGE_FILE};
use crate::block::BlockId;
use crate::error::{Damage, Result, UcmError};
use crate::store::maintain::{
    check_header, local_threads, map_parallel, BlockEntry, BlockVerifier, Check, Identity, Kept,
    Leftover, Listing, Maintenance, Progress, Removal, HEADER_READ,
};
use crate::store::safe_fs::{describe_kind, DirEntry};

/// Block files read to recognise a directory without a marker as a store.
pub const ADOPT_SAMPLE: usize = 64;
/// Bytes read at a time when verifying a block.
const READ_CHUNK: u64 = 1 << 20;

/// Maintenance of the blocks under `roots`.
pub struct PosixMaintenance {
    tree: Tree,
    identity: Vec<Identity>,
    /// Roots marked by this maintenance (adopted).
    marked: Vec<AtomicBool>,
    /// Bytes removed under each root, not yet in its usage record.
    freed: Vec<AtomicU64>,
    /// Each root's block directories, opened at first use and kept: a job
    /// over a million blocks opens each once, not once per block. Held
    /// open, a directory is the one found at its name then, whatever is
    /// put at that name later.
    buckets: Vec<OnceLock<Result<Option<Dir>>>>,
}

impl PosixMaintenance {
    /// Over existing store directories (nothing is created or repaired;
    /// nothing below a root is followed when it is a link). A directory
    /// that is not recognised as a store is an error naming it and why.
    pub fn new(roots: Vec<PathBuf>) -> Result<Self> {
        for (i, r) in roots.iter().enumerate() {
            if !r.is_dir() {
                return Err(UcmError::invalid(format!(
                    "storage_backends[{i}]: {} is not a directory",
                    r.display()
                )));
            }
        }
        let tree = Tree::open(&roots, false, false)?;
        let identity = (0..tree.root_count())
            .map(|i| recognise(&tree, i))
            .collect::<Result<Vec<_>>>()?;
        Ok(PosixMaintenance {
            marked: identity.iter().map(|_| AtomicBool::new(false)).collect(),
            freed: identity.iter().map(|_| AtomicU64::new(0)).collect(),
            buckets: (0..256 * identity.len()).map(|_| OnceLock::new()).collect(),
            identity,
            tree,
        })
    }

    /// Block `id`'s directory, open; None when there is none.
    fn bucket(&self, id: &BlockId) -> Result<Option<&Dir>> {
        let r = self.tree.root_index(id);
        let opened = self.buckets[r * 256 + usize::from(id.0[0])].get_or_init(|| {
            let root = self.tree.root(r);
            let name = bucket_name(id.0[0]);
            match root.sub(&name) {
                Ok(d) => Ok(Some(d)),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(e) => Err(UcmError::os("open", root.join(&name), e)),
            }
        });
        match opened {
            Ok(d) => Ok(d.as_ref()),
            Err(e) => Err(e.clone()),
        }
    }

    /// Runs `f` on the entries of every block directory, on the
    /// maintenance's threads; a block directory's name holding something
    /// else (a link, never followed) is reported in the listing's odd.
    fn each_bucket<T: Send>(
        &self,
        f: impl Fn(usize, u8, &Dir, Vec<DirEntry>) -> (Vec<T>, Vec<Kept>) + Sync,
    ) -> (Vec<T>, Vec<Kept>) {
        let mut tasks = Vec::new();
        let mut odd = Vec::new();
        for r in 0..self.tree.root_count() {
            let root = self.tree.root(r);
            for e in root.entries().into_iter().flatten() {
                if let Some(b) = e.name.to_str().and_then(bucket_of) {
                    tasks.push((r, b));
                }
            }
        }
        let progress = Progress::default();
        let done = map_parallel(&tasks, self.threads(), &progress, |&(r, b)| {
            let root = self.tree.root(r);
            let name = bucket_name(b);
            match root.sub(&name) {
                Ok(dir) => match dir.entries() {
                    Ok(entries) => Some(f(r, b, &dir, entries)),
                    Err(e) => Some((Vec::new(), vec![unreadable(&dir.join(""), e)])),
                },
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                Err(e) => {
                    let what = root
                        .lstat(&name)
                        .map_or("not a directory", |s| s.describe());
                    let reason = if e.kind() == std::io::ErrorKind::InvalidData {
                        format!("{what}, not a block directory: not followed")
                    } else {
                        format!("could not be opened: {e}")
                    };
                    Some((
                        Vec::new(),
                        vec![Kept::new(label(&root.join(&name)), reason)],
                    ))
                }
            }
        });
        let mut out = Vec::new();
        for (items, kept) in done {
            out.extend(items);
            odd.extend(kept);
        }
        odd.sort_by(|a, b| a.label.cmp(&b.label));
        (out, odd)
    }

    /// Root `i` as marked now.
    fn identity_of(&self, i: usize) -> Identity {
        if self.marked[i].load(Ordering::Acquire) {
            Identity::Marked {
                format: marker::FORMAT,
            }
        } else {
            self.identity[i]
        }
    }
}

/// Whether root `i` of `tree` is a store (see the module's doc).
fn recognise(tree: &Tree, i: usize) -> Result<Identity> {
    let root = tree.root(i);
    let path = root.path().display().to_string();
    let refuse = |why: String| {
        UcmError::invalid(format!(
            "storage_backends[{i}]: {path} is not a ucm store: {why}; nothing there was changed"
        ))
    };
    match marker::read(root) {
        Ok(Some(v)) if v > marker::FORMAT => Err(UcmError::invalid(format!(
            "storage_backends[{i}]: {path} was written by a newer ucm (store format {v}; this \
             version reads {}); nothing there was changed",
            marker::FORMAT
        ))),
        Ok(Some(format)) => Ok(Identity::Marked { format }),
        Ok(None) => sample(tree, i)
            .map(|sampled| Identity::Adoptable { sampled })
            .map_err(|why| refuse(format!("it has no {MARKER_FILE} marker, and {why}"))),
        Err(e) => Err(refuse(message(&e))),
    }
}

/// Checks the first block file of each block directory of root `i`, up to
/// [`ADOPT_SAMPLE`] of them: how many there were, or the first that is not
/// a ucm block file.
fn sample(tree: &Tree, i: usize) -> std::result::Result<usize, String> {
    let root = tree.root(i);
    let mut sampled = 0;
    for b in 0..=255u8 {
        if sampled == ADOPT_SAMPLE {
            break;
        }
        let Ok(dir) = root.sub(bucket_name(b)) else {
            continue; // none, or a link: never followed
        };
        let Ok(entries) = dir.entries() else { continue };
        let Some((name, id)) = entries
            .iter()
            .find_map(|e| block_in(tree, i, b, &e.name).map(|id| (e.name.clone(), id)))
        else {
            continue;
        };
        let name = name.to_string_lossy().to_string();
        match inspect(&dir, &name, &id) {
            Ok(Found::Ours(..)) => sampled += 1,
            Ok(Found::Gone) => {}
            Ok(Found::NotOurs(why)) => return Err(format!("{}: {why}", label(&dir.join(&name)))),
            Err(e) => return Err(message(&e)),
        }
    }
    if sampled == 0 {
        return Err("no block file to recognise it by".into());
    }
    Ok(sampled)
}

/// The message of `e` without its kind's prefix.
fn message(e: &UcmError) -> String {
    match e {
        UcmError::InvalidParam(m) => m.clone(),
        other => other.to_string(),
    }
}

fn label(path: &std::path::Path) -> String {
    path.display().to_string()
}

fn unreadable(path: &std::path::Path, e: std::io::Error) -> Kept {
    Kept::new(label(path), format!("could not be listed: {e}"))
}

/// The block directory a root's entry names (two lowercase hex digits).
fn bucket_of(name: &str) -> Option<u8> {
    let b = u8::from_str_radix(name, 16).ok()?;
    (bucket_name(b) == name).then_some(b)
}

/// The block whose file `name` is in block directory `b` of root `root`:
/// its exact name, in its own directory and root; None for anything else.
fn block_in(tree: &Tree, root: usize, b: u8, name: &OsStr) -> Option<BlockId> {
    let name = name.to_str()?;
    // Lowercase only, as stores name them (checked without an allocation:
    // a listing goes through every name of the store).
    let lowercase = name.bytes().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f'));
    let id = BlockId::from_hex(name).filter(|_| lowercase)?;
    (id.0[0] == b && tree.root_index(&id) == root).then_some(id)
}

/// What sits at a block's name, opened (a regular file) or why not.
enum Found {
    /// A regular file, opened (by [`inspect`]: one whose first header
    /// names the block).
    Ours(File, std::fs::Metadata),
    /// Nothing.
    Gone,
    /// Something else.
    NotOurs(String),
}

/// Opens the regular file `name` of `dir` for reading, never following a
/// link and never opening anything else (opening a device can have side
/// effects; a FIFO would block): the file, or what sits there instead.
fn open_regular(dir: &Dir, name: &str) -> Result<Found> {
    let path = || dir.join(name);
    let not_block = |what: &str| Ok(Found::NotOurs(format!("{what}, not a block file")));
    match dir.lstat(name) {
        Ok(st) if !st.is_file() => return not_block(st.describe()),
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Found::Gone),
        Err(e) => return Err(UcmError::os("stat", path(), e)),
    }
    // Opened as `Dir::open_file` does, less the two calls that clear
    // O_NONBLOCK again: reads of a regular file ignore it (and nothing else
    // is read), and a job over a million blocks makes this call a million
    // times.
    let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC;
    let opened = rustix::fs::openat(dir, name, flags, rustix::fs::Mode::empty());
    let file = match opened.map(File::from).map_err(std::io::Error::from) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Found::Gone),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => return not_block("a symbolic link"),
        Err(e) => return Err(UcmError::os("open", path(), e)),
    };
    // Swapped between the lstat and the open?
    let meta = file
        .metadata()
        .map_err(|e| UcmError::os("fstat", path(), e))?;
    if !meta.file_type().is_file() {
        return not_block(kind_of(&meta));
    }
    Ok(Found::Ours(file, meta))
}

/// Reads at most `buf.len()` bytes at `offset`, fewer only at the end.
fn read_at_most(file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

/// Whether `name` in `dir` is a ucm block file of block `id` (see
/// [`check_header`]).
fn inspect(dir: &Dir, name: &str, id: &BlockId) -> Result<Found> {
    let (file, meta) = match open_regular(dir, name)? {
        Found::Ours(file, meta) => (file, meta),
        other => return Ok(other),
    };
    let mut head = vec![0u8; meta.len().min(HEADER_READ as u64) as usize];
    let n =
        read_at_most(&file, &mut head, 0).map_err(|e| UcmError::os("read", dir.join(name), e))?;
    Ok(match check_header(&head[..n], id) {
        Ok(()) => Found::Ours(file, meta),
        Err(why) => Found::NotOurs(why),
    })
}

impl Maintenance for PosixMaintenance {
    fn location(&self) -> String {
        self.tree
            .root_paths()
            .iter()
            .map(|r| r.display().to_string())
            .collect::<Vec<_>>()
            .join(":")
    }

    fn identity(&self) -> Vec<(String, Identity)> {
        (0..self.tree.root_count())
            .map(|i| (label(self.tree.root(i).path()), self.identity_of(i)))
            .collect()
    }

    fn adopt(&self) -> Result<Vec<String>> {
        let mut marked = Vec::new();
        for i in 0..self.tree.root_count() {
            if matches!(self.identity_of(i), Identity::Adoptable { .. }) {
                marker::ensure(self.tree.root(i))?;
                self.marked[i].store(true, Ordering::Release);
                marked.push(label(self.tree.root(i).path()));
            }
        }
        Ok(marked)
    }

    fn list(&self, detail: bool) -> Result<Listing> {
        let (blocks, odd) = self.each_bucket(|r, b, dir, entries| {
            let mut blocks = Vec::new();
            let mut odd = Vec::new();
            for e in entries {
                let Some(id) = block_in(&self.tree, r, b, &e.name) else {
                    continue;
                };
                let kind = dir.kind_of(&e);
                if kind != Some(FileType::RegularFile) {
                    let what = kind.map_or("gone", describe_kind);
                    if kind.is_some() {
                        odd.push(Kept::new(
                            label(&dir.join(&e.name)),
                            format!("{what} at a block's name, not a block file: left alone"),
                        ));
                    }
                    continue;
                }
                // Without detail, the first block of each directory is
                // the sample the bytes are estimated from.
                let st = (detail || blocks.is_empty())
                    .then(|| dir.lstat(&e.name).ok())
                    .flatten()
                    .filter(|st| st.is_file());
                blocks.push(BlockEntry {
                    id,
                    bytes: st.map(|s| s.len),
                    modified: st
                        .filter(|_| detail)
                        .map(|s| UNIX_EPOCH + Duration::from_nanos(s.mtime_ns)),
                });
            }
            (blocks, odd)
        });
        Ok(Listing { blocks, odd })
    }

    fn block_label(&self, id: &BlockId) -> String {
        label(&self.tree.block_path(id))
    }

    fn verify(&self, id: &BlockId) -> Result<()> {
        // Named in errors only: no path is built for a block that verifies.
        let path = || self.tree.block_path(id);
        let gone = || UcmError::NotFound(format!("block file {}", path().display()));
        let dir = self.bucket(id)?.ok_or_else(gone)?;
        let (file, meta) = match open_regular(dir, &id.hex())? {
            Found::Ours(file, meta) => (file, meta),
            Found::NotOurs(why) => {
                return Err(UcmError::corrupt(
                    Damage::NotBlockFile,
                    Some(*id),
                    None,
                    format!("{}: {why}", path().display()),
                ))
            }
            Found::Gone => return Err(gone()),
        };
        let read_err = |e| UcmError::os("read", path(), e);
        let mut buf = vec![0u8; meta.len().min(READ_CHUNK) as usize];
        let n = read_at_most(&file, &mut buf, 0).map_err(read_err)?;
        let mut v = BlockVerifier::new(&buf[..n.min(HEADER_READ)], id, meta.len())?;
        v.feed(&buf[..n])?;
        let mut at = n as u64;
        while v.remaining() > 0 {
            let n = read_at_most(&file, &mut buf, at).map_err(read_err)?;
            if n == 0 {
                break;
            }
            v.feed(&buf[..n])?;
            at += n as u64;
        }
        v.finish().map(drop)
    }

    fn check(&self, id: &BlockId) -> Result<Check> {
        let Some(dir) = self.bucket(id)? else {
            return Ok(Check::Gone);
        };
        Ok(match inspect(dir, &id.hex(), id)? {
            Found::Ours(_, meta) => Check::Ours { bytes: meta.len() },
            Found::Gone => Check::Gone,
            Found::NotOurs(why) => Check::NotOurs(why),
        })
    }

    fn remove(&self, id: &BlockId) -> Result<Removal> {
        let Some(dir) = self.bucket(id)? else {
            return Ok(Removal::Gone);
        };
        let name = id.hex();
        let (file, meta) = match inspect(dir, &name, id)? {
            Found::Ours(file, meta) => (file, meta),
            Found::Gone => return Ok(Removal::Gone),
            Found::NotOurs(why) => return Ok(Removal::Kept(why)),
        };
        // The name must still be the file whose header was read.
        match dir.lstat(&name) {
            Ok(st) if st.dev == meta.dev() && st.ino == meta.ino() => {}
            Ok(_) => {
                return Ok(Removal::Kept(
                    "replaced while it was checked: left for the next run".into(),
                ))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Removal::Gone),
            Err(e) => return Err(UcmError::os("stat", dir.join(&name), e)),
        }
        match dir.remove_file(&name) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Removal::Gone),
            Err(e) => return Err(UcmError::os("unlink", dir.join(&name), e)),
        }
        drop(file);
        self.freed[self.tree.root_index(id)].fetch_add(meta.len(), Ordering::AcqRel);
        Ok(Removal::Removed { bytes: meta.len() })
    }

    fn leftovers(&self) -> Result<(Vec<Leftover>, Vec<Kept>)> {
        let (mut found, mut kept) = leftovers::work_dirs(&self.tree);
        let (temps, odd) = self.each_bucket(|r, b, dir, entries| {
            (
                leftovers::idle_temps(&self.tree, r, b, dir, entries),
                Vec::new(),
            )
        });
        found.extend(temps);
        kept.extend(odd);
        Ok((found, kept))
    }

    fn remove_leftover(&self, leftover: &Leftover) -> Result<Removal> {
        let (removal, root, counted) = leftovers::remove(&self.tree, leftover)?;
        if counted > 0 {
            self.freed[root].fetch_add(counted, Ordering::AcqRel);
        }
        Ok(removal)
    }

    /// Takes what was removed off the roots' usage records, so that live
    /// stores' capacities count the directory as it is. Only records that
    /// are there: a missing one is counted afresh by the next store to open.
    fn finish(&self) {
        let freed: Vec<u64> = self
            .freed
            .iter()
            .map(|f| f.swap(0, Ordering::AcqRel))
            .collect();
        if freed.iter().all(|&b| b == 0) {
            return;
        }
        let recorded = (0..self.tree.root_count()).all(|i| {
            self.tree
                .root(i)
                .lstat(USAGE_FILE)
                .is_ok_and(|s| s.is_file())
        });
        if !recorded {
            return;
        }
        if let Ok(usage) = Usage::open(&self.tree) {
            for (i, bytes) in freed.into_iter().enumerate() {
                usage.add(i, -i64::try_from(bytes).unwrap_or(i64::MAX));
            }
        }
    }

    fn threads(&self) -> usize {
        local_threads()
    }
}

#[cfg(test)]
mod tests;
