//! Parsing loosely typed config values into typed ones, as declared.

use std::collections::BTreeMap;

use super::schema::{Dflt, Key, Kind, Stage};
use super::ConfigError;

/// A value as it arrives: from YAML, JSON, Python objects or environment
/// variables (text). Integers too large for `i128` arrive as their text.
#[derive(Clone, Debug, PartialEq)]
pub enum Raw {
    /// No value (YAML `~`, Python `None`): the key's default.
    Null,
    /// A boolean.
    Bool(bool),
    /// An integer.
    Int(i128),
    /// A number.
    Float(f64),
    /// Text.
    Str(String),
    /// A list.
    List(Vec<Raw>),
    /// Anything else: its type name, for the message.
    Other(String),
}

impl Raw {
    fn describe(&self) -> String {
        match self {
            Raw::Null => "nothing".into(),
            Raw::Bool(b) => format!("the boolean {b}"),
            Raw::Int(i) => format!("{i}"),
            Raw::Float(f) => format!("{f}"),
            Raw::Str(s) => format!("{s:?}"),
            Raw::List(l) => format!("a list of {} item(s)", l.len()),
            Raw::Other(t) => format!("a {t}"),
        }
    }
}

/// A value as declared.
#[derive(Clone, Debug, PartialEq)]
pub enum Val {
    /// An optional key that was not given.
    Unset,
    /// [`Kind::Bool`].
    Bool(bool),
    /// [`Kind::Int`].
    Int(i64),
    /// [`Kind::Float`].
    Float(f64),
    /// [`Kind::Text`] and [`Kind::Choice`] (lowercase).
    Text(String),
    /// [`Kind::Sizes`].
    Sizes(Vec<u64>),
    /// [`Kind::Locations`].
    List(Vec<String>),
}

/// The parsed keys of one stage, every declared key present (defaults
/// filled in; optional keys not given are [`Val::Unset`]).
#[derive(Clone, Debug)]
pub struct Values {
    map: BTreeMap<&'static str, Val>,
}

impl Values {
    /// The value of `key` (None for a key the stage doesn't declare).
    pub fn get(&self, key: &str) -> Option<&Val> {
        self.map.get(key)
    }

    /// Every key and value, in key order.
    pub fn iter(&self) -> impl Iterator<Item = (&'static str, &Val)> {
        self.map.iter().map(|(k, v)| (*k, v))
    }

    /// An integer key (0 if the stage doesn't declare it).
    pub fn int(&self, key: &str) -> i64 {
        match self.get(key) {
            Some(Val::Int(i)) => *i,
            _ => 0,
        }
    }

    /// An optional integer key.
    pub fn opt_int(&self, key: &str) -> Option<i64> {
        match self.get(key) {
            Some(Val::Int(i)) => Some(*i),
            _ => None,
        }
    }

    /// A non-negative integer key as `u64` (declared ranges of such keys
    /// start at 0 or above).
    pub fn u64(&self, key: &str) -> u64 {
        u64::try_from(self.int(key)).unwrap_or(0)
    }

    /// A non-negative integer key as `usize`.
    pub fn usize(&self, key: &str) -> usize {
        usize::try_from(self.int(key)).unwrap_or(0)
    }

    /// A number key.
    pub fn float(&self, key: &str) -> f64 {
        match self.get(key) {
            Some(Val::Float(f)) => *f,
            _ => 0.0,
        }
    }

    /// A boolean key.
    pub fn bool(&self, key: &str) -> bool {
        matches!(self.get(key), Some(Val::Bool(true)))
    }

    /// A text or choice key.
    pub fn text(&self, key: &str) -> &str {
        match self.get(key) {
            Some(Val::Text(t)) => t,
            _ => "",
        }
    }

    /// A locations key.
    pub fn list(&self, key: &str) -> &[String] {
        match self.get(key) {
            Some(Val::List(l)) => l,
            _ => &[],
        }
    }

    /// An optional sizes key.
    pub fn sizes(&self, key: &str) -> Option<&[u64]> {
        match self.get(key) {
            Some(Val::Sizes(s)) => Some(s),
            _ => None,
        }
    }

