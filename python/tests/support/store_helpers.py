"""Constants and config builders shared by the store tests (kept out of
``conftest.py`` so that test modules can import them by a unique name)."""

from __future__ import annotations

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
