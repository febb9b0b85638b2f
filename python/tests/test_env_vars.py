"""Variables that look like ucm's but aren't are named, once, with the
right one."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from ucm.integration.vllm.config import TOP_LEVEL_KEYS, resolve_config, store_keys
from ucm.shared.env_vars import KNOWN_ENV_VARS, closest_env_var


def import_ucm_with(env: dict[str, str]) -> str:
    """stderr of a fresh Python that imports ucm (and sets up its logging
    twice) under ``env``."""
    code = "import ucm\nfrom ucm.shared.logging import init_logging\ninit_logging()\n"
    res = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return res.stderr


def test_ucm_log_level_names_the_real_variable_once_at_import() -> None:
    err = import_ucm_with({"UCM_LOG_LEVEL": "DEBUG"})
    assert err.count("UCM_LOG_LEVEL") == 1, err
    assert "did you mean UNIFIED_CACHE_LOG_LEVEL?" in err


@pytest.mark.parametrize(
    ("var", "meant"),
    [("UNIFIED_CACHE_LOGLEVEL", "UNIFIED_CACHE_LOG_LEVEL"), ("UCM_MODEL_DIRS", "UCM_MODEL_DIR")],
)
def test_misspellings_are_named_at_import(var: str, meant: str) -> None:
    err = import_ucm_with({var: "x"})
    assert f"{var} is not read by ucm; did you mean {meant}?" in err, err


def test_variables_ucm_reads_are_not_warned_about() -> None:
    env = {"UNIFIED_CACHE_LOG_LEVEL": "INFO", "UCM_USE_LAYERWISE": "1", "UCM_MODEL_DIR": "/m"}
    assert "not read by ucm" not in import_ucm_with(env)


def test_no_config_key_looks_like_a_misspelling() -> None:
    for key in (*TOP_LEVEL_KEYS, *store_keys()):
        assert closest_env_var(f"UCM_{key.upper()}", KNOWN_ENV_VARS) is None, key


def test_config_merge_suggests_variables_that_are_not_config_keys(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING):
        resolve_config({}, env={"UCM_CONFIG_FLIE": "x.yaml"})
    assert "UCM_CONFIG_FLIE" in caplog.text and "'UCM_CONFIG_FILE'" in caplog.text
