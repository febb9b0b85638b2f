"""One conformance suite, run against every store backend: the built-in
Posix store (both I/O engines, O_DIRECT on and off), the Empty store, the
Mooncake store (a real master and store service, see ``mooncake_server``),
a store written in Python registered through the factory, and the Cache
tier composed over each of them (``Cache|Posix``, ``Cache|Empty`` -- a
memory-only store -- ``Cache|Mooncake`` and ``Cache|TestDictStore``).

Capability differences are data (``keeps_data``), not skipped tests.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from support.store_helpers import SHARD, SHARDS, base_config

from ucm.store import (
    BlockNotFoundError,
    InvalidParamError,
    UcmConnectorFactory,
    UcmKVStoreBase,
    UcmStoreError,
)


@dataclass
class Backend:
    name: str
    keeps_data: bool = True
    knows_layout: bool = True  # validates shard sizes against its config


BACKENDS = [
    Backend("posix-psync"),
    Backend("posix-uring"),
    Backend("posix-uring-direct"),
    Backend("posix-psync-direct"),
    Backend("empty", keeps_data=False, knows_layout=False),
    Backend("python-dict"),
    Backend("mooncake"),
    Backend("cache-posix"),
    Backend("cache-posix-sync"),
    Backend("cache-empty"),
    Backend("cache-python-dict"),
    Backend("cache-mooncake"),
]

CACHE_KEYS = {"cache_buffer_capacity_gb": 0.02, "write_back_interval": 0.01}


@pytest.fixture(scope="module", autouse=True)
def _register_python_store() -> Iterator[None]:
    UcmConnectorFactory.register_connector("TestDictStore", "support.py_stores", "DictStore")
    yield
    UcmConnectorFactory.unregister_connector("TestDictStore")


@pytest.fixture(params=BACKENDS, ids=lambda b: b.name)
def backend(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[Backend, UcmKVStoreBase]]:
    b: Backend = request.param
    root = tmp_path / "store"
    root.mkdir()
    if "mooncake" in b.name:
        cluster = request.getfixturevalue("mooncake")
        pipeline = "Cache|Mooncake" if b.name.startswith("cache") else "Mooncake"
        cfg = base_config(root, store_pipeline=pipeline, **cluster.store_keys(uuid.uuid4().hex))
        del cfg["storage_backends"]
        if b.name.startswith("cache"):
            cfg.update(CACHE_KEYS)
        with cluster.on_host(0):
            store = UcmConnectorFactory.create_connector("UcmPipelineStore", cfg)
    elif b.name.startswith("posix"):
        cfg = base_config(root, io_engine=b.name.split("-")[1], io_direct=b.name.endswith("direct"))
        store = UcmConnectorFactory.create_connector("UcmPipelineStore", cfg)
    elif b.name == "empty":
        store = UcmConnectorFactory.create_connector(
            "UcmPipelineStore", {"store_pipeline": "Empty"}
        )
    elif b.name.startswith("cache"):
        below = {"posix": "Posix", "empty": "Empty", "python": "TestDictStore"}[
            b.name.split("-")[1]
        ]
        cfg = base_config(root, store_pipeline=f"Cache|{below}", **CACHE_KEYS)
        if below != "Posix":
            del cfg["storage_backends"]
        if below == "Empty":
            del cfg["tensor_size_list"]
            cfg["tensor_size"] = SHARD // 2
        if b.name.endswith("sync"):
            cfg["write_back_policy"] = "sync"
        store = UcmConnectorFactory.create_connector("UcmPipelineStore", cfg)
    else:
        cfg = base_config(root)
        store = UcmConnectorFactory.create_connector("TestDictStore", cfg)
    yield b, store
    store.close()


def ids(n: int, salt: int = 0) -> list[bytes]:
    return [int(i + salt * 1_000_003).to_bytes(8, "little") + b"\x5a" * 8 for i in range(n)]


def shard_tensors(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    half = SHARD // 2 // 2  # float16 elements per half shard
    return [torch.randn(half, generator=g).half(), torch.randn(half, generator=g).half()]


def dump_blocks(store: UcmKVStoreBase, block_ids: list[bytes]) -> list[list[list[torch.Tensor]]]:
    data = [[shard_tensors(hash((b, s)) & 0xFFFF) for s in range(SHARDS)] for b in block_ids]
    flat_ids = [b for b in block_ids for _ in range(SHARDS)]
    flat_idx = [s for _ in block_ids for s in range(SHARDS)]
    flat_t = [t for blk in data for t in blk]
    store.wait(store.dump(flat_ids, flat_idx, flat_t))
    return data


def test_lookup_misses_then_hits(backend: tuple[Backend, UcmKVStoreBase]) -> None:
    b, store = backend
    blocks = ids(6)
    assert store.lookup(blocks) == [False] * 6
    assert store.lookup_on_prefix(blocks) == -1
    dump_blocks(store, [blocks[0], blocks[1], blocks[3]])
    expect = [True, True, False, True, False, False] if b.keeps_data else [False] * 6
    assert store.lookup(blocks) == expect
    assert store.lookup_on_prefix(blocks) == (1 if b.keeps_data else -1)
    assert store.lookup_on_prefix([]) == -1
    store.prefetch(blocks)  # a hint: never fails, even on misses


def test_round_trip_tensors(backend: tuple[Backend, UcmKVStoreBase]) -> None:
    b, store = backend
    blocks = ids(5, salt=1)
    data = dump_blocks(store, blocks)
    out = [[[torch.empty_like(t) for t in data[i][s]] for s in range(SHARDS)] for i in range(5)]
    task = store.load(
        [x for x in blocks for _ in range(SHARDS)],
        [s for _ in blocks for s in range(SHARDS)],
        [t for blk in out for t in blk],
    )
    if not b.keeps_data:
        with pytest.raises(BlockNotFoundError) as e:
            store.wait(task)
        assert e.value.code == -50005
        return
    store.wait(task)
    for i in range(5):
        for s in range(SHARDS):
            for a, c in zip(data[i][s], out[i][s], strict=True):
                assert torch.equal(a, c)


def test_round_trip_numpy_and_raw_addresses(backend: tuple[Backend, UcmKVStoreBase]) -> None:
    b, store = backend
    blocks = ids(3, salt=2)
    rng = np.random.default_rng(7)
    src = rng.integers(0, 255, size=(3, SHARDS, 2, SHARD // 2), dtype=np.uint8)
    flat_ids = [x for x in blocks for _ in range(SHARDS)]
    flat_idx = [s for _ in blocks for s in range(SHARDS)]
    addrs = np.array(
        [[src[i, s, k].ctypes.data for k in range(2)] for i in range(3) for s in range(SHARDS)],
        dtype=np.uint64,
    )
    store.wait(store.dump_data(flat_ids, flat_idx, addrs))
    dst = np.zeros_like(src)
    rows = [[dst[i, s, 0], dst[i, s, 1]] for i in range(3) for s in range(SHARDS)]
    task = store.load(flat_ids, flat_idx, rows)
    if not b.keeps_data:
        with pytest.raises(UcmStoreError):
            store.wait(task)
        return
    store.wait(task)
    assert np.array_equal(src, dst)
    # and back through load_data into raw addresses
    dst2 = np.zeros_like(src)
    addrs2 = np.array(
        [[dst2[i, s, k].ctypes.data for k in range(2)] for i in range(3) for s in range(SHARDS)],
        dtype=np.uint64,
    )
    store.wait(store.load_data(flat_ids, flat_idx, addrs2))
    assert np.array_equal(src, dst2)


def test_check_never_blocks_and_wait_consumes(backend: tuple[Backend, UcmKVStoreBase]) -> None:
    _, store = backend
    blocks = ids(2, salt=3)
    t = store.dump(
        [x for x in blocks for _ in range(SHARDS)],
        [s for _ in blocks for s in range(SHARDS)],
        [shard_tensors(i) for i in range(2 * SHARDS)],
    )
    assert isinstance(store.check(t), bool)
    store.wait(t)
    with pytest.raises(UcmStoreError):
        store.wait(t)


def test_bad_ids_are_rejected(backend: tuple[Backend, UcmKVStoreBase]) -> None:
    b, store = backend
    for bad in ([b"x" * 15], [b"x" * 17]):
        with pytest.raises(InvalidParamError, match="16 bytes"):
            store.lookup(bad)
        with pytest.raises(InvalidParamError):
            store.dump(bad, [0], [shard_tensors(0)])
    with pytest.raises(InvalidParamError):
        store.dump([b"x" * 16], [0, 1], [shard_tensors(0)])
    if b.knows_layout:
        with pytest.raises(InvalidParamError, match="shard_size"):
            store.dump([b"x" * 16], [0], [[torch.zeros(10)]])
