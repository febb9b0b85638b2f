"""The Posix store's index at scale: open, memory, lookups and tools.

For each size in ``--blocks`` (default 10^4, 10^5 and 10^6 blocks of 4 KiB)
a store is built once under ``--data`` (kept between runs: building 10^6
blocks takes a while) and measured, each figure in fresh processes:

* ``open``: from creating the store until its first lookup of 10,000
  present ids answers all of them, for a lookup-only store (what an
  engine's scheduler opens) and for a writing store with a capacity; warm
  (the directories in memory) and cold (the kernel's caches dropped first;
  needs root, else left out);
* ``index``: bytes of the index per block, as the store reports it, and
  the memory a lookup-only store adds in all once it has read every block
  directory (its resident memory against the process's before the open);
* ``lookup``: 10,000 present and 10,000 absent ids, median of 20 rounds,
  beside the ``Empty`` store's time for the same ids (the binding's floor);
* ``ucm store info`` and ``ucm store verify`` (wall time; verify's
  blocks/s);
* ``on disk``: bytes a block takes on disk for blocks of 4, 16 and 64 KiB
  in one and in four shards, against the bytes it holds;
* with ``--engine``, an engine's start (vLLM, a small random-weight model,
  ucm's connector) over the largest store against an empty one, alternated.

Each figure at 10^6 blocks is printed beside its target. 10^7 blocks is an
opt-in size (``--blocks 10000,100000,1000000,10000000``): its data set takes
some 82 GB of disk.

    python benches/index_bench.py [--blocks 10000,100000,1000000] [--data DIR]
                                  [--engine] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np

BLOCK = 4096
LOOKUP_IDS = 10_000
TARGETS = {
    "open_warm_s": 1.0,
    "open_cold_s": 3.0,
    "index_bytes_per_block": 64,
    "lookup_only_total_mib": 96,
    "lookup_present_ms": 0.3,
    "lookup_absent_ms": 1.0,
    "info_s": 2.0,
    "engine_start_extra_s": 2.0,
}


def store_config(root: Path, **extra: Any) -> dict[str, Any]:
    return {
        "store_pipeline": "Posix",
        "storage_backends": str(root),
        "block_size": BLOCK,
        "shard_size": BLOCK,
        "tensor_size_list": [BLOCK],
        **extra,
    }


def block_id(n: int) -> bytes:
    """Ids as uniform as a hash's, derived from ``n`` (any process can
    tell which ids a store of N blocks holds)."""
    x = (n * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & ((1 << 64) - 1)
    y = ((n ^ 0xD6E8FEB86659FD93) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    return x.to_bytes(8, "little") + y.to_bytes(8, "little")


def build(root: Path, n: int) -> None:
    """Makes a store of ``n`` blocks at ``root`` unless one is there."""
    done = root / "built"
    if done.exists() and done.read_text() == str(n):
        return
    import ucm.store

    root.mkdir(parents=True, exist_ok=True)
    # A batch of 10,000 files can outlast the default task timeout on a busy
    # machine; building the data set is not what is measured.
    store = ucm.store.open(store_config(root, posix_spare_files=0, timeout_ms=0))
    batch = 10_000
    rng = np.random.default_rng(n)
    started = time.perf_counter()
    for first in range(0, n, batch):
        count = min(batch, n - first)
        data = rng.integers(0, 256, size=(count, BLOCK), dtype=np.uint8)
        ids = [block_id(first + i) for i in range(count)]
        store.wait(store.dump(ids, [0] * count, [[row] for row in data]))
        done_n = first + count
        rate = done_n / (time.perf_counter() - started)
        print(f"  building {n} blocks: {done_n} ({rate:.0f}/s)", file=sys.stderr, end="\r")
    store.close()
    print(file=sys.stderr)
    done.write_text(str(n))


def drop_caches() -> bool:
    """Empties the kernel's page, dentry and inode caches (root only)."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


