//! The on-disk format of one block file.
//!
//! A block file holds `shard_count` shard regions back to back; shard `i`
//! starts at `i * stride`. Each region is a 4 KiB header followed by the
//! shard's bytes, padded to 4 KiB:
//!
//! ```text
//! | header (4096) | shard 0 data (shard_size, padded) | header | shard 1 data | ...
//! ```
//!
//! Why a header per shard rather than one at the start of the file: a load
//! of shard `i` then reads its header and its data in ONE contiguous I/O
//! (header and data are adjacent), which matters under O_DIRECT where the
//! header costs a whole aligned block anyway; and each shard verifies on its
//! own, which is what layer-wise loads (one shard per layer) need. The
//! header carries the magic, format version, block id, shard index and
//! count, a fingerprint of the layout (block size, shard size, tensor
//! sizes), the checksum of the shard's data and a checksum of itself, so a
//! torn, foreign, truncated or differently-laid-out block is always detected.

use crate::hashing::xxh3::{xxh3_64, Xxh3Stream};

use crate::block::{BlockId, MemSeg};
use crate::error::{Damage, Result, UcmError};

/// Size of the per-shard header region (one O_DIRECT-aligned block).
pub const HEADER_LEN: usize = 4096;
/// Alignment of every region in the file.
pub const REGION_ALIGN: usize = 4096;
const MAGIC: &[u8; 8] = b"UCMKVBLK";
const VERSION: u32 = 1;
/// Bytes of the header actually used (the rest of the 4 KiB is zero).
const ENCODED_LEN: usize = 72;

/// Most shards a block may have (the header stores the count as u32; this
/// keeps the per-block bookkeeping small).
pub const MAX_SHARDS: usize = 65_536;

/// Checks a block geometry shared by every store that uses the block file
/// format: shards divide the block, and the tensor sizes sum to a shard.
/// Errors name the key and the values.
pub fn validate_geometry(
    block_size: usize,
    shard_size: usize,
    tensor_sizes: &[usize],
) -> Result<()> {
    if shard_size == 0 {
        return Err(UcmError::invalid("shard_size: must be > 0"));
    }
    if block_size == 0 || block_size % shard_size != 0 {
        return Err(UcmError::invalid(format!(
            "block_size: {block_size} must be a positive multiple of shard_size {shard_size}"
        )));
    }
    if block_size / shard_size > MAX_SHARDS {
        return Err(UcmError::invalid(format!(
            "block_size / shard_size = {} shards; at most {MAX_SHARDS} are supported",
            block_size / shard_size
        )));
    }
    let sum: usize = tensor_sizes.iter().sum();
    if tensor_sizes.is_empty() || tensor_sizes.contains(&0) || sum != shard_size {
        return Err(UcmError::invalid(format!(
            "tensor_size_list: sizes {tensor_sizes:?} must be positive and sum to shard_size {shard_size} (they sum to {sum})"
        )));
    }
    Ok(())
}

/// Rounds `n` up to a multiple of `align` (a power of two).
pub fn round_up(n: usize, align: usize) -> usize {
    (n + align - 1) & !(align - 1)
}

/// Geometry of a block file, derived from the store's config.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Bytes of caller data per shard.
    pub shard_size: usize,
    /// Shards per block.
    pub shard_count: usize,
    /// Distance between consecutive shard regions in the file.
    pub stride: usize,
    /// Hash of the geometry and tensor sizes; stored in every header.
    pub fingerprint: u64,
}

impl Layout {
    /// Builds the layout; sizes are validated by the caller's config.
    pub fn new(block_size: usize, shard_size: usize, tensor_sizes: &[usize]) -> Self {
        let mut fp = Xxh3Stream::new();
        fp.update(&VERSION.to_le_bytes());
        fp.update(&(block_size as u64).to_le_bytes());
        fp.update(&(shard_size as u64).to_le_bytes());
        for t in tensor_sizes {
            fp.update(&(*t as u64).to_le_bytes());
        }
        Layout {
            shard_size,
            shard_count: block_size / shard_size,
            stride: HEADER_LEN + round_up(shard_size, REGION_ALIGN),
            fingerprint: fp.digest(),
        }
    }

    /// Size of a complete block file.
    pub fn file_len(&self) -> u64 {
        (self.stride * self.shard_count) as u64
    }

    /// Offset of shard `index`'s region (its header).
    pub fn offset(&self, index: usize) -> u64 {
        (index * self.stride) as u64
    }
}

/// The decoded header of one shard region.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardHeader {
    /// Block the shard belongs to.
    pub block: BlockId,
    /// Shard index.
    pub index: u32,
    /// Shards in the block.
    pub count: u32,
    /// Bytes of data.
    pub shard_size: u64,
    /// Layout fingerprint of the writer.
    pub fingerprint: u64,
    /// xxh3-64 of the shard's data.
    pub checksum: u64,
}

