//! Configuration of the Cache store and its validation.

use std::fmt;
use std::str::FromStr;

use super::policy::PolicyKind;
use super::transport::DeviceMemory;
use crate::error::{Result, UcmError};

/// Which operations leave blocks in the cache (see the crate docs of
/// [`super`]): dumps always pass through the cache; this decides what
/// stays once the backend has a copy, and whether load misses are filled.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum FillPolicy {
    /// Load misses are filled into the cache; dumped blocks stay cached.
    #[default]
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
            unique_id: String::new(),
            timeout_ms: 30_000,
        }
    }
}

/// Most slots a cache may have (slot indices are u32; one is reserved).
pub const MAX_SLOTS: u64 = (u32::MAX - 1) as u64;

impl CacheConfig {
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

    /// Checks values; errors name the key.
    pub fn validate(&self) -> Result<()> {
        if self.shard_size == 0 {
            return Err(UcmError::invalid("shard_size: must be > 0"));
        }
        if self.block_size == 0 || self.block_size % self.shard_size != 0 {
            return Err(UcmError::invalid(format!(
                "block_size: {} must be a positive multiple of shard_size {}",
                self.block_size, self.shard_size
            )));
        }
        if self.slots() < self.shard_count().max(2) {
            return Err(UcmError::invalid(format!(
                "cache_buffer_capacity_gb: {} bytes hold {} slot(s) of {} bytes; at least {} \
                 (one whole block, and no fewer than 2) are needed",
                self.capacity_bytes,
                self.slots(),
                self.stride(),
                self.shard_count().max(2)
            )));
        }
        if self.write_back_batch_size == 0 {
            return Err(UcmError::invalid("write_back_batch_size: must be > 0"));
        }
        if !(1..=32).contains(&self.cache_stream_number) {
            return Err(UcmError::invalid(format!(
                "cache_stream_number: {} is out of range 1..=32",
                self.cache_stream_number
            )));
        }
        if self.copy_threads == 0 || self.backend_threads == 0 {
            return Err(UcmError::invalid(
                "cache_copy_threads / cache_backend_threads: must be > 0",
            ));
        }
        if self.share_buffer_enable && self.unique_id.trim().is_empty() {
            return Err(UcmError::invalid(
                "unique_id: required (non-empty) when share_buffer_enable is true",
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
    fn validation() {
        let ok = CacheConfig {
            block_size: 8192,
            shard_size: 4096,
            capacity_bytes: 1 << 20,
            ..Default::default()
        };
        ok.validate().unwrap();
        assert_eq!(ok.slots(), 256);
        let small = CacheConfig {
            capacity_bytes: 4096,
            ..ok.clone()
        };
        assert!(small
            .validate()
            .unwrap_err()
            .to_string()
            .contains("cache_buffer_capacity_gb"));
        let shared = CacheConfig {
            share_buffer_enable: true,
            ..ok
        };
        assert!(shared
            .validate()
            .unwrap_err()
            .to_string()
            .contains("unique_id"));
    }
}
