//! `ucm._native.Maintenance`: a store's contents as `ucm store` sees them.
//! Its long jobs (every block verified, removals planned and carried out)
//! run on a thread of their own, on the store's pool of threads, without
//! the GIL: Python polls a [`PyJob`] for its progress (a progress bar) and
//! can cancel it.

use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use ucm_core::block::BlockId;
use ucm_core::store::maintain::{
    self, Identity, ItemKind, Kept, Maintenance, Outcome, Plan, Progress, VerifyReport,
};
use ucm_core::UcmError;

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
    /// used: the geometry is read from the blocks themselves. A Posix
    /// directory that is not recognised as a store is refused.
    #[staticmethod]
    fn open(py: Python<'_>, stage: &str, values: &Bound<'_, PyDict>) -> PyResult<Self> {
        let stage = crate::config::find_stage(stage)?;
        let raw = crate::config::raw_pairs(values)?;
        let inner = py.detach(|| stage.open_maintenance(&raw)).py_err()?;
        Ok(PyMaintenance { inner })
    }

    /// Where the blocks live.
    #[getter]
    fn location(&self) -> String {
        self.inner.location()
    }

    /// How each root was recognised: (path, how, n) where how is `marked`
    /// (n: the format), `adoptable` (n: block files sampled) or
    /// `per-object` (no marker; each object is checked before removal).
    fn identity(&self) -> Vec<(String, &'static str, u64)> {
        self.inner
            .identity()
            .into_iter()
            .map(|(path, id)| match id {
                Identity::Marked { format } => (path, "marked", u64::from(format)),
                Identity::Adoptable { sampled } => (path, "adoptable", sampled as u64),
                Identity::PerObject => (path, "per-object", 0),
            })
            .collect()
    }

    /// Blocks, bytes and (with `ages`, or where the listing gives them)
    /// the blocks per age bucket, each bucket younger than a bound in
    /// seconds, then the rest.
    fn summary<'py>(
        &self,
        py: Python<'py>,
        ages: bool,
        bounds: Vec<f64>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let bounds = bounds
            .iter()
            .map(|s| {
                Duration::try_from_secs_f64(*s)
                    .map_err(|_| invalid(format!("age bound {s}: not a number of seconds")))
            })
            .collect::<PyResult<Vec<_>>>()?;
        let m = self.inner.clone();
        let now = std::time::SystemTime::now();
        let s = py
            .detach(move || maintain::summarize(&*m, ages, &bounds, now))
            .py_err()?;
        let d = PyDict::new(py);
        d.set_item("blocks", s.blocks)?;
        d.set_item("bytes", s.bytes)?;
        d.set_item("estimated_bytes", s.estimated_bytes)?;
        d.set_item("sized", s.sized)?;
        d.set_item("ages", s.ages)?;
        d.set_item("odd", kept_list(&s.odd))?;
        Ok(d)
    }

    /// Every block: a list of (id bytes, size in bytes, mtime in seconds).
    fn blocks<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let m = self.inner.clone();
        let listing = py.detach(move || m.list(true)).py_err()?;
        let out = PyList::empty(py);
        for b in listing.blocks {
            let secs = b
                .modified
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map_or(0.0, |d| d.as_secs_f64());
            out.append((PyBytes::new(py, &b.id.0), b.bytes.unwrap_or(0), secs))?;
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

    /// Starts verifying every block. Its result: a dict of `blocks`,
    /// `failures` ((id, message, corrupt) each), `vanished` and `odd`.
    fn start_verify(&self) -> PyJob {
        self.start(|m, p| JobResult::Verify(maintain::verify_all(m, p)))
    }

    /// Starts planning `clear`: every block file, checked. Its result: a
    /// `RemovalPlan`.
    fn start_plan_clear(&self) -> PyJob {
        self.start(|m, p| JobResult::Plan(maintain::plan_clear(m, p)))
    }

    /// Starts planning `gc`: what stopped stores left and the corrupt
    /// blocks (every block verified). Its result: a `RemovalPlan`.
    fn start_plan_gc(&self) -> PyJob {
        self.start(|m, p| JobResult::Plan(maintain::plan_gc(m, p)))
    }

    /// Starts planning the removal of the corrupt blocks `block_ids` (with
    /// what is wrong with each, `details`). Its result: a `RemovalPlan`.
    fn start_plan_corrupt(
        &self,
        block_ids: &Bound<'_, PyList>,
        details: Vec<String>,
    ) -> PyResult<PyJob> {
        if block_ids.len() != details.len() {
            return Err(invalid("block_ids and details differ in length"));
        }
        let blocks = block_ids
            .iter()
            .enumerate()
            .map(|(i, b)| one_id(&b, i))
            .collect::<PyResult<Vec<BlockId>>>()?
            .into_iter()
            .zip(details)
            .map(|(id, d)| (id, ItemKind::Corrupt, d))
            .collect();
        Ok(self.start(move |m, p| JobResult::Plan(maintain::plan_blocks(m, blocks, p))))
    }

    /// Starts carrying out `plan`. Its result: a dict of `removed` (kind ->
    /// (items, files, bytes)), `gone`, `kept`, `failed` and `marked`.
    fn start_execute(&self, plan: &PyPlan) -> PyJob {
        let plan = plan.plan.clone();
        self.start(move |m, p| JobResult::Outcome(maintain::execute(m, &plan, p)))
    }
}

