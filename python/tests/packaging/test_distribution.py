"""One distribution name everywhere: PyPI's ``ucm`` is another project, so
ours is ``ucm-kvcache`` (import name and command stay ``ucm``)."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

from support.docs import text as docs_text

import ucm
import ucm_kvcache

ROOT = Path(__file__).resolve().parents[3]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]


def test_the_package_and_its_guard_know_the_distribution_name() -> None:
    assert PROJECT["name"] == ucm.__distribution__ == ucm_kvcache.DISTRIBUTION == "ucm-kvcache"
    assert PROJECT["version"] == ucm.__version__


def test_extras_refer_to_the_project_by_its_name() -> None:
    for extra, reqs in PROJECT["optional-dependencies"].items():
        for req in reqs:
            if re.match(r"ucm\b", req):
                assert req.startswith(f"{PROJECT['name']}["), (extra, req)


def test_the_plugin_entry_point_lives_outside_ucm_and_ships() -> None:
    (target,) = PROJECT["entry-points"]["vllm.general_plugins"].values()
    assert target.split(".")[0] == "ucm_kvcache"
    assert PYPROJECT["tool"]["maturin"]["python-packages"] == ["ucm_kvcache"]


def test_version_prints_the_distribution_name() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "ucm", "--version"], capture_output=True, text=True, check=True
    )
    assert res.stdout == f"ucm-kvcache {PROJECT['version']}\n"


def test_the_documented_wheel_build_is_the_stripped_profile() -> None:
    # `maturin build --release` would override the profile below with the
    # release one, which keeps debug info (a 37 MB extension against 10).
    cargo = tomllib.loads((ROOT / "Cargo.toml").read_text())
    assert cargo["profile"]["dist"]["strip"] is True
    assert cargo["profile"]["dist"].get("debug", 0) in (0, False)
    assert PYPROJECT["tool"]["maturin"]["profile"] == "dist"
    builds = re.findall(r"^maturin build.*$", docs_text(), re.M)
    assert builds and all("--profile dist" in b and "--release" not in b for b in builds), builds
