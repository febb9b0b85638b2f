//! Configuration of the Posix store and its validation.

use std::path::PathBuf;

use crate::config::{ConfigError, Geometry, Values};
use crate::error::{Result, UcmError};
use crate::io::IoEngineKind;
use crate::store::format::layout::validate_geometry;
use crate::store::safe_fs::require_dir;

/// The Posix stage's own keys (besides the geometry, `device_id` and
/// `timeout_ms`), declared in `config/keys.toml`.
pub use crate::config::keys::POSIX as KEYS;

/// What a successful `wait()` of a dump guarantees about the disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Durability {
    /// The block is published (renamed into place) in the page cache: it
    /// survives the process being killed, not a power cut or kernel crash.
    /// After one, a block whose data never reached the disk fails its
    /// checksum and is treated as missing.
    #[default]
    None,
    /// The block's data is on the disk (`fdatasync`) before it is renamed:
    /// a power cut can only lose the rename, never leave a block published
    /// over data that was not written.
    Data,
    /// `Data`, plus the directory is synced after the rename: a published
    /// block survives a power cut.
    Full,
}

impl std::str::FromStr for Durability {
    type Err = UcmError;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "none" => Ok(Durability::None),
            "data" => Ok(Durability::Data),
            "full" => Ok(Durability::Full),
            _ => Err(UcmError::invalid(format!(
                "durability: unknown value {s:?}; valid values: none, data, full"
            ))),
        }
    }
}

/// Posix store settings. Field names match the config keys.
#[derive(Clone, Debug)]
pub struct PosixConfig {
    /// Root directories; blocks spread across them by id.
    pub storage_backends: Vec<PathBuf>,
    /// Bytes of one whole block (all shards).
    pub block_size: usize,
    /// Bytes of one shard; divides `block_size`.
    pub shard_size: usize,
    /// Sizes of the tensors making up one shard; sums to `shard_size`.
    pub tensor_size_list: Vec<usize>,
    /// Open files with O_DIRECT.
    pub io_direct: bool,
    /// Which I/O engine.
    pub io_engine: IoEngineKind,
    /// Worker threads preparing transfers and engine threads (see the docs
    /// of `IoEngineConfig::threads`).
    pub io_threads: usize,
    /// Task timeout from submit, 0 = none.
    pub timeout_ms: u64,
    /// Capacity in bytes above which the least recently used blocks are
    /// evicted; 0 = unbounded.
    pub capacity_bytes: u64,
    /// -1: lookup-only role (load and dump refused); >= 0: transfers on.
    pub device_id: i64,
    /// Temporary files kept pre-created per root (0 = none); see `spare`.
    pub spare_files: usize,
    /// What a dump's success guarantees (`durability`).
    pub durability: Durability,
    /// Refuse directories other users can write to, and block files other
    /// users own (`posix_strict`), instead of warning.
    pub strict: bool,
}

impl Default for PosixConfig {
    fn default() -> Self {
        PosixConfig {
            storage_backends: Vec::new(),
            block_size: 0,
            shard_size: 0,
            tensor_size_list: Vec::new(),
            io_direct: false,
            io_engine: IoEngineKind::Auto,
            io_threads: 4,
            timeout_ms: 30_000,
            capacity_bytes: 0,
            device_id: 0,
            spare_files: 64,
            durability: Durability::None,
            strict: false,
        }
    }
}

impl PosixConfig {
    /// Builds the config from a checked Posix stage (see [`crate::config`]).
    pub fn from_values(v: &Values) -> std::result::Result<Self, ConfigError> {
        let g = Geometry::from_values(v)?;
        let choice = |key: &str, e: UcmError| ConfigError::new(key, e.to_string());
        Ok(PosixConfig {
            storage_backends: v
                .list("storage_backends")
                .iter()
                .map(PathBuf::from)
                .collect(),
            block_size: g.block_size,
            shard_size: g.shard_size,
            tensor_size_list: g.tensor_size_list,
            io_direct: v.bool("io_direct"),
            io_engine: v
                .text("io_engine")
                .parse()
                .map_err(|e| choice("io_engine", e))?,
            io_threads: v.usize("io_threads"),
            timeout_ms: v.u64("timeout_ms"),
            capacity_bytes: (v.float("posix_capacity_gb") * (1u64 << 30) as f64) as u64,
            device_id: v.int("device_id"),
            spare_files: v.usize("posix_spare_files"),
            durability: v
                .text("durability")
                .parse()
                .map_err(|e| choice("durability", e))?,
            strict: v.bool("posix_strict"),
        })
    }

