"""Posix store benchmarks from Python (the binding's overhead included).

Prints, in one run:

* dump/load GB/s through the Python API (torch tensors, and raw addresses via
  ``load_data``/``dump_data``) beside plain O_DIRECT pwrite/pread of the same
  bytes, I/O size and queue depth on the same directory, with the ratio;
* ``lookup`` and ``lookup_on_prefix`` latency for 1,000 and 10,000 present ids;
* hashing speed of a 32k-token prompt in 128-token blocks against the
  pure-Python md5+pickle reference.

With ``--pipeline``, instead: the default ``Cache|Posix`` pipeline against
``Posix`` alone and memcpy (``benches/pipeline_bench.py``, whose options
follow).

With ``--durability``, instead: dump GB/s (until ``wait()`` returns) with
``durability: data`` and ``full`` against ``none``, same blocks, same run.

    python benches/store_bench.py [--dir DIR] [--mib 128] [--engines psync,uring]
    python benches/store_bench.py --durability [--dir DIR] [--mib 128]
    python benches/store_bench.py --pipeline [pipeline_bench options]
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python" / "tests"))

from support import store_debug

import native_baselines
import ucm.store

QD = 4
PIPELINE_BENCH = Path(__file__).with_name("pipeline_bench.py")


def make_store(root: Path, shard: int, tensors: int, engine: str, direct: bool, **extra: object):
    return ucm.store.open(
        {
            "store_pipeline": "Posix",
            "storage_backends": str(root),
            "block_size": shard,
            "shard_size": shard,
            "tensor_size_list": [shard // tensors] * tensors,
            "io_engine": engine,
            "io_direct": direct,
            "io_threads": QD,
            "timeout_ms": 0,
            **extra,
        },
    )


def durability_cost(parent: Path, total: int) -> None:
    """Dump GB/s with each ``durability`` setting, 1 MiB blocks, fresh
    directories, the modes interleaved over 3 rounds (medians)."""
    shard = 1 << 20
    n = total // shard
    src = aligned(total)
    src.copy_(torch.from_numpy(np.random.default_rng(0).integers(0, 255, total, dtype=np.uint8)))
    rows = [[src[i * shard : (i + 1) * shard]] for i in range(n)]
    modes = ("none", "data", "full")
    speeds: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(3):
        for mode in modes:
            with tempfile.TemporaryDirectory(dir=parent) as d:
                store = make_store(Path(d), shard, 1, "psync", False, durability=mode)
                t0 = time.perf_counter()
                store.wait(store.dump(ids_for(r + 1, n), [0] * n, rows))
                speeds[mode].append(total / (time.perf_counter() - t0) / 1e9)
                store.close()
    base = statistics.median(speeds["none"])
    print(f"dump until wait() returns, {total >> 20} MiB in 1 MiB blocks (GB/s, median of 3)")
    for mode in modes:
        got = statistics.median(speeds[mode])
        print(f"  durability: {mode:<5} {got:7.2f}   x{got / base:5.2f} of none")


def aligned(nbytes: int) -> torch.Tensor:
    raw = np.zeros(nbytes + 4096, dtype=np.uint8)
    off = (-raw.ctypes.data) % 4096
    return torch.from_numpy(raw[off : off + nbytes])


def ids_for(round_: int, n: int) -> list[bytes]:
    return [round_.to_bytes(8, "little") + i.to_bytes(8, "little") for i in range(n)]


def throughput(root: Path, total: int, shard: int, tensors: int, engine: str, direct: bool):
    n = total // shard
    store = make_store(root, shard, tensors, engine, direct)
    # Page-aligned host memory standing for a KV cache: O_DIRECT then reads
    # and writes it in place (unaligned memory is bounced through aligned
    # buffers, which costs a memcpy).
    src = aligned(total)
    src.copy_(torch.from_numpy(np.random.default_rng(0).integers(0, 255, total, dtype=np.uint8)))
    dst = aligned(total)
    t_size = shard // tensors

    def rows(buf: torch.Tensor) -> list[list[torch.Tensor]]:
        return [
            [buf[i * shard + k * t_size : i * shard + (k + 1) * t_size] for k in range(tensors)]
            for i in range(n)
        ]

    dumps, loads, loads_raw = [], [], []
    for r in range(3):
        ids = ids_for(r + 1, n)
        t0 = time.perf_counter()
        store.wait(store.dump(ids, [0] * n, rows(src)))
        dumps.append(total / (time.perf_counter() - t0) / 1e9)
        if r < 2:
            for i in ids:  # keep the disk footprint small; the last round stays for loads
                path = store_debug.block_path(store, i)
                if path:
                    Path(path).unlink(missing_ok=True)
    ids = ids_for(3, n)
    base = dst.data_ptr()
    addrs = np.array(
        [[base + i * shard + k * t_size for k in range(tensors)] for i in range(n)],
        dtype=np.uint64,
    )
    for _ in range(3):
        t0 = time.perf_counter()
        store.wait(store.load(ids, [0] * n, rows(dst)))
        loads.append(total / (time.perf_counter() - t0) / 1e9)
        t0 = time.perf_counter()
        store.wait(store.load_data(ids, [0] * n, addrs))
        loads_raw.append(total / (time.perf_counter() - t0) / 1e9)
    assert torch.equal(src, dst), "loaded bytes differ"
    store.close()
    bw = statistics.median(
        native_baselines.direct_io_gbps(root, "write", total, shard, QD) for _ in range(3)
    )
    br = statistics.median(
        native_baselines.direct_io_gbps(root, "read", total, shard, QD) for _ in range(3)
    )
    return (
        statistics.median(dumps),
        bw,
        statistics.median(loads),
        statistics.median(loads_raw),
        br,
    )


def lookups(root: Path) -> None:
    store = make_store(root, 4096, 1, "psync", False)
    data = torch.zeros(4096, dtype=torch.uint8)
    print("\nlookup latency (present ids, in-memory index, median of 100)")
    for n in (1_000, 10_000):
        # Ids as the connector makes them, uniform hashes: counter ids would
        # sit in neighbouring slots of the index and measure that locality.
        ids = [hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest() for i in range(n)]
        for k in range(0, n, 1000):
            chunk = ids[k : k + 1000]
            store.wait(store.dump(chunk, [0] * len(chunk), [[data]] * len(chunk)))
        for name, fn, expect in (
            ("lookup", store.lookup, [True] * n),
            ("lookup_on_prefix", store.lookup_on_prefix, n - 1),
        ):
            assert fn(ids) == expect
            times = []
            for _ in range(100):
                t0 = time.perf_counter()
                fn(ids)
                times.append(time.perf_counter() - t0)
            print(f"  {name:<17} {n:>6} ids: {statistics.median(times) * 1e3:7.3f} ms")
    store.close()


def main() -> None:
    if "--pipeline" in sys.argv[1:]:
        # One entry point for the storage figures; the pipeline comparison
        # lives in its own script because it measures in fresh processes.
        import runpy

        sys.argv = [str(PIPELINE_BENCH)] + [a for a in sys.argv[1:] if a != "--pipeline"]
        runpy.run_path(str(PIPELINE_BENCH), run_name="__main__")
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--dir",
        type=lambda p: Path(p).absolute(),
        default=Path("target").absolute(),
        help="parent of the scratch dir",
    )
    ap.add_argument("--mib", type=int, default=128, help="MiB moved per measurement")
    ap.add_argument("--engines", default="psync,uring")
    ap.add_argument("--durability", action="store_true", help="the cost of data/full syncs")
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    total = args.mib << 20
    if args.durability:
        durability_cost(args.dir, total)
        return
    native_baselines.require()
    print(f"Python API vs plain O_DIRECT pread/pwrite, {args.mib} MiB, queue depth {QD} (GB/s)")
    print(
        f"{'case':<26}{'dump':>7}{'base_w':>8}{'ratio':>7}"
        f"{'load':>8}{'load_raw':>9}{'base_r':>8}{'ratio':>7}"
    )
    for engine in args.engines.split(","):
        for direct in (True, False):
            for shard, tensors in (
                (64 << 10, 1),
                (256 << 10, 1),
                (1 << 20, 1),
                (4 << 20, 1),
                (1 << 20, 32),
            ):
                with tempfile.TemporaryDirectory(dir=args.dir) as d:
                    dump, bw, load, load_raw, br = throughput(
                        Path(d), total, shard, tensors, engine, direct
                    )
                case = f"{engine}/{'direct' if direct else 'buffered'}/{shard >> 10}KiB" + (
                    f"x{tensors}t" if tensors > 1 else ""
                )
                print(
                    f"{case:<26}{dump:7.2f}{bw:8.2f}{dump / bw:6.0%} "
                    f"{load:7.2f}{load_raw:9.2f}{br:8.2f}{load / br:6.0%}"
                )
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        lookups(Path(d))
    print()
    import runpy

    runpy.run_path(str(Path(__file__).with_name("hash_bench.py")), run_name="__main__")


if __name__ == "__main__":
    main()
