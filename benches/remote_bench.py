"""The shared remote tiers on loopback, each beside a same-run baseline.

Starts its own servers (``python/tests/support/servers.py``,
``mooncake_server.py``) and prints:

* **S3** (``moto_server`` on 127.0.0.1): dump and load MB/s of whole blocks
  through the Python API, beside boto3 ``put_object``/``get_object`` of the
  same object bytes at the same concurrency; ``lookup_on_prefix`` latency
  for 1,000 present ids (cold: HEAD requests; warm: the lookup cache) beside
  boto3 ``head_object`` of the same keys; and the hit rates of ``Cache|S3``
  on the Zipf trace of ``cache_trace.py``.
* **NFS** (NFS-Ganesha in a private network namespace, the store's built-in
  NFSv3 client): dump and load MB/s beside libnfs ``nfs-cp`` uploading and
  downloading one file of the same total bytes, and lookup latency.
* **Mooncake** (``mooncake_master`` and a store service on one private host,
  the store on another, TCP over a veth pair): dump and load MB/s beside
  Mooncake's own client putting and getting the same object bytes in a
  loop from a registered buffer; lookup latency beside its ``get_size``
  loop; and the hit rates of ``Cache|Mooncake`` on the Zipf trace.

Not run in CI (needs the servers of tools/apt-packages.txt and moto)::

    .venv/bin/python benches/remote_bench.py [--blocks 64] [--shard-kib 256]
        [--only s3|nfs|mooncake]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python" / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from support.servers import MotoServer, NfsServer, find_binary

import ucm.store
from cache_trace import replay, zipf_trace
from ucm.store import UcmKVStoreBase

SHARDS = 4


def bid(n: int) -> bytes:
    return n.to_bytes(8, "little") + b"\x5e" * 8


def open_store(cfg: dict[str, Any]) -> UcmKVStoreBase:
    return ucm.store.open(cfg)


def transfer(store: UcmKVStoreBase, blocks: range, bufs: np.ndarray, dump: bool) -> float:
    """Seconds to dump or load ``blocks`` (whole blocks, all in one task)."""
    ids = [bid(n) for n in blocks for _ in range(SHARDS)]
    idx = [s for _ in blocks for s in range(SHARDS)]
    tensors = [[bufs[i % len(bufs), s]] for i, _ in enumerate(blocks) for s in range(SHARDS)]
    start = time.perf_counter()
    task = store.dump(ids, idx, tensors) if dump else store.load(ids, idx, tensors)
    store.wait(task)
    return time.perf_counter() - start


def layerwise_load(store: UcmKVStoreBase, blocks: range, bufs: np.ndarray) -> float:
    """Seconds to load ``blocks`` as a layer-wise engine does: one task per
    shard index (layer), the tasks in flight together."""
    start = time.perf_counter()
    tasks = [
        store.load(
            [bid(n) for n in blocks],
            [s] * len(blocks),
            [[bufs[i % len(bufs), s]] for i, _ in enumerate(blocks)],
        )
        for s in range(SHARDS)
    ]
    for t in tasks:
        store.wait(t)
    return time.perf_counter() - start


def lookup_ms(store: UcmKVStoreBase, ids: list[bytes], reps: int = 3) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        assert store.lookup_on_prefix(ids) == len(ids) - 1
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def seconds(fn: Callable[[], object]) -> float:
    """Wall-clock seconds of one call of ``fn``."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def round_trip(store: UcmKVStoreBase, blocks: int, shard: int) -> tuple[float, float]:
    """Seconds to dump blocks ``0..blocks`` of random bytes, then to load them."""
    bufs = np.random.default_rng(1).integers(0, 256, (8, SHARDS, shard), dtype=np.uint8)
    d = transfer(store, range(blocks), bufs, dump=True)
    return d, transfer(store, range(blocks), np.empty_like(bufs), dump=False)


def throughput_rows(total: int, rows: list[tuple[str, float, float]]) -> None:
    """One row per (what, our seconds, the baseline's seconds) moving ``total`` bytes."""
    for what, ours, base in rows:
        row(what, total / ours / 1e6, total / base / 1e6, "MB/s")


def row(what: str, ours: float, base: float, unit: str) -> None:
    ratio = ours / base if base else float("nan")
    print(
        f"  {what:<34} {ours:>9.1f} {unit:<5} baseline {base:>9.1f} {unit:<5} ratio {ratio:>5.2f}"
    )