    /// Sets `key` (for values derived from others, e.g. the geometry).
    pub fn set(&mut self, key: &'static str, val: Val) {
        self.map.insert(key, val);
    }
}

/// Parses the keys of one stage. Unknown keys, wrong types and values out
/// of range are errors naming the key; keys not given take their defaults.
pub fn parse_stage(stage: &Stage, raw: &[(String, Raw)]) -> Result<Values, ConfigError> {
    let mut map = BTreeMap::new();
    for (name, value) in raw {
        let Some(key) = stage.key(name) else {
            let valid: Vec<&str> = stage.keys().map(|k| k.name).collect();
            return Err(ConfigError::new(
                name.clone(),
                format!(
                    "unknown key for the {} stage{}; valid keys: {}",
                    stage.name,
                    suggestion(name, &valid),
                    valid.join(", ")
                ),
            ));
        };
        map.insert(key.name, convert(key, value)?);
    }
    for key in stage.keys() {
        if map.contains_key(key.name) && map[key.name] != Val::Unset {
            continue;
        }
        let val = match key.default {
            Dflt::Required => {
                return Err(ConfigError::new(
                    key.name,
                    format!("required by the {} stage", stage.name),
                ))
            }
            Dflt::Unset => Val::Unset,
            Dflt::Is(text) => convert(key, &Raw::Str(text.into()))?,
        };
        map.insert(key.name, val);
    }
    Ok(Values { map })
}

/// `" (did you mean `x`?)"` when a valid name is close to `name`.
pub fn suggestion(name: &str, valid: &[&str]) -> String {
    let best = valid
        .iter()
        .map(|v| (edit_distance(name, v), *v))
        .min_by_key(|(d, _)| *d);
    match best {
        Some((d, v)) if d <= (name.len() / 3).max(2) => format!(" (did you mean `{v}`?)"),
        _ => String::new(),
    }
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != *cb)).min(row[j] + 1).min(cur + 1);
            prev = cur;
        }
    }
    row[b.len()]
}

/// Converts one value of `key`, checking its type and range.
pub fn convert(key: &Key, raw: &Raw) -> Result<Val, ConfigError> {
    if *raw == Raw::Null {
        return Ok(Val::Unset);
    }
    let c = Conv { key, raw };
    match key.kind {
        Kind::Bool => c.bool(),
        Kind::Int { min, max } => c.int(min, max),
        Kind::Float { min, max } => c.float(min, max),
        Kind::Text => match raw {
            Raw::Str(s) => Ok(Val::Text(s.clone())),
            _ => Err(c.err(format!("expected text, got {}", c.shown()))),
        },
        Kind::Choice(choices) => c.choice(choices),
        Kind::Sizes => c.sizes(),
        Kind::Location => c.location(),
        Kind::Locations => c.locations(),
    }
}

/// One value of one key being converted: errors name the key and show
/// the value, unless the key is secret.
struct Conv<'a> {
    key: &'a Key,
    raw: &'a Raw,
}

