"""Triton kernels of attention over paged KV (the ``@triton.jit`` layer).

Launchers: :mod:`ucm.sparse.kernels.attention.launchers`; specification:
:mod:`ucm.sparse.kernels.attention.reference`.

One kernel, :func:`paged_attention_kernel`, serves prefill (any query
lengths) and decode (one query per sequence, optionally split over its keys
flash-decoding style and combined by :func:`paged_decode_reduce_kernel`).
Per key tile it decides from the tile's relative-position range which
scores it needs: a tile entirely inside the window computes only
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
def paged_attention_kernel(
    q_ptr,
    qw_ptr,
    k_ptr,
    k2_ptr,
    v_ptr,
    out_ptr,
    part_ptr,
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
    stride_pt,
    stride_ph,
    stride_pp,
    stride_pd,
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
    NUM_SPLITS: tl.constexpr,
    ONE_QUERY: tl.constexpr,
    REROPE: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Grid ``(S, cdiv(max_q_len, BLOCK_Q) * NUM_SPLITS, H_kv)``: ``BLOCK_Q``
    query tokens x ``G`` heads, over one split of their keys.

    The ``BLOCK_M >= BLOCK_Q * G`` rows of a program are the ``G`` query
    heads of kv head ``h`` for ``BLOCK_Q`` consecutive query tokens of
    sequence ``s`` (row ``m``: token ``m // G``, head ``h * G + m % G``), so
    every K/V tile is loaded once for the whole GQA group. ``ONE_QUERY``: one
    query per sequence (decode; token ``s``, no ``query_start_loc``). Keys
    ``0 .. max(q_pos)`` of the sequence are visited in tiles of ``BLOCK_N``
    tokens; a tile inside one block (``BLOCK_N`` divides ``BLOCK_SIZE``)
    reads its block id once, any other tile per token. A key is visible to
    a row iff ``j <= q_pos``. Online softmax in fp32; a row that sees no key
    gets 0.

    ``NUM_SPLITS > 1`` (flash-decoding): split ``p`` covers a contiguous
    range of the tiles and writes its rows' partials ``[T, H_q, NUM_SPLITS,
    HEAD_DIM + 2]``: the unnormalised ``acc``, then the running max ``m``
    and the normaliser ``l``; :func:`paged_decode_reduce_kernel` combines
    them into the output.
    """
    s = tl.program_id(0).to(tl.int64)
    qt = tl.program_id(1) // NUM_SPLITS
    sp = tl.program_id(1) % NUM_SPLITS
    h = tl.program_id(2).to(tl.int64)
    if ONE_QUERY:
        q_start = s
        q_len = 1
    else:
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
    # This split's share of the keys 0 .. kv_end, in whole tiles.
    kv_end = tl.minimum(seq_len, pos_max + 1)
    per = (kv_end + BLOCK_N * NUM_SPLITS - 1) // (BLOCK_N * NUM_SPLITS) * BLOCK_N
    lo = sp * per
    hi = tl.minimum(kv_end, lo + per)
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        j = start + offs_n
        mask_n = j < hi
        if BLOCK_SIZE % BLOCK_N == 0:  # the tile lies in one block
            blk = tl.load(table_ptr + s * stride_ts + (start // BLOCK_SIZE) * stride_tn).to(
                tl.int64
            )
            off = (start % BLOCK_SIZE + offs_n).to(tl.int64)
            blk_n = blk
            blk_t = blk
        else:
            blk = tl.load(
                table_ptr + s * stride_ts + (j // BLOCK_SIZE).to(tl.int64) * stride_tn,
                mask=mask_n,
                other=0,
            ).to(tl.int64)
            off = (j % BLOCK_SIZE).to(tl.int64)
            blk_n = blk[None, :]
            blk_t = blk[:, None]
        kmask = mask_d[:, None] & mask_n[None, :]
        # K tiles are [D, N], the V tile [N, D].
        k_ptrs = _cache_ptrs(k_ptr, blk_n, off[None, :], h, offs_d[:, None],
                             stride_kb, stride_kt, stride_kh, stride_kd)  # fmt: skip
        k2_ptrs = _cache_ptrs(k2_ptr, blk_n, off[None, :], h, offs_d[:, None],
                              stride_k2b, stride_k2t, stride_k2h, stride_k2d)  # fmt: skip
        rel = pos[:, None] - j[None, :]
        min_rel = pos_min - (start + BLOCK_N - 1)
        max_rel = pos_max - start
        sc = _scores(
            q, qw, k_ptrs, k2_ptrs, kmask, rel, window, min_rel, max_rel, REROPE, IEEE, UPCAST
        )
        visible = (rel >= 0) & mask_n[None, :] & mask_m[:, None]
        sc = tl.where(visible, sc * scale, float("-inf"))
        v_ptrs = _cache_ptrs(v_ptr, blk_t, off[:, None], h, offs_d[None, :],
                             stride_vb, stride_vt, stride_vh, stride_vd)  # fmt: skip
        vmask = mask_n[:, None] & mask_d[None, :]
        m_i, l_i, acc = _softmax_step(sc, v_ptrs, vmask, m_i, l_i, acc, IEEE, UPCAST)
    if NUM_SPLITS == 1:
        out = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
        o_ptrs = out_ptr + row[:, None] * stride_ot + head[:, None] * stride_oh
        tl.store(o_ptrs + offs_d[None, :] * stride_od, out.to(out_ptr.dtype.element_ty), mask=qmask)
    else:
        p_ptrs = part_ptr + row * stride_pt + head * stride_ph + sp * stride_pp
        tl.store(p_ptrs[:, None] + offs_d[None, :] * stride_pd, acc, mask=qmask)
        tl.store(p_ptrs + HEAD_DIM * stride_pd, m_i, mask=mask_m)
        tl.store(p_ptrs + (HEAD_DIM + 1) * stride_pd, l_i, mask=mask_m)


@triton.jit
def paged_decode_reduce_kernel(
    part_ptr,
    out_ptr,
    stride_pt,
    stride_ph,
    stride_pp,
    stride_pd,
    stride_ot,
    stride_oh,
    stride_od,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    NUM_SPLITS_PAD: tl.constexpr,
):
    """Grid ``(T, H_q)``: combines the split partials (``acc | m | l``, see
    :func:`paged_attention_kernel`) into the output (0 if no keys)."""
    t = tl.program_id(0).to(tl.int64)
    hq = tl.program_id(1).to(tl.int64)
    offs_p = tl.arange(0, NUM_SPLITS_PAD)
    mask_p = offs_p < NUM_SPLITS
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask_d = offs_d < HEAD_DIM
    p_ptrs = part_ptr + t * stride_pt + hq * stride_ph + offs_p * stride_pp
    m = tl.load(p_ptrs + HEAD_DIM * stride_pd, mask=mask_p, other=float("-inf"))
    l_part = tl.load(p_ptrs + (HEAD_DIM + 1) * stride_pd, mask=mask_p, other=0.0)
    m_max = tl.max(m, axis=0)
    m_ref = tl.where(m_max > float("-inf"), m_max, 0.0)
    live = m > float("-inf")
    w = tl.where(live, tl.exp(tl.where(live, m, m_ref) - m_ref), 0.0)
    total = tl.sum(w * l_part, axis=0)
    acc = tl.load(
        p_ptrs[:, None] + offs_d[None, :] * stride_pd,
        mask=mask_p[:, None] & mask_d[None, :],
        other=0.0,
    )
    num = tl.sum(acc * w[:, None], axis=0)
    out = tl.where(total > 0, num / tl.where(total > 0, total, 1.0), 0.0)
    o_ptrs = out_ptr + t * stride_ot + hq * stride_oh + offs_d * stride_od
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_d)
