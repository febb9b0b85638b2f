//! `PyStage`: a store written in Python (a `UcmKVStoreBase` subclass) as a
//! Rust [`Store`], so it can sit under the Rust cache in a pipeline
//! (`"Cache|MyStore"`).
//!
//! The cache's worker threads call it without the GIL; every method
//! attaches to the interpreter for the duration of the Python call. Lock
//! order is always GIL first, then the task map's lock (held only for a map
//! operation), so a thread holding the map lock never waits for the GIL.
//!
//! Shards arrive as slot memory (one contiguous segment) or caller
//! segments; either way they become one row of raw addresses per shard, one
//! column per entry of `tensor_size_list`, and go to the store's
//! `load_data` / `dump_data`. Python exceptions come back as the matching
//! [`UcmError`] (by their `.code`, else `TaskFailed`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use ucm_core::error::Damage;
use ucm_core::store::{Store, StoreStats};
use ucm_core::task::TaskId;
use ucm_core::{BlockId, ShardIo, UcmError};

/// A Python store seen as a Rust [`Store`].
pub struct PyStage {
    obj: Py<PyAny>,
    label: String,
    sizes: Vec<usize>,
    tasks: Mutex<HashMap<TaskId, Py<PyAny>>>,
    next: AtomicU64,
}

impl PyStage {
    /// Wraps `obj`; `sizes` is the `tensor_size_list` its rows use.
    pub fn new(py: Python<'_>, obj: Py<PyAny>, sizes: Vec<usize>) -> Self {
        let label = obj
            .bind(py)
            .get_type()
            .name()
            .map(|n| n.to_string())
            .unwrap_or_else(|_| "PythonStore".into());
        PyStage {
            obj,
            label,
            sizes,
            tasks: Mutex::new(HashMap::new()),
            next: AtomicU64::new(1),
        }
    }

    fn err(&self, py: Python<'_>, method: &str, e: PyErr) -> UcmError {
        let value = e.value(py);
        let code: Option<i32> = value.getattr("code").ok().and_then(|c| c.extract().ok());
        let msg = format!("{}.{method}: {}", self.label, value);
        match code {
            Some(-50000) => UcmError::InvalidParam(msg),
            Some(-50001) => UcmError::OutOfMemory(msg),
            Some(-50002) => UcmError::os("python store", "", std::io::Error::other(msg)),
            Some(-50003) => UcmError::DuplicateKey(msg),
            Some(-50005) => UcmError::NotFound(msg),
            Some(-50008) => UcmError::Unsupported(msg),
            Some(-50009) => UcmError::NoSpace(msg),
            Some(-50010) => UcmError::Timeout(msg),
            Some(-50011) => UcmError::corrupt(Damage::Reported, None, None, msg),
            Some(-50012) => UcmError::Closed,
            _ => UcmError::TaskFailed(msg),
        }
    }

    fn ids<'py>(py: Python<'py>, ids: &[BlockId]) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, ids.iter().map(|b| PyBytes::new(py, &b.0)))
    }

    /// One address row per shard, one column per tensor size.
    fn rows(&self, shards: &[ShardIo]) -> Result<Vec<Vec<u64>>, UcmError> {
        shards
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let lens: Vec<usize> = s.segs.iter().map(|g| g.len).collect();
                if lens == self.sizes {
                    return Ok(s.segs.iter().map(|g| g.addr as u64).collect());
                }
                if s.segs.len() == 1 && s.segs[0].len == self.sizes.iter().sum::<usize>() {
                    let mut off = 0;
                    return Ok(self
                        .sizes
                        .iter()
                        .map(|n| {
                            let a = (s.segs[0].addr + off) as u64;
                            off += n;
                            a
                        })
                        .collect());
                }
                Err(UcmError::invalid(format!(
                    "shard {i}: segments {lens:?} match neither tensor_size_list {:?} nor one \
                     contiguous shard",
                    self.sizes
                )))
            })
            .collect()
    }

    fn transfer(
        &self,
        method: &str,
        shards: Vec<ShardIo>,
        prerequisite: u64,
    ) -> Result<TaskId, UcmError> {
        let rows = self.rows(&shards)?;
        let ids: Vec<BlockId> = shards.iter().map(|s| s.block).collect();
        let idx: Vec<usize> = shards.iter().map(|s| s.index).collect();
        Python::attach(|py| {
            let call = || -> PyResult<Py<PyAny>> {
                let np = py.import("numpy")?;
                let arr = np.call_method1("array", (rows.clone(), np.getattr("uint64")?))?;
                let arr = if rows.is_empty() {
                    arr.call_method1("reshape", ((0usize, self.sizes.len()),))?
                } else {
                    arr
                };
                let obj = self.obj.bind(py);
                let task = if method == "dump_data" {
                    obj.call_method1(
                        method,
                        (Self::ids(py, &ids)?, idx.clone(), arr, prerequisite),
                    )?
                } else {
                    obj.call_method1(method, (Self::ids(py, &ids)?, idx.clone(), arr))?
                };
                Ok(task.unbind())
            };
            let task = call().map_err(|e| self.err(py, method, e))?;
            let id = self.next.fetch_add(1, Ordering::Relaxed);
            self.tasks.lock().insert(id, task);
            Ok(id)
        })
    }
}

