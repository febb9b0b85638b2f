"""The ``Cache`` tier in pipelines: write-back policies, a failing Python
backend, fill-once, prefetch, statistics, concurrency, restart after flush,
and config validation naming the stage and key."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
from support.py_stores import DictStore
from support.store_helpers import SHARD, SHARDS, base_config, run_in_threads

from ucm.store import (
    BlockNotFoundError,
    InvalidParamError,
    NoSpaceError,
    TaskFailedError,
    UcmConnectorFactory,
    UcmKVStoreBase,
)


class RecordingStore(DictStore):
    """A Python backend that counts calls, can fail its writes and can be slow."""

    fail_dumps: ClassVar[bool] = False
    load_delay: ClassVar[float] = 0.0
    loaded_shards: ClassVar[int] = 0
    instances: ClassVar[list[RecordingStore]] = []

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        RecordingStore.instances.append(self)

    def dump_data(self, block_ids, shard_index, src_addr, prerequisite_handle: int = 0):
        if RecordingStore.fail_dumps:
            raise NoSpaceError("injected: backend is full")
        return super().dump_data(block_ids, shard_index, src_addr, prerequisite_handle)

    def load_data(self, block_ids, shard_index, dst_addr):
        RecordingStore.loaded_shards += len(block_ids)
        if RecordingStore.load_delay:
            time.sleep(RecordingStore.load_delay)
        return super().load_data(block_ids, shard_index, dst_addr)

    def has(self, bid: bytes) -> bool:
        return self.lookup([bid])[0]


@pytest.fixture(autouse=True)
def _recording_store() -> Iterator[None]:
    UcmConnectorFactory.register_connector("RecordingStore", __name__, "RecordingStore")
    RecordingStore.fail_dumps = False
    RecordingStore.load_delay = 0.0
    RecordingStore.loaded_shards = 0
    RecordingStore.instances = []
    yield
    UcmConnectorFactory.unregister_connector("RecordingStore")


def content(bid: bytes, shard: int) -> np.ndarray:
    seed = int.from_bytes(bid[:8], "little") * 31 + shard
    return np.random.default_rng(seed).integers(0, 256, size=SHARD, dtype=np.uint8)


def rows(arrs: list[np.ndarray]) -> list[list[np.ndarray]]:
    return [[a[: SHARD // 2], a[SHARD // 2 :]] for a in arrs]


def put(store: UcmKVStoreBase, bid: bytes) -> None:
    data = [content(bid, s) for s in range(SHARDS)]
    store.wait(store.dump([bid] * SHARDS, list(range(SHARDS)), rows(data)))


def get(store: UcmKVStoreBase, bid: bytes) -> None:
    out = [np.zeros(SHARD, dtype=np.uint8) for _ in range(SHARDS)]
    store.wait(store.load([bid] * SHARDS, list(range(SHARDS)), rows(out)))
    for s in range(SHARDS):
        assert np.array_equal(out[s], content(bid, s)), f"block {bid.hex()} shard {s}"


def wait_for_stat(store: UcmKVStoreBase, key: str, at_least: float) -> None:
    """Waits (20 s at most) for background work to bring a stat to a value."""
    deadline = time.monotonic() + 20
    while store.get_stats()[key] < at_least:
        assert time.monotonic() < deadline, store.get_stats()
        time.sleep(0.01)


def bid(n: int) -> bytes:
    return n.to_bytes(8, "little") + b"\xc3" * 8


def cache_cfg(root: Path, below: str = "Posix", **kw: Any) -> dict[str, Any]:
    cfg = base_config(
        root,
        store_pipeline=f"Cache|{below}",
        cache_buffer_capacity_gb=64 * SHARD / (1 << 30),  # 64 slots = 16 blocks
        write_back_interval=0.01,
    )
    if below != "Posix":
        del cfg["storage_backends"]
    cfg.update(kw)
    return cfg


@pytest.fixture
def open_store(tmp_path: Path) -> Iterator[Any]:
    made: list[UcmKVStoreBase] = []

    def make(below: str = "Posix", **kw: Any) -> UcmKVStoreBase:
        root = tmp_path / "store"
        root.mkdir(exist_ok=True)
        s = UcmConnectorFactory.create_connector("UcmPipelineStore", cache_cfg(root, below, **kw))
        made.append(s)
        return s

    yield make
    for s in made:
        try:
            s.close()
        except TaskFailedError:
            pass


def test_write_back_policies_over_a_python_backend(open_store) -> None:
    sync = open_store("RecordingStore", write_back_policy="sync")
    put(sync, bid(1))
    assert RecordingStore.instances[-1].has(bid(1)), "sync: backend has it when wait returns"

    lazy = open_store("RecordingStore", write_back_policy="lazy")
    backend = RecordingStore.instances[-1]
    put(lazy, bid(2))
    time.sleep(0.05)
    assert not backend.has(bid(2)), "lazy: nothing written before eviction or flush"
    assert lazy.get_stats()["dirty_blocks"] == 1
    lazy.flush()
    assert backend.has(bid(2))
    assert lazy.get_stats()["dirty_blocks"] == 0

    slow = open_store(
        "RecordingStore", write_back_policy="async", write_back_interval=60, write_back_batch_size=8
    )
    backend = RecordingStore.instances[-1]
    put(slow, bid(3))
    time.sleep(0.05)
    assert not backend.has(bid(3)), "async: batched, interval not reached"
    get(slow, bid(3))  # served from the cache meanwhile
    slow.close()  # closing flushes
    assert backend.has(bid(3))


def test_failing_backend_keeps_data_dirty_and_flush_reports(open_store) -> None:
    store = open_store("RecordingStore", write_back_max_backoff=0.05)
    backend = RecordingStore.instances[-1]
    RecordingStore.fail_dumps = True
    for n in range(3):
        put(store, bid(n))  # accepted by the cache (async)
    with pytest.raises(TaskFailedError, match=r"3 block\(s\).*stay dirty.*injected"):
        store.flush()
    stats = store.get_stats()
    assert stats["dirty_blocks"] == 3
    assert stats["write_back_failures"] >= 3
    for n in range(3):
        get(store, bid(n))  # nothing was lost
    RecordingStore.fail_dumps = False
    store.flush()
    assert all(backend.has(bid(n)) for n in range(3))
    assert store.get_stats()["dirty_blocks"] == 0


def test_two_loads_of_a_missing_block_fill_it_once(open_store) -> None:
    store = open_store("RecordingStore")
    backend = RecordingStore.instances[-1]
    data = [content(bid(9), s) for s in range(SHARDS)]
    backend.wait(backend.dump([bid(9)] * SHARDS, list(range(SHARDS)), rows(data)))
    RecordingStore.load_delay = 0.2
    run_in_threads(lambda _: get(store, bid(9)), 4)
    assert RecordingStore.loaded_shards == SHARDS


def test_stats_on_a_scripted_sequence(open_store) -> None:
    store = open_store("Empty", tensor_size_list=None, tensor_size=SHARD // 2)
    put(store, bid(1))
    put(store, bid(2))
    get(store, bid(1))
    get(store, bid(2))
    with pytest.raises(BlockNotFoundError):
        get(store, bid(3))
    store.flush()
    s = store.get_stats()
    assert s["load_shards"] == 3 * SHARDS
    assert s["l1_hits"] == 2 * SHARDS
    assert s["l1_hit_rate"] == pytest.approx(2 / 3)
    assert s["l2_hit_rate"] == 0.0
    assert s["l2_misses"] == SHARDS
    assert s["bytes_loaded_l1"] == 2 * SHARDS * SHARD
    assert s["bytes_dumped_l1"] == 2 * SHARDS * SHARD
    assert s["bytes_dumped_l2"] == 2 * SHARDS * SHARD
    assert s["eviction_count"] == 0
    assert s["dirty_blocks"] == 0
    assert s["write_back_failures"] == 0
    assert s["load_tasks"] == 3
    assert s["avg_load_latency_ms"] > 0
    assert s["p99_load_latency_ms"] >= s["avg_load_latency_ms"] / 2
    assert store.lookup([bid(1), bid(3)]) == [True, False]


def test_prefetch_and_restart_after_flush(tmp_path: Path, open_store) -> None:
    store = open_store("Posix", write_back_policy="lazy")
    for n in range(6):
        put(store, bid(n))
    store.flush()
    store.close()
    # A fresh pipeline over the same directory: the cache is empty, the
    # backend has everything. read_allocate: prefetches fill the tier.
    again = open_store("Posix", fill_policy="read_allocate")
    assert again.lookup([bid(n) for n in range(6)]) == [True] * 6
    assert again.get_stats()["lookup_l2_hits"] == 6
    again.prefetch([bid(n) for n in range(6)] + [bid(99)])
    wait_for_stat(again, "prefetch_shards", 6 * SHARDS)
    for n in range(6):
        get(again, bid(n))
    s = again.get_stats()
    assert s["l1_hit_rate"] == 1.0
    assert s["posix.blocks"] == 6


def test_the_default_keeps_a_restarted_stores_blocks_from_their_second_load(
    open_store,
) -> None:
    """reuse_allocate: a block read from the Posix files after a restart is
    neither prefetched into the tier nor kept on its first load, only on its
    second; the bytes are right every time."""
    store = open_store("Posix", write_back_policy="lazy")
    for n in range(4):
        put(store, bid(n))
    store.close()
    again = open_store("Posix")
    again.prefetch([bid(n) for n in range(4)])
    time.sleep(0.5)
    assert again.get_stats()["prefetch_shards"] == 0
    for n in range(4):
        get(again, bid(n))
    s = again.get_stats()
    assert s["first_loads_not_kept"] == 4 * SHARDS
    assert s["slots_used"] == 0
    for n in range(4):
        get(again, bid(n))
    wait_for_stat(again, "fills_after_load", 4 * SHARDS)
    for n in range(4):
        get(again, bid(n))
    s = again.get_stats()
    assert s["l1_hits"] == 4 * SHARDS
    assert s["first_loads_not_kept"] == 4 * SHARDS


def test_many_threads_overlapping_ids_under_eviction(open_store) -> None:
    store = open_store("Posix", cache_buffer_capacity_gb=24 * SHARD / (1 << 30))

    def worker(k: int) -> None:
        rng = np.random.default_rng(k)
        for _ in range(20):
            b = bid(int(rng.integers(0, 20)))
            if rng.random() < 0.4 or not store.lookup([b])[0]:
                put(store, b)
            get(store, b)

    run_in_threads(worker, 6)
    store.flush()
    assert store.get_stats()["slots_used"] <= 24


def test_config_errors_name_stage_and_key(tmp_path: Path) -> None:
    root = tmp_path / "s"
    root.mkdir()

    def make(**kw: Any) -> None:
        UcmConnectorFactory.create_connector("UcmPipelineStore", cache_cfg(root, **kw))

    with pytest.raises(InvalidParamError, match=r"stage Cache: fill_policy.*read_allocate"):
        make(fill_policy="sometimes")
    with pytest.raises(InvalidParamError, match=r"stage Cache: eviction_policy"):
        make(eviction_policy="arc")
    with pytest.raises(InvalidParamError, match=r"stage Cache: cache_buffer_capacity_gb"):
        make(cache_buffer_capacity_gb=1e-6)
    with pytest.raises(InvalidParamError, match=r"stage Cache: unique_id"):
        make(share_buffer_enable=True)
    with pytest.raises(InvalidParamError, match=r"stage Posix: storage_backends"):
        make(storage_backends=[])
    with pytest.raises(InvalidParamError, match="unknown config key 'cache_size'"):
        make(cache_size=3)
    with pytest.raises(InvalidParamError, match="only 'Cache' can"):
        make(store_pipeline="Posix|Cache")
    with pytest.raises(InvalidParamError, match="needs a stage below"):
        make(store_pipeline="Cache")
    with pytest.raises(InvalidParamError, match="unknown stage 'Nfs'"):
        make(store_pipeline="Cache|Nfs")
