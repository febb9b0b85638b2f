//! `md5_ucm`: byte-exact reimplementation of the original UCM block-id chain.
//!
//! The original (`RequestHasher` in `ucm/integration/vllm/ucm_connector.py`)
//! computes
//!
//! ```text
//! hash(x) = MD5(meta + (x if bytes else pickle.dumps(x, protocol=HIGHEST_PROTOCOL)))
//! seed    = hash("UCM_HASH_SEED")                  # the str is pickled; meta prefixed
//! id_i    = hash((id_{i-1}, tuple(tokens_i)))      # full blocks only, id_{-1} = seed
//! ```
//!
//! with CPython 3.11, where `HIGHEST_PROTOCOL` is 5. This module writes the
//! exact bytes the C pickler (`_pickle.c`) produces for the one shape we need,
//! `(bytes16, tuple[int, ...])`:
//!
//! ```text
//! PROTO 5 | FRAME len | SHORT_BINBYTES 16 <id> MEMOIZE
//!         | MARK <int>... TUPLE  (or <int>.. TUPLE1/2/3 for 1..=3 items) MEMOIZE
//!         | TUPLE2 MEMOIZE STOP
//! ```
//!
//! ints are `BININT1` (0..256), `BININT2` (256..65536), `BININT` (other
//! 32-bit signed values, negatives included) or `LONG1` (minimal two's
//! complement, little-endian). Framing follows `_pickle.c`: the first write
//! after `PROTO` opens a frame (a 9-byte `FRAME` header reserved in place);
//! before each object is saved the pickler checks whether the open frame
//! holds at least 64 KiB (`FRAME_SIZE_TARGET`) and, if so, commits it, so the
//! next opcode opens a new frame. Within our shape the only objects saved
//! while a frame can be that large are the ints, so the check runs before
//! each int. A frame with fewer than 4 payload bytes loses its header
//! (`FRAME_SIZE_MIN`); that cannot happen for this shape, but is handled.

use md5::{Digest, Md5};

use crate::BlockId;

/// `pickle.dumps("UCM_HASH_SEED", protocol=5)` as produced by CPython 3.11:
/// PROTO 5, FRAME 17, SHORT_BINUNICODE 13 "UCM_HASH_SEED", MEMOIZE, STOP.
pub(crate) const SEED_PICKLE: &[u8] =
    b"\x80\x05\x95\x11\x00\x00\x00\x00\x00\x00\x00\x8c\x0dUCM_HASH_SEED\x94.";

// Pickle opcodes (see CPython `Lib/pickle.py`).
const PROTO: u8 = 0x80;
const FRAME: u8 = 0x95;
const SHORT_BINBYTES: u8 = b'C';
const MEMOIZE: u8 = 0x94;
const MARK: u8 = b'(';
const TUPLE: u8 = b't';
const TUPLE1: u8 = 0x85;
const TUPLE2: u8 = 0x86;
const TUPLE3: u8 = 0x87;
const EMPTY_TUPLE: u8 = b')';
const BININT1: u8 = b'K';
const BININT2: u8 = b'M';
const BININT: u8 = b'J';
const LONG1: u8 = 0x8a;
const STOP: u8 = b'.';

/// `_pickle.c` `FRAME_SIZE_TARGET`.
const FRAME_SIZE_TARGET: usize = 64 * 1024;
/// `_pickle.c` `FRAME_SIZE_MIN`: smaller frames are written without header.
const FRAME_SIZE_MIN: usize = 4;
/// FRAME opcode + 8-byte little-endian length.
const FRAME_HEADER_SIZE: usize = 9;

/// The seed (parent of block 0): `MD5(meta + pickle.dumps("UCM_HASH_SEED"))`.
pub(crate) fn root_id(meta: &[u8]) -> BlockId {
    let mut h = Md5::new();
    h.update(meta);
    h.update(SEED_PICKLE);
    BlockId(h.finalize().into())
}

/// Chains `MD5(meta + pickle((parent, tuple(block))))` over `tokens`, which
/// must hold whole blocks only (the caller drops the partial tail).
pub(crate) fn chain(
    tokens: &[i64],
    block_size: usize,
    meta: &[u8],
    parent: BlockId,
) -> Vec<BlockId> {
    debug_assert!(block_size > 0 && tokens.len() % block_size == 0);
    let mut out = Vec::with_capacity(tokens.len() / block_size);
    // One scratch buffer reused for every block: `meta` stays at the front,
    // the pickle is rewritten after it, and MD5 runs over the whole buffer in
    // one call.
    let mut buf = Vec::with_capacity(meta.len() + max_pickle_len(block_size));
    buf.extend_from_slice(meta);
    let mut prev = parent;
    for block in tokens.chunks_exact(block_size) {
        buf.truncate(meta.len());
        write_pickle(&mut buf, &prev, block);
        prev = BlockId(Md5::digest(&buf).into());
        out.push(prev);
    }
    out
}

/// Upper bound of the pickle size of a block of `n` ints, plus the slack the
/// writer needs (it stores 9 bytes per int before advancing by the real size).
fn max_pickle_len(n: usize) -> usize {
    // PROTO + frame headers + bytes + MARK + ints (<= 10 bytes each) + tail.
    let frames = n * 10 / FRAME_SIZE_TARGET + 2;
    2 + frames * FRAME_HEADER_SIZE + 19 + 1 + n * 10 + 5 + 16
}

/// Appends `pickle.dumps((parent, tuple(block)), protocol=5)` to `buf`.
pub(crate) fn write_pickle(buf: &mut Vec<u8>, parent: &BlockId, block: &[i64]) {
    let base = buf.len();
    buf.resize(base + max_pickle_len(block.len()), 0);
    let len = write_pickle_into(&mut buf[base..], parent, block);
    buf.truncate(base + len);
}

