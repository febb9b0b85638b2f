//! The Empty store: keeps nothing.
//!
//! Lookups miss, dumps succeed and discard the data, loads fail cleanly with
//! `NotFound` (unlike the original, whose loads "succeed" without writing
//! anything, which would hand garbage to the caller). Useful as the bottom of
//! a memory-only pipeline and for measuring everything but storage.

use std::sync::atomic::{AtomicBool, Ordering};

use super::Store;
use crate::block::{BlockId, ShardIo};
use crate::error::{Result, UcmError};
use crate::task::{TaskId, TaskRegistry};

/// A store that keeps nothing.
pub struct EmptyStore {
    tasks: TaskRegistry,
    closed: AtomicBool,
}

impl EmptyStore {
    /// Creates the store; `timeout_ms` only matters for API symmetry.
    pub fn new(timeout_ms: u64) -> Self {
        EmptyStore {
            tasks: TaskRegistry::new(timeout_ms),
            closed: AtomicBool::new(false),
        }
    }

    fn ensure_open(&self) -> Result<()> {
        if self.closed.load(Ordering::Acquire) {
            Err(UcmError::Closed)
        } else {
            Ok(())
        }
    }
}

impl Store for EmptyStore {
    fn name(&self) -> &'static str {
        "Empty"
    }

    fn lookup(&self, ids: &[BlockId]) -> Result<Vec<bool>> {
        self.ensure_open()?;
        Ok(vec![false; ids.len()])
    }

    fn lookup_on_prefix(&self, _ids: &[BlockId]) -> Result<isize> {
        self.ensure_open()?;
        Ok(-1)
    }

    fn prefetch(&self, _ids: &[BlockId]) -> Result<()> {
        self.ensure_open()
    }

    fn load(&self, shards: Vec<ShardIo>) -> Result<TaskId> {
        self.ensure_open()?;
        let task = self.tasks.create("load", shards.len());
        for s in &shards {
            task.complete_unit(Err(UcmError::NotFound(format!(
                "block {} shard {}: the Empty store keeps no data",
                s.block, s.index
            ))));
        }
        Ok(task.id())
    }

    fn dump(&self, _shards: Vec<ShardIo>, _prerequisite: u64) -> Result<TaskId> {
        self.ensure_open()?;
        Ok(self.tasks.create("dump", 0).id())
    }

    fn wait(&self, task: TaskId) -> Result<()> {
        self.tasks.wait(task)
    }

    fn check(&self, task: TaskId) -> Result<bool> {
        self.tasks.check(task)
    }

    fn close(&self) -> Result<()> {
        self.closed.store(true, Ordering::Release);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::MemSeg;

    #[test]
    fn empty_semantics() {
        let s = EmptyStore::new(1000);
        let id = BlockId([1; 16]);
        assert_eq!(s.lookup(&[id, id]).unwrap(), vec![false, false]);
        assert_eq!(s.lookup_on_prefix(&[id]).unwrap(), -1);
        let mut buf = vec![0u8; 64];
        let seg = MemSeg::of_mut(&mut buf);
        let shard = ShardIo {
            block: id,
            index: 0,
            segs: vec![seg],
        };
        let t = s.dump(vec![shard.clone()], 0).unwrap();
        s.wait(t).unwrap();
        assert_eq!(s.lookup(&[id]).unwrap(), vec![false]);
        let t = s.load(vec![shard]).unwrap();
        assert_eq!(s.wait(t).unwrap_err().code(), -50005);
        s.close().unwrap();
        assert_eq!(s.lookup(&[id]).unwrap_err().code(), -50012);
    }
}
