"""``ucm config check`` runs without torch and vLLM, and tells a store
config (for ``ucm.store.open``) from a connector config (for vLLM)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from ucm.cli import main

CONFIGS = Path(__file__).parents[3] / "configs"

# Runs the ``ucm`` command in a Python where torch and vLLM can't be imported.
WITHOUT_TORCH = (
    "import sys\n"
    "for name in ('torch', 'vllm', 'triton'):\n"
    "    sys.modules[name] = None\n"
    "from ucm.cli import main\n"
    "main(sys.argv[1:], prog_name='ucm')\n"
)


def run_without_torch(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_TORCH, *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("name", ["ucm-vllm-posix.yaml", "store-posix.yaml"])
def test_config_check_runs_without_torch_or_vllm(name: str) -> None:
    res = run_without_torch("config", "check", str(CONFIGS / name))
    assert res.returncode == 0, res.stderr
    assert res.stdout.rstrip().endswith("ok")


def test_a_sparse_method_without_torch_says_what_is_missing(tmp_path: Path) -> None:
    cfg = tmp_path / "sparse.yaml"
    cfg.write_text("ucm_sparse_config:\n  ESA: {sparse_ratio: 0.3}\n")
    res = run_without_torch("config", "check", str(cfg))
    assert res.returncode == 1
    assert "ucm_sparse_config" in res.stderr and "torch" in res.stderr


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("store-*.yaml")), ids=lambda p: p.name)
def test_store_configs_are_checked_as_store_configs(path: Path) -> None:
    res = CliRunner().invoke(main, ["config", "check", str(path)])
    assert res.exit_code == 0, res.output
    assert res.output.startswith("store config") and "block_size" in res.output


def test_a_store_configs_bad_key_is_named_as_a_store_config_error(tmp_path: Path) -> None:
    cfg = tmp_path / "store.yaml"
    cfg.write_text(
        "store_pipeline: Posix\nstorage_backends: /tmp/kv\nblock_size: 65536\nio_thread: 4\n"
    )
    res = CliRunner().invoke(main, ["config", "check", str(cfg)])
    assert res.exit_code == 1
    assert "store config" in res.output and "did you mean 'io_threads'" in res.output


def test_kind_overrides_the_detection(tmp_path: Path) -> None:
    cfg = tmp_path / "store.yaml"
    cfg.write_text("store_pipeline: Posix\nstorage_backends: /tmp/kv\n")
    # As a store config it lacks the block geometry a store needs.
    store = CliRunner().invoke(main, ["config", "check", "--kind", "store", str(cfg)])
    assert store.exit_code == 1 and "block_size" in store.output, store.output
    # As a connector config it is complete: the connector sets the geometry.
    conn = CliRunner().invoke(main, ["config", "check", "--kind", "connector", str(cfg)])
    assert conn.exit_code == 0 and "store.storage_backends" in conn.output, conn.output
    # Geometry in a connector config is the connector's to set.
    geo = CONFIGS / "store-posix.yaml"
    res = CliRunner().invoke(main, ["config", "check", "--kind", "connector", str(geo)])
    assert res.exit_code == 1 and "block_size" in res.output
