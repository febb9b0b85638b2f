"""Attention over paged KV: decode over selected blocks, position-causal
prefill, ReRoPE's two-score attention.

One set of kernels (:mod:`.jit`) serves all three: ``window=None`` compiles
plain attention (sparse decode, Blend's recomputed rows), a window the
ReRoPE variant. ``impl`` as in :mod:`ucm.sparse.kernels.dispatch`: the
kernels where Triton can run, the torch references (:mod:`.reference`)
elsewhere (e.g. vLLM's CPU build).
"""

from __future__ import annotations

import torch

from ucm.sparse.kernels.attention import reference
from ucm.sparse.kernels.attention.reference import AttentionBatch, default_q_positions, write_kv
from ucm.sparse.kernels.dispatch import Impl, launchers_of, use_triton

_launchers = launchers_of(__name__)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    impl: Impl = "auto",
) -> torch.Tensor:
    """``[S, H_q, D]`` decode attention over paged (selected) blocks (see the reference)."""
    batch = AttentionBatch(q, k_cache, v_cache, block_table, seq_lens, scale=scale)
    if use_triton(impl, q):
        return _launchers.paged_decode_attention(batch)
    return reference.paged_decode_attention(batch)


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

    See :func:`ucm.sparse.kernels.attention.reference.paged_attention`. Decode-only
    batches (every sequence one query token) use the split-K decode launch.
    """
    batch = AttentionBatch(
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
    if not use_triton(impl, q):
        return reference.paged_attention(batch)
    decode_only = q.shape[0] == seq_lens.numel()
    if decode_only:
        if max_query_len is None:
            qsl = query_start_loc.to(torch.long)
            decode_only = bool(((qsl[1:] - qsl[:-1]) == 1).all())
        else:
            decode_only = max_query_len == 1
    if decode_only:
        return _launchers.paged_decode_attention(batch)
    return _launchers.paged_prefill_attention(batch, max_query_len)


__all__ = [
    "AttentionBatch",
    "default_q_positions",
    "paged_attention",
    "paged_decode_attention",
    "write_kv",
]
