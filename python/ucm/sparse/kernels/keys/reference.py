"""Plain-torch references of the key kernels (the specification the kernel tests use).

Shapes (see :mod:`ucm.sparse.kernels.selection.reference` for the shared conventions):

* ``k_cache`` ``[num_blocks, B, H_kv, D]``: the *logical* view of one layer's
  paged K; any strides, so the vLLM CPU layout (K stored transposed
  ``[D, B]`` inside each ``(block, head)`` slab, see
  :func:`ucm.sparse.kernels.views.cpu_kv_cache_views`) and the GPU flash layout are
  passed as views without a copy. A plain ``[T, H, D]`` tensor is the same
  thing with ``B = 1`` (``k.unsqueeze(1)``); :func:`delta_rope_tokens` takes
  it directly with one delta per token.
* ``cos_sin_cache`` ``[max_pos, rot_dim]``: the model's rotary table (vLLM's
  ``rotary_emb.cos_sin_cache``), ``cos | sin`` halves; ``rot_dim <= D``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ucm.sparse.kernels.rope import cos_sin_at, rotate


@dataclass(frozen=True)
class BlockRotation:
    """Which paged key blocks :func:`delta_rope` rotates, and by how much.

    Attributes:
        block_ids: ``[n]`` physical blocks to rotate (distinct).
        deltas: ``[n]`` (one per block) or ``[n, B]`` (one per token) int
            position shifts; ``|delta| < max_pos``; negative shifts rotate back.
        cos_sin_cache: ``[max_pos, rot_dim]``.
        is_neox: NeoX (half split) or GPT-J (interleaved) pairing.
        num_tokens: ``[n]`` valid tokens per block (the rest is untouched);
            ``None``: all ``B``.
    """

    block_ids: torch.Tensor
    deltas: torch.Tensor
    cos_sin_cache: torch.Tensor
    is_neox: bool = True
    num_tokens: torch.Tensor | None = None


def delta_rope(k_cache: torch.Tensor, rot: BlockRotation) -> None:
    """Rotates the keys of whole blocks of ``k_cache`` ``[NB, B, H_kv, D]``
    (any strides) by ``rot.deltas`` positions, in place.

    A key stored at position ``p`` (``R(p) k``) becomes the key at ``p + delta``
    (``R(delta) R(p) k = R(p + delta) k``). Blend moves a chunk cached at
    start ``a`` to start ``b`` with ``delta = b - a``.

    The rotation is computed in fp32 and rounded once to the cache dtype.
    """
    block_ids, deltas, num_tokens = rot.block_ids, rot.deltas, rot.num_tokens
    n = int(block_ids.numel())
    if n == 0:
        return
    b = k_cache.shape[1]
    cs = rot.cos_sin_cache.float()
    if num_tokens is None:
        # Every token of every block: one gather, one rotation, one scatter
        # (same arithmetic as the per-block loop below; block ids are distinct).
        ids = block_ids.to(device=k_cache.device, dtype=torch.long)
        d = deltas.to(device=k_cache.device, dtype=torch.long)
        d = d.reshape(n, 1).expand(n, b) if d.numel() == n else d.reshape(n, b)
        cos, sin = cos_sin_at(cs.to(k_cache.device), d.reshape(-1))
        x = k_cache[ids].float()  # [n, B, H, D]
        rotated = rotate(x.reshape(n * b, *x.shape[2:]), cos, sin, rot.is_neox)
        k_cache[ids] = rotated.reshape(x.shape).to(k_cache.dtype)
        return
    for i in range(n):
        blk = int(block_ids[i])
        ntok = b if num_tokens is None else min(b, int(num_tokens[i]))
        if ntok <= 0:
            continue
        d = deltas[i].reshape(-1).to(torch.long)
        d = d.expand(ntok) if d.numel() == 1 else d[:ntok]
        cos, sin = cos_sin_at(cs, d)
        x = k_cache[blk, :ntok]
        k_cache[blk, :ntok] = rotate(x.float(), cos, sin, rot.is_neox).to(k_cache.dtype)


def delta_rope_tokens(
    k: torch.Tensor,
    deltas: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> None:
    """Rotates a plain ``[T, H, D]`` key tensor by per-token ``deltas`` ``[T]``, in place."""
    if k.shape[0] == 0:
        return
    cos, sin = cos_sin_at(cos_sin_cache.float(), deltas.reshape(-1))
    k.copy_(rotate(k.float(), cos, sin, is_neox).to(k.dtype))


def kv_deviation(k_cache: torch.Tensor, slots: torch.Tensor, k_fresh: torch.Tensor) -> torch.Tensor:
    """Per-token L1 deviation between cached and freshly computed keys.

    ``dev[t] = sum_{h, d} |k_cache[slot // B, slot % B, h, d] - k_fresh[t, h, d]|``
    in fp32; a token with ``slots[t] < 0`` gets 0 (no cached key).

    Args:
        k_cache: ``[NB, B, H_kv, D]`` (any strides).
        slots: ``[T]`` int slots (``block * B + offset``).
        k_fresh: ``[T, H_kv, D]``.

    Returns:
        ``[T]`` float32.
    """
    t = k_fresh.shape[0]
    out = torch.zeros(t, dtype=torch.float32, device=k_fresh.device)
    if t == 0:
        return out
    b = k_cache.shape[1]
    s = slots.to(device=k_fresh.device, dtype=torch.long)
    valid = s >= 0
    sv = s[valid]
    cached = k_cache[sv // b, sv % b].float()
    out[valid] = (cached - k_fresh[valid].float()).abs().sum(dim=(-1, -2))
    return out
