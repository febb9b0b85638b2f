"""The Mooncake store (pipeline stages ``Mooncake`` / ``MooncakeStore`` and
``Cache|Mooncake``) against a real Mooncake cluster: ``mooncake_master`` and
a store service lending the pool its memory, on two private "hosts" (see
``mooncake_server.py``).

Covers round trips and layer-wise dumps, two hosts sharing one pool, a
master killed mid-run and restarted (loads of what it lost fail so the
engine recomputes, serving goes on, and the stage recovers), a full pool,
corrupt and foreign values (load errors, never wrong bytes), a dead master
at start-up (a clear error within ``timeout_ms``) and config validation.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.dry_run import dry_run_argv
from support.mooncake_server import HOST_ADDRS, MooncakeCluster
from support.remote_helpers import SHARD, SHARDS, bid, block_data, dump, load, remote_config
from support.remote_scenarios import ride_out_an_outage, round_trip

from ucm.shared.config import ConfigError
from ucm.store import (
    BlockNotFoundError,
    CorruptBlockError,
    InvalidParamError,
    NoSpaceError,
    PipelineStoreConfig,
    StoreTimeoutError,
    UcmConnectorFactory,
    UcmKVStoreBase,
    UcmStoreError,
)

BLOCK_LEN = SHARDS * (4096 + SHARD)  # a block object: a header and data per shard


def mc_config(cluster: MooncakeCluster, **overrides: Any) -> dict[str, Any]:
    location = {
        **cluster.store_keys(uuid.uuid4().hex[:12]),
        "mooncake_negative_cache_ttl_ms": 0,
    }
    return remote_config("Mooncake", location, **overrides)


def open_store(cluster: MooncakeCluster, cfg: dict[str, Any], host: int = 0) -> UcmKVStoreBase:
    with cluster.on_host(host):
        return UcmConnectorFactory.create_connector("UcmPipelineStore", cfg)


class RawClient:
    """Mooncake's own client on host 0, lending no memory. Its calls run
    on the calling thread, so each joins host 0 for the call."""

    def __init__(self, cluster: MooncakeCluster) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.cluster = cluster
        self.client = MooncakeDistributedStore()
        rc = self.call(
            "setup", HOST_ADDRS[0], "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", cluster.master_addr
        )
        assert rc == 0

    def call(self, method: str, *args: Any) -> Any:
        with self.cluster.on_host(0):
            return getattr(self.client, method)(*args)

    def size(self, key: str) -> int:
        return int(self.call("get_size", key))

    def put(self, key: str, value: np.ndarray) -> int:
        return int(self.call("put_from", key, value.ctypes.data, value.nbytes))

    def get(self, key: str, into: np.ndarray) -> int:
        return int(self.call("get_into", key, into.ctypes.data, into.nbytes))

    def remove(self, key: str) -> int:
        return int(self.call("remove", key, True))

    def close(self) -> None:
        self.call("close")


def key_of(cfg: dict[str, Any], n: int) -> str:
    return f"{cfg['mooncake_key_prefix']}/{bid(n).hex()}"


@pytest.mark.parametrize("pipeline", ["Mooncake", "MooncakeStore", "Cache|Mooncake"])
def test_round_trip_lookup_and_layer_wise(mooncake: MooncakeCluster, pipeline: str) -> None:
    cfg = mc_config(mooncake, store_pipeline=pipeline)
    store = open_store(mooncake, cfg)
    raw = RawClient(mooncake)
    try:
        round_trip(store)
        assert raw.size(key_of(cfg, 1)) == BLOCK_LEN
        # layer-wise: one task per shard, out of order; the object appears whole
        for s in (3, 0, 2):
            dump(store, [7], range(s, s + 1))
        store.flush()
        assert raw.size(key_of(cfg, 7)) < 0
        dump(store, [7], range(1, 2))
        store.flush()
        assert raw.size(key_of(cfg, 7)) == BLOCK_LEN
        assert np.array_equal(load(store, [7])[7], block_data(7))
        # one shard alone (a layer-wise load): a ranged read of that shard
        out = np.zeros((2, SHARD // 2), dtype=np.uint8)
        store.wait(store.load([bid(7)], [2], [[out[0], out[1]]]))
        assert np.array_equal(out, block_data(7)[2])
        with pytest.raises(UcmStoreError):
            load(store, [99])
        stats = store.get_stats()
        assert any(k.endswith("put_requests") and v > 0 for k, v in stats.items()), stats
    finally:
        store.close()
        raw.close()


READER = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    sys.path.insert(0, sys.argv[2])
    from support.remote_helpers import block_data, bid, dump, load
    from ucm.store import UcmConnectorFactory
    cfg = json.loads(sys.argv[1])
    store = UcmConnectorFactory.create_connector("UcmPipelineStore", cfg)
    assert store.lookup_on_prefix([bid(11), bid(12), bid(13), bid(14)]) == 2
    got = load(store, [11, 12, 13])
    assert all(np.array_equal(got[n], block_data(n)) for n in (11, 12, 13))
    dump(store, [21])
    store.close()  # flushes the cache
    print("ok")
    """
)


