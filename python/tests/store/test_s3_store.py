"""The S3 store (pipeline stages ``S3`` / ``Ds3fs``, and ``Cache|S3``)
against a real S3-compatible server: ``moto_server`` started on a free
127.0.0.1 port (see ``servers.py``).

Covers round trips through every stage name, two processes (two "nodes")
sharing one bucket, a server stopped mid-run under ``Cache|S3`` (loads fail
so the engine recomputes, dumps do not crash, dirty blocks stay cached and
reach the server once it is back), a slow server (timeouts honoured), wrong
credentials with signature checking on (a clear error at start-up, no
secret in logs or messages), a missing bucket, and config validation.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.remote_helpers import SHARD, SHARDS, bid, block_data, dump, load, remote_config
from support.remote_scenarios import ride_out_an_outage, round_trip, wait_until_found
from support.servers import DelayProxy, MotoServer
from support.tiny_serve import free_port

from ucm.shared.config import ConfigError
from ucm.store import (
    InvalidParamError,
    PipelineStoreConfig,
    UcmConnectorFactory,
    UcmKVStoreBase,
    UcmStoreError,
)


def s3_config(server: MotoServer, bucket: str, **overrides: Any) -> dict[str, Any]:
    location = {**server.store_keys(bucket, "kv"), "s3_negative_cache_ttl_ms": 0}
    return remote_config("S3", location, **overrides)


def open_store(cfg: dict[str, Any]) -> UcmKVStoreBase:
    return UcmConnectorFactory.create_connector("UcmPipelineStore", cfg)


def object_key(n: int) -> str:
    h = bid(n).hex()
    return f"kv/{h[:2]}/{h}"


@pytest.mark.parametrize("pipeline", ["S3", "Ds3fs", "Cache|S3"])
def test_round_trip_lookup_and_layer_wise(moto: MotoServer, pipeline: str) -> None:
    bucket = moto.create_bucket()
    store = open_store(s3_config(moto, bucket, store_pipeline=pipeline))
    try:
        round_trip(store)
        # layer-wise: one task per shard, out of order; the object appears whole
        for s in (3, 0, 2):
            dump(store, [7], range(s, s + 1))
        store.flush()
        client = moto.client()
        listed = client.list_objects_v2(Bucket=bucket, Prefix="kv/").get("Contents", [])
        assert object_key(7) not in {o["Key"] for o in listed}
        dump(store, [7], range(1, 2))
        store.flush()
        head = client.head_object(Bucket=bucket, Key=object_key(7))
        assert head["ContentLength"] == SHARDS * (4096 + SHARD)
        assert np.array_equal(load(store, [7])[7], block_data(7))
        with pytest.raises(UcmStoreError):
            load(store, [99])
        stats = store.get_stats()
        assert any(k.endswith("put_requests") for k in stats), stats
    finally:
        store.close()


WRITER = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    sys.path.insert(0, sys.argv[2])
    from support.remote_helpers import dump
    from ucm.store import UcmConnectorFactory
    cfg = json.loads(sys.argv[1])
    store = UcmConnectorFactory.create_connector("UcmPipelineStore", cfg)
    dump(store, [int(x) for x in sys.argv[3].split(",")])
    store.close()  # flushes the cache
    print("ok")
    """
)


