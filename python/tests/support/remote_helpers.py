"""Block geometry, ids, data and transfers shared by the S3 and NFS store
tests (kept out of ``conftest.py`` so test modules import them by name)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ucm.store import UcmKVStoreBase

SHARD = 32 * 1024
SHARDS = 4
CACHE_KEYS = {
    "cache_buffer_capacity_gb": 0.02,
    "write_back_interval": 0.01,
    "write_back_max_backoff": 0.2,
}


def remote_config(pipeline: str, location: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    """A config of the remote stage ``pipeline`` whose blocks are at
    ``location`` (its stage's keys), in the tests' geometry; overrides win,
    and a ``Cache|...`` pipeline among them gets the small cache of
    :data:`CACHE_KEYS`."""
    cfg: dict[str, Any] = {
        "store_pipeline": pipeline,
        **location,
        "block_size": SHARD * SHARDS,
        "shard_size": SHARD,
        "tensor_size_list": [SHARD // 2, SHARD // 2],
        "timeout_ms": 10000,
    }
    if "Cache" in overrides.get("store_pipeline", pipeline):
        cfg.update(CACHE_KEYS)
    cfg.update(overrides)
    return cfg


def bid(n: int) -> bytes:
    return n.to_bytes(8, "little") + b"\x3c" * 8


def block_data(n: int) -> np.ndarray:
    """Block ``n``'s bytes, shaped (SHARDS, 2, SHARD // 2)."""
    rng = np.random.default_rng(n)
    return rng.integers(0, 256, size=(SHARDS, 2, SHARD // 2), dtype=np.uint8)


def dump(store: UcmKVStoreBase, blocks: list[int], shards: range = range(SHARDS)) -> None:
    data = {n: block_data(n) for n in blocks}
    ids = [bid(n) for n in blocks for _ in shards]
    idx = [s for _ in blocks for s in shards]
    tensors = [[data[n][s, 0], data[n][s, 1]] for n in blocks for s in shards]
    store.wait(store.dump(ids, idx, tensors))


def load(store: UcmKVStoreBase, blocks: list[int]) -> dict[int, np.ndarray]:
    out = {n: np.zeros((SHARDS, 2, SHARD // 2), dtype=np.uint8) for n in blocks}
    ids = [bid(n) for n in blocks for _ in range(SHARDS)]
    idx = [s for _ in blocks for s in range(SHARDS)]
    tensors = [[out[n][s, 0], out[n][s, 1]] for n in blocks for s in range(SHARDS)]
    store.wait(store.load(ids, idx, tensors))
    return out
