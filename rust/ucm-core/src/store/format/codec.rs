//! Shard regions of the block format, built in and verified from memory
//! (the remote stores move whole regions over the network).
//!
//! A remote block is byte for byte a Posix block file (see
//! [`super::layout`]): shard `i`'s region starts at
//! `layout.offset(i)` and is a 4 KiB header (magic, version, block id,
//! shard index and count, layout fingerprint, xxh3 of the data, xxh3 of the
//! header) followed by the data padded to 4 KiB. So every load is guarded
//! by the same checks as a Posix load, and a block can be copied between a
//! Posix directory, an NFS export and a bucket unchanged.

use crate::hashing::xxh3::xxh3_64;

use crate::block::{BlockId, ShardIo};
use crate::error::{Damage, Result, UcmError};
use crate::store::format::carried::{carried, report_verified};
use crate::store::format::layout::{Layout, ShardHeader, HEADER_LEN};

/// Bytes of a region that a load must read: the header and the data
/// (not the padding).
pub fn read_len(layout: &Layout) -> usize {
    HEADER_LEN + layout.shard_size
}

/// Writes shard `shard`'s region (header, data, zero padding) into `out`,
/// which must be `layout.stride` bytes.
///
/// # Safety
/// Every segment of `shard` must be valid for reads of its length for the
/// duration of the call.
pub unsafe fn encode_region(layout: &Layout, shard: &ShardIo, out: &mut [u8]) {
    debug_assert_eq!(out.len(), layout.stride);
    let mut off = HEADER_LEN;
    for s in &shard.segs {
        // SAFETY: the source is valid per the caller's contract; the
        // destination lies inside `out` (the segments sum to shard_size).
        unsafe {
            std::ptr::copy_nonoverlapping(s.addr as *const u8, out[off..].as_mut_ptr(), s.len)
        };
        off += s.len;
    }
    out[off..].fill(0);
    // A tier above that knows the checksum hands it down with its memory:
    // hashing the copy would seal whatever that memory holds now.
    let checksum = carried(&shard.segs)
        .unwrap_or_else(|| xxh3_64(&out[HEADER_LEN..HEADER_LEN + layout.shard_size]));
    out[..HEADER_LEN].fill(0);
    ShardHeader {
        block: shard.block,
        index: shard.index as u32,
        count: layout.shard_count as u32,
        shard_size: layout.shard_size as u64,
        fingerprint: layout.fingerprint,
        checksum,
    }
    .encode(&mut out[..HEADER_LEN]);
}

/// True when a verification error means "written by a store with another
/// layout" (a differently configured engine sharing the bucket or export):
/// such a block is valid for its writer and must not be deleted.
pub fn is_layout_mismatch(e: &UcmError) -> bool {
    matches!(
        e,
        UcmError::Corrupt {
            damage: Damage::OtherLayout,
            ..
        }
    )
}

/// Verifies a region read back (`raw` holds at least [`read_len`] bytes:
/// the header then the data) and copies the data into the caller's
/// segments. Caller memory is only written when every check passed.
///
/// # Safety
/// Every segment of `shard` must be valid for writes of its length for the
/// duration of the call, and not alias `raw`.
pub unsafe fn decode_region(layout: &Layout, shard: &ShardIo, raw: &[u8]) -> Result<()> {
    let need = read_len(layout);
    if raw.len() < need {
        return Err(UcmError::corrupt(
            Damage::Truncated,
            Some(shard.block),
            Some(shard.index),
            format!(
                "block {} shard {}: object is truncated ({} of {need} bytes)",
                shard.block,
                shard.index,
                raw.len()
            ),
        ));
    }
    let hdr = ShardHeader::decode_expect(&raw[..HEADER_LEN], &shard.block, shard.index, layout)?;
    let data = &raw[HEADER_LEN..need];
    if xxh3_64(data) != hdr.checksum {
        return Err(UcmError::shard_checksum(shard.block, shard.index));
    }
    let mut off = 0;
    for s in &shard.segs {
        // SAFETY: destination valid per the caller's contract; the source
        // range lies inside `data` (segments sum to shard_size).
        unsafe { std::ptr::copy_nonoverlapping(data[off..].as_ptr(), s.addr as *mut u8, s.len) };
        off += s.len;
    }
    report_verified(&shard.segs, hdr.checksum);
    Ok(())
}

