//! `block_ids` / `root_id`: argument conversion for `ucm_core::hashing`.
//!
//! Token ids are copied into a `Vec<i64>` while the GIL is held (so nothing
//! can mutate them under us), then hashed with the GIL released.

use std::str::FromStr;

use pyo3::buffer::{ElementType, PyUntypedBuffer};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyString, PyTuple};
use ucm_core::hashing::{self, HashAlgo};
use ucm_core::BlockId;

use crate::errors::{invalid, IntoPyResult};

/// Below this many tokens the GIL is kept: hashing is shorter than a switch.
const DETACH_MIN_TOKENS: usize = 4096;

/// Converts `meta` (str or bytes) into bytes.
fn meta_bytes(meta: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    if let Ok(s) = meta.cast::<PyString>() {
        Ok(s.to_str()?.as_bytes().to_vec())
    } else if let Ok(b) = meta.cast::<PyBytes>() {
        Ok(b.as_bytes().to_vec())
    } else {
        Err(invalid(format!(
            "meta must be str or bytes, got {}",
            type_name(meta)
        )))
    }
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".to_owned())
}

fn parse_algo(algo: &str) -> PyResult<HashAlgo> {
    HashAlgo::from_str(algo).py_err()
}

/// Copies a 1-D buffer of `T` (any strides) into a `Vec<T>`.
fn copy_buffer<T: pyo3::buffer::Element>(
    py: Python<'_>,
    buf: &PyUntypedBuffer,
) -> PyResult<Vec<T>> {
    buf.as_typed::<T>()
        .map_err(|e| invalid(format!("token_ids buffer: {e}")))?
        .to_vec(py)
}

fn widen<T: Into<i64>>(v: Vec<T>) -> Vec<i64> {
    v.into_iter().map(Into::into).collect()
}

/// A numpy-like name of a buffer element type, for error messages.
fn element_name(t: ElementType) -> String {
    match t {
        ElementType::SignedInteger { bytes } => format!("int{}", bytes * 8),
        ElementType::UnsignedInteger { bytes } => format!("uint{}", bytes * 8),
        ElementType::Float { bytes } => format!("float{}", bytes * 8),
        ElementType::Bool => "bool".to_owned(),
        _ => "unknown".to_owned(),
    }
}

/// Token ids from a buffer-protocol object (int32/int64/uint32/uint64 items).
fn tokens_from_buffer(py: Python<'_>, buf: &PyUntypedBuffer) -> PyResult<Vec<i64>> {
    if buf.dimensions() != 1 {
        return Err(invalid(format!(
            "token_ids must be 1-D, got {} dimensions",
            buf.dimensions()
        )));
    }
    match ElementType::from_format(buf.format()) {
        ElementType::SignedInteger { bytes: 8 } => copy_buffer::<i64>(py, buf),
        ElementType::SignedInteger { bytes: 4 } => copy_buffer::<i32>(py, buf).map(widen),
        ElementType::UnsignedInteger { bytes: 4 } => copy_buffer::<u32>(py, buf).map(widen),
        ElementType::UnsignedInteger { bytes: 8 } => copy_buffer::<u64>(py, buf)?
            .into_iter()
            .enumerate()
            .map(|(i, v)| {
                i64::try_from(v)
                    .map_err(|_| invalid(format!("token_ids[{i}] = {v} does not fit in int64")))
            })
            .collect(),
        other => Err(invalid(format!(
            "token_ids must hold integers (int32, int64, uint32 or uint64), got {} items \
             (buffer format {:?})",
            element_name(other),
            buf.format()
        ))),
    }
}

/// Token ids from a list: exact `int` items are read through the C API
/// directly (about 3x faster than generic extraction, which matters because a
/// 32k-token list otherwise costs more than hashing it); anything else goes
/// through `item`.
fn tokens_from_list(
    list: &Bound<'_, PyList>,
    item: impl Fn(usize, Bound<'_, PyAny>) -> PyResult<i64>,
) -> PyResult<Vec<i64>> {
    let py = list.py();
    let n = list.len();
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        // SAFETY: we hold the GIL (`py`) and `list` is a live list. The C call
        // bounds-checks `i` and returns a borrowed reference (or NULL with an
        // IndexError set, if a callback of an earlier item shrank the list).
        let raw = unsafe { ffi::PyList_GetItem(list.as_ptr(), i as ffi::Py_ssize_t) };
        if raw.is_null() {
            return Err(PyErr::fetch(py));
        }
        // SAFETY: `raw` is a valid object pointer (borrowed, see above).
        if unsafe { ffi::PyLong_CheckExact(raw) } != 0 {
            let mut overflow: std::os::raw::c_int = 0;
            // SAFETY: `raw` is an exact int, so no Python code runs (no
            // `__index__`) and the borrowed reference stays valid.
            let v = unsafe { ffi::PyLong_AsLongLongAndOverflow(raw, &mut overflow) };
            if overflow == 0 && !(v == -1 && PyErr::occurred(py)) {
                out.push(v);
                continue;
            }
        }
        // Slow path (int subclasses, non-ints, overflow): an owned reference,
        // so arbitrary Python code may run safely.
        out.push(item(i, list.get_item(i)?)?);
    }
    Ok(out)
}

