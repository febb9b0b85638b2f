"""ReRoPE end to end on vLLM's CPU build: a 512-position model serves a 2k-token prompt.

The engine runs in a child process (``rerope_vllm_check.py``) so vLLM's
global state never leaks into the test process. Checks:

* vLLM with ReRoPE produces the same greedy tokens (and first-token log
  probability) as the torch reference stack with ReRoPE on the same weights;
* after ``uninstall`` vLLM produces the reference's plain-RoPE tokens, which
  differ: the patch really changes the attention, and removes cleanly;
* the K2 cache costs half the KV-cache bytes;
* through the UCM connector config (``ucm_sparse_config: {ReRoPE: ...}``,
  no ``install_rerope`` call) the same prompt gives the reference's ReRoPE
  tokens, computed and again with its blocks loaded from the store (K2 of
  loaded blocks is derived from their K).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from support.engines import run_check_script

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"
)


def run_check(tmp_path: Path, *args: str) -> dict:
    return run_check_script(HERE / "rerope_vllm_check.py", *args, cwd=tmp_path, timeout=600)


def test_rerope_serves_2k_prompt_on_512_position_model(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    model_dir = request.config.cache.mkdir("ucm-rerope-tiny512")  # reused across runs
    r = run_check(tmp_path, str(model_dir))
    assert json.loads((model_dir / "config.json").read_text())["max_position_embeddings"] == 512
    assert r["prompt_len"] == 2048 and r["same_rotary_table"]
    assert r["layers"] == ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    assert r["calls"]["rerope"] == 2 * 8  # 2 layers x (prefill + 7 decode steps)
    assert r["memory"]["overhead"] == 0.5
    assert r["rerope_tokens"] == r["ref_rerope_tokens"]
    assert abs(r["rerope_first_logprob"] - r["ref_rerope_first_logprob"]) < 1e-3
    assert r["native_tokens"] == r["ref_plain_tokens"]
    assert r["rerope_tokens"] != r["native_tokens"]


def test_rerope_through_connector_config(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """``ucm_sparse_config: {ReRoPE: ...}`` in the UCM connector config installs ReRoPE
    (no ``install_rerope`` call): the 2k prompt gives the reference's ReRoPE
    tokens, computed and then again with its prefix loaded from the store."""
    model_dir = request.config.cache.mkdir("ucm-rerope-tiny512")
    r = run_check(tmp_path, str(model_dir), "--connector", str(tmp_path / "store"))
    assert r["prompt_len"] == 2048
    assert r["layers"] == ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    first, second = r["runs"]
    assert first["cached"] == 0 and first["rebuilt_blocks"] == 0
    # all 64 blocks loaded (vLLM recomputes the last prompt token), K2 derived for each
    assert second["cached"] == 2047 and second["rebuilt_blocks"] == 64
    for run in r["runs"]:
        assert run["tokens"] == r["ref_tokens"]
        assert abs(run["first_logprob"] - r["ref_first_logprob"]) < 1e-3