/// Checks the shards of a load or dump against the block geometry (blocks
/// of `shard_count` shards of `shard_size` bytes); errors name the offending
/// entry.
pub fn check_shards(shard_count: usize, shard_size: usize, shards: &[ShardIo]) -> Result<()> {
    for (i, s) in shards.iter().enumerate() {
        if s.index >= shard_count {
            return Err(UcmError::invalid(format!(
                "shard_index[{i}] = {} is out of range: blocks have {shard_count} shard(s)",
                s.index
            )));
        }
        if s.len() != shard_size {
            return Err(UcmError::invalid(format!(
                "shard {i} (block {}): tensors sum to {} bytes, expected shard_size {shard_size}",
                s.block,
                s.len(),
            )));
        }
        if s.segs.iter().any(|g| g.addr == 0) {
            return Err(UcmError::invalid(format!("shard {i}: null memory address")));
        }
    }
    Ok(())
}

/// Contiguous runs of shard indices (sorted, deduplicated input), as
/// `(first index, count)`: one request each.
pub fn runs(sorted: &[usize]) -> Vec<(usize, usize)> {
    let mut out: Vec<(usize, usize)> = Vec::new();
    for &i in sorted {
        match out.last_mut() {
            Some((first, n)) if *first + *n == i => *n += 1,
            Some((first, n)) if *first + *n > i => {} // duplicate
            _ => out.push((i, 1)),
        }
    }
    out
}

/// Key (relative path) of a block: `<2 hex>/<32 hex>`, as in a Posix root.
pub fn block_key(id: &BlockId) -> (String, String) {
    let hex = id.hex();
    (hex[..2].to_string(), hex)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::MemSeg;

    #[test]
    fn region_round_trip_and_checks() {
        let layout = Layout::new(8000, 4000, &[1000, 3000]);
        let a: Vec<u8> = (0..1000u32).map(|i| i as u8).collect();
        let b: Vec<u8> = (0..3000u32).map(|i| (i * 7) as u8).collect();
        let shard = ShardIo {
            block: BlockId([3; 16]),
            index: 1,
            segs: vec![MemSeg::of(&a), MemSeg::of(&b)],
        };
        let mut region = vec![0xffu8; layout.stride];
        // SAFETY: the segments point at live vectors.
        unsafe { encode_region(&layout, &shard, &mut region) };
        assert!(region[HEADER_LEN + 4000..].iter().all(|&x| x == 0));
        let mut c = vec![0u8; 1000];
        let mut d = vec![0u8; 3000];
        let out = ShardIo {
            block: shard.block,
            index: 1,
            segs: vec![MemSeg::of_mut(&mut c), MemSeg::of_mut(&mut d)],
        };
        // SAFETY: as above.
        unsafe { decode_region(&layout, &out, &region).unwrap() };
        assert_eq!((c.clone(), d.clone()), (a.clone(), b.clone()));
        // a flipped data byte, a short read, another shard index, another layout
        region[HEADER_LEN + 10] ^= 1;
        c.fill(0);
        // SAFETY: as above.
        let e = unsafe { decode_region(&layout, &out, &region) }.unwrap_err();
        assert!(e.to_string().contains("checksum"), "{e}");
        assert!(
            c.iter().all(|&x| x == 0),
            "caller memory untouched on error"
        );
        region[HEADER_LEN + 10] ^= 1;
        // SAFETY: as above.
        assert!(unsafe { decode_region(&layout, &out, &region[..100]) }.is_err());
        let other = ShardIo {
            index: 0,
            ..out.clone()
        };
        // SAFETY: as above.
        assert!(unsafe { decode_region(&layout, &other, &region) }.is_err());
        let l2 = Layout::new(8000, 4000, &[4000]);
        // SAFETY: as above.
        let e = unsafe { decode_region(&l2, &out, &region) }.unwrap_err();
        assert!(is_layout_mismatch(&e), "{e}");
    }

    #[test]
    fn runs_of_indices() {
        assert_eq!(runs(&[0, 1, 2, 5, 6, 9]), vec![(0, 3), (5, 2), (9, 1)]);
        assert_eq!(runs(&[0, 0, 1]), vec![(0, 2)]);
        assert!(runs(&[]).is_empty());
    }
}
