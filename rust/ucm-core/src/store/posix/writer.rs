//! Assembly of one block's shards into its temporary file.
//!
//! A block is published (renamed to its final name) only when EVERY shard
//! has been written — counted per block, whatever task or order the shards
//! arrive in (whole-block dumps, or one task per layer in layer-wise mode).
//! The original published on "the last shard index finished", which can
//! publish a block with holes when layer writes complete out of order.
//!
//! A shard that is already being written by another task is not written
//! twice: the second task joins the first write and completes with it.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::files::OpenFile;
use crate::block::BlockId;
use crate::error::{Result, UcmError};
use crate::task::Task;

enum Slot {
    Empty,
    InFlight(Vec<Arc<Task>>),
    Done,
}

struct State {
    slots: Vec<Slot>,
    done: usize,
    in_flight: usize,
    failed: Option<UcmError>,
    last_activity: Instant,
    /// The commit (or the discard) after the last write has finished.
    settled: bool,
}

/// Where a block is assembled: a file in the store instance's work
/// directory of one root.
#[derive(Clone, Debug)]
pub struct Temp {
    /// The root (its index).
    pub root: usize,
    /// The file's name in the instance's work directory there.
    pub name: String,
    /// Its path, for messages.
    pub path: PathBuf,
}

/// One block being assembled in a temporary file.
pub struct BlockWriter {
    /// The block.
    pub block: BlockId,
    /// Its temporary file.
    pub tmp: Temp,
    /// The temporary file, open for writing until the writer is dropped.
    pub file: OpenFile,
    state: Mutex<State>,
    settled_cv: Condvar,
}

/// What a task should do with its shard.
pub enum Claim {
    /// Write it; report with [`BlockWriter::finish`].
    Write,
    /// Already written: nothing to do.
    AlreadyDone,
    /// Another task is writing it; the caller's unit completes with it.
    Joined,
    /// The block's assembly failed; the unit fails with this.
    Failed(UcmError),
}

/// Outcome of finishing one shard write.
pub struct Finished {
    /// Tasks that joined this shard; complete one unit of each.
    pub joined: Vec<Arc<Task>>,
    /// Every shard is written: the caller must publish the block.
    pub complete: bool,
    /// This write failed the block: the caller must discard the temp file.
    pub failed_now: bool,
}

impl BlockWriter {
    /// A writer for `shards` shards into `file`, open at `tmp`.
    pub fn new(block: BlockId, tmp: Temp, file: OpenFile, shards: usize) -> Self {
        BlockWriter {
            block,
            tmp,
            file,
            state: Mutex::new(State {
                slots: (0..shards).map(|_| Slot::Empty).collect(),
                done: 0,
                in_flight: 0,
                failed: None,
                last_activity: Instant::now(),
                settled: false,
            }),
            settled_cv: Condvar::new(),
        }
    }

    /// Claims shard `index` for `task`.
    pub fn claim(&self, index: usize, task: &Arc<Task>) -> Claim {
        let mut st = self.state.lock();
        if let Some(e) = &st.failed {
            return Claim::Failed(e.clone());
        }
        st.last_activity = Instant::now();
        match &mut st.slots[index] {
            Slot::Done => Claim::AlreadyDone,
            Slot::InFlight(joined) => {
                joined.push(task.clone());
                Claim::Joined
            }
            slot @ Slot::Empty => {
                *slot = Slot::InFlight(Vec::new());
                st.in_flight += 1;
                Claim::Write
            }
        }
    }

    /// Records the result of writing shard `index`.
    pub fn finish(&self, index: usize, result: &Result<()>) -> Finished {
        let mut st = self.state.lock();
        st.last_activity = Instant::now();
        st.in_flight -= 1;
        let joined = match std::mem::replace(&mut st.slots[index], Slot::Empty) {
            Slot::InFlight(j) => j,
            _ => Vec::new(),
        };
        let was_failed = st.failed.is_some();
        match result {
            Ok(()) if !was_failed => {
                st.slots[index] = Slot::Done;
                st.done += 1;
                Finished {
                    joined,
                    complete: st.done == st.slots.len(),
                    failed_now: false,
                }
            }
            Ok(()) => Finished {
                joined,
                complete: false,
                failed_now: false,
            },
            Err(e) => {
                if !was_failed {
                    st.failed = Some(e.clone());
                }
                Finished {
                    joined,
                    complete: false,
                    failed_now: !was_failed,
                }
            }
        }
    }

