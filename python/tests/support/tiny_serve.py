"""Starting and talking to a ``vllm serve`` of the tiny test model.

The end-to-end tests, the install check and the disaggregation bench start
the same kind of small engine: the tiny model in float32, 32-token blocks, a
short context, a fixed KV memory, and vLLM's own prefix cache off so that
repeats are served by UCM. They reach it over plain HTTP on loopback.

Test and benchmark tooling (the tests' ``support`` package), not product API.
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request


def tiny_server_args(
    port: int,
    *,
    name: str = "tiny",
    max_model_len: int = 1024,
    kv_cache_bytes: int = 64 << 20,
) -> list[str]:
    """Options after ``serve MODEL`` for the tiny model on 127.0.0.1:``port``."""
    return [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        name,
        "--enforce-eager",
        "--dtype",
        "float32",
        "--max-model-len",
        str(max_model_len),
        "--block-size",
        "32",
        "--kv-cache-memory-bytes",
        str(kv_cache_bytes),
        "--no-enable-prefix-caching",
    ]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http(url: str, body: dict | None = None, timeout: float = 60) -> tuple[int, str]:
    """GET ``url``, or POST ``body`` as JSON: the status and the text, the
    error's for an HTTP error, and ``(0, "")`` when nothing answered."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return 0, ""
