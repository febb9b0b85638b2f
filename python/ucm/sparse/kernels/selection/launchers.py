"""Pure-Python launchers of the Triton kernels (the host layer).

A launcher checks shapes and dtypes, allocates outputs, passes every stride,
picks the constexpr tile sizes and the grid, and launches. The tile and split
choices are small functions with their own unit tests. Shapes are those of
:mod:`ucm.sparse.kernels.selection.reference`.
"""

from __future__ import annotations

import torch

from ucm.sparse.kernels.dispatch import (
    MIN_DOT,
    dot_pad,
    gqa_group,
    launch_guard,
    require,
    strides_of,
    with_pads,
)
from ucm.sparse.kernels.selection import jit
from ucm.sparse.kernels.selection.reference import Candidates, HammingBatch, KeyBlocks
from ucm.sparse.kernels.triton_utils import cdiv, next_power_of_2


def block_representatives(blocks: KeyBlocks) -> torch.Tensor:
    """Triton :func:`ucm.sparse.kernels.selection.reference.block_representatives`."""
    k_cache = blocks.k_cache
    require(k_cache.dim() == 4, f"k_cache must be [num_blocks, B, H_kv, D], got {k_cache.shape}")
    _, b, h, d = k_cache.shape
    n = int(blocks.block_ids.numel())
    require(blocks.num_tokens.numel() == n, "num_tokens must have one entry per block id")
    c, m = blocks.reps()
    dev = k_cache.device
    block_ids = blocks.block_ids.to(device=dev, dtype=torch.int64).contiguous()
    num_tokens = blocks.num_tokens.to(device=dev, dtype=torch.int32).contiguous()
    channels = blocks.block_channels()
    if channels is not None:
        require(channels.shape[-2] == h, f"channels must be [..., {h}, D'], got {channels.shape}")
        channels = channels.to(device=dev, dtype=torch.int32)
        dp = channels.shape[-1]
        ch_strides = channels.stride()
    else:
        dp = d
        channels = block_ids  # placeholder pointer, never read (HAS_CHANNELS=False)
        ch_strides = (0, 0, 0)
    out = torch.empty(n, m, h, dp, dtype=torch.float32, device=dev)
    if n == 0:
        return out
    with launch_guard():
        jit.block_repr_kernel[(n, h)](
            k_cache,
            block_ids,
            num_tokens,
            channels,
            out,
            *k_cache.stride(),
            *ch_strides,
            *out.stride(),
            BLOCK_SIZE=b,
            NUM_REPS=m,
            HAS_CHANNELS=ch_strides != (0, 0, 0),
            **with_pads(C=c, DP=dp),
        )
    return out


