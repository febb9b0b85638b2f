"""Plain-torch references of ReRoPE attention (the specification of the kernels).

ReRoPE (Jianlin Su, "Transformer Upgrade Road 12", 2023): a query at position
``i`` sees a key at position ``j <= i`` with the *exact* relative position
``i - j`` when ``i - j < W`` and with the relative position ``W`` otherwise,
so no relative position beyond the trained window is ever used. With RoPE a
score depends only on the relative rotation, ``(R_i q) . (R_j k) = (R_{i-j} q) . k``,
which gives the two-score form the kernels compute::

    S1[i, j] = (R_i q_i) . (R_j k_j)          # ordinary RoPE score
    S2[i, j] = (R_W q_i) . k_j                # clamped: q rotated to W, key un-rotated
    S[i, j]  = S1 if i - j < W else S2

so each kernel needs, per token, the rotated query ``q`` and ``q_w = R_W q``,
and, per key, the rotated key ``k`` and the un-rotated key ``k2``. With
log-n scaling the query is first multiplied by
``max(1, log(i + 1) / log(training_length))`` (``i`` 0-based).

Tensors (``T`` query tokens, ``S`` sequences, GQA ``G = H_q / H_kv``):

* ``q``, ``q_w`` ``[T, H_q, D]``; ``k``, ``k2``, ``v`` ``[T, H_kv, D]``;
* paged caches ``k_cache``, ``k2_cache``, ``v_cache``: logical
  ``[num_blocks, B, H_kv, D]`` views, any strides (the vLLM CPU layout is a
  strided view, :func:`ucm.sparse.layout.cpu_kv_cache_views`);
* ``block_table`` ``[S, max_blocks]``, ``seq_lens`` ``[S]`` (keys of each
  sequence, the new tokens included), ``query_start_loc`` ``[S + 1]``;
* ``q_positions`` ``[T]``: the position of each query token. A token attends
  to the keys at positions ``0..q_positions[t]`` of its sequence (causal by
  position, so a non-contiguous subset of a prompt's tokens, e.g. Blend's
  recomputed tokens, attends correctly). Default: the last ``q_len``
  positions, ``seq_len - q_len + i``.
"""

from __future__ import annotations

import math

import torch

from ucm.sparse.rerope.rope import apply_rope, cos_sin_at, rotate


def log_n_scale(positions: torch.Tensor, training_length: int | None) -> torch.Tensor:
    """``max(1, log(pos + 1) / log(training_length))`` per position (fp32); 1 if disabled."""
    p = positions.to(torch.float64)
    if training_length is None:
        return torch.ones_like(p, dtype=torch.float32)
    return torch.clamp(torch.log(p + 1.0) / math.log(training_length), min=1.0).float()


