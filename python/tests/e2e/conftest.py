"""The slow tier: every test here starts real vLLM engines (marked ``vllm``;
``pytest -m "not vllm"`` runs the fast tier). Fixtures: a tiny model, engines
in their own processes."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.engines import Engine, engine_env

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ucm.vllm_demo.tiny_model import make_tiny_llama

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


def pytest_itemcollected(item: pytest.Item) -> None:
    # Called for the items below this folder only (a folder's conftest).
    item.add_marker(pytest.mark.vllm)
