"""Constants and config builders shared by the store tests (kept out of
``conftest.py`` so that test modules can import them by a unique name)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

SHARD = 64 * 1024
SHARDS = 4


def base_config(root: Path, **overrides: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "store_pipeline": "Posix",
        "storage_backends": str(root),
        "block_size": SHARD * SHARDS,
        "shard_size": SHARD,
        "tensor_size_list": [SHARD // 2, SHARD // 2],
        "timeout_ms": 20000,
    }
    cfg.update(overrides)
    return cfg


def run_in_threads(worker: Callable[[int], None], count: int) -> None:
    """Runs ``worker(0) .. worker(count - 1)`` at once, each in its own
    thread, and fails with the first error any of them raised."""
    errors: list[BaseException] = []

    def guarded(k: int) -> None:
        try:
            worker(k)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(k,)) for k in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
