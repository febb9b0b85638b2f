"""The NFS store (pipeline stage ``NFS`` and ``Cache|NFS``) against a real
NFS server: NFS-Ganesha exporting a temporary directory over NFSv3 inside a
private network namespace (see ``servers.py``), reached by the store's
built-in user-space NFSv3 client; plus the kernel-mounted-directory mode on
a local directory.

Covers round trips, layer-wise assembly (a block appears whole or not at
all), two processes (two "nodes") sharing one export, the server stopped
mid-run under ``Cache|NFS`` (loads fail so the engine recomputes, dumps do
not crash, dirty blocks stay cached and reach the export once the server is
back), a slow server (timeouts honoured) and a missing export.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.remote_helpers import SHARD, SHARDS, bid, block_data, dump, load, remote_config
from support.remote_scenarios import ride_out_an_outage, round_trip, wait_until_found
from support.servers import NfsServer

from ucm.shared.config import ConfigError
from ucm.store import (
    InvalidParamError,
    PipelineStoreConfig,
    UcmConnectorFactory,
    UcmKVStoreBase,
    UcmStoreError,
)


def nfs_config(target: str, **overrides: Any) -> dict[str, Any]:
    return remote_config("NFS", {"storage_backends": target}, **overrides)


def open_store(server: NfsServer | None, cfg: dict[str, Any]) -> UcmKVStoreBase:
    if server is None:
        return UcmConnectorFactory.create_connector("UcmPipelineStore", cfg)
    with server.in_netns():
        return UcmConnectorFactory.create_connector("UcmPipelineStore", cfg)


def block_file(root: Path, n: int) -> Path:
    h = bid(n).hex()
    return root / h[:2] / h


def temporaries(root: Path) -> list[Path]:
    return [p for p in root.glob("*/*") if ".tmp." in p.name]


def check_round_trip(store: UcmKVStoreBase, root: Path) -> None:
    round_trip(store)
    raw = block_file(root, 1).read_bytes()
    assert len(raw) == SHARDS * (4096 + SHARD) and raw[:8] == b"UCMKVBLK"
    # layer-wise: one task per shard, out of order; the file appears whole
    for s in (2, 0, 3):
        dump(store, [7], range(s, s + 1))
    store.flush()
    assert not block_file(root, 7).exists()
    assert len(temporaries(root)) == 1
    dump(store, [7], range(1, 2))
    store.flush()
    assert block_file(root, 7).exists() and not temporaries(root)
    assert np.array_equal(load(store, [7])[7], block_data(7))
    with pytest.raises(UcmStoreError):
        load(store, [99])


@pytest.mark.parametrize("pipeline", ["NFS", "Cache|NFS"])
def test_round_trip_over_ganesha(nfs: NfsServer, pipeline: str) -> None:
    sub = pipeline.replace("|", "-").lower()
    store = open_store(nfs, nfs_config(nfs.url(sub), store_pipeline=pipeline))
    try:
        check_round_trip(store, nfs.export / sub)
        stats = store.get_stats()
        assert any(k.endswith("blocks_published") for k in stats), stats
    finally:
        store.close()


def test_kernel_mounted_directory_mode(tmp_path: Path) -> None:
    """A directory of a kernel-mounted export: same format and protocol
    (write, fsync, rename), tested on a local directory."""
    store = open_store(None, nfs_config(str(tmp_path)))
    try:
        check_round_trip(store, tmp_path)
    finally:
        store.close()


def test_kernel_mounted_directory_refuses_what_is_not_a_block_file(tmp_path: Path) -> None:
    """The export is shared ground: a symlink or FIFO at a block's name is
    neither followed nor waited on."""
    store = open_store(None, nfs_config(str(tmp_path)))
    try:
        dump(store, [1, 2])
        (tmp_path / "victim").write_bytes(block_file(tmp_path, 1).read_bytes())
        for n, plant in ((3, "symlink"), (4, "fifo")):
            path = block_file(tmp_path, n)
            path.parent.mkdir(exist_ok=True)
            if plant == "symlink":
                path.symlink_to(tmp_path / "victim")
            else:
                os.mkfifo(path)
            assert store.lookup([bid(n)]) == [False]
            with pytest.raises(UcmStoreError):
                load(store, [n])
        assert np.array_equal(load(store, [2])[2], block_data(2))
    finally:
        store.close()


WRITER = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, sys.argv[2])
    from support.remote_helpers import dump
    from ucm.store import UcmConnectorFactory
    store = UcmConnectorFactory.create_connector("UcmPipelineStore", json.loads(sys.argv[1]))
    dump(store, [int(x) for x in sys.argv[3].split(",")])
    store.close()  # flushes the cache
    print("ok")
    """
)


