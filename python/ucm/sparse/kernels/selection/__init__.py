"""Block selection ops: representatives, block scores, KVStar votes, SRP codes.

Each op runs its Triton kernel (:mod:`.jit`, launched by :mod:`.launchers`)
or its torch reference (:mod:`.reference`, where shapes and semantics are
documented), as ``impl`` says (:mod:`ucm.sparse.kernels.dispatch`).
"""

from __future__ import annotations

from types import ModuleType

import torch

from ucm.sparse.kernels.dispatch import Impl, launchers_of, use_triton
from ucm.sparse.kernels.selection import reference
from ucm.sparse.kernels.selection.reference import (
    FORCED_SCORE,
    INVALID_SCORE,
    Candidates,
    HammingBatch,
    KeyBlocks,
    dense_attention_weights,
    group_mean_query,
    srp_projection,
)

_launchers = launchers_of(__name__)


def _impl(impl: Impl, t: torch.Tensor) -> ModuleType:
    """The module whose op runs on tensors like ``t``: the launchers or the reference."""
    return _launchers if use_triton(impl, t) else reference


def block_representatives(
    k_cache: torch.Tensor,
    block_ids: torch.Tensor,
    num_tokens: torch.Tensor,
    tokens_per_rep: int | None = None,
    channels: torch.Tensor | None = None,
    impl: Impl = "auto",
) -> torch.Tensor:
    """``[n, M, H_kv, D']`` fp32 sub-block mean keys (see the reference)."""
    blocks = KeyBlocks(k_cache, block_ids, num_tokens, tokens_per_rep, channels)
    return _impl(impl, k_cache).block_representatives(blocks)


def block_scores_dot(
    q: torch.Tensor,
    rep_pool: torch.Tensor,
    rep_table: torch.Tensor,
    num_reps: torch.Tensor,
    impl: Impl = "auto",
) -> torch.Tensor:
    """``[S, n_max]`` ESA scores (see the reference)."""
    return _impl(impl, q).block_scores_dot(q, Candidates(rep_pool, rep_table, num_reps))


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
    cands = Candidates(rep_pool, rep_table, num_reps)
    return _impl(impl, q).kvstar_vote_scores(q, cands, channels, scale)


def srp_encode(x: torch.Tensor, proj: torch.Tensor, impl: Impl = "auto") -> torch.Tensor:
    """``[..., H, D] -> [..., H, nbits // 32]`` int32 sign codes (see the reference)."""
    if use_triton(impl, x) and x.dim() >= 2:
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
    _impl(impl, k).srp_encode_to_cache(k, proj, code_cache, slot_mapping)


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
    batch = HammingBatch(q_codes, k_code_cache, block_table, seq_lens, sink_blocks, recent_blocks)
    return hamming_scores(batch, impl)


def hamming_scores(batch: HammingBatch, impl: Impl = "auto") -> torch.Tensor:
    """:func:`block_scores_hamming` of a batch already bundled."""
    return _impl(impl, batch.q_codes).block_scores_hamming(batch)


__all__ = [
    "FORCED_SCORE",
    "INVALID_SCORE",
    "Candidates",
    "HammingBatch",
    "KeyBlocks",
    "block_representatives",
    "block_scores_dot",
    "block_scores_hamming",
    "dense_attention_weights",
    "group_mean_query",
    "hamming_scores",
    "kvstar_vote_scores",
    "srp_encode",
    "srp_encode_to_cache",
    "srp_projection",
]
