"""Triton kernels of attention over paged KV (the ``@triton.jit`` layer).

Launchers: :mod:`ucm.sparse.kernels.attention.launchers`; specification:
:mod:`ucm.sparse.kernels.attention.reference`.

Per key tile both kernels decide from the tile's relative-position range
which scores they need: a tile entirely inside the window computes only
``S1 = q . k`` (the ordinary RoPE score), a tile entirely beyond it only
``S2 = q_w . k2``, and only the tiles on the window's edge compute both and
pick per element (``q_pos - j < W``). Long prompts therefore cost about one
score product per tile plus one extra on a band of width ``W``, not two
everywhere. ``REROPE = False`` compiles the plain (position-causal)
attention that sparse decode over selected blocks and Blend's
non-contiguous recomputed tokens use.

Block ids, token offsets and anything multiplied by a cache stride are
widened to int64. ``UPCAST`` computes the products in fp32 (the launcher
sets it for 16-bit inputs under the interpreter, whose ``tl.dot`` mis-computes
bfloat16), ``IEEE`` asks for exact fp32 products.
"""

from __future__ import annotations

from ucm.sparse.kernels.triton_utils import tl, triton


@triton.jit
def _tile_dot(a, b_ptrs, mask, IEEE: tl.constexpr, UPCAST: tl.constexpr, A_AS_B: tl.constexpr):
    """``a @ b`` with the tile ``b`` loaded at ``b_ptrs`` (``A_AS_B``: ``a`` cast to its dtype)."""
    b = tl.load(b_ptrs, mask=mask, other=0.0)
    if UPCAST:
        b = b.to(tl.float32)
    if A_AS_B:
        a = a.to(b.dtype)
    if IEEE:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _cache_ptrs(cache_ptr, blk, off, h, d, stride_b, stride_t, stride_h, stride_d):
    """Addresses of the paged cache elements (block ``blk``, token ``off`` of
    the block, kv head ``h``, dim ``d``), broadcast like the indices."""
    return cache_ptr + blk * stride_b + off * stride_t + h * stride_h + d * stride_d


