//! `NativeStore`: the Python face of the core's stores.
//!
//! Converts ids, shard indices and memory descriptions into owned Rust
//! values, then runs the core call with the GIL released.
//!
//! Caller memory: a transfer submitted with an `owner` (the Python objects
//! whose memory the transfer reads or writes) keeps a reference to it here,
//! in the store, until the core reports the task finished: `wait` returned,
//! `check` said so, the store closed, or a later submit found it finished.
//! The `Task` handle Python holds is only an id, so dropping it, closing
//! the store or garbage-collecting either never frees memory the core still
//! uses. This was chosen over "dropping an unfinished task waits for it":
//! a wait inside a finalizer would block whatever thread the garbage
//! collector happens to run on for up to `timeout_ms`.
//!
//! Over 600 lines because PyO3 (without its `multiple-pymethods` feature)
//! takes a class's Python methods in one `#[pymethods]` block.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};
use ucm_core::config::Geometry;
use ucm_core::store::pipeline::{self, Layer};
use ucm_core::store::registry::Clients;
use ucm_core::store::Store;
use ucm_core::task::TaskId;
use ucm_core::{BlockId, MemSeg, ShardIo};

use crate::errors::{invalid, to_py, IntoPyResult};
use crate::py_stage::PyStage;

/// A pipeline of stores (`Posix`, `Cache|Posix`, `Cache|<a Python
/// store>`...) built in the core, seen from its top stage.
#[pyclass(name = "NativeStore", module = "ucm._native", frozen)]
pub struct PyStore {
    store: Arc<dyn Store>,
    /// Owners of the caller memory of unfinished transfers (module docs).
    owners: Mutex<Owners>,
}

/// Python objects owning the memory of transfers in flight, by task.
struct Owners {
    by_task: HashMap<TaskId, Py<PyAny>>,
    /// Size at which the next submit looks for finished tasks to release.
    sweep_at: usize,
}

/// Smallest [`Owners::sweep_at`]: sweeping costs one `check` per entry,
/// so it runs when the map has doubled since the last sweep.
const MIN_SWEEP: usize = 64;

impl Default for Owners {
    fn default() -> Self {
        Owners {
            by_task: HashMap::new(),
            sweep_at: MIN_SWEEP,
        }
    }
}

impl PyStore {
    /// Keeps `owner` alive until `task` finished; first releases the owners
    /// of tasks that finished without anyone waiting for them.
    fn hold(&self, task: TaskId, owner: Option<Py<PyAny>>) {
        let Some(owner) = owner else { return };
        let released = {
            let mut owners = self.owners.lock();
            owners.by_task.insert(task, owner);
            if owners.by_task.len() < owners.sweep_at {
                return;
            }
            let finished: Vec<TaskId> = owners
                .by_task
                .keys()
                .copied()
                // A handle the core no longer knows was dropped after it
                // finished (never waited): its memory is free too.
                .filter(|t| self.store.check(*t).unwrap_or(true))
                .collect();
            let released: Vec<Py<PyAny>> = finished
                .iter()
                .filter_map(|t| owners.by_task.remove(t))
                .collect();
            owners.sweep_at = (owners.by_task.len() * 2).max(MIN_SWEEP);
            released
        };
        // Dropped outside the lock: a finalizer may call back into the store.
        drop(released);
    }

    /// Releases the owner of a task that finished.
    fn release(&self, task: TaskId) {
        let owner = self.owners.lock().by_task.remove(&task);
        drop(owner);
    }

    /// Releases every owner (the store finished all its work).
    fn release_all(&self) {
        let owners = std::mem::take(&mut *self.owners.lock());
        drop(owners);
    }
}