def rerope_prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    window: int,
    training_length: int | None = None,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, q_w, k, k2)`` from un-rotated ``q`` ``[T, H_q, D]`` and ``k`` ``[T, H_kv, D]``.

    ``q`` is log-n scaled (``training_length`` None: not scaled) and rotated
    to its position, ``q_w`` is the scaled query rotated to ``window``, ``k``
    is rotated to its position and ``k2`` is the un-rotated key (a copy).
    """
    scale = log_n_scale(positions, training_length).to(q.dtype).view(-1, 1, 1)
    qs = q * scale
    q_rot = apply_rope(qs, positions, cos_sin_cache, is_neox)
    q_w = apply_rope(qs, torch.full_like(positions, window), cos_sin_cache, is_neox)
    k_rot = apply_rope(k, positions, cos_sin_cache, is_neox)
    return q_rot, q_w, k_rot, k.clone()


def rerope_attention_dense(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    window: int | None,
    training_length: int | None = None,
    scale: float | None = None,
    is_neox: bool = True,
    start_pos: int = 0,
) -> torch.Tensor:
    """ReRoPE causal attention of one sequence, straight from the definition.

    Uses the relative form ``score[i, j] = (R_{min(i - j, W)} q'_i) . k_j``
    with ``q'`` the log-n scaled query: a different computation from the
    two-score form of the kernels, which makes it an independent check.
    ``window`` None is plain RoPE attention (no clamp). Queries and keys are
    un-rotated ``[L, H, D]`` tensors at positions ``start_pos..start_pos+L-1``.
    Returns ``[L, H_q, D]`` in ``q``'s dtype; fp32 arithmetic. Memory is
    ``O(L^2 * H_q * D)``: for tests.
    """
    n, h_q, d = q.shape
    h_kv = k.shape[1]
    g = h_q // h_kv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    pos = torch.arange(start_pos, start_pos + n)
    qf = q.float() * log_n_scale(pos, training_length).view(-1, 1, 1)
    kf = k.float().repeat_interleave(g, dim=1)
    vf = v.float().repeat_interleave(g, dim=1)
    rel = pos[:, None] - pos[None, :]
    clamped = rel.clamp(min=0)
    if window is not None:
        clamped = clamped.clamp(max=window)
    cos, sin = cos_sin_at(cos_sin_cache.float(), clamped.reshape(-1))
    # q_i rotated by every clamped distance: [L*L, H, D] -> [L, L, H, D]
    q_rel = rotate(qf.repeat_interleave(n, dim=0), cos, sin, is_neox).view(n, n, h_q, d)
    scores = torch.einsum("ijhd,jhd->hij", q_rel, kf) * scale
    scores = scores.masked_fill((rel < 0).unsqueeze(0), float("-inf"))
    p = torch.softmax(scores, dim=-1)
    return torch.einsum("hij,jhd->ihd", p, vf).to(q.dtype)


def default_q_positions(seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
    """``[T]`` positions of the last ``q_len`` tokens of each sequence."""
    qsl = query_start_loc.to(torch.long).cpu()
    sl = seq_lens.to(torch.long).cpu()
    out = []
    for s in range(sl.numel()):
        ql = int(qsl[s + 1] - qsl[s])
        out.append(torch.arange(int(sl[s]) - ql, int(sl[s])))
    if not out:
        return torch.zeros(0, dtype=torch.int32)
    return torch.cat(out).to(torch.int32)


def _gather(cache: torch.Tensor, table_row: torch.Tensor, n: int) -> torch.Tensor:
    b = cache.shape[1]
    nb = -(-n // b)
    blocks = cache[table_row[:nb].to(torch.long)]  # [nb, B, H, D]
    return blocks.reshape(nb * b, *cache.shape[2:])[:n]


def paged_attention(
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
    q_chunk: int = 512,
) -> torch.Tensor:
    """Causal-by-position attention over paged KV, optionally ReRoPE.

    Without ``window`` it is ordinary attention (``S1`` everywhere); with
    ``window``, ``q_w`` and ``k2_cache`` each score is ``S1`` if
    ``q_pos - j < window`` else ``S2`` (see the module doc). Rows with no
    visible key give 0. Returns ``[T, H_q, D]`` in ``q``'s dtype (fp32
    arithmetic); queries are processed ``q_chunk`` at a time to bound memory.
    """
    t, h_q, d = q.shape
    h_kv = k_cache.shape[2]
    g = h_q // h_kv
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    rerope = window is not None
    if rerope and (q_w is None or k2_cache is None):
        raise ValueError("ReRoPE needs q_w and k2_cache")
    if q_positions is None:
        q_positions = default_q_positions(seq_lens, query_start_loc)
    if out is None:
        out = torch.zeros(t, h_q, d, dtype=q.dtype, device=q.device)
    qsl = query_start_loc.to(torch.long).cpu()
    sl = seq_lens.to(torch.long).cpu()
    pos_all = q_positions.to(device=q.device, dtype=torch.long)
    for s in range(sl.numel()):
        a, b_ = int(qsl[s]), int(qsl[s + 1])
        n = int(sl[s])
        if a == b_:
            continue
        if n == 0:
            out[a:b_] = 0
            continue
        row = block_table[s]
        kf = _gather(k_cache, row, n).float()
        vf = _gather(v_cache, row, n).float()
        k2f = _gather(k2_cache, row, n).float() if rerope else None
        j = torch.arange(n, device=q.device)
        for c0 in range(a, b_, q_chunk):
            c1 = min(b_, c0 + q_chunk)
            pos = pos_all[c0:c1]
            qc = q[c0:c1].float().view(c1 - c0, h_kv, g, d)
            sc = torch.einsum("thgd,jhd->hgtj", qc, kf)
            if rerope:
                qw = q_w[c0:c1].float().view(c1 - c0, h_kv, g, d)
                s2 = torch.einsum("thgd,jhd->hgtj", qw, k2f)
                inside = (pos[:, None] - j[None, :]) < window
                sc = torch.where(inside, sc, s2)
            sc = sc * scale
            visible = j[None, :] <= pos[:, None]
            sc = sc.masked_fill(~visible, float("-inf"))
            mx = sc.amax(dim=-1, keepdim=True)
            mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
            p = torch.exp(sc - mx)
            denom = p.sum(dim=-1, keepdim=True)
            o = torch.einsum("hgtj,jhd->thgd", p / torch.where(denom > 0, denom, 1.0), vf)
            out[c0:c1] = o.reshape(c1 - c0, h_q, d).to(out.dtype)
    return out


def write_kv(cache: torch.Tensor, x: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``cache[slot // B, slot % B] = x[t]`` for every token with ``slot >= 0``."""
    b = cache.shape[1]
    s = slot_mapping.to(device=x.device, dtype=torch.long)
    valid = s >= 0
    sv = s[valid]
    cache[sv // b, sv % b] = x[valid].to(cache.dtype)
