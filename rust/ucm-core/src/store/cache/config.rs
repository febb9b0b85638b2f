//! Configuration of the Cache store and its validation.

use std::fmt;
use std::str::FromStr;

use super::policy::PolicyKind;
use super::transport::DeviceMemory;
use crate::config::{ConfigError, Geometry, Values};
use crate::error::{Result, UcmError};

/// The Cache stage's own keys (besides the geometry, `device_id` and
/// `timeout_ms`), declared in `config/keys.toml`.
pub use crate::config::keys::CACHE as KEYS;

/// Which operations leave blocks in the cache (see the crate docs of
/// [`super`]): dumps always pass through the cache; this decides what
/// stays once the backend has a copy, and whether load misses are filled.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum FillPolicy {
    /// As `ReadAllocate`, except that a miss read straight from a local
    /// backend into host memory is kept only on its block's second load
    /// (see `super::admission`).
    #[default]
    ReuseAllocate,
    /// Load misses are filled into the cache; dumped blocks stay cached.
    ReadAllocate,
    /// Only dumped blocks stay cached; load misses go from the backend
    /// straight to the caller.
    WriteAllocate,
    /// Nothing stays: the cache only stages dumps until the backend has
    /// them, and load misses bypass it.
    NoAllocate,
}

/// When a dumped block is written to the backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum WriteBackPolicy {
    /// `wait` returns once the backend has the block.
    Sync,
    /// `wait` returns once the cache has it; the backend write is queued
    /// and batched.
    #[default]
    Async,
    /// Written only when eviction needs the slot, or on flush/close.
    Lazy,
}

macro_rules! named_enum {
    ($t:ty, $key:literal, $($v:path => $s:literal),+) => {
        impl $t {
            /// The config spelling.
            pub fn name(self) -> &'static str {
                match self { $($v => $s),+ }
            }
        }
        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.name())
            }
        }
        impl FromStr for $t {
            type Err = UcmError;
            fn from_str(s: &str) -> Result<Self> {
                match s.trim().to_ascii_lowercase().as_str() {
                    $($s => Ok($v),)+
                    _ => Err(UcmError::invalid(format!(
                        concat!($key, ": unknown value {:?}; valid values: ", $($s, " "),+),
                        s
                    ))),
                }
            }
        }
    };
}

named_enum!(FillPolicy, "fill_policy",
    FillPolicy::ReuseAllocate => "reuse_allocate",
    FillPolicy::ReadAllocate => "read_allocate",
    FillPolicy::WriteAllocate => "write_allocate",
    FillPolicy::NoAllocate => "no_allocate");
named_enum!(WriteBackPolicy, "write_back_policy",
    WriteBackPolicy::Sync => "sync",
    WriteBackPolicy::Async => "async",
    WriteBackPolicy::Lazy => "lazy");

impl FromStr for DeviceMemory {
    type Err = UcmError;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" | "" => Ok(DeviceMemory::Auto),
            "true" | "yes" | "1" | "device" => Ok(DeviceMemory::Yes),
            "false" | "no" | "0" | "host" => Ok(DeviceMemory::No),
            _ => Err(UcmError::invalid(format!(
                "device_memory: unknown value {s:?}; valid values: auto, true, false"
            ))),
        }
    }
}

/// Cache store settings. Field names follow the config keys.
#[derive(Clone, Debug)]
pub struct CacheConfig {
    /// Bytes of one whole block.
    pub block_size: usize,
    /// Bytes of one shard (one slot holds one shard).
    pub shard_size: usize,
    /// Bytes of slot memory (`cache_buffer_capacity_gb`).
    pub capacity_bytes: u64,
    /// Eviction algorithm.
    pub eviction_policy: PolicyKind,
    /// What stays cached.
    pub fill_policy: FillPolicy,
    /// When dumps reach the backend.
    pub write_back_policy: WriteBackPolicy,
    /// Blocks per backend write (async), and the count that triggers one.
    pub write_back_batch_size: usize,
    /// Most time a dirty block waits for its batch (async), in ms.
    pub write_back_interval_ms: u64,
    /// Cap of the retry backoff after failed writes, in ms.
    pub write_back_max_backoff_ms: u64,
    /// -1: lookup-only role; >= 0: transfers on (and the CUDA device).
    pub device_id: i64,
    /// Whether caller addresses are device memory.
    pub device_memory: DeviceMemory,
    /// CUDA copy streams (1..=32).
    pub cache_stream_number: usize,
    /// Threads copying between slots and caller memory.
    pub copy_threads: usize,
    /// Threads waiting on backend tasks (fills, bypasses, sync writes).
    pub backend_threads: usize,
    /// Put the cache in `/dev/shm` shared by every process with the same
    /// `unique_id`.
    pub share_buffer_enable: bool,
    /// Leave the shared segment in place when the last process leaves it.
    pub share_buffer_keep: bool,
    /// Commit the data area in the background from start-up.
    pub prefault: bool,
    /// Names the shared segment.
    pub unique_id: String,
    /// Task timeout from submit, 0 = none.
    pub timeout_ms: u64,
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            block_size: 0,
            shard_size: 0,
            capacity_bytes: 4 << 30,
            eviction_policy: PolicyKind::default(),
            fill_policy: FillPolicy::default(),
            write_back_policy: WriteBackPolicy::default(),
            write_back_batch_size: 32,
            write_back_interval_ms: 1000,
            write_back_max_backoff_ms: 10_000,
            device_id: 0,
            device_memory: DeviceMemory::Auto,
            cache_stream_number: 4,
            copy_threads: 4,
            backend_threads: 8,
            share_buffer_enable: false,
            share_buffer_keep: false,
            prefault: true,
            unique_id: String::new(),
            timeout_ms: 30_000,
        }
    }
}