CHILD = textwrap.dedent(
    """
    import json, os, sys, time
    sys.path.insert(0, sys.argv[3])
    from index_bench import block_id, store_config
    import ucm.store

    root, n, what = sys.argv[1], int(sys.argv[2]), sys.argv[4]
    ids = [block_id(i * (n // 10_000 or 1) % n) for i in range(10_000)]

    def rss():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    extra = {"device_id": -1} if what == "lookup-only" else {"posix_capacity_gb": 1e6}
    before = rss()
    t0 = time.perf_counter()
    store = ucm.store.open(store_config(root, **extra))
    while not all(store.lookup(ids)):
        pass
    opened = time.perf_counter() - t0
    out = {"open_s": opened}
    if what == "lookup-only":
        while store.stats().get("indexed") != 1:
            time.sleep(0.01)
        out["indexed_s"] = time.perf_counter() - t0
        stats = store.stats()
        out["index_bytes"] = stats["index_bytes"]
        out["blocks"] = stats["blocks"]
        out["added_bytes"] = rss() - before
        absent = [os.urandom(16) for _ in range(10_000)]
        empty = ucm.store.open({"store_pipeline": "Empty"})

        def median_ms(s, xs):
            times = []
            for _ in range(20):
                t = time.perf_counter()
                s.lookup(xs)
                times.append(time.perf_counter() - t)
            return 1e3 * sorted(times)[len(times) // 2]

        out["lookup_present_ms"] = median_ms(store, ids)
        out["lookup_absent_ms"] = median_ms(store, absent)
        out["empty_ms"] = median_ms(empty, ids)
    print(json.dumps(out))
    """
)


def child(root: Path, n: int, what: str) -> dict[str, Any]:
    res = subprocess.run(
        [sys.executable, "-c", CHILD, str(root), str(n), str(Path(__file__).parent), what],
        capture_output=True,
        text=True,
        check=False,
    )
    if res.returncode != 0:
        raise RuntimeError(f"measuring {what} at {n} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def tool(root: Path, *args: str) -> float:
    t = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "ucm", "store", *args, "--dir", str(root)],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return time.perf_counter() - t


def on_disk(parent: Path) -> list[dict[str, Any]]:
    """Bytes one block takes on disk (what `du` counts) against its data."""
    import ucm.store

    rows = []
    for kib in (4, 16, 64):
        for shards in (1, 4):
            size = kib << 10
            if size % (shards * 4096):
                continue
            shard = size // shards
            with tempfile.TemporaryDirectory(dir=parent) as d:
                cfg = {
                    **store_config(Path(d), posix_spare_files=0),
                    "block_size": size,
                    "shard_size": shard,
                    "tensor_size_list": [shard],
                }
                store = ucm.store.open(cfg)
                data = np.ones((shards, shard), dtype=np.uint8)
                bid = block_id(1)
                store.wait(store.dump([bid] * shards, list(range(shards)), [[r] for r in data]))
                store.close()
                f = Path(d) / bid.hex()[:2] / bid.hex()
                used = f.stat().st_blocks * 512
                rows.append(
                    {"block_kib": kib, "shards": shards, "disk": used, "ratio": used / size}
                )
    return rows


def engine_start(data: Path, n: int, runs: int) -> tuple[float, float]:
    """Seconds an engine takes to start over the store of ``n`` blocks and
    over an empty one (medians, alternated)."""
    from ucm.vllm_demo.engine_process import EngineProcess
    from ucm.vllm_demo.tiny_model import make_tiny_llama

    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_llama(Path(tmp) / "model")
        empty = Path(tmp) / "empty"
        empty.mkdir()
        times: dict[str, list[float]] = {"full": [], "empty": []}
        for _ in range(runs):
            for which, root in (("empty", empty), ("full", data / str(n))):
                t = time.perf_counter()
                eng = EngineProcess(
                    {"model": str(model), "ucm": {"storage_backends": str(root)}},
                    Path(tmp) / f"engine-{which}.log",
                )
                times[which].append(time.perf_counter() - t)
                eng.close()
        return statistics.median(times["full"]), statistics.median(times["empty"])


