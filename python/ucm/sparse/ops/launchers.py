"""Pure-Python launchers of the Triton kernels (the host layer).

A launcher checks shapes and dtypes, allocates outputs, passes every stride,
picks the constexpr tile sizes and the grid, and launches. The tile and split
choices are small functions with their own unit tests. Shapes are those of
:mod:`ucm.sparse.ops.reference`.
"""

from __future__ import annotations

import contextlib
import math
import threading

import torch

from ucm.sparse.ops import kernels
from ucm.sparse.triton_utils import INTERPRET, cdiv, next_power_of_2

#: tl.dot needs every dimension >= 16.
MIN_DOT = 16

# The Triton interpreter keeps launch state in globals: two threads launching
# at once (an asynchronous retrieval next to the forward) corrupt each other.
# Compiled launches are thread-safe and take no lock.
_INTERPRETER_LOCK = threading.Lock()


def _launch_guard() -> contextlib.AbstractContextManager:
    return _INTERPRETER_LOCK if INTERPRET else contextlib.nullcontext()


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def dot_pad(n: int) -> int:
    """Padded size of a ``tl.dot`` operand dimension (power of two, >= 16)."""
    return max(MIN_DOT, next_power_of_2(n))


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_blocks: int, target_programs: int = 256
) -> int:
    """Flash-decoding split count: enough programs to fill a GPU, >= 4 blocks per split.

    With few sequences and kv heads a long sequence would run on a handful of
    programs; splitting its blocks over ``NUM_SPLITS`` programs and reducing
    afterwards keeps the machine busy. Powers of two keep compiled variants few.
    """
    base = max(1, num_seqs * num_kv_heads)
    want = cdiv(target_programs, base)
    cap = max(1, max_blocks // 4)
    splits = max(1, min(want, cap, 64))
    return 1 << (splits.bit_length() - 1)


def block_representatives(
    k_cache: torch.Tensor,
    block_ids: torch.Tensor,
    num_tokens: torch.Tensor,
    tokens_per_rep: int | None = None,
    channels: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton :func:`ucm.sparse.ops.reference.block_representatives`."""
    _check(k_cache.dim() == 4, f"k_cache must be [num_blocks, B, H_kv, D], got {k_cache.shape}")
    _, b, h, d = k_cache.shape
    n = int(block_ids.numel())
    _check(num_tokens.numel() == n, "num_tokens must have one entry per block id")
    c = b if tokens_per_rep is None else int(tokens_per_rep)
    _check(1 <= c <= b, f"tokens_per_rep must be in [1, {b}], got {c}")
    m = cdiv(b, c)
    dev = k_cache.device
    block_ids = block_ids.to(device=dev, dtype=torch.int64).contiguous()
    num_tokens = num_tokens.to(device=dev, dtype=torch.int32).contiguous()
    if channels is not None:
        _check(channels.shape[-2] == h, f"channels must be [..., {h}, D'], got {channels.shape}")
        if channels.dim() == 2:
            channels = channels.unsqueeze(0).expand(n, -1, -1)
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
    with _launch_guard():
        kernels.block_repr_kernel[(n, h)](
            k_cache,
            block_ids,
            num_tokens,
            channels,
            out,
            *k_cache.stride(),
            *ch_strides,
            *out.stride(),
            BLOCK_SIZE=b,
            C=c,
            C_PAD=next_power_of_2(c),
            NUM_REPS=m,
            DP=dp,
            DP_PAD=next_power_of_2(dp),
            HAS_CHANNELS=ch_strides != (0, 0, 0),
        )
    return out


def _group_for(h_q: int, h_kv: int) -> int:
    _check(h_q % h_kv == 0, f"{h_q} query heads are not a multiple of {h_kv} kv heads")
    return h_q // h_kv


def block_scores_dot(
    q: torch.Tensor,
    rep_pool: torch.Tensor,
    rep_table: torch.Tensor,
    num_reps: torch.Tensor,
    block_n: int = 64,
) -> torch.Tensor:
    """Triton :func:`ucm.sparse.ops.reference.block_scores_dot`."""
    _check(q.dim() == 3, f"q must be [S, H_q, D], got {q.shape}")
    _check(rep_pool.dim() == 3, f"rep_pool must be [P, H_kv, D], got {rep_pool.shape}")
    s, h_q, d = q.shape
    h_kv = rep_pool.shape[1]
    _check(rep_pool.shape[2] == d, "rep_pool head dim differs from q")
    if h_q < h_kv:  # fewer query heads: repeat them (as the reference does)
        _check(h_kv % h_q == 0, f"{h_kv} kv heads are not a multiple of {h_q} query heads")
        q = q.repeat_interleave(h_kv // h_q, dim=1)
        h_q = h_kv
    g = _group_for(h_q, h_kv)
    n_max = rep_table.shape[1]
    rep_table = rep_table.to(torch.int32)
    num_reps = num_reps.to(device=q.device, dtype=torch.int32)
    out = torch.empty(s, n_max, dtype=torch.float32, device=q.device)
    if s == 0 or n_max == 0:
        return out
    grid = (s, cdiv(n_max, block_n))
    with _launch_guard():
        kernels.block_score_dot_kernel[grid](
            q,
            rep_pool,
            rep_table,
            num_reps,
            out,
            *q.stride(),
            *rep_pool.stride(),
            *rep_table.stride(),
            *out.stride(),
            n_max,
            NUM_KV_HEADS=h_kv,
            GROUP=g,
            GROUP_PAD=next_power_of_2(g),
            HEAD_DIM=d,
            D_PAD=next_power_of_2(d),
            BLOCK_N=block_n,
        )
    return out


def kvstar_vote_scores(
    q: torch.Tensor,
    rep_pool: torch.Tensor,
    rep_table: torch.Tensor,
    num_reps: torch.Tensor,
    channels: torch.Tensor,
    scale: float,
    block_n: int = 32,
) -> torch.Tensor:
    """Triton :func:`ucm.sparse.ops.reference.kvstar_vote_scores`."""
    _check(q.dim() == 4, f"q must be [S, X, H_q, D], got {q.shape}")
    _check(rep_pool.dim() == 4, f"rep_pool must be [P, M, H_kv, D'], got {rep_pool.shape}")
    s, x, h_q, _ = q.shape
    _, m, h_kv, dp = rep_pool.shape
    g = _group_for(h_q, h_kv)
    _check(
        tuple(channels.shape) == (s, h_kv, dp),
        f"channels must be [{s}, {h_kv}, {dp}], got {tuple(channels.shape)}",
    )
    n_max = rep_table.shape[1]
    rep_table = rep_table.to(torch.int32)
    num_reps = num_reps.to(device=q.device, dtype=torch.int32)
    channels = channels.to(torch.int32)
    votes = torch.zeros(s, x * h_q, n_max, dtype=torch.float32, device=q.device)
    if s and n_max and x:
        with _launch_guard():
            kernels.kvstar_vote_kernel[(s, x * h_q)](
                q,
                rep_pool,
                rep_table,
                num_reps,
                channels,
                votes,
                *q.stride(),
                *rep_pool.stride(),
                *rep_table.stride(),
                *channels.stride(),
                *votes.stride(),
                float(scale),
                NUM_HEADS_Q=h_q,
                GROUP=g,
                M=m,
                M_PAD=next_power_of_2(m),
                DP=dp,
                DP_PAD=next_power_of_2(dp),
                BLOCK_N=block_n,
            )
    out = votes.sum(dim=1)
    idx = torch.arange(n_max, device=q.device)
    return out.masked_fill(idx.unsqueeze(0) >= num_reps.long().unsqueeze(1), float("-inf"))


def _srp_launch(
    x: torch.Tensor,
    proj: torch.Tensor,
    out: torch.Tensor,
    slots: torch.Tensor | None,
    block_r: int = 32,
) -> None:
    t, h, d = x.shape
    d_p, nbits = proj.shape
    _check(d_p == d, f"proj must be [{d}, nbits], got {tuple(proj.shape)}")
    _check(
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
    with _launch_guard():
        kernels.srp_encode_kernel[(cdiv(rows, block_r),)](
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
    """Triton :func:`ucm.sparse.ops.reference.srp_encode` for ``x`` ``[..., H, D]``."""
    _check(x.dim() >= 2, f"x must be [..., H, D], got {x.shape}")
    lead = x.shape[:-2]
    x3 = x.reshape(-1, x.shape[-2], x.shape[-1])
    words = proj.shape[1] // 32
    out = torch.empty(x3.shape[0], x3.shape[1], words, dtype=torch.int32, device=x.device)
    _srp_launch(x3, proj.to(x.device), out, None)
    return out.reshape(*lead, x.shape[-2], proj.shape[1] // 32)


def srp_encode_to_cache(
    k: torch.Tensor, proj: torch.Tensor, code_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Triton :func:`ucm.sparse.ops.reference.srp_encode_to_cache`."""
    _check(k.dim() == 3, f"k must be [T, H_kv, D], got {k.shape}")
    _check(code_cache.dim() == 4, "code_cache must be [num_blocks, B, H_kv, W]")
    _check(code_cache.dtype == torch.int32, "code_cache must be int32")
    _check(slot_mapping.numel() == k.shape[0], "slot_mapping must have one slot per token")
    slots = slot_mapping.to(device=k.device, dtype=torch.int64).contiguous()
    _srp_launch(k, proj.to(k.device), code_cache, slots)


def block_scores_hamming(
    q_codes: torch.Tensor,
    k_code_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sink_blocks: int = 1,
    recent_blocks: int = 4,
    block_nb: int = 16,
) -> torch.Tensor:
    """Triton :func:`ucm.sparse.ops.reference.block_scores_hamming`."""
    _check(q_codes.dim() == 3, f"q_codes must be [S, H_kv, W], got {q_codes.shape}")
    _check(k_code_cache.dim() == 4, "k_code_cache must be [num_blocks, B, H_kv, W]")
    s, h, w = q_codes.shape
    _, b, h2, w2 = k_code_cache.shape
    _check((h, w) == (h2, w2), "q_codes and k_code_cache disagree on kv heads or words")
    max_blocks = block_table.shape[1]
    out = torch.empty(s, max_blocks, dtype=torch.int32, device=q_codes.device)
    if s == 0 or max_blocks == 0:
        return out
    block_table = block_table.to(torch.int32)
    seq_lens = seq_lens.to(device=q_codes.device, dtype=torch.int32)
    with _launch_guard():
        kernels.hamming_block_score_kernel[(s, cdiv(max_blocks, block_nb))](
            q_codes,
            k_code_cache,
            block_table,
            seq_lens,
            out,
            *q_codes.stride(),
            *k_code_cache.stride(),
            *block_table.stride(),
            *out.stride(),
            max_blocks,
            NUM_KV_HEADS=h,
            WORDS=w,
            BLOCK_SIZE=b,
            B_PAD=next_power_of_2(b),
            BLOCK_NB=block_nb,
            SINK=sink_blocks,
            RECENT=recent_blocks,
        )
    return out


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton :func:`ucm.sparse.ops.reference.paged_decode_attention` (flash-decoding).

    ``num_splits`` forces the split count (default: :func:`choose_num_splits`).
    """
    _check(q.dim() == 3, f"q must be [S, H_q, D], got {q.shape}")
    _check(k_cache.dim() == 4 and v_cache.dim() == 4, "caches must be [num_blocks, B, H_kv, D]")
    _check(k_cache.shape == v_cache.shape, "k_cache and v_cache shapes differ")
    _check(k_cache.dtype == v_cache.dtype, "k_cache and v_cache dtypes differ")
    s, h_q, d = q.shape
    _, b, h_kv, d2 = k_cache.shape
    _check(d == d2, f"q head dim {d} != cache head dim {d2}")
    g = _group_for(h_q, h_kv)
    _check(block_table.dim() == 2 and block_table.shape[0] == s, "block_table must be [S, n]")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    max_blocks = block_table.shape[1]
    splits = num_splits or choose_num_splits(s, h_kv, max_blocks)
    if out is None:
        out = torch.empty(s, h_q, d, dtype=q.dtype, device=q.device)
    if s == 0:
        return out
    block_table = block_table.to(torch.int32)
    seq_lens = seq_lens.to(device=q.device, dtype=torch.int32)
    # Triton 3.7's interpreter returns garbage for tl.dot on bfloat16 operands;
    # there the kernel computes in fp32 (compiled kernels use the tensor cores).
    upcast = INTERPRET and k_cache.dtype != torch.float32
    acc = torch.empty(s, h_q, splits, d, dtype=torch.float32, device=q.device)
    m = torch.empty(s, h_q, splits, dtype=torch.float32, device=q.device)
    lsum = torch.empty_like(m)
    with _launch_guard():
        kernels.paged_decode_split_kernel[(s, h_kv, splits)](
            q,
            k_cache,
            v_cache,
            block_table,
            seq_lens,
            acc,
            m,
            lsum,
            *q.stride(),
            *k_cache.stride(),
            *v_cache.stride(),
            *block_table.stride(),
            *acc.stride(),
            *m.stride(),
            scale,
            GROUP=g,
            GROUP_PAD=dot_pad(g),
            HEAD_DIM=d,
            D_PAD=dot_pad(d),
            BLOCK_SIZE=b,
            BLOCK_N=dot_pad(b),
            NUM_SPLITS=splits,
            IEEE=upcast or k_cache.dtype == torch.float32,
            UPCAST=upcast,
        )
    with _launch_guard():
        kernels.paged_decode_reduce_kernel[(s, h_q)](
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
