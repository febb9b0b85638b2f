"""The ``ucm`` command: serve's vLLM command line, config checks with the
connector's messages, the early check vLLM runs as a plugin, and bench."""

from __future__ import annotations

import importlib.metadata
import json
import logging
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from support.seed_yaml import seed_config

from ucm.cli import main
from ucm.cli.serve_cmd import build_vllm_args, cpu_build, cpu_kv_bytes, vllm_command
from ucm.integration.vllm.config import resolve_config
from ucm.integration.vllm.plugin import check_early, transfer_config_from_argv
from ucm.shared.config import ConfigError


def test_help_everywhere() -> None:
    runner = CliRunner()
    for args in (
        [],
        ["serve"],
        ["store"],
        ["config"],
        ["config", "check"],
        ["config", "keys"],
        ["bench"],
        ["model"],
        ["model", "fetch"],
    ):
        res = runner.invoke(main, [*args, "--help"])
        assert res.exit_code == 0, (args, res.output)
        assert "Usage:" in res.output
    res = subprocess.run([sys.executable, "-m", "ucm", "--help"], capture_output=True, text=True)
    assert res.returncode == 0 and "serve" in res.stdout


def test_serve_wires_the_connector_and_a_cpu_kv_size(tmp_path: Path) -> None:
    cfg = seed_config(tmp_path)
    argv, env = build_vllm_args(
        "m", ("--port", "8001"), config_file=str(cfg), storage=None, layerwise=False, cpu=True
    )
    assert argv[:4] == ["serve", "m", "--port", "8001"]
    transfer = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert transfer["kv_connector"] == "UCMConnector"
    assert int(argv[argv.index("--kv-cache-memory-bytes") + 1]) == cpu_kv_bytes()
    assert env["UCM_CONFIG_FILE"] == str(cfg.resolve())
    # What the user gives is kept; a GPU build gets no CPU cache size.
    argv, _ = build_vllm_args(
        "m",
        ("--kv-cache-memory-bytes", "123", "--kv-transfer-config", "{}"),
        config_file=None,
        storage="/d",
        layerwise=True,
        cpu=True,
    )
    assert argv.count("--kv-cache-memory-bytes") == 1 and argv.count("--kv-transfer-config") == 1
    argv, _ = build_vllm_args("m", (), config_file=None, storage="/d", layerwise=True, cpu=False)
    assert "--kv-cache-memory-bytes" not in argv
    extra = json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    assert extra == {"storage_backends": "/d", "use_layerwise": True}
    res = CliRunner().invoke(main, ["serve", "m", "--dry-run", "--storage", "/d"])
    assert res.exit_code == 0 and " serve m " in res.output


def test_dry_run_prints_the_command_that_runs_vllm_here() -> None:
    """The CPU build's ``vllm`` script fails before it parses anything (it
    looks for a ``vllm`` distribution); there the line is our wrapper."""
    res = CliRunner().invoke(main, ["serve", "m", "--dry-run"])
    words = shlex.split(res.output.splitlines()[-1])
    prefix = words[: words.index("serve")]
    assert prefix == vllm_command()
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        assert cpu_build()
        assert prefix == [sys.executable, "-m", "ucm.integration.vllm.cli"]
    else:
        assert prefix == ["vllm"]
    # e2e/test_vllm_serve.py starts a server with the line.


def test_config_check_accepts_the_design_documents_yaml(tmp_path: Path) -> None:
    res = CliRunner().invoke(main, ["config", "check", str(seed_config(tmp_path))])
    assert res.exit_code == 0, res.output
    assert "store.buffer_number" in res.output and f"YAML {tmp_path}" in res.output


def test_config_check_fails_with_the_connectors_message(tmp_path: Path) -> None:
    cfg = seed_config(tmp_path, metrics=False)
    res = CliRunner().invoke(main, ["config", "check", str(cfg)])
    assert res.exit_code == 1
    assert "metrics_config_path" in res.output and str(tmp_path) in res.output
    res = CliRunner().invoke(main, ["config", "check", "--extra", '{"use_layerwsie": true}'])
    assert res.exit_code == 1
    assert "did you mean 'use_layerwise'?" in res.output
    # Keys the connector sets from the model are not offered to users.
    valid = res.output.split("valid keys:")[1]
    assert "block_size" not in valid and "device_id" not in valid