/// Parses block ids: a sequence of 16-byte `bytes`, or a C-contiguous
/// uint8 buffer of shape (n, 16).
fn parse_ids(ids: &Bound<'_, PyAny>) -> PyResult<Vec<BlockId>> {
    if let Ok(list) = ids.cast::<PyList>() {
        return list_ids(list);
    }
    if let Ok(tuple) = ids.cast::<PyTuple>() {
        let mut out = Vec::with_capacity(tuple.len());
        for (i, item) in tuple.iter().enumerate() {
            out.push(one_id(&item, i)?);
        }
        return Ok(out);
    }
    if let Ok(buf) = PyBuffer::<u8>::get(ids) {
        let shape = buf.shape();
        if shape.len() != 2 || shape[1] != 16 || !buf.is_c_contiguous() {
            return Err(invalid(format!(
                "block_ids array must be C-contiguous uint8 of shape (n, 16), got shape {shape:?}"
            )));
        }
        let bytes = buf.to_vec(ids.py())?;
        return Ok(bytes
            .chunks_exact(16)
            .map(|c| {
                let mut a = [0u8; 16];
                a.copy_from_slice(c);
                BlockId(a)
            })
            .collect());
    }
    // Anything else must at least be iterable; None or a number is a
    // caller's mistake, named as such rather than as Python's bare TypeError.
    let items = ids.try_iter().map_err(|_| {
        invalid(format!(
            "block_ids: expected a sequence of 16-byte ids or a uint8 array of shape (n, 16), \
             got {}",
            ids.get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_default()
        ))
    })?;
    let mut out = Vec::new();
    for (i, item) in items.enumerate() {
        out.push(one_id(&item?, i)?);
    }
    Ok(out)
}

/// The ids in a list, each a 16-byte `bytes` (what the connector passes on
/// every scheduler step). Read through the C API with borrowed references:
/// the safe iteration takes and drops a reference and checks the type
/// through PyO3 for each item, which was most of a lookup of 10,000 ids on
/// the `Empty` store (0.25 of 0.34 ms). Anything else in the list is
/// reported by [`one_id`].
fn list_ids(list: &Bound<'_, PyList>) -> PyResult<Vec<BlockId>> {
    let n = list.len();
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        // SAFETY: `list` is a list we hold a reference to and the GIL is held
        // for the whole loop, in which no Python code runs (no call below can
        // run any), so no thread can change the list or drop its items: a
        // borrowed item stays valid until it is read, and `i` stays within
        // the list's length. A null return (not possible for `i < n`) is
        // handled as an error.
        let item = unsafe { pyo3::ffi::PyList_GetItem(list.as_ptr(), i as isize) };
        if item.is_null() {
            return Err(PyErr::fetch(list.py()));
        }
        let mut data: *mut std::os::raw::c_char = std::ptr::null_mut();
        let mut len: pyo3::ffi::Py_ssize_t = 0;
        // SAFETY: `item` is a live object (above); the type check reads only
        // its type, and for bytes `PyBytes_AsStringAndSize` writes a pointer
        // to its buffer and its length into our two locals.
        let is_bytes = unsafe {
            pyo3::ffi::PyBytes_Check(item) != 0
                && pyo3::ffi::PyBytes_AsStringAndSize(item, &mut data, &mut len) == 0
        };
        if !is_bytes || len != 16 || data.is_null() {
            // The slow path names what is wrong with this item.
            PyErr::take(list.py());
            return Err(match one_id(&list.get_item(i)?, i) {
                Err(e) => e,
                Ok(_) => invalid(format!("block_ids[{i}] could not be read")),
            });
        }
        let mut id = [0u8; 16];
        // SAFETY: `data` points to the 16 bytes of the live bytes object
        // `item` (checked above), which nothing changes during the copy.
        unsafe { std::ptr::copy_nonoverlapping(data.cast::<u8>(), id.as_mut_ptr(), 16) };
        out.push(BlockId(id));
    }
    Ok(out)
}

pub(crate) fn one_id(item: &Bound<'_, PyAny>, i: usize) -> PyResult<BlockId> {
    let bytes = item.cast::<PyBytes>().map_err(|_| {
        invalid(format!(
            "block_ids[{i}] must be bytes, got {}",
            item.get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_default()
        ))
    })?;
    let b = bytes.as_bytes();
    if b.len() != 16 {
        return Err(invalid(format!(
            "block_ids[{i}] must be exactly 16 bytes, got {}",
            b.len()
        )));
    }
    let mut a = [0u8; 16];
    a.copy_from_slice(b);
    Ok(BlockId(a))
}

