//! One error type for the whole core, with stable numeric codes.
//!
//! The codes are those of the original UCM (`0`, `-1`, `-50000 - i`) so that
//! callers and log parsers written for it keep working; `Corrupt` and `Closed`
//! extend the range. The Python bindings map each variant to one exception
//! class carrying the same code.

use std::io;
use std::path::PathBuf;

/// Result alias used across the core.
pub type Result<T, E = UcmError> = std::result::Result<T, E>;

/// Why stored bytes were refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Damage {
    /// Not a regular file of the block's length (a symlink, FIFO, device,
    /// directory, or another user's file in strict mode).
    NotBlockFile,
    /// Shorter than the block.
    Truncated,
    /// A header that fails its own checks (magic, version, self checksum,
    /// shard index).
    BadHeader,
    /// The header names another block.
    ForeignBlock,
    /// Written by a store with another layout: valid for its writer, so it
    /// is not deleted.
    OtherLayout,
    /// The data does not match its checksum.
    Checksum,
    /// The stored block is intact, but the caller changed the destination
    /// memory while the shard was arriving.
    DestinationChanged,
    /// Reported by a store written in Python, which gave no finer reason.
    Reported,
}

/// Every error the core can report. Each variant names what went wrong and
/// where (the key, path or block) so that a message alone is actionable.
#[derive(Debug, thiserror::Error, Clone)]
#[non_exhaustive]
pub enum UcmError {
    /// A task failed; the message names the first failing shard.
    #[error("task failed: {0}")]
    TaskFailed(String),
    /// A caller-supplied argument is invalid.
    #[error("invalid parameter: {0}")]
    InvalidParam(String),
    /// A config value is unknown, of the wrong type or out of range.
    #[error("{key}: {reason}")]
    Config {
        /// The key.
        key: String,
        /// What is wrong with its value.
        reason: String,
    },
    /// An allocation failed.
    #[error("out of memory: {0}")]
    OutOfMemory(String),
    /// An operating-system call failed.
    #[error("{op} {path}: {source}")]
    Os {
        /// What was attempted (`open`, `pwrite`, `rename`, ...).
        op: &'static str,
        /// The path involved, or empty.
        path: String,
        /// The OS error, shared so the error stays `Clone`.
        source: std::sync::Arc<io::Error>,
    },
    /// A duplicate key (a task handle registered twice).
    #[error("duplicate key: {0}")]
    DuplicateKey(String),
    /// A block, task handle or directory does not exist.
    #[error("not found: {0}")]
    NotFound(String),
    /// The operation is not supported by this store or in this role.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// The storage device is full (ENOSPC / EDQUOT).
    #[error("no space left: {0}")]
    NoSpace(String),
    /// A task ran past its `timeout_ms` (counted from submit).
    #[error("timeout: {0}")]
    Timeout(String),
    /// Stored bytes were refused: not a block file, truncated, or failing
    /// the header or checksum checks.
    #[error("corrupt block: {detail}")]
    Corrupt {
        /// The block, where known.
        block: Option<crate::block::BlockId>,
        /// The shard, where known.
        shard: Option<usize>,
        /// What is wrong, for callers that act on it.
        damage: Damage,
        /// The whole message, naming the block, shard and file.
        detail: String,
    },
    /// The store has been closed.
    #[error("store closed")]
    Closed,
}

impl UcmError {
    /// The stable numeric code of this error (0 is success, never returned).
    pub fn code(&self) -> i32 {
        match self {
            UcmError::TaskFailed(_) => -1,
            UcmError::InvalidParam(_) | UcmError::Config { .. } => -50000,
            UcmError::OutOfMemory(_) => -50001,
            UcmError::Os { .. } => -50002,
            UcmError::DuplicateKey(_) => -50003,
            UcmError::NotFound(_) => -50005,
            UcmError::Unsupported(_) => -50008,
            UcmError::NoSpace(_) => -50009,
            UcmError::Timeout(_) => -50010,
            UcmError::Corrupt { .. } => -50011,
            UcmError::Closed => -50012,
        }
    }

    /// Wraps an OS error, turning ENOSPC/EDQUOT into [`UcmError::NoSpace`] and
    /// ENOENT into [`UcmError::NotFound`] so callers can branch on the kind.
    pub fn os(op: &'static str, path: impl Into<PathBuf>, err: io::Error) -> Self {
        let path = path.into().display().to_string();
        match err.raw_os_error() {
            Some(libc::ENOSPC) | Some(libc::EDQUOT) => {
                UcmError::NoSpace(format!("{op} {path}: {err}"))
            }
            Some(libc::ENOENT) => UcmError::NotFound(format!("{op} {path}: {err}")),
            _ => UcmError::Os {
                op,
                path,
                source: std::sync::Arc::new(err),
            },
        }
    }

    /// A [`UcmError::Corrupt`].
    pub fn corrupt(
        damage: Damage,
        block: Option<crate::block::BlockId>,
        shard: Option<usize>,
        detail: impl Into<String>,
    ) -> Self {
        UcmError::Corrupt {
            block,
            shard,
            damage,
            detail: detail.into(),
        }
    }

    /// A shard whose bytes do not match the checksum in its header.
    pub fn shard_checksum(block: crate::block::BlockId, shard: usize) -> Self {
        Self::corrupt(
            Damage::Checksum,
            Some(block),
            Some(shard),
            format!("block {block} shard {shard}: data checksum mismatch"),
        )
    }

    /// Shorthand for [`UcmError::InvalidParam`].
    pub fn invalid(msg: impl Into<String>) -> Self {
        UcmError::InvalidParam(msg.into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_is_send_sync_static() {
        fn assert_traits<T: Send + Sync + 'static>() {}
        assert_traits::<UcmError>();
    }

    #[test]
    fn os_errors_are_classified() {
        let e = UcmError::os("pwrite", "/x", io::Error::from_raw_os_error(libc::ENOSPC));
        assert_eq!(e.code(), -50009);
        let e = UcmError::os("open", "/x", io::Error::from_raw_os_error(libc::ENOENT));
        assert_eq!(e.code(), -50005);
        let e = UcmError::os("open", "/x", io::Error::from_raw_os_error(libc::EACCES));
        assert_eq!(e.code(), -50002);
        assert!(e.to_string().contains("/x"));
    }
}
