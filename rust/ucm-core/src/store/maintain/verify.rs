//! Checking blocks as stored, for maintenance: whether what sits at a
//! block's place is a ucm block file of that block at all (its first
//! header, [`check_header`]), and the whole block verified as its bytes go
//! past ([`BlockVerifier`]), in memory bounded by the caller's buffer
//! whatever size the file or object claims: the same checks, in the same
//! order and with the same messages, as the format's [`verify_block`].
//!
//! [`verify_block`]: crate::store::format::layout::verify_block

use crate::block::BlockId;
use crate::error::{Damage, Result, UcmError};
use crate::hashing::xxh3::Xxh3Stream;
use crate::store::format::layout::{
    ShardHeader, VerifiedBlock, HEADER_LEN, MAX_SHARDS, REGION_ALIGN,
};

/// Bytes read to check a block's first header.
pub const HEADER_READ: usize = HEADER_LEN;

/// The largest shard a header may declare (as the format's check bounds it).
const MAX_SHARD_SIZE: u64 = 1 << 40;

/// Whether `head`, the first bytes of what sits at block `id`'s place (at
/// least its first header, [`HEADER_READ`] bytes where the file is that
/// long), is a ucm block file of that block: the header's magic, its own
/// checksum and format version, and that it names block `id` as its
/// shard 0. Why not, otherwise.
pub fn check_header(head: &[u8], id: &BlockId) -> std::result::Result<(), String> {
    let hdr = ShardHeader::decode(head, id, 0).map_err(|e| match e {
        UcmError::Corrupt { detail, .. } => format!("not a ucm block file ({detail})"),
        other => other.to_string(),
    })?;
    if hdr.block != *id {
        return Err(format!(
            "a ucm block file of another block ({}), not of {id}",
            hdr.block
        ));
    }
    if hdr.index != 0 {
        return Err(format!(
            "not a ucm block file of {id} (its first header says shard {})",
            hdr.index
        ));
    }
    Ok(())
}

fn region_len(shard_size: u64) -> u64 {
    let align = REGION_ALIGN as u64;
    shard_size.div_ceil(align).saturating_mul(align)
}

/// Verifies one block fed to it in order, a piece at a time.
pub struct BlockVerifier {
    id: BlockId,
    first: ShardHeader,
    shards: u64,
    shard_size: u64,
    stride: u64,
    len: u64,
    /// Bytes fed so far.
    pos: u64,
    /// The header of the shard being read, as it arrives.
    header: Vec<u8>,
    /// That header, once it arrived and was checked.
    current: Option<ShardHeader>,
    hasher: Xxh3Stream,
}

impl BlockVerifier {
    /// Starts verifying block `id`, stored in `len` bytes whose first ones
    /// are `head` (its first header at least): the geometry that header
    /// declares must account for exactly `len` bytes.
    pub fn new(head: &[u8], id: &BlockId, len: u64) -> Result<Self> {
        let first = ShardHeader::decode(head, id, 0)?;
        let shards = u64::from(first.count);
        let shard_size = first.shard_size;
        let stride = (HEADER_LEN as u64).saturating_add(region_len(shard_size.min(MAX_SHARD_SIZE)));
        let want = stride.saturating_mul(shards);
        if shards == 0
            || shards > MAX_SHARDS as u64
            || shard_size == 0
            || shard_size > MAX_SHARD_SIZE
            || len != want
        {
            let damage = if len < want {
                Damage::Truncated
            } else {
                Damage::BadHeader
            };
            return Err(fail(
                id,
                damage,
                None,
                format!(
                    "{len} bytes, but its first header declares {shards} shard(s) of \
                     {shard_size} bytes ({want} bytes)"
                ),
            ));
        }
        Ok(BlockVerifier {
            id: *id,
            first,
            shards,
            shard_size,
            stride,
            len,
            pos: 0,
            header: Vec::with_capacity(HEADER_LEN),
            current: None,
            hasher: Xxh3Stream::new(),
        })
    }

    /// Bytes the block has.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True for a block of no bytes (never: a header declares at least one
    /// shard).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes still to feed.
    pub fn remaining(&self) -> u64 {
        self.len - self.pos
    }

