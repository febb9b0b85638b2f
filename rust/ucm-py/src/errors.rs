//! The single mapping from core errors to Python exceptions.
//!
//! The exception classes live in `ucm.errors` (Python), because several
//! of them also derive from a built-in (`ValueError`, `KeyError`,
//! `TimeoutError`, ...) and PyO3's `create_exception!` takes one base only.
//! This module looks the class up by numeric code and builds it with the
//! message and code.

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use ucm_core::UcmError;

static ERROR_FACTORY: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

fn factory(py: Python<'_>) -> PyResult<&Bound<'_, PyAny>> {
    ERROR_FACTORY
        .get_or_try_init(py, || {
            Ok::<_, PyErr>(
                py.import("ucm.errors")?
                    .getattr("error_from_code")?
                    .unbind(),
            )
        })
        .map(|f| f.bind(py))
}

/// Converts a core error into the matching `ucm.errors` exception; a
/// config error becomes `ucm.shared.config.ConfigError` with `.key` and
/// `.reason` set, so the caller can add where the value came from.
pub fn to_py(err: UcmError) -> PyErr {
    if let UcmError::Config { key, reason } = &err {
        let made = Python::attach(|py| -> PyResult<PyErr> {
            let cls = py.import("ucm.shared.config")?.getattr("ConfigError")?;
            let exc = cls.call1((err.to_string(),))?;
            exc.setattr("key", key)?;
            exc.setattr("reason", reason)?;
            Ok(PyErr::from_value(exc))
        });
        return made.unwrap_or_else(|e| e);
    }
    let code = err.code();
    let msg = err.to_string();
    Python::attach(|py| match factory(py) {
        Ok(f) => match f.call1((code, msg.clone())) {
            Ok(exc) => PyErr::from_value(exc),
            Err(e) => e,
        },
        Err(_) => PyRuntimeError::new_err(format!("{code}, {msg}")),
    })
}

/// An `InvalidParamError` for bad arguments detected in the binding.
pub fn invalid(msg: impl Into<String>) -> PyErr {
    to_py(UcmError::InvalidParam(msg.into()))
}

/// Extension trait: `core_call().py_err()?`.
pub trait IntoPyResult<T> {
    /// Maps the core error with [`to_py`].
    fn py_err(self) -> PyResult<T>;
}

impl<T> IntoPyResult<T> for Result<T, UcmError> {
    fn py_err(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}

pub fn register(_m: &Bound<'_, PyModule>) -> PyResult<()> {
    Ok(())
}
