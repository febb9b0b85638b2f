"""Pure-Python launchers of the attention kernels (plain or ReRoPE).

Shapes are those of :mod:`ucm.sparse.kernels.attention.reference`. The
launchers check shapes, fill in placeholders for the pointers a plain
attention launch never reads, pick the tile sizes and the grid, and launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ucm.sparse.kernels.attention import jit
from ucm.sparse.kernels.attention.reference import AttentionBatch
from ucm.sparse.kernels.dispatch import (
    choose_num_splits,
    dot_pad,
    gqa_group,
    launch_guard,
    require,
    softmax_scale,
    strides_of,
    with_pads,
)
from ucm.sparse.kernels.triton_utils import INTERPRET, cdiv

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
    """What every attention launch takes from the same checks: the (possibly
    placeholder) ReRoPE operands, the table and lengths as int32 on the
    queries' device, the GQA geometry and the precision flags."""

    q: torch.Tensor
    q_w: torch.Tensor
    k_cache: torch.Tensor
    k2_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    out: torch.Tensor
    h_kv: int
    group: int
    head_dim: int
    scale: float
    window: int
    rerope: bool
    upcast: bool
    ieee: bool

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.numel()

    def pointers(self) -> tuple[torch.Tensor, ...]:
        """The five operands, in the kernels' argument order."""
        return self.q, self.q_w, self.k_cache, self.k2_cache, self.v_cache

    def strides(self) -> tuple[int, ...]:
        """The strides of :meth:`pointers`, in the kernels' argument order."""
        return strides_of(*self.pointers())


def _operands(batch: AttentionBatch) -> _Operands:
    q, k_cache, v_cache = batch.q, batch.k_cache, batch.v_cache
    q_w, k2_cache, window = batch.q_w, batch.k2_cache, batch.window
    require(q.dim() == 3, f"q must be [T, H_q, D], got {tuple(q.shape)}")
    require(k_cache.dim() == 4 and v_cache.dim() == 4, "caches must be [num_blocks, B, H_kv, D]")
    require(k_cache.shape == v_cache.shape, "k_cache and v_cache shapes differ")
    require(k_cache.dtype == v_cache.dtype, "k_cache and v_cache dtypes differ")
    h_q, d = q.shape[1], q.shape[2]
    h_kv = k_cache.shape[2]
    require(k_cache.shape[3] == d, f"q head dim {d} != cache head dim {k_cache.shape[3]}")
    group = gqa_group(h_q, h_kv)
    s = batch.seq_lens.numel()
    table = batch.block_table
    require(table.dim() == 2 and table.shape[0] == s, "block_table must be [S, n]")
    if batch.rerope:
        require(q_w is not None and k2_cache is not None, "ReRoPE needs q_w and k2_cache")
        require(q_w.shape == q.shape, "q_w must have q's shape")
        require(k2_cache.shape == k_cache.shape, "k2_cache must have k_cache's shape")
        require(k2_cache.dtype == k_cache.dtype, "k2_cache must have k_cache's dtype")
        require(int(window) >= 1, f"window must be >= 1, got {window}")
    else:
        q_w, k2_cache = q, k_cache  # placeholders, never read (REROPE=False)
    out = batch.out
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dev = q.device
    upcast = INTERPRET and k_cache.dtype != torch.float32
    return _Operands(
        q=q,
        q_w=q_w,
        k_cache=k_cache,
        k2_cache=k2_cache,
        v_cache=v_cache,
        block_table=table.to(device=dev, dtype=torch.int32),
        seq_lens=batch.seq_lens.to(device=dev, dtype=torch.int32).contiguous(),
        out=out,
        h_kv=h_kv,
        group=group,
        head_dim=d,
        scale=softmax_scale(d, batch.scale),
        window=int(window) if batch.rerope else 0,
        rerope=batch.rerope,
        upcast=upcast,
        ieee=upcast or k_cache.dtype == torch.float32,
    )


