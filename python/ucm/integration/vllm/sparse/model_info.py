"""vLLM's config described the way the sparse methods take it: :class:`SparseModelInfo`.

The methods in :mod:`ucm.sparse` know no engine; this is the one place that
reads a model and its KV layout out of a ``VllmConfig`` for them (duck-typed,
so it imports no vLLM and a test can hand it a stand-in).
"""

from __future__ import annotations

from typing import Any

import torch

from ucm.sparse.base import SparseModelInfo


def sparse_model_info(vllm_config: Any) -> SparseModelInfo:
    """Block size, layer and head counts, limits, dtype and device of a ``VllmConfig``."""
    mc = vllm_config.model_config
    pc = vllm_config.parallel_config
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", None)
    return SparseModelInfo(
        block_size=int(vllm_config.cache_config.block_size),
        num_layers=int(mc.get_num_layers(pc)),
        num_heads=int(mc.get_num_attention_heads(pc)),
        num_kv_heads=int(mc.get_num_kv_heads(pc)),
        head_dim=int(mc.get_head_size()),
        max_model_len=int(mc.max_model_len),
        max_num_seqs=int(vllm_config.scheduler_config.max_num_seqs),
        dtype=mc.dtype if isinstance(mc.dtype, torch.dtype) else torch.float32,
        device=str(device or "cpu"),
        max_position_embeddings=_max_position_embeddings(mc),
    )


def _max_position_embeddings(model_config: Any) -> int | None:
    # The HF config's value, which ``hf_overrides`` may have changed.
    v = getattr(getattr(model_config, "hf_config", None), "max_position_embeddings", None)
    return int(v) if v else None
