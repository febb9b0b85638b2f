//! [`Maintenance`] of Posix directories: the block files under each root's
//! 256 block directories, verified with the format's self-describing check
//! (no layout needed: the headers declare it).

use std::path::PathBuf;

use super::files::{remove_entry, Paths};
use super::index::Index;
use super::{scan, work};
use crate::block::BlockId;
use crate::error::{Result, UcmError};
use crate::store::format::layout::verify_block;
use crate::store::maintain::{BlockEntry, GcReport, Maintenance};
use crate::store::safe_fs::open_regular;

/// Maintenance of the blocks under `roots`.
pub struct PosixMaintenance {
    paths: Paths,
}

impl PosixMaintenance {
    /// Over existing directories (nothing is created).
    pub fn new(roots: Vec<PathBuf>) -> Result<Self> {
        for (i, r) in roots.iter().enumerate() {
            if !r.is_dir() {
                return Err(UcmError::invalid(format!(
                    "storage_backends[{i}]: {} is not a directory",
                    r.display()
                )));
            }
        }
        Ok(PosixMaintenance {
            paths: Paths::new(roots),
        })
    }
}

impl Maintenance for PosixMaintenance {
    fn blocks(&self) -> Result<Vec<BlockEntry>> {
        let mut out = Vec::new();
        for root in self.paths.roots() {
            for b in 0..=255u8 {
                let dir = root.join(format!("{b:02x}"));
                let Ok(entries) = std::fs::read_dir(&dir) else {
                    continue;
                };
                for e in entries.flatten() {
                    let name = e.file_name();
                    let Some(id) = BlockId::from_hex(&name.to_string_lossy()) else {
                        continue;
                    };
                    let Ok(meta) = e.metadata() else { continue };
                    if meta.file_type().is_file() {
                        out.push(BlockEntry {
                            id,
                            bytes: meta.len(),
                            modified: meta.modified().unwrap_or(std::time::UNIX_EPOCH),
                        });
                    }
                }
            }
        }
        Ok(out)
    }

    fn verify(&self, id: &BlockId) -> Result<()> {
        use std::io::Read;
        let path = self.paths.block(id);
        let mut raw = Vec::new();
        open_regular(&path, 0)
            .and_then(|mut f| f.read_to_end(&mut raw))
            .map_err(|e| UcmError::os("read", &path, e))?;
        verify_block(&raw, id).map(drop)
    }

    fn remove(&self, id: &BlockId) -> Result<bool> {
        let path = self.paths.block(id);
        match std::fs::remove_file(&path) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(UcmError::os("unlink", &path, e)),
        }
    }

    fn gc(&self) -> Result<GcReport> {
        let mut report = GcReport::default();
        for root in self.paths.roots() {
            // No store of ours to adopt spares: everything of a dead store goes.
            let none = root.join(".work").join(".maintenance");
            let r = work::reclaim(root, &none, 0, 0);
            report.temporaries += r.removed + r.spares.len();
            for s in r.spares {
                remove_entry(&s);
            }
        }
        let s = scan::scan(&self.paths, &Index::default(), 0, true);
        report.temporaries += s.removed_temps;
        report.foreign += s.removed_foreign;
        Ok(report)
    }

    fn location(&self) -> String {
        self.paths
            .roots()
            .iter()
            .map(|r| r.display().to_string())
            .collect::<Vec<_>>()
            .join(":")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{PosixConfig, PosixStore, Store};
    use crate::{MemSeg, ShardIo};

    #[test]
    fn lists_verifies_and_removes() {
        let d = tempfile::tempdir().unwrap();
        let cfg = PosixConfig {
            storage_backends: vec![d.path().to_path_buf()],
            block_size: 8192,
            shard_size: 4096,
            tensor_size_list: vec![4096],
            ..Default::default()
        };
        let store = PosixStore::open(cfg).unwrap();
        let data = vec![7u8; 4096];
        for b in 1..=3u8 {
            let shards = (0..2)
                .map(|i| ShardIo {
                    block: BlockId([b; 16]),
                    index: i,
                    segs: vec![MemSeg {
                        addr: data.as_ptr() as usize,
                        len: 4096,
                    }],
                })
                .collect();
            let t = store.dump(shards, 0).unwrap();
            store.wait(t).unwrap();
        }
        drop(store);
        let m = PosixMaintenance::new(vec![d.path().to_path_buf()]).unwrap();
        let mut ids: Vec<_> = m.blocks().unwrap().into_iter().map(|e| e.id).collect();
        ids.sort();
        assert_eq!(
            ids,
            vec![BlockId([1; 16]), BlockId([2; 16]), BlockId([3; 16])]
        );
        for id in &ids {
            m.verify(id).unwrap();
        }
        // Flip a data byte of block 2's second shard.
        let path = m.paths.block(&BlockId([2; 16]));
        let mut raw = std::fs::read(&path).unwrap();
        raw[2 * 4096 + 4096 + 10] ^= 1;
        std::fs::write(&path, raw).unwrap();
        let e = m.verify(&BlockId([2; 16])).unwrap_err();
        assert!(
            e.to_string().contains("shard 1: data checksum mismatch"),
            "{e}"
        );
        assert!(m.remove(&BlockId([2; 16])).unwrap());
        assert!(!m.remove(&BlockId([2; 16])).unwrap());
        assert_eq!(m.blocks().unwrap().len(), 2);
        let r = m.gc().unwrap();
        assert!(r.temporaries >= 1, "the closed store's spares: {r:?}");
        assert_eq!(
            std::fs::read_dir(d.path().join(".work")).unwrap().count(),
            0
        );
    }
}
