"""Helpers of the vLLM connector tests."""

from __future__ import annotations

from pathlib import Path

from ucm.testing.harness import EngineProcess, engine_env

ROOT = Path(__file__).resolve().parents[3]


class Engine(EngineProcess):
    """A vLLM engine (``ucm.testing.harness``) in a child process;
    test engines use a 2048-token context and a 64 MiB KV cache."""

    def __init__(self, config: dict, log: Path, env: dict[str, str] | None = None) -> None:
        super().__init__(config, log, env=env or engine_env(), cwd=log.parent)


__all__ = ["ROOT", "Engine", "engine_env"]
