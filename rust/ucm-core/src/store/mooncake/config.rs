//! Configuration of the Mooncake store: where the master and the metadata
//! service are, how this client joins the pool, and how blocks are kept.
//!
//! The keys that set up Mooncake's own client (`mooncake_master`,
//! `mooncake_metadata_server`, `mooncake_local_hostname`,
//! `mooncake_protocol`, `mooncake_device_name`, the segment and buffer
//! sizes) are read by the Python side, which owns that client; they are
//! declared and checked here so that every stage's keys live in one schema.

use crate::config::{ConfigError, Dflt, Geometry, Key, Kind, Values, MAX_TIMEOUT_MS};
use crate::error::Result;
use crate::store::format::layout::validate_geometry;
use crate::store::remote::expand_env;

const TTL: Kind = Kind::Int {
    min: 0,
    max: MAX_TIMEOUT_MS,
};
const GB: Kind = Kind::Float {
    min: 0.0,
    max: 4096.0,
};

/// The Mooncake stage's own keys (besides the geometry, `device_id` and
/// `timeout_ms`). Text keys may name environment variables as `${VAR}`.
pub const KEYS: &[Key] = &[
    Key::new(
        "mooncake_master",
        Kind::Text,
        Dflt::Required,
        "host:port of mooncake_master's RPC service (e.g. \"10.0.0.5:50051\").",
    ),
    Key::new(
        "mooncake_metadata_server",
        Kind::Text,
        Dflt::Is("P2PHANDSHAKE"),
        "Where transfer endpoints are published: \"P2PHANDSHAKE\" (no metadata server), \
         \"http://host:8080/metadata\" (the master's --enable_http_metadata_server) or \
         \"etcd://host:2379\".",
    ),
    Key::new(
        "mooncake_local_hostname",
        Kind::Text,
        Dflt::Is(""),
        "Address other clients reach this one at; empty: the address this host uses to reach \
         the master.",
    ),
    Key::new(
        "mooncake_protocol",
        Kind::Choice(&["tcp", "rdma"]),
        Dflt::Is("tcp"),
        "Transport of the transfer engine (rdma needs the RDMA build of the client).",
    ),
    Key::new(
        "mooncake_device_name",
        Kind::Text,
        Dflt::Is(""),
        "RDMA devices to use (\"mlx5_0,mlx5_1\"); empty with tcp.",
    ),
    Key::new(
        "mooncake_global_segment_gb",
        GB,
        Dflt::Is("1"),
        "Memory (GiB) this engine lends to the cluster-wide pool; 0 when dedicated store \
         services (mooncake_client) hold the pool.",
    ),
    Key::new(
        "mooncake_local_buffer_gb",
        GB,
        Dflt::Is("0.0625"),
        "Memory (GiB) of the client's own transfer buffer (blocks travel through the stage's \
         registered staging memory instead, so this can stay small).",
    ),
    Key::new(
        "mooncake_replica_num",
        Kind::Int { min: 1, max: 16 },
        Dflt::Is("1"),
        "Copies of each block the pool keeps (on distinct segments).",
    ),
    Key::new(
        "mooncake_soft_pin",
        Kind::Bool,
        Dflt::Is("false"),
        "Asks the master to evict these blocks last. How long a read keeps an object from \
         eviction (its lease) is the master's --default_kv_lease_ttl.",
    ),
    Key::new(
        "mooncake_key_prefix",
        Kind::Text,
        Dflt::Is("ucm"),
        "Prefix of the pool's keys (\"<prefix>/<block id hex>\"), so deployments can share \
         one pool without seeing each other's blocks.",
    ),
    Key::new(
        "mooncake_max_concurrency",
        Kind::Int { min: 1, max: 256 },
        Dflt::Is("1"),
        "Transfer calls in flight at most (threads calling into the client; lookups have one \
         of their own). Transfers that wait meanwhile go together in the next batch call, \
         which Mooncake runs in parallel, so one is usually best.",
    ),
    Key::new(
        "mooncake_lookup_cache_ttl_ms",
        TTL,
        Dflt::Is("2000"),
        "How long a \"present\" lookup result is reused; 0 disables. The pool evicts, so \
         keep it short: a load of an evicted block fails and the engine recomputes.",
    ),
    Key::new(
        "mooncake_negative_cache_ttl_ms",
        TTL,
        Dflt::Is("500"),
        "How long an \"absent\" lookup result is reused; 0 disables.",
    ),
    Key::new(
        "mooncake_staging_buffer_gb",
        Kind::Float {
            min: 0.001,
            max: 1024.0,
        },
        Dflt::Is("0.25"),
        "Memory (GiB) for blocks whose shards are still arriving, and the registered memory \
         (half as much again) blocks travel through.",
    ),
];

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
    /// Bytes of one whole block (all shards).
    pub block_size: usize,
    /// Bytes of one shard; divides `block_size`.
    pub shard_size: usize,
    /// Sizes of the tensors of one shard; sum to `shard_size`.
    pub tensor_size_list: Vec<usize>,
    /// -1: lookup-only role (load and dump refused); >= 0: transfers on.
    pub device_id: i64,
}

impl MooncakeConfig {
    /// Builds the config from a checked Mooncake stage (see [`crate::config`]).
    pub fn from_values(v: &Values) -> std::result::Result<Self, ConfigError> {
        let g = Geometry::from_values(v)?;
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
            block_size: g.block_size,
            shard_size: g.shard_size,
            tensor_size_list: g.tensor_size_list,
            device_id: v.int("device_id"),
        })
    }

    /// Expands `${VAR}` and checks the geometry.
    pub fn resolved(&self) -> Result<Self> {
        let mut c = self.clone();
        c.master = expand_env("mooncake_master", &c.master)?;
        c.key_prefix = expand_env("mooncake_key_prefix", &c.key_prefix)?;
        validate_geometry(c.block_size, c.shard_size, &c.tensor_size_list)?;
        Ok(c)
    }

    /// False in the lookup-only role (`device_id = -1`).
    pub fn transfers_enabled(&self) -> bool {
        self.device_id >= 0
    }
}
