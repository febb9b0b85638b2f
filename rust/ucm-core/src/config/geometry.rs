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
            // Two answers to one question: which one was meant is a guess.
            (Some(_), Some(_)) => {
                return Err(ConfigError::new(
                    "tensor_size",
                    "give tensor_size or tensor_size_list, not both",
                ))
            }
            (Some(list), None) => list.iter().map(|&s| s as usize).collect(),
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
    /// back from a checked config). `tensor_size` is folded into
    /// `tensor_size_list`, so the values check again as they are.
    pub fn write_to(&self, v: &mut Values) {
        use super::Val;
        v.set("shard_size", Val::Int(self.shard_size as i64));
        if v.get("tensor_size").is_some() {
            v.set("tensor_size", Val::Unset);
        }
        v.set(
            "tensor_size_list",
            Val::Sizes(self.tensor_size_list.iter().map(|&s| s as u64).collect()),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{parse_stage, Raw, Stage};
    use crate::store::registry;

    fn stage(name: &str) -> Option<&'static Stage> {
        registry::find(name).map(|s| &s.config)
    }

    fn posix(extra: &[(&str, Raw)]) -> Values {
        let mut raw = vec![
            ("storage_backends".to_string(), Raw::Str("/a".into())),
            ("block_size".to_string(), Raw::Int(4096)),
        ];
        raw.extend(extra.iter().map(|(k, v)| (k.to_string(), v.clone())));
        parse_stage(stage("Posix").unwrap(), &raw).unwrap()
    }

    #[test]
    fn tensor_size_beside_tensor_size_list_is_refused() {
        let both = posix(&[
            ("tensor_size", Raw::Int(1024)),
            ("tensor_size_list", Raw::List(vec![Raw::Int(4096)])),
        ]);
        let e = Geometry::from_values(&both).unwrap_err();
        assert_eq!(e.key, "tensor_size");
        assert!(e.reason.contains("tensor_size_list"), "{e}");
        // Either one alone resolves, and the resolved values check again.
        for one in [
            ("tensor_size", Raw::Int(1024)),
            ("tensor_size_list", Raw::List(vec![Raw::Int(4096)])),
        ] {
            let mut v = posix(&[one]);
            let g = Geometry::from_values(&v).unwrap();
            g.write_to(&mut v);
            assert_eq!(Geometry::from_values(&v).unwrap(), g);
        }
    }
}