impl Store for PyStage {
    fn name(&self) -> &'static str {
        "Python"
    }

    fn lookup(&self, ids: &[BlockId]) -> ucm_core::Result<Vec<bool>> {
        Python::attach(|py| {
            Self::ids(py, ids)
                .and_then(|l| self.obj.bind(py).call_method1("lookup", (l,)))
                .and_then(|r| r.extract::<Vec<bool>>())
                .map_err(|e| self.err(py, "lookup", e))
        })
    }

    fn lookup_on_prefix(&self, ids: &[BlockId]) -> ucm_core::Result<isize> {
        Python::attach(|py| {
            Self::ids(py, ids)
                .and_then(|l| self.obj.bind(py).call_method1("lookup_on_prefix", (l,)))
                .and_then(|r| r.extract::<isize>())
                .map_err(|e| self.err(py, "lookup_on_prefix", e))
        })
    }

    fn prefetch(&self, ids: &[BlockId]) -> ucm_core::Result<()> {
        Python::attach(|py| {
            Self::ids(py, ids)
                .and_then(|l| self.obj.bind(py).call_method1("prefetch", (l,)))
                .map(|_| ())
                .map_err(|e| self.err(py, "prefetch", e))
        })
    }

    fn load(&self, shards: Vec<ShardIo>) -> ucm_core::Result<TaskId> {
        self.transfer("load_data", shards, 0)
    }

    fn dump(&self, shards: Vec<ShardIo>, prerequisite: u64) -> ucm_core::Result<TaskId> {
        self.transfer("dump_data", shards, prerequisite)
    }

    fn wait(&self, task: TaskId) -> ucm_core::Result<()> {
        Python::attach(|py| {
            let t = self.tasks.lock().remove(&task).ok_or_else(|| {
                UcmError::NotFound(format!("task {task} is unknown or was already waited"))
            })?;
            self.obj
                .bind(py)
                .call_method1("wait", (t,))
                .map(|_| ())
                .map_err(|e| self.err(py, "wait", e))
        })
    }

    fn check(&self, task: TaskId) -> ucm_core::Result<bool> {
        Python::attach(|py| {
            let t = self
                .tasks
                .lock()
                .get(&task)
                .map(|t| t.clone_ref(py))
                .ok_or_else(|| {
                    UcmError::NotFound(format!("task {task} is unknown or was already waited"))
                })?;
            self.obj
                .bind(py)
                .call_method1("check", (t,))
                .and_then(|r| r.extract::<bool>())
                .map_err(|e| self.err(py, "check", e))
        })
    }

    fn close(&self) -> ucm_core::Result<()> {
        Python::attach(|py| {
            self.obj
                .bind(py)
                .call_method0("close")
                .map(|_| ())
                .map_err(|e| self.err(py, "close", e))
        })
    }

    fn flush(&self) -> ucm_core::Result<()> {
        Python::attach(|py| {
            let obj = self.obj.bind(py);
            if !obj.hasattr("flush").unwrap_or(false) {
                return Ok(());
            }
            obj.call_method0("flush")
                .map(|_| ())
                .map_err(|e| self.err(py, "flush", e))
        })
    }

    fn stats(&self) -> StoreStats {
        Python::attach(|py| {
            let mut out = StoreStats::new();
            let obj = self.obj.bind(py);
            let Ok(d) = obj.call_method0("get_stats") else {
                return out;
            };
            if let Ok(d) = d.cast::<PyDict>() {
                for (k, v) in d.iter() {
                    if let (Ok(k), Ok(v)) = (k.extract::<String>(), v.extract::<f64>()) {
                        out.insert(k, v);
                    }
                }
            }
            out
        })
    }
}
