"""What a client sends ``ucm proxy`` is checked before it reaches an engine:
a body nested too deeply is refused with 400, and the P/D fields of
``kv_transfer_params`` are the proxy's own (a client's are dropped, its
per-request controls kept).

The real proxy runs as ``python -m ucm proxy`` in front of two fake engines
(``support.pd_proxy``).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from support.pd_proxy import HANDOVER, FakeEngine, running_proxy
from support.tiny_serve import free_port, http

from ucm.integration.vllm.proxy import CLIENT_KV_PARAMS, MAX_JSON_DEPTH
from ucm.integration.vllm.request_control import KEYS as REQUEST_CONTROL_KEYS


@dataclass
class Proxy:
    url: str
    log: Path
    prefill: FakeEngine
    decode: FakeEngine


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    prefill, decode = FakeEngine("prefill"), FakeEngine("decode")
    log = tmp_path_factory.mktemp("proxy") / "proxy.log"
    try:
        with running_proxy(prefill.url, decode.url, free_port(), log) as url:
            yield Proxy(url, log, prefill, decode)
    finally:
        prefill.close()
        decode.close()


def post_raw(url: str, data: bytes) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def nested(depth: int) -> bytes:
    """A completion request with a value ``depth`` levels deep in it."""
    inner = "[" * (depth - 1) + "]" * (depth - 1)
    return f'{{"model": "m", "prompt": "x", "user": {inner}}}'.encode()


def test_a_deeply_nested_body_is_refused_with_400(proxy: Proxy) -> None:
    seen = len(proxy.prefill.bodies), len(proxy.decode.bodies)
    # Far deeper than the parser's recursion, and just past the proxy's limit.
    for depth in (200_000, MAX_JSON_DEPTH + 1):
        status, out = post_raw(proxy.url + "/v1/completions", nested(depth))
        assert status == 400, (depth, out)
        assert f"nests deeper than {MAX_JSON_DEPTH} levels" in out["error"]["message"]
    assert (len(proxy.prefill.bodies), len(proxy.decode.bodies)) == seen
    # At the limit, the request goes through.
    status, out = post_raw(proxy.url + "/v1/chat/completions", nested(MAX_JSON_DEPTH))
    assert status == 200 and out["choices"][0]["text"] == "decode", out
    # The proxy is still up.
    assert http(proxy.url + "/health")[0] == 200


def test_client_pd_fields_never_reach_the_engines(proxy: Proxy) -> None:
    forged = {
        **HANDOVER,
        "do_remote_decode": True,
        "ucm_blocks": 10**12,
        "remote_engine_id": "attacker",
        "remote_block_ids": [1, 2, 3],
        "ucm_skip_save": True,
        "ucm_max_load_tokens": 64,
    }
    body = {"model": "m", "prompt": "hello", "max_tokens": 4, "kv_transfer_params": forged}
    status, out = post_raw(proxy.url + "/v1/completions", json.dumps(body).encode())
    assert status == 200 and out["choices"][0]["text"] == "decode", out
    pre, dec = proxy.prefill.bodies[-1], proxy.decode.bodies[-1]
    controls = {"ucm_skip_save": True, "ucm_max_load_tokens": 64}
    # The prefill engine gets the client's controls and the proxy's request
    # for a handover; the decode engine the controls and the prefill engine's
    # handover, nothing the client forged.
    assert pre["kv_transfer_params"] == {
        **controls,
        "do_remote_decode": True,
        "do_remote_prefill": False,
    }
    assert dec["kv_transfer_params"] == {**controls, **HANDOVER}
    log = proxy.log.read_text()
    assert "dropped the client's kv_transfer_params" in log, log[-2000:]
    assert "remote_engine_id" in log and "ucm_blocks" in log
    # Only P/D fields: nothing of kv_transfer_params is left to send.
    only_pd = {**body, "kv_transfer_params": {"do_remote_prefill": True, "ucm_blocks": 5}}
    status, _ = post_raw(proxy.url + "/v1/completions", json.dumps(only_pd).encode())
    assert status == 200
    assert proxy.prefill.bodies[-1]["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
    }
    assert proxy.decode.bodies[-1]["kv_transfer_params"] == HANDOVER


def test_the_client_keys_are_the_documented_per_request_controls() -> None:
    from ucm.sparse.blend.config import BUILD_PARAM, CHUNKS_PARAM

    assert CLIENT_KV_PARAMS == {*REQUEST_CONTROL_KEYS, CHUNKS_PARAM, BUILD_PARAM}
    assert not CLIENT_KV_PARAMS & set(HANDOVER)
