"""Block-hashing speed: a 32k-token prompt in 128-token blocks, per algorithm,
against the pure-Python md5+pickle chain of the original UCM.

Run after building: ``.venv/bin/python benches/hash_bench.py [--tokens N] [--block-size B]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import random
import time
from collections.abc import Callable

import numpy as np

from ucm import hashing

_REF = pathlib.Path(__file__).resolve().parents[1] / "python" / "tests" / "ucm_reference_hash.py"
_spec = importlib.util.spec_from_file_location("ucm_reference_hash", _REF)
assert _spec is not None and _spec.loader is not None
ref = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ref)


def best_of(fn: Callable[[], object], repeat: int) -> float:
    """Minimum wall time of ``repeat`` calls, in seconds."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=32 * 1024)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=30)
    args = ap.parse_args()

    rng = random.Random(0)
    tokens = [rng.randrange(152_064) for _ in range(args.tokens)]  # Qwen-sized vocabulary
    array = np.array(tokens, dtype=np.int64)
    meta = hashing.ucm_meta("Qwen/Qwen3-8B", 1, "torch.bfloat16", 0)
    bs = args.block_size

    expected = ref.reference_block_ids(tokens, bs, meta)
    assert hashing.block_ids(array, bs, meta, algo="md5_ucm") == expected
    t_ref = best_of(lambda: ref.reference_block_ids(tokens, bs, meta), args.repeat)
    print(f"{args.tokens} tokens, block_size {bs}, {len(expected)} blocks")
    print(f"{'python md5+pickle (reference)':34s} {t_ref * 1e3:8.3f} ms")
    for algo in hashing.HASH_ALGOS:
        for name, data in (("numpy int64", array), ("list", tokens)):
            t = best_of(lambda a=algo, d=data: hashing.block_ids(d, bs, meta, algo=a), args.repeat)
            label = f"{algo} ({name})"
            print(f"{label:34s} {t * 1e3:8.3f} ms   {t_ref / t:6.1f}x")


if __name__ == "__main__":
    main()
