"""A client that hangs up in the middle of a streamed answer is not a fault
of the decode engine: ``ucm proxy`` stops reading the answer, lets go of the
engine's connection (so the engine can abort the request), keeps the engine
in rotation and counts the request as ``client_gone``. An engine that breaks
its answer off is one: it leaves the rotation and counts as an engine error.

The real proxy runs as ``python -m ucm proxy`` in front of fake engines
(``support.pd_proxy``).
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

from support.pd_proxy import FakeEngine, running_proxy, scrape, value
from support.tiny_serve import free_port, http

STREAM = {"model": "m", "prompt": "hello", "max_tokens": 100, "stream": True}


def read_first_chunk_and_hang_up(url: str) -> bytes:
    """POST a streamed completion to ``url``, read until its first event
    arrives, then close the connection; what was read."""
    parts = urlsplit(url)
    body = json.dumps(STREAM).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {parts.netloc}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as s:
        s.sendall(head + body)
        got = b""
        while b"data:" not in got:
            data = s.recv(65536)
            assert data, f"the proxy closed the stream before its first event: {got!r}"
            got += data
    return got


def wait_for(what: str, check: Callable[[], object], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_client_hanging_up_mid_stream_leaves_the_decode_engine_in_rotation(
    tmp_path: Path,
) -> None:
    prefill, decode = FakeEngine("prefill"), FakeEngine("decode")
    # Health checks run once at the start, then not for the test's length:
    # whatever takes the engine out of rotation shows on the proxy's /health.
    port = free_port()
    try:
        with running_proxy(prefill.url, decode.url, port, tmp_path / "log", 300) as url:
            got = read_first_chunk_and_hang_up(url)
            assert b"200 OK" in got.split(b"\r\n", 1)[0], got
            assert b"decode0" in got, got

            def answered() -> bool:
                counts = scrape(url).items()
                return sum(v for (n, _), v in counts if n == "ucm_proxy_requests_total") == 1

            wait_for("the proxy never finished the request", answered)
            m = scrape(url)
            status, text = http(url + "/health")
            # The engine sees its reader go, as vLLM does to abort the request.
            wait_for("the decode engine's stream was never hung up", lambda: decode.hung_up)
            # And it is still there for the next request.
            assert http(url + "/v1/completions", {**STREAM, "stream": False})[0] == 200
            after = scrape(url)
    finally:
        prefill.close()
        decode.close()
    assert status == 200, text
    assert json.loads(text)["decode"] == {decode.url: True}
    assert value(m, "ucm_proxy_engine_errors_total", role="decode") == 0
    assert value(m, "ucm_proxy_requests_total", outcome="error") == 0
    assert value(m, "ucm_proxy_requests_total", outcome="client_gone") == 1
    assert value(m, "ucm_proxy_requests_in_flight") == 0
    assert len(decode.bodies) == 2
    assert value(after, "ucm_proxy_requests_total", outcome="ok") == 1
    assert value(after, "ucm_proxy_engine_errors_total", role="decode") == 0


def test_a_decode_engine_breaking_off_mid_stream_leaves_the_rotation(tmp_path: Path) -> None:
    prefill, decode = FakeEngine("prefill"), FakeEngine("decode", break_after=2)
    try:
        with running_proxy(prefill.url, decode.url, free_port(), tmp_path / "log", 300) as url:
            answer = http(url + "/v1/completions", STREAM)
            m = scrape(url)
            status, text = http(url + "/health")
    finally:
        prefill.close()
        decode.close()
    # The headers had gone: the client gets what came, then the stream's end.
    assert answer[0] == 200 and "decode1" in answer[1], answer
    assert status == 503, text
    assert json.loads(text)["decode"] == {decode.url: False}
    assert value(m, "ucm_proxy_engine_errors_total", role="decode") == 1
    assert value(m, "ucm_proxy_requests_total", outcome="error") == 1
    assert value(m, "ucm_proxy_requests_total", outcome="client_gone") == 0
    assert value(m, "ucm_proxy_requests_in_flight") == 0
