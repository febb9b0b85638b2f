//! Unified Cache Manager core.
//!
//! Pure Rust, no Python: block hashing ([`hashing`]), the asynchronous task
//! engine ([`task`]), the I/O engines ([`io`]) and the KV block stores
//! ([`store`]). The PyO3 crate `ucm-py` is a thin layer on top of this one.

pub mod block;
pub mod config;
pub mod error;
pub mod hashing;
pub mod io;
pub mod store;
pub mod task;

pub use block::{BlockId, MemSeg, ShardIo};
pub use error::{Result, UcmError};
