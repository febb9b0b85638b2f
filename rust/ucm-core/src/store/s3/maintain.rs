//! [`Maintenance`] of an S3 store: the objects under its prefix that sit at
//! block keys (`<prefix>/<2 hex>/<32 hex>`), each verified by reading it
//! whole and checking it with the format's self-describing check (no
//! layout needed: the headers declare it).

use std::time::{Duration, SystemTime};

use futures::StreamExt;
use object_store::{ObjectStore, ObjectStoreExt};

use super::{S3Config, S3Store};
use crate::block::BlockId;
use crate::error::Result;
use crate::store::format::codec::block_key;
use crate::store::format::layout::verify_block;
use crate::store::maintain::{BlockEntry, GcReport, Maintenance};

/// Maintenance of the blocks under an S3 store's prefix.
pub struct S3Maintenance {
    store: S3Store,
}

impl S3Maintenance {
    /// Connects as a lookup-only store would (same checks of the endpoint,
    /// bucket and credentials); the geometry in `cfg` is not used.
    pub fn open(mut cfg: S3Config) -> Result<Self> {
        cfg.device_id = -1;
        Ok(S3Maintenance {
            store: S3Store::open(cfg)?,
        })
    }
}

/// The block whose object key is `key` under `prefix` (None: not a block
/// key, e.g. an object some other tool put there).
fn block_of(prefix: &str, key: &str) -> Option<BlockId> {
    let rel = if prefix.is_empty() {
        key
    } else {
        key.strip_prefix(prefix)?.strip_prefix('/')?
    };
    let (dir, name) = rel.split_once('/')?;
    let id = BlockId::from_hex(name)?;
    let (want_dir, want_name) = block_key(&id);
    (dir == want_dir && name == want_name).then_some(id)
}

fn system_time(secs: i64, nanos: u32) -> SystemTime {
    let since_epoch = Duration::new(u64::try_from(secs).unwrap_or(0), nanos);
    SystemTime::UNIX_EPOCH + since_epoch
}

impl Maintenance for S3Maintenance {
    fn blocks(&self) -> Result<Vec<BlockEntry>> {
        self.store.run_on_backend(|b| async move {
            let prefix = (!b.loc.prefix.is_empty()).then_some(&b.prefix);
            let mut listing = b.client.list(prefix);
            let mut out = Vec::new();
            while let Some(meta) = listing.next().await {
                let meta = meta.map_err(|e| b.note_err("LIST", &b.location, e))?;
                if let Some(id) = block_of(b.prefix.as_ref(), meta.location.as_ref()) {
                    let t = meta.last_modified;
                    out.push(BlockEntry {
                        id,
                        bytes: meta.size,
                        modified: system_time(t.timestamp(), t.timestamp_subsec_nanos()),
                    });
                }
            }
            Ok(out)
        })
    }

    fn verify(&self, id: &BlockId) -> Result<()> {
        let id = *id;
        let raw = self.store.run_on_backend(move |b| async move {
            let url = b.url_of(&id);
            let got = b.client.get(&b.path(&id)).await;
            let got = got.map_err(|e| b.note_err("GET", &url, e))?;
            got.bytes().await.map_err(|e| b.note_err("GET", &url, e))
        })?;
        verify_block(&raw, &id).map(drop)
    }

    fn remove(&self, id: &BlockId) -> Result<bool> {
        let id = *id;
        self.store.run_on_backend(move |b| async move {
            let (path, url) = (b.path(&id), b.url_of(&id));
            match b.client.head(&path).await {
                Ok(_) => {}
                Err(object_store::Error::NotFound { .. }) => return Ok(false),
                Err(e) => return Err(b.note_err("HEAD", &url, e)),
            }
            b.client
                .delete(&path)
                .await
                .map_err(|e| b.note_err("DELETE", &url, e))?;
            Ok(true)
        })
    }

    /// Nothing to collect: every block is one PUT, visible whole or not at
    /// all, so a stopped writer leaves no partial object behind.
    fn gc(&self) -> Result<GcReport> {
        Ok(GcReport::default())
    }

    fn location(&self) -> String {
        self.store.backend().location.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_objects_at_block_keys_are_blocks() {
        let id = BlockId([0xab; 16]);
        let (d, n) = block_key(&id);
        assert_eq!(block_of("kv", &format!("kv/{d}/{n}")), Some(id));
        assert_eq!(block_of("", &format!("{d}/{n}")), Some(id));
        assert_eq!(
            block_of("kv", &format!("kv/00/{n}")),
            None,
            "wrong directory"
        );
        assert_eq!(
            block_of("kv", &format!("kvx/{d}/{n}")),
            None,
            "another prefix"
        );
        assert_eq!(block_of("kv", &format!("kv/{d}/{n}.tmp")), None);
        assert_eq!(block_of("kv", "kv/readme"), None);
    }

    #[test]
    fn modification_times_convert() {
        let t = system_time(1_700_000_000, 5);
        let d = t.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
        assert_eq!((d.as_secs(), d.subsec_nanos()), (1_700_000_000, 5));
        assert_eq!(system_time(-5, 0), SystemTime::UNIX_EPOCH);
    }
}
