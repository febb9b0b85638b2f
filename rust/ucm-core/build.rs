//! Generates the config key declarations (`config::keys`) from
//! `src/config/keys.toml`, where every key is written once.
//!
//! The output is plain Rust: one `&[Key]` constant per key group, so the
//! declarations stay `const` and cost nothing at run time (the stages that
//! take the groups are declared in `store/registry.rs`). A mistake in the
//! file fails the build with a message naming the key.

use std::fmt::Write as _;
use std::path::PathBuf;

use toml::{Table, Value};

const SOURCE: &str = "src/config/keys.toml";

fn main() {
    println!("cargo:rerun-if-changed={SOURCE}");
    let text = std::fs::read_to_string(SOURCE).unwrap_or_else(|e| panic!("{SOURCE}: {e}"));
    let declared: Table = text
        .parse()
        .unwrap_or_else(|e| panic!("{SOURCE}: not valid TOML: {e}"));
    let code = generate(&declared).unwrap_or_else(|e| panic!("{SOURCE}: {e}"));
    let out_dir = std::env::var_os("OUT_DIR").unwrap_or_else(|| panic!("OUT_DIR is not set"));
    let out = PathBuf::from(out_dir).join("config_keys.rs");
    std::fs::write(&out, code).unwrap_or_else(|e| panic!("{}: {e}", out.display()));
}

type Fallible<T> = Result<T, String>;

/// The whole generated file: the key groups.
fn generate(declared: &Table) -> Fallible<String> {
    only(declared, &["keys"])?;
    let groups = table(declared, "keys", "the file")?;
    let mut code = String::new();
    for (group, keys) in groups {
        let keys = keys
            .as_array()
            .ok_or_else(|| format!("keys.{group}: expected [[keys.{group}]] entries"))?;
        let _ = writeln!(
            code,
            "/// The `{group}` keys, in the order users see them.\n\
             pub const {}: &[Key] = &[",
            group.to_uppercase()
        );
        for key in keys {
            let key = key
                .as_table()
                .ok_or_else(|| format!("keys.{group}: an entry is not a table"))?;
            let _ = writeln!(
                code,
                "    {},",
                key_expr(key).map_err(|e| in_key(group, key, e))?
            );
        }
        code.push_str("];\n\n");
    }
    Ok(code)
}

/// `Key::new(...)` or `Key::secret(...)` for one `[[keys.*]]` entry.
fn key_expr(key: &Table) -> Fallible<String> {
    let name = text(key, "name")?;
    let doc = text(key, "doc")?;
    if flag(key, "secret")? {
        only(key, &["name", "secret", "doc"])?;
        return Ok(format!("Key::secret({name:?}, {doc:?})"));
    }
    let (kind, kind_fields): (String, &[&str]) = match text(key, "kind")? {
        "int" => (
            format!("Kind::Int {{ {} }}", bounds(key, integer)?),
            &["min", "max"],
        ),
        "float" => (
            format!("Kind::Float {{ {} }}", bounds(key, float)?),
            &["min", "max"],
        ),
        "choice" => (
            format!("Kind::Choice(&{:?})", strings(key, "choices")?),
            &["choices"],
        ),
        "bool" => ("Kind::Bool".into(), &[]),
        "text" => ("Kind::Text".into(), &[]),
        "sizes" => ("Kind::Sizes".into(), &[]),
        "locations" => ("Kind::Locations".into(), &[]),
        "location" => ("Kind::Location".into(), &[]),
        other => return Err(format!("unknown kind {other:?}")),
    };
    only(
        key,
        &[&["name", "kind", "default", "required", "doc"], kind_fields].concat(),
    )?;
    let default = match (flag(key, "required")?, key.get("default")) {
        (true, Some(_)) => return Err("a required key has no default".into()),
        (true, None) => "Dflt::Required".to_string(),
        (false, Some(_)) => format!("Dflt::Is({:?})", text(key, "default")?),
        (false, None) => "Dflt::Unset".to_string(),
    };
    Ok(format!("Key::new({name:?}, {kind}, {default}, {doc:?})"))
}

/// "keys.posix.io_threads: ..." for an error in one key.
fn in_key(group: &str, key: &Table, e: String) -> String {
    let name = key.get("name").and_then(Value::as_str).unwrap_or("?");
    format!("keys.{group}.{name}: {e}")
}

fn table<'a>(t: &'a Table, field: &str, what: &str) -> Fallible<&'a Table> {
    t.get(field)
        .and_then(Value::as_table)
        .ok_or_else(|| format!("{what}: expected a table `{field}`"))
}

fn text<'a>(t: &'a Table, field: &str) -> Fallible<&'a str> {
    t.get(field)
        .and_then(Value::as_str)
        .ok_or_else(|| format!("`{field}` must be a string"))
}

fn flag(t: &Table, field: &str) -> Fallible<bool> {
    match t.get(field) {
        None => Ok(false),
        Some(v) => v
            .as_bool()
            .ok_or_else(|| format!("`{field}` must be true or false")),
    }
}

/// `min: .., max: ..` of a ranged kind, each read by `read`.
fn bounds<T: std::fmt::Debug>(
    t: &Table,
    read: fn(&Table, &str) -> Fallible<T>,
) -> Fallible<String> {
    Ok(format!(
        "min: {:?}, max: {:?}",
        read(t, "min")?,
        read(t, "max")?
    ))
}

fn integer(t: &Table, field: &str) -> Fallible<i64> {
    t.get(field)
        .and_then(Value::as_integer)
        .ok_or_else(|| format!("`{field}` must be an integer"))
}

/// A float field; an integer is taken as the same number.
fn float(t: &Table, field: &str) -> Fallible<f64> {
    match t.get(field) {
        Some(Value::Float(f)) => Ok(*f),
        Some(Value::Integer(i)) => Ok(*i as f64),
        _ => Err(format!("`{field}` must be a number")),
    }
}

fn strings<'a>(t: &'a Table, field: &str) -> Fallible<Vec<&'a str>> {
    t.get(field)
        .and_then(Value::as_array)
        .and_then(|items| items.iter().map(Value::as_str).collect())
        .ok_or_else(|| format!("`{field}` must be a list of strings"))
}

/// Refuses fields other than `allowed` (a misspelt `defualt` would
/// otherwise silently make a key optional).
fn only(t: &Table, allowed: &[&str]) -> Fallible<()> {
    match t.keys().find(|k| !allowed.contains(&k.as_str())) {
        Some(k) => Err(format!(
            "unexpected field `{k}` (allowed: {})",
            allowed.join(", ")
        )),
        None => Ok(()),
    }
}
