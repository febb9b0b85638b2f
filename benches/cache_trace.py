"""``Cache|Posix`` on a Zipf-like block trace larger than the cache: hit rates
per tier and throughput, one row per fill policy and eviction policy.

Every block of the trace is first written to a Posix directory (so the
backend holds them all); then, for each pair of policies, a fresh ``Cache|Posix``
pipeline over that directory replays the same trace of block loads, and
``get_stats()`` gives the tier hit rates. Not run in CI::

    .venv/bin/python benches/cache_trace.py [--blocks 800] [--cache-frac 0.1]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python" / "tests"))

from support.store_helpers import SHARD, SHARDS, base_config

import ucm.store
from ucm.store import UcmKVStoreBase
from ucm.store.config import stage_schemas

EVICTION_POLICIES = next(
    k.choices for k in stage_schemas()["Cache"].keys if k.name == "eviction_policy"
)
#: The default (a block read straight into the caller is kept on its second
#: load) against keeping every load miss.
FILL_POLICIES = ("reuse_allocate", "read_allocate")


def bid(n: int) -> bytes:
    return n.to_bytes(8, "little") + b"\x42" * 8


def zipf_trace(blocks: int, length: int, alpha: float, seed: int) -> np.ndarray:
    ranks = np.arange(1, blocks + 1, dtype=np.float64)
    p = ranks**-alpha
    p /= p.sum()
    rng = np.random.default_rng(seed)
    perm = rng.permutation(blocks)  # popular blocks are not neighbours
    return perm[rng.choice(blocks, size=length, p=p)]


@dataclass(frozen=True)
class TraceRun:
    """What a replayed trace measured, from the store's own stats."""

    loads: int
    seconds: float
    l1_hit_rate: float
    l2_hit_rate: float
    p99_load_ms: float

    @property
    def blocks_per_s(self) -> float:
        return self.loads / self.seconds


def replay(
    store: UcmKVStoreBase, trace: np.ndarray, batch: int, load: Callable[[list[int]], None]
) -> TraceRun:
    """Loads the trace's blocks, ``batch`` block numbers per call of ``load``,
    then closes ``store`` and returns the timing and its hit rates."""
    start = time.perf_counter()
    for i in range(0, len(trace), batch):
        load([int(n) for n in trace[i : i + batch]])
    seconds = time.perf_counter() - start
    s = store.get_stats()
    store.close()
    return TraceRun(
        len(trace), seconds, s["l1_hit_rate"], s["l2_hit_rate"], s["p99_load_latency_ms"]
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=800, help="distinct blocks in the trace")
    ap.add_argument("--length", type=int, default=4000, help="block loads replayed")
    ap.add_argument("--cache-frac", type=float, default=0.1, help="cache size / distinct blocks")
    ap.add_argument("--alpha", type=float, default=0.9, help="Zipf exponent")
    ap.add_argument("--batch", type=int, default=8, help="blocks per load call")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        root = Path(tmp)
        data = [np.full(SHARD, i % 251, dtype=np.uint8) for i in range(SHARDS)]
        writer = ucm.store.open(base_config(root, tensor_size_list=[SHARD]))
        for start in range(0, args.blocks, 64):
            ids = [bid(n) for n in range(start, min(args.blocks, start + 64))]
            writer.wait(
                writer.dump(
                    [b for b in ids for _ in range(SHARDS)],
                    [s for _ in ids for s in range(SHARDS)],
                    [[d] for _ in ids for d in data],
                )
            )
        writer.close()

        trace = zipf_trace(args.blocks, args.length, args.alpha, seed=7)
        cache_gb = args.blocks * args.cache_frac * SHARDS * SHARD / (1 << 30)
        out = [np.empty(SHARD, dtype=np.uint8) for _ in range(SHARDS * args.batch)]
        print(
            f"Cache|Posix, {args.blocks} blocks of {SHARDS}x{SHARD >> 10} KiB, cache "
            f"{args.cache_frac:.0%} of them, Zipf a={args.alpha}, {args.length} loads\n"
        )
        print(
            f"{'fill':<15} {'policy':<8} {'l1 hit':>7} {'l2 hit':>7} {'blocks/s':>9} "
            f"{'MB/s':>8} {'p99 ms':>7}"
        )
        for fill, policy in ((f, p) for f in FILL_POLICIES for p in EVICTION_POLICIES):
            store = ucm.store.open(
                base_config(
                    root,
                    tensor_size_list=[SHARD],
                    store_pipeline="Cache|Posix",
                    cache_buffer_capacity_gb=cache_gb,
                    eviction_policy=policy,
                    fill_policy=fill,
                ),
            )

            def load(numbers: list[int], store: UcmKVStoreBase = store) -> None:
                ids = [bid(n) for n in numbers]
                k = len(ids) * SHARDS
                store.wait(
                    store.load(
                        [b for b in ids for _ in range(SHARDS)],
                        [s for _ in ids for s in range(SHARDS)],
                        [[o] for o in out[:k]],
                    )
                )

            run = replay(store, trace, args.batch, load)
            print(
                f"{fill:<15} {policy:<8} {run.l1_hit_rate:>7.3f} {run.l2_hit_rate:>7.3f} "
                f"{run.blocks_per_s:>9.0f} "
                f"{run.blocks_per_s * SHARDS * SHARD / 1e6:>8.0f} {run.p99_load_ms:>7.2f}"
            )


if __name__ == "__main__":
    main()
