"""Plain-torch references of ReRoPE attention (the definition the kernels are checked against).

ReRoPE (Jianlin Su, "Transformer Upgrade Road 12", 2023): a query at position
``i`` sees a key at position ``j <= i`` with the *exact* relative position
``i - j`` when ``i - j < W`` and with the relative position ``W`` otherwise,
so no relative position beyond the trained window is ever used. With RoPE a
score depends only on the relative rotation, ``(R_i q) . (R_j k) = (R_{i-j} q) . k``,
which gives the two-score form the kernels compute::

    S1[i, j] = (R_i q_i) . (R_j k_j)          # ordinary RoPE score
    S2[i, j] = (R_W q_i) . k_j                # clamped: q rotated to W, key un-rotated
    S[i, j]  = S1 if i - j < W else S2

so each kernel needs, per token, the rotated query ``q`` and ``q_w = R_W q``,
and, per key, the rotated key ``k`` and the un-rotated key ``k2``. With
log-n scaling the query is first multiplied by
``max(1, log(i + 1) / log(training_length))`` (``i`` 0-based).

The paged attention the kernels run (``S1`` or ``S2`` per key by distance)
is :func:`ucm.sparse.kernels.attention.reference.paged_attention`; this
module holds the definition it is checked against (:func:`rerope_attention_dense`)
and the preparation of ``q``, ``q_w``, ``k`` and ``k2`` (:func:`rerope_prepare`).
"""

from __future__ import annotations

import math

import torch

from ucm.sparse.kernels.dispatch import softmax_scale
from ucm.sparse.kernels.rope import apply_rope, cos_sin_at, rotate


def log_n_scale(positions: torch.Tensor, training_length: int | None) -> torch.Tensor:
    """``max(1, log(pos + 1) / log(training_length))`` per position (fp32); 1 if disabled."""
    p = positions.to(torch.float64)
    if training_length is None:
        return torch.ones_like(p, dtype=torch.float32)
    return torch.clamp(torch.log(p + 1.0) / math.log(training_length), min=1.0).float()


def rerope_prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    window: int,
    training_length: int | None = None,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, q_w, k, k2)`` from un-rotated ``q`` ``[T, H_q, D]`` and ``k`` ``[T, H_kv, D]``.

    ``q`` is log-n scaled (``training_length`` None: not scaled) and rotated
    to its position, ``q_w`` is the scaled query rotated to ``window``, ``k``
    is rotated to its position and ``k2`` is the un-rotated key (a copy).
    """
    scale = log_n_scale(positions, training_length).to(q.dtype).view(-1, 1, 1)
    qs = q * scale
    q_rot = apply_rope(qs, positions, cos_sin_cache, is_neox)
    q_w = apply_rope(qs, torch.full_like(positions, window), cos_sin_cache, is_neox)
    k_rot = apply_rope(k, positions, cos_sin_cache, is_neox)
    return q_rot, q_w, k_rot, k.clone()


def rerope_attention_dense(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    window: int | None,
    training_length: int | None = None,
    scale: float | None = None,
    is_neox: bool = True,
    start_pos: int = 0,
) -> torch.Tensor:
    """ReRoPE causal attention of one sequence, straight from the definition.

    Uses the relative form ``score[i, j] = (R_{min(i - j, W)} q'_i) . k_j``
    with ``q'`` the log-n scaled query: a different computation from the
    two-score form of the kernels, which makes it an independent check.
    ``window`` None is plain RoPE attention (no clamp). Queries and keys are
    un-rotated ``[L, H, D]`` tensors at positions ``start_pos..start_pos+L-1``.
    Returns ``[L, H_q, D]`` in ``q``'s dtype; fp32 arithmetic. Memory is
    ``O(L^2 * H_q * D)``: for tests.
    """
    n, h_q, d = q.shape
    h_kv = k.shape[1]
    g = h_q // h_kv
    scale = softmax_scale(d, scale)
    pos = torch.arange(start_pos, start_pos + n)
    qf = q.float() * log_n_scale(pos, training_length).view(-1, 1, 1)
    kf = k.float().repeat_interleave(g, dim=1)
    vf = v.float().repeat_interleave(g, dim=1)
    rel = pos[:, None] - pos[None, :]
    clamped = rel.clamp(min=0)
    if window is not None:
        clamped = clamped.clamp(max=window)
    cos, sin = cos_sin_at(cos_sin_cache.float(), clamped.reshape(-1))
    # q_i rotated by every clamped distance: [L*L, H, D] -> [L, L, H, D]
    q_rel = rotate(qf.repeat_interleave(n, dim=0), cos, sin, is_neox).view(n, n, h_q, d)
    scores = torch.einsum("ijhd,jhd->hij", q_rel, kf) * scale
    scores = scores.masked_fill((rel < 0).unsqueeze(0), float("-inf"))
    p = torch.softmax(scores, dim=-1)
    return torch.einsum("hij,jhd->ihd", p, vf).to(q.dtype)
