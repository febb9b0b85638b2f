//! Mooncake's Python client seen as the core's [`PoolClient`].
//!
//! The object is `ucm.store.mooncake.MooncakePool` (a thin wrapper over
//! `mooncake.store.MooncakeDistributedStore` that the Python side sets up
//! from the stage's keys). Calls come from the store's own threads, never
//! with the GIL held; each attaches for the call, and Mooncake's bindings
//! release the GIL while they transfer.

use pyo3::prelude::*;
use ucm_core::store::mooncake::{Buf, PoolClient};
use ucm_core::UcmError;

/// A Python object with the `MooncakePool` methods.
pub struct PyPoolClient {
    obj: Py<PyAny>,
}

impl PyPoolClient {
    /// Wraps `obj` after checking it has every method the store calls.
    pub fn new(obj: &Bound<'_, PyAny>) -> PyResult<Self> {
        for m in [
            "sizes",
            "put_from",
            "get_whole",
            "get_ranges",
            "remove",
            "register",
            "unregister",
            "close",
        ] {
            if !obj.hasattr(m)? {
                return Err(crate::errors::invalid(format!(
                    "the Mooncake client object has no method {m}()"
                )));
            }
        }
        Ok(PyPoolClient {
            obj: obj.clone().unbind(),
        })
    }

    fn codes<A>(&self, method: &str, args: A) -> Result<Vec<i64>, UcmError>
    where
        A: for<'py> pyo3::call::PyCallArgs<'py>,
    {
        Python::attach(|py| {
            self.obj
                .call_method1(py, method, args)
                .and_then(|r| r.extract::<Vec<i64>>(py))
                .map_err(|e| UcmError::TaskFailed(format!("{method}(): {}", e.value(py))))
        })
    }
}

fn split(bufs: &[Buf]) -> (Vec<usize>, Vec<usize>) {
    bufs.iter().map(|b| (b.addr, b.len)).unzip()
}

impl PoolClient for PyPoolClient {
    fn sizes(&self, keys: &[String]) -> Result<Vec<i64>, UcmError> {
        self.codes("sizes", (keys.to_vec(),))
    }

    fn put_from(&self, keys: &[String], bufs: &[Buf]) -> Result<Vec<i64>, UcmError> {
        let (addrs, lens) = split(bufs);
        self.codes("put_from", (keys.to_vec(), addrs, lens))
    }

    fn get_whole(&self, keys: &[String], bufs: &[Buf]) -> Result<Vec<i64>, UcmError> {
        let (addrs, lens) = split(bufs);
        self.codes("get_whole", (keys.to_vec(), addrs, lens))
    }

    fn get_ranges(
        &self,
        keys: &[String],
        bufs: &[Buf],
        offsets: &[u64],
    ) -> Result<Vec<i64>, UcmError> {
        let (addrs, lens) = split(bufs);
        self.codes("get_ranges", (keys.to_vec(), addrs, lens, offsets.to_vec()))
    }

    fn remove(&self, keys: &[String]) -> Result<Vec<i64>, UcmError> {
        self.codes("remove", (keys.to_vec(),))
    }

    fn register(&self, buf: Buf) -> Result<(), UcmError> {
        let rc = Python::attach(|py| {
            self.obj
                .call_method1(py, "register", (buf.addr, buf.len))
                .and_then(|r| r.extract::<i64>(py))
                .map_err(|e| UcmError::TaskFailed(format!("register(): {}", e.value(py))))
        })?;
        if rc != 0 {
            return Err(UcmError::TaskFailed(format!("register() returned {rc}")));
        }
        Ok(())
    }

    fn unregister(&self, addr: usize) {
        Python::attach(|py| {
            if let Err(e) = self.obj.call_method1(py, "unregister", (addr,)) {
                log::warn!("Mooncake unregister(): {}", e.value(py));
            }
        })
    }

    fn close(&self) {
        Python::attach(|py| {
            if let Err(e) = self.obj.call_method0(py, "close") {
                log::warn!("Mooncake close(): {}", e.value(py));
            }
        })
    }
}