fn parse_indices(obj: &Bound<'_, PyAny>, n: usize) -> PyResult<Vec<usize>> {
    let v: Vec<i64> = if let Ok(buf) = PyBuffer::<i64>::get(obj) {
        buf.to_vec(obj.py())?
    } else {
        obj.extract()
            .map_err(|_| invalid("shard_index must be a sequence of ints"))?
    };
    if v.len() != n {
        return Err(invalid(format!(
            "shard_index has {} entries but block_ids has {n}; they must match",
            v.len()
        )));
    }
    v.into_iter()
        .enumerate()
        .map(|(i, x)| {
            usize::try_from(x).map_err(|_| invalid(format!("shard_index[{i}] = {x} is negative")))
        })
        .collect()
}

fn u64_matrix(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<(Vec<u64>, usize, usize)> {
    let buf = PyBuffer::<u64>::get(obj).map_err(|_| {
        invalid(format!(
            "{what} must be a 2-D uint64 array (numpy.ndarray of dtype uint64)"
        ))
    })?;
    let shape = buf.shape().to_vec();
    if shape.len() != 2 || !buf.is_c_contiguous() {
        return Err(invalid(format!(
            "{what} must be a C-contiguous 2-D uint64 array, got shape {shape:?}"
        )));
    }
    Ok((buf.to_vec(obj.py())?, shape[0], shape[1]))
}

/// Builds shard descriptions from a (rows, cols) address matrix; column
/// `j` of every row is `sizes[j]` bytes.
fn shards_from_addrs(
    ids: Vec<BlockId>,
    idx: Vec<usize>,
    addrs: &[u64],
    cols: usize,
    sizes: &[usize],
) -> PyResult<Vec<ShardIo>> {
    if sizes.len() != cols {
        return Err(invalid(format!(
            "address rows have {cols} column(s) but the store's tensor_size_list has {} entries",
            sizes.len()
        )));
    }
    Ok(ids
        .into_iter()
        .zip(idx)
        .enumerate()
        .map(|(r, (block, index))| ShardIo {
            block,
            index,
            segs: (0..cols)
                .map(|c| MemSeg {
                    addr: addrs[r * cols + c] as usize,
                    len: sizes[c],
                })
                .collect(),
        })
        .collect())
}

/// Builds shard descriptions from per-row (pointer, length) lists given in
/// CSR form: row `r` is `ptrs[offsets[r]..offsets[r+1]]`.
fn shards_from_segs(
    ids: Vec<BlockId>,
    idx: Vec<usize>,
    ptrs: Vec<u64>,
    lens: Vec<u64>,
    offsets: Vec<u64>,
) -> PyResult<Vec<ShardIo>> {
    if offsets.len() != ids.len() + 1 || ptrs.len() != lens.len() {
        return Err(invalid("tensor description arrays are inconsistent"));
    }
    let mut out = Vec::with_capacity(ids.len());
    for (r, (block, index)) in ids.into_iter().zip(idx).enumerate() {
        let (a, b) = (offsets[r] as usize, offsets[r + 1] as usize);
        if a > b || b > ptrs.len() {
            return Err(invalid("tensor description offsets are out of range"));
        }
        out.push(ShardIo {
            block,
            index,
            segs: (a..b)
                .map(|k| MemSeg {
                    addr: ptrs[k] as usize,
                    len: lens[k] as usize,
                })
                .collect(),
        });
    }
    Ok(out)
}

#[pymethods]
impl PyStore {
    /// Opens a pipeline, built in the core. `stages` are its built-in
    /// stages, top first, each `(name, keys)` with its keys checked as
    /// `ucm._native.check_stage` does. `external`, when given, is the
    /// bottom stage below them: a store written in Python
    /// (`UcmKVStoreBase`), called back with the GIL for misses and
    /// write-backs in the row layout of the `tensor_size_list` of the stage
    /// above it. `clients` holds the clients of other systems that stages
    /// are opened with, by the name `config_schema` gives them (`mooncake`:
    /// a `ucm.store.mooncake.MooncakePool`).
    #[staticmethod]
    #[pyo3(signature = (stages, external=None, clients=None))]
    fn open_pipeline(
        py: Python<'_>,
        stages: Vec<(String, Bound<'_, PyDict>)>,
        external: Option<Bound<'_, PyAny>>,
        clients: Option<Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        let prepared = builtin_layers(&stages).and_then(|layers| {
            let clients = clients_of(clients.as_ref())?;
            Ok((layers, clients))
        });
        let (mut layers, clients) = match (prepared, &external) {
            (Ok(prepared), _) => prepared,
            (Err(e), Some(obj)) => {
                // It was handed over to be closed with the pipeline.
                let _ = obj.call_method0("close");
                return Err(e);
            }
            (Err(e), None) => return Err(e),
        };
        if let Some(obj) = external {
            // A tier's checked keys hold its geometry; a stage over it that
            // is not a tier has none, and the pipeline refuses the order.
            let sizes = match layers.last() {
                Some(Layer::Builtin(_, above)) => Geometry::from_values(above)
                    .map(|g| g.tensor_size_list)
                    .unwrap_or_default(),
                _ => Vec::new(),
            };
            let stage = PyStage::new(py, obj.unbind(), sizes);
            layers.push(Layer::Given(Arc::new(stage)));
        }
        let store = py.detach(|| pipeline::open(layers, &clients)).py_err()?;
        Ok(PyStore {
            store,
            owners: Mutex::new(Owners::default()),
        })
    }

    /// The store's name.
    #[getter]
    fn name(&self) -> &'static str {
        self.store.name()
    }

    /// Presence of each block.
    fn lookup(&self, py: Python<'_>, block_ids: &Bound<'_, PyAny>) -> PyResult<Vec<bool>> {
        let ids = parse_ids(block_ids)?;
        let store = self.store.clone();
        py.detach(move || store.lookup(&ids)).py_err()
    }

    /// Index of the last block of the longest present prefix, or -1.
    fn lookup_on_prefix(&self, py: Python<'_>, block_ids: &Bound<'_, PyAny>) -> PyResult<isize> {
        let ids = parse_ids(block_ids)?;
        let store = self.store.clone();
        py.detach(move || store.lookup_on_prefix(&ids)).py_err()
    }

    /// Background hint that the blocks will be loaded.
    fn prefetch(&self, py: Python<'_>, block_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = parse_ids(block_ids)?;
        let store = self.store.clone();
        py.detach(move || store.prefetch(&ids)).py_err()
    }

    /// Starts a transfer (`direction` "load" or "dump") of the shards named
    /// by `block_ids` / `shard_index`, with the caller's memory in one of two
    /// forms:
    /// - `segments` = (pointers, lengths, row offsets): per-shard segment
    ///   lists in CSR form, taken from the objects in `owner`;
    /// - `addrs`, (n, k) uint64, whose column `j` is `sizes[j]` bytes. With
    ///   `bounds` (the (address, length) of the memory of each object in
    ///   `owner`) every range must lie inside one of them; without, the
    ///   addresses are trusted as they are (the raw `load_data`/`dump_data`
    ///   API).
    ///
    /// `owner` is kept alive until the task finished. A dump waits for the
    /// event `prerequisite_handle` (0: none) before it reads.
    #[pyo3(signature = (direction, block_ids, shard_index, *, segments=None, addrs=None, sizes=None, bounds=None, prerequisite_handle=0, owner=None))]
    #[allow(clippy::too_many_arguments)] // two forms of memory, and its owner
    fn transfer(
        &self,
        py: Python<'_>,
        direction: &str,
        block_ids: &Bound<'_, PyAny>,
        shard_index: &Bound<'_, PyAny>,
        segments: Option<(Vec<u64>, Vec<u64>, Vec<u64>)>,
        addrs: Option<&Bound<'_, PyAny>>,
        sizes: Option<Vec<usize>>,
        bounds: Option<Vec<(u64, u64)>>,
        prerequisite_handle: u64,
        owner: Option<Py<PyAny>>,
    ) -> PyResult<u64> {
        let dump_after = dump_after(direction, prerequisite_handle)?;
        let shards = match (segments, addrs, sizes) {
            (Some(segs), None, None) if bounds.is_none() => {
                seg_shards(block_ids, shard_index, segs)?
            }
            (None, Some(addrs), Some(sizes)) => {
                self.addr_shards(block_ids, shard_index, addrs, &sizes, bounds)?
            }
            _ => {
                return Err(invalid(
                    "give either segments, or addrs with sizes (and optionally bounds)",
                ))
            }
        };
        self.submit(py, shards, dump_after, owner)
    }

    /// Blocks (without the GIL) until the task finishes; raises on failure.
    /// Even when it raises (a timeout included), no I/O of the task touches
    /// caller memory any more, so the task's memory is released.
    fn wait(&self, py: Python<'_>, task_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let task = parse_task_id(task_id)?;
        let store = self.store.clone();
        let res = py.detach(move || store.wait(task));
        self.release(task);
        res.py_err()
    }

    /// True when the task finished; never blocks.
    fn check(&self, task_id: &Bound<'_, PyAny>) -> PyResult<bool> {
        let task = parse_task_id(task_id)?;
        let done = self.store.check(task).py_err()?;
        if done {
            self.release(task);
        }
        Ok(done)
    }

    /// Finishes in-flight work and stops the store's threads (a cache
    /// flushes first, then closes its backend).
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let store = self.store.clone();
        let res = py.detach(move || store.close());
        // Closing finished (or abandoned) every task: no I/O is left.
        self.release_all();
        res.py_err()
    }

    /// Writes every dirty block to the backend; raises if some could not
    /// be written (they stay dirty and are retried).
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        let store = self.store.clone();
        py.detach(move || store.flush()).py_err()
    }

    /// The store's facts (I/O engine, directories, a shared segment's path,
    /// ...) as a dict of strings; a cache's backend facts are prefixed
    /// `backend.`.
    fn describe<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (k, v) in self.store.describe() {
            d.set_item(k, v)?;
        }
        Ok(d)
    }

    /// The store's figures (hit rates, latencies, bytes per tier, ...) as
    /// a dict of floats; a cache's backend figures are prefixed `backend.`.
    fn get_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let store = self.store.clone();
        let stats = py.detach(move || store.stats());
        let d = PyDict::new(py);
        for (k, v) in stats {
            d.set_item(k, v)?;
        }
        Ok(d)
    }
}

