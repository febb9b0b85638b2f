"""Fixtures for the vLLM connector tests: a tiny model, engines in their own processes."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ucm_vllm_testing import Engine, engine_env

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ucm.integration.vllm.tiny_model import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Starts engines on demand; closes them at the end of the module."""
    made: list[Engine] = []
    logs = tmp_path_factory.mktemp("engine-logs")

    def start(name: str, config: dict[str, Any], **env: str) -> Engine:
        e = Engine(config, logs / f"{name}.log", engine_env(**env))
        made.append(e)
        return e

    yield start
    for e in made:
        e.close()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "vllm: end-to-end tests that start real vLLM engines")