impl Conv<'_> {
    fn err(&self, what: String) -> ConfigError {
        ConfigError::new(self.key.name, what)
    }

    /// An error about item `i` of a list value.
    fn item_err(&self, i: usize, what: String) -> ConfigError {
        ConfigError::new(format!("{}[{i}]", self.key.name), what)
    }

    fn shown(&self) -> String {
        if self.key.secret {
            "a value (not shown: secret)".to_string()
        } else {
            self.raw.describe()
        }
    }

    fn bool(&self) -> Result<Val, ConfigError> {
        match self.raw {
            Raw::Bool(b) => Ok(Val::Bool(*b)),
            Raw::Int(0) => Ok(Val::Bool(false)),
            Raw::Int(1) => Ok(Val::Bool(true)),
            Raw::Str(s) => match s.trim().to_ascii_lowercase().as_str() {
                "1" | "true" | "yes" | "on" => Ok(Val::Bool(true)),
                "0" | "false" | "no" | "off" => Ok(Val::Bool(false)),
                _ => Err(self.err(format!("expected a boolean, got {}", self.shown()))),
            },
            _ => Err(self.err(format!("expected a boolean, got {}", self.shown()))),
        }
    }

    fn int(&self, min: i64, max: i64) -> Result<Val, ConfigError> {
        let v = as_int(self.raw)
            .ok_or_else(|| self.err(format!("expected an integer, got {}", self.shown())))?;
        if v < i128::from(min) || v > i128::from(max) {
            return Err(self.err(format!("{} is out of range {min}..={max}", self.shown())));
        }
        Ok(Val::Int(v as i64))
    }

    fn float(&self, min: f64, max: f64) -> Result<Val, ConfigError> {
        let v = match self.raw {
            Raw::Int(i) => Some(*i as f64),
            Raw::Float(f) => Some(*f),
            Raw::Str(s) => s.trim().parse::<f64>().ok(),
            _ => None,
        }
        .ok_or_else(|| self.err(format!("expected a number, got {}", self.shown())))?;
        if !v.is_finite() {
            return Err(self.err(format!("expected a finite number, got {}", self.shown())));
        }
        if v < min || v > max {
            return Err(self.err(format!("{} is out of range {min}..={max}", self.shown())));
        }
        Ok(Val::Float(v))
    }

    fn choice(&self, choices: &[&str]) -> Result<Val, ConfigError> {
        let word = match self.raw {
            Raw::Str(s) => s.trim().to_ascii_lowercase(),
            // `device_memory: true` and friends.
            Raw::Bool(b) if choices.contains(&"true") => b.to_string(),
            _ => {
                return Err(self.err(format!(
                    "expected one of {}, got {}",
                    choices.join(", "),
                    self.shown()
                )))
            }
        };
        if choices.contains(&word.as_str()) {
            Ok(Val::Text(word))
        } else {
            Err(self.err(format!(
                "unknown value {}{}; valid values: {}",
                self.shown(),
                suggestion(&word, choices),
                choices.join(", ")
            )))
        }
    }

    fn sizes(&self) -> Result<Val, ConfigError> {
        let Raw::List(items) = self.raw else {
            return Err(self.err(format!(
                "expected a list of sizes in bytes, got {}",
                self.shown()
            )));
        };
        if items.is_empty() {
            return Err(self.err("expected at least one size".into()));
        }
        let mut out = Vec::with_capacity(items.len());
        for (i, item) in items.iter().enumerate() {
            match as_int(item) {
                Some(v) if (1..=1 << 40).contains(&v) => out.push(v as u64),
                _ => {
                    return Err(self.item_err(
                        i,
                        format!(
                            "expected a size in bytes (1..=2^40), got {}",
                            item.describe()
                        ),
                    ))
                }
            }
        }
        Ok(Val::Sizes(out))
    }

    fn location(&self) -> Result<Val, ConfigError> {
        let one = match self.raw {
            Raw::Str(s) => s.trim().to_string(),
            Raw::List(items) if items.len() == 1 => match &items[0] {
                Raw::Str(s) => s.trim().to_string(),
                other => {
                    return Err(self.err(format!("expected a location, got {}", other.describe())))
                }
            },
            Raw::List(items) => {
                return Err(self.err(format!(
                    "this stage takes one location, got {}",
                    items.len()
                )))
            }
            _ => return Err(self.err(format!("expected a location, got {}", self.shown()))),
        };
        if one.is_empty() {
            return Err(self.err("a location is required".into()));
        }
        Ok(Val::Text(one))
    }

    /// Absolute directories: one text is one path (a ':' in it is part of
    /// the name, never a separator), several are a list. A relative path
    /// would depend on each process's working directory, so it is refused
    /// with the absolute form it stands for here.
    fn locations(&self) -> Result<Val, ConfigError> {
        let list = match self.raw {
            Raw::Str(s) if !s.trim().is_empty() => {
                let one = s.trim().to_string();
                if !one.starts_with('/') {
                    return Err(self.err(relative_path(&one)));
                }
                vec![one]
            }
            Raw::Str(_) => Vec::new(),
            Raw::List(items) => {
                let mut out = Vec::new();
                for (i, item) in items.iter().enumerate() {
                    match item {
                        Raw::Str(s) if s.trim().starts_with('/') => out.push(s.trim().to_string()),
                        Raw::Str(s) if !s.trim().is_empty() => {
                            return Err(self.item_err(i, relative_path(s.trim())))
                        }
                        _ => {
                            return Err(self
                                .item_err(i, format!("expected a path, got {}", item.describe())))
                        }
                    }
                }
                out
            }
            _ => {
                return Err(self.err(format!(
                    "expected a path or a list of paths, got {}",
                    self.shown()
                )))
            }
        };
        if list.is_empty() {
            return Err(self.err("at least one location is required".into()));
        }
        Ok(Val::List(list))
    }
}