def test_two_hosts_share_one_pool(mooncake: MooncakeCluster) -> None:
    """Blocks one host dumps through ``Cache|Mooncake`` are hit and loaded,
    unchanged, by a process on the other host, and the other way round."""
    cfg = mc_config(mooncake, store_pipeline="Cache|Mooncake")
    writer = open_store(mooncake, cfg, host=0)
    try:
        dump(writer, [11, 12, 13])
        writer.flush()
        tests = str(Path(__file__).parents[1])  # for ``support``
        out = subprocess.run(
            mooncake.nsenter(1, [sys.executable, "-c", READER, json.dumps(cfg), tests]),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]
        assert np.array_equal(load(writer, [21])[21], block_data(21))
    finally:
        writer.close()


@pytest.fixture
def restartable(mooncake: MooncakeCluster) -> Iterator[MooncakeCluster]:
    """The session's cluster, for a test that kills its master: a master
    runs again afterwards. (One cluster per process: Mooncake's client keeps
    process-wide threads, which stay in the namespace of the first cluster
    a client joined.)"""
    yield mooncake
    if mooncake.master is None:
        mooncake.start_master()


def test_master_killed_and_restarted_under_a_cache(restartable: MooncakeCluster) -> None:
    """The master dies mid-run: loads of what only the pool had fail (the
    engine recomputes), dumps don't crash, cached blocks are still served,
    and once a master is back the dirty blocks reach the new pool. What the
    old master knew is gone: those blocks read as misses, never as wrong
    bytes."""
    cfg = mc_config(restartable, store_pipeline="Cache|Mooncake")
    store = open_store(restartable, cfg)
    try:
        ride_out_an_outage(store, restartable.stop_master, restartable.start_master)
        assert np.array_equal(load(store, [3])[3], block_data(3))
        assert store.get_stats()["backend.breaker_trips"] >= 1
    finally:
        store.close()
    # a plain Mooncake store sees the new pool: 2 and 3 (written back after
    # the restart) are there, 1 (written before it) is not
    fresh = open_store(
        restartable, mc_config(restartable, mooncake_key_prefix=cfg["mooncake_key_prefix"])
    )
    try:
        assert fresh.lookup([bid(1), bid(2), bid(3)]) == [False, True, True]
        with pytest.raises(BlockNotFoundError):
            load(fresh, [1])
        assert np.array_equal(load(fresh, [2])[2], block_data(2))
    finally:
        fresh.close()