/// The built-in stages given to `open_pipeline`, each with its keys
/// checked.
fn builtin_layers(stages: &[(String, Bound<'_, PyDict>)]) -> PyResult<Vec<Layer>> {
    stages
        .iter()
        .map(|(name, values)| {
            let stage = crate::config::find_stage(name)?;
            let checked = stage
                .check(&crate::config::raw_pairs(values)?)
                .map_err(|e| to_py(e.into()))?;
            Ok(Layer::Builtin(stage, checked))
        })
        .collect()
}

/// The clients of other systems given to `open_pipeline`, by name.
fn clients_of(given: Option<&Bound<'_, PyDict>>) -> PyResult<Clients> {
    let mut clients = Clients::default();
    for (name, client) in given.into_iter().flat_map(|d| d.iter()) {
        match name.extract::<String>()?.as_str() {
            "mooncake" => {
                let pool = crate::mooncake_client::PyPoolClient::new(&client)?;
                clients.mooncake = Some(Arc::new(pool));
            }
            other => {
                return Err(invalid(format!(
                    "clients: no stage is opened with a client {other:?} (known: mooncake)"
                )))
            }
        }
    }
    Ok(clients)
}

/// What `submit` takes for a transfer `direction`: None for a load, the
/// prerequisite event for a dump. A load has no prerequisite.
fn dump_after(direction: &str, prerequisite_handle: u64) -> PyResult<Option<u64>> {
    match direction {
        "load" if prerequisite_handle == 0 => Ok(None),
        "load" => Err(invalid("a load has no prerequisite_handle")),
        "dump" => Ok(Some(prerequisite_handle)),
        other => Err(invalid(format!(
            "direction must be \"load\" or \"dump\", not {other:?}"
        ))),
    }
}

/// The shards named by `block_ids` / `shard_index`, with segments in CSR
/// form (`transfer` with `segments`).
fn seg_shards(
    block_ids: &Bound<'_, PyAny>,
    shard_index: &Bound<'_, PyAny>,
    (ptrs, lens, offsets): (Vec<u64>, Vec<u64>, Vec<u64>),
) -> PyResult<Vec<ShardIo>> {
    let ids = parse_ids(block_ids)?;
    let idx = parse_indices(shard_index, ids.len())?;
    shards_from_segs(ids, idx, ptrs, lens, offsets)
}

impl PyStore {
    /// Starts a load of `shards` (`dump_after` None) or a dump of them
    /// once that prerequisite event fired, without the GIL; keeps `owner`
    /// alive until the task finished.
    fn submit(
        &self,
        py: Python<'_>,
        shards: Vec<ShardIo>,
        dump_after: Option<u64>,
        owner: Option<Py<PyAny>>,
    ) -> PyResult<u64> {
        let store = self.store.clone();
        let task = py
            .detach(move || match dump_after {
                None => store.load(shards),
                Some(prerequisite) => store.dump(shards, prerequisite),
            })
            .py_err()?;
        self.hold(task, owner);
        Ok(task)
    }

    fn addr_shards(
        &self,
        block_ids: &Bound<'_, PyAny>,
        shard_index: &Bound<'_, PyAny>,
        addrs: &Bound<'_, PyAny>,
        sizes: &[usize],
        bounds: Option<Vec<(u64, u64)>>,
    ) -> PyResult<Vec<ShardIo>> {
        let ids = parse_ids(block_ids)?;
        let idx = parse_indices(shard_index, ids.len())?;
        let (flat, rows, cols) = u64_matrix(addrs, "addrs")?;
        if rows != ids.len() {
            return Err(invalid(format!(
                "addrs has {rows} row(s) but block_ids has {}; they must match",
                ids.len()
            )));
        }
        let shards = shards_from_addrs(ids, idx, &flat, cols, sizes)?;
        if let Some(bounds) = bounds {
            check_within(&shards, bounds)?;
        }
        Ok(shards)
    }
}

/// A task handle from Python: a positive integer that fits 64 bits.
fn parse_task_id(obj: &Bound<'_, PyAny>) -> PyResult<TaskId> {
    let describe = || {
        let ty = obj
            .get_type()
            .name()
            .map(|n| n.to_string())
            .unwrap_or_default();
        let shown = obj.repr().map(|r| r.to_string()).unwrap_or_default();
        invalid(format!(
            "task must be a handle returned by load/dump (a positive integer), got {ty} {shown}"
        ))
    };
    if obj.is_instance_of::<pyo3::types::PyBool>() {
        return Err(describe());
    }
    match obj.extract::<u64>() {
        Ok(id) if id > 0 => Ok(id),
        _ => Err(describe()),
    }
}

/// Checks that every segment lies inside one of `bounds` (address, length):
/// the memory of the objects the caller handed over with the addresses.
fn check_within(shards: &[ShardIo], mut bounds: Vec<(u64, u64)>) -> PyResult<()> {
    bounds.sort_unstable();
    for (r, shard) in shards.iter().enumerate() {
        for (c, seg) in shard.segs.iter().enumerate() {
            let (addr, len) = (seg.addr as u64, seg.len as u64);
            // The last region starting at or before `addr`.
            let i = bounds.partition_point(|(start, _)| *start <= addr);
            let inside = i > 0 && {
                let (start, size) = bounds[i - 1];
                addr.checked_add(len)
                    .is_some_and(|end| end <= start.saturating_add(size))
            };
            if !inside {
                return Err(invalid(format!(
                    "addresses[{r}][{c}]: {len} bytes at {addr:#x} lie outside the memory of \
                     the tensors given with them"
                )));
            }
        }
    }
    Ok(())
}

impl Drop for PyStore {
    fn drop(&mut self) {
        // Joining the store's threads must not happen with the GIL held:
        // they may be logging through Python (or be a Python store).
        let store = self.store.clone();
        Python::attach(|py| {
            py.detach(move || {
                let _ = store.close();
            })
        });
    }
}

/// Test and tooling hook: where a block's file lives (None for stores
/// that keep no files).
#[pyfunction]
fn debug_block_path(store: &PyStore, block_id: &Bound<'_, PyAny>) -> PyResult<Option<String>> {
    let id = one_id(block_id, 0)?;
    Ok(store
        .store
        .debug()
        .and_then(|d| d.block_path(&id))
        .map(|p| p.display().to_string()))
}

/// Test hook: takes a shared cache's lock and never returns (the test kills
/// the process to check recovery); raises for stores without such a lock.
#[pyfunction]
fn debug_hold_lock_forever(py: Python<'_>, store: &PyStore) -> PyResult<()> {
    let s = store.store.clone();
    let held = py.detach(move || s.debug().is_some_and(|d| d.hold_lock_forever()));
    if held {
        Ok(())
    } else {
        Err(invalid("this store has no lock to hold"))
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyStore>()?;
    m.add_function(wrap_pyfunction!(debug_block_path, m)?)?;
    m.add_function(wrap_pyfunction!(debug_hold_lock_forever, m)?)?;
    Ok(())
}
