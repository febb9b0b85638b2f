//! Store configuration, declared once.
//!
//! Every config key of every built-in store stage is declared in
//! `keys.toml`, with its type, range, default and documentation; the build
//! turns it into the [`Key`] tables of [`keys`]. Which groups of keys each
//! stage takes is declared with the stage, in
//! [`crate::store::registry`], and each stage builds its struct next to
//! its own code. Everything else derives from these declarations: the
//! parsing and validation of loosely typed values (YAML, JSON, environment
//! strings) into typed [`Values`], the Python view of the schema
//! (`ucm._native.config_schema()`), the up-front checks of the vLLM
//! connector and `ucm config check`, and the README's key tables (a test
//! fails when they drift).
//!
//! Errors are [`ConfigError`]s naming the key and saying what is wrong with
//! the value; the caller adds where the value came from.

mod geometry;
pub mod keys;
mod schema;
mod value;

pub use geometry::Geometry;
pub use schema::{Dflt, Key, Kind, Stage, MAX_TIMEOUT_MS};

/// The key groups several stages share.
pub mod schema_groups {
    pub use super::keys::{COMMON, GEOMETRY};
}
pub use value::{convert, parse_stage, suggestion, Raw, Val, Values};

use std::fmt;

/// A config value that is unknown, of the wrong type, or out of range.
#[derive(Clone, Debug, PartialEq)]
pub struct ConfigError {
    /// The key (`io_threads`, `tensor_size_list[2]`).
    pub key: String,
    /// What is wrong, naming the value.
    pub reason: String,
}

impl ConfigError {
    /// An error about `key`.
    pub fn new(key: impl Into<String>, reason: impl Into<String>) -> Self {
        ConfigError {
            key: key.into(),
            reason: reason.into(),
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.key, self.reason)
    }
}

impl std::error::Error for ConfigError {}

impl From<ConfigError> for crate::UcmError {
    fn from(e: ConfigError) -> Self {
        crate::UcmError::Config {
            key: e.key,
            reason: e.reason,
        }
    }
}
