//! Lookups: which blocks are published, answered from the index and kept
//! current with what other processes publish (see [`super::listing`]).

use super::tree::Tree;
use super::{scan, Shared};
use crate::block::BlockId;

/// Index misses in one block directory that can't be watched, within one
/// lookup, from which on the directory is listed once instead of probing
/// each id with a `stat`.
const LIST_MIN_MISSES: usize = 64;

impl Shared {
    /// The block directory `id` lives in.
    fn bucket_of(&self, id: &BlockId) -> (usize, u8) {
        (self.tree.root_index(id), id.0[0])
    }

    /// [`Shared::present`] of many ids. The index answers what it holds;
    /// a miss in a directory the index knows whole (read and watched, see
    /// [`listing`]) is absent once the changes other processes made are
    /// applied, which costs one system call for the whole lookup. A miss in
    /// a directory not read yet reads it; one in a directory that can't be
    /// watched is checked on disk (one `stat`, or one listing when many of
    /// its ids miss), so a block another process published is still found.
    pub(super) fn present_all(&self, ids: &[BlockId]) -> Vec<bool> {
        let mut out = vec![false; ids.len()];
        let seen = (self.listing.changes_seen(), self.listing.reads_done());
        self.index.touch_all(ids, &mut out);
        if out.iter().all(|p| *p) {
            return out;
        }
        // Applied here, or by the watcher thread since the index was read;
        // or a directory read whole (by the background pass) since then.
        self.catch_up();
        let changed = (self.listing.changes_seen(), self.listing.reads_done()) != seen;
        let mut again = Vec::new();
        let mut unknown: std::collections::HashMap<(usize, u8), Vec<usize>> = Default::default();
        for (i, id) in ids.iter().enumerate() {
            if out[i] {
                continue;
            }
            let bucket = self.bucket_of(id);
            if self.listing.complete(bucket) {
                if changed {
                    again.push(i);
                }
            } else {
                unknown.entry(bucket).or_default().push(i);
            }
        }
        self.touch_subset(ids, &again, &mut out);
        for (bucket, idx) in unknown {
            // Listed here, or by another thread (the background pass) since
            // the check above: either way the index has it now.
            self.listing.ensure(
                &self.tree,
                &self.index,
                self.file_moves.of_bucket(bucket.0, bucket.1),
                bucket,
            );
            self.touch_subset(ids, &idx, &mut out);
            let left: Vec<usize> = idx.into_iter().filter(|i| !out[*i]).collect();
            if left.is_empty() || self.listing.complete(bucket) {
                continue;
            }
            self.probe_misses(ids, bucket, &left, &mut out);
        }
        self.settle_own_commits(ids, &mut out);
        out
    }

    /// Applies the changes other processes made in the watched block
    /// directories to the index: each changed name is looked at as it is
    /// now, and indexed or dropped accordingly (under `file_moves`, so an
    /// eviction moving a file away is never undone here). How many names
    /// changed.
    pub(super) fn catch_up(&self) -> usize {
        self.listing.catch_up(|id| {
            let _moves = self.file_moves.lock(&self.tree, &id);
            let Ok(dir) = self.tree.bucket(&id) else {
                return;
            };
            match dir.lstat(Tree::block_name(&id)) {
                Ok(st) if st.is_file() && st.len == self.layout.file_len() => {
                    self.index.note_published(id)
                }
                // Something else at the name: a load finds out what.
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    self.index.remove(&id);
                }
                Err(_) => {}
            }
        })
    }

    /// [`Index::touch_all`] of `ids[i]` for each `i` in `which`.
    fn touch_subset(&self, ids: &[BlockId], which: &[usize], out: &mut [bool]) {
        if which.is_empty() {
            return;
        }
        let sub: Vec<BlockId> = which.iter().map(|i| ids[*i]).collect();
        let mut found = vec![false; sub.len()];
        self.index.touch_all(&sub, &mut found);
        for (k, i) in which.iter().enumerate() {
            out[*i] |= found[k];
        }
    }

    /// Checks misses of a directory that can't be watched on disk.
    fn probe_misses(
        &self,
        ids: &[BlockId],
        bucket: (usize, u8),
        which: &[usize],
        out: &mut [bool],
    ) {
        if which.len() < LIST_MIN_MISSES {
            for i in which {
                out[*i] = self.probe(&ids[*i]);
            }
            return;
        }
        let names: std::collections::HashSet<std::ffi::OsString> = self
            .tree
            .bucket_at(bucket.0, bucket.1)
            .ok()
            .and_then(|d| d.entries().ok())
            .map(|entries| entries.into_iter().map(|e| e.name).collect())
            .unwrap_or_default();
        for i in which {
            let id = &ids[*i];
            if names.contains(std::ffi::OsStr::new(&id.hex())) {
                out[*i] = self.probe(id);
            }
        }
    }

    /// Misses that are blocks this store finished writing, whose commit
    /// (on a committer thread) is finishing right now: found once it has.
    fn settle_own_commits(&self, ids: &[BlockId], out: &mut [bool]) {
        let waiting: Vec<usize> = {
            let writers = self.writers.lock();
            if writers.is_empty() {
                return;
            }
            (0..ids.len())
                .filter(|i| !out[*i] && writers.committing(&ids[*i]))
                .collect()
        };
        for i in waiting {
            out[i] = self.commit_settled(&ids[i]) && self.index.touch(&ids[i]);
        }
    }

    /// A published block file at `id`'s name, found on disk (and indexed).
    fn probe(&self, id: &BlockId) -> bool {
        let _moves = self.file_moves.lock(&self.tree, id);
        let probed = self
            .tree
            .bucket(id)
            .ok()
            .and_then(|dir| scan::probe(&dir, &Tree::block_name(id), self.layout.file_len()));
        if probed.is_some() {
            self.index.insert(*id, None);
        }
        probed.is_some()
    }

    pub(super) fn present(&self, id: &BlockId) -> bool {
        self.present_all(std::slice::from_ref(id))[0]
    }
}
