//! Hit ratios of the cache's eviction policies on synthetic block traces
//! (the table in `store/cache/policy/mod.rs` comes from this run).
//!
//! Run: `cargo bench -p ucm-core --bench cache_eviction`. No timing, only
//! hit ratios, so the numbers are exactly reproducible.

use ucm_core::store::cache::policy::sim::{simulate, Trace};
use ucm_core::store::cache::PolicyKind;

fn main() {
    let traces = [
        (Trace::zipf(200_000, 0.8, 2_000_000, 1), vec![0.01, 0.10]),
        (Trace::zipf(200_000, 1.0, 2_000_000, 2), vec![0.01, 0.10]),
        (
            Trace::zipf_with_scans(200_000, 1.0, 0.5, 2_000_000, 3),
            vec![0.01, 0.10],
        ),
        (Trace::shared_prefixes(20_000, 2_000_000, 4), vec![0.05]),
    ];
    print!("{:<30} {:>5}", "trace", "cap");
    for k in PolicyKind::ALL {
        print!(" {:>8}", k.name());
    }
    println!();
    for (trace, caps) in &traces {
        for &cap in caps {
            let entries = ((trace.keys as f64) * cap) as usize;
            print!("{:<30} {:>4.0}%", trace.name, cap * 100.0);
            for k in PolicyKind::ALL {
                print!(" {:>8.4}", simulate(k, entries, trace));
            }
            println!();
        }
    }
}
