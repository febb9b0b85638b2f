"""Engines forked from one process that imported vLLM once
(:mod:`support.forker`, used by ``benches/quality.py``): each must behave
as an engine started in a new interpreter."""

from __future__ import annotations

import random
from pathlib import Path

from support.engines import Engine
from support.forker import EngineForker

from ucm.vllm_demo.engine_process import EngineProcess, engine_env


def test_forked_engines_match_a_fresh_process_and_share_the_store(
    tmp_path: Path, tiny_model: Path
) -> None:
    rng = random.Random(5)
    prompts = [[rng.randrange(10, 500) for _ in range(200)] for _ in range(3)]
    plain = {"model": str(tiny_model), "ucm": None}
    ref = Engine(plain, tmp_path / "fresh.log")
    try:
        expected = ref.generate(prompts, max_tokens=6)["tokens"]
    finally:
        ref.close()

    stored = {"model": str(tiny_model), "ucm": {"storage_backends": str(tmp_path / "store")}}
    with EngineForker(engine_env(), tmp_path / "forker.log") as forker:
        first = EngineProcess(stored, tmp_path / "a.log", cwd=tmp_path, forker=forker)
        try:
            out = first.generate(prompts, max_tokens=6)
            assert out["tokens"] == expected
            assert out["cached"] == [0, 0, 0]
        finally:
            first.close()
        assert first.proc.poll() is not None, "a closed engine's process must be gone"
        # A second engine forked from the same state: nothing of the first
        # is inherited but the store it saved to.
        second = EngineProcess(stored, tmp_path / "b.log", cwd=tmp_path, forker=forker)
        try:
            out = second.generate(prompts, max_tokens=6)
            assert out["tokens"] == expected
            assert all(c >= 192 for c in out["cached"]), out["cached"]
            assert "UCMConnector" in second.log_text(), "the engine's log must reach its file"
        finally:
            second.close()
    assert forker.proc.poll() is not None


def test_a_forked_engine_that_fails_to_start_says_why(tmp_path: Path) -> None:
    bad = {"model": str(tmp_path / "no-such-model"), "ucm": None}
    with EngineForker(engine_env(), tmp_path / "forker.log") as forker:
        try:
            EngineProcess(bad, tmp_path / "bad.log", cwd=tmp_path, forker=forker)
        except RuntimeError as e:
            assert "engine exited" in str(e) and "no-such-model" in str(e)
        else:
            raise AssertionError("an engine without a model must not start")
