"""Helpers of the vLLM connector tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from ucm.vllm_demo.engine_process import EngineProcess, engine_env

ROOT = Path(__file__).resolve().parents[3]


class Engine(EngineProcess):
    """A vLLM engine (``ucm.vllm_demo.engine_process``) in a child process;
    test engines use a 2048-token context and a 64 MiB KV cache."""

    def __init__(self, config: dict, log: Path, env: dict[str, str] | None = None) -> None:
        super().__init__(config, log, env=env or engine_env(), cwd=log.parent)


def record_reference(engine: Engine, world: dict[str, Any], max_tokens: int) -> None:
    """Generates every prompt batch of ``world["prompts"]`` on ``engine`` into
    ``world["ref"]`` (the tokens later engines must reproduce), then closes it."""
    for name, batch in world["prompts"].items():
        out = engine.generate(batch, max_tokens)
        assert all(len(t) == max_tokens for t in out["tokens"])
        world["ref"][name] = out["tokens"]
    engine.close()


def run_check_script(script: Path, *args: str, cwd: Path, timeout: float) -> dict[str, Any]:
    """Runs an engine check script in a child process (``python/`` and the
    tests' ``support`` importable, no stray ``UCM_*`` settings); returns the
    JSON of its ``@@RESULT@@`` line."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p
        for p in (str(ROOT / "python"), str(ROOT / "python" / "tests"), env.get("PYTHONPATH"))
        if p
    )
    for k in [k for k in env if k.startswith("UCM_")]:
        del env[k]
    proc = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(cwd),
        timeout=timeout,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("@@RESULT@@ ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1].split(" ", 1)[1])


__all__ = ["ROOT", "Engine", "engine_env", "run_check_script"]
