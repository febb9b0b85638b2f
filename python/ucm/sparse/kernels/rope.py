"""Rotary position embedding in vLLM's conventions (torch).

vLLM keeps one ``cos_sin_cache`` per rotary module: ``[max_pos, rot_dim]``,
row ``p`` = ``cos(p * inv_freq) | sin(p * inv_freq)`` (two halves of
``rot_dim // 2``), ``inv_freq[f] = base ** (-2f / rot_dim)``. Only the first
``rot_dim <= head_dim`` dims of a head rotate (partial rotary); the rest pass
through. Two pairings of the rotated dims:

* **NeoX** (Llama, Qwen; ``is_neox=True``): dim ``f`` pairs with ``f + rot_dim/2``;
* **GPT-J** (``is_neox=False``): dim ``2f`` pairs with ``2f + 1``.

A pair ``(x1, x2)`` at frequency ``f`` and angle ``a = p * inv_freq[f]``
becomes ``(x1 cos a - x2 sin a, x2 cos a + x1 sin a)``. Rotations compose,
``R(a) R(b) = R(a + b)``, which is what delta-RoPE (Blend) and ReRoPE's
``q_w`` rely on.
"""

from __future__ import annotations

import torch


def rope_cos_sin_cache(
    rot_dim: int, max_pos: int, base: float = 10000.0, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``[max_pos, rot_dim]`` cos|sin table, computed exactly as vLLM's ``RotaryEmbedding``."""
    if rot_dim % 2:
        raise ValueError(f"rot_dim must be even, got {rot_dim}")
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float) / rot_dim))
    t = torch.arange(max_pos, dtype=torch.float)
    freqs = torch.einsum("i,j -> ij", t, inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)


def _pairs(x: torch.Tensor, rot_dim: int, is_neox: bool) -> tuple[torch.Tensor, torch.Tensor]:
    xr = x[..., :rot_dim]
    if is_neox:
        return xr[..., : rot_dim // 2], xr[..., rot_dim // 2 :]
    return xr[..., 0::2], xr[..., 1::2]


def _join(o1: torch.Tensor, o2: torch.Tensor, rest: torch.Tensor, is_neox: bool) -> torch.Tensor:
    rot = torch.cat((o1, o2), dim=-1) if is_neox else torch.stack((o1, o2), dim=-1).flatten(-2)
    return torch.cat((rot, rest), dim=-1)


def rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool = True
) -> torch.Tensor:
    """Rotates ``x`` ``[T, H, D]`` by per-token angles given as ``cos``/``sin`` ``[T, rot/2]``.

    Computes in ``cos``'s dtype and returns ``x``'s dtype (out of place).
    """
    rot_dim = 2 * cos.shape[-1]
    if rot_dim > x.shape[-1]:
        raise ValueError(f"rot_dim {rot_dim} exceeds the head dim {x.shape[-1]}")
    xc = x.to(cos.dtype)
    x1, x2 = _pairs(xc, rot_dim, is_neox)
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    o1 = x1 * c - x2 * s
    o2 = x2 * c + x1 * s
    return _join(o1, o2, xc[..., rot_dim:], is_neox).to(x.dtype)


def cos_sin_at(
    cos_sin_cache: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` ``[T, rot/2]`` of integer ``positions`` (negative: the inverse rotation)."""
    pos = positions.to(torch.long)
    rows = cos_sin_cache.index_select(0, pos.abs().flatten())
    cos, sin = rows.chunk(2, dim=-1)
    sign = torch.where(pos.flatten() < 0, -1.0, 1.0).to(sin.dtype).unsqueeze(-1)
    return cos, sin * sign


def apply_rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> torch.Tensor:
    """``x`` ``[T, H, D]`` rotated to ``positions`` ``[T]``, like vLLM's ``forward_native``.

    The arithmetic runs in ``x``'s dtype with the cache cast to it, as vLLM
    does, so an fp32 model matches vLLM's rotation bit for bit.
    """
    cos, sin = cos_sin_at(cos_sin_cache.to(x.dtype), positions)
    return rotate(x, cos, sin, is_neox)