def test_misspelled_environment_variables_are_named(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        resolve_config({}, env={"UCM_USE_LAYERWSIE": "1"})
    text = caplog.text
    assert "UCM_USE_LAYERWSIE" in text and "UCM_USE_LAYERWISE" in text


def test_vllm_plugin_checks_the_command_line_before_anything_loads(tmp_path: Path) -> None:
    good = {"kv_connector": "UCMConnector", "kv_connector_extra_config": {"use_layerwise": True}}
    argv = ["vllm", "serve", "m", "--kv-transfer-config", json.dumps(good)]
    assert transfer_config_from_argv(argv) == good
    check_early(argv)  # fine
    bad = {"kv_connector": "UCMConnector", "kv_connector_extra_config": {"io_thread": 4}}
    with pytest.raises(SystemExit, match=r"UCM config error.*io_thread.*did you mean 'io_threads'"):
        check_early(["vllm", "serve", "m", f"--kv-transfer-config={json.dumps(bad)}"])
    # Another connector's config is none of its business.
    check_early(["vllm", "serve", "m", "--kv-transfer-config", '{"kv_connector": "Other"}'])
    with pytest.raises(ConfigError):
        resolve_config({"io_thread": 4}, env={})


def test_bench_reports_the_store_against_the_disk(tmp_path: Path) -> None:
    res = CliRunner().invoke(
        main, ["bench", str(tmp_path), "--mib", "8", "--rounds", "1", "--buffered"]
    )
    assert res.exit_code == 0, res.output
    assert "dump" in res.output and "disk write" in res.output
    assert list(tmp_path.iterdir()) == [], "the scratch directory stays"


def _proxy_series() -> set[str]:
    """The sample names ``ucm proxy`` serves on its /metrics."""
    from ucm.integration.vllm.proxy_metrics import ProxyMetrics

    return {s.name for fam in ProxyMetrics().registry.collect() for s in fam.samples}


def test_grafana_dashboard_uses_only_metrics_ucm_exports() -> None:
    """Every series the dashboard names is one the engines' connector or
    ``ucm proxy`` exports, and the P/D series are all on it."""
    import re

    from ucm.shared.metrics import COUNTERS, GAUGES, HISTOGRAMS

    dash = json.loads((Path(__file__).parents[3] / "configs" / "grafana-ucm.json").read_text())
    exported = (
        {f"ucm_{k}_total" for k in COUNTERS}
        | {f"ucm_{k}" for k in GAUGES}
        | {f"ucm_{k}_bucket" for k in HISTOGRAMS}
        | _proxy_series()
    )
    used = {
        m
        for p in dash["panels"]
        for t in p.get("targets", [])
        for m in re.findall(r"ucm_\w+", t["expr"])
    }
    assert used and used <= exported, used - exported
    assert {f"ucm_{k}" for k in GAUGES} <= used
    pd = {f"ucm_{k}_total" for k in COUNTERS if k.startswith("handover_")}
    pd |= {f"ucm_{k}_bucket" for k in HISTOGRAMS if k.startswith("handover_")}
    proxy = {
        "ucm_proxy_requests_total",
        "ucm_proxy_requests_in_flight",
        "ucm_proxy_engine_errors_total",
        *(
            f"ucm_proxy_{k}_bucket"
            for k in (
                "prefill_duration_seconds",
                "decode_first_byte_seconds",
                "decode_duration_seconds",
                "request_duration_seconds",
            )
        ),
    }
    assert pd | proxy <= used, (pd | proxy) - used


def test_grafana_dashboard_panels_are_laid_out_apart() -> None:
    """Unique ids, one data source, and no two panels on the same cells."""
    dash = json.loads((Path(__file__).parents[3] / "configs" / "grafana-ucm.json").read_text())
    panels = dash["panels"]
    ids = [p["id"] for p in panels]
    assert len(set(ids)) == len(ids), ids
    for p in panels:
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
            assert [t["refId"] for t in p["targets"]] == [
                chr(ord("A") + i) for i in range(len(p["targets"]))
            ]
    cells: dict[tuple[int, int], str] = {}
    for p in panels:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, (p["title"], cells.get((x, y)))
                cells[(x, y)] = p["title"]
