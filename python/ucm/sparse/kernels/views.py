"""KV-cache views in the kernels' logical layout ``[num_blocks, B, H_kv, D]``.

vLLM's CPU and GPU backends store a layer's paged cache differently; the
kernels take strided views of either without copying.
"""

from __future__ import annotations

import torch


def flash_kv_cache_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V views of a vLLM GPU (flash-attn layout) cache ``[2, NB, B, H, D]``."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"expected [2, num_blocks, B, H, D], got {tuple(kv_cache.shape)}")
    return kv_cache[0], kv_cache[1]


def cpu_kv_cache_views(kv_layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V views of one layer of the vLLM CPU cache, without copying.

    The CPU attention backend stores a layer as ``[NB, H, N, 2C]``, where each
    ``(block, head)`` slab of ``2*N*C`` elements holds K transposed
    (``[C, N]``, head-dim major) then V (``[N, C]``). See
    ``shared/reference/vllm-on-cpu.md`` (KV cache layout). The returned views
    have the logical shape ``[NB, N, H, C]`` every kernel here takes.
    """
    if kv_layer.dim() != 4 or kv_layer.shape[-1] % 2:
        raise ValueError(f"expected [num_blocks, H, N, 2C], got {tuple(kv_layer.shape)}")
    if not kv_layer.is_contiguous():
        raise ValueError("the CPU KV layer must be contiguous")
    nb, h, n, c2 = kv_layer.shape
    c = c2 // 2
    slab = 2 * n * c
    off = kv_layer.storage_offset()
    k = kv_layer.as_strided((nb, n, h, c), (h * slab, 1, slab, n), off)
    v = kv_layer.as_strided((nb, n, h, c), (h * slab, c, slab, 1), off + n * c)
    return k, v


def kv_views(kv_layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(K, V)`` logical ``[NB, B, H, D]`` views of one layer's vLLM paged cache.

    Accepts the CPU backend's ``[NB, H, B, 2D]`` (K transposed inside each
    block) and the flash layout ``[2, NB, B, H, D]``.
    """
    if kv_layer.dim() == 4:
        return cpu_kv_cache_views(kv_layer)
    return flash_kv_cache_views(kv_layer)


__all__ = ["cpu_kv_cache_views", "flash_kv_cache_views", "kv_views"]
