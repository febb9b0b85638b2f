"""What a client sends ``ucm proxy`` is checked before it reaches an engine:
a body nested too deeply is refused with 400, and the P/D fields of
``kv_transfer_params`` are the proxy's own (a client's are dropped, its
per-request controls kept).

The real proxy runs as ``python -m ucm proxy`` in front of two fake engines:
HTTP servers on 127.0.0.1 that answer as a prefill and a decode engine do
and record every request body they get.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from support.tiny_serve import free_port, http

from ucm.integration.vllm.proxy import CLIENT_KV_PARAMS, MAX_JSON_DEPTH
from ucm.integration.vllm.request_control import KEYS as REQUEST_CONTROL_KEYS

HANDOVER = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "ucm_blocks": 2,
    "ucm_tail_tokens": 3,
    "ucm_last_block": "ab" * 16,
}


@dataclass
class FakeEngine:
    """An OpenAI completions server that records the bodies it gets."""

    role: str
    bodies: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def answer(self, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self.answer({"object": "list", "data": []})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                engine.bodies.append(body)
                out: dict[str, Any] = {"choices": [{"text": engine.role, "index": 0}]}
                if engine.role == "prefill":
                    out["kv_transfer_params"] = HANDOVER
                self.answer(out)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass
class Proxy:
    url: str
    log: Path
    prefill: FakeEngine
    decode: FakeEngine


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    prefill, decode = FakeEngine("prefill"), FakeEngine("decode")
    port = free_port()
    log = tmp_path_factory.mktemp("proxy") / "proxy.log"
    argv = [sys.executable, "-m", "ucm", "proxy", "--prefill", prefill.url]
    argv += ["--decode", decode.url, "--port", str(port), "--health-interval", "1"]
    env = {**os.environ, "UNIFIED_CACHE_LOG_LEVEL": "DEBUG"}
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while http(url + "/health", timeout=5)[0] != 200:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"ucm proxy did not start:\n{log.read_text()[-4000:]}")
            time.sleep(0.2)
        yield Proxy(url, log, prefill, decode)
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
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