def test_two_nodes_share_one_export(nfs: NfsServer) -> None:
    cfg = nfs_config(nfs.url("shared"), store_pipeline="Cache|NFS")
    tests = str(Path(__file__).parents[1])  # for ``support``
    out = subprocess.run(
        nfs.nsenter([sys.executable, "-c", WRITER, json.dumps(cfg), tests, "11,12,13"]),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr
    reader = open_store(nfs, cfg)
    try:
        assert reader.lookup_on_prefix([bid(11), bid(12), bid(13), bid(14)]) == 2
        got = load(reader, [11, 12, 13])
        for n in (11, 12, 13):
            assert np.array_equal(got[n], block_data(n))
    finally:
        reader.close()


def test_server_stopped_mid_run_under_a_cache(nfs: NfsServer) -> None:
    cfg = nfs_config(
        nfs.url("outage"),
        store_pipeline="Cache|NFS",
        timeout_ms=3000,
        nfs_mount_options="timeo=5,retrans=1",
        nfs_lookup_cache_ttl_ms=0,
    )
    store = open_store(nfs, cfg)
    root = nfs.export / "outage"
    try:
        ride_out_an_outage(store, nfs.stop, nfs.start)
        for n in (1, 2, 3):
            assert block_file(root, n).exists()
    finally:
        store.close()
    # what was written before the outage survived it
    again = open_store(nfs, nfs_config(nfs.url("outage")))
    try:
        assert np.array_equal(load(again, [1])[1], block_data(1))
    finally:
        again.close()


def test_slow_server_timeouts_are_honoured(nfs: NfsServer) -> None:
    cfg = nfs_config(
        nfs.url("slow"),
        timeout_ms=1500,
        nfs_mount_options="timeo=5,retrans=1",
        nfs_lookup_cache_ttl_ms=0,
    )
    store = open_store(nfs, cfg)
    try:
        dump(store, [1])
        nfs.pause()
        try:
            started = time.monotonic()
            with pytest.raises(UcmStoreError):
                load(store, [1])
            assert time.monotonic() - started < 3.5
            assert store.lookup([bid(1)]) == [False]
        finally:
            nfs.resume()
        wait_until_found(store, 1)
        assert np.array_equal(load(store, [1])[1], block_data(1))
    finally:
        store.close()


def test_missing_export_and_bad_options_fail_at_start(nfs: NfsServer) -> None:
    with pytest.raises(InvalidParamError, match="storage_backends"):
        open_store(nfs, nfs_config("nfs://127.0.0.1/no/such/export"))
    with pytest.raises(InvalidParamError, match="storage_backends"):
        open_store(
            nfs,
            nfs_config(nfs.url("x"), nfs_mount_options="port=3049,mountport=3048,retrans=0"),
        )
    with pytest.raises(UcmStoreError, match="NFSv3"):
        open_store(nfs, nfs_config(nfs.url("x"), nfs_mount_options="vers=4.1"))


def test_config_validation() -> None:
    base = remote_config(
        "Cache|NFS", {"storage_backends": "nfs://server/export/kv"}, nfs_mount_options="rw,sync"
    )
    cfg = PipelineStoreConfig.from_dict(base)
    assert [name for name, _ in cfg.stages] == ["Cache", "NFS"]
    for bad, key in (
        ({"nfs_max_concurrency": 0}, "nfs_max_concurrency"),
        ({"nfs_lookup_cache_ttl_ms": -1}, "nfs_lookup_cache_ttl_ms"),
        ({"storage_backends": ""}, "storage_backends"),
    ):
        with pytest.raises(ConfigError, match=key):
            PipelineStoreConfig.from_dict({**base, **bad})


@pytest.mark.vllm  # starts vLLM engines: the slow tier
def test_two_vllm_engines_share_an_export(nfs: NfsServer, tmp_path: Path) -> None:
    """Two vLLM engines in their own processes over ``Cache|NFS`` (started
    inside the server's network namespace): blocks saved by the first are
    hit by the second, with unchanged tokens."""
    pytest.importorskip("vllm")
    from support.servers import vllm_two_engines

    ucm = {
        "store_pipeline": "Cache|NFS",
        "storage_backends": nfs.url("vllm"),
        "cache_buffer_capacity_gb": 0.05,
    }
    a, b = vllm_two_engines(tmp_path, ucm, spawn_in=lambda _: nfs.in_netns())
    assert a["cached"] == [0, 0]
    assert b["tokens"] == a["tokens"]
    bs = 32
    assert b["cached"] == [len(p) // bs * bs for p in a["prompts"]]
    files = [p for p in (nfs.export / "vllm").glob("*/*") if ".tmp." not in p.name]
    assert len(files) == sum(len(p) // bs for p in a["prompts"])
