"""A store round trip without an inference engine (``./tools/demo.sh``).

Creates a Posix store under a local directory, dumps a few hundred MiB of
KV-cache-shaped blocks through the Python API (torch tensors, one shard per
layer as the layer-wise connector does), loads them back, checks every byte
and prints the throughput.

    python -m ucm.demo [--dir DIR] [--mib 256] [--layers 32] [--io-direct]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

import ucm.store
from ucm.hashing import block_ids


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=Path(".ucm-demo/store"), help="store directory")
    ap.add_argument("--mib", type=int, default=256, help="MiB of KV data to move")
    ap.add_argument("--layers", type=int, default=32, help="shards per block (one per layer)")
    ap.add_argument("--layer-kib", type=int, default=64, help="KiB per layer of one block")
    ap.add_argument("--io-direct", action="store_true", help="use O_DIRECT")
    ap.add_argument("--io-engine", default="auto", choices=("auto", "uring", "psync"))
    ap.add_argument("--keep", action="store_true", help="keep the store directory afterwards")
    args = ap.parse_args(argv)

    shard = args.layer_kib * 1024
    block = shard * args.layers
    n_blocks = max(1, args.mib * (1 << 20) // block)
    args.dir.mkdir(parents=True, exist_ok=True)
    root = Path(
        tempfile.mkdtemp(prefix="run-", dir=args.dir)
    ).resolve()  # stores take absolute dirs
    store = ucm.store.open(
        {
            "store_pipeline": "Posix",
            "storage_backends": str(root),
            "block_size": block,
            "shard_size": shard,
            "tensor_size_list": [shard // 2, shard // 2],  # K and V of one layer
            "io_direct": args.io_direct,
            "io_engine": args.io_engine,
        },
    )
    tokens = torch.randint(0, 32000, (n_blocks * 128,), dtype=torch.int64)
    ids = block_ids(tokens, 128, "demo-model:1:float16:0")
    # One (blocks, layers, 2, shard/2) host buffer standing for the KV cache.
    kv = torch.randint(-128, 127, (n_blocks, args.layers, 2, shard // 2), dtype=torch.int8)
    out = torch.zeros_like(kv)

    def plan(buf: torch.Tensor) -> tuple[list[bytes], list[int], list[list[torch.Tensor]]]:
        ids_rep, idx, tensors = [], [], []
        for b in range(n_blocks):
            for layer in range(args.layers):
                ids_rep.append(ids[b])
                idx.append(layer)
                tensors.append([buf[b, layer, 0], buf[b, layer, 1]])
        return ids_rep, idx, tensors

    total = n_blocks * block
    print(
        f"store: {root}  blocks: {n_blocks} x {block >> 10} KiB ({args.layers} shards of "
        f"{shard >> 10} KiB)  total: {total / (1 << 20):.0f} MiB"
    )
    t0 = time.perf_counter()
    store.wait(store.dump(*plan(kv)))
    t_dump = time.perf_counter() - t0
    hit = store.lookup_on_prefix(ids) + 1
    t0 = time.perf_counter()
    store.wait(store.load(*plan(out)))
    t_load = time.perf_counter() - t0
    ok = torch.equal(kv, out)
    stats = store.stats()
    store.close()
    print(f"dump: {total / t_dump / 1e9:6.2f} GB/s  ({t_dump * 1e3:.0f} ms)")
    print(
        f"load: {total / t_load / 1e9:6.2f} GB/s  ({t_load * 1e3:.0f} ms)  "
        f"prefix hit: {hit}/{n_blocks}  verified: {ok}  engine: {stats.get('io_engine')}"
    )
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if ok and hit == n_blocks else 1


if __name__ == "__main__":
    raise SystemExit(main())