    /// Every shard is written and none failed: the block is being
    /// committed (or was just committed).
    pub fn all_written(&self) -> bool {
        let st = self.state.lock();
        st.failed.is_none() && st.done == st.slots.len()
    }

    /// Records that the block was committed or discarded, waking loads
    /// waiting in [`BlockWriter::wait_settled`].
    pub fn settle(&self) {
        self.state.lock().settled = true;
        self.settled_cv.notify_all();
    }

    /// Waits up to `limit` for [`BlockWriter::settle`]. A task whose shards
    /// were written before the last one completes before the commit; a load
    /// by its caller right after must find the block, not miss it for the
    /// microseconds the committing thread takes to rename.
    pub fn wait_settled(&self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        let mut st = self.state.lock();
        while !st.settled {
            if self.settled_cv.wait_until(&mut st, deadline).timed_out() {
                return st.settled;
            }
        }
        true
    }

    /// The error that failed the block, if any.
    pub fn failure(&self) -> Option<UcmError> {
        self.state.lock().failed.clone()
    }

    /// True when nothing is in flight and nothing happened for `idle`.
    pub fn is_stale(&self, idle: std::time::Duration) -> bool {
        let st = self.state.lock();
        st.in_flight == 0 && st.last_activity.elapsed() >= idle
    }

    /// Marks an idle, incomplete block as abandoned.
    pub fn abandon(&self) {
        let mut st = self.state.lock();
        if st.failed.is_none() {
            st.failed = Some(UcmError::TaskFailed(format!(
                "block {}: abandoned with {} of {} shards written",
                self.block,
                st.done,
                st.slots.len()
            )));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::task::TaskRegistry;

    fn writer(shards: usize) -> BlockWriter {
        let file = OpenFile {
            file: tempfile::tempfile().unwrap(),
            direct: false,
        };
        let tmp = Temp {
            root: 0,
            name: "x".into(),
            path: PathBuf::from("/x"),
        };
        BlockWriter::new(BlockId([1; 16]), tmp, file, shards)
    }

    #[test]
    fn completes_only_when_all_shards_are_written_in_any_order() {
        let reg = TaskRegistry::new(0);
        let t = reg.create("dump", 3);
        let w = writer(3);
        for i in [2, 0, 1] {
            assert!(matches!(w.claim(i, &t), Claim::Write));
        }
        assert!(!w.finish(2, &Ok(())).complete);
        assert!(!w.finish(0, &Ok(())).complete);
        assert!(matches!(w.claim(0, &t), Claim::AlreadyDone));
        assert!(w.finish(1, &Ok(())).complete);
        assert!(w.all_written());
        assert!(!w.wait_settled(Duration::from_millis(1)));
        let w = Arc::new(w);
        let committer = {
            let w = w.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(20));
                w.settle();
            })
        };
        assert!(w.wait_settled(Duration::from_secs(20)));
        committer.join().unwrap();
    }

    #[test]
    fn joiners_and_failures() {
        let reg = TaskRegistry::new(0);
        let a = reg.create("dump", 2);
        let b = reg.create("dump", 1);
        let w = writer(2);
        assert!(matches!(w.claim(0, &a), Claim::Write));
        assert!(matches!(w.claim(0, &b), Claim::Joined));
        assert!(matches!(w.claim(1, &a), Claim::Write));
        let f = w.finish(0, &Err(UcmError::NoSpace("x".into())));
        assert!(f.failed_now && f.joined.len() == 1);
        let f = w.finish(1, &Ok(()));
        assert!(!f.complete && !f.failed_now);
        assert!(matches!(w.claim(1, &a), Claim::Failed(_)));
    }
}
