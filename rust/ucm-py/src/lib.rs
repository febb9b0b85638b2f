//! Python bindings of `ucm-core`, exposed as `ucm._native`.
//!
//! This crate only converts arguments, releases the GIL around blocking core
//! calls and maps [`ucm_core::UcmError`] to Python exceptions; all behaviour
//! lives in `ucm-core`.

use pyo3::prelude::*;

#[cfg(feature = "bench")]
mod bench;
mod config;
mod errors;
mod hashing;
mod maintain;
mod mooncake_client;
mod py_stage;
mod store;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // Rust `log` records go to Python's `logging` (the target `ucm_core::store::posix` becomes the logger
    // `ucm_core.store.posix`; `ucm.shared.logging` routes it next to `ucm`).
    let _ = pyo3_log::Logger::new(m.py(), pyo3_log::Caching::LoggersAndLevels)?
        .filter_target("ucm_core".to_owned(), log::LevelFilter::Trace)
        .install();
    #[cfg(feature = "bench")]
    bench::register(m)?;
    errors::register(m)?;
    hashing::register(m)?;
    store::register(m)?;
    maintain::register(m)?;
    config::register(m)?;
    Ok(())
}
