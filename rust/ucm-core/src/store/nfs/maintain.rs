//! [`Maintenance`] of an NFS store. Through a kernel mount the export is a
//! directory with the Posix store's layout (`<root>/<2 hex>/<32 hex>`), so
//! the Posix maintenance serves it as is. Through the built-in client
//! ([`RemoteMaintenance`]) the block directories are listed with
//! READDIRPLUS and blocks read whole with the store's own reads. Either
//! way the clean-up removes only temporaries idle for an hour, which no
//! live writer leaves that long (it abandons a block after twice the task
//! timeout).

use std::time::{Duration, SystemTime};

use nfs3_client::nfs3_types::nfs3::{fattr3, ftype3};

use super::config::{NfsConfig, Target};
use super::fs::Fs;
use super::{NfsBackend, NfsStore};
use crate::block::BlockId;
use crate::error::{Result, UcmError};
use crate::store::format::codec::block_key;
use crate::store::format::layout::verify_block;
use crate::store::maintain::{BlockEntry, GcReport, Maintenance};
use crate::store::posix::PosixMaintenance;

/// Temporaries idle this long belong to writers that are gone.
const TEMP_MAX_AGE: Duration = Duration::from_secs(3600);

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
    let (hex, _) = name.split_once(".tmp.")?;
    block_at(dir, hex)
}

impl Maintenance for RemoteMaintenance {
    fn blocks(&self) -> Result<Vec<BlockEntry>> {
        self.store.run_on_backend(|b| async move {
            let found = entries(&b).await?.into_iter().filter_map(|(dir, name, a)| {
                let id = block_at(&dir, &name)?;
                matches!(a.type_, ftype3::NF3REG).then(|| BlockEntry {
                    id,
                    bytes: a.size,
                    modified: mtime(&a),
                })
            });
            Ok(found.collect())
        })
    }

    fn verify(&self, id: &BlockId) -> Result<()> {
        let id = *id;
        let raw = self.store.run_on_backend(move |b| async move {
            let Some(size) = b.fs.size_of(&id).await? else {
                return Err(UcmError::NotFound(format!("block {id}")));
            };
            let len = usize::try_from(size)
                .map_err(|_| UcmError::invalid(format!("block {id}: {size} bytes")))?;
            b.fs.read(&id, 0, len).await
        })?;
        verify_block(&raw, &id).map(drop)
    }

    fn remove(&self, id: &BlockId) -> Result<bool> {
        let id = *id;
        self.store.run_on_backend(move |b| async move {
            if b.fs.size_of(&id).await?.is_none() {
                return Ok(false);
            }
            b.fs.remove(&id, &block_key(&id).1).await?;
            b.fs.forget(&id);
            Ok(true)
        })
    }

    fn gc(&self) -> Result<GcReport> {
        self.store.run_on_backend(|b| async move {
            let mut report = GcReport::default();
            let now = SystemTime::now();
            for (dir, name, a) in entries(&b).await? {
                let Some(id) = temp_of(&dir, &name) else {
                    continue;
                };
                let idle = now.duration_since(mtime(&a)).unwrap_or_default();
                if idle >= TEMP_MAX_AGE {
                    b.fs.remove(&id, &name).await?;
                    report.temporaries += 1;
                }
            }
            Ok(report)
        })
    }

    fn location(&self) -> String {
        self.store.backend().label.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mounted_export_is_a_directory() {
        let d = tempfile::tempdir().unwrap();
        let mounted = NfsConfig {
            target: d.path().display().to_string(),
            ..Default::default()
        };
        let m = maintenance(&mounted).unwrap();
        assert_eq!(m.location(), d.path().display().to_string());
        assert!(m.blocks().unwrap().is_empty());
    }

    #[test]
    fn names_of_blocks_and_temporaries() {
        let id = BlockId([0x5a; 16]);
        let (d, n) = block_key(&id);
        assert_eq!(block_at(&d, &n), Some(id));
        assert_eq!(block_at("00", &n), None, "wrong directory");
        assert_eq!(temp_of(&d, &format!("{n}.tmp.0123abcd.7")), Some(id));
        assert_eq!(temp_of(&d, &n), None);
        assert_eq!(temp_of(&d, "notes.tmp.x"), None);
    }
}