def test_two_nodes_share_one_bucket(moto: MotoServer) -> None:
    """Blocks dumped by one process through ``Cache|S3`` are hit and loaded,
    unchanged, by another process with its own cache."""
    bucket = moto.create_bucket()
    cfg = s3_config(moto, bucket, store_pipeline="Cache|S3")
    tests = str(Path(__file__).parents[1])  # for ``support``
    out = subprocess.run(
        [sys.executable, "-c", WRITER, json.dumps(cfg), tests, "11,12,13"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr
    reader = open_store(cfg)
    try:
        assert reader.lookup_on_prefix([bid(11), bid(12), bid(13), bid(14)]) == 2
        got = load(reader, [11, 12, 13])
        for n in (11, 12, 13):
            assert np.array_equal(got[n], block_data(n))
        # and the other way round: what this node writes, a new node reads
        dump(reader, [21])
        reader.flush()
    finally:
        reader.close()
    second = open_store(s3_config(moto, bucket, store_pipeline="S3"))
    try:
        assert np.array_equal(load(second, [21])[21], block_data(21))
    finally:
        second.close()


def test_server_stopped_mid_run_under_a_cache() -> None:
    try:
        server = MotoServer()
    except FileNotFoundError as e:
        pytest.skip(f"{e} is not installed")
    try:
        bucket = server.create_bucket()
        store = open_store(
            s3_config(server, bucket, store_pipeline="Cache|S3", timeout_ms=3000, s3_retries=1)
        )

        def restart() -> None:  # moto keeps nothing: the bucket is made again
            server.start()
            server.create_bucket(bucket)

        ride_out_an_outage(store, server.stop, restart)
        client = server.client()
        for n in (2, 3):
            assert client.head_object(Bucket=bucket, Key=object_key(n))["ContentLength"] > 0
        store.close()
    finally:
        server.close()


def test_slow_server_timeouts_are_honoured(moto: MotoServer) -> None:
    bucket = moto.create_bucket()
    proxy = DelayProxy(moto.port)
    try:
        store = open_store(
            s3_config(
                moto,
                bucket,
                s3_endpoint=proxy.endpoint,
                timeout_ms=1500,
                s3_retries=1,
                s3_lookup_cache_ttl_ms=0,
            )
        )
        dump(store, [1])
        proxy.delay = 5.0
        started = time.monotonic()
        with pytest.raises(UcmStoreError) as e:
            load(store, [1])
        assert time.monotonic() - started < 3.5, e.value
        assert store.lookup([bid(1)]) == [False]  # a lookup that can't answer is a miss
        proxy.delay = 0.0
        wait_until_found(store, 1)
        assert np.array_equal(load(store, [1])[1], block_data(1))
        store.close()
    finally:
        proxy.close()


def test_missing_bucket_and_dead_endpoint_fail_at_start(moto: MotoServer) -> None:
    with pytest.raises(InvalidParamError, match="does not exist"):
        open_store(s3_config(moto, "no-such-bucket-here"))
    dead = f"http://127.0.0.1:{free_port()}"  # nobody listens there
    with pytest.raises(UcmStoreError, match="s3_endpoint"):
        open_store(s3_config(moto, "whatever", s3_endpoint=dead, s3_retries=0, timeout_ms=2000))


@pytest.fixture(scope="module")
def moto_auth() -> Iterator[MotoServer]:
    try:
        server = MotoServer(auth=True)
    except FileNotFoundError as e:
        pytest.skip(f"{e} is not installed")
    yield server
    server.close()


def test_credentials_checked_at_start_and_never_logged(
    moto_auth: MotoServer, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.DEBUG)
    bucket = moto_auth.create_bucket()
    # the right credentials, from the environment
    monkeypatch.setenv("UCM_TEST_AK", moto_auth.access_key)
    monkeypatch.setenv("UCM_TEST_SK", moto_auth.secret_key)
    good = s3_config(
        moto_auth, bucket, s3_access_key="${UCM_TEST_AK}", s3_secret_key="${UCM_TEST_SK}"
    )
    store = open_store(good)
    dump(store, [5])
    assert np.array_equal(load(store, [5])[5], block_data(5))
    store.close()
    # a wrong secret, an unknown key: a clear error when the store opens
    wrong_secret = "WRONG-secret-value-1234567890"
    for ak, sk in ((moto_auth.access_key, wrong_secret), ("AKIAUNKNOWN000000000", wrong_secret)):
        with pytest.raises(InvalidParamError, match="s3_access_key") as e:
            open_store(s3_config(moto_auth, bucket, s3_access_key=ak, s3_secret_key=sk))
        assert wrong_secret not in str(e.value)
    # an unset variable names itself
    monkeypatch.delenv("UCM_TEST_SK")
    with pytest.raises(InvalidParamError, match="UCM_TEST_SK"):
        open_store(good)
    for secret in (moto_auth.secret_key, wrong_secret):
        assert secret not in caplog.text
    cfg = PipelineStoreConfig.from_dict(
        {
            "store_pipeline": "S3",
            "storage_backends": "s3://kvb/x",
            "block_size": SHARD,
            "s3_access_key": "AKIA-visible?",
            "s3_secret_key": "never-shown",
        }
    )
    assert "never-shown" not in repr(cfg) and "AKIA-visible?" not in repr(cfg)


def test_no_credentials_names_the_real_cause(
    moto_auth: MotoServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No key in the config and none in the environment: the error says so
    and which keys or variables to set, not that the endpoint rejected
    credentials (the client had fallen back to the instance metadata)."""
    bucket = moto_auth.create_bucket()
    for var in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    ):
        monkeypatch.delenv(var, raising=False)
    cfg = s3_config(moto_auth, bucket, s3_access_key="", s3_secret_key="", timeout_ms=3000)
    with pytest.raises(InvalidParamError) as info:
        open_store(cfg)
    msg = str(info.value)
    assert "no S3 credentials are configured" in msg, msg
    assert "s3_access_key" in msg and "AWS_ACCESS_KEY_ID" in msg
    assert "rejected the credentials" not in msg


def test_config_validation_names_the_key() -> None:
    base = remote_config("Cache|S3", {"storage_backends": "s3://kvb/prefix"})
    cfg = PipelineStoreConfig.from_dict(base)
    assert [name for name, _ in cfg.stages] == ["Cache", "S3"]
    assert PipelineStoreConfig.from_dict({**base, "store_pipeline": "Cache|Ds3fs"})
    for bad, key in (
        ({"storage_backends": "/local/dir"}, "storage_backends"),
        ({"s3_max_concurrency": 0}, "s3_max_concurrency"),
        ({"s3_retries": -1}, "s3_retries"),
        ({"s3_bogus": 1}, "s3_bogus"),
    ):
        with pytest.raises(ConfigError, match=key):
            PipelineStoreConfig.from_dict({**base, **bad})
    with pytest.raises(ConfigError, match="storage_backends"):
        PipelineStoreConfig.from_dict({**base, "storage_backends": ["s3://a/b", "s3://c/d"]})


@pytest.mark.vllm  # starts vLLM engines: the slow tier
def test_two_vllm_engines_share_a_bucket(moto: MotoServer, tmp_path: Path) -> None:
    """Two vLLM engines in their own processes over ``Cache|S3``: blocks
    saved by the first are hit by the second, with unchanged tokens."""
    pytest.importorskip("vllm")
    from support.servers import vllm_two_engines

    bucket = moto.create_bucket()
    ucm = {
        "store_pipeline": "Cache|S3",
        **moto.store_keys(bucket, "vllm"),
        "cache_buffer_capacity_gb": 0.05,
    }
    a, b = vllm_two_engines(tmp_path, ucm)
    assert a["cached"] == [0, 0]
    assert b["tokens"] == a["tokens"]
    bs = 32
    assert b["cached"] == [len(p) // bs * bs for p in a["prompts"]]
    listed = moto.client().list_objects_v2(Bucket=bucket, Prefix="vllm/").get("Contents", [])
    assert len(listed) == sum(len(p) // bs for p in a["prompts"])
