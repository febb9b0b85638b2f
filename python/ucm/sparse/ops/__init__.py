"""Sparse-attention ops with Triton kernels and torch fallbacks.

Every op takes ``impl``:

* ``"auto"`` (default): the Triton kernel when Triton is installed and can run
  on the tensors (CUDA tensors, or any tensor when the kernels were created
  under ``TRITON_INTERPRET=1``), else the torch reference;
* ``"triton"``: the kernel, or :class:`RuntimeError` if it can't run;
* ``"torch"``: the reference in :mod:`ucm.sparse.ops.reference`.

Shapes and semantics are documented on the reference functions.
"""

from __future__ import annotations

from typing import Literal

import torch

from ucm.sparse.ops import reference
from ucm.sparse.ops.reference import (
    FORCED_SCORE,
    INVALID_SCORE,
    dense_attention_weights,
    group_mean_query,
    srp_projection,
)
from ucm.sparse.triton_utils import HAS_TRITON, INTERPRET

Impl = Literal["auto", "triton", "torch"]

if HAS_TRITON:
    from ucm.sparse.ops import launchers as _launchers
else:  # pragma: no cover - depends on the environment
    _launchers = None


def triton_usable(t: torch.Tensor) -> bool:
    """Whether the Triton kernels can run on tensors on ``t``'s device."""
    if not HAS_TRITON:
        return False
    return t.is_cuda or INTERPRET


def _use_triton(impl: Impl, t: torch.Tensor) -> bool:
    if impl == "torch":
        return False
    if impl == "triton":
        if not triton_usable(t):
            raise RuntimeError(
                "Triton kernels cannot run here: "
                + ("triton is not installed" if not HAS_TRITON else f"tensors on {t.device}")
                + " (set TRITON_INTERPRET=1 before importing ucm.sparse to run them on CPU)"
            )
        return True
    if impl != "auto":
        raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")
    return triton_usable(t)


def block_representatives(
    k_cache: torch.Tensor,
    block_ids: torch.Tensor,
    num_tokens: torch.Tensor,
    tokens_per_rep: int | None = None,
    channels: torch.Tensor | None = None,
    impl: Impl = "auto",
) -> torch.Tensor:
    """``[n, M, H_kv, D']`` fp32 sub-block mean keys (see the reference)."""
    mod = _launchers if _use_triton(impl, k_cache) else reference
    return mod.block_representatives(k_cache, block_ids, num_tokens, tokens_per_rep, channels)


def block_scores_dot(
    q: torch.Tensor,
    rep_pool: torch.Tensor,
    rep_table: torch.Tensor,
    num_reps: torch.Tensor,
    impl: Impl = "auto",
) -> torch.Tensor:
    """``[S, n_max]`` ESA scores (see the reference)."""
    mod = _launchers if _use_triton(impl, q) else reference
    return mod.block_scores_dot(q, rep_pool, rep_table, num_reps)


def kvstar_vote_scores(
    q: torch.Tensor,
    rep_pool: torch.Tensor,
    rep_table: torch.Tensor,
    num_reps: torch.Tensor,
    channels: torch.Tensor,
    scale: float,
    impl: Impl = "auto",
) -> torch.Tensor:
    """``[S, n_max]`` KVStar votes (see the reference)."""
    mod = _launchers if _use_triton(impl, q) else reference
    return mod.kvstar_vote_scores(q, rep_pool, rep_table, num_reps, channels, scale)


def srp_encode(x: torch.Tensor, proj: torch.Tensor, impl: Impl = "auto") -> torch.Tensor:
    """``[..., H, D] -> [..., H, nbits // 32]`` int32 sign codes (see the reference)."""
    if _use_triton(impl, x) and x.dim() >= 2:
        return _launchers.srp_encode(x, proj)
    return reference.srp_encode(x, proj)


def srp_encode_to_cache(
    k: torch.Tensor,
    proj: torch.Tensor,
    code_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    impl: Impl = "auto",
) -> None:
    """Writes key codes into the paged code cache (see the reference)."""
    mod = _launchers if _use_triton(impl, k) else reference
    mod.srp_encode_to_cache(k, proj, code_cache, slot_mapping)


def block_scores_hamming(
    q_codes: torch.Tensor,
    k_code_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sink_blocks: int = 1,
    recent_blocks: int = 4,
    impl: Impl = "auto",
) -> torch.Tensor:
    """``[S, max_blocks]`` int32 GSA scores, lower is better (see the reference)."""
    mod = _launchers if _use_triton(impl, q_codes) else reference
    return mod.block_scores_hamming(
        q_codes, k_code_cache, block_table, seq_lens, sink_blocks, recent_blocks
    )


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
    mod = _launchers if _use_triton(impl, q) else reference
    return mod.paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, scale)


__all__ = [
    "FORCED_SCORE",
    "HAS_TRITON",
    "INVALID_SCORE",
    "Impl",
    "block_representatives",
    "block_scores_dot",
    "block_scores_hamming",
    "dense_attention_weights",
    "group_mean_query",
    "kvstar_vote_scores",
    "paged_decode_attention",
    "srp_encode",
    "srp_encode_to_cache",
    "srp_projection",
    "triton_usable",
]