    /// Feeds the next bytes of the block (what goes past its length is
    /// ignored); the first check that fails is the error.
    pub fn feed(&mut self, bytes: &[u8]) -> Result<()> {
        let keep = usize::try_from(self.remaining()).unwrap_or(usize::MAX);
        let mut bytes = &bytes[..bytes.len().min(keep)];
        let header_len = HEADER_LEN as u64;
        while !bytes.is_empty() {
            let shard = self.pos / self.stride;
            let off = self.pos % self.stride;
            let (end, part) = if off < header_len {
                (header_len, Part::Header)
            } else if off < header_len + self.shard_size {
                (header_len + self.shard_size, Part::Data)
            } else {
                (self.stride, Part::Padding)
            };
            let take = usize::try_from(end - off)
                .unwrap_or(usize::MAX)
                .min(bytes.len());
            let (now, rest) = bytes.split_at(take);
            match part {
                Part::Header => self.header.extend_from_slice(now),
                Part::Data => self.hasher.update(now),
                Part::Padding => {}
            }
            self.pos += take as u64;
            bytes = rest;
            if off + take as u64 == end {
                match part {
                    Part::Header => self.header_done(shard as usize)?,
                    Part::Data => self.data_done(shard as usize)?,
                    Part::Padding => {}
                }
            }
        }
        Ok(())
    }

    /// Checks that every byte arrived; what the block's headers declare.
    pub fn finish(self) -> Result<VerifiedBlock> {
        if self.pos != self.len {
            return Err(fail(
                &self.id,
                Damage::Truncated,
                None,
                format!(
                    "{} of its {} bytes could be read (it shrank while it was read)",
                    self.pos, self.len
                ),
            ));
        }
        Ok(VerifiedBlock {
            shards: self.shards as usize,
            shard_size: self.shard_size as usize,
            fingerprint: self.first.fingerprint,
        })
    }

    fn header_done(&mut self, i: usize) -> Result<()> {
        let hdr = ShardHeader::decode(&self.header, &self.id, i)?;
        self.header.clear();
        if hdr.block != self.id {
            return Err(fail(
                &self.id,
                Damage::ForeignBlock,
                Some(i),
                format!("shard {i} holds foreign block {}", hdr.block),
            ));
        }
        let first = &self.first;
        if hdr.index as usize != i
            || hdr.count != first.count
            || hdr.shard_size != first.shard_size
            || hdr.fingerprint != first.fingerprint
        {
            return Err(fail(
                &self.id,
                Damage::BadHeader,
                Some(i),
                format!("shard {i}'s header disagrees with the block's first header"),
            ));
        }
        self.current = Some(hdr);
        Ok(())
    }

    fn data_done(&mut self, i: usize) -> Result<()> {
        let sum = std::mem::replace(&mut self.hasher, Xxh3Stream::new()).digest();
        if self.current.take().map(|h| h.checksum) != Some(sum) {
            return Err(fail(
                &self.id,
                Damage::Checksum,
                Some(i),
                format!("shard {i}: data checksum mismatch"),
            ));
        }
        Ok(())
    }
}

enum Part {
    Header,
    Data,
    Padding,
}

