//! `ucm._native.Maintenance`: a store's contents as `ucm store` sees them.

use std::path::PathBuf;
use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use ucm_core::config::Stage;
use ucm_core::config::Values;
use ucm_core::store::maintain::Maintenance;
use ucm_core::store::nfs::maintain::maintenance as nfs_maintenance;
use ucm_core::store::nfs::NfsConfig;
use ucm_core::store::posix::PosixMaintenance;
use ucm_core::store::s3::{S3Config, S3Maintenance};

use crate::errors::{invalid, to_py, IntoPyResult};
use crate::store::one_id;

/// The maintenance of one stage's contents.
#[pyclass(name = "Maintenance", module = "ucm._native", frozen)]
pub struct PyMaintenance {
    inner: Arc<dyn Maintenance>,
}

#[pymethods]
impl PyMaintenance {
    /// Opens the maintenance of stage `stage` with its keys `values`; only
    /// the keys that say where the blocks live (and how to reach them) are
    /// used: the geometry is read from the blocks themselves.
    #[staticmethod]
    fn open(py: Python<'_>, stage: &str, values: &Bound<'_, PyDict>) -> PyResult<Self> {
        let s = crate::config::find_stage(stage)?;
        let cfg_err = |e: ucm_core::config::ConfigError| to_py(e.into());
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
            "NFS" => {
                let v = location_values(py, s, values)?;
                let cfg = NfsConfig::from_values(&v).map_err(cfg_err)?;
                Arc::from(py.detach(|| nfs_maintenance(&cfg)).py_err()?)
            }
            "S3" => {
                let v = location_values(py, s, values)?;
                let cfg = S3Config::from_values(&v).map_err(cfg_err)?;
                Arc::new(py.detach(|| S3Maintenance::open(cfg)).py_err()?)
            }
            other => {
                return Err(invalid(format!(
                    "store maintenance of {other} stages is not available (Posix, S3 and \
                     NFS stages only)"
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

/// The keys of stage `stage` in `values`, checked as the stage declares
/// them, for a lookup-only view of the store: a config written for an
/// engine names keys of other stages too, and may lack the geometry, which
/// maintenance does not use (a one-page block stands in for it).
fn location_values(py: Python<'_>, stage: &Stage, values: &Bound<'_, PyDict>) -> PyResult<Values> {
    let mine = PyDict::new(py);
    for (k, v) in values.iter() {
        if stage.key(&k.extract::<String>()?).is_some() {
            mine.set_item(k, v)?;
        }
    }
    let given =
        |key: &str| -> PyResult<bool> { Ok(mine.get_item(key)?.is_some_and(|v| !v.is_none())) };
    if !given("block_size")? {
        for key in ["shard_size", "tensor_size", "tensor_size_list"] {
            if mine.contains(key)? {
                mine.del_item(key)?;
            }
        }
        mine.set_item("block_size", 4096)?;
    }
    mine.set_item("device_id", -1)?;
    crate::config::parse(stage, &mine)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyMaintenance>()
}
