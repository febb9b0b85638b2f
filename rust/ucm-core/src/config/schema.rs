//! The declarations: what a key is, and which keys each stage takes (the
//! keys and stages themselves are in `keys.toml`, see [`super::keys`]).

/// The type and range of a key's value.
#[derive(Clone, Copy, Debug)]
pub enum Kind {
    /// `true`/`false` (also `1`/`0`, `yes`/`no`, `on`/`off` as text).
    Bool,
    /// An integer within `min..=max` (also as text, `0x` allowed).
    Int {
        /// Smallest value.
        min: i64,
        /// Largest value.
        max: i64,
    },
    /// A finite number within `min..=max` (also as text).
    Float {
        /// Smallest value.
        min: f64,
        /// Largest value.
        max: f64,
    },
    /// Any text.
    Text,
    /// One of these words (case-insensitive).
    Choice(&'static [&'static str]),
    /// A non-empty list of positive integers (bytes).
    Sizes,
    /// One or more absolute directories: a list of text, or one text
    /// (one directory).
    Locations,
    /// One location (a URL may hold `:`): text, or a list of one text.
    Location,
}

/// A key's default.
#[derive(Clone, Copy, Debug)]
pub enum Dflt {
    /// The key must be given.
    Required,
    /// Optional, with no value unless given (derived from other keys).
    Unset,
    /// This value, written as config text.
    Is(&'static str),
}

/// One config key.
#[derive(Clone, Copy, Debug)]
pub struct Key {
    /// The key as written in a config.
    pub name: &'static str,
    /// Its type and range.
    pub kind: Kind,
    /// Its default.
    pub default: Dflt,
    /// One line for users (README tables, `ucm config check`).
    pub doc: &'static str,
    /// Never shown in messages, logs or `repr`.
    pub secret: bool,
}

impl Key {
    /// A key that is not secret.
    pub const fn new(name: &'static str, kind: Kind, default: Dflt, doc: &'static str) -> Self {
        Key {
            name,
            kind,
            default,
            doc,
            secret: false,
        }
    }

    /// A key whose value is never shown.
    pub const fn secret(name: &'static str, doc: &'static str) -> Self {
        Key {
            name,
            kind: Kind::Text,
            default: Dflt::Is(""),
            doc,
            secret: true,
        }
    }
}

/// One store stage (`store_pipeline: "Cache|Posix"` has two).
#[derive(Debug)]
pub struct Stage {
    /// The name in `store_pipeline`.
    pub name: &'static str,
    /// Other spellings of the name.
    pub aliases: &'static [&'static str],
    /// What the stage is, in one line.
    pub doc: &'static str,
    /// Its keys, in groups (the shared geometry keys, its own).
    pub groups: &'static [&'static [Key]],
}

impl Stage {
    /// Every key of the stage.
    pub fn keys(&self) -> impl Iterator<Item = &'static Key> {
        self.groups.iter().flat_map(|g| g.iter())
    }

    /// The key named `name`.
    pub fn key(&self, name: &str) -> Option<&'static Key> {
        self.keys().find(|k| k.name == name)
    }
}

/// Longest timeout: a day (the largest `timeout_ms` and lookup cache TTL).
pub const MAX_TIMEOUT_MS: i64 = 86_400_000;