@triton.jit
def _scores(
    q,
    qw,
    k_ptrs,
    k2_ptrs,
    kmask,
    rel,
    window,
    min_rel,
    max_rel,
    REROPE: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Scores of one ``[M, D] x [D, N]`` tile: S1, S2 or the per-element mix."""
    if REROPE:
        if max_rel < window:
            s = _tile_dot(q, k_ptrs, kmask, IEEE, UPCAST, False)
        elif min_rel >= window:
            s = _tile_dot(qw, k2_ptrs, kmask, IEEE, UPCAST, False)
        else:
            s1 = _tile_dot(q, k_ptrs, kmask, IEEE, UPCAST, False)
            s2 = _tile_dot(qw, k2_ptrs, kmask, IEEE, UPCAST, False)
            s = tl.where(rel < window, s1, s2)
    else:
        s = _tile_dot(q, k_ptrs, kmask, IEEE, UPCAST, False)
    return s


@triton.jit
def _load_queries(q_ptrs, qw_ptrs, qmask, k_ptr, REROPE: tl.constexpr, UPCAST: tl.constexpr):
    """The query tile and, with ReRoPE, ``q_w`` (else ``q`` again), in the product dtype."""
    q = tl.load(q_ptrs, mask=qmask, other=0.0)
    if REROPE:
        qw = tl.load(qw_ptrs, mask=qmask, other=0.0)
    else:
        qw = q
    if UPCAST:
        q = q.to(tl.float32)
        qw = qw.to(tl.float32)
    else:
        q = q.to(k_ptr.dtype.element_ty)
        qw = qw.to(k_ptr.dtype.element_ty)
    return q, qw


@triton.jit
def _softmax_step(sc, v_ptrs, vmask, m_i, l_i, acc, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """One tile of the online softmax: scaled scores ``sc`` (-inf where not
    visible) and the V tile at ``v_ptrs``; returns the new max, normaliser and
    unnormalised output."""
    m_new = tl.maximum(m_i, tl.max(sc, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(sc - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _tile_dot(p, v_ptrs, vmask, IEEE, UPCAST, True)
    return m_new, l_i, acc


@triton.jit
def paged_prefill_kernel(
    q_ptr,
    qw_ptr,
    k_ptr,
    k2_ptr,
    v_ptr,
    out_ptr,
    table_ptr,
    seq_lens_ptr,
    qsl_ptr,
    qpos_ptr,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_wt,
    stride_wh,
    stride_wd,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_k2b,
    stride_k2t,
    stride_k2h,
    stride_k2d,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_ts,
    stride_tn,
    scale,
    window,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    REROPE: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Grid ``(S, cdiv(max_q_len, BLOCK_Q), H_kv)``: ``BLOCK_Q`` query tokens x ``G`` heads.

    The ``BLOCK_M = BLOCK_Q * G`` rows of a program are the ``G`` query heads
    of kv head ``h`` for ``BLOCK_Q`` consecutive query tokens of sequence
    ``s`` (row ``m``: token ``m // G``, head ``h * G + m % G``), so every K/V
    tile is loaded once for the whole GQA group. Keys ``0 .. max(q_pos)`` of
    the sequence are visited in tiles of ``BLOCK_N`` tokens, each token found
    through the block table; a key is visible to a row iff ``j <= q_pos``.
    Online softmax in fp32; a row that sees no key gets 0.
    """
    s = tl.program_id(0).to(tl.int64)
    qt = tl.program_id(1)
    h = tl.program_id(2).to(tl.int64)
    q_start = tl.load(qsl_ptr + s).to(tl.int64)
    q_len = (tl.load(qsl_ptr + s + 1).to(tl.int64) - q_start).to(tl.int32)
    if qt * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + s).to(tl.int32)
    offs_m = tl.arange(0, BLOCK_M)
    tok = qt * BLOCK_Q + offs_m // GROUP
    mask_m = (offs_m // GROUP < BLOCK_Q) & (tok < q_len)
    row = q_start + tok.to(tl.int64)
    head = h * GROUP + (offs_m % GROUP).to(tl.int64)
    pos = tl.load(qpos_ptr + row, mask=mask_m, other=0).to(tl.int32)
    pos_max = tl.max(tl.where(mask_m, pos, -1), axis=0)
    pos_min = tl.min(tl.where(mask_m, pos, 2147483647), axis=0)
    offs_d = tl.arange(0, D_PAD)
    mask_d = offs_d < HEAD_DIM
    qmask = mask_m[:, None] & mask_d[None, :]
    q, qw = _load_queries(
        q_ptr + row[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        qw_ptr + row[:, None] * stride_wt + head[:, None] * stride_wh + offs_d[None, :] * stride_wd,
        qmask,
        k_ptr,
        REROPE,
        UPCAST,
    )
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    kv_end = tl.minimum(seq_len, pos_max + 1)
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(0, kv_end, BLOCK_N):
        j = start + offs_n
        mask_n = j < kv_end
        blk = tl.load(
            table_ptr + s * stride_ts + (j // BLOCK_SIZE).to(tl.int64) * stride_tn,
            mask=mask_n,
            other=0,
        ).to(tl.int64)
        off = (j % BLOCK_SIZE).to(tl.int64)
        kmask = mask_d[:, None] & mask_n[None, :]
        # K tiles are [D, N], the V tile [N, D].
        k_ptrs = _cache_ptrs(k_ptr, blk[None, :], off[None, :], h, offs_d[:, None],
                             stride_kb, stride_kt, stride_kh, stride_kd)  # fmt: skip
        k2_ptrs = _cache_ptrs(k2_ptr, blk[None, :], off[None, :], h, offs_d[:, None],
                              stride_k2b, stride_k2t, stride_k2h, stride_k2d)  # fmt: skip
        rel = pos[:, None] - j[None, :]
        min_rel = pos_min - (start + BLOCK_N - 1)
        max_rel = pos_max - start
        sc = _scores(
            q, qw, k_ptrs, k2_ptrs, kmask, rel, window, min_rel, max_rel, REROPE, IEEE, UPCAST
        )
        visible = (rel >= 0) & mask_n[None, :] & mask_m[:, None]
        sc = tl.where(visible, sc * scale, float("-inf"))
        v_ptrs = _cache_ptrs(v_ptr, blk[:, None], off[:, None], h, offs_d[None, :],
                             stride_vb, stride_vt, stride_vh, stride_vd)  # fmt: skip
        vmask = mask_n[:, None] & mask_d[None, :]
        m_i, l_i, acc = _softmax_step(sc, v_ptrs, vmask, m_i, l_i, acc, IEEE, UPCAST)
    out = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
    tl.store(
        out_ptr
        + row[:, None] * stride_ot
        + head[:, None] * stride_oh
        + offs_d[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=qmask,
    )


@triton.jit
def paged_decode_split_kernel(
    q_ptr,
    qw_ptr,
    k_ptr,
    k2_ptr,
    v_ptr,
    table_ptr,
    seq_lens_ptr,
    qpos_ptr,
    acc_ptr,
    m_ptr,
    l_ptr,
    stride_qs,
    stride_qh,
    stride_qd,
    stride_ws,
    stride_wh,
    stride_wd,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_k2b,
    stride_k2t,
    stride_k2h,
    stride_k2d,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_ts,
    stride_tn,
    stride_as,
    stride_ah,
    stride_ap,
    stride_ad,
    stride_ms,
    stride_mh,
    stride_mp,
    scale,
    window,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    REROPE: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Grid ``(S, H_kv, NUM_SPLITS)``: flash-decoding partials of one GQA group.

    One query per sequence (``q[s]`` at position ``q_pos[s]``, keys
    ``0 .. min(seq_len, q_pos + 1)``). Split ``p`` covers a contiguous range
    of the sequence's blocks, one block per tile, and writes the unnormalised
    ``acc``, running max ``m`` and normaliser ``l`` of the ``G`` heads;
    :func:`paged_decode_reduce_kernel` combines them.
    """
    s = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    sp = tl.program_id(2)
    pos = tl.load(qpos_ptr + s).to(tl.int32)
    kv_len = tl.minimum(tl.load(seq_lens_ptr + s).to(tl.int32), pos + 1)
    nb = (kv_len + BLOCK_SIZE - 1) // BLOCK_SIZE
    per = (nb + NUM_SPLITS - 1) // NUM_SPLITS
    start_b = sp * per
    end_b = tl.minimum(nb, start_b + per)
    offs_g = tl.arange(0, GROUP_PAD)
    mask_g = offs_g < GROUP
    offs_d = tl.arange(0, D_PAD)
    mask_d = offs_d < HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)
    off = offs_n.to(tl.int64)  # token offsets inside a block (a tile is one block)
    heads = h * GROUP + offs_g
    qmask = mask_g[:, None] & mask_d[None, :]
    q, qw = _load_queries(
        q_ptr + s * stride_qs + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        qw_ptr + s * stride_ws + heads[:, None] * stride_wh + offs_d[None, :] * stride_wd,
        qmask,
        k_ptr,
        REROPE,
        UPCAST,
    )
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    for jb in range(start_b, end_b):
        blk = tl.load(table_ptr + s * stride_ts + jb * stride_tn).to(tl.int64)
        j = jb * BLOCK_SIZE + offs_n
        mask_n = (offs_n < BLOCK_SIZE) & (j < kv_len)
        kmask = mask_d[:, None] & mask_n[None, :]
        # K tiles are [D, N], the V tile [N, D].
        k_ptrs = _cache_ptrs(k_ptr, blk, off[None, :], h, offs_d[:, None],
                             stride_kb, stride_kt, stride_kh, stride_kd)  # fmt: skip
        k2_ptrs = _cache_ptrs(k2_ptr, blk, off[None, :], h, offs_d[:, None],
                              stride_k2b, stride_k2t, stride_k2h, stride_k2d)  # fmt: skip
        rel = pos - j[None, :]
        min_rel = pos - (jb * BLOCK_SIZE + BLOCK_SIZE - 1)
        max_rel = pos - jb * BLOCK_SIZE
        sc = _scores(
            q, qw, k_ptrs, k2_ptrs, kmask, rel, window, min_rel, max_rel, REROPE, IEEE, UPCAST
        )
        sc = tl.where(mask_n[None, :], sc * scale, float("-inf"))
        v_ptrs = _cache_ptrs(v_ptr, blk, off[:, None], h, offs_d[None, :],
                             stride_vb, stride_vt, stride_vh, stride_vd)  # fmt: skip
        vmask = mask_n[:, None] & mask_d[None, :]
        m_i, l_i, acc = _softmax_step(sc, v_ptrs, vmask, m_i, l_i, acc, IEEE, UPCAST)
    a_ptrs = acc_ptr + s * stride_as + heads[:, None] * stride_ah + sp * stride_ap
    tl.store(a_ptrs + offs_d[None, :] * stride_ad, acc, mask=qmask)
    ml_off = s * stride_ms + heads * stride_mh + sp * stride_mp
    tl.store(m_ptr + ml_off, m_i, mask=mask_g)
    tl.store(l_ptr + ml_off, l_i, mask=mask_g)


@triton.jit
def paged_decode_reduce_kernel(
    acc_ptr,
    m_ptr,
    l_ptr,
    out_ptr,
    stride_as,
    stride_ah,
    stride_ap,
    stride_ad,
    stride_ms,
    stride_mh,
    stride_mp,
    stride_os,
    stride_oh,
    stride_od,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    """Grid ``(S, H_q)``: combines the split partials into the output (0 if no keys)."""
    s = tl.program_id(0).to(tl.int64)
    hq = tl.program_id(1).to(tl.int64)
    offs_p = tl.arange(0, SPLITS_PAD)
    mask_p = offs_p < NUM_SPLITS
    offs_d = tl.arange(0, D_PAD)
    mask_d = offs_d < HEAD_DIM
    ml_off = s * stride_ms + hq * stride_mh + offs_p * stride_mp
    m = tl.load(m_ptr + ml_off, mask=mask_p, other=float("-inf"))
    l_part = tl.load(l_ptr + ml_off, mask=mask_p, other=0.0)
    m_max = tl.max(m, axis=0)
    m_ref = tl.where(m_max > float("-inf"), m_max, 0.0)
    live = m > float("-inf")
    w = tl.where(live, tl.exp(tl.where(live, m, m_ref) - m_ref), 0.0)
    total = tl.sum(w * l_part, axis=0)
    a_ptrs = acc_ptr + s * stride_as + hq * stride_ah + offs_p[:, None] * stride_ap
    acc = tl.load(
        a_ptrs + offs_d[None, :] * stride_ad, mask=mask_p[:, None] & mask_d[None, :], other=0.0
    )
    num = tl.sum(acc * w[:, None], axis=0)
    out = tl.where(total > 0, num / tl.where(total > 0, total, 1.0), 0.0)
    o_ptrs = out_ptr + s * stride_os + hq * stride_oh + offs_d * stride_od
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_d)
