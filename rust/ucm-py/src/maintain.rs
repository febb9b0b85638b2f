//! `ucm._native.Maintenance`: a store's contents as `ucm store` sees them.

use std::path::PathBuf;
use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use ucm_core::store::maintain::Maintenance;
use ucm_core::store::posix::PosixMaintenance;

use crate::errors::{invalid, IntoPyResult};
use crate::store::one_id;

/// The maintenance of one stage's contents.
#[pyclass(name = "Maintenance", module = "ucm._native", frozen)]
pub struct PyMaintenance {
    inner: Arc<dyn Maintenance>,
}

#[pymethods]
impl PyMaintenance {
    /// Opens the maintenance of stage `stage` with its keys `values`; only
    /// the keys that say where the blocks live are used (the geometry is
    /// read from the blocks themselves).
    #[staticmethod]
    fn open(stage: &str, values: &Bound<'_, PyDict>) -> PyResult<Self> {
        let s = crate::config::find_stage(stage)?;
        let inner: Arc<dyn Maintenance> = match s.name {
            "Posix" => {
                let raw = values
                    .get_item("storage_backends")?
                    .ok_or_else(|| invalid("storage_backends: required"))?;
                let dirs: Vec<PathBuf> = match raw.extract::<String>() {
                    Ok(one) => one
                        .split(':')
                        .filter(|p| !p.is_empty())
                        .map(PathBuf::from)
                        .collect(),
                    Err(_) => raw.extract::<Vec<PathBuf>>()?,
                };
                Arc::new(PosixMaintenance::new(dirs).py_err()?)
            }
            other => {
                return Err(invalid(format!(
                    "store maintenance of {other} stages is not available in this build"
                )))
            }
        };
        Ok(PyMaintenance { inner })
    }

    /// Every block: a list of (id bytes, size in bytes, mtime in seconds).
    fn blocks<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let m = self.inner.clone();
        let blocks = py.detach(move || m.blocks()).py_err()?;
        let out = PyList::empty(py);
        for b in blocks {
            let secs = b
                .modified
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            out.append((PyBytes::new(py, &b.id.0), b.bytes, secs))?;
        }
        Ok(out)
    }

    /// Verifies every shard of a block; raises `CorruptBlockError` (or an
    /// OS error) naming the block and the shard.
    fn verify(&self, py: Python<'_>, block_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let id = one_id(block_id, 0)?;
        let m = self.inner.clone();
        py.detach(move || m.verify(&id)).py_err()
    }

    /// Removes a block; False if it was not there.
    fn remove(&self, py: Python<'_>, block_id: &Bound<'_, PyAny>) -> PyResult<bool> {
        let id = one_id(block_id, 0)?;
        let m = self.inner.clone();
        py.detach(move || m.remove(&id)).py_err()
    }

    /// Removes what stopped stores left behind: a dict of counts.
    fn gc<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let m = self.inner.clone();
        let r = py.detach(move || m.gc()).py_err()?;
        let d = PyDict::new(py);
        d.set_item("temporaries", r.temporaries)?;
        d.set_item("foreign", r.foreign)?;
        Ok(d)
    }

    /// Where the blocks live.
    #[getter]
    fn location(&self) -> String {
        self.inner.location()
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyMaintenance>()
}
