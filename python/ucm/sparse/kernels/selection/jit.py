"""Triton kernels of the block selection ops (the ``@triton.jit`` layer).

Each kernel has a launcher in :mod:`ucm.sparse.kernels.selection.launchers` (asserts,
strides, grid, constexpr choice) and a plain-torch specification in
:mod:`ucm.sparse.kernels.selection.reference`; tensor shapes are documented there.

Conventions:

* Every tensor is passed with all of its strides, so permuted or strided views
  (e.g. the vLLM CPU KV layout) are read in place.
* Block ids, pool slots and anything multiplied by a large stride are widened
  to int64 before address arithmetic (a paged cache easily exceeds 2**31
  elements).
* Tile sizes are ``tl.constexpr`` powers of two; ``*_PAD`` is the padded size
  of a dimension whose true size is the matching unpadded constexpr.
"""

from __future__ import annotations

from ucm.sparse.kernels.triton_utils import tl, triton


@triton.jit
def _popcount32(x):
    """Set bits of each 32-bit lane (SWAR; works on CUDA and in the interpreter)."""
    v = x.to(tl.uint32, bitcast=True)
    v = v - ((v >> 1) & 0x55555555)
    v = (v & 0x33333333) + ((v >> 2) & 0x33333333)
    v = (v + (v >> 4)) & 0x0F0F0F0F
    v = (v * 0x01010101) >> 24
    return v.to(tl.int32)


