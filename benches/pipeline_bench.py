"""The default pipeline against its own lower tier: ``Cache|Posix`` vs
``Posix`` alone, same blocks, same run.

Each measurement runs in a fresh process, as a fresh engine would: the
Cache tier's slot memory has never been touched there, so its first-touch
page faults are part of what is measured (their count is printed). The
block files are in the page cache for the loads ("from memory"), and the
caller's memory is touched beforehand, like a KV cache vLLM allocated at
start-up, and handed to the store as addresses inside it (``Regions``), as
the connector does. The store is opened ``--settle`` seconds (2) before
the timed call, as an engine opens it before loading its model. Each
measurement starts with no dirty page cache left by the one before
(``sync``). Printed, as GB/s medians and ratios:

* cold load (nothing in the Cache tier yet): ``Cache|Posix`` vs ``Posix``;
* the second load of the same blocks, which the default fill policy keeps
  in the Cache tier (filled after the load), vs ``Posix``'s cold load;
* a third load right after it, while those fills still run, vs the same;
* dump until persisted (``wait()`` then ``flush()``): ``Cache|Posix`` vs
  ``Posix``;
* dump until ``wait()`` returns and hot load (every block in the Cache
  tier): ``Cache|Posix`` vs the machine's memcpy of the same bytes;
* the minor page faults taken inside each timed call;
* a restarted engine whose host still holds its blocks: a process fills a
  shared ``/dev/shm`` Cache segment that outlives it (``share_buffer_keep``)
  and exits; fresh processes attach to it alone and load every block,
  against ``Posix`` reading the same blocks from the page cache: the speed
  side of keeping the default Cache tier private
  (``docs/user-guide/tiers-and-pipelines.md``, "Why the Cache tier is private
  by default").

    python benches/pipeline_bench.py [--dir DIR] [--mib 256] [--shard-kib 1024] [--rounds 3]
                                     [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import ucm.store
from ucm.store.memory import Regions


def make_store(
    root: Path, pipeline: str, shard: int, total: int, shared_id: str | None = None
) -> Any:
    cfg: dict[str, Any] = {
        "store_pipeline": pipeline,
        "storage_backends": str(root),
        "block_size": shard,
        "shard_size": shard,
        "tensor_size_list": [shard],
        "timeout_ms": 0,
    }
    if pipeline.startswith("Cache"):
        # The store's default size (4 GiB) unless every block would not fit
        # twice. A Cache tier only twice the size of the dump starts writing
        # back during it (more than a quarter of its slots dirty), which
        # takes a CPU from the copies; the default size does not. A shared
        # segment lives in /dev/shm: it gets what the blocks need.
        need = 2 * total / 2**30
        cfg["cache_buffer_capacity_gb"] = max(1.0, need) if shared_id else max(4.0, need)
    if shared_id:
        cfg.update(share_buffer_enable=True, share_buffer_keep=True, unique_id=shared_id)
    return ucm.store.open(cfg)


def ids_for(n: int) -> list[bytes]:
    return [b"pipebench" + i.to_bytes(7, "little") for i in range(n)]


def minflt() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def regions(buf: torch.Tensor, shard: int) -> Regions:
    """Shard ``i`` at byte ``i * shard`` of ``buf``, as addresses inside it:
    the form the vLLM connector hands the store (no tensor view per shard,
    whose Python objects would be timed with the store)."""
    n = buf.numel() // shard
    addrs = buf.data_ptr() + np.arange(n, dtype=np.uint64) * np.uint64(shard)
    return Regions([buf], addrs.reshape(n, 1))


def timed(fn: Any) -> tuple[float, int]:
    f0 = minflt()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0, minflt() - f0


def child(case: str, root: Path, total: int, shard: int, settle: float) -> dict[str, float]:
    """One measurement in this (fresh) process; prints nothing itself."""
    n = total // shard
    ids = ids_for(n)
    src = torch.from_numpy(np.random.default_rng(7).integers(0, 255, total, dtype=np.uint8))
    dst = torch.ones(total, dtype=torch.uint8)  # touched, like a KV cache
    out: dict[str, float] = {}
    if case == "memcpy":
        dst.copy_(src)  # both sides touched before timing
        secs = min(timed(lambda: dst.copy_(src))[0] for _ in range(5))
        out["gbps"] = total / secs / 1e9
        return out
    pipeline, _, op = case.partition(":")
    if pipeline == "shm":
        return shared_segment(op, root, total, shard, settle, ids, src, dst)
    store = make_store(root, pipeline, shard, total)
    # An engine opens its store seconds before the first request (model
    # load, KV cache allocation, warm-up); give both pipelines that time.
    time.sleep(settle)
    if op == "seed":
        store.wait(store.dump(ids, [0] * n, regions(src, shard)))
        store.flush()
    elif op == "dump":
        secs, faults = timed(lambda: store.wait(store.dump(ids, [0] * n, regions(src, shard))))
        persisted = secs + timed(store.flush)[0]
        out.update(wait_gbps=total / secs / 1e9, persisted_gbps=total / persisted / 1e9)
        out["faults"] = faults
    elif op == "load":

        def load_checked(what: str) -> tuple[float, int]:
            secs, faults = timed(lambda: store.wait(store.load(ids, [0] * n, regions(dst, shard))))
            if not torch.equal(src, dst):
                raise SystemExit(f"{what} bytes differ")
            return total / secs / 1e9, faults

        out["cold_gbps"], out["faults"] = load_checked("loaded")
        if pipeline.startswith("Cache"):
            # The default fill policy keeps a block read straight into the
            # caller on its second load; those fills run after the load, in
            # the background. Hot: every block then sits in the Cache tier.
            dst.zero_()
            out["second_gbps"], _ = load_checked("second-loaded")
            # Right away again, while those fills still run: a load must
            # not wait for them (it reads Posix instead while they last).
            dst.zero_()
            out["during_fill_gbps"], _ = load_checked("third-loaded")
            deadline = time.monotonic() + 60
            while store.get_stats()["fills_after_load"] < n:
                if time.monotonic() > deadline:
                    raise SystemExit("the fills after the second load did not finish in 60 s")
                time.sleep(0.05)
            dst.zero_()
            out["hot_gbps"], out["hot_faults"] = load_checked("hot-loaded")
    store.close()
    return out


def shared_segment(
    op: str,
    root: Path,
    total: int,
    shard: int,
    settle: float,
    ids: list[bytes],
    src: torch.Tensor,
    dst: torch.Tensor,
) -> dict[str, float]:
    """``fill``: fill a kept shared segment, then exit. ``load``: a fresh
    process attaches to it, alone, and loads every block twice."""
    n = len(ids)
    store = make_store(root, "Cache|Posix", shard, total, shared_id=segment_id(os.getppid()))
    out: dict[str, float] = {}
    if op == "fill":
        store.wait(store.dump(ids, [0] * n, regions(src, shard)))
        store.flush()
    else:
        time.sleep(settle)
        for key in ("first", "second"):
            dst.zero_()
            secs, faults = timed(lambda: store.wait(store.load(ids, [0] * n, regions(dst, shard))))
            if not torch.equal(src, dst):
                raise SystemExit(f"{key} load from the shared segment: bytes differ")
            out.update({f"{key}_gbps": total / secs / 1e9, f"{key}_faults": faults})
        if store.get_stats()["l1_hit_rate"] < 1.0:
            raise SystemExit("a load from the shared segment missed it")
    store.close()
    return out


def segment_id(bench_pid: int) -> str:
    """Every child of one bench run names the same segment."""
    return f"pipebench{bench_pid}"


def child_cmd(case: str, root: Path, args: argparse.Namespace) -> list[str]:
    return [
        sys.executable,
        __file__,
        "--child",
        case,
        "--dir",
        str(root),
        "--mib",
        str(args.mib),
        "--shard-kib",
        str(args.shard_kib),
        "--settle",
        str(args.settle),
    ]


def run_child(case: str, root: Path, args: argparse.Namespace) -> dict[str, float]:
    # Buffered writes of an earlier measurement still being flushed to the
    # disk would slow this one's writes (dirty-page throttling) and take CPU:
    # every measurement starts with none.
    os.sync()
    cmd = child_cmd(case, root, args)
    res = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def median(results: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in results)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--dir",
        type=lambda p: Path(p).absolute(),
        default=Path("target").absolute(),
        help="parent of the scratch dir",
    )
    ap.add_argument("--mib", type=int, default=256, help="MiB moved per measurement")
    ap.add_argument("--shard-kib", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--settle", type=float, default=2.0, help="seconds between open and timing")
    ap.add_argument("--json", type=Path, help="also write every measurement here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    total, shard = args.mib << 20, args.shard_kib << 10
    if args.child:
        print(json.dumps(child(args.child, args.dir, total, shard, args.settle)))
        return
    args.dir.mkdir(parents=True, exist_ok=True)
    res: dict[str, list[dict[str, float]]] = {}
    pipes = ("Posix", "Cache|Posix")
    for _ in range(args.rounds):
        res.setdefault("memcpy", []).append(run_child("memcpy", args.dir, args))
        for pipe in pipes:
            with tempfile.TemporaryDirectory(dir=args.dir) as d:
                res.setdefault(f"{pipe}:dump", []).append(run_child(f"{pipe}:dump", Path(d), args))
            with tempfile.TemporaryDirectory(dir=args.dir) as d:
                run_child("Posix:seed", Path(d), args)
                # A first read puts the files in the page cache for both.
                run_child("Posix:load", Path(d), args)
                res.setdefault(f"{pipe}:load", []).append(run_child(f"{pipe}:load", Path(d), args))
    restart(args, res)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    mem = median(res["memcpy"], "gbps")
    print(
        f"Cache|Posix vs Posix, {args.mib} MiB in {args.shard_kib} KiB blocks, "
        f"fresh process per measurement (GB/s, median of {args.rounds})"
    )
    print(f"  memcpy of the same bytes: {mem:6.2f}")
    print(f"  {'case':<30}{'Posix':>8}{'Cache|Posix':>13}{'ratio':>8}{'faults P / C|P':>18}")
    for label, op, key in (
        ("cold load (page cache)", "load", "cold_gbps"),
        ("dump until persisted", "dump", "persisted_gbps"),
        ("dump until wait()", "dump", "wait_gbps"),
    ):
        p, c = (median(res[f"{pipe}:{op}"], key) for pipe in pipes)
        fp, fc = (int(median(res[f"{pipe}:{op}"], "faults")) for pipe in pipes)
        print(f"  {label:<30}{p:8.2f}{c:13.2f}{c / p:8.2f}{fp:>9} / {fc}")
    wait = median(res["Cache|Posix:dump"], "wait_gbps")
    hot = median(res["Cache|Posix:load"], "hot_gbps")
    hot_faults = int(median(res["Cache|Posix:load"], "hot_faults"))
    second = median(res["Cache|Posix:load"], "second_gbps")
    cold_posix = median(res["Posix:load"], "cold_gbps")
    print(
        f"  Cache|Posix second load (kept, filled after it): {second:6.2f}"
        f"  x{second / cold_posix:4.2f} of Posix"
    )
    during = median(res["Cache|Posix:load"], "during_fill_gbps")
    print(
        f"  Cache|Posix third load, during those fills: {during:6.2f}"
        f"  x{during / cold_posix:4.2f} of Posix"
    )
    print(f"  Cache|Posix dump until wait(): {wait:6.2f}  x{wait / mem:4.2f} of memcpy")
    print(
        f"  Cache|Posix hot load:          {hot:6.2f}  x{hot / mem:4.2f} of memcpy"
        f" ({hot_faults} faults)"
    )
    print_restart(res)


def restart(args: argparse.Namespace, res: dict[str, list[dict[str, float]]]) -> None:
    """Fresh processes loading blocks a kept shared segment holds (its
    filler gone), and ``Posix`` loading the same blocks from the page cache,
    interleaved."""
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        root = Path(d)
        try:
            run_child("shm:fill", root, args)
            run_child("Posix:load", root, args)  # the blocks' files into the page cache
            for _ in range(args.rounds):
                res.setdefault("restart:posix", []).append(run_child("Posix:load", root, args))
                res.setdefault("restart:shm", []).append(run_child("shm:load", root, args))
        finally:
            Path(f"/dev/shm/ucm_cache_{segment_id(os.getpid())}").unlink(missing_ok=True)


def print_restart(res: dict[str, list[dict[str, float]]]) -> None:
    posix = median(res["restart:posix"], "cold_gbps")
    first, second = (median(res["restart:shm"], f"{k}_gbps") for k in ("first", "second"))
    faults = int(median(res["restart:shm"], "first_faults"))
    print("  restarted engine, blocks still on the host:")
    print(f"    Posix from the page cache:                 {posix:6.2f}")
    print(
        f"    kept /dev/shm segment, first load:         {first:6.2f}  x{first / posix:4.2f}"
        f" of Posix ({faults} faults)"
    )
    print(f"    kept /dev/shm segment, second load:        {second:6.2f}  x{second / posix:4.2f}")


if __name__ == "__main__":
    main()
