"""The store factory and the logging setup."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from support.store_helpers import SHARD, base_config

from ucm.store import InvalidParamError, UcmConnectorFactory, UcmKVStoreBase


def test_builtin_and_user_stores_come_from_one_factory(tmp_path: Path) -> None:
    assert "UcmPipelineStore" in UcmConnectorFactory.registered()
    UcmConnectorFactory.register_connector("MyDictStore", "support.py_stores", "DictStore")
    try:
        with pytest.raises(ValueError, match="already registered"):
            UcmConnectorFactory.register_connector("MyDictStore", "support.py_stores", "DictStore")
        one_shard = base_config(tmp_path, block_size=SHARD, tensor_size_list=[SHARD])
        user = UcmConnectorFactory.create_connector("MyDictStore", one_shard)
        builtin = UcmConnectorFactory.create_connector("UcmPipelineStore", one_shard)
        for store in (user, builtin):
            assert isinstance(store, UcmKVStoreBase)
            data = [[torch.full((SHARD,), 7, dtype=torch.uint8)]]
            store.wait(store.dump([b"u" * 16], [0], data))
            out = [[torch.zeros(SHARD, dtype=torch.uint8)]]
            store.wait(store.load([b"u" * 16], [0], out))
            assert torch.equal(out[0][0], data[0][0])
            store.close()
    finally:
        UcmConnectorFactory.unregister_connector("MyDictStore")


def test_factory_errors_name_the_problem() -> None:
    with pytest.raises(InvalidParamError, match=r"unknown store 'Nope'.*UcmPipelineStore"):
        UcmConnectorFactory.create_connector("Nope", {})
    UcmConnectorFactory.register_connector("NotAStore", "pathlib", "Path")
    UcmConnectorFactory.register_connector("Missing", "support.py_stores", "NoSuchClass")
    try:
        with pytest.raises(InvalidParamError, match="not a UcmKVStoreBase subclass"):
            UcmConnectorFactory.create_connector("NotAStore", {})
        with pytest.raises(InvalidParamError, match="has no class 'NoSuchClass'"):
            UcmConnectorFactory.create_connector("Missing", {})
    finally:
        UcmConnectorFactory.unregister_connector("NotAStore")
        UcmConnectorFactory.unregister_connector("Missing")


LOGGING_SCRIPT = textwrap.dedent(
    """
    import logging, sys
    sys.path.insert(0, {tests!r})
    from pathlib import Path
    from support.store_helpers import base_config
    from ucm.store import UcmConnectorFactory
    print("level", logging.getLevelName(logging.getLogger("ucm").level), flush=True)
    s = UcmConnectorFactory.create_connector("UcmPipelineStore", base_config(Path({root!r})))
    s.close()
    """
)


def run_with_level(tmp_path: Path, level: str) -> subprocess.CompletedProcess[str]:
    root = tmp_path / f"store-{level}"
    root.mkdir()
    code = LOGGING_SCRIPT.format(tests=str(Path(__file__).parents[1]), root=str(root))
    env = {**os.environ, "UNIFIED_CACHE_LOG_LEVEL": level}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )


def test_log_level_env_controls_python_and_rust_logs(tmp_path: Path) -> None:
    info = run_with_level(tmp_path, "INFO")
    assert "level INFO" in info.stdout
    # The Rust core's start-up line arrives through Python logging.
    # Its logger sits under ucm_core.store.posix, whichever file logs it.
    assert re.search(r"INFO ucm_core\.store\.posix(\.\w+)*: posix store over", info.stderr), (
        info.stderr
    )
    err = run_with_level(tmp_path, "ERROR")
    assert "level ERROR" in err.stdout
    assert "posix store over" not in err.stderr
    debug = run_with_level(tmp_path, "debug")
    assert "level DEBUG" in debug.stdout
    bad = run_with_level(tmp_path, "LOUD")
    assert "UNIFIED_CACHE_LOG_LEVEL='LOUD'" in bad.stderr and "level INFO" in bad.stdout


SPARES_SCRIPT = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {tests!r})
    from pathlib import Path
    from support.store_helpers import base_config
    from ucm.store import UcmConnectorFactory
    root = Path({root!r})
    s = UcmConnectorFactory.create_connector(
        "UcmPipelineStore", base_config(root, posix_spare_files=2)
    )
    deadline = time.monotonic() + 10
    while len(list(root.glob(".work/*/spare.*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    s.close()
    """
)


def test_start_up_line_reports_adopted_spares_and_no_markers(tmp_path: Path) -> None:
    code = SPARES_SCRIPT.format(tests=str(Path(__file__).parents[1]), root=str(tmp_path))
    env = {**os.environ, "UNIFIED_CACHE_LOG_LEVEL": "INFO"}

    def start() -> str:
        run = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        return run.stderr

    first = start()
    assert "adopted" not in first, first
    # The first store closed cleanly: its lock and closed marker are not
    # leftovers, and its two spares are taken over.
    second = start()
    assert "0 file(s) of stopped stores" in second, second
    assert "adopted 2 spare file(s)" in second, second