impl ShardHeader {
    /// Writes the header into the start of `out` (at least 72 bytes).
    pub fn encode(&self, out: &mut [u8]) {
        out[..ENCODED_LEN].fill(0);
        out[0..8].copy_from_slice(MAGIC);
        out[8..12].copy_from_slice(&VERSION.to_le_bytes());
        out[12..16].copy_from_slice(&(HEADER_LEN as u32).to_le_bytes());
        out[16..32].copy_from_slice(&self.block.0);
        out[32..36].copy_from_slice(&self.index.to_le_bytes());
        out[36..40].copy_from_slice(&self.count.to_le_bytes());
        out[40..48].copy_from_slice(&self.shard_size.to_le_bytes());
        out[48..56].copy_from_slice(&self.fingerprint.to_le_bytes());
        out[56..64].copy_from_slice(&self.checksum.to_le_bytes());
        let self_sum = xxh3_64(&out[..64]);
        out[64..72].copy_from_slice(&self_sum.to_le_bytes());
    }

    /// Parses a header and checks what it says of itself (magic, its own
    /// checksum, the format version); `block`/`index` only name the shard
    /// in messages.
    pub fn decode(raw: &[u8], block: &BlockId, index: usize) -> Result<ShardHeader> {
        let where_ = || format!("block {block} shard {index}");
        let bad =
            |damage, detail: String| UcmError::corrupt(damage, Some(*block), Some(index), detail);
        if raw.len() < ENCODED_LEN || &raw[0..8] != MAGIC {
            return Err(bad(Damage::BadHeader, format!("{}: bad magic", where_())));
        }
        let u32_at = |o: usize| u32::from_le_bytes([raw[o], raw[o + 1], raw[o + 2], raw[o + 3]]);
        let u64_at = |o: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&raw[o..o + 8]);
            u64::from_le_bytes(b)
        };
        if u64_at(64) != xxh3_64(&raw[..64]) {
            return Err(bad(
                Damage::BadHeader,
                format!("{}: header checksum mismatch", where_()),
            ));
        }
        let version = u32_at(8);
        if version != VERSION {
            return Err(bad(
                Damage::BadHeader,
                format!(
                    "{}: format version {version}, this build reads {VERSION}",
                    where_()
                ),
            ));
        }
        let mut id = [0u8; 16];
        id.copy_from_slice(&raw[16..32]);
        Ok(ShardHeader {
            block: BlockId(id),
            index: u32_at(32),
            count: u32_at(36),
            shard_size: u64_at(40),
            fingerprint: u64_at(48),
            checksum: u64_at(56),
        })
    }

    /// Parses and checks a header against what the reader expects; every
    /// mismatch is a [`UcmError::Corrupt`] naming the field.
    pub fn decode_expect(
        raw: &[u8],
        block: &BlockId,
        index: usize,
        layout: &Layout,
    ) -> Result<ShardHeader> {
        let where_ = || format!("block {block} shard {index}");
        let bad =
            |damage, detail: String| UcmError::corrupt(damage, Some(*block), Some(index), detail);
        let hdr = Self::decode(raw, block, index)?;
        if hdr.block != *block {
            return Err(bad(
                Damage::ForeignBlock,
                format!("{}: file holds foreign block {}", where_(), hdr.block),
            ));
        }
        if hdr.index as usize != index || hdr.count as usize != layout.shard_count {
            return Err(bad(
                Damage::BadHeader,
                format!(
                    "{}: header says shard {} of {}",
                    where_(),
                    hdr.index,
                    hdr.count
                ),
            ));
        }
        if hdr.fingerprint != layout.fingerprint || hdr.shard_size as usize != layout.shard_size {
            return Err(bad(
                Damage::OtherLayout,
                format!(
                "{}: written with another layout (shard size {}, fingerprint {:016x}; expected {} / {:016x})",
                where_(),
                hdr.shard_size,
                hdr.fingerprint,
                layout.shard_size,
                layout.fingerprint
            )));
        }
        Ok(hdr)
    }
}

/// xxh3-64 over caller memory segments, as one stream.
///
/// # Safety
/// Every segment must be valid for reads of `len` bytes for the duration of
/// the call.
pub unsafe fn checksum_segs(segs: &[MemSeg]) -> u64 {
    if let [one] = segs {
        // SAFETY: guaranteed by the caller.
        return xxh3_64(unsafe { std::slice::from_raw_parts(one.addr as *const u8, one.len) });
    }
    let mut h = Xxh3Stream::new();
    for s in segs {
        // SAFETY: guaranteed by the caller.
        h.update(unsafe { std::slice::from_raw_parts(s.addr as *const u8, s.len) });
    }
    h.digest()
}

