//! The block geometry shared by every stage that stores blocks.

use super::{ConfigError, Values};
use crate::error::Result as UcmResult;
use crate::store::format::layout::{validate_geometry, Layout, MAX_SHARDS};

/// A stage's block geometry, with its defaults resolved.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Geometry {
    /// Bytes of one whole block.
    pub block_size: usize,
    /// Bytes of one shard; divides `block_size`.
    pub shard_size: usize,
    /// Bytes of each tensor of a shard; sums to `shard_size`.
    pub tensor_size_list: Vec<usize>,
}

impl Geometry {
    /// Resolves `shard_size` (default: the block), then `tensor_size_list`
    /// (default: `tensor_size` repeated, else one tensor), and checks that
    /// they fit together.
    pub fn from_values(v: &Values) -> Result<Self, ConfigError> {
        let block = v.usize("block_size");
        let shard = v.opt_int("shard_size").map_or(block, |s| s as usize);
        if block % shard != 0 {
            return Err(ConfigError::new(
                "shard_size",
                format!("{shard} must divide block_size {block}"),
            ));
        }
        if block / shard > MAX_SHARDS {
            return Err(ConfigError::new(
                "shard_size",
                format!(
                    "block_size / shard_size = {} shards; at most {MAX_SHARDS} are supported",
                    block / shard
                ),
            ));
        }
        let sizes: Vec<usize> = match (v.sizes("tensor_size_list"), v.opt_int("tensor_size")) {
            (Some(list), _) => list.iter().map(|&s| s as usize).collect(),
            (None, Some(t)) => {
                let t = t as usize;
                if shard % t != 0 {
                    return Err(ConfigError::new(
                        "tensor_size",
                        format!("{t} must divide shard_size {shard}"),
                    ));
                }
                vec![t; shard / t]
            }
            (None, None) => vec![shard],
        };
        let sum: usize = sizes.iter().sum();
        if sum != shard {
            return Err(ConfigError::new(
                "tensor_size_list",
                format!("{sizes:?} must sum to shard_size {shard} (they sum to {sum})"),
            ));
        }
        Ok(Geometry {
            block_size: block,
            shard_size: shard,
            tensor_size_list: sizes,
        })
    }

    /// Checks that the sizes fit together, as every store using the block
    /// file format needs (a geometry resolved from a config always does;
    /// one set by hand may not). Errors name the key and the values.
    pub fn validate(&self) -> UcmResult<()> {
        validate_geometry(self.block_size, self.shard_size, &self.tensor_size_list)
    }

    /// The block file layout of this geometry.
    pub fn layout(&self) -> Layout {
        Layout::new(self.block_size, self.shard_size, &self.tensor_size_list)
    }

    /// The resolved geometry written back into `v` (what a caller reads
    /// back from a checked config).
    pub fn write_to(&self, v: &mut Values) {
        use super::Val;
        v.set("shard_size", Val::Int(self.shard_size as i64));
        v.set(
            "tensor_size_list",
            Val::Sizes(self.tensor_size_list.iter().map(|&s| s as u64).collect()),
        );
    }
}