/// Most slots a cache may have (slot indices are u32; one is reserved).
pub const MAX_SLOTS: u64 = (u32::MAX - 1) as u64;

const GIB: f64 = (1u64 << 30) as f64;

/// Bytes of physical memory, if the system says.
fn physical_memory() -> Option<u64> {
    // SAFETY: sysconf has no memory-safety preconditions.
    let (pages, size) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    (pages > 0 && size > 0).then(|| pages as u64 * size as u64)
}

/// Total bytes of the file system at `path`, if it exists.
fn fs_size(path: &str) -> Option<u64> {
    let c = std::ffi::CString::new(path).ok()?;
    // SAFETY: statvfs is plain old data; zeroed is valid, and `c` is a
    // valid NUL-terminated path for the duration of the call.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return None;
    }
    Some((st.f_blocks as u64).saturating_mul(st.f_frsize as u64))
}

impl CacheConfig {
    /// Builds the config from a checked Cache stage (see [`crate::config`]),
    /// refusing a capacity the machine can't hold.
    pub fn from_values(v: &Values) -> std::result::Result<Self, ConfigError> {
        let g = Geometry::from_values(v)?;
        let choice = |key: &'static str| move |e: UcmError| ConfigError::new(key, e.to_string());
        let mut cfg = CacheConfig {
            block_size: g.block_size,
            shard_size: g.shard_size,
            capacity_bytes: (v.float("cache_buffer_capacity_gb") * GIB) as u64,
            eviction_policy: v
                .text("eviction_policy")
                .parse()
                .map_err(choice("eviction_policy"))?,
            fill_policy: v
                .text("fill_policy")
                .parse()
                .map_err(choice("fill_policy"))?,
            write_back_policy: v
                .text("write_back_policy")
                .parse()
                .map_err(choice("write_back_policy"))?,
            write_back_batch_size: v.usize("write_back_batch_size"),
            write_back_interval_ms: (v.float("write_back_interval") * 1000.0).round() as u64,
            write_back_max_backoff_ms: ((v.float("write_back_max_backoff") * 1000.0).round()
                as u64)
                .max(1),
            device_id: v.int("device_id"),
            device_memory: v
                .text("device_memory")
                .parse()
                .map_err(choice("device_memory"))?,
            cache_stream_number: v.usize("cache_stream_number"),
            copy_threads: v.usize("cache_copy_threads"),
            backend_threads: v.usize("cache_backend_threads"),
            share_buffer_enable: v.bool("share_buffer_enable"),
            share_buffer_keep: v.bool("share_buffer_keep"),
            prefault: v.bool("cache_prefault"),
            unique_id: v.text("unique_id").to_string(),
            timeout_ms: v.u64("timeout_ms"),
        };
        let mut key = "cache_buffer_capacity_gb";
        if let Some(n) = v.opt_int("buffer_number") {
            cfg.capacity_bytes = (n as u64).saturating_mul(cfg.stride() as u64);
            key = "buffer_number";
        }
        cfg.validate_with(key)?;
        cfg.check_fits(key)?;
        Ok(cfg)
    }