    /// Creates the storage directories that don't exist yet (mode 0700 for
    /// each directory it makes), as the connector always did for its
    /// default store. A lookup-only store creates nothing.
    pub fn create_missing_roots(&self) -> Result<()> {
        if !self.transfers_enabled() {
            return Ok(());
        }
        for (i, dir) in self.storage_backends.iter().enumerate() {
            if std::fs::symlink_metadata(dir).is_ok() {
                continue;
            }
            let mut missing = Vec::new();
            let mut at = Some(dir.as_path());
            while let Some(p) = at {
                if p.as_os_str().is_empty() || std::fs::symlink_metadata(p).is_ok() {
                    break;
                }
                missing.push(p.to_path_buf());
                at = p.parent();
            }
            for p in missing.iter().rev() {
                crate::store::posix::files::make_private_dir(p).map_err(|e| {
                    UcmError::invalid(format!(
                        "storage_backends[{i}]: directory {} does not exist and can't be \
                         created: {e}",
                        dir.display()
                    ))
                })?;
                if self.durability == Durability::Full {
                    // A durable block needs every directory above it to be.
                    let parent = p.parent().filter(|q| !q.as_os_str().is_empty());
                    let parent = parent.unwrap_or(std::path::Path::new("."));
                    crate::store::safe_fs::Dir::open(parent)
                        .and_then(|d| d.sync())
                        .map_err(|e| UcmError::os("fsync", parent, e))?;
                }
            }
        }
        Ok(())
    }

    /// Checks sizes and directories; errors name the key and the value.
    pub fn validate(&self) -> Result<()> {
        if self.storage_backends.is_empty() {
            return Err(UcmError::invalid(
                "storage_backends: at least one directory is required",
            ));
        }
        for (i, dir) in self.storage_backends.iter().enumerate() {
            require_dir(&format!("storage_backends[{i}]"), dir)?;
            if self.device_id >= 0 && !writable(dir) {
                return Err(UcmError::invalid(format!(
                    "storage_backends[{i}]: directory {} is not writable",
                    dir.display()
                )));
            }
        }
        validate_geometry(self.block_size, self.shard_size, &self.tensor_size_list)?;
        if self.io_threads == 0 {
            return Err(UcmError::invalid("io_threads: must be > 0"));
        }
        Ok(())
    }

    /// True when loads and dumps are allowed.
    pub fn transfers_enabled(&self) -> bool {
        self.device_id >= 0
    }
}

fn writable(dir: &std::path::Path) -> bool {
    let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()) else {
        return false;
    };
    // SAFETY: `c` is a valid NUL-terminated path for the duration of the call.
    unsafe { libc::access(c.as_ptr(), libc::W_OK | libc::X_OK) == 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base(dir: &std::path::Path) -> PosixConfig {
        PosixConfig {
            storage_backends: vec![dir.to_path_buf()],
            block_size: 8192,
            shard_size: 4096,
            tensor_size_list: vec![2048, 2048],
            ..Default::default()
        }
    }

    #[test]
    fn validation_names_the_key() {
        let d = tempfile::tempdir().unwrap();
        assert!(base(d.path()).validate().is_ok());
        let mut c = base(d.path());
        c.tensor_size_list = vec![1000];
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("tensor_size_list"));
        let mut c = base(d.path());
        c.block_size = 5000;
        assert!(c.validate().unwrap_err().to_string().contains("block_size"));
        let mut c = base(d.path());
        c.storage_backends = vec![d.path().join("missing")];
        let e = c.validate().unwrap_err().to_string();
        assert!(
            e.contains("storage_backends[0]") && e.contains("missing"),
            "{e}"
        );
    }
}
