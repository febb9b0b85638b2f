"""What ``ucm serve`` prints while vLLM starts: phases named from vLLM's own
log lines, the phase again after a silence, and the ready line once /health
answers (a real HTTP server here; the end-to-end run is in
``e2e/test_vllm_serve.py``)."""

from __future__ import annotations

import http.server
import io
import threading
from collections.abc import Iterator

import pytest

from ucm.cli.serve_progress import Progress, server_url


def test_server_url_follows_vllms_host_and_port() -> None:
    assert server_url([]) == "http://127.0.0.1:8000"
    assert server_url(["--port", "8100", "--host", "0.0.0.0"]) == "http://127.0.0.1:8100"
    assert server_url(["--host=10.0.0.5", "--port=9"]) == "http://10.0.0.5:9"
    assert server_url(["--host", "::1"]) == "http://[::1]:8000"


@pytest.fixture
def health() -> Iterator[tuple[str, list[int]]]:
    """A server whose /health answers with the status at the end of the list."""
    status = [503]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status[-1] if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", status
    finally:
        srv.shutdown()
        srv.server_close()


def test_phases_silence_and_one_ready_line(health: tuple[str, list[int]]) -> None:
    url, status = health
    out = io.StringIO()
    p = Progress(url, out, silence_s=0.0)
    p.passthrough("INFO [cpu_model_runner.py:68] Starting to load model /m...\n")
    p.passthrough("INFO [cpu_model_runner.py:87] Warming up model for the compilation...\n")
    # An earlier phase's text again does not move the phase back.
    p.passthrough("INFO [cpu_model_runner.py:68] Starting to load model /m...\n")
    p.tick()  # not healthy yet, and silent (silence_s=0): the phase again
    status.append(200)
    p.tick()
    p.tick()
    lines = out.getvalue().splitlines()
    ours = [x for x in lines if x.startswith("ucm serve: ")]
    assert lines[0].endswith("Starting to load model /m...")  # vLLM's lines pass unchanged
    assert ours[0].startswith("ucm serve: loading weights (")
    assert ours[1].startswith("ucm serve: warming up and compiling the model")
    assert ours[2].startswith("ucm serve: still warming up and compiling the model")
    assert [x for x in ours if "ready" in x] == [ours[3]]
    assert ours[3].startswith(f"ucm serve: ready: {url}/v1 (after ")
    assert len(ours) == 4
