//! [`Maintenance`] of an NFS store. Through a kernel mount the export is a
//! directory with the Posix store's layout (`<root>/<2 hex>/<32 hex>`), so
//! the Posix maintenance serves it as is, marker rule included (the NFS
//! stage writes no marker: an export written by it is recognised by its
//! blocks, and marked by the first removal). Through the built-in client
//! ([`RemoteMaintenance`]) the block directories are listed with
//! READDIRPLUS and blocks read with the store's own reads; the client only
//! ever reaches the 256 block directories by name, and there each file is
//! checked on its own before it is removed (its first header must name the
//! block of its name), so no marker is asked for. Either way the clean-up
//! removes, of what writers leave, only temporaries idle for an hour,
//! which no live writer leaves that long (it abandons a block after twice
//! the task timeout).

use std::time::{Duration, SystemTime};

use nfs3_client::nfs3_types::nfs3::{fattr3, ftype3};

use super::config::{NfsConfig, Target};
use super::fs::Fs;
use super::{NfsBackend, NfsStore};
use crate::block::BlockId;
use crate::error::{Result, UcmError};
use crate::store::format::codec::block_key;
use crate::store::maintain::{
    check_header, BlockEntry, BlockVerifier, Check, ItemKind, Kept, Leftover, Listing, Maintenance,
    Place, Removal, HEADER_READ,
};
use crate::store::posix::PosixMaintenance;

/// Temporaries idle this long belong to writers that are gone.
const TEMP_MAX_AGE: Duration = Duration::from_secs(3600);
/// Requests in flight for a job over many blocks.
const THREADS: usize = 16;
/// Bytes read at a time when verifying a block.
const READ_CHUNK: u64 = 1 << 20;

/// The maintenance of the NFS store `cfg` names (its geometry is not used).
pub fn maintenance(cfg: &NfsConfig) -> Result<Box<dyn Maintenance>> {
    match cfg.parse_target()?.0 {
        Target::Mounted(dir) => Ok(Box::new(PosixMaintenance::new(vec![dir])?)),
        Target::Remote { .. } => Ok(Box::new(RemoteMaintenance::open(cfg.clone())?)),
    }
}

/// Maintenance of an export reached by the built-in NFSv3 client.
pub struct RemoteMaintenance {
    store: NfsStore,
}

impl RemoteMaintenance {
    /// Mounts the export as a lookup-only store would (nothing is created).
    pub fn open(mut cfg: NfsConfig) -> Result<Self> {
        cfg.device_id = -1;
        Ok(RemoteMaintenance {
            store: NfsStore::open(cfg)?,
        })
    }

    fn label_of(&self, dir: &str, name: &str) -> String {
        format!("{}/{dir}/{name}", self.store.backend().label)
    }
}

/// Every entry of the 256 block directories: (directory, name, attributes).
async fn entries(b: &NfsBackend) -> Result<Vec<(String, String, fattr3)>> {
    let Fs::Remote(remote) = &b.fs else {
        return Err(UcmError::invalid("not an export of the built-in client"));
    };
    let mut out = Vec::new();
    for d in 0..=255u8 {
        let dir = format!("{d:02x}");
        for (name, attrs) in remote.list_dir(&dir).await? {
            if let Some(a) = attrs {
                out.push((dir.clone(), name, a));
            }
        }
    }
    Ok(out)
}

/// The block at `dir`/`name`, if that is a block's place.
fn block_at(dir: &str, name: &str) -> Option<BlockId> {
    let id = BlockId::from_hex(name)?;
    let (d, n) = block_key(&id);
    (d == dir && n == name).then_some(id)
}

fn mtime(a: &fattr3) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::new(a.mtime.seconds.into(), a.mtime.nseconds)
}

/// The block a temporary (`<32 hex>.tmp.<writer>.<seq>`) was written for.
fn temp_of(dir: &str, name: &str) -> Option<BlockId> {
    let (hex, writer) = name.split_once(".tmp.")?;
    let ours = !writer.is_empty()
        && writer
            .bytes()
            .all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f' | b'.'));
    block_at(dir, hex).filter(|_| ours)
}

/// Whether the file at block `id`'s place is a ucm block file of it.
async fn inspect(b: &NfsBackend, id: &BlockId) -> Result<Check> {
    let Some(size) = b.fs.size_of(id).await? else {
        return Ok(Check::Gone);
    };
    let n = size.min(HEADER_READ as u64) as usize;
    let head = b.fs.read(id, 0, n).await?;
    Ok(match check_header(&head, id) {
        Ok(()) => Check::Ours { bytes: size },
        Err(why) => Check::NotOurs(why),
    })
}

impl Maintenance for RemoteMaintenance {
    fn location(&self) -> String {
        self.store.backend().label.clone()
    }