def zipf_run(
    args: argparse.Namespace,
    shard: int,
    pipeline: str,
    opener: Callable[[dict[str, Any]], UcmKVStoreBase],
) -> None:
    """``pipeline`` (a Cache over a stage already holding blocks
    ``0..args.blocks``) on the Zipf trace of ``cache_trace.py``, the cache
    holding a tenth of the blocks: hit rates, blocks/s and p99."""
    trace = zipf_trace(args.blocks, args.blocks * 8, 0.9, seed=7)
    cache_gb = args.blocks * 0.1 * SHARDS * shard / (1 << 30)
    store = opener({"store_pipeline": pipeline, "cache_buffer_capacity_gb": max(cache_gb, 0.001)})
    one = np.empty((1, SHARDS, shard), dtype=np.uint8)
    run = replay(store, trace, 1, lambda n: transfer(store, range(n[0], n[0] + 1), one, False))
    print(
        f"  {pipeline}, Zipf a=0.9 over {args.blocks} blocks, cache 10% of them, "
        f"{run.loads} loads: l1 hit {run.l1_hit_rate:.3f}, l2 hit {run.l2_hit_rate:.3f}, "
        f"{run.blocks_per_s:.0f} blocks/s, p99 {run.p99_load_ms:.1f} ms"
    )


def bench_s3(args: argparse.Namespace, shard: int) -> None:
    server = MotoServer()
    try:
        bucket = server.create_bucket()
        cfg = {
            "store_pipeline": "S3",
            **server.store_keys(bucket, "bench"),
            "block_size": shard * SHARDS,
            "shard_size": shard,
            "s3_max_concurrency": args.concurrency,
            "timeout_ms": 120000,
        }
        store = open_store(cfg)
        total = args.blocks * SHARDS * shard
        d, ld = round_trip(store, args.blocks, shard)
        client = server.client()
        obj = bytes(SHARDS * (4096 + shard))  # the object size the store writes

        def put(n: int) -> None:
            client.put_object(Bucket=bucket, Key=f"base/{n}", Body=obj)

        def get(n: int) -> None:
            client.get_object(Bucket=bucket, Key=f"base/{n}")["Body"].read()

        with ThreadPoolExecutor(args.concurrency) as pool:
            bput = seconds(lambda: list(pool.map(put, range(args.blocks))))
            bget = seconds(lambda: list(pool.map(get, range(args.blocks))))
        print(
            f"S3 (moto_server on loopback), {args.blocks} blocks of {SHARDS} x {shard >> 10} KiB, "
            f"concurrency {args.concurrency}"
        )
        throughput_rows(total, [("dump (PUT)", d, bput), ("load (ranged GET)", ld, bget)])

        n_ids = 1000
        meta = np.zeros((1, SHARDS, 16), dtype=np.uint8)
        small = dict(
            cfg, block_size=16 * SHARDS, shard_size=16, storage_backends=f"s3://{bucket}/ids"
        )
        ids_store = open_store(small)
        for start_n in range(0, n_ids, 200):
            transfer(ids_store, range(start_n, start_n + 200), meta, dump=True)
        ids_store.close()
        cold_store = open_store(dict(small, s3_lookup_cache_ttl_ms=0))
        ids = [bid(n) for n in range(n_ids)]
        cold = lookup_ms(cold_store, ids)
        cold_store.close()
        warm_store = open_store(small)
        lookup_ms(warm_store, ids, reps=1)
        warm = lookup_ms(warm_store, ids)
        warm_store.close()
        keys = [f"ids/{b.hex()[:2]}/{b.hex()}" for b in ids]
        with ThreadPoolExecutor(args.concurrency) as pool:
            start = time.perf_counter()
            list(pool.map(lambda k: client.head_object(Bucket=bucket, Key=k), keys))
            bhead = (time.perf_counter() - start) * 1e3
        row(f"lookup_on_prefix {n_ids} ids, cold", cold, bhead, "ms")
        row(f"lookup_on_prefix {n_ids} ids, warm", warm, bhead, "ms")

        zipf_run(args, shard, "Cache|S3", lambda extra: open_store(dict(cfg, **extra)))
        store.close()
    finally:
        server.close()


def bench_nfs(args: argparse.Namespace, shard: int) -> None:
    server = NfsServer()
    try:
        cfg = {
            "store_pipeline": "NFS",
            "storage_backends": server.url("bench"),
            "block_size": shard * SHARDS,
            "shard_size": shard,
            "nfs_max_concurrency": args.concurrency,
            "timeout_ms": 120000,
        }
        with server.in_netns():
            store = open_store(cfg)
        total = args.blocks * SHARDS * shard
        d, ld = round_trip(store, args.blocks, shard)

        nfs_cp = find_binary("nfs-cp")
        bput = bget = float("nan")
        if nfs_cp:
            with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
                src = Path(tmp) / "blob"
                src.write_bytes(
                    np.random.default_rng(2).bytes(args.blocks * SHARDS * (4096 + shard))
                )
                url = f"{server.url()}/baseline.bin"

                def nfs_copy(src: str, dst: str) -> None:
                    subprocess.run(
                        server.nsenter([nfs_cp, src, dst]), check=True, capture_output=True
                    )

                bput = seconds(lambda: nfs_copy(str(src), url))
                bget = seconds(lambda: nfs_copy(url, str(Path(tmp) / "back")))
        print(
            f"NFS (Ganesha 4.3 VFS, NFSv3 over loopback), {args.blocks} blocks of "
            f"{SHARDS} x {shard >> 10} KiB, concurrency {args.concurrency}"
        )
        throughput_rows(total, [("dump (WRITE+COMMIT+RENAME)", d, bput), ("load (READ)", ld, bget)])
        ids = [bid(n) for n in range(args.blocks)]
        with server.in_netns():
            cold_store = open_store(dict(cfg, nfs_lookup_cache_ttl_ms=0))
        cold = lookup_ms(cold_store, ids)
        cold_store.close()
        lookup_ms(store, ids, reps=1)
        warm = lookup_ms(store, ids)
        print(f"  lookup_on_prefix {len(ids)} ids: cold {cold:.1f} ms, warm {warm:.2f} ms")
        store.close()
    finally:
        server.close()


