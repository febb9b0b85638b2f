//! The file a new block is assembled in: a spare from the pool (recycled
//! from evicted blocks at the capacity, see `evict`) or a new temporary in
//! the store instance's work directory, never a file someone planted.

use std::sync::atomic::Ordering;

use super::files::OpenFile;
use super::writer::Temp;
use super::{evict, Shared};
use crate::block::BlockId;
use crate::error::{Result, UcmError};

/// The code of [`UcmError::NotFound`].
const NOT_FOUND: i32 = -50005;
/// True when `e` is the OS error `code`.
fn is_os_error(e: &UcmError, code: i32) -> bool {
    matches!(e, UcmError::Os { source, .. } if source.raw_os_error() == Some(code))
}

/// Spares that fail their check in a row before a dump creates a file.
const MAX_BAD_SPARES: usize = 4;
/// Temporary names found taken in a row before a create gives up.
const MAX_TAKEN_NAMES: usize = 16;

/// A temporary file opened for a new block.
pub(super) struct TempFile {
    pub temp: Temp,
    pub file: OpenFile,
    /// It came from the spare pool (and goes back there if unused).
    pub spare: bool,
}

impl Shared {
    /// Removes a temporary file that will not be published (the roots'
    /// usage never counted it).
    pub(super) fn discard_temp(&self, temp: &Temp) {
        if let Some(work) = &self.work {
            let _ = work.dir(temp.root).remove_file(&temp.name);
        }
    }

    /// An open file to assemble `block` in: a checked spare when the pool
    /// has one (a spare that fails the check is removed), else a new file.
    pub(super) fn temp_file(&self, block: &BlockId, root: usize) -> Result<TempFile> {
        let work = self
            .work
            .as_ref()
            .ok_or_else(|| UcmError::Unsupported("a lookup-only store does not dump".into()))?;
        let fresh_name = || {
            let seq = self.tmp_seq.fetch_add(1, Ordering::Relaxed);
            format!("{}.{seq}", block.hex())
        };
        for _ in 0..MAX_BAD_SPARES {
            let name = fresh_name();
            if !self.spare_for_new_block(root, &name) {
                break;
            }
            let dir = work.dir(root);
            let temp = Temp {
                root,
                path: dir.join(&name),
                name,
            };
            if let Some(file) = self.opener.reuse(&dir, &temp.name, self.layout.file_len()) {
                return Ok(TempFile {
                    temp,
                    file,
                    spare: true,
                });
            }
            // Replaced or changed by someone: not ours any more.
            dir.remove_entry(&temp.name);
        }
        let mut attempt = 0;
        loop {
            let name = fresh_name();
            let created = {
                let dir = work.dir(root);
                self.opener.create(&dir, &name).map(|file| TempFile {
                    temp: Temp {
                        root,
                        path: dir.join(&name),
                        name: name.clone(),
                    },
                    file,
                    spare: false,
                })
            };
            match created {
                Ok(t) => return Ok(t),
                // Something was planted at this name: never reuse it.
                Err(e) if is_os_error(&e, libc::EEXIST) && attempt < MAX_TAKEN_NAMES => {}
                Err(e) if e.code() == NOT_FOUND && attempt == 0 => {
                    // The work directory was removed under us: make it again.
                    work.remake(root)?;
                }
                Err(e) => return Err(e),
            }
            attempt += 1;
        }
    }

    /// A spare file for a new block under root `root` (registered in
    /// [`Writers::opening`]). When the pool is empty and the new
    /// block would take the store past its capacity, evicts a batch
    /// of cold blocks into the pool now (one rename each) instead of
    /// creating a file, which on ext4 costs more than writing a 1 MiB
    /// shard, only for the evictor to delete another one right after. A
    /// burst of dumps into a store at capacity thus never creates or
    /// deletes files, whatever the pool's size. None: create a file.
    pub(super) fn spare_for_new_block(&self, root: usize, temp: &str) -> bool {
        if self.spares.take_as(root, temp).is_some() {
            return true;
        }
        let cap = self.cfg.capacity_bytes;
        if cap == 0 || !self.spares.enabled() {
            return false;
        }
        let len = self.layout.file_len().max(1);
        let after = self.bytes_with_unpublished_files();
        if after <= cap {
            return false;
        }
        // One refill at a time; the others then find its files.
        let _refilling = self.refill_lock.lock();
        if self.spares.take_as(root, temp).is_some() {
            return true;
        }
        // Down to the evictor's low watermark, in one batch.
        let band = (cap as f64 * evict::LOW_WATERMARK) as u64;
        // No more than the pool may hold: beyond it, evicted files are deleted.
        let room = self.recycled_spares().max(1);
        let want = (after.saturating_sub(band) / len).clamp(1, room);
        evict::recycle_coldest(self, root, want as usize);
        self.spares.take_as(root, temp).is_some()
    }

    /// Bytes of the directory's files (every store's blocks and spares, as
    /// the roots' usage counts them) plus one block file per block this
    /// store is assembling or opening (the caller's new block included, as
    /// it is opening). Read under the writers lock; a file in motion is
    /// counted twice at worst, never missed, so no create is taken for room
    /// that is not there.
    fn bytes_with_unpublished_files(&self) -> u64 {
        let writers = self.writers.lock();
        self.dir_bytes() + writers.files() as u64 * self.layout.file_len()
    }
}
