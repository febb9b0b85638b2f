//! A same-run baseline for load benchmarks: how fast this machine computes
//! the per-shard checksum that every load verifies, on bytes in memory,
//! with a given number of threads. A load from the page cache copies each
//! byte out of it and then checksums it; together with the page-cache read
//! bandwidth this bounds what any verified load of the same bytes can reach.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use super::layout::checksum_segs;
use crate::block::MemSeg;
use crate::error::{Result, UcmError};

/// GB/s (10^9 bytes per second) of the load checksum over `total_bytes` in
/// memory, in pieces of `piece_bytes` (one shard each), hashed by `threads`
/// threads taking pieces in turn; best of three passes over memory touched
/// beforehand.
pub fn checksum_gbps(total_bytes: usize, piece_bytes: usize, threads: usize) -> Result<f64> {
    if total_bytes == 0 || piece_bytes == 0 || threads == 0 {
        return Err(UcmError::invalid(format!(
            "checksum baseline: total_bytes ({total_bytes}), piece_bytes ({piece_bytes}) and \
             threads ({threads}) must be positive"
        )));
    }
    // Distinct bytes, so no pass hashes a page the kernel shares as zeros.
    let buf: Vec<u8> = (0..total_bytes).map(|i| (i * 7 + i / 4096) as u8).collect();
    let pieces: Vec<&[u8]> = buf.chunks(piece_bytes).collect();
    let mut best = 0.0f64;
    for _ in 0..3 {
        let next = AtomicUsize::new(0);
        let start = Instant::now();
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| {
                    let mut acc = 0u64;
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(piece) = pieces.get(i) else { break };
                        // SAFETY: the segment is `piece`, a slice of `buf`, which outlives
                        // this scope and is never written while it runs.
                        acc ^= unsafe { checksum_segs(&[MemSeg::of(piece)]) };
                    }
                    std::hint::black_box(acc);
                });
            }
        });
        let secs = start.elapsed().as_secs_f64();
        best = best.max(total_bytes as f64 / secs.max(1e-9) / 1e9);
    }
    Ok(best)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_a_positive_rate_and_rejects_empty_work() {
        let gbps = checksum_gbps(4 << 20, 256 << 10, 2).expect("baseline");
        assert!(gbps > 0.0 && gbps.is_finite(), "{gbps}");
        // A last piece shorter than the others is hashed too.
        assert!(checksum_gbps(1000, 300, 3).expect("odd sizes") > 0.0);
        for (t, p, n) in [(0, 1, 1), (1, 0, 1), (1, 1, 0)] {
            let e = checksum_gbps(t, p, n).expect_err("empty work");
            assert!(e.to_string().contains("must be positive"), "{e}");
        }
    }
}
