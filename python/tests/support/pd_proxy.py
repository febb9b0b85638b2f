"""The real ``ucm proxy`` (``python -m ucm proxy``) in front of fake engines:
HTTP servers on 127.0.0.1 that answer as a prefill and a decode engine do
and record every request body they get. A request with ``"stream": true``
is answered as server-sent events, one chunk at a time."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from support.tiny_serve import http

#: The ``kv_transfer_params`` a fake prefill engine answers with.
HANDOVER = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "ucm_blocks": 2,
    "ucm_tail_tokens": 3,
    "ucm_last_block": "ab" * 16,
}


@dataclass
class FakeEngine:
    """An OpenAI completions server that records the bodies it gets; while
    ``gate`` is clear, its answers wait. A streamed answer is ``chunks``
    events ``chunk_interval_s`` apart, or, with ``break_after``, that many
    events of an answer promised longer (as an engine dying mid-answer
    leaves it); ``hung_up`` counts the streams whose reader closed the
    connection before their end (as vLLM would notice, and abort the
    request)."""

    role: str
    bodies: list[dict[str, Any]] = field(default_factory=list)
    gate: threading.Event = field(default_factory=threading.Event)
    chunks: int = 100
    chunk_interval_s: float = 0.05
    break_after: int | None = None
    hung_up: int = 0

    def __post_init__(self) -> None:
        engine = self
        self.gate.set()

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

            def stream(self) -> None:
                # No length: the stream ends when the connection closes (HTTP/1.0).
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                if engine.break_after is not None:
                    self.send_header("Content-Length", str(1 << 20))
                self.end_headers()
                try:
                    for i in range(engine.chunks):
                        if i == engine.break_after:
                            return
                        event = {"choices": [{"text": f"{engine.role}{i}", "index": 0}]}
                        self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                        time.sleep(engine.chunk_interval_s)
                    self.wfile.write(b"data: [DONE]\n\n")
                except (BrokenPipeError, ConnectionResetError):
                    engine.hung_up += 1

            def do_GET(self) -> None:
                self.answer({"object": "list", "data": []})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                engine.bodies.append(body)
                engine.gate.wait(60)
                if body.get("stream"):
                    self.stream()
                    return
                out: dict[str, Any] = {"choices": [{"text": engine.role, "index": 0}]}
                if engine.role == "prefill":
                    out["kv_transfer_params"] = HANDOVER
                self.answer(out)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.gate.set()
        self.server.shutdown()
        self.server.server_close()


@contextlib.contextmanager
def running_proxy(
    prefill: str, decode: str, port: int, log: Path, health_interval_s: float = 1
) -> Iterator[str]:
    """``ucm proxy`` routing to the engines at ``prefill`` and ``decode``,
    serving on ``port``, checking their health every ``health_interval_s``;
    yields its URL once it answers."""
    argv = [sys.executable, "-m", "ucm", "proxy", "--prefill", prefill]
    argv += ["--decode", decode, "--port", str(port)]
    argv += ["--health-interval", str(health_interval_s)]
    env = {**os.environ, "UNIFIED_CACHE_LOG_LEVEL": "DEBUG"}
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        # /metrics, not /health: the latter is 503 while a pool has no engine up.
        while http(url + "/metrics", timeout=5)[0] != 200:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ucm proxy did not start:\n{log.read_text()[-4000:]}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The ``ucm_proxy_*`` samples on the proxy at ``url``: (name, sorted labels) -> value."""
    status, text = http(url + "/metrics")
    assert status == 200, text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name.startswith("ucm_proxy_")
    }


def value(samples: dict, name: str, **labels: str) -> float:
    """One sample of :func:`scrape`'s answer."""
    return samples[(name, tuple(sorted(labels.items())))]
