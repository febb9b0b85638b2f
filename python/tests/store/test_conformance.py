"""The public conformance suite (:mod:`ucm.testing.conformance`), run
against every store backend: the built-in Posix store (both I/O engines,
O_DIRECT on and off), the Empty store, the
Mooncake store (a real master and store service, see ``mooncake_server``),
a store written in Python registered through the factory, and the Cache
tier composed over each of them (``Cache|Posix``, ``Cache|Empty`` -- a
memory-only store -- ``Cache|Mooncake`` and ``Cache|TestDictStore``).

Capability differences are data (``keeps_data``), not skipped tests.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.store_helpers import SHARD, SHARDS, base_config

from ucm.store import UcmConnectorFactory, UcmKVStoreBase
from ucm.testing import conformance


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


@pytest.mark.parametrize("check", conformance.CHECKS, ids=lambda c: c.__name__)
def test_conformance(
    backend: tuple[Backend, UcmKVStoreBase],
    check: Callable[[UcmKVStoreBase, conformance.StoreTraits], None],
) -> None:
    b, store = backend
    check(store, conformance.StoreTraits(keeps_data=b.keeps_data, knows_layout=b.knows_layout))


def test_the_suite_moves_the_layout_the_test_configs_declare(tmp_path: Path) -> None:
    cfg = base_config(tmp_path)
    assert {k: cfg[k] for k in conformance.layout_config()} == conformance.layout_config()
    assert (SHARD, SHARDS) == (conformance.SHARD_SIZE, conformance.SHARDS)


def test_the_suite_fails_stores_that_break_their_promises(tmp_path: Path) -> None:
    """A store that keeps nothing checked as one that keeps data fails, and
    so does one that keeps data checked as one that keeps nothing."""
    empty = UcmConnectorFactory.create_connector("UcmPipelineStore", {"store_pipeline": "Empty"})
    posix = UcmConnectorFactory.create_connector("UcmPipelineStore", base_config(tmp_path))
    try:
        with pytest.raises(AssertionError):
            conformance.check_lookup_misses_then_hits(empty, conformance.StoreTraits())
        with pytest.raises(AssertionError, match="nothing was raised"):
            conformance.check_round_trip_tensors(posix, conformance.StoreTraits(keeps_data=False))
    finally:
        empty.close()
        posix.close()