    /// READDIRPLUS gives every file's size and time: `detail` costs nothing.
    fn list(&self, _detail: bool) -> Result<Listing> {
        let found = self
            .store
            .run_on_backend(|b| async move { entries(&b).await })?;
        let mut listing = Listing::default();
        for (dir, name, a) in found {
            let Some(id) = block_at(&dir, &name) else {
                continue;
            };
            if matches!(a.type_, ftype3::NF3REG) {
                listing.blocks.push(BlockEntry {
                    id,
                    bytes: Some(a.size),
                    modified: Some(mtime(&a)),
                });
            } else {
                listing.odd.push(Kept::new(
                    self.label_of(&dir, &name),
                    format!(
                        "{:?} at a block's name, not a block file: left alone",
                        a.type_
                    ),
                ));
            }
        }
        Ok(listing)
    }

    fn block_label(&self, id: &BlockId) -> String {
        let (d, n) = block_key(id);
        self.label_of(&d, &n)
    }

    fn verify(&self, id: &BlockId) -> Result<()> {
        let id = *id;
        self.store.run_on_backend(move |b| async move {
            let Some(size) = b.fs.size_of(&id).await? else {
                return Err(UcmError::NotFound(format!("block {id}")));
            };
            let chunk = |at: u64| (size - at).min(READ_CHUNK) as usize;
            let first = b.fs.read(&id, 0, chunk(0)).await?;
            let mut v = BlockVerifier::new(&first[..first.len().min(HEADER_READ)], &id, size)?;
            v.feed(&first)?;
            let mut at = first.len() as u64;
            while v.remaining() > 0 {
                let more = b.fs.read(&id, at, chunk(at)).await?;
                if more.is_empty() {
                    break;
                }
                v.feed(&more)?;
                at += more.len() as u64;
            }
            v.finish().map(drop)
        })
    }

    fn check(&self, id: &BlockId) -> Result<Check> {
        let id = *id;
        self.store
            .run_on_backend(move |b| async move { inspect(&b, &id).await })
    }

    fn remove(&self, id: &BlockId) -> Result<Removal> {
        let id = *id;
        self.store.run_on_backend(move |b| async move {
            let bytes = match inspect(&b, &id).await? {
                Check::Ours { bytes } => bytes,
                Check::Gone => return Ok(Removal::Gone),
                Check::NotOurs(why) => return Ok(Removal::Kept(why)),
            };
            b.fs.remove(&id, &block_key(&id).1).await?;
            b.fs.forget(&id);
            Ok(Removal::Removed { bytes })
        })
    }

    fn leftovers(&self) -> Result<(Vec<Leftover>, Vec<Kept>)> {
        let found = self
            .store
            .run_on_backend(|b| async move { entries(&b).await })?;
        let now = SystemTime::now();
        let mut out = Vec::new();
        for (dir, name, a) in found {
            let Some(block) = temp_of(&dir, &name) else {
                continue;
            };
            let idle = now.duration_since(mtime(&a)).unwrap_or_default();
            if matches!(a.type_, ftype3::NF3REG) && idle >= TEMP_MAX_AGE {
                out.push(Leftover {
                    label: self.label_of(&dir, &name),
                    bytes: a.size,
                    files: 1,
                    kind: ItemKind::IdleTemp,
                    place: Place::Temp {
                        root: 0,
                        dir,
                        name,
                        block,
                    },
                });
            }
        }
        Ok((out, Vec::new()))
    }

    fn remove_leftover(&self, leftover: &Leftover) -> Result<Removal> {
        let Place::Temp { name, block, .. } = &leftover.place else {
            return Ok(Removal::Kept("not a temporary of this export".into()));
        };
        let (name, block, bytes) = (name.clone(), *block, leftover.bytes);
        self.store.run_on_backend(move |b| async move {
            b.fs.remove(&block, &name).await?;
            Ok(Removal::Removed { bytes })
        })
    }

    fn threads(&self) -> usize {
        THREADS
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A mounted export is a directory, refused while nothing in it says
    /// it is a store.
    #[test]
    fn a_mounted_export_is_a_directory() {
        let d = tempfile::tempdir().unwrap();
        let mounted = NfsConfig {
            target: d.path().display().to_string(),
            ..Default::default()
        };
        let e = maintenance(&mounted).err().unwrap().to_string();
        assert!(e.contains("not a ucm store"), "{e}");
        std::fs::write(d.path().join(".ucm-store"), "ucm store\nformat 1\n").unwrap();
        let m = maintenance(&mounted).unwrap();
        assert_eq!(m.location(), d.path().display().to_string());
        assert!(m.list(false).unwrap().blocks.is_empty());
    }

    #[test]
    fn names_of_blocks_and_temporaries() {
        let id = BlockId([0x5a; 16]);
        let (d, n) = block_key(&id);
        assert_eq!(block_at(&d, &n), Some(id));
        assert_eq!(block_at("00", &n), None, "wrong directory");
        assert_eq!(temp_of(&d, &format!("{n}.tmp.0123abcd.7")), Some(id));
        assert_eq!(temp_of(&d, &format!("{n}.tmp.my notes")), None);
        assert_eq!(temp_of(&d, &n), None);
        assert_eq!(temp_of(&d, "notes.tmp.x"), None);
    }
}
