"""PyPI's unrelated ``ucm`` package ahead of ours on the path: vLLM's plugin
and the connector's import stop with the conflict and its fix, not with
``No module named 'ucm.integration'``. Each case runs in a child process
whose ``sys.path`` has a stand-in of the other package first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

PYTHON_SRC = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((PYTHON_SRC.parent / "pyproject.toml").read_text())["project"]
UCM_ARGV = [
    "vllm",
    "serve",
    "MODEL",
    "--kv-transfer-config",
    json.dumps(
        {
            "kv_connector": "UCMConnector",
            "kv_connector_module_path": "ucm.integration.vllm.ucm_connector",
            "kv_role": "kv_both",
        }
    ),
]


@pytest.fixture
def foreign(tmp_path: Path) -> Path:
    """A directory holding another project's top-level ``ucm`` package."""
    pkg = tmp_path / "foreign" / "ucm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""Urwid rendered Connection Manager (a stand-in)."""\n')
    (pkg / "ui.py").write_text("SCREEN = 'urwid'\n")
    return pkg.parent


def run(code: str, *path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, [*path, PYTHON_SRC]))}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_vllm_plugin_stops_a_ucm_command_line_with_the_conflict(foreign: Path) -> None:
    res = run(
        f"""
        from ucm_kvcache.vllm_plugin import check_early
        check_early({UCM_ARGV!r})
        """,
        foreign,
    )
    assert res.returncode == 1, res.stdout + res.stderr
    assert "UCM install error" in res.stderr
    assert str(foreign / "ucm") in res.stderr
    assert "pip uninstall ucm" in res.stderr
    assert "No module named" not in res.stderr


def test_vllm_loads_the_plugin_by_its_entry_point_and_stops(foreign: Path, tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    # The metadata pip writes for the entry points of pyproject.toml.
    plugins = PYPROJECT["entry-points"]["vllm.general_plugins"]
    info = tmp_path / "site" / "ucm_kvcache-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {PYPROJECT['name']}\nVersion: 0.1.0\n"
    )
    lines = [f"{name} = {value}" for name, value in plugins.items()]
    (info / "entry_points.txt").write_text("[vllm.general_plugins]\n" + "\n".join(lines) + "\n")
    res = run(
        f"""
        import sys
        sys.argv = {UCM_ARGV!r}
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        """,
        foreign,
        info.parent,
    )
    assert res.returncode == 1, res.stdout + res.stderr[-3000:]
    assert "UCM install error" in res.stderr
    assert "pip uninstall ucm" in res.stderr


def test_connector_import_names_the_conflict(foreign: Path) -> None:
    # The Python LLM API: the command line names no connector, vLLM loads the
    # plugin, then imports the connector by its module path.
    res = run(
        """
        import importlib
        from ucm_kvcache.vllm_plugin import check_early
        check_early(["python", "app.py"])
        import ucm.ui  # the other package's own modules still import
        try:
            importlib.import_module("ucm.integration.vllm.ucm_connector")
        except Exception as e:
            print(type(e).__name__, e)
        """,
        foreign,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("ForeignUcmError the `ucm` package"), res.stdout
    assert "pip uninstall ucm" in res.stdout


def test_our_ucm_passes_and_the_config_is_still_checked() -> None:
    bad = [
        *UCM_ARGV[:-1],
        json.dumps(
            {**json.loads(UCM_ARGV[-1]), "kv_connector_extra_config": {"use_layerwsie": True}}
        ),
    ]
    res = run(
        f"""
        import sys
        from ucm_kvcache.vllm_plugin import check_early
        check_early({UCM_ARGV!r})
        assert not any(type(f).__name__ == "ForeignUcmImportGuard" for f in sys.meta_path)
        print("ok")
        check_early({bad!r})
        """
    )
    assert res.stdout == "ok\n", res.stderr
    assert res.returncode == 1
    assert "use_layerwsie" in res.stderr