/// Why a relative directory is refused, with the absolute one it would be.
fn relative_path(path: &str) -> String {
    let here = std::env::current_dir()
        .map(|d| d.join(path).display().to_string())
        .unwrap_or_else(|_| format!("/full/path/to/{path}"));
    format!(
        "{path:?} is a relative path (it would depend on each process's working \
         directory); give an absolute one, e.g. {here:?}, and several directories as a list"
    )
}

/// An integer from an integer, an integral number, or text (`0x` prefixes
/// and integral exponents such as `1e3` included).
fn as_int(raw: &Raw) -> Option<i128> {
    match raw {
        Raw::Int(i) => Some(*i),
        Raw::Float(f) if f.is_finite() && f.fract() == 0.0 && f.abs() < 1e30 => Some(*f as i128),
        Raw::Str(s) => {
            let t = s.trim().replace('_', "");
            let (neg, body) = match t.strip_prefix('-') {
                Some(rest) => (true, rest.to_string()),
                None => (false, t.trim_start_matches('+').to_string()),
            };
            let parsed = if let Some(hex) = body.strip_prefix("0x").or(body.strip_prefix("0X")) {
                i128::from_str_radix(hex, 16).ok()
            } else if let Ok(v) = body.parse::<i128>() {
                Some(v)
            } else {
                body.parse::<f64>().ok().and_then(|f| {
                    (f.is_finite() && f.fract() == 0.0 && f.abs() < 1e30).then_some(f as i128)
                })
            };
            parsed.map(|v| if neg { -v } else { v })
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::registry;

    fn stage(name: &str) -> Option<&'static Stage> {
        registry::find(name).map(|s| &s.config)
    }

    fn raw(pairs: &[(&str, Raw)]) -> Vec<(String, Raw)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect()
    }

    #[test]
    fn types_ranges_and_defaults() {
        let posix = stage("Posix").unwrap();
        let v = parse_stage(
            posix,
            &raw(&[
                ("storage_backends", Raw::Str("/a:/b".into())),
                ("block_size", Raw::Str("0x1000".into())),
                ("io_threads", Raw::Float(8.0)),
                ("io_direct", Raw::Str("yes".into())),
            ]),
        )
        .unwrap();
        // One text is one directory, ':' and all.
        assert_eq!(v.list("storage_backends"), ["/a:/b"]);
        assert_eq!(v.int("block_size"), 4096);
        assert_eq!(v.int("io_threads"), 8);
        assert!(v.bool("io_direct"));
        assert_eq!(v.int("timeout_ms"), 30_000);
        assert_eq!(v.get("shard_size"), Some(&Val::Unset));
        for (key, bad, what) in [
            ("io_threads", Raw::Int(1 << 63), "out of range"),
            ("io_threads", Raw::Str("many".into()), "expected an integer"),
            ("posix_capacity_gb", Raw::Float(f64::NAN), "finite"),
            (
                "posix_capacity_gb",
                Raw::Str("1e300".into()),
                "out of range",
            ),
            ("device_id", Raw::Int(1 << 64), "out of range"),
            (
                "io_engine",
                Raw::Str("psyn".into()),
                "did you mean `psync`?",
            ),
            ("io_direct", Raw::Other("dict".into()), "expected a boolean"),
        ] {
            let e = parse_stage(
                posix,
                &raw(&[
                    ("storage_backends", Raw::Str("/a".into())),
                    ("block_size", Raw::Int(1)),
                    (key, bad),
                ]),
            )
            .unwrap_err();
            assert_eq!(e.key, key);
            assert!(e.reason.contains(what), "{key}: {e}");
        }
        let e = parse_stage(posix, &raw(&[("io_thread", Raw::Int(2))])).unwrap_err();
        assert!(e.reason.contains("did you mean `io_threads`?"), "{e}");
        let e = parse_stage(posix, &raw(&[("block_size", Raw::Int(1))])).unwrap_err();
        assert_eq!(e.key, "storage_backends");
    }

    #[test]
    fn secrets_are_never_shown() {
        let s3 = stage("S3").unwrap();
        let key = s3.key("s3_secret_key").unwrap();
        let e = convert(key, &Raw::Int(12345)).unwrap_err();
        assert!(!e.to_string().contains("12345"), "{e}");
    }

    #[test]
    fn list_values_name_the_bad_item() {
        let list = |items: &[Raw]| Raw::List(items.to_vec());
        let sizes = Key::new("sizes", Kind::Sizes, Dflt::Unset, "");
        assert_eq!(
            convert(&sizes, &list(&[Raw::Int(4096), Raw::Str("0x10".into())])).unwrap(),
            Val::Sizes(vec![4096, 16])
        );
        let e = convert(&sizes, &list(&[Raw::Int(1), Raw::Int(0)])).unwrap_err();
        assert_eq!(e.key, "sizes[1]");
        let e = convert(&sizes, &list(&[])).unwrap_err();
        assert_eq!(
            (e.key.as_str(), e.reason.as_str()),
            ("sizes", "expected at least one size")
        );

        let dirs = Key::new("dirs", Kind::Locations, Dflt::Unset, "");
        // One text is one directory: a ':' is part of its name.
        assert_eq!(
            convert(&dirs, &Raw::Str(" /a:b ".into())).unwrap(),
            Val::List(vec!["/a:b".into()])
        );
        assert_eq!(
            convert(
                &dirs,
                &list(&[Raw::Str("/a".into()), Raw::Str("/b".into())])
            )
            .unwrap(),
            Val::List(vec!["/a".into(), "/b".into()])
        );
        let e = convert(&dirs, &list(&[Raw::Str("/a".into()), Raw::Str(" ".into())])).unwrap_err();
        assert_eq!(e.key, "dirs[1]");
        let e = convert(&dirs, &Raw::Str(" ".into())).unwrap_err();
        assert_eq!(e.reason, "at least one location is required");
        // A relative directory is refused with its absolute form.
        let e = convert(&dirs, &Raw::Str("b/c".into())).unwrap_err();
        assert_eq!(e.key, "dirs");
        assert!(e.reason.contains("\"b/c\" is a relative path"), "{e}");
        let cwd = std::env::current_dir().unwrap().join("b/c");
        assert!(
            e.reason
                .contains(&format!("{:?}", cwd.display().to_string())),
            "{e}"
        );
        let e = convert(
            &dirs,
            &list(&[Raw::Str("/a".into()), Raw::Str("kv".into())]),
        )
        .unwrap_err();
        assert_eq!(e.key, "dirs[1]");
        assert!(e.reason.contains("relative"), "{e}");

        let dir = Key::new("dir", Kind::Location, Dflt::Unset, "");
        assert_eq!(
            convert(&dir, &list(&[Raw::Str(" /a ".into())])).unwrap(),
            Val::Text("/a".into())
        );
        let two = list(&[Raw::Str("/a".into()), Raw::Str("/b".into())]);
        let e = convert(&dir, &two).unwrap_err();
        assert_eq!(e.reason, "this stage takes one location, got 2");
        let e = convert(&dir, &Raw::Str("  ".into())).unwrap_err();
        assert_eq!(e.reason, "a location is required");
    }
}
