"""Pure-Python launchers of the attention kernels (plain or ReRoPE).

Shapes are those of :mod:`ucm.sparse.kernels.attention.reference`. The
launchers check shapes, fill in placeholders for the pointers a plain
attention launch never reads, pick the tile sizes and the grid, and launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ucm.sparse.kernels.attention import jit
from ucm.sparse.kernels.attention.reference import default_q_positions
from ucm.sparse.kernels.dispatch import (
    choose_num_splits,
    dot_pad,
    gqa_group,
    launch_guard,
    require,
    softmax_scale,
)
from ucm.sparse.kernels.triton_utils import INTERPRET, cdiv, next_power_of_2

#: Query rows (tokens x GQA heads) per prefill program.
PREFILL_BLOCK_M = 64
#: Key tokens per prefill tile.
PREFILL_BLOCK_N = 32


def prefill_tiles(group: int, block_m: int = PREFILL_BLOCK_M) -> tuple[int, int]:
    """``(BLOCK_M, BLOCK_Q)``: rows per program (power of two, >= 16) and the
    query tokens they cover (``BLOCK_M // G``, at least 1)."""
    bm = max(block_m, dot_pad(group))
    return bm, max(1, bm // group)


@dataclass(frozen=True)
class _Operands:
    """What both attention launches take from the same checks: the (possibly
    placeholder) ReRoPE operands, the GQA geometry and the precision flags."""

    q: torch.Tensor
    q_w: torch.Tensor
    k_cache: torch.Tensor
    k2_cache: torch.Tensor
    v_cache: torch.Tensor
    h_kv: int
    group: int
    head_dim: int
    scale: float
    window: int
    rerope: bool
    upcast: bool
    ieee: bool

    def pointers(self) -> tuple[torch.Tensor, ...]:
        """The five operands, in the kernels' argument order."""
        return self.q, self.q_w, self.k_cache, self.k2_cache, self.v_cache

    def strides(self) -> tuple[int, ...]:
        """The strides of :meth:`pointers`, in the kernels' argument order."""
        return tuple(x for t in self.pointers() for x in t.stride())

    def flags(self) -> dict[str, bool]:
        """The constexpr flags every attention kernel takes."""
        return {"REROPE": self.rerope, "IEEE": self.ieee, "UPCAST": self.upcast}

    def new_output(self) -> torch.Tensor:
        """An output like ``q`` (one row per query token)."""
        return torch.empty(self.q.shape, dtype=self.q.dtype, device=self.q.device)


def _operands(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_w: torch.Tensor | None,
    k2_cache: torch.Tensor | None,
    window: int | None,
    scale: float | None,
) -> _Operands:
    require(q.dim() == 3, f"q must be [T, H_q, D], got {tuple(q.shape)}")
    require(k_cache.dim() == 4 and v_cache.dim() == 4, "caches must be [num_blocks, B, H_kv, D]")
    require(k_cache.shape == v_cache.shape, "k_cache and v_cache shapes differ")
    require(k_cache.dtype == v_cache.dtype, "k_cache and v_cache dtypes differ")
    h_q, d = q.shape[1], q.shape[2]
    h_kv = k_cache.shape[2]
    require(k_cache.shape[3] == d, f"q head dim {d} != cache head dim {k_cache.shape[3]}")
    group = gqa_group(h_q, h_kv)
    rerope = window is not None
    if rerope:
        require(q_w is not None and k2_cache is not None, "ReRoPE needs q_w and k2_cache")
        require(q_w.shape == q.shape, "q_w must have q's shape")
        require(k2_cache.shape == k_cache.shape, "k2_cache must have k_cache's shape")
        require(k2_cache.dtype == k_cache.dtype, "k2_cache must have k_cache's dtype")
        require(int(window) >= 1, f"window must be >= 1, got {window}")
    else:
        q_w, k2_cache = q, k_cache  # placeholders, never read (REROPE=False)
    upcast = INTERPRET and k_cache.dtype != torch.float32
    return _Operands(
        q=q,
        q_w=q_w,
        k_cache=k_cache,
        k2_cache=k2_cache,
        v_cache=v_cache,
        h_kv=h_kv,
        group=group,
        head_dim=d,
        scale=softmax_scale(d, scale),
        window=int(window) if rerope else 0,
        rerope=rerope,
        upcast=upcast,
        ieee=upcast or k_cache.dtype == torch.float32,
    )


def paged_prefill_attention(
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
) -> torch.Tensor:
    """Triton :func:`ucm.sparse.kernels.attention.reference.paged_attention` (any query lengths).

    ``max_query_len`` sizes the grid; ``None`` reads it from
    ``query_start_loc`` (a device sync).
    """
    ops = _operands(q, k_cache, v_cache, q_w, k2_cache, window, scale)
    t = q.shape[0]
    s = seq_lens.numel()
    require(query_start_loc.numel() == s + 1, "query_start_loc must be [S + 1]")
    require(block_table.dim() == 2 and block_table.shape[0] == s, "block_table must be [S, n]")
    if out is None:
        out = ops.new_output()
    if s == 0 or t == 0:
        return out
    dev = q.device
    if q_positions is None:
        q_positions = default_q_positions(seq_lens, query_start_loc)
    require(q_positions.numel() == t, "q_positions must have one entry per query token")
    q_positions = q_positions.to(device=dev, dtype=torch.int32).contiguous()
    qsl = query_start_loc.to(device=dev, dtype=torch.int32).contiguous()
    seq_lens = seq_lens.to(device=dev, dtype=torch.int32).contiguous()
    block_table = block_table.to(device=dev, dtype=torch.int32)
    if max_query_len is None:
        max_query_len = int((qsl[1:] - qsl[:-1]).max())
    bm, bq = prefill_tiles(ops.group)
    grid = (s, cdiv(max_query_len, bq), ops.h_kv)
    with launch_guard():
        jit.paged_prefill_kernel[grid](
            *ops.pointers(),
            out,
            block_table,
            seq_lens,
            qsl,
            q_positions,
            *ops.strides(),
            *out.stride(),
            *block_table.stride(),
            ops.scale,
            ops.window,
            GROUP=ops.group,
            HEAD_DIM=ops.head_dim,
            D_PAD=dot_pad(ops.head_dim),
            BLOCK_SIZE=k_cache.shape[1],
            BLOCK_M=bm,
            BLOCK_Q=bq,
            BLOCK_N=PREFILL_BLOCK_N,
            **ops.flags(),
        )
    return out


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    q_positions: torch.Tensor | None = None,
    scale: float | None = None,
    *,
    q_w: torch.Tensor | None = None,
    k2_cache: torch.Tensor | None = None,
    window: int | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """One query per sequence (``q`` ``[S, H_q, D]``), flash-decoding over paged KV.

    ``q_positions`` ``[S]`` defaults to ``seq_lens - 1``. Same result as
    :func:`paged_prefill_attention` with one query token per sequence; plain
    decode attention over (selected) blocks is this with no ``window``
    (:func:`ucm.sparse.kernels.attention.reference.paged_decode_attention`).
    ``num_splits`` forces the split count (default: :func:`choose_num_splits`).
    """
    ops = _operands(q, k_cache, v_cache, q_w, k2_cache, window, scale)
    s, h_q, d = q.shape
    require(seq_lens.numel() == s, "seq_lens must be [S]")
    require(block_table.dim() == 2 and block_table.shape[0] == s, "block_table must be [S, n]")
    if out is None:
        out = ops.new_output()
    if s == 0:
        return out
    dev = q.device
    seq_lens = seq_lens.to(device=dev, dtype=torch.int32).contiguous()
    if q_positions is None:
        q_positions = seq_lens - 1
    q_positions = q_positions.to(device=dev, dtype=torch.int32).contiguous()
    block_table = block_table.to(device=dev, dtype=torch.int32)
    b = k_cache.shape[1]
    splits = num_splits or choose_num_splits(s, ops.h_kv, block_table.shape[1])
    acc = torch.empty(s, h_q, splits, d, dtype=torch.float32, device=dev)
    m = torch.empty(s, h_q, splits, dtype=torch.float32, device=dev)
    lsum = torch.empty_like(m)
    with launch_guard():
        jit.paged_decode_split_kernel[(s, ops.h_kv, splits)](
            *ops.pointers(),
            block_table,
            seq_lens,
            q_positions,
            acc,
            m,
            lsum,
            *ops.strides(),
            *block_table.stride(),
            *acc.stride(),
            *m.stride(),
            ops.scale,
            ops.window,
            GROUP=ops.group,
            GROUP_PAD=dot_pad(ops.group),
            HEAD_DIM=d,
            D_PAD=dot_pad(d),
            BLOCK_SIZE=b,
            BLOCK_N=dot_pad(b),
            NUM_SPLITS=splits,
            **ops.flags(),
        )
    with launch_guard():
        jit.paged_decode_reduce_kernel[(s, h_q)](
            acc,
            m,
            lsum,
            out,
            *acc.stride(),
            *m.stride(),
            *out.stride(),
            HEAD_DIM=d,
            D_PAD=next_power_of_2(d),
            NUM_SPLITS=splits,
            SPLITS_PAD=next_power_of_2(splits),
        )
    return out
