//! Measurement helpers exposed for the Python benchmarks.

use std::path::PathBuf;

use pyo3::prelude::*;
use ucm_core::io::{baseline_direct_io, IoOp};
use ucm_core::store::format::checksum_baseline::checksum_gbps;

use crate::errors::{invalid, IntoPyResult};

/// GB/s of plain sequential O_DIRECT pread (`op="read"`) or pwrite
/// (`op="write"`) of `total_bytes` in `io_size` I/Os at `queue_depth`, in a
/// scratch file under `dir`: the baseline benchmarks compare stores against.
#[pyfunction]
fn baseline_direct_io_gbps(
    py: Python<'_>,
    dir: PathBuf,
    op: &str,
    total_bytes: usize,
    io_size: usize,
    queue_depth: usize,
) -> PyResult<f64> {
    let op = match op {
        "read" => IoOp::Read,
        "write" => IoOp::Write,
        other => {
            return Err(invalid(format!(
                "op must be \"read\" or \"write\", got {other:?}"
            )))
        }
    };
    py.detach(|| baseline_direct_io(&dir, op, total_bytes, io_size, queue_depth))
        .map_err(|e| pyo3::exceptions::PyOSError::new_err(e.to_string()))
}

/// GB/s of the checksum every load verifies, over `total_bytes` in memory
/// in shards of `piece_bytes`, on `threads` threads (best of three passes).
#[pyfunction]
fn baseline_checksum_gbps(
    py: Python<'_>,
    total_bytes: usize,
    piece_bytes: usize,
    threads: usize,
) -> PyResult<f64> {
    py.detach(|| checksum_gbps(total_bytes, piece_bytes, threads))
        .py_err()
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(baseline_direct_io_gbps, m)?)?;
    m.add_function(wrap_pyfunction!(baseline_checksum_gbps, m)?)
}