/// Token ids from a list, tuple or other iterable of Python ints.
fn tokens_from_sequence(obj: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    let item = |i: usize, v: Bound<'_, PyAny>| -> PyResult<i64> {
        v.extract::<i64>().map_err(|_| {
            invalid(format!(
                "token_ids[{i}] must be an int in the int64 range, got {} {}",
                type_name(&v),
                v.repr().map(|r| r.to_string()).unwrap_or_default()
            ))
        })
    };
    if let Ok(list) = obj.cast::<PyList>() {
        tokens_from_list(list, item)
    } else if let Ok(tuple) = obj.cast::<PyTuple>() {
        tuple.iter().enumerate().map(|(i, v)| item(i, v)).collect()
    } else if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
        Err(invalid(format!(
            "token_ids must be a sequence of ints or an integer array, got {}",
            type_name(obj)
        )))
    } else {
        let it = obj.try_iter().map_err(|_| {
            invalid(format!(
                "token_ids must be a sequence of ints or an integer array, got {}",
                type_name(obj)
            ))
        })?;
        it.enumerate().map(|(i, v)| item(i, v?)).collect()
    }
}

/// Token ids as i64, from any accepted input.
fn extract_tokens(py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    if obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() {
        return tokens_from_sequence(obj);
    }
    match PyUntypedBuffer::get(obj) {
        Ok(buf) => {
            let r = tokens_from_buffer(py, &buf);
            buf.release(py);
            r
        }
        Err(_) => tokens_from_sequence(obj),
    }
}

fn parse_parent(parent: Option<&Bound<'_, PyAny>>) -> PyResult<Option<BlockId>> {
    let Some(p) = parent else { return Ok(None) };
    if p.is_none() {
        return Ok(None);
    }
    let b = p.cast::<PyBytes>().map_err(|_| {
        invalid(format!(
            "parent must be None or 16 bytes, got {}",
            type_name(p)
        ))
    })?;
    BlockId::from_slice(b.as_bytes()).map(Some).map_err(|_| {
        invalid(format!(
            "parent must be exactly 16 bytes, got {} bytes",
            b.as_bytes().len()
        ))
    })
}

/// One 16-byte id per full block of `token_ids`, chained from `parent` (or
/// the root id of `meta`). See `ucm.hashing.block_ids`.
#[pyfunction]
#[pyo3(signature = (token_ids, block_size, meta, algo = "blake3", parent = None))]
fn block_ids<'py>(
    py: Python<'py>,
    token_ids: &Bound<'py, PyAny>,
    block_size: i64,
    meta: &Bound<'py, PyAny>,
    algo: &str,
    parent: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyList>> {
    let algo = parse_algo(algo)?;
    let block_size = usize::try_from(block_size)
        .map_err(|_| invalid(format!("block_size must be at least 1, got {block_size}")))?;
    let meta = meta_bytes(meta)?;
    let parent = parse_parent(parent)?;
    let tokens = extract_tokens(py, token_ids)?;
    let run = || hashing::block_ids(&tokens, block_size, &meta, algo, parent);
    let ids = if tokens.len() >= DETACH_MIN_TOKENS {
        py.detach(run)
    } else {
        run()
    }
    .py_err()?;
    PyList::new(py, ids.iter().map(|id| PyBytes::new(py, &id.0)))
}

/// The root id (parent of block 0) of `meta` for `algo`.
#[pyfunction]
#[pyo3(signature = (meta, algo = "blake3"))]
fn root_id<'py>(
    py: Python<'py>,
    meta: &Bound<'py, PyAny>,
    algo: &str,
) -> PyResult<Bound<'py, PyBytes>> {
    let algo = parse_algo(algo)?;
    let meta = meta_bytes(meta)?;
    Ok(PyBytes::new(py, &hashing::root_id(&meta, algo).0))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(block_ids, m)?)?;
    m.add_function(wrap_pyfunction!(root_id, m)?)?;
    m.add("HASH_ALGOS", PyTuple::new(m.py(), HashAlgo::NAMES)?)?;
    Ok(())
}
