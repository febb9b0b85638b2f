//! A copy that computes the XXH3-64 (seed 0) of the bytes it writes, in
//! the same pass: each 64-byte stripe is loaded once into vector
//! registers, stored to the destination and folded into the hash from
//! those registers.
//!
//! Every shard that enters or leaves the cache is copied and checksummed.
//! Copying a piece and then hashing it from the CPU cache (the previous
//! way, still the fallback) read each byte twice and cost 28 % of the
//! copy's throughput on one thread of the development machine (5.0 against
//! 7.0 GB/s for 256 KiB shards); here the hash rides on the copy's loads.
//! XXH3's stripe loop is simple enough to write out (the specification's
//! `accumulate_512` and `scramble`, AVX2 form), but no crate offers it
//! over a copy, so it lives here. The result equals
//! [`crate::hashing::xxh3::xxh3_64`] of the concatenated source; the tests
//! hold it to that for every length class, split and alignment.
//!
//! On the fused path the checksum describes the bytes as written: a source
//! byte that changes during the copy is written and hashed in the same
//! value. The fallback hashes the source right after copying it, so such a
//! byte is seen by the hash too unless it changes back in between.

use crate::hashing::xxh3::Xxh3Stream;
use crate::io::bulk_copy::bulk_copy;

/// One contiguous copy of a gathered or scattered transfer.
#[derive(Clone, Copy, Debug)]
pub struct CopyPiece {
    /// Where the bytes go.
    pub dst: *mut u8,
    /// Where they come from.
    pub src: *const u8,
    /// How many.
    pub len: usize,
}

/// Below this many bytes in all, the pieces are copied and hashed the
/// plain way: the fused loop's set-up and final stripe are not worth it,
/// and XXH3's short-input forms (up to 240 bytes) never reach it.
const FUSED_MIN: usize = 4096;

/// Copies every piece in order and returns the XXH3-64 of their bytes,
/// concatenated in that order, as written to the destinations.
///
/// # Safety
/// For each piece, as for [`std::ptr::copy_nonoverlapping`]: `src` valid
/// for reads and `dst` for writes of `len` bytes, not overlapping each other
/// or any other piece's destination; nobody else writes a destination until
/// this returns.
pub unsafe fn copy_xxh3_64(pieces: &[CopyPiece]) -> u64 {
    let total: usize = pieces.iter().map(|p| p.len).sum();
    #[cfg(target_arch = "x86_64")]
    if total >= FUSED_MIN && std::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 is present (checked above); the pieces are the
        // caller's; total > 240 bytes, the long form's domain.
        return unsafe { avx2::copy_hash(pieces, total) };
    }
    // SAFETY: the caller's contract.
    unsafe { copy_then_hash(pieces) }
}

/// Bytes copied, then hashed from the CPU cache, at a time by the
/// fallback.
const HASH_PIECE: usize = 64 << 10;

