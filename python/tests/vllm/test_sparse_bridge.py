"""The sparse bridge's choices that need no engine: no bridge without a
method, version and config errors at engine start, the method built from the
model the vLLM config describes, per-step request facts."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ucm.integration.vllm.compat import UnsupportedVllmError
from ucm.integration.vllm.sparse.bridge import create_bridge, sparse_spec
from ucm.integration.vllm.sparse.model_info import sparse_model_info
from ucm.integration.vllm.sparse.steps import SparseReqStep
from ucm.shared.config import ConfigError
from ucm.sparse.base import layer_index


def _resolved(extra: dict[str, Any]) -> Any:
    from ucm.integration.vllm.config import resolve_config

    return resolve_config(extra, env={})


def test_no_sparse_config_means_no_bridge() -> None:
    assert sparse_spec(_resolved({})) is None
    # Nothing is created (not even a version check) without ucm_sparse_config.
    assert create_bridge(None, True, _resolved({}), None, version="0.1.0") is None


def test_unsupported_vllm_is_a_clear_error_at_engine_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("UCM_ALLOW_UNSUPPORTED_VLLM", raising=False)
    cfg = _resolved({"ucm_sparse_config": {"ESA": {"sparse_ratio": 0.3}}})
    with pytest.raises(UnsupportedVllmError, match=r"supports vLLM 0\.32\.x, 0\.33\.x.*0\.31\.2"):
        create_bridge(None, True, cfg, None, version="0.31.2")
    with pytest.raises(UnsupportedVllmError, match=r"0\.34\.0"):
        create_bridge(None, False, cfg, None, version="0.34.0")


def _vllm_config(max_position_embeddings: int, max_batched: int) -> Any:
    """What the bridge reads of a ``VllmConfig`` (a stand-in: no engine)."""
    model = SimpleNamespace(
        max_model_len=4096,
        dtype=torch.float16,
        hf_config=SimpleNamespace(max_position_embeddings=max_position_embeddings),
        get_num_layers=lambda pc: 4,
        get_num_attention_heads=lambda pc: 8,
        get_num_kv_heads=lambda pc: 2,
        get_head_size=lambda: 64,
    )
    return SimpleNamespace(
        model_config=model,
        parallel_config=None,
        cache_config=SimpleNamespace(block_size=16),
        scheduler_config=SimpleNamespace(max_num_seqs=8, max_num_batched_tokens=max_batched),
    )


def test_the_method_is_built_from_the_model_the_vllm_config_describes() -> None:
    vc = _vllm_config(max_position_embeddings=2048, max_batched=256)
    cfg = _resolved({"ucm_sparse_config": {"ReRoPE": {}}})
    worker = create_bridge(vc, False, cfg, None, version="0.32.0")
    try:
        assert worker.agent.model_info == worker.model_info == sparse_model_info(vc)
        assert worker.agent.config.training_length == 2048  # the model's trained context
    finally:
        worker.shutdown()
    side = SimpleNamespace(save_enabled=True)
    cfg = _resolved({"ucm_sparse_config": {"Blend": {}}})
    scheduler = create_bridge(vc, True, cfg, side, version="0.32.0")
    try:
        assert scheduler.agent.model_info == sparse_model_info(vc)
        assert side.extension.agent is scheduler.agent and side.extension.max_batched == 256
    finally:
        scheduler.shutdown()


def test_sparse_config_errors_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"ucm_sparse_config\.ESA\.sparse_ratio"):
        sparse_spec(_resolved({"ucm_sparse_config": {"ESA": {"sparse_ratio": 1.5}}}))
    with pytest.raises(ConfigError, match="unknown sparse method 'Nope'"):
        sparse_spec(_resolved({"ucm_sparse_config": {"Nope": {}}}))


def test_step_facts() -> None:
    prefill_end = SparseReqStep("r", prompt_len=100, start=64, num_tokens=36, last_block=7)
    assert prefill_end.finishes_prefill and prefill_end.decode_step == 0
    chunk = SparseReqStep("r", prompt_len=100, start=0, num_tokens=64, last_block=3)
    assert not chunk.finishes_prefill
    first_decode = SparseReqStep("r", prompt_len=100, start=100, num_tokens=1, last_block=7)
    assert first_decode.decode_step == 1 and not first_decode.finishes_prefill
    assert layer_index("model.layers.11.self_attn.attn") == 11
    with pytest.raises(ValueError):
        layer_index("attn")


def test_sparse_needs_piecewise_cuda_graphs() -> None:
    # The attention hooks run in Python: full CUDA graphs must leave attention out.
    from ucm.integration.vllm.ucm_connector import UCMConnector

    assert UCMConnector.requires_piecewise_for_cudagraph({"ucm_sparse_config": {"ESA": {}}})
    assert not UCMConnector.requires_piecewise_for_cudagraph({})
