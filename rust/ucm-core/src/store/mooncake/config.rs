//! Configuration of the Mooncake store: where the master and the metadata
//! service are, how this client joins the pool, and how blocks are kept.
//!
//! The keys that set up Mooncake's own client (`mooncake_master`,
//! `mooncake_metadata_server`, `mooncake_local_hostname`,
//! `mooncake_protocol`, `mooncake_device_name`, the segment and buffer
//! sizes) are read by the Python side, which owns that client; they are
//! declared (in `config/keys.toml`) and checked with every other stage's
//! keys, in one schema.

use crate::config::{ConfigError, Geometry, Values};
use crate::error::Result;
use crate::store::remote::expand_env;

/// The Mooncake stage's own keys (besides the geometry, `device_id` and
/// `timeout_ms`), declared in `config/keys.toml`.
pub use crate::config::keys::MOONCAKE as KEYS;

/// Mooncake store settings the core uses. Field names follow the keys
/// (`mooncake_*`).
#[derive(Clone, Debug)]
pub struct MooncakeConfig {
    /// `host:port` of the master (`mooncake_master`), for messages.
    pub master: String,
    /// Prefix of the pool's keys (`mooncake_key_prefix`).
    pub key_prefix: String,
    /// Client calls in flight at most (`mooncake_max_concurrency`).
    pub max_concurrency: usize,
    /// Task timeout counted from submit; 0 = none.
    pub timeout_ms: u64,
    /// How long a "present" lookup result is reused.
    pub lookup_cache_ttl_ms: u64,
    /// How long an "absent" lookup result is reused.
    pub negative_cache_ttl_ms: u64,
    /// Bytes for blocks whose shards are still arriving.
    pub staging_bytes: u64,
    /// Block, shard and tensor sizes.
    pub geometry: Geometry,
    /// -1: lookup-only role (load and dump refused); >= 0: transfers on.
    pub device_id: i64,
}

impl MooncakeConfig {
    /// Builds the config from a checked Mooncake stage (see [`crate::config`]).
    pub fn from_values(v: &Values) -> std::result::Result<Self, ConfigError> {
        let geometry = Geometry::from_values(v)?;
        let prefix = v.text("mooncake_key_prefix").trim_matches('/').to_string();
        if prefix.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(ConfigError::new(
                "mooncake_key_prefix",
                format!("{prefix:?} holds white space or control characters"),
            ));
        }
        Ok(MooncakeConfig {
            master: v.text("mooncake_master").trim().to_string(),
            key_prefix: prefix,
            max_concurrency: v.usize("mooncake_max_concurrency"),
            timeout_ms: v.u64("timeout_ms"),
            lookup_cache_ttl_ms: v.u64("mooncake_lookup_cache_ttl_ms"),
            negative_cache_ttl_ms: v.u64("mooncake_negative_cache_ttl_ms"),
            staging_bytes: (v.float("mooncake_staging_buffer_gb") * (1u64 << 30) as f64) as u64,
            geometry,
            device_id: v.int("device_id"),
        })
    }

    /// Expands `${VAR}` and checks the geometry.
    pub fn resolved(&self) -> Result<Self> {
        let mut c = self.clone();
        c.master = expand_env("mooncake_master", &c.master)?;
        c.key_prefix = expand_env("mooncake_key_prefix", &c.key_prefix)?;
        c.geometry.validate()?;
        Ok(c)
    }

    /// False in the lookup-only role (`device_id = -1`).
    pub fn transfers_enabled(&self) -> bool {
        self.device_id >= 0
    }
}