/// The fallback: a piece at a time, copy then hash the source's bytes
/// while they are still in the CPU cache (the destination's were streamed
/// past it).
///
/// # Safety
/// As for [`copy_xxh3_64`].
unsafe fn copy_then_hash(pieces: &[CopyPiece]) -> u64 {
    let mut h = Xxh3Stream::new();
    for p in pieces {
        let mut off = 0;
        while off < p.len {
            let n = HASH_PIECE.min(p.len - off);
            // SAFETY: [off, off + n) lies within the piece; the destination
            // is the caller's and nobody else writes it.
            unsafe {
                bulk_copy(p.dst.add(off), p.src.add(off), n);
                h.update(std::slice::from_raw_parts(p.src.add(off), n));
            }
            off += n;
        }
    }
    h.digest()
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::{
        __m256i, _mm256_add_epi64, _mm256_loadu_si256, _mm256_mul_epu32, _mm256_set1_epi32,
        _mm256_set_epi64x, _mm256_shuffle_epi32, _mm256_slli_epi64, _mm256_srli_epi64,
        _mm256_storeu_si256, _mm256_stream_si256, _mm256_xor_si256, _mm_sfence,
    };

    use super::CopyPiece;
    use crate::io::bulk_copy::STREAM_MIN;

    const STRIPE: usize = 64;
    const STRIPES_PER_BLOCK: usize = (SECRET.len() - STRIPE) / 8;
    const BLOCK: usize = STRIPE * STRIPES_PER_BLOCK;

    const PRIME32_1: u64 = 0x9E37_79B1;
    const PRIME32_2: u64 = 0x85EB_CA77;
    const PRIME32_3: u64 = 0xC2B2_AE3D;
    const PRIME64_1: u64 = 0x9E37_79B1_85EB_CA87;
    const PRIME64_2: u64 = 0xC2B2_AE3D_27D4_EB4F;
    const PRIME64_3: u64 = 0x1656_67B1_9E37_79F9;
    const PRIME64_4: u64 = 0x85EB_CA77_C2B2_AE63;
    const PRIME64_5: u64 = 0x27D4_EB2F_1656_67C5;
    const PRIME_MX1: u64 = 0x1656_6791_9E37_79F9;

    /// XXH3's default secret (`kSecret` of the specification).
    const SECRET: [u8; 192] = [
        0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad,
        0x1c, 0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3,
        0x67, 0x1f, 0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc,
        0xff, 0x72, 0x21, 0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6,
        0x81, 0x3a, 0x26, 0x4c, 0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65,
        0x8b, 0x1b, 0x53, 0x2e, 0xa3, 0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19,
        0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8, 0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9,
        0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d, 0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31,
        0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64, 0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb,
        0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb, 0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0,
        0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e, 0x2b, 0x16, 0xbe, 0x58, 0x7d,
        0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce, 0x45, 0xcb, 0x3a, 0x8f,
        0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
    ];

    /// The long form's running state: eight 64-bit accumulators in two
    /// vectors and the stripe's place in its block.
    struct Acc {
        v: [__m256i; 2],
        stripe: usize,
    }

    impl Acc {
        #[target_feature(enable = "avx2")]
        fn new() -> Self {
            let v = [
                _mm256_set_epi64x(
                    PRIME64_3 as i64,
                    PRIME64_2 as i64,
                    PRIME64_1 as i64,
                    PRIME32_3 as i64,
                ),
                _mm256_set_epi64x(
                    PRIME32_1 as i64,
                    PRIME64_5 as i64,
                    PRIME32_2 as i64,
                    PRIME64_4 as i64,
                ),
            ];
            Self { v, stripe: 0 }
        }

        /// Copies a whole block of stripes and hashes it, then scrambles:
        /// the stripe loop unrolled with constant secret offsets and the
        /// accumulators in registers.
        ///
        /// # Safety
        /// `src` is readable and `dst` writable for a block; with STREAM,
        /// `dst` is 32-byte aligned; the block starts a block of the input.
        #[inline]
        #[target_feature(enable = "avx2")]
        unsafe fn copy_block<const STREAM: bool>(&mut self, src: *const u8, dst: *mut u8) {
            let mut v = self.v;
            for s in 0..STRIPES_PER_BLOCK {
                // SAFETY: stripe s of the block, per the contract.
                let halves =
                    unsafe { copy_stripe::<STREAM>(src.add(s * STRIPE), dst.add(s * STRIPE)) };
                accumulate(&mut v, halves, 8 * s);
            }
            self.v = v;
            self.scramble();
        }

        /// One stripe of a block, then the block's scramble when it is full.
        #[inline]
        #[target_feature(enable = "avx2")]
        fn stripe(&mut self, halves: [__m256i; 2]) {
            accumulate(&mut self.v, halves, 8 * self.stripe);
            self.stripe += 1;
            if self.stripe == STRIPES_PER_BLOCK {
                self.scramble();
                self.stripe = 0;
            }
        }

        #[target_feature(enable = "avx2")]
        fn scramble(&mut self) {
            let prime = _mm256_set1_epi32(PRIME32_1 as i32);
            for (i, acc) in self.v.iter_mut().enumerate() {
                let a = _mm256_xor_si256(*acc, _mm256_srli_epi64::<47>(*acc));
                let dk = _mm256_xor_si256(a, read_secret(SECRET.len() - STRIPE + 32 * i));
                let lo = _mm256_mul_epu32(dk, prime);
                let hi = _mm256_mul_epu32(_mm256_srli_epi64::<32>(dk), prime);
                *acc = _mm256_add_epi64(lo, _mm256_slli_epi64::<32>(hi));
            }
        }

        /// The last stripe, the merge of the accumulators and the avalanche.
        #[target_feature(enable = "avx2")]
        fn finish(mut self, last: &[u8; STRIPE], total: usize) -> u64 {
            accumulate(&mut self.v, load_stripe(last), SECRET.len() - STRIPE - 7);
            let mut acc = [0u64; 8];
            for (i, v) in self.v.iter().enumerate() {
                // SAFETY: `acc` has room for two vectors of four u64.
                unsafe { _mm256_storeu_si256(acc.as_mut_ptr().add(4 * i).cast(), *v) };
            }
            let mut h = (total as u64).wrapping_mul(PRIME64_1);
            for (i, pair) in acc.chunks_exact(2).enumerate() {
                let lo = pair[0] ^ secret_u64(11 + 16 * i);
                let hi = pair[1] ^ secret_u64(11 + 16 * i + 8);
                let m = u128::from(lo) * u128::from(hi);
                h = h.wrapping_add((m as u64) ^ ((m >> 64) as u64));
            }
            h ^= h >> 37;
            h = h.wrapping_mul(PRIME_MX1);
            h ^ (h >> 32)
        }
    }

    /// `accumulate_512` of one stripe (its two halves) into `acc` with the
    /// secret at byte `key`.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn accumulate(acc: &mut [__m256i; 2], halves: [__m256i; 2], key: usize) {
        for (a, (i, data)) in acc.iter_mut().zip(halves.into_iter().enumerate()) {
            let dk = _mm256_xor_si256(data, read_secret(key + 32 * i));
            let product = _mm256_mul_epu32(dk, _mm256_srli_epi64::<32>(dk));
            // acc[j] += data[j ^ 1]: swap the 64-bit halves of each lane.
            let swapped = _mm256_shuffle_epi32::<0b0100_1110>(data);
            *a = _mm256_add_epi64(_mm256_add_epi64(*a, swapped), product);
        }
    }

    /// Copies one stripe and returns it, loaded once. The streaming stores
    /// are 32 bytes wide: 16-byte ones are SSE-encoded and mixing them with
    /// the hash's AVX2 measured slower.
    ///
    /// # Safety
    /// `src` readable and `dst` writable for a stripe; with STREAM, `dst`
    /// is 32-byte aligned.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn copy_stripe<const STREAM: bool>(src: *const u8, dst: *mut u8) -> [__m256i; 2] {
        // SAFETY: per the contract.
        unsafe {
            let s = src.cast::<__m256i>();
            let halves = [_mm256_loadu_si256(s), _mm256_loadu_si256(s.add(1))];
            if STREAM {
                let d = dst.cast::<__m256i>();
                _mm256_stream_si256(d, halves[0]);
                _mm256_stream_si256(d.add(1), halves[1]);
            } else {
                let d = dst.cast::<__m256i>();
                _mm256_storeu_si256(d, halves[0]);
                _mm256_storeu_si256(d.add(1), halves[1]);
            }
            halves
        }
    }

    /// The secret's 32 bytes from `at`.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn read_secret(at: usize) -> __m256i {
        assert!(at <= SECRET.len() - 32);
        // SAFETY: an unaligned load of 32 bytes within SECRET (asserted;
        // every caller's offset is below 160, so the check folds away).
        unsafe { _mm256_loadu_si256(SECRET.as_ptr().add(at).cast()) }
    }

    fn secret_u64(at: usize) -> u64 {
        let mut b = [0u8; 8];
        b.copy_from_slice(&SECRET[at..at + 8]);
        u64::from_le_bytes(b)
    }

    #[target_feature(enable = "avx2")]
    fn load_stripe(s: &[u8; STRIPE]) -> [__m256i; 2] {
        // SAFETY: two unaligned loads of 32 bytes within `s`.
        unsafe {
            [
                _mm256_loadu_si256(s.as_ptr().cast()),
                _mm256_loadu_si256(s.as_ptr().add(32).cast()),
            ]
        }
    }

    /// The input's last stripe, collected from the bytes as they are
    /// written (reading it back from a destination just written with
    /// streaming stores waits for them to reach memory: a quarter of the
    /// copy's time at 256 KiB).
    struct LastStripe {
        bytes: [u8; STRIPE],
        start: usize,
    }

    impl LastStripe {
        /// Notes `bytes`, written at input offset `at`.
        fn note(&mut self, at: usize, bytes: &[u8]) {
            let end = at + bytes.len();
            if end > self.start {
                let from = at.max(self.start);
                self.bytes[from - self.start..end - self.start]
                    .copy_from_slice(&bytes[from - at..]);
            }
        }
    }

    /// # Safety
    /// As for [`super::copy_xxh3_64`]; AVX2 is present; `total` is the sum
    /// of the pieces' lengths and above 240.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn copy_hash(pieces: &[CopyPiece], total: usize) -> u64 {
        let mut acc = Acc::new();
        let mut last = LastStripe {
            bytes: [0; STRIPE],
            start: total - STRIPE,
        };
        // A stripe split between pieces, gathered here.
        let mut carry = [0u8; STRIPE];
        let mut carried = 0;
        // Source offset of the next byte, in the concatenation.
        let mut at = 0;
        let mut streamed = false;
        for p in pieces {
            let (mut src, mut dst, mut n) = (p.src, p.dst, p.len);
            if carried > 0 {
                let k = (STRIPE - carried).min(n);
                // SAFETY: k bytes lie within the piece and within `carry`;
                // the destination gets the bytes the hash sees.
                unsafe {
                    std::ptr::copy_nonoverlapping(src, carry.as_mut_ptr().add(carried), k);
                    std::ptr::copy_nonoverlapping(carry.as_ptr().add(carried), dst, k);
                    (src, dst) = (src.add(k), dst.add(k));
                }
                last.note(at, &carry[carried..carried + k]);
                (carried, n, at) = (carried + k, n - k, at + k);
                if carried < STRIPE {
                    continue; // the piece ended inside the stripe
                }
                // The stripe that ends the input is the last stripe, taken
                // by `finish`, never accumulated here.
                if at < total {
                    acc.stripe(load_stripe(&carry));
                }
            }
            // Streaming stores need 32-byte aligned addresses; small pieces
            // keep ordinary stores (their lines may be read soon).
            let stream = n >= STREAM_MIN && (dst as usize) % 32 == 0;
            streamed |= stream;
            while n >= STRIPE && at + STRIPE < total {
                // Whole blocks stop short of the last stripe, so only the
                // single-stripe path below has bytes to note.
                let step = if acc.stripe == 0 && n >= BLOCK && at + BLOCK + STRIPE < total {
                    // SAFETY: a whole block within the piece, at a block
                    // boundary of the input; aligned when streamed (`dst`
                    // was, and BLOCK keeps it).
                    unsafe {
                        if stream {
                            acc.copy_block::<true>(src, dst);
                        } else {
                            acc.copy_block::<false>(src, dst);
                        }
                    }
                    BLOCK
                } else {
                    // SAFETY: a stripe within the piece, aligned as above.
                    let halves = unsafe {
                        if stream {
                            copy_stripe::<true>(src, dst)
                        } else {
                            copy_stripe::<false>(src, dst)
                        }
                    };
                    if at + 2 * STRIPE > total {
                        last.note(at, &stripe_bytes(halves));
                    }
                    acc.stripe(halves);
                    STRIPE
                };
                // SAFETY: step <= n bytes remain in the piece.
                unsafe { (src, dst) = (src.add(step), dst.add(step)) };
                (n, at) = (n - step, at + step);
            }
            // Left: under a stripe (carried into the next piece), or exactly
            // the input's last stripe. Copied through `carry` so the hash
            // and the destination see the same bytes.
            // SAFETY: n <= STRIPE bytes within the piece.
            unsafe {
                std::ptr::copy_nonoverlapping(src, carry.as_mut_ptr(), n);
                std::ptr::copy_nonoverlapping(carry.as_ptr(), dst, n);
            }
            last.note(at, &carry[..n]);
            carried = if n < STRIPE { n } else { 0 };
            at += n;
        }
        if streamed {
            // Order the streamed stores before the caller's next store (a
            // slot's state, a task's completion).
            _mm_sfence();
        }
        acc.finish(&last.bytes, total)
    }

    #[target_feature(enable = "avx2")]
    fn stripe_bytes(halves: [__m256i; 2]) -> [u8; STRIPE] {
        let mut b = [0u8; STRIPE];
        // SAFETY: two unaligned stores of 32 bytes within `b`.
        unsafe {
            _mm256_storeu_si256(b.as_mut_ptr().cast(), halves[0]);
            _mm256_storeu_si256(b.as_mut_ptr().add(32).cast(), halves[1]);
        }
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hashing::xxh3::xxh3_64;

    fn sample(len: usize) -> Vec<u8> {
        (0..len)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8)
            .collect()
    }

    /// Splits `len` bytes at `cuts` into pieces copied from `src` (at source
    /// offset `so`) into `dst` (at `dof`), scattered with a gap of `gap`
    /// bytes between destinations; checks the copy and the checksum.
    fn check(len: usize, cuts: &[usize], so: usize, dof: usize, gap: usize) {
        let src = sample(len + so);
        // Offsets count from a 64-byte aligned start, so `dof` 0 streams.
        let mut buf = vec![0xA5u8; len + dof + gap * (cuts.len() + 1) + 128];
        let skew = buf.as_ptr().align_offset(64);
        let dst = &mut buf[skew..];
        let mut bounds: Vec<usize> = cuts.iter().copied().filter(|&c| c <= len).collect();
        bounds.insert(0, 0);
        bounds.push(len);
        let mut pieces = Vec::new();
        let mut d = dof;
        for w in bounds.windows(2) {
            let n = w[1] - w[0];
            pieces.push(CopyPiece {
                // SAFETY: offsets stay within both vectors (sized above).
                dst: unsafe { dst.as_mut_ptr().add(d) },
                src: unsafe { src.as_ptr().add(so + w[0]) },
                len: n,
            });
            d += n + gap;
        }
        // SAFETY: the pieces lie within the vectors, destinations disjoint.
        let h = unsafe { copy_xxh3_64(&pieces) };
        let want = &src[so..so + len];
        assert_eq!(h, xxh3_64(want), "len {len} cuts {cuts:?} {so}/{dof}/{gap}");
        let mut d = dof;
        for w in bounds.windows(2) {
            let n = w[1] - w[0];
            assert_eq!(&dst[d..d + n], &want[w[0]..w[1]], "len {len} cuts {cuts:?}");
            assert!(dst[d + n..d + n + gap].iter().all(|&b| b == 0xA5));
            d += n + gap;
        }
        assert!(dst[..dof].iter().all(|&b| b == 0xA5));
    }

    #[test]
    fn one_piece_of_every_length_class_hashes_as_xxh3() {
        let mut lens: Vec<usize> = (0..300).collect();
        lens.extend([
            FUSED_MIN - 1,
            FUSED_MIN,
            FUSED_MIN + 1,
            4160,
            5119,
            5120,
            5121,
        ]);
        lens.extend([65_536, 65_599, 262_144, 262_144 + 63, 262_144 + 64, 1 << 20]);
        for len in lens {
            for (so, dof) in [(0, 0), (1, 0), (0, 1), (7, 32), (33, 64)] {
                check(len, &[], so, dof, 0);
            }
        }
    }

    #[test]
    fn split_pieces_hash_as_their_concatenation() {
        let len = 262_144 + 77;
        let splits: [&[usize]; 9] = [
            &[1],
            &[63, 64, 65],
            &[64, 128, 1024, 1025],
            &[100, 101, 102, 5000],
            &[len - 64, len - 1],
            &[len - 63],
            &[len - 65, len - 64],
            &[131_072, 196_608],
            &[4096, 4096, 4096, 8000],
        ];
        for cuts in splits {
            for (so, dof, gap) in [(0, 0, 0), (3, 5, 7), (0, 0, 64), (17, 32, 1)] {
                check(len, cuts, so, dof, gap);
            }
        }
        // Many tiny pieces: every stripe is gathered through the carry.
        let cuts: Vec<usize> = (1..200).map(|i| i * 37).collect();
        check(8192, &cuts, 1, 2, 3);
        // A shard as the cache sees one: 16 layers, K and V each.
        let cuts: Vec<usize> = (1..32).map(|i| i * 8192).collect();
        check(262_144, &cuts, 0, 0, 4096);
    }
}
