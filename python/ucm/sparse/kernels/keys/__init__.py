"""Ops on cached keys: delta-RoPE (move paged keys to other positions) and
the deviation of fresh keys from cached ones.

Blend moves reused chunks with :func:`delta_rope` and finds the tokens to
recompute with :func:`kv_deviation`; ReRoPE un-rotates loaded keys with
:func:`delta_rope`. Triton kernels (:mod:`.jit`) or torch references
(:mod:`.reference`), as ``impl`` says (:mod:`ucm.sparse.kernels.dispatch`).
"""

from __future__ import annotations

import torch

from ucm.sparse.kernels.dispatch import Impl, launchers_of, use_triton
from ucm.sparse.kernels.keys import reference
from ucm.sparse.kernels.keys.reference import BlockRotation

_launchers = launchers_of(__name__)


def delta_rope(
    k_cache: torch.Tensor,
    block_ids: torch.Tensor,
    deltas: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
    num_tokens: torch.Tensor | None = None,
    impl: Impl = "auto",
    validate: bool = True,
) -> None:
    """Rotates paged key blocks by ``deltas`` positions in place (see the reference).

    ``validate=False`` skips the kernel launcher's checks that read device
    values back (distinct block ids, deltas inside the table): hot paths.
    """
    rot = BlockRotation(block_ids, deltas, cos_sin_cache, is_neox, num_tokens)
    if use_triton(impl, k_cache):
        _launchers.delta_rope(k_cache, rot, validate)
    else:
        reference.delta_rope(k_cache, rot)


def delta_rope_tokens(
    k: torch.Tensor,
    deltas: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
    impl: Impl = "auto",
) -> None:
    """Rotates a plain ``[T, H, D]`` key tensor by per-token ``deltas`` ``[T]`` in place."""
    if use_triton(impl, k):
        _launchers.delta_rope_tokens(k, deltas, cos_sin_cache, is_neox)
    else:
        reference.delta_rope_tokens(k, deltas, cos_sin_cache, is_neox)


def kv_deviation(
    k_cache: torch.Tensor, slots: torch.Tensor, k_fresh: torch.Tensor, impl: Impl = "auto"
) -> torch.Tensor:
    """``[T]`` fp32 L1 deviation between cached keys (through ``slots``) and fresh ones."""
    if use_triton(impl, k_fresh):
        return _launchers.kv_deviation(k_cache, slots, k_fresh)
    return reference.kv_deviation(k_cache, slots, k_fresh)


__all__ = ["BlockRotation", "delta_rope", "delta_rope_tokens", "kv_deviation"]