def _launch(
    ops: _Operands,
    q_positions: torch.Tensor,
    qsl: torch.Tensor | None,
    q_tiles: int,
    block_m: int,
    block_q: int,
    block_n: int,
    splits: int,
) -> torch.Tensor:
    """Launches :func:`~ucm.sparse.kernels.attention.jit.paged_attention_kernel`
    (then the split reduction when ``splits > 1``); ``qsl`` None: one query
    per sequence."""
    out, dev = ops.out, ops.q.device
    t, h_q, d = ops.q.shape
    q_positions = q_positions.to(device=dev, dtype=torch.int32).contiguous()
    if splits > 1:  # per split: acc | running max | normaliser
        part = torch.empty(t, h_q, splits, d + 2, dtype=torch.float32, device=dev)
        part_strides = part.stride()
    else:  # the kernel writes the output: a placeholder, never read
        part, part_strides = out, (0, 0, 0, 0)
    with launch_guard():
        jit.paged_attention_kernel[(ops.num_seqs, q_tiles * splits, ops.h_kv)](
            *ops.pointers(),
            out,
            part,
            ops.block_table,
            ops.seq_lens,
            ops.seq_lens if qsl is None else qsl,  # placeholder, never read (ONE_QUERY)
            q_positions,
            *ops.strides(),
            *out.stride(),
            *part_strides,
            *ops.block_table.stride(),
            ops.scale,
            ops.window,
            GROUP=ops.group,
            HEAD_DIM=d,
            D_PAD=dot_pad(d),
            BLOCK_SIZE=ops.k_cache.shape[1],
            BLOCK_M=block_m,
            BLOCK_Q=block_q,
            BLOCK_N=block_n,
            NUM_SPLITS=splits,
            ONE_QUERY=qsl is None,
            REROPE=ops.rerope,
            IEEE=ops.ieee,
            UPCAST=ops.upcast,
        )
    if splits > 1:
        with launch_guard():
            jit.paged_decode_reduce_kernel[(t, h_q)](
                part,
                out,
                *part_strides,
                *out.stride(),
                **with_pads(HEAD_DIM=d, NUM_SPLITS=splits),
            )
    return out


def paged_prefill_attention(
    batch: AttentionBatch, max_query_len: int | None = None
) -> torch.Tensor:
    """Triton :func:`ucm.sparse.kernels.attention.reference.paged_attention` (any query lengths).

    ``max_query_len`` sizes the grid; ``None`` reads it from
    ``query_start_loc`` (a device sync).
    """
    ops = _operands(batch)
    qsl = batch.starts()
    require(qsl.numel() == ops.num_seqs + 1, "query_start_loc must be [S + 1]")
    if ops.num_seqs == 0 or batch.q.shape[0] == 0:
        return ops.out
    q_positions = batch.positions()
    require(
        q_positions.numel() == batch.q.shape[0], "q_positions must have one entry per query token"
    )
    qsl = qsl.to(device=batch.q.device, dtype=torch.int32).contiguous()
    if max_query_len is None:
        max_query_len = int((qsl[1:] - qsl[:-1]).max())
    bm, bq = prefill_tiles(ops.group)
    return _launch(ops, q_positions, qsl, cdiv(max_query_len, bq), bm, bq, PREFILL_BLOCK_N, 1)


def paged_decode_attention(batch: AttentionBatch, num_splits: int | None = None) -> torch.Tensor:
    """One query per sequence (``q`` ``[S, H_q, D]``), flash-decoding over paged KV.

    ``q_positions`` ``[S]`` defaults to ``seq_lens - 1`` (``query_start_loc``
    is not read). Same result as :func:`paged_prefill_attention` with one
    query token per sequence; plain decode attention over (selected) blocks
    is this with no ``window``
    (:func:`ucm.sparse.kernels.attention.reference.paged_decode_attention`).
    ``num_splits`` forces the split count (default: :func:`choose_num_splits`).
    """
    ops = _operands(batch)
    require(batch.q.shape[0] == ops.num_seqs, "seq_lens must be [S]")
    if ops.num_seqs == 0:
        return ops.out
    q_positions = ops.seq_lens - 1 if batch.q_positions is None else batch.q_positions
    b = ops.k_cache.shape[1]
    splits = num_splits or choose_num_splits(ops.num_seqs, ops.h_kv, ops.block_table.shape[1])
    return _launch(ops, q_positions, None, 1, dot_pad(ops.group), 1, dot_pad(b), splits)
