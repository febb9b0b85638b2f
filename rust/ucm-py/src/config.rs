//! The config schema and checks of `ucm-core` for Python: the declarations
//! (`config_schema`), and the parsing of one stage's keys (`check_stage`),
//! which is also what `NativeStore.open_stage` does before opening.

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use ucm_core::config::{self, Dflt, Geometry, Key, Kind, Raw, Stage, Val, Values};

use crate::errors::to_py;

/// A Python value as the core's config parser takes it.
fn to_raw(obj: &Bound<'_, PyAny>) -> Raw {
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
pub fn find_stage(name: &str) -> PyResult<&'static Stage> {
    config::stage(name).ok_or_else(|| {
        let valid: Vec<&str> = config::stages().iter().map(|s| s.name).collect();
        to_py(
            config::ConfigError::new(
                "store_pipeline",
                format!(
                    "unknown stage {name:?}{}; built-in stages: {}",
                    config::suggestion(name, &valid),
                    valid.join(", ")
                ),
            )
            .into(),
        )
    })
}

/// Parses `values` (a mapping of one stage's keys) as `stage` declares,
/// resolving the geometry of the stages that have one.
pub fn parse(stage: &Stage, values: &Bound<'_, PyDict>) -> PyResult<Values> {
    let raw: Vec<(String, Raw)> = values
        .iter()
        .map(|(k, v)| Ok((k.extract::<String>()?, to_raw(&v))))
        .collect::<PyResult<_>>()?;
    let mut v = config::parse_stage(stage, &raw).map_err(|e| to_py(e.into()))?;
    if stage.key("block_size").is_some() {
        Geometry::from_values(&v)
            .map_err(|e| to_py(e.into()))?
            .write_to(&mut v);
    }
    Ok(v)
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
    let s = find_stage(stage)?;
    let v = parse(s, values)?;
    // The cross-key checks of the stage's struct (capacity, locations...).
    let built: Result<(), config::ConfigError> = match s.name {
        "Posix" => ucm_core::store::PosixConfig::from_values(&v).map(drop),
        "Cache" => ucm_core::store::CacheConfig::from_values(&v).map(drop),
        "S3" => ucm_core::store::s3::S3Config::from_values(&v).map(drop),
        "NFS" => ucm_core::store::nfs::NfsConfig::from_values(&v).map(drop),
        "Mooncake" => ucm_core::store::mooncake::MooncakeConfig::from_values(&v).map(drop),
        _ => Ok(()),
    };
    built.map_err(|e| to_py(e.into()))?;
    let out = PyDict::new(py);
    for (k, val) in v.iter() {
        out.set_item(k, to_py_value(py, val)?)?;
    }
    Ok(out)
}

/// The declarations of every built-in stage: a list of dicts `{name,
/// aliases, doc, keys: [{name, type, default, required, min, max, choices,
/// doc, secret, shared}]}`; `default` is the config text, or None;
/// `shared` keys (the geometry, `device_id`, `timeout_ms`) are the same in
/// every stage that has them.
#[pyfunction]
fn config_schema(py: Python<'_>) -> PyResult<Bound<'_, PyList>> {
    let out = PyList::empty(py);
    for s in config::stages() {
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
    m.add_function(wrap_pyfunction!(expand_env, m)?)?;
    m.add_function(wrap_pyfunction!(config_schema, m)?)?;
    Ok(())
}