/// What [`verify_block`] found: the geometry the block's headers declare.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VerifiedBlock {
    /// Shards in the block.
    pub shards: usize,
    /// Bytes of one shard's data.
    pub shard_size: usize,
    /// Fingerprint of the layout that wrote it.
    pub fingerprint: u64,
}

/// Verifies a whole block as stored (`raw`: the file or object), without
/// knowing the layout that wrote it: the first header declares the shard
/// size and count, and every shard must then carry a valid header for this
/// block, its index and the same layout, and data matching its checksum.
pub fn verify_block(raw: &[u8], block: &BlockId) -> Result<VerifiedBlock> {
    let first = ShardHeader::decode(raw, block, 0)?;
    let shards = first.count as usize;
    let shard_size = usize::try_from(first.shard_size).unwrap_or(usize::MAX);
    let stride = HEADER_LEN.saturating_add(round_up(shard_size.min(1 << 40), REGION_ALIGN));
    let want = stride.saturating_mul(shards);
    let fail = |damage, shard: Option<usize>, detail: String| {
        UcmError::corrupt(
            damage,
            Some(*block),
            shard,
            format!("block {block}: {detail}"),
        )
    };
    if shards == 0 || shards > MAX_SHARDS || shard_size == 0 || raw.len() != want {
        return Err(fail(
            if raw.len() < want {
                Damage::Truncated
            } else {
                Damage::BadHeader
            },
            None,
            format!(
                "{} bytes, but its first header declares {shards} shard(s) of {shard_size} bytes \
                 ({want} bytes)",
                raw.len()
            ),
        ));
    }
    for i in 0..shards {
        let region = &raw[i * stride..(i + 1) * stride];
        let hdr = ShardHeader::decode(&region[..HEADER_LEN], block, i)?;
        if hdr.block != *block {
            return Err(fail(
                Damage::ForeignBlock,
                Some(i),
                format!("shard {i} holds foreign block {}", hdr.block),
            ));
        }
        if hdr.index as usize != i
            || hdr.count != first.count
            || hdr.shard_size != first.shard_size
            || hdr.fingerprint != first.fingerprint
        {
            return Err(fail(
                Damage::BadHeader,
                Some(i),
                format!("shard {i}'s header disagrees with the block's first header"),
            ));
        }
        if xxh3_64(&region[HEADER_LEN..HEADER_LEN + shard_size]) != hdr.checksum {
            return Err(fail(
                Damage::Checksum,
                Some(i),
                format!("shard {i}: data checksum mismatch"),
            ));
        }
    }
    Ok(VerifiedBlock {
        shards,
        shard_size,
        fingerprint: first.fingerprint,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> ShardHeader {
        ShardHeader {
            block: BlockId([7; 16]),
            index: 2,
            count: 4,
            shard_size: 1000,
            fingerprint: Layout::new(4000, 1000, &[500, 500]).fingerprint,
            checksum: 42,
        }
    }

    #[test]
    fn geometry() {
        let l = Layout::new(4000, 1000, &[500, 500]);
        assert_eq!(l.shard_count, 4);
        assert_eq!(l.stride, 4096 + 4096);
        assert_eq!(l.offset(2), 16384);
        assert_eq!(l.file_len(), 32768);
        assert_ne!(l.fingerprint, Layout::new(4000, 1000, &[1000]).fingerprint);
    }

    #[test]
    fn header_round_trip_and_checks() {
        let l = Layout::new(4000, 1000, &[500, 500]);
        let mut raw = vec![0u8; HEADER_LEN];
        header().encode(&mut raw);
        let h = ShardHeader::decode_expect(&raw, &BlockId([7; 16]), 2, &l).unwrap();
        assert_eq!(h, header());
        // foreign block, wrong shard, other layout, flipped byte
        assert!(ShardHeader::decode_expect(&raw, &BlockId([8; 16]), 2, &l).is_err());
        assert!(ShardHeader::decode_expect(&raw, &BlockId([7; 16]), 1, &l).is_err());
        let other = Layout::new(4000, 1000, &[1000]);
        let e = ShardHeader::decode_expect(&raw, &BlockId([7; 16]), 2, &other).unwrap_err();
        assert!(e.to_string().contains("another layout"), "{e}");
        raw[40] ^= 1;
        let e = ShardHeader::decode_expect(&raw, &BlockId([7; 16]), 2, &l).unwrap_err();
        assert!(e.to_string().contains("header checksum"), "{e}");
        assert!(ShardHeader::decode_expect(&[0u8; 8], &BlockId([7; 16]), 2, &l).is_err());
    }
}
