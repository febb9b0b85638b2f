"""(ReRoPE) attention ops with Triton kernels and torch fallbacks.

``impl`` as in :mod:`ucm.sparse.ops`: ``"auto"`` runs the kernels where
Triton can (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``) and
the torch references elsewhere (e.g. vLLM's CPU build).
"""

from __future__ import annotations

import torch

from ucm.sparse.layout import cpu_kv_cache_views, flash_kv_cache_views
from ucm.sparse.ops import Impl, _use_triton
from ucm.sparse.rerope import reference
from ucm.sparse.rerope.reference import (
    default_q_positions,
    log_n_scale,
    rerope_attention_dense,
    rerope_prepare,
    write_kv,
)
from ucm.sparse.triton_utils import HAS_TRITON

if HAS_TRITON:
    from ucm.sparse.rerope import launchers as _launchers
else:  # pragma: no cover - depends on the environment
    _launchers = None


def kv_views(kv_layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(K, V)`` logical ``[NB, B, H, D]`` views of one layer's vLLM paged cache.

    Accepts the CPU backend's ``[NB, H, B, 2D]`` (K transposed inside each
    block) and the flash layout ``[2, NB, B, H, D]``.
    """
    if kv_layer.dim() == 4:
        return cpu_kv_cache_views(kv_layer)
    return flash_kv_cache_views(kv_layer)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    q_positions: torch.Tensor | None = None,
    scale: float | None = None,
    *,
    q_w: torch.Tensor | None = None,
    k2_cache: torch.Tensor | None = None,
    window: int | None = None,
    out: torch.Tensor | None = None,
    max_query_len: int | None = None,
    impl: Impl = "auto",
) -> torch.Tensor:
    """Position-causal (ReRoPE when ``window`` is set) attention over paged KV.

    See :func:`ucm.sparse.rerope.reference.paged_attention`. Decode-only
    batches (every sequence one query token) use the split-K decode kernel.
    """
    if not _use_triton(impl, q):
        return reference.paged_attention(
            q,
            k_cache,
            v_cache,
            block_table,
            seq_lens,
            query_start_loc,
            q_positions,
            scale,
            q_w=q_w,
            k2_cache=k2_cache,
            window=window,
            out=out,
        )
    s = seq_lens.numel()
    decode_only = q.shape[0] == s
    if decode_only:
        if max_query_len is None:
            qsl = query_start_loc.to(torch.long)
            decode_only = bool(((qsl[1:] - qsl[:-1]) == 1).all())
        else:
            decode_only = max_query_len == 1
    if decode_only:
        return _launchers.paged_decode_attention(
            q,
            k_cache,
            v_cache,
            block_table,
            seq_lens,
            q_positions,
            scale,
            q_w=q_w,
            k2_cache=k2_cache,
            window=window,
            out=out,
        )
    return _launchers.paged_prefill_attention(
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        query_start_loc,
        q_positions,
        scale,
        q_w=q_w,
        k2_cache=k2_cache,
        window=window,
        out=out,
        max_query_len=max_query_len,
    )


__all__ = [
    "default_q_positions",
    "kv_views",
    "log_n_scale",
    "paged_attention",
    "rerope_attention_dense",
    "rerope_prepare",
    "write_kv",
]
