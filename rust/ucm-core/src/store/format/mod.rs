//! The block format every store shares, below all of them: one block is
//! `shard_count` regions, each a 4 KiB header (magic, version, block id,
//! shard index and count, layout fingerprint, checksums) followed by the
//! shard's data padded to 4 KiB ([`layout`]). A Posix block file, an NFS
//! file and an S3 object hold the same bytes, so a block can be copied
//! between them unchanged and every load is verified the same way;
//! [`codec`] builds and checks regions in memory for the remote tiers.
//! [`carried`] hands a shard's known checksum between tiers with its
//! memory. With the `bench` feature, `checksum_baseline` measures the load
//! checksum's speed for benchmarks.

pub mod carried;
#[cfg(feature = "bench")]
pub mod checksum_baseline;
pub mod codec;
pub mod layout;

pub use layout::{validate_geometry, Layout, ShardHeader, HEADER_LEN, MAX_SHARDS, REGION_ALIGN};
