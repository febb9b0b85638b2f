"""Triton kernels of the key ops (the ``@triton.jit`` layer).

Launchers: :mod:`ucm.sparse.kernels.keys.launchers`; specification:
:mod:`ucm.sparse.kernels.keys.reference`. Every tensor comes with all its strides,
so the vLLM CPU paged layout (K transposed inside each block) and plain
``[T, H, D]`` tensors are read and written in place. Block ids, slots and
anything multiplied by a block stride are widened to int64 first.
"""

from __future__ import annotations

from ucm.sparse.kernels.triton_utils import tl, triton


@triton.jit
def delta_rope_kernel(
    k_ptr,
    block_ids_ptr,
    deltas_ptr,
    num_tokens_ptr,
    cs_ptr,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_dn,
    stride_dt,
    stride_cp,
    stride_cr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    IS_NEOX: tl.constexpr,
    HAS_NUM_TOKENS: tl.constexpr,
):
    """Grid ``(n, H_kv, cdiv(B, BLOCK_T))``: rotates ``BLOCK_T`` tokens of one block and head.

    ``k[blk, t, h, :2*HALF]`` (``blk = block_ids[i]``) is rotated by the
    angle of ``delta = deltas[i * stride_dn + t * stride_dt]``
    (``stride_dt = 0``: one delta per block): with ``c, s = cos_sin[|delta|]``
    and ``s`` negated for a negative delta, each pair ``(x1, x2)`` becomes
    ``(x1 c - x2 s, x2 c + x1 s)``; fp32 arithmetic, one rounding on store.
    Each element is read and written by exactly one program.
    """
    i = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs_t = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    blk = tl.load(block_ids_ptr + i).to(tl.int64)
    if HAS_NUM_TOKENS:
        ntok = tl.minimum(tl.load(num_tokens_ptr + i).to(tl.int32), BLOCK_SIZE)
    else:
        ntok = BLOCK_SIZE
    mask_t = offs_t < ntok
    delta = tl.load(
        deltas_ptr + i * stride_dn + offs_t.to(tl.int64) * stride_dt, mask=mask_t, other=0
    )
    delta = delta.to(tl.int64)
    absd = tl.where(delta < 0, -delta, delta)
    sign = tl.where(delta < 0, -1.0, 1.0)
    offs_f = tl.arange(0, HALF_PAD)
    mask_f = offs_f < HALF
    mask = mask_t[:, None] & mask_f[None, :]
    cs_row = cs_ptr + absd[:, None] * stride_cp
    cos = tl.load(cs_row + offs_f[None, :] * stride_cr, mask=mask, other=1.0).to(tl.float32)
    sin = tl.load(cs_row + (HALF + offs_f)[None, :] * stride_cr, mask=mask, other=0.0)
    sin = sin.to(tl.float32) * sign[:, None]
    if IS_NEOX:
        d1 = offs_f
        d2 = offs_f + HALF
    else:
        d1 = 2 * offs_f
        d2 = 2 * offs_f + 1
    base = k_ptr + blk * stride_kb + h * stride_kh + offs_t.to(tl.int64)[:, None] * stride_kt
    p1 = base + d1.to(tl.int64)[None, :] * stride_kd
    p2 = base + d2.to(tl.int64)[None, :] * stride_kd
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    tl.store(p1, o1.to(k_ptr.dtype.element_ty), mask=mask)
    tl.store(p2, o2.to(k_ptr.dtype.element_ty), mask=mask)


@triton.jit
def kv_deviation_kernel(
    k_ptr,
    slots_ptr,
    f_ptr,
    out_ptr,
    n_tokens,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_ft,
    stride_fh,
    stride_fd,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Grid ``(cdiv(T, BLOCK_T),)``: ``out[t] = sum_{h,d} |k[slot_t] - fresh[t]|`` (0 if slot < 0).

    Reads the cached keys through the slot mapping in place (no gather copy).
    """
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < n_tokens
    slot = tl.load(slots_ptr + offs_t, mask=mask_t, other=-1).to(tl.int64)
    valid = mask_t & (slot >= 0)
    slot = tl.where(valid, slot, 0)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = valid[:, None] & (offs_d < HEAD_DIM)[None, :]
    k_row = k_ptr + (slot // BLOCK_SIZE) * stride_kb + (slot % BLOCK_SIZE) * stride_kt
    f_row = f_ptr + offs_t.to(tl.int64) * stride_ft
    acc = tl.zeros([BLOCK_T], dtype=tl.float32)
    for h in range(NUM_HEADS):
        kc = tl.load(
            k_row[:, None] + h * stride_kh + offs_d[None, :] * stride_kd, mask=mask, other=0.0
        ).to(tl.float32)
        kf = tl.load(
            f_row[:, None] + h * stride_fh + offs_d[None, :] * stride_fd, mask=mask, other=0.0
        ).to(tl.float32)
        acc += tl.sum(tl.abs(kc - kf), axis=1)
    tl.store(out_ptr + offs_t, tl.where(valid, acc, 0.0), mask=mask_t)