    /// Refuses a capacity larger than the machine's memory, or than
    /// `/dev/shm` for a shared cache: such a cache would be killed (or
    /// fail with SIGBUS) once it filled up, long after start.
    fn check_fits(&self, key: &str) -> std::result::Result<(), ConfigError> {
        let (limit, what) = if self.share_buffer_enable {
            (fs_size("/dev/shm"), "the size of /dev/shm")
        } else {
            (physical_memory(), "this machine's memory")
        };
        match limit {
            Some(limit) if self.capacity_bytes > limit => Err(ConfigError::new(
                key,
                format!(
                    "{:.2} GiB of cache is more than {what} ({:.2} GiB)",
                    self.capacity_bytes as f64 / GIB,
                    limit as f64 / GIB
                ),
            )),
            _ => Ok(()),
        }
    }

    /// Bytes between slots (shards are padded to 4 KiB for O_DIRECT/DMA).
    pub fn stride(&self) -> usize {
        self.shard_size.div_ceil(4096) * 4096
    }

    /// Shards per block.
    pub fn shard_count(&self) -> usize {
        self.block_size / self.shard_size.max(1)
    }

    /// Number of slots the capacity buys.
    pub fn slots(&self) -> usize {
        (self.capacity_bytes / self.stride().max(1) as u64).min(MAX_SLOTS) as usize
    }

    /// Checks values; errors name the key (`capacity_key`: the key that
    /// set the capacity, `cache_buffer_capacity_gb` or `buffer_number`).
    pub fn validate(&self) -> std::result::Result<(), ConfigError> {
        self.validate_with("cache_buffer_capacity_gb")
    }

    fn validate_with(&self, capacity_key: &str) -> std::result::Result<(), ConfigError> {
        if self.shard_size == 0 || self.block_size == 0 || self.block_size % self.shard_size != 0 {
            return Err(ConfigError::new(
                "shard_size",
                format!(
                    "{} must be > 0 and divide block_size {}",
                    self.shard_size, self.block_size
                ),
            ));
        }
        if self.slots() < self.shard_count().max(2) {
            return Err(ConfigError::new(
                capacity_key,
                format!(
                    "{} bytes hold {} slot(s) of {} bytes; at least {} (one whole block, and no \
                     fewer than 2) are needed",
                    self.capacity_bytes,
                    self.slots(),
                    self.stride(),
                    self.shard_count().max(2)
                ),
            ));
        }
        let positive = [
            ("write_back_batch_size", self.write_back_batch_size),
            ("cache_copy_threads", self.copy_threads),
            ("cache_backend_threads", self.backend_threads),
        ];
        if let Some((key, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(ConfigError::new(*key, "must be > 0"));
        }
        if !(1..=32).contains(&self.cache_stream_number) {
            return Err(ConfigError::new(
                "cache_stream_number",
                format!("{} is out of range 1..=32", self.cache_stream_number),
            ));
        }
        if self.share_buffer_enable && self.unique_id.trim().is_empty() {
            return Err(ConfigError::new(
                "unique_id",
                "required (non-empty) when share_buffer_enable is true",
            ));
        }
        if self.share_buffer_keep && !self.share_buffer_enable {
            return Err(ConfigError::new(
                "share_buffer_keep",
                "keeps the shared segment, so it needs share_buffer_enable: true",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_errors_name_the_key() {
        for p in [
            FillPolicy::ReuseAllocate,
            FillPolicy::ReadAllocate,
            FillPolicy::WriteAllocate,
            FillPolicy::NoAllocate,
        ] {
            assert_eq!(p.name().parse::<FillPolicy>().unwrap(), p);
        }
        assert_eq!(
            "ASYNC".parse::<WriteBackPolicy>().unwrap(),
            WriteBackPolicy::Async
        );
        let e = "later".parse::<WriteBackPolicy>().unwrap_err().to_string();
        assert!(e.contains("write_back_policy") && e.contains("lazy"), "{e}");
    }

    #[test]
    fn buffer_number_is_capped_at_max_slots() {
        // keys.toml writes the cap as a number; the code names it.
        let key = KEYS.iter().find(|k| k.name == "buffer_number");
        assert!(
            matches!(key.map(|k| k.kind), Some(crate::config::Kind::Int { max, .. }) if max == MAX_SLOTS as i64),
            "{key:?}"
        );
    }

    #[test]
    fn validation() {
        let ok = CacheConfig {
            block_size: 8192,
            shard_size: 4096,
            capacity_bytes: 1 << 20,
            ..Default::default()
        };
        ok.validate().unwrap();
        assert_eq!(ok.slots(), 256);
        let cases = [
            (
                CacheConfig {
                    capacity_bytes: 4096,
                    ..ok.clone()
                },
                "cache_buffer_capacity_gb",
            ),
            (
                CacheConfig {
                    share_buffer_enable: true,
                    ..ok
                },
                "unique_id",
            ),
        ];
        for (bad, key) in cases {
            assert!(bad.validate().unwrap_err().to_string().contains(key));
        }
    }
}