impl PyMaintenance {
    fn start(
        &self,
        job: impl FnOnce(&dyn Maintenance, &Progress) -> JobResult + Send + 'static,
    ) -> PyJob {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let progress = Arc::new(Progress::default());
        let (m, p) = (self.inner.clone(), progress.clone());
        let spawned = std::thread::Builder::new()
            .name("ucm-store-job".into())
            .spawn(move || {
                let _ = tx.send(job(&*m, &p));
            });
        let done = match spawned {
            Ok(_) => None,
            Err(e) => Some(JobResult::Failed(UcmError::TaskFailed(format!(
                "cannot start a thread: {e}"
            )))),
        };
        PyJob {
            progress,
            rx: Mutex::new(rx),
            result: Mutex::new(done),
        }
    }
}

/// What a job gives back.
enum JobResult {
    Verify(ucm_core::Result<VerifyReport>),
    Plan(ucm_core::Result<Plan>),
    Outcome(ucm_core::Result<Outcome>),
    Failed(UcmError),
}

/// A maintenance job running on its own thread.
#[pyclass(name = "MaintenanceJob", module = "ucm._native", frozen)]
pub struct PyJob {
    progress: Arc<Progress>,
    rx: Mutex<Receiver<JobResult>>,
    result: Mutex<Option<JobResult>>,
}

#[pymethods]
impl PyJob {
    /// The phase running (`listing`, `verifying`, `checking`, `removing`...).
    #[getter]
    fn phase(&self) -> &'static str {
        self.progress.phase()
    }

    /// Items of the phase, None while not known.
    #[getter]
    fn total(&self) -> Option<u64> {
        self.progress.total()
    }

    /// Items of the phase done.
    #[getter]
    fn done(&self) -> u64 {
        self.progress.done()
    }

    /// Waits up to `timeout` seconds (without the GIL); True once the job
    /// has finished.
    fn wait(&self, py: Python<'_>, timeout: f64) -> bool {
        if self.result.lock().is_some() {
            return true;
        }
        let timeout = Duration::try_from_secs_f64(timeout).unwrap_or_default();
        let got = py.detach(|| self.rx.lock().recv_timeout(timeout));
        let r = match got {
            Ok(r) => r,
            Err(RecvTimeoutError::Timeout) => return false,
            Err(RecvTimeoutError::Disconnected) => {
                JobResult::Failed(UcmError::TaskFailed("the job's thread failed".into()))
            }
        };
        *self.result.lock() = Some(r);
        true
    }

    /// Asks the job to stop at its next item.
    fn cancel(&self) {
        self.progress.cancel();
    }

    /// The job's result (see the method that started it), once finished;
    /// its error is raised.
    fn result<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let r = self
            .result
            .lock()
            .take()
            .ok_or_else(|| invalid("the job has not finished (or its result was taken)"))?;
        match r {
            JobResult::Verify(r) => verify_dict(py, r.py_err()?).map(Bound::into_any),
            JobResult::Plan(r) => Ok(Bound::new(
                py,
                PyPlan {
                    plan: Arc::new(r.py_err()?),
                },
            )?
            .into_any()),
            JobResult::Outcome(r) => outcome_dict(py, r.py_err()?).map(Bound::into_any),
            JobResult::Failed(e) => Err(to_py(e)),
        }
    }
}

/// What a destructive command removes, each item checked to be ucm's, and
/// what it found and leaves alone.
#[pyclass(name = "RemovalPlan", module = "ucm._native", frozen)]
pub struct PyPlan {
    plan: Arc<Plan>,
}

#[pymethods]
impl PyPlan {
    /// To remove: (path, bytes, kind, files, detail) each; kind is
    /// `block`, `corrupt`, `work` (a stopped store's work directory) or
    /// `temp` (an abandoned temporary).
    fn items(&self) -> Vec<(String, u64, &'static str, usize, String)> {
        self.plan
            .remove
            .iter()
            .map(|i| {
                (
                    i.label.clone(),
                    i.bytes,
                    i.kind.name(),
                    i.files,
                    i.detail.clone(),
                )
            })
            .collect()
    }

    /// Left alone: (path, why) each.
    fn kept(&self) -> Vec<(String, String)> {
        kept_list(&self.plan.keep)
    }

    fn __len__(&self) -> usize {
        self.plan.remove.len()
    }
}

fn kept_list(kept: &[Kept]) -> Vec<(String, String)> {
    kept.iter()
        .map(|k| (k.label.clone(), k.reason.clone()))
        .collect()
}

fn verify_dict(py: Python<'_>, r: VerifyReport) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("blocks", r.blocks)?;
    let failures = PyList::empty(py);
    for (id, e) in &r.failures {
        let corrupt = matches!(e, UcmError::Corrupt { .. });
        failures.append((PyBytes::new(py, &id.0), e.to_string(), corrupt))?;
    }
    d.set_item("failures", failures)?;
    d.set_item("vanished", r.vanished)?;
    d.set_item("odd", kept_list(&r.odd))?;
    Ok(d)
}

fn outcome_dict(py: Python<'_>, o: Outcome) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    let removed = PyDict::new(py);
    for (kind, t) in &o.removed {
        removed.set_item(kind.name(), (t.items, t.files, t.bytes))?;
    }
    d.set_item("removed", removed)?;
    d.set_item("gone", o.gone)?;
    d.set_item("kept", kept_list(&o.kept))?;
    d.set_item("failed", kept_list(&o.failed))?;
    d.set_item("marked", o.marked)?;
    Ok(d)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyMaintenance>()?;
    m.add_class::<PyJob>()?;
    m.add_class::<PyPlan>()
}
