//! XXH3, the one implementation every caller uses: block ids
//! (`xxh3_128`), shard checksums and layout fingerprints (`xxh3_64`).
//!
//! It comes from `twox-hash`, which picks AVX2 or SSE2 when the process
//! starts. `xxhash-rust` fixes its SIMD width when the crate is compiled, so
//! a portable wheel ran the SSE2 loop on every machine; every load verifies
//! each shard's checksum, and there the AVX2 loop hashes about 1.4 times as
//! many bytes per second. XXH3's output is fixed by its specification, so
//! stored checksums and block ids are unchanged; the tests below pin it to
//! the reference vectors and to the previous crate.

use std::hash::Hasher;

use twox_hash::{XxHash3_128, XxHash3_64};

/// XXH3-64 of `bytes`, seed 0.
#[inline]
pub fn xxh3_64(bytes: &[u8]) -> u64 {
    XxHash3_64::oneshot(bytes)
}

/// XXH3-128 of `bytes` with `seed`.
#[inline]
pub fn xxh3_128_with_seed(bytes: &[u8], seed: u64) -> u128 {
    XxHash3_128::oneshot_with_seed(seed, bytes)
}

/// XXH3-64 (seed 0) of several pieces fed one after another: the same value
/// as [`xxh3_64`] of their concatenation.
#[derive(Default)]
pub struct Xxh3Stream(XxHash3_64);

impl Xxh3Stream {
    /// An empty stream.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends `bytes`.
    #[inline]
    pub fn update(&mut self, bytes: &[u8]) {
        self.0.write(bytes);
    }

    /// The hash of everything appended so far.
    pub fn digest(&self) -> u64 {
        self.0.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(len: usize) -> Vec<u8> {
        (0..len)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect()
    }

    #[test]
    fn matches_the_reference_vectors() {
        // From the xxHash reference implementation (XXH3_64bits / XXH3_128bits
        // of the empty input, seed 0).
        assert_eq!(xxh3_64(b""), 0x2D06_8005_38D3_94C2);
        assert_eq!(
            xxh3_128_with_seed(b"", 0),
            0x99AA_06D3_0147_98D8_6001_C324_468D_497F
        );
    }

    #[test]
    fn matches_the_crate_that_wrote_existing_stores() {
        // Every size class of the algorithm (0, 1-3, 4-8, 9-16, 17-128,
        // 129-240, long with a partial stripe and block), for both widths.
        let data = sample(3 * 1024 * 1024 + 77);
        let mut lens: Vec<usize> = (0..=300).collect();
        lens.extend([1023, 1024, 1025, 4096, 65_536, 262_144, 262_151]);
        lens.push(data.len());
        for len in lens {
            let bytes = &data[..len];
            assert_eq!(xxh3_64(bytes), xxhash_rust::xxh3::xxh3_64(bytes), "{len}");
            for seed in [0, 1, 0x9E37_79B9_7F4A_7C15] {
                assert_eq!(
                    xxh3_128_with_seed(bytes, seed),
                    xxhash_rust::xxh3::xxh3_128_with_seed(bytes, seed),
                    "{len} {seed}"
                );
            }
        }
    }

    #[test]
    fn a_stream_hashes_as_its_concatenation() {
        let data = sample(600_000);
        for cuts in [
            vec![],
            vec![0, 0],
            vec![1, 63, 64, 240],
            vec![262_144],
            vec![599_999],
        ] {
            let mut s = Xxh3Stream::new();
            let mut at = 0;
            for c in cuts {
                s.update(&data[at..c]);
                at = c;
            }
            s.update(&data[at..]);
            assert_eq!(s.digest(), xxh3_64(&data));
        }
        assert_eq!(Xxh3Stream::new().digest(), xxh3_64(b""));
    }
}
