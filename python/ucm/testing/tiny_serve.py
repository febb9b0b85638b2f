"""``vllm serve`` options sized for the tiny test model.

The end-to-end tests and the install check start the same small engine: the
tiny model in float32, 32-token blocks, a short context and 64 MiB of KV
memory, and vLLM's own prefix cache off so that repeats are served by UCM.
"""

from __future__ import annotations


def tiny_server_args(port: int, host: str = "127.0.0.1") -> list[str]:
    """Options after ``serve MODEL`` for the tiny model on ``host:port``."""
    return [
        "--host",
        host,
        "--port",
        str(port),
        "--served-model-name",
        "tiny",
        "--enforce-eager",
        "--dtype",
        "float32",
        "--max-model-len",
        "1024",
        "--block-size",
        "32",
        "--kv-cache-memory-bytes",
        str(64 << 20),
        "--no-enable-prefix-caching",
    ]