@triton.jit
def block_repr_kernel(
    k_ptr,
    block_ids_ptr,
    num_tokens_ptr,
    ch_ptr,
    out_ptr,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_cn,
    stride_ch,
    stride_cd,
    stride_on,
    stride_om,
    stride_oh,
    stride_od,
    BLOCK_SIZE: tl.constexpr,
    C: tl.constexpr,
    C_PAD: tl.constexpr,
    NUM_REPS: tl.constexpr,
    DP: tl.constexpr,
    DP_PAD: tl.constexpr,
    HAS_CHANNELS: tl.constexpr,
):
    """Grid ``(n, H_kv)``: mean of each ``C``-token sub-block of one block and kv head.

    ``out[i, m, h, :] = mean_{t in sub-block m, t < num_tokens[i]} k[block_ids[i], t, h, ch]``
    """
    i = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    blk = tl.load(block_ids_ptr + i).to(tl.int64)
    ntok = tl.minimum(tl.load(num_tokens_ptr + i).to(tl.int32), BLOCK_SIZE)
    offs_d = tl.arange(0, DP_PAD)
    mask_d = offs_d < DP
    if HAS_CHANNELS:
        ch = tl.load(
            ch_ptr + i * stride_cn + h * stride_ch + offs_d * stride_cd, mask=mask_d, other=0
        ).to(tl.int64)
    else:
        ch = offs_d.to(tl.int64)
    base = k_ptr + blk * stride_kb + h * stride_kh
    offs_t = tl.arange(0, C_PAD)
    for m in range(NUM_REPS):
        tok = m * C + offs_t
        mask_t = (offs_t < C) & (tok < ntok)
        ptrs = base + tok[:, None].to(tl.int64) * stride_kt + ch[None, :] * stride_kd
        x = tl.load(ptrs, mask=mask_t[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
        cnt = tl.sum(mask_t.to(tl.float32), axis=0)
        mean = tl.sum(x, axis=0) / tl.maximum(cnt, 1.0)
        tl.store(
            out_ptr + i * stride_on + m * stride_om + h * stride_oh + offs_d * stride_od,
            mean,
            mask=mask_d,
        )


@triton.jit
def block_score_dot_kernel(
    q_ptr,
    rep_ptr,
    table_ptr,
    nreps_ptr,
    out_ptr,
    stride_qs,
    stride_qh,
    stride_qd,
    stride_rp,
    stride_rh,
    stride_rd,
    stride_ts,
    stride_tn,
    stride_os,
    stride_on,
    n_max,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Grid ``(S, cdiv(n_max, BLOCK_N))``: ESA scores of ``BLOCK_N`` candidate blocks.

    ``out[s, j] = sum_h <mean_g q[s, h*G+g], rep[table[s, j], h]>``;
    ``-inf`` past ``num_reps[s]``.
    """
    s = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n = tl.load(nreps_ptr + s)
    mask_n = offs_n < n
    slots = tl.load(table_ptr + s * stride_ts + offs_n * stride_tn, mask=mask_n, other=0)
    slots = slots.to(tl.int64)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask_d = offs_d < HEAD_DIM
    mask_q = (offs_g < GROUP)[:, None] & mask_d[None, :]
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for h in range(NUM_KV_HEADS):
        q_ptrs = q_ptr + s * stride_qs + (h * GROUP + offs_g)[:, None] * stride_qh
        qh = tl.load(q_ptrs + offs_d[None, :] * stride_qd, mask=mask_q, other=0.0)
        qm = tl.sum(qh.to(tl.float32), axis=0) / GROUP
        r_ptrs = rep_ptr + slots[:, None] * stride_rp + h * stride_rh + offs_d[None, :] * stride_rd
        r = tl.load(r_ptrs, mask=mask_n[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(r * qm[None, :], axis=1)
    acc = tl.where(mask_n, acc, float("-inf"))
    tl.store(out_ptr + s * stride_os + offs_n * stride_on, acc, mask=offs_n < n_max)


@triton.jit
def _vote_logits(
    qv,
    rep_ptr,
    row_ptr,
    start,
    n,
    offs_m,
    mask_m,
    offs_d,
    mask_d,
    h,
    stride_tn,
    stride_rp,
    stride_rm,
    stride_rh,
    stride_rd,
    BLOCK_N: tl.constexpr,
):
    """``[BLOCK_N, M_PAD]`` logits of one query against the sub-block
    representatives of the candidate blocks ``start .. start + BLOCK_N`` of
    the ``n`` (-inf where masked), with the blocks' offsets and mask."""
    offs_n = start + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n
    slots = tl.load(row_ptr + offs_n * stride_tn, mask=mask_n, other=0)
    r_ptrs = (
        rep_ptr
        + slots.to(tl.int64)[:, None, None] * stride_rp
        + offs_m[None, :, None] * stride_rm
        + h * stride_rh
        + offs_d[None, None, :] * stride_rd
    )
    mask_r = mask_n[:, None, None] & mask_m[None, :, None] & mask_d[None, None, :]
    r = tl.load(r_ptrs, mask=mask_r, other=0.0).to(tl.float32)
    logit = tl.sum(r * qv[None, None, :], axis=2)
    return tl.where(mask_n[:, None] & mask_m[None, :], logit, float("-inf")), offs_n, mask_n


@triton.jit
def kvstar_vote_kernel(
    q_ptr,
    rep_ptr,
    table_ptr,
    nreps_ptr,
    ch_ptr,
    out_ptr,
    stride_qs,
    stride_qx,
    stride_qh,
    stride_qd,
    stride_rp,
    stride_rm,
    stride_rh,
    stride_rd,
    stride_ts,
    stride_tn,
    stride_cs,
    stride_ch,
    stride_cd,
    stride_os,
    stride_ov,
    stride_on,
    scale,
    NUM_HEADS_Q: tl.constexpr,
    GROUP: tl.constexpr,
    M: tl.constexpr,
    M_PAD: tl.constexpr,
    DP: tl.constexpr,
    DP_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Grid ``(S, X * H_q)``: one query's softmax mass per candidate block.

    Two passes over the ``n * M`` sub-block representatives: the first finds
    the softmax max and normaliser (online), the second writes each block's
    mass to ``out[s, x * H_q + H, j]``; the launcher sums over the middle axis.
    """
    s = tl.program_id(0).to(tl.int64)
    v = tl.program_id(1)
    x = v // NUM_HEADS_Q
    hq = v % NUM_HEADS_Q
    h = hq // GROUP
    n = tl.load(nreps_ptr + s)
    offs_d = tl.arange(0, DP_PAD)
    mask_d = offs_d < DP
    offs_m = tl.arange(0, M_PAD)
    mask_m = offs_m < M
    ch = tl.load(ch_ptr + s * stride_cs + h * stride_ch + offs_d * stride_cd, mask=mask_d, other=0)
    q_ptrs = q_ptr + s * stride_qs + x * stride_qx + hq * stride_qh
    qv = tl.load(q_ptrs + ch.to(tl.int64) * stride_qd, mask=mask_d, other=0.0).to(tl.float32)
    qv = qv * scale
    row_ptr = table_ptr + s * stride_ts
    m_i = tl.max(tl.full([M_PAD], float("-inf"), tl.float32), axis=0)
    l_i = tl.sum(tl.zeros([M_PAD], tl.float32), axis=0)
    for start in range(0, n, BLOCK_N):
        logit, offs_n, mask_n = _vote_logits(
            qv, rep_ptr, row_ptr, start, n, offs_m, mask_m, offs_d, mask_d, h,
            stride_tn, stride_rp, stride_rm, stride_rh, stride_rd, BLOCK_N,
        )  # fmt: skip
        m_new = tl.maximum(m_i, tl.max(tl.max(logit, axis=1), axis=0))
        p = tl.exp(logit - m_new)
        l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.sum(p, axis=1), axis=0)
        m_i = m_new
    inv_l = 1.0 / l_i
    for start in range(0, n, BLOCK_N):
        logit, offs_n, mask_n = _vote_logits(
            qv, rep_ptr, row_ptr, start, n, offs_m, mask_m, offs_d, mask_d, h,
            stride_tn, stride_rp, stride_rm, stride_rh, stride_rd, BLOCK_N,
        )  # fmt: skip
        mass = tl.sum(tl.exp(logit - m_i), axis=1) * inv_l
        tl.store(out_ptr + s * stride_os + v * stride_ov + offs_n * stride_on, mass, mask=mask_n)


@triton.jit
def srp_encode_kernel(
    x_ptr,
    proj_ptr,
    out_ptr,
    slot_ptr,
    n_rows,
    stride_xt,
    stride_xh,
    stride_xd,
    stride_pd,
    stride_pb,
    stride_ob,
    stride_ot,
    stride_oh,
    stride_ow,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    NBITS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    CACHE_BLOCK: tl.constexpr,
    USE_SLOTS: tl.constexpr,
):
    """Grid ``(cdiv(T * H, BLOCK_R),)``: packed sign bits of ``x @ proj`` per (token, head).

    Without slots the code of row ``(t, h)`` goes to ``out[t, h, :]``; with
    slots it goes to the paged code cache ``out[slot // B, slot % B, h, :]``
    and tokens whose slot is negative are skipped.
    """
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = rows < n_rows
    t = (rows // NUM_HEADS).to(tl.int64)
    h = (rows % NUM_HEADS).to(tl.int64)
    offs_d = tl.arange(0, D_PAD)
    mask_d = offs_d < HEAD_DIM
    x_ptrs = x_ptr + t[:, None] * stride_xt + h[:, None] * stride_xh + offs_d[None, :] * stride_xd
    x = tl.load(x_ptrs, mask=mask_r[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
    offs_b = tl.arange(0, NBITS)
    w = tl.load(
        proj_ptr + offs_d[:, None] * stride_pd + offs_b[None, :] * stride_pb,
        mask=mask_d[:, None],
        other=0.0,
    ).to(tl.float32)
    proj = tl.dot(x, w, input_precision="ieee")
    bits = (proj > 0).to(tl.uint32) << (offs_b % 32).to(tl.uint32)[None, :]
    words = tl.sum(tl.reshape(bits, (BLOCK_R, NBITS // 32, 32)), axis=2).to(tl.uint32)
    offs_w = tl.arange(0, NBITS // 32)
    if USE_SLOTS:
        slot = tl.load(slot_ptr + t, mask=mask_r, other=-1).to(tl.int64)
        valid = mask_r & (slot >= 0)
        slot = tl.where(valid, slot, 0)
        base = (slot // CACHE_BLOCK) * stride_ob + (slot % CACHE_BLOCK) * stride_ot
    else:
        valid = mask_r
        base = t * stride_ot
    out_ptrs = out_ptr + (base + h * stride_oh)[:, None] + offs_w[None, :] * stride_ow
    tl.store(out_ptrs, words.to(tl.int32, bitcast=True), mask=valid[:, None])


@triton.jit
def hamming_block_score_kernel(
    qc_ptr,
    kc_ptr,
    table_ptr,
    seq_lens_ptr,
    out_ptr,
    stride_qs,
    stride_qh,
    stride_qw,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_kw,
    stride_ts,
    stride_tn,
    stride_os,
    stride_on,
    max_blocks,
    NUM_KV_HEADS: tl.constexpr,
    WORDS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_SIZE_PAD: tl.constexpr,
    BLOCK_NB: tl.constexpr,
    SINK: tl.constexpr,
    RECENT: tl.constexpr,
):
    """Grid ``(S, cdiv(max_blocks, BLOCK_NB))``: min Hamming distance per block.

    Token distance = min over kv heads of the popcount of ``q ^ k`` summed over
    words; block score = min over its valid tokens; sink and recent blocks get
    -1 (forced), blocks past the sequence ``2**31 - 1`` (invalid).
    """
    s = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK_NB + tl.arange(0, BLOCK_NB)
    sl = tl.load(seq_lens_ptr + s).to(tl.int32)
    nb = (sl + BLOCK_SIZE - 1) // BLOCK_SIZE
    mask_j = j < nb
    blk = tl.load(table_ptr + s * stride_ts + j * stride_tn, mask=mask_j, other=0).to(tl.int64)
    tok = tl.arange(0, BLOCK_SIZE_PAD)
    pos = j[:, None] * BLOCK_SIZE + tok[None, :]
    valid = mask_j[:, None] & (tok < BLOCK_SIZE)[None, :] & (pos < sl)
    base = kc_ptr + blk[:, None] * stride_kb + tok[None, :].to(tl.int64) * stride_kt
    best = tl.full([BLOCK_NB, BLOCK_SIZE_PAD], 2147483647, tl.int32)
    for h in range(NUM_KV_HEADS):
        dist = tl.zeros([BLOCK_NB, BLOCK_SIZE_PAD], dtype=tl.int32)
        for w in range(WORDS):
            qw = tl.load(qc_ptr + s * stride_qs + h * stride_qh + w * stride_qw)
            kw = tl.load(base + h * stride_kh + w * stride_kw, mask=valid, other=0)
            dist += _popcount32(kw ^ qw)
        best = tl.minimum(best, dist)
    best = tl.where(valid, best, 2147483647)
    score = tl.min(best, axis=1)
    forced = (j < SINK) | (j >= nb - RECENT)
    score = tl.where(forced, -1, score)
    score = tl.where(mask_j, score, 2147483647)
    tl.store(out_ptr + s * stride_os + j * stride_on, score, mask=j < max_blocks)
