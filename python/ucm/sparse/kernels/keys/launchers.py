"""Pure-Python launchers of the key kernels (checks, strides, grid, constexprs).

Shapes are those of :mod:`ucm.sparse.kernels.keys.reference`.
"""

from __future__ import annotations

import torch

from ucm.sparse.kernels.dispatch import launch_guard, require, strides_of, with_pads
from ucm.sparse.kernels.keys import jit
from ucm.sparse.kernels.keys.reference import BlockRotation
from ucm.sparse.kernels.triton_utils import cdiv, next_power_of_2


def delta_rope_tile(block_size: int) -> int:
    """Tokens per program of :func:`delta_rope`: the block, capped at 64 (power of two)."""
    return min(64, next_power_of_2(block_size))


def _require_paged_keys(k_cache: torch.Tensor) -> None:
    require(
        k_cache.dim() == 4, f"k_cache must be [num_blocks, B, H, D], got {tuple(k_cache.shape)}"
    )


def delta_rope(k_cache: torch.Tensor, rot: BlockRotation, validate: bool = True) -> None:
    """Triton :func:`ucm.sparse.kernels.keys.reference.delta_rope` (in place).

    ``validate`` checks that block ids are distinct and deltas fit the table;
    both read device values back (a sync), so hot paths pass False.
    """
    _require_paged_keys(k_cache)
    _delta_rope_launch(k_cache, k_cache.stride(), k_cache.shape[1], rot, validate)


def delta_rope_tokens(
    k: torch.Tensor,
    deltas: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
    group: int = 16,
    validate: bool = True,
) -> None:
    """Triton :func:`ucm.sparse.kernels.keys.reference.delta_rope_tokens` (in place).

    The ``T`` tokens are launched as ``ceil(T / group)`` blocks of ``group``
    consecutive tokens (block stride ``group * stride_t``), one delta per token;
    the tail block is masked, so nothing past token ``T - 1`` is touched.
    """
    require(k.dim() == 3, f"k must be [T, H, D], got {tuple(k.shape)}")
    t = k.shape[0]
    require(deltas.numel() == t, f"deltas must be [{t}]")
    if t == 0:
        return
    n = cdiv(t, group)
    st, sh, sd = k.stride()
    ids = torch.arange(n, device=k.device, dtype=torch.int64)
    ntok = torch.clamp(t - ids * group, max=group).to(torch.int32)
    dd = torch.zeros(n * group, dtype=torch.int64, device=k.device)
    dd[:t] = deltas.to(device=k.device, dtype=torch.int64).reshape(-1)
    rot = BlockRotation(ids, dd.view(n, group), cos_sin_cache, is_neox, ntok)
    _delta_rope_launch(k, (group * st, st, sh, sd), group, rot, validate)


def _delta_rope_launch(
    k: torch.Tensor,
    strides: tuple[int, int, int, int],
    b: int,
    rot: BlockRotation,
    validate: bool,
) -> None:
    """Rotates ``k`` seen as ``[NB, b, H, D]`` blocks with ``strides``."""
    h, d = k.shape[-2], k.shape[-1]
    cos_sin_cache, num_tokens = rot.cos_sin_cache, rot.num_tokens
    require(cos_sin_cache.dim() == 2, "cos_sin_cache must be [max_pos, rot_dim]")
    rot_dim = cos_sin_cache.shape[1]
    require(
        rot_dim % 2 == 0 and 0 < rot_dim <= d,
        f"rot_dim {rot_dim} must be even and <= head dim {d}",
    )
    n = int(rot.block_ids.numel())
    if n == 0:
        return
    dev = k.device
    block_ids = rot.block_ids.to(device=dev, dtype=torch.int64).contiguous()
    deltas = rot.deltas.to(device=dev, dtype=torch.int64)
    if deltas.dim() == 1:
        require(deltas.numel() == n, f"deltas must be [{n}] or [{n}, {b}]")
        stride_dn, stride_dt = deltas.stride(0), 0
    else:
        require(tuple(deltas.shape) == (n, b), f"deltas must be [{n}] or [{n}, {b}]")
        stride_dn, stride_dt = deltas.stride()
    if validate:
        require(
            int(torch.unique(block_ids).numel()) == n,
            "block_ids must be distinct (in-place rotation)",
        )
        max_abs = int(deltas.abs().max())
        require(
            max_abs < cos_sin_cache.shape[0],
            f"|delta| = {max_abs} is outside the rotary table ({cos_sin_cache.shape[0]} positions)",
        )
    cs = cos_sin_cache.to(dev)
    if num_tokens is not None:
        require(num_tokens.numel() == n, "num_tokens must have one entry per block")
        num_tokens = num_tokens.to(device=dev, dtype=torch.int32).contiguous()
    bt = delta_rope_tile(b)
    with launch_guard():
        jit.delta_rope_kernel[(n, h, cdiv(b, bt))](
            k,
            block_ids,
            deltas,
            num_tokens if num_tokens is not None else block_ids,  # placeholder, never read
            cs,
            *strides,
            stride_dn,
            stride_dt,
            *cs.stride(),
            BLOCK_SIZE=b,
            BLOCK_T=bt,
            IS_NEOX=bool(rot.is_neox),
            HAS_NUM_TOKENS=num_tokens is not None,
            **with_pads(HALF=rot_dim // 2),
        )


def kv_deviation(
    k_cache: torch.Tensor, slots: torch.Tensor, k_fresh: torch.Tensor, block_t: int = 32
) -> torch.Tensor:
    """Triton :func:`ucm.sparse.kernels.keys.reference.kv_deviation`."""
    _require_paged_keys(k_cache)
    require(k_fresh.dim() == 3, f"k_fresh must be [T, H, D], got {tuple(k_fresh.shape)}")
    _, b, h, d = k_cache.shape
    t = k_fresh.shape[0]
    require(tuple(k_fresh.shape[1:]) == (h, d), "k_fresh heads/dims differ from the cache")
    require(slots.numel() == t, "slots must have one entry per token")
    out = torch.empty(t, dtype=torch.float32, device=k_fresh.device)
    if t == 0:
        return out
    slots = slots.to(device=k_fresh.device, dtype=torch.int64).contiguous()
    with launch_guard():
        jit.kv_deviation_kernel[(cdiv(t, block_t),)](
            k_cache,
            slots,
            k_fresh,
            out,
            t,
            *strides_of(k_cache, k_fresh),
            NUM_HEADS=h,
            BLOCK_SIZE=b,
            BLOCK_T=block_t,
            **with_pads(HEAD_DIM=d),
        )
    return out
