//! Block identity and the description of one shard transfer.

use std::collections::HashMap;
use std::fmt;
use std::hash::{BuildHasherDefault, Hasher};

/// A 16-byte block id (the chained hash of a block's tokens).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(pub [u8; 16]);

/// The id whose 16 bytes are all `n`: distinct ids for unit tests.
#[cfg(test)]
pub(crate) fn test_id(n: u8) -> BlockId {
    BlockId([n; 16])
}

impl BlockId {
    /// Length of every id, in bytes.
    pub const LEN: usize = 16;

    /// Builds an id from a slice, naming the offending length on error.
    pub fn from_slice(bytes: &[u8]) -> crate::Result<Self> {
        let arr: [u8; 16] = bytes.try_into().map_err(|_| {
            crate::UcmError::invalid(format!(
                "block id must be exactly 16 bytes, got {}",
                bytes.len()
            ))
        })?;
        Ok(BlockId(arr))
    }

    /// Lowercase hex of the 16 bytes in order (the on-disk file name).
    pub fn hex(&self) -> String {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut s = String::with_capacity(32);
        for b in self.0 {
            s.push(HEX[(b >> 4) as usize] as char);
            s.push(HEX[(b & 0xf) as usize] as char);
        }
        s
    }

    /// Parses 32 hex characters back into an id.
    pub fn from_hex(s: &str) -> Option<Self> {
        if s.len() != 32 {
            return None;
        }
        let mut out = [0u8; 16];
        for (i, chunk) in s.as_bytes().chunks(2).enumerate() {
            let hi = (chunk[0] as char).to_digit(16)?;
            let lo = (chunk[1] as char).to_digit(16)?;
            out[i] = (hi * 16 + lo) as u8;
        }
        Some(BlockId(out))
    }

    /// A well-mixed 64-bit value taken from the id itself: ids are already
    /// uniform hashes, so hashing them again would be wasted work.
    pub fn prefix_u64(&self) -> u64 {
        let mut b = [0u8; 8];
        b.copy_from_slice(&self.0[..8]);
        u64::from_le_bytes(b)
    }
}

impl fmt::Debug for BlockId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockId({})", self.hex())
    }
}

impl fmt::Display for BlockId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.hex())
    }
}

/// Block ids are usually uniform hashes already, so SipHash over them again
/// would be wasted: the two 8-byte halves are XORed and mixed by one
/// folded 128-bit multiply. The mix matters because the API accepts any 16
/// bytes: ids that differ only in low bits (a counter, as benches and some
/// callers use) would otherwise share the hash's top 7 bits, which the
/// table uses as its per-slot tag, and every probe would compare whole keys.
#[derive(Default)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        let m = u128::from(self.0).wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835);
        (m as u64) ^ ((m >> 64) as u64)
    }
    fn write(&mut self, bytes: &[u8]) {
        // `[u8; 16]` hashes as its length (usize) followed by the bytes.
        for chunk in bytes.chunks(8) {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            self.0 ^= u64::from_le_bytes(b);
        }
    }
    fn write_usize(&mut self, _n: usize) {}
}

/// A hash map keyed by block id, hashed by [`IdHasher`].
pub type IdMap<V> = HashMap<BlockId, V, BuildHasherDefault<IdHasher>>;

/// One contiguous piece of caller memory (a tensor, or part of one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemSeg {
    /// Start address in this process.
    pub addr: usize,
    /// Length in bytes.
    pub len: usize,
}

impl MemSeg {
    /// The segment over `bytes`, to be read from (a dump's source).
    pub fn of(bytes: &[u8]) -> Self {
        MemSeg {
            addr: bytes.as_ptr() as usize,
            len: bytes.len(),
        }
    }

    /// The segment over `bytes`, to be written to (a load's destination).
    pub fn of_mut(bytes: &mut [u8]) -> Self {
        MemSeg {
            addr: bytes.as_mut_ptr() as usize,
            len: bytes.len(),
        }
    }
}

/// One shard of one block to move between caller memory and a store: the
/// shard's bytes are the concatenation of `segs` in order.
#[derive(Clone, Debug)]
pub struct ShardIo {
    /// Block the shard belongs to.
    pub block: BlockId,
    /// Shard index inside the block (`0..block_size/shard_size`).
    pub index: usize,
    /// Caller memory making up the shard, in order.
    pub segs: Vec<MemSeg>,
}

impl ShardIo {
    /// Total bytes described by `segs`.
    pub fn len(&self) -> usize {
        self.segs.iter().map(|s| s.len).sum()
    }

    /// True when the shard describes no memory.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trip() {
        let id = BlockId([0xab; 16]);
        assert_eq!(id.hex(), "ab".repeat(16));
        assert_eq!(BlockId::from_hex(&id.hex()), Some(id));
        assert_eq!(BlockId::from_hex("zz"), None);
        assert!(BlockId::from_slice(&[0u8; 15]).is_err());
    }

    #[test]
    fn counter_ids_spread_over_the_hash_tag_bits() {
        use std::hash::Hash;
        // The table tags each slot with the hash's top 7 bits: ids that
        // differ only in their low bytes must still spread over those.
        let tags: std::collections::HashSet<u64> = (0u64..1000)
            .map(|i| {
                let mut raw = [0u8; 16];
                raw[..8].copy_from_slice(&99u64.to_le_bytes());
                raw[8..].copy_from_slice(&i.to_le_bytes());
                let mut h = IdHasher::default();
                BlockId(raw).hash(&mut h);
                h.finish() >> 57
            })
            .collect();
        assert!(tags.len() > 100, "only {} of 128 tags used", tags.len());
    }
}