def verdict(value: float, key: str) -> str:
    target = TARGETS[key]
    return f"(target <= {target:g}: {'met' if value <= target else 'MISSED'})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--blocks", default="10000,100000,1000000")
    ap.add_argument("--data", type=Path, default=Path.home() / ".cache/ucm/index-bench")
    ap.add_argument("--engine", action="store_true", help="also time an engine's start")
    ap.add_argument("--json", type=Path, help="write every figure here")
    args = ap.parse_args()
    sizes = [int(x) for x in args.blocks.split(",")]
    largest = max(sizes)
    results: dict[str, Any] = {"sizes": {}}
    for n in sizes:
        root = args.data / str(n)
        build(root, n)
        warm = child(root, n, "lookup-only")  # reads the directories into memory
        warm = child(root, n, "lookup-only")
        writer = child(root, n, "writer")
        cold = cold_writer = None
        if drop_caches():
            cold = child(root, n, "lookup-only")
            drop_caches()
            cold_writer = child(root, n, "writer")
        info_s = tool(root, "info")
        results["sizes"][n] = {
            "warm": warm,
            "writer_warm_open_s": writer["open_s"],
            "cold_open_s": cold and cold["open_s"],
            "writer_cold_open_s": cold_writer and cold_writer["open_s"],
            "info_s": info_s,
        }
    print(
        f"{'blocks':>9} {'open warm':>10} {'open cold':>10} {'writer':>8} {'indexed':>8} "
        f"{'B/block':>8} {'added MiB':>10} {'present':>9} {'absent':>8} {'floor':>7} {'info':>6}"
    )
    for n, r in results["sizes"].items():
        w = r["warm"]
        cold_s = "-" if r["cold_open_s"] is None else f"{r['cold_open_s']:.3f}"
        print(
            f"{n:>9} {w['open_s']:>9.3f}s {cold_s:>9}s {r['writer_warm_open_s']:>7.3f}s "
            f"{w['indexed_s']:>7.2f}s {w['index_bytes'] / n:>8.1f} "
            f"{w['added_bytes'] / (1 << 20):>10.1f} {w['lookup_present_ms']:>7.3f}ms "
            f"{w['lookup_absent_ms']:>6.3f}ms {w['empty_ms']:>5.3f}ms {r['info_s']:>5.2f}s"
        )
    top = results["sizes"][largest]
    w = top["warm"]
    print(f"\nat {largest} blocks:")
    print(
        f"  open until the first correct lookup, warm: {w['open_s']:.3f} s "
        f"{verdict(w['open_s'], 'open_warm_s')}"
    )
    if top["cold_open_s"] is not None:
        print(
            f"  open until the first correct lookup, cold: {top['cold_open_s']:.3f} s "
            f"{verdict(top['cold_open_s'], 'open_cold_s')}"
        )
    else:
        print("  cold open: left out (dropping the kernel's caches needs root)")
    per_block = w["index_bytes"] / largest
    print(f"  index: {per_block:.1f} B per block {verdict(per_block, 'index_bytes_per_block')}")
    added = w["added_bytes"] / (1 << 20)
    print(f"  a lookup-only store adds {added:.1f} MiB {verdict(added, 'lookup_only_total_mib')}")
    print(
        f"  lookup of {LOOKUP_IDS} present ids: {w['lookup_present_ms']:.3f} ms "
        f"{verdict(w['lookup_present_ms'], 'lookup_present_ms')} "
        f"(the Empty store's floor: {w['empty_ms']:.3f} ms)"
    )
    print(
        f"  lookup of {LOOKUP_IDS} absent ids: {w['lookup_absent_ms']:.3f} ms "
        f"{verdict(w['lookup_absent_ms'], 'lookup_absent_ms')}"
    )
    print(f"  ucm store info: {top['info_s']:.2f} s {verdict(top['info_s'], 'info_s')}")
    verify_s = tool(args.data / str(largest), "verify")
    results["verify_s"] = verify_s
    print(
        f"  ucm store verify: {verify_s:.1f} s, {largest / verify_s:.0f} blocks/s "
        f"on {os.cpu_count()} CPUs"
    )
    disk = on_disk(args.data)
    results["on_disk"] = disk
    print("  bytes on disk per block (one shard's header takes 4 KiB):")
    for row in disk:
        print(
            f"    {row['block_kib']:>3} KiB in {row['shards']} shard(s): {row['disk']:>7} B "
            f"= {row['ratio']:.2f} x its data"
        )
    if args.engine:
        full, empty = engine_start(args.data, largest, runs=2)
        results["engine_start"] = {"full_s": full, "empty_s": empty}
        extra = full - empty
        print(
            f"  engine start over {largest} blocks: {full:.1f} s against {empty:.1f} s over "
            f"an empty store: {extra:+.1f} s {verdict(extra, 'engine_start_extra_s')}"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