/// Writes the pickle at the start of `out` (at least
/// `max_pickle_len(block.len())` bytes); returns its length.
fn write_pickle_into(out: &mut [u8], parent: &BlockId, block: &[i64]) -> usize {
    out[..2].copy_from_slice(&[PROTO, 5]);
    // First write after PROTO opens a frame; its header is filled on commit.
    let mut frame_start = 2;
    let mut pos = frame_start + FRAME_HEADER_SIZE;
    out[pos..pos + 2].copy_from_slice(&[SHORT_BINBYTES, BlockId::LEN as u8]);
    out[pos + 2..pos + 18].copy_from_slice(&parent.0);
    out[pos + 18] = MEMOIZE;
    pos += 19;
    let tuple_op = match block.len() {
        0 => None,
        1 => Some(TUPLE1),
        2 => Some(TUPLE2),
        3 => Some(TUPLE3),
        _ => {
            out[pos] = MARK;
            pos += 1;
            Some(TUPLE)
        }
    };
    for &v in block {
        // `save()` calls the opcode-boundary check before each object.
        if pos - frame_start - FRAME_HEADER_SIZE >= FRAME_SIZE_TARGET {
            pos = commit_frame(out, frame_start, pos);
            frame_start = pos;
            pos += FRAME_HEADER_SIZE;
        }
        pos += write_int(&mut out[pos..pos + 10], v);
    }
    let tail: &[u8] = match tuple_op {
        // The empty tuple is a singleton and is not memoized.
        None => &[EMPTY_TUPLE, TUPLE2, MEMOIZE, STOP],
        Some(op) => &[op, MEMOIZE, TUPLE2, MEMOIZE, STOP],
    };
    out[pos..pos + tail.len()].copy_from_slice(tail);
    pos += tail.len();
    commit_frame(out, frame_start, pos)
}

/// `_Pickler_CommitFrame` for the frame whose header is at `start` and whose
/// data ends at `end`: fills the header, or drops it for tiny frames.
/// Returns the new end.
fn commit_frame(out: &mut [u8], start: usize, end: usize) -> usize {
    let len = end - start - FRAME_HEADER_SIZE;
    if len >= FRAME_SIZE_MIN {
        out[start] = FRAME;
        out[start + 1..start + FRAME_HEADER_SIZE].copy_from_slice(&(len as u64).to_le_bytes());
        end
    } else {
        out.copy_within(start + FRAME_HEADER_SIZE..end, start);
        end - FRAME_HEADER_SIZE
    }
}

/// `save_long` for protocol >= 2 into `out` (10 bytes); returns the length.
#[inline(always)]
fn write_int(out: &mut [u8], v: i64) -> usize {
    // Opcode and size for 0..256, 256..65536, other i32, indexed by range
    // without branches (token ids mix these ranges unpredictably).
    const OPS: [u8; 3] = [BININT, BININT2, BININT1];
    const LENS: [usize; 3] = [5, 3, 2];
    if i32::try_from(v).is_ok() {
        let u = v as u64;
        let k = (u < 0x1_0000) as usize + (u < 0x100) as usize;
        out[0] = OPS[k];
        // Little-endian: the low 1, 2 or 4 bytes are the value.
        out[1..9].copy_from_slice(&v.to_le_bytes());
        LENS[k]
    } else {
        // LONG1: CPython takes (nbits >> 3) + 1 bytes of two's complement and
        // drops one redundant 0xff for -(2**(8j-1)); that is exactly the
        // minimal two's-complement length, computed here directly.
        let b = v.to_le_bytes();
        let mut n = b.len();
        while n > 1 {
            let top = b[n - 1];
            let next_neg = b[n - 2] & 0x80 != 0;
            if (top == 0 && !next_neg) || (top == 0xff && next_neg) {
                n -= 1;
            } else {
                break;
            }
        }
        out[0] = LONG1;
        out[1] = n as u8;
        out[2..2 + n].copy_from_slice(&b[..n]);
        2 + n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pickle(parent: &BlockId, block: &[i64]) -> Vec<u8> {
        let mut v = Vec::new();
        write_pickle(&mut v, parent, block);
        v
    }

    fn unhex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
            .collect()
    }

    // Expected bytes below come from CPython 3.11
    // `pickle.dumps((bytes(range(16)), tuple(block)), protocol=5).hex()`.
    const P: BlockId = BlockId([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]);

    #[test]
    fn pickle_one_int() {
        assert_eq!(
            pickle(&P, &[1]),
            unhex("8005951a000000000000004310000102030405060708090a0b0c0d0e0f944b01859486942e")
        );
    }

    #[test]
    fn pickle_int_opcodes() {
        let block = [
            0,
            255,
            256,
            65535,
            65536,
            -1,
            -128,
            i32::MAX as i64,
            i32::MIN as i64,
            1 << 31,
            -(1 << 31) - 1,
            1 << 32,
            -(1 << 32),
            i64::MAX,
            i64::MIN,
            -(1 << 39),
            (1 << 39) - 1,
        ];
        let expected = unhex(concat!(
            "8005957a000000000000004310000102030405060708090a0b0c0d0e0f94284b004bff4d00014dffff",
            "4a000001004affffffff4a80ffffff4affffff7f4a000000808a0500000080008a05ffffff7fff",
            "8a0500000000018a0500000000ff8a08ffffffffffffff7f8a0800000000000000808a0500000000",
            "808a05ffffffff7f749486942e",
        ));
        assert_eq!(pickle(&P, &block), expected);
    }

    #[test]
    fn seed_pickle_layout() {
        // FRAME length covers everything after the header.
        assert_eq!(SEED_PICKLE.len(), 2 + 9 + 17);
        assert_eq!(SEED_PICKLE[2], FRAME);
    }
}
