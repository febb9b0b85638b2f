//! Constructors of the shared remote tiers, returning `NativeStore`s:
//! `open_s3_store` (S3-compatible object storage) and `open_nfs_store` (an
//! NFS export through the built-in NFSv3 client, or a kernel-mounted
//! directory). Being `NativeStore`s, they can sit under a `Cache` stage
//! with every transfer staying in Rust.
//!
//! Arguments mirror the config keys one to one (validated and documented in
//! `ucm.store.remote_config`); opening connects and checks access, so it
//! runs with the GIL released.

use std::sync::Arc;

use pyo3::prelude::*;
use ucm_core::store::nfs::{NfsConfig, NfsStore};
use ucm_core::store::s3::{S3Config, S3Store};

use crate::errors::IntoPyResult;
use crate::store::PyStore;

/// Opens an S3 store over `url` (`s3://bucket/prefix`).
#[pyfunction]
#[pyo3(signature = (url, block_size, shard_size, tensor_size_list, endpoint=String::new(),
    region=String::new(), access_key=String::new(), secret_key=String::new(),
    session_token=String::new(), virtual_hosted_style=false, max_concurrency=32, retries=3,
    timeout_ms=30000, lookup_cache_ttl_ms=30000, negative_cache_ttl_ms=1000,
    staging_bytes=1u64 << 30, io_threads=2, device_id=0))]
#[allow(clippy::too_many_arguments)] // mirrors the config keys one to one
fn open_s3_store(
    py: Python<'_>,
    url: String,
    block_size: usize,
    shard_size: usize,
    tensor_size_list: Vec<usize>,
    endpoint: String,
    region: String,
    access_key: String,
    secret_key: String,
    session_token: String,
    virtual_hosted_style: bool,
    max_concurrency: usize,
    retries: usize,
    timeout_ms: u64,
    lookup_cache_ttl_ms: u64,
    negative_cache_ttl_ms: u64,
    staging_bytes: u64,
    io_threads: usize,
    device_id: i64,
) -> PyResult<PyStore> {
    let cfg = S3Config {
        url,
        endpoint,
        region,
        access_key,
        secret_key,
        session_token,
        virtual_hosted_style,
        max_concurrency,
        retries,
        timeout_ms,
        lookup_cache_ttl_ms,
        negative_cache_ttl_ms,
        staging_bytes,
        io_threads,
        block_size,
        shard_size,
        tensor_size_list,
        device_id,
    };
    let store = py.detach(|| S3Store::open(cfg)).py_err()?;
    Ok(PyStore::plain(Arc::new(store), None))
}

/// Opens an NFS store over `target` (`nfs://server/export/path`, or a
/// directory on a kernel-mounted export).
#[pyfunction]
#[pyo3(signature = (target, block_size, shard_size, tensor_size_list, mount_options=String::new(),
    max_concurrency=8, timeout_ms=30000, lookup_cache_ttl_ms=30000, io_direct=false,
    io_threads=2, device_id=0))]
#[allow(clippy::too_many_arguments)] // mirrors the config keys one to one
fn open_nfs_store(
    py: Python<'_>,
    target: String,
    block_size: usize,
    shard_size: usize,
    tensor_size_list: Vec<usize>,
    mount_options: String,
    max_concurrency: usize,
    timeout_ms: u64,
    lookup_cache_ttl_ms: u64,
    io_direct: bool,
    io_threads: usize,
    device_id: i64,
) -> PyResult<PyStore> {
    let cfg = NfsConfig {
        target,
        mount_options,
        max_concurrency,
        timeout_ms,
        lookup_cache_ttl_ms,
        io_direct,
        io_threads,
        block_size,
        shard_size,
        tensor_size_list,
        device_id,
    };
    let store = py.detach(|| NfsStore::open(cfg)).py_err()?;
    Ok(PyStore::plain(Arc::new(store), None))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(open_s3_store, m)?)?;
    m.add_function(wrap_pyfunction!(open_nfs_store, m)?)?;
    Ok(())
}