def bench_mooncake(args: argparse.Namespace, shard: int) -> None:
    from support.mooncake_server import HOST_ADDRS, MooncakeCluster

    obj_len = SHARDS * (4096 + shard)  # the object size the store writes
    reps = 3  # rounds, ours and the baseline's interleaved; each side's best counts
    pool_mb = max(64, (2 * reps + 1) * args.blocks * obj_len >> 20)
    cluster = MooncakeCluster(pool_mb=pool_mb)
    try:
        # The engine's side on host 2, the pool's memory (the store service)
        # on host 1: every block crosses the veth pair, as between machines.
        cfg = {
            "store_pipeline": "Mooncake",
            **cluster.store_keys("bench"),
            "block_size": shard * SHARDS,
            "shard_size": shard,
            "timeout_ms": 120000,
        }
        with cluster.on_host(1):
            store = open_store(cfg)
        bufs = np.random.default_rng(1).integers(0, 256, (8, SHARDS, shard), dtype=np.uint8)
        out = np.empty_like(bufs)
        total = args.blocks * SHARDS * shard

        # Baseline: Mooncake's own client, a put_from / get_into loop of the
        # same object bytes from a registered buffer, on the same host.
        from mooncake.store import MooncakeDistributedStore

        raw = MooncakeDistributedStore()
        buf = np.random.default_rng(2).integers(0, 256, obj_len, dtype=np.uint8)
        with cluster.on_host(1):
            rc = raw.setup(
                HOST_ADDRS[1], "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", cluster.master_addr
            )
            assert rc == 0, rc
            raw.register_buffer(buf.ctypes.data, buf.nbytes)
        d = ld = bput = bget = float("inf")
        for r in range(reps):
            blocks = range(r * args.blocks, (r + 1) * args.blocks)
            d = min(d, transfer(store, blocks, bufs, dump=True))
            ld = min(ld, transfer(store, blocks, out, dump=False))

            def put(blocks: range = blocks) -> None:
                for n in blocks:
                    assert raw.put_from(f"base/{n}", buf.ctypes.data, obj_len) == 0

            def get(blocks: range = blocks) -> None:
                for n in blocks:
                    assert raw.get_into(f"base/{n}", buf.ctypes.data, obj_len) == obj_len

            with cluster.on_host(1):
                bput = min(bput, seconds(put))
                bget = min(bget, seconds(get))
        print(
            f"Mooncake (mooncake_master + a store service, TCP over a veth pair), "
            f"{args.blocks} blocks of {SHARDS} x {shard >> 10} KiB, best of {reps}: the stage "
            f"(batched calls) against the client's one-at-a-time loop"
        )
        throughput_rows(
            total, [("dump (batch_put_from)", d, bput), ("load (batch_get_into)", ld, bget)]
        )
        lw = min(layerwise_load(store, range(r * args.blocks, (r + 1) * args.blocks), out)
                 for r in range(reps))  # fmt: skip
        row("load, a task per shard (ranged)", total / lw / 1e6, total / bget / 1e6, "MB/s")

        ids = [bid(n) for n in range(args.blocks)]
        with cluster.on_host(1):
            cold_store = open_store(dict(cfg, mooncake_lookup_cache_ttl_ms=0))
        cold = lookup_ms(cold_store, ids)
        cold_store.close()
        lookup_ms(store, ids, reps=1)
        warm = lookup_ms(store, ids)
        keys = [f"bench/{b.hex()}" for b in ids]
        with cluster.on_host(1):
            start = time.perf_counter()
            for k in keys:
                raw.get_size(k)
            bsize = (time.perf_counter() - start) * 1e3
            raw.close()
        row(f"lookup_on_prefix {len(ids)} ids, cold", cold, bsize, "ms")
        row(f"lookup_on_prefix {len(ids)} ids, warm", warm, bsize, "ms")
        store.close()

        def cached(extra: dict[str, Any]) -> UcmKVStoreBase:
            with cluster.on_host(1):
                return open_store(dict(cfg, **extra))

        zipf_run(args, shard, "Cache|Mooncake", cached)
    finally:
        cluster.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--shard-kib", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--only", choices=["s3", "nfs", "mooncake"], default=None)
    args = ap.parse_args()
    shard = args.shard_kib << 10
    if args.only in (None, "s3"):
        bench_s3(args, shard)
    if args.only in (None, "nfs"):
        bench_nfs(args, shard)
    if args.only in (None, "mooncake"):
        bench_mooncake(args, shard)


if __name__ == "__main__":
    main()
