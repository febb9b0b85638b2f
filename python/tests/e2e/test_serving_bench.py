"""CI-sized run of the serving benchmark (``benches/serving.py``), so it can't
rot: vLLM alone and ucm's default store, two users asking about one shared
document, one round, the tiny model. vLLM's own prefix cache is off, so the
second user's hit can only come from ucm."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from support.engines import ROOT, engine_env


def test_serving_bench_smoke(tiny_model: Path, tmp_path: Path) -> None:
    env = engine_env()
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # servers run as users run them
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        str(ROOT / "benches" / "serving.py"),
        "--model",
        str(tiny_model),
        "--systems",
        "vllm",
        "ucm",
        "--workload",
        "shared-doc",
        "--users",
        "2",
        "--users-per-doc",
        "2",
        "--rounds",
        "1",
        "--concurrency",
        "1",
        "--doc-tokens",
        "256",
        "--server-arg=--no-enable-prefix-caching",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    res = json.loads((out / "results.json").read_text())
    runs = {r["system"]: r for r in res["runs"]}
    assert set(runs) == {"vllm", "ucm"}
    for run in runs.values():
        assert [x["error"] for x in run["results"]] == [None, None]
        assert all(len(x["tokens"]) == 16 for x in run["results"])
    # The second user's document comes from ucm, and every token is vLLM's.
    reuse = [x for x in runs["ucm"]["results"] if x["reuse"]]
    assert len(reuse) == 1 and reuse[0]["cached_tokens"] >= 256 - 32
    assert runs["ucm"]["extra"]["counters"]["ucm_load_blocks_total"] > 0
    ref = {(x["user"], x["rnd"]): x["tokens"] for x in runs["vllm"]["results"]}
    assert all(ref[(x["user"], x["rnd"])] == x["tokens"] for x in runs["ucm"]["results"])
    table = (out / "table.md").read_text()
    assert "| ucm |" in table and "| vllm |" in table
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "ttft.png").stat().st_size > 0