def test_a_full_pool_fails_dumps_and_serving_goes_on(mooncake: MooncakeCluster) -> None:
    """A pool with no room: the dump fails with ``NoSpaceError`` naming the
    pool, counted in ``pool_full``; what is stored is still served; dumps
    succeed again once the master evicted, and the evicted blocks are
    misses."""
    big = mooncake.pool_mb << 15  # 2 MiB shards: 8 MiB blocks in a 64 MiB pool
    cfg = mc_config(
        mooncake, block_size=4 * big, shard_size=big, tensor_size_list=[big // 2, big // 2]
    )
    store = open_store(mooncake, cfg)
    rng = np.random.default_rng(1)
    blocks = {n: rng.integers(0, 256, size=(4, 2, big // 2), dtype=np.uint8) for n in range(12)}

    def put(n: int) -> None:
        t = [[blocks[n][s, 0], blocks[n][s, 1]] for s in range(4)]
        store.wait(store.dump([bid(n)] * 4, list(range(4)), t))

    try:
        stored, full = [], None
        for n in range(12):
            try:
                put(n)
                stored.append(n)
            except NoSpaceError as e:
                full = e
                break
        assert full is not None and "pool is full" in str(full), stored
        assert store.get_stats()["pool_full"] >= 1
        out = np.zeros((4, 2, big // 2), dtype=np.uint8)
        t = [[out[s, 0], out[s, 1]] for s in range(4)]
        store.wait(store.load([bid(stored[-1])] * 4, list(range(4)), t))
        assert np.array_equal(out, blocks[stored[-1]])
        # Three more blocks: 24 MiB the full pool can only find by evicting
        # stored blocks (what else it holds is under 1 MiB).
        for n in (9, 10, 11):
            deadline = time.monotonic() + 20
            while True:  # the master evicts at its high watermark
                try:
                    put(n)
                    break
                except NoSpaceError:
                    assert time.monotonic() < deadline, "the pool never made room"
                    time.sleep(0.5)
        # An evicted block is a miss (the engine recomputes it), never wrong
        # bytes; the rest still load.
        evicted = 0
        for n in stored:
            out = np.zeros((4, 2, big // 2), dtype=np.uint8)
            t = [[out[s, 0], out[s, 1]] for s in range(4)]
            try:
                store.wait(store.load([bid(n)] * 4, list(range(4)), t))
                assert np.array_equal(out, blocks[n])
            except BlockNotFoundError:
                evicted += 1
        assert evicted >= 1
    finally:
        store.close()
        raw = RawClient(mooncake)  # make room for the tests after this one
        for n in blocks:
            raw.remove(key_of(cfg, n))
        raw.close()


def test_concurrent_loads_of_one_block(mooncake: MooncakeCluster) -> None:
    """Many loads of the same blocks in flight at once (engines sharing a
    prefix): each gets the right bytes. Requests that wait go to Mooncake
    together, and its batch calls must never name a key twice (it would
    fill one buffer and report success for both)."""
    store = open_store(mooncake, mc_config(mooncake))
    try:
        dump(store, [1, 2])
        outs, tasks = [], []
        for _ in range(8):
            out = {n: np.zeros((SHARDS, 2, SHARD // 2), dtype=np.uint8) for n in (1, 2)}
            ids = [bid(n) for n in (1, 2) for _ in range(SHARDS)]
            idx = [s for _ in (1, 2) for s in range(SHARDS)]
            t = [[out[n][s, 0], out[n][s, 1]] for n in (1, 2) for s in range(SHARDS)]
            tasks.append(store.load(ids, idx, t))
            outs.append(out)
        for task in tasks:
            store.wait(task)
        for out in outs:
            assert np.array_equal(out[1], block_data(1))
            assert np.array_equal(out[2], block_data(2))
        assert store.get_stats()["corrupt_loads"] == 0
    finally:
        store.close()


def test_corrupt_and_foreign_values_are_load_errors(mooncake: MooncakeCluster) -> None:
    """Values that are not this deployment's blocks: a corrupt one of the
    right size fails its load (and is removed), one of another size is not
    a hit; no wrong byte reaches the caller."""
    cfg = mc_config(mooncake, mooncake_lookup_cache_ttl_ms=0)
    store = open_store(mooncake, cfg)
    raw = RawClient(mooncake)
    try:
        garbage = np.random.default_rng(3).integers(0, 256, size=BLOCK_LEN, dtype=np.uint8)
        short = garbage[: BLOCK_LEN // 2].copy()
        for n, value in ((1, garbage), (2, short)):
            assert raw.put(key_of(cfg, n), value) == 0
        # a real block, one bit flipped in shard 2's data
        dump(store, [3])
        good = np.zeros(BLOCK_LEN, dtype=np.uint8)
        assert raw.get(key_of(cfg, 3), good) == BLOCK_LEN
        good[2 * (4096 + SHARD) + 4096 + 17] ^= 1
        assert raw.remove(key_of(cfg, 3)) == 0
        assert raw.put(key_of(cfg, 3), good) == 0

        assert store.lookup([bid(1), bid(2), bid(3)]) == [True, False, True]
        for n in (1, 3):
            out = np.full((SHARDS, 2, SHARD // 2), 7, dtype=np.uint8)
            ids = [bid(n)] * SHARDS
            t = [[out[s, 0], out[s, 1]] for s in range(SHARDS)]
            with pytest.raises(CorruptBlockError):
                store.wait(store.load(ids, list(range(SHARDS)), t))
            # a shard that failed its checks was never copied out
            assert (out[2] == 7).all()
        assert store.get_stats()["corrupt_loads"] == 2
        deadline = time.monotonic() + 5
        while raw.size(key_of(cfg, 1)) >= 0:  # removed, for the next dump
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        store.close()
        raw.close()


def test_a_dead_master_fails_start_within_the_timeout(mooncake: MooncakeCluster) -> None:
    cfg = mc_config(mooncake, mooncake_master=f"{HOST_ADDRS[0]}:1", timeout_ms=3000)
    started = time.monotonic()
    with pytest.raises(StoreTimeoutError, match="mooncake_master: nothing answers"):
        open_store(mooncake, cfg)
    assert time.monotonic() - started < 10


def test_config_validation_names_the_key(
    mooncake: MooncakeCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = mc_config(mooncake)
    for bad, key in [
        ({"mooncake_protocol": "udp"}, "mooncake_protocol"),
        ({"mooncake_replica_num": 0}, "mooncake_replica_num"),
        ({"mooncake_global_segment_gb": -1}, "mooncake_global_segment_gb"),
        ({"mooncake_key_prefix": "a b"}, "mooncake_key_prefix"),
    ]:
        with pytest.raises(ConfigError, match=key):
            PipelineStoreConfig.from_dict({**base, **bad})
    cfg = {k: v for k, v in base.items() if k != "mooncake_master"}
    with pytest.raises(ConfigError, match="mooncake_master"):
        PipelineStoreConfig.from_dict(cfg)
    for bad, key in [
        ({"mooncake_master": "no-port"}, "mooncake_master"),
        ({"mooncake_master": "${UCM_TEST_UNSET_MASTER}"}, "mooncake_master"),
        ({"mooncake_global_segment_gb": 0.001}, "mooncake_global_segment_gb"),
    ]:
        with pytest.raises(InvalidParamError, match=key):
            open_store(mooncake, {**base, **bad})
    # ${VAR} names the master
    monkeypatch.setenv("UCM_TEST_MASTER", mooncake.master_addr)
    store = open_store(mooncake, {**base, "mooncake_master": "${UCM_TEST_MASTER}"})
    try:
        round_trip(store)
    finally:
        store.close()


@pytest.mark.vllm  # starts vLLM engines: the slow tier
def test_two_vllm_engines_on_two_hosts_share_one_pool(
    mooncake: MooncakeCluster, tmp_path: Path
) -> None:
    """Two vLLM engines over ``Cache|Mooncake``, on two hosts: engine B hits
    every full block engine A served, from the pool (B's own cache starts
    empty), and its greedy tokens equal A's cold run."""
    pytest.importorskip("vllm")
    from support.servers import vllm_two_engines

    prefix = uuid.uuid4().hex[:12]
    ucm = {
        "store_pipeline": "Cache|Mooncake",
        **mooncake.store_keys(prefix),
        "cache_buffer_capacity_gb": 0.05,
    }
    a, b = vllm_two_engines(
        tmp_path, ucm, spawn_in=lambda name: mooncake.on_host(0 if name == "A" else 1)
    )
    assert a["cached"] == [0, 0]
    assert b["tokens"] == a["tokens"]
    bs = 32
    assert b["cached"] == [len(p) // bs * bs for p in a["prompts"]]


ROOT = Path(__file__).resolve().parents[3]
ROUND_TRIP = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, sys.argv[1])
    from support.remote_helpers import SHARD, SHARDS
    from support.remote_scenarios import round_trip
    from ucm.integration.vllm.config import CONFIG_FILE_KEY, resolve_config
    from ucm.integration.vllm.store_handle import build_store_config
    from ucm.store import UcmConnectorFactory
    spec = resolve_config({CONFIG_FILE_KEY: sys.argv[2]}).store
    geometry = {"block_size": SHARD * SHARDS, "shard_size": SHARD,
                "tensor_size_list": [SHARD // 2, SHARD // 2]}
    cfg = build_store_config(spec, geometry, device_id=0)
    store = UcmConnectorFactory.create_connector(spec.name, cfg)
    round_trip(store)
    store.close()
    print("ok")
    """
)


def test_readme_mooncake_example(mooncake: MooncakeCluster) -> None:
    """The Mooncake page's commands as they stand (the address and the
    pool's size aside): its master and store service start, an engine
    host's store opened from ``configs/ucm-vllm-mooncake.yaml`` with
    ``MOONCAKE_MASTER`` round-trips blocks through them, and its
    ``ucm serve`` line passes the connector's early checks."""
    import shlex

    from click.testing import CliRunner
    from support.docs import blocks_with

    from ucm.cli import main
    from ucm.integration.vllm.plugin import check_early

    (block,) = blocks_with("bash", "mooncake_master")
    lines = [shlex.split(x) for x in block.code.splitlines() if x and not x.startswith("#")]
    master, service, serve = (w[:-1] if w[-1] == "&" else w for w in lines)
    addr = "10.0.0.5"

    def local(words: list[str]) -> list[str]:
        from support.mooncake_server import binary

        words = [w.replace(addr, HOST_ADDRS[0]).replace("=4 GB", "=64 MB") for w in words]
        return [binary(words[0]) or words[0], *words[1:]]

    cluster = MooncakeCluster(master_cmd=local(master), service_cmd=local(service))
    try:
        env_word, *serve_words = serve
        assert env_word == f"MOONCAKE_MASTER={addr}:50051"
        config = serve_words[serve_words.index("--ucm-config") + 1]
        out = subprocess.run(
            cluster.nsenter(
                1,
                [sys.executable, "-c", ROUND_TRIP, str(Path(__file__).parents[1]), config],
            ),
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
            env={**os.environ, "MOONCAKE_MASTER": cluster.master_addr},
        )
        assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]
    finally:
        cluster.close()
    assert serve_words[:3] == ["ucm", "serve", "MODEL"]
    res = CliRunner().invoke(main, ["serve", "--dry-run", *serve_words[2:]])
    assert res.exit_code == 0, res.output
    check_early(dry_run_argv(res.output))
