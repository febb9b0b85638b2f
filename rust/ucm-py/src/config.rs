//! The stage registry of `ucm-core` for Python: the declarations
//! (`config_schema`), the order of a `store_pipeline` (`pipeline_stages`)
//! and the checks of one stage's keys (`check_stage`), which is also what
//! `NativeStore.open_pipeline` does before opening.

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use ucm_core::config::{self, Dflt, Key, Kind, Raw, Val};
use ucm_core::store::pipeline;
use ucm_core::store::registry::{self, Place, StageDef};

use crate::errors::to_py;

/// A Python value as the core's config parser takes it.
pub fn to_raw(obj: &Bound<'_, PyAny>) -> Raw {
    if obj.is_none() {
        return Raw::Null;
    }
    if let Ok(b) = obj.cast::<PyBool>() {
        return Raw::Bool(b.is_true());
    }
    if obj.is_instance_of::<PyInt>() {
        return match obj.extract::<i128>() {
            Ok(i) => Raw::Int(i),
            // Beyond i128: no key takes it; as a number it is out of range.
            Err(_) => Raw::Float(obj.extract::<f64>().unwrap_or(f64::INFINITY)),
        };
    }
    if let Ok(f) = obj.cast::<PyFloat>() {
        return Raw::Float(f.value());
    }
    if let Ok(s) = obj.cast::<PyString>() {
        return Raw::Str(s.to_string_lossy().into_owned());
    }
    if let Ok(l) = obj.cast::<PyList>() {
        return Raw::List(l.iter().map(|x| to_raw(&x)).collect());
    }
    if let Ok(t) = obj.cast::<PyTuple>() {
        return Raw::List(t.iter().map(|x| to_raw(&x)).collect());
    }
    if let Ok(p) = obj.call_method0("__fspath__") {
        if let Ok(s) = p.cast::<PyString>() {
            return Raw::Str(s.to_string_lossy().into_owned());
        }
    }
    let ty = obj
        .get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_default();
    Raw::Other(ty)
}

fn to_py_value<'py>(py: Python<'py>, v: &Val) -> PyResult<Bound<'py, PyAny>> {
    Ok(match v {
        Val::Unset => py.None().into_bound(py),
        Val::Bool(b) => PyBool::new(py, *b).to_owned().into_any(),
        Val::Int(i) => i.into_pyobject(py)?.into_any(),
        Val::Float(f) => f.into_pyobject(py)?.into_any(),
        Val::Text(t) => t.into_pyobject(py)?.into_any(),
        Val::Sizes(s) => PyList::new(py, s)?.into_any(),
        Val::List(l) => PyList::new(py, l)?.into_any(),
    })
}

/// The stage named `name`, or a `ConfigError` naming the valid ones.
pub fn find_stage(name: &str) -> PyResult<&'static StageDef> {
    registry::find_or_err(name).map_err(|e| to_py(e.into()))
}

/// The pairs of a mapping of keys, as the core's config parser takes them.
pub fn raw_pairs(values: &Bound<'_, PyDict>) -> PyResult<Vec<(String, Raw)>> {
    values
        .iter()
        .map(|(k, v)| Ok((k.extract::<String>()?, to_raw(&v))))
        .collect()
}

/// Checks one stage's keys; returns every key of the stage with its value
/// (defaults filled in, geometry resolved). Raises `ConfigError` (with
/// `.key` and `.reason`) on the first bad key.
#[pyfunction]
fn check_stage<'py>(
    py: Python<'py>,
    stage: &str,
    values: &Bound<'py, PyDict>,
) -> PyResult<Bound<'py, PyDict>> {
    let v = find_stage(stage)?
        .check(&raw_pairs(values)?)
        .map_err(|e| to_py(e.into()))?;
    let out = PyDict::new(py);
    for (k, val) in v.iter() {
        out.set_item(k, to_py_value(py, val)?)?;
    }
    Ok(out)
}