def block_scores_dot(q: torch.Tensor, cands: Candidates, block_n: int = 64) -> torch.Tensor:
    """Triton :func:`ucm.sparse.kernels.selection.reference.block_scores_dot`."""
    rep_pool = cands.rep_pool
    require(q.dim() == 3, f"q must be [S, H_q, D], got {q.shape}")
    require(rep_pool.dim() == 3, f"rep_pool must be [P, H_kv, D], got {rep_pool.shape}")
    s, h_q, d = q.shape
    h_kv = rep_pool.shape[1]
    require(rep_pool.shape[2] == d, "rep_pool head dim differs from q")
    if h_q < h_kv:  # fewer query heads: repeat them (as the reference does)
        require(h_kv % h_q == 0, f"{h_kv} kv heads are not a multiple of {h_q} query heads")
        q = q.repeat_interleave(h_kv // h_q, dim=1)
        h_q = h_kv
    g = gqa_group(h_q, h_kv)
    n_max = cands.rep_table.shape[1]
    rep_table = cands.rep_table.to(torch.int32)
    num_reps = cands.num_reps.to(device=q.device, dtype=torch.int32)
    out = torch.empty(s, n_max, dtype=torch.float32, device=q.device)
    if s == 0 or n_max == 0:
        return out
    grid = (s, cdiv(n_max, block_n))
    with launch_guard():
        jit.block_score_dot_kernel[grid](
            q,
            rep_pool,
            rep_table,
            num_reps,
            out,
            *strides_of(q, rep_pool, rep_table, out),
            n_max,
            NUM_KV_HEADS=h_kv,
            BLOCK_N=block_n,
            **with_pads(GROUP=g, HEAD_DIM=d),
        )
    return out


def kvstar_vote_scores(
    q: torch.Tensor, cands: Candidates, channels: torch.Tensor, scale: float, block_n: int = 32
) -> torch.Tensor:
    """Triton :func:`ucm.sparse.kernels.selection.reference.kvstar_vote_scores`."""
    rep_pool = cands.rep_pool
    require(q.dim() == 4, f"q must be [S, X, H_q, D], got {q.shape}")
    require(rep_pool.dim() == 4, f"rep_pool must be [P, M, H_kv, D'], got {rep_pool.shape}")
    s, x, h_q, _ = q.shape
    _, m, h_kv, dp = rep_pool.shape
    g = gqa_group(h_q, h_kv)
    require(
        tuple(channels.shape) == (s, h_kv, dp),
        f"channels must be [{s}, {h_kv}, {dp}], got {tuple(channels.shape)}",
    )
    n_max = cands.rep_table.shape[1]
    rep_table = cands.rep_table.to(torch.int32)
    num_reps = cands.num_reps.to(device=q.device, dtype=torch.int32)
    channels = channels.to(torch.int32)
    votes = torch.zeros(s, x * h_q, n_max, dtype=torch.float32, device=q.device)
    if s and n_max and x:
        with launch_guard():
            jit.kvstar_vote_kernel[(s, x * h_q)](
                q,
                rep_pool,
                rep_table,
                num_reps,
                channels,
                votes,
                *strides_of(q, rep_pool, rep_table, channels, votes),
                float(scale),
                NUM_HEADS_Q=h_q,
                GROUP=g,
                BLOCK_N=block_n,
                **with_pads(M=m, DP=dp),
            )
    return cands.mask_padding(votes.sum(dim=1))


def _srp_launch(
    x: torch.Tensor,
    proj: torch.Tensor,
    out: torch.Tensor,
    slots: torch.Tensor | None,
    block_r: int = 32,
) -> None:
    t, h, d = x.shape
    d_p, nbits = proj.shape
    require(d_p == d, f"proj must be [{d}, nbits], got {tuple(proj.shape)}")
    require(
        nbits % 32 == 0 and nbits == next_power_of_2(nbits) and nbits >= 32,
        f"nbits must be a power of two >= 32, got {nbits}",
    )
    rows = t * h
    if rows == 0:
        return
    if slots is None:
        ob, ot, oh, ow = 0, *out.stride()
        cache_block = 1
        slot_arg = out  # placeholder pointer, never read (USE_SLOTS=False)
    else:
        ob, ot, oh, ow = out.stride()
        cache_block = out.shape[1]
        slot_arg = slots
    with launch_guard():
        jit.srp_encode_kernel[(cdiv(rows, block_r),)](
            x,
            proj,
            out,
            slot_arg,
            rows,
            *x.stride(),
            *proj.stride(),
            ob,
            ot,
            oh,
            ow,
            NUM_HEADS=h,
            HEAD_DIM=d,
            D_PAD=dot_pad(d),
            NBITS=nbits,
            BLOCK_R=max(MIN_DOT, block_r),
            CACHE_BLOCK=cache_block,
            USE_SLOTS=slots is not None,
        )


def srp_encode(x: torch.Tensor, proj: torch.Tensor) -> torch.Tensor:
    """Triton :func:`~ucm.sparse.kernels.selection.reference.srp_encode`, ``x`` ``[..., H, D]``."""
    require(x.dim() >= 2, f"x must be [..., H, D], got {x.shape}")
    lead = x.shape[:-2]
    x3 = x.reshape(-1, x.shape[-2], x.shape[-1])
    words = proj.shape[1] // 32
    out = torch.empty(x3.shape[0], x3.shape[1], words, dtype=torch.int32, device=x.device)
    _srp_launch(x3, proj.to(x.device), out, None)
    return out.reshape(*lead, x.shape[-2], proj.shape[1] // 32)


def srp_encode_to_cache(
    k: torch.Tensor, proj: torch.Tensor, code_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Triton :func:`ucm.sparse.kernels.selection.reference.srp_encode_to_cache`."""
    require(k.dim() == 3, f"k must be [T, H_kv, D], got {k.shape}")
    require(code_cache.dim() == 4, "code_cache must be [num_blocks, B, H_kv, W]")
    require(code_cache.dtype == torch.int32, "code_cache must be int32")
    require(slot_mapping.numel() == k.shape[0], "slot_mapping must have one slot per token")
    slots = slot_mapping.to(device=k.device, dtype=torch.int64).contiguous()
    _srp_launch(k, proj.to(k.device), code_cache, slots)


def block_scores_hamming(batch: HammingBatch, block_nb: int = 16) -> torch.Tensor:
    """Triton :func:`ucm.sparse.kernels.selection.reference.block_scores_hamming`."""
    q_codes, k_code_cache = batch.q_codes, batch.k_code_cache
    require(q_codes.dim() == 3, f"q_codes must be [S, H_kv, W], got {q_codes.shape}")
    require(k_code_cache.dim() == 4, "k_code_cache must be [num_blocks, B, H_kv, W]")
    s, h, w = q_codes.shape
    _, b, h2, w2 = k_code_cache.shape
    require((h, w) == (h2, w2), "q_codes and k_code_cache disagree on kv heads or words")
    max_blocks = batch.block_table.shape[1]
    out = torch.empty(s, max_blocks, dtype=torch.int32, device=q_codes.device)
    if s == 0 or max_blocks == 0:
        return out
    block_table = batch.block_table.to(torch.int32)
    seq_lens = batch.seq_lens.to(device=q_codes.device, dtype=torch.int32)
    with launch_guard():
        jit.hamming_block_score_kernel[(s, cdiv(max_blocks, block_nb))](
            q_codes,
            k_code_cache,
            block_table,
            seq_lens,
            out,
            *strides_of(q_codes, k_code_cache, block_table, out),
            max_blocks,
            NUM_KV_HEADS=h,
            WORDS=w,
            BLOCK_NB=block_nb,
            SINK=batch.sink_blocks,
            RECENT=batch.recent_blocks,
            **with_pads(BLOCK_SIZE=b),
        )
    return out
