"""``vllm serve`` (OpenAI server on 127.0.0.1, API server + engine core + worker
processes) with the connector flag: completions, and the ucm metrics on /metrics.

vLLM's own prefix cache is off (``--no-enable-prefix-caching``), so the second
identical request must come from the UCM store: one server exercises both
the save and the load path.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from support.engines import ROOT, engine_env
from support.tiny_serve import free_port, http, tiny_server_args

from ucm.cli import main

PROMPT = (
    "the cache of keys and values is stored on disk so that a later request with the same "
    "prefix loads it instead of computing it again every block has an id made from its "
    "tokens and the id of the block before it a store keeps blocks in files a scheduler "
    "asks how many blocks of a prompt are present and the workers load them layer by layer"
)


def samples(text: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("ucm_"):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("serve")
    port = free_port()
    extra = {"storage_backends": str(root / "store"), "store_pipeline": "Posix"}
    cmd = [
        sys.executable,
        "-m",
        "ucm.integration.vllm.cli",
        "serve",
        str(tiny_model),
        *tiny_server_args(port),
        "--kv-transfer-config",
        json.dumps(
            {
                "kv_connector": "UCMConnector",
                "kv_connector_module_path": "ucm.integration.vllm.ucm_connector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": extra,
            }
        ),
    ]
    with serving(cmd, root / "serve.log", port) as base:
        yield base, root / "serve.log"


@contextlib.contextmanager
def serving(cmd: list[str], log: Path, port: int, **env_extra: str) -> Iterator[str]:
    """Runs ``cmd`` (a server on ``port``) until its /health answers; yields
    its base URL and stops it afterwards."""
    env = engine_env()
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # the real thing: several processes
    env.update(env_extra)
    with open(log, "w") as logf:
        proc = subprocess.Popen(
            cmd,
            stdout=logf,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=str(ROOT),
            start_new_session=True,
        )
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 240
        while time.time() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited {proc.returncode}:\n{log.read_text()[-4000:]}")
            if http(base + "/health", timeout=5)[0] == 200:
                break
            time.sleep(1)
        else:
            proc.kill()
            pytest.fail(f"vllm serve did not start:\n{log.read_text()[-4000:]}")
        try:
            yield base
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def wait_for_metric(base: str, name: str, at_least: float, tries: int) -> dict[str, float]:
    """Polls /metrics (every 0.1 s, ``tries`` times) until ``name`` reaches
    ``at_least``; returns the last samples either way."""
    m: dict[str, float] = {}
    for _ in range(tries):
        m = samples(http(base + "/metrics")[1])
        if m.get(name, 0) >= at_least:
            break
        time.sleep(0.1)
    return m


def complete(base: str, prompt: str = PROMPT, control: dict | None = None) -> dict:
    body: dict = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
    }
    if control is not None:
        body["kv_transfer_params"] = control
    status, text = http(base + "/v1/completions", body)
    assert status == 200, text
    return json.loads(text)


def test_metrics_exist_at_zero_before_any_request(server: tuple[str, Path]) -> None:
    # Runs first (file order): nothing was served yet.
    base, _ = server
    m = samples(http(base + "/metrics")[1])
    for name in (
        "ucm_save_blocks_total",
        "ucm_load_blocks_total",
        "ucm_save_failed_blocks_total",
        "ucm_lookup_tokens_total",
        "ucm_store_errors_total",
    ):
        assert m.get(name) == 0, (name, sorted(m))
    assert m["ucm_store_healthy"] == 1


def test_serve_completions_and_metrics(server: tuple[str, Path]) -> None:
    base, _ = server
    first = complete(base)
    n_prompt = first["usage"]["prompt_tokens"]
    assert n_prompt >= 64
    # The save of the first request completes asynchronously.
    m = wait_for_metric(base, "ucm_save_blocks_total", n_prompt // 32, tries=100)
    assert m.get("ucm_save_blocks_total", 0) == n_prompt // 32
    second = complete(base)
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    m = wait_for_metric(base, "ucm_load_blocks_total", 1, tries=50)
    full = n_prompt // 32
    assert m["ucm_load_blocks_total"] == full
    assert m["ucm_lookup_tokens_total"] == 2 * n_prompt
    assert m["ucm_lookup_hit_tokens_total"] == min(full * 32, n_prompt - 1)
    assert 0 < m["ucm_lookup_hit_rate"] <= 1
    assert m["ucm_load_duration_seconds_count"] >= 1 and m["ucm_load_duration_seconds_sum"] > 0
    assert m["ucm_save_duration_seconds_count"] >= 1 and m["ucm_save_duration_seconds_sum"] > 0
    assert m["ucm_load_speed_gbps"] > 0 and m["ucm_save_speed_gbps"] > 0
    assert m["ucm_load_bytes_total"] == m["ucm_save_bytes_total"] > 0
    assert m.get("ucm_load_failed_blocks_total", 0) == 0
    assert m["ucm_store_healthy"] == 1
    # Histograms have buckets.
    text = http(base + "/metrics")[1]
    assert "ucm_load_duration_seconds_bucket{" in text and 'le="+Inf"' in text


def wait_metric(base: str, name: str, at_least: float) -> dict[str, float]:
    m: dict[str, float] = {}
    for _ in range(100):
        m = samples(http(base + "/metrics")[1])
        if m.get(name, 0) >= at_least:
            break
        time.sleep(0.1)
    return m


def test_per_request_control_through_kv_transfer_params(server: tuple[str, Path]) -> None:
    """A request can skip loading, skip saving, or cap what it loads."""
    base, _ = server
    prompt = PROMPT.replace("cache", "store") + " once more with other words"
    before = samples(http(base + "/metrics")[1])
    # Not saved: the same prompt again finds nothing.
    first = complete(base, prompt, {"ucm_skip_save": True})
    n = first["usage"]["prompt_tokens"] // 32
    time.sleep(1.0)
    m = samples(http(base + "/metrics")[1])
    assert m["ucm_save_blocks_total"] == before["ucm_save_blocks_total"]
    # Saved now.
    complete(base, prompt)
    m = wait_metric(base, "ucm_save_blocks_total", before["ucm_save_blocks_total"] + n)
    assert m["ucm_save_blocks_total"] == before["ucm_save_blocks_total"] + n
    loads = m["ucm_load_blocks_total"]
    # Present, but this request computes its prompt.
    again = complete(base, prompt, {"ucm_skip_load": True})
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    time.sleep(0.5)
    assert samples(http(base + "/metrics")[1])["ucm_load_blocks_total"] == loads
    # At most one block (32 tokens) loaded; a bad value is ignored, not fatal.
    capped = complete(base, prompt, {"ucm_max_load_tokens": 40})
    assert capped["choices"][0]["text"] == first["choices"][0]["text"]
    m = wait_metric(base, "ucm_load_blocks_total", loads + 1)
    assert m["ucm_load_blocks_total"] == loads + 1
    complete(base, prompt, {"ucm_max_load_tokens": "lots"})
    m = wait_metric(base, "ucm_load_blocks_total", loads + 1 + n)
    assert m["ucm_load_blocks_total"] == loads + 1 + n


def test_the_design_documents_yaml_serves(tiny_model: Path, tmp_path: Path) -> None:
    """The design document's connector YAML (Cache|Posix with buffer_number,
    ESA, a metrics file next to it, layer-wise), verbatim but for the store
    directory, starts ``ucm serve`` and serves a completion twice, the
    second time loaded from the store."""
    from support.seed_yaml import seed_config

    cfg = seed_config(tmp_path)
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "ucm",
        "serve",
        str(tiny_model),
        "--ucm-config",
        str(cfg),
        *tiny_server_args(port),
    ]
    with serving(cmd, tmp_path / "serve.log", port) as base:
        first = complete(base)
        # The first request's save completes asynchronously.
        wait_for_metric(base, "ucm_save_blocks_total", 1, tries=100)
        second = complete(base)
        assert second["choices"][0]["text"] == first["choices"][0]["text"]
        m = wait_for_metric(base, "ucm_load_blocks_total", 1, tries=50)
        assert m.get("ucm_load_blocks_total", 0) > 0, m
    # `ucm serve` said what it was doing, and when it was ready (once).
    log = (tmp_path / "serve.log").read_text()
    assert "ucm serve: loading weights" in log
    assert log.count(f"ucm serve: ready: http://127.0.0.1:{port}/v1 (after ") == 1, log[-4000:]


def test_the_dry_run_line_serves(tiny_model: Path, tmp_path: Path) -> None:
    """What `ucm serve --dry-run` prints, run as it stands, serves (on
    vLLM's CPU build the `vllm` script itself fails at start-up)."""
    port = free_port()
    res = CliRunner().invoke(
        main,
        [
            "serve",
            str(tiny_model),
            "--dry-run",
            "--storage",
            str(tmp_path / "kv"),
            *tiny_server_args(port),
        ],
    )
    assert res.exit_code == 0, res.output
    cmd = shlex.split(res.output.splitlines()[-1])
    with serving(cmd, tmp_path / "serve.log", port) as base:
        assert complete(base)["usage"]["prompt_tokens"] >= 64