/// The stage names of `spec` (trimmed, top first) after checking their
/// order: only a tier sits above another stage, and the bottom one is not
/// a tier. Names that are not built in are kept as written (stores
/// registered from Python). Raises `ConfigError` (`.key`
/// `store_pipeline`, `.reason`).
#[pyfunction]
fn pipeline_stages(spec: &str) -> PyResult<Vec<String>> {
    pipeline::parse(spec).map_err(|e| to_py(e.into()))?;
    Ok(spec.split('|').map(|n| n.trim().to_string()).collect())
}

/// The declarations of every built-in stage: a list of dicts `{name,
/// aliases, doc, place, client, maintainable, keys: [{name, type, default,
/// required, min, max, choices, doc, secret, shared}]}`. `place` is `tier`
/// (sits over another stage) or `bottom`; `client` names the client of
/// another system the stage is opened with (`mooncake`), or is None;
/// `maintainable` says whether `ucm store` reaches its contents. A key's
/// `default` is the config text, or None; `shared` keys (the geometry,
/// `device_id`, `timeout_ms`) are the same in every stage that has them.
#[pyfunction]
fn config_schema(py: Python<'_>) -> PyResult<Bound<'_, PyList>> {
    let out = PyList::empty(py);
    for def in registry::stages() {
        let s = &def.config;
        let keys = PyList::empty(py);
        let shared = |k: &Key| {
            [
                config::schema_groups::GEOMETRY,
                config::schema_groups::COMMON,
            ]
            .iter()
            .any(|g| g.iter().any(|x| x.name == k.name))
        };
        for k in s.keys() {
            let d = PyDict::new(py);
            d.set_item("name", k.name)?;
            d.set_item("shared", shared(k))?;
            d.set_item("doc", k.doc)?;
            d.set_item("secret", k.secret)?;
            let (ty, min, max, choices): (&str, Option<f64>, Option<f64>, Vec<&str>) = match k.kind
            {
                Kind::Bool => ("bool", None, None, vec![]),
                Kind::Int { min, max } => ("int", Some(min as f64), Some(max as f64), vec![]),
                Kind::Float { min, max } => ("float", Some(min), Some(max), vec![]),
                Kind::Text => ("text", None, None, vec![]),
                Kind::Choice(c) => ("choice", None, None, c.to_vec()),
                Kind::Sizes => ("sizes", None, None, vec![]),
                Kind::Locations => ("paths", None, None, vec![]),
                Kind::Location => ("location", None, None, vec![]),
            };
            d.set_item("type", ty)?;
            d.set_item("min", min)?;
            d.set_item("max", max)?;
            d.set_item("choices", choices)?;
            let (required, default) = match k.default {
                Dflt::Required => (true, None),
                Dflt::Unset => (false, None),
                Dflt::Is(t) => (false, Some(t)),
            };
            d.set_item("required", required)?;
            d.set_item("default", default)?;
            keys.append(d)?;
        }
        let d = PyDict::new(py);
        d.set_item("name", s.name)?;
        d.set_item("aliases", s.aliases.to_vec())?;
        d.set_item("doc", s.doc)?;
        let place = match def.place {
            Place::Tier(_) => "tier",
            Place::Bottom(_) => "bottom",
        };
        d.set_item("place", place)?;
        d.set_item("client", def.client.map(|c| c.name()))?;
        d.set_item("maintainable", def.maintenance.is_some())?;
        d.set_item("keys", keys)?;
        out.append(d)?;
    }
    Ok(out)
}

/// Expands `${VAR}` and `${VAR:-default}` in the value of `key` as every
/// stage does when it opens (for keys the Python side reads itself).
/// Raises `InvalidParamError` naming the key for an unset variable.
#[pyfunction]
fn expand_env(key: &str, value: &str) -> PyResult<String> {
    ucm_core::store::remote::expand_env(key, value).map_err(to_py)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(check_stage, m)?)?;
    m.add_function(wrap_pyfunction!(pipeline_stages, m)?)?;
    m.add_function(wrap_pyfunction!(expand_env, m)?)?;
    m.add_function(wrap_pyfunction!(config_schema, m)?)?;
    Ok(())
}
