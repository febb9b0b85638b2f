"""GPU transport check of the Cache store: correctness and host<->device GB/s.

Run on a machine with an NVIDIA GPU (not in CI)::

    python benches/transport_gpu.py [--shard-kib 256] [--blocks 256] [--device 0]

It builds a ``Cache|Empty`` pipeline with ``device_id`` set and
``device_memory: true``, so the cache itself moves bytes between its
page-locked slots and GPU memory with async copies on its own streams
(``cache_stream_number``). Dumps read GPU tensors after waiting on a CUDA
event recorded by the producer (``prerequisite_handle``); loads write other
GPU tensors, which must come back bit-identical. GB/s are compared with
torch's own copies between GPU memory and pinned host memory of the same
size. Exits non-zero on a mismatch.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shard-kib", type=int, default=256)
    ap.add_argument("--tensors", type=int, default=2, help="tensors per shard")
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--shards", type=int, default=4, help="shards per block")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--device", type=int, default=0)
    args = ap.parse_args()

    import torch

    import ucm.store

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 0
    dev = torch.device("cuda", args.device)
    torch.cuda.set_device(dev)
    shard = args.shard_kib << 10
    tsize = shard // args.tensors
    n = args.blocks * args.shards
    total = n * shard
    cfg = {
        "store_pipeline": "Cache|Empty",
        "block_size": shard * args.shards,
        "shard_size": shard,
        "tensor_size": tsize,
        "cache_buffer_capacity_gb": 2 * total / (1 << 30),
        "device_id": args.device,
        "device_memory": True,
        "cache_stream_number": args.streams,
        "write_back_policy": "lazy",
    }
    store = ucm.store.open(cfg)
    ids = [i.to_bytes(8, "little") + b"\x01" * 8 for i in range(args.blocks)]
    flat_ids = [b for b in ids for _ in range(args.shards)]
    flat_idx = [s for _ in ids for s in range(args.shards)]

    src = torch.randint(0, 255, (n, args.tensors, tsize), dtype=torch.uint8, device=dev)
    dst = torch.zeros_like(src)

    def addrs(t: torch.Tensor) -> np.ndarray:
        base = t.data_ptr()
        return np.array(
            [
                [base + (r * args.tensors + c) * tsize for c in range(args.tensors)]
                for r in range(n)
            ],
            dtype=np.uint64,
        )

    # Dump: the producer records an event after writing `src`; the cache's
    # streams wait on it before reading.
    src.add_(1)
    event = torch.cuda.Event()
    event.record()
    t0 = time.perf_counter()
    store.wait(
        store.dump_data(flat_ids, flat_idx, addrs(src), prerequisite_handle=event.cuda_event)
    )
    d2h = total / (time.perf_counter() - t0) / 1e9

    t0 = time.perf_counter()
    store.wait(store.load_data(flat_ids, flat_idx, addrs(dst)))
    h2d = total / (time.perf_counter() - t0) / 1e9
    torch.cuda.synchronize()
    ok = torch.equal(src, dst)

    # Baseline: torch copies between the GPU and pinned host memory.
    pinned = torch.empty(src.shape, dtype=torch.uint8, pin_memory=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    pinned.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    base_d2h = total / (time.perf_counter() - t0) / 1e9
    t0 = time.perf_counter()
    dst.copy_(pinned, non_blocking=True)
    torch.cuda.synchronize()
    base_h2d = total / (time.perf_counter() - t0) / 1e9

    stats = store.get_stats()
    store.close()
    print(f"{n} shards of {args.shard_kib} KiB ({args.tensors} tensors), {total / 1e6:.0f} MB")
    print(f"correct: {ok}")
    print(f"dump D2H {d2h:6.2f} GB/s  (torch pinned copy {base_d2h:6.2f} GB/s)")
    print(f"load H2D {h2d:6.2f} GB/s  (torch pinned copy {base_h2d:6.2f} GB/s)")
    print(f"l1_hit_rate {stats['l1_hit_rate']:.3f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
