//! [`Maintenance`] of an S3 store: the objects under its prefix that sit at
//! block keys (`<prefix>/<2 hex>/<32 hex>`), each verified as its body
//! streams in, with the format's self-describing check (no layout needed:
//! the headers declare it).
//!
//! No marker object: the S3 stage writes nothing but block objects, each
//! in one PUT (no temporaries, no work files), so what keeps a removal to
//! what ucm wrote is the object itself. An object is deleted only after its
//! first 4 KiB were read and found to be a ucm block header naming the
//! block of its key; any other object under the prefix, at a block key or
//! not, is left alone. The check and the DELETE are two requests: an
//! object put at the key between them (by an engine: a block again; by
//! anyone else: they can write the bucket, and so delete anyway) goes too.

use std::time::{Duration, SystemTime};

use futures::StreamExt;
use object_store::{ObjectStore, ObjectStoreExt};

use super::{S3Backend, S3Config, S3Store};
use crate::block::BlockId;
use crate::error::Result;
use crate::store::format::codec::block_key;
use crate::store::maintain::{
    check_header, BlockEntry, BlockVerifier, Check, Kept, Leftover, Listing, Maintenance, Removal,
    HEADER_READ,
};

/// Requests in flight for a job over many blocks.
const THREADS: usize = 16;

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

/// Whether the object at block `id`'s key is a ucm block of that block.
async fn inspect(b: &S3Backend, id: &BlockId) -> Result<Check> {
    let (path, url) = (b.path(id), b.url_of(id));
    let meta = match b.client.head(&path).await {
        Ok(m) => m,
        Err(object_store::Error::NotFound { .. }) => return Ok(Check::Gone),
        Err(e) => return Err(b.note_err("HEAD", &url, e)),
    };
    let n = meta.size.min(HEADER_READ as u64);
    let head = if n == 0 {
        bytes::Bytes::new()
    } else {
        match b.client.get_range(&path, 0..n).await {
            Ok(h) => h,
            Err(object_store::Error::NotFound { .. }) => return Ok(Check::Gone),
            Err(e) => return Err(b.note_err("GET", &url, e)),
        }
    };
    Ok(match check_header(&head, id) {
        Ok(()) => Check::Ours { bytes: meta.size },
        Err(why) => Check::NotOurs(why),
    })
}

impl Maintenance for S3Maintenance {
    fn location(&self) -> String {
        self.store.backend().location.clone()
    }

    /// One LIST gives every object's size and time: `detail` costs nothing.
    fn list(&self, _detail: bool) -> Result<Listing> {
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
                        bytes: Some(meta.size),
                        modified: Some(system_time(t.timestamp(), t.timestamp_subsec_nanos())),
                    });
                }
            }
            Ok(Listing {
                blocks: out,
                odd: Vec::new(),
            })
        })
    }

    fn block_label(&self, id: &BlockId) -> String {
        self.store.backend().url_of(id)
    }

    fn verify(&self, id: &BlockId) -> Result<()> {
        let id = *id;
        self.store.run_on_backend(move |b| async move {
            let url = b.url_of(&id);
            let got = b.client.get(&b.path(&id)).await;
            let got = got.map_err(|e| b.note_err("GET", &url, e))?;
            let len = got.meta.size;
            let mut body = got.into_stream();
            // The first bytes, until they hold the first header; then the
            // body streams through the check (an object longer than its
            // header declares fails before it is read).
            let mut head = Vec::new();
            let mut verifier: Option<BlockVerifier> = None;
            while let Some(chunk) = body.next().await {
                let chunk = chunk.map_err(|e| b.note_err("GET", &url, e))?;
                match &mut verifier {
                    Some(v) => v.feed(&chunk)?,
                    None => {
                        head.extend_from_slice(&chunk);
                        if head.len() >= HEADER_READ {
                            let mut v = BlockVerifier::new(&head[..HEADER_READ], &id, len)?;
                            v.feed(&std::mem::take(&mut head))?;
                            verifier = Some(v);
                        }
                    }
                }
            }
            let v = match verifier {
                Some(v) => v,
                None => {
                    let mut v = BlockVerifier::new(&head, &id, len)?;
                    v.feed(&head)?;
                    v
                }
            };
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
            let (path, url) = (b.path(&id), b.url_of(&id));
            match b.client.delete(&path).await {
                Ok(()) => Ok(Removal::Removed { bytes }),
                Err(object_store::Error::NotFound { .. }) => Ok(Removal::Gone),
                Err(e) => Err(b.note_err("DELETE", &url, e)),
            }
        })
    }

    /// Nothing to collect: every block is one PUT, visible whole or not at
    /// all, so a stopped writer leaves no partial object behind.
    fn leftovers(&self) -> Result<(Vec<Leftover>, Vec<Kept>)> {
        Ok((Vec::new(), Vec::new()))
    }

    fn remove_leftover(&self, _leftover: &Leftover) -> Result<Removal> {
        Ok(Removal::Gone)
    }

    fn threads(&self) -> usize {
        THREADS
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