fn fail(id: &BlockId, damage: Damage, shard: Option<usize>, detail: String) -> UcmError {
    UcmError::corrupt(damage, Some(*id), shard, format!("block {id}: {detail}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hashing::xxh3::xxh3_64;
    use crate::store::format::layout::{verify_block, Layout};
    use rand::{Rng, SeedableRng};

    /// A block file of `shards` shards of `shard_size` bytes, as stores write it.
    pub(crate) fn block_file(id: BlockId, shards: usize, shard_size: usize) -> Vec<u8> {
        let layout = Layout::new(shards * shard_size, shard_size, &[shard_size]);
        let mut raw = vec![0u8; layout.file_len() as usize];
        for i in 0..shards {
            let at = layout.offset(i) as usize;
            let data = &mut raw[at + HEADER_LEN..at + HEADER_LEN + shard_size];
            for (k, b) in data.iter_mut().enumerate() {
                *b = (k * 7 + i) as u8;
            }
            let checksum = xxh3_64(data);
            ShardHeader {
                block: id,
                index: i as u32,
                count: shards as u32,
                shard_size: shard_size as u64,
                fingerprint: layout.fingerprint,
                checksum,
            }
            .encode(&mut raw[at..at + HEADER_LEN]);
        }
        raw
    }

    fn streamed(raw: &[u8], id: &BlockId, rng: &mut impl Rng) -> Result<VerifiedBlock> {
        let head = &raw[..raw.len().min(HEADER_READ)];
        let mut v = BlockVerifier::new(head, id, raw.len() as u64)?;
        let mut at = 0;
        while at < raw.len() {
            let n = rng.random_range(1..=9000).min(raw.len() - at);
            v.feed(&raw[at..at + n])?;
            at += n;
        }
        v.finish()
    }

    /// Every damage the format's check finds, the streaming one finds
    /// alike, fed in pieces of any size.
    #[test]
    fn agrees_with_the_format_check() {
        let id = BlockId([9; 16]);
        let good = block_file(id, 3, 5000);
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let show = |r: Result<VerifiedBlock>| format!("{:?}", r.map_err(|e| e.to_string()));
        assert!(streamed(&good, &id, &mut rng).is_ok());
        for round in 0..400 {
            let mut raw = good.clone();
            match round % 4 {
                0 => {
                    let at = rng.random_range(0..raw.len());
                    raw[at] ^= 1 << rng.random_range(0..8);
                }
                1 => raw.truncate(rng.random_range(0..raw.len())),
                2 => raw.extend(std::iter::repeat_n(0, rng.random_range(1..9000))),
                _ => {
                    // A header field, re-sealed: a valid header saying
                    // something else.
                    let shard = rng.random_range(0..3usize);
                    let at = shard * (4096 + 8192);
                    let mut h = ShardHeader::decode(&raw[at..at + 4096], &id, shard).unwrap();
                    match rng.random_range(0..4) {
                        0 => h.block = BlockId([8; 16]),
                        1 => h.index ^= 1,
                        2 => h.count += 1,
                        _ => h.checksum ^= 1,
                    }
                    h.encode(&mut raw[at..at + 4096]);
                }
            }
            let want = show(verify_block(&raw, &id));
            assert_eq!(show(streamed(&raw, &id, &mut rng)), want, "round {round}");
        }
        assert_eq!(
            show(streamed(&good, &BlockId([1; 16]), &mut rng)),
            show(verify_block(&good, &BlockId([1; 16])))
        );
    }

    #[test]
    fn a_block_that_shrinks_while_read_fails() {
        let id = BlockId([3; 16]);
        let raw = block_file(id, 2, 4096);
        let mut v = BlockVerifier::new(&raw[..4096], &id, raw.len() as u64).unwrap();
        v.feed(&raw[..10_000]).unwrap();
        let e = v.finish().unwrap_err();
        assert!(e.to_string().contains("shrank"), "{e}");
    }

    #[test]
    fn the_first_header_tells_ucm_block_files() {
        let id = BlockId([5; 16]);
        let raw = block_file(id, 2, 4096);
        assert_eq!(check_header(&raw[..4096], &id), Ok(()));
        assert_eq!(check_header(&raw[..100], &id), Ok(()), "a truncated block");
        let other = check_header(&raw[..4096], &BlockId([6; 16])).unwrap_err();
        assert!(other.contains("another block"), "{other}");
        let second = check_header(&raw[8192..8192 + 4096], &id).unwrap_err();
        assert!(second.contains("shard 1"), "{second}");
        let mut flipped = raw[..4096].to_vec();
        flipped[20] ^= 1;
        let e = check_header(&flipped, &id).unwrap_err();
        assert!(e.contains("header checksum"), "{e}");
        for junk in [&b""[..], b"hello", &[0u8; 4096]] {
            let e = check_header(junk, &id).unwrap_err();
            assert!(e.contains("bad magic"), "{e}");
        }
    }
}
