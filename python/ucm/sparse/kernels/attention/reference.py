"""Plain-torch references of attention over paged KV (the specification of
:mod:`ucm.sparse.kernels.attention.jit`).

Tensors (``T`` query tokens, ``S`` sequences, GQA ``G = H_q / H_kv``):

* ``q``, ``q_w`` ``[T, H_q, D]``;
* paged caches ``k_cache``, ``k2_cache``, ``v_cache``: logical
  ``[num_blocks, B, H_kv, D]`` views, any strides (the vLLM CPU layout is a
  strided view, :func:`ucm.sparse.kernels.views.cpu_kv_cache_views`);
* ``block_table`` ``[S, max_blocks]``, ``seq_lens`` ``[S]`` (keys of each
  sequence, the new tokens included), ``query_start_loc`` ``[S + 1]``;
* ``q_positions`` ``[T]``: the position of each query token. A token attends
  to the keys at positions ``0..q_positions[t]`` of its sequence (causal by
  position, so a non-contiguous subset of a prompt's tokens, e.g. Blend's
  recomputed tokens, attends correctly). Default: the last ``q_len``
  positions, ``seq_len - q_len + i``.

With ReRoPE (``window`` set) a score is ``S1 = q . k`` when the query and the
key are less than ``window`` positions apart and ``S2 = q_w . k2`` otherwise
(see :mod:`ucm.sparse.rerope.reference` for the definition).
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass

import torch

from ucm.sparse.kernels.dispatch import softmax_scale


@dataclass(frozen=True)
class AttentionBatch:
    """The operands of one attention call over paged KV (shapes in the module doc).

    ``query_start_loc`` None: one query per sequence (decode). ``q_positions``
    None: each sequence's last ``q_len`` positions. ``window`` set: ReRoPE,
    which reads ``q_w`` and ``k2_cache`` too. ``out``: the ``[T, H_q, D]``
    tensor to write (default: a new one). ``scale`` None: ``1/sqrt(D)``.
    The public ops build one; the references and the launchers take it.
    """

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor | None = None
    q_positions: torch.Tensor | None = None
    scale: float | None = None
    _: KW_ONLY
    q_w: torch.Tensor | None = None
    k2_cache: torch.Tensor | None = None
    window: int | None = None
    out: torch.Tensor | None = None

    @property
    def rerope(self) -> bool:
        """Whether the scores are ReRoPE's two (``window`` is set)."""
        return self.window is not None

    def starts(self) -> torch.Tensor:
        """``query_start_loc``, or ``0 .. S`` (one query per sequence)."""
        if self.query_start_loc is not None:
            return self.query_start_loc
        return torch.arange(self.seq_lens.numel() + 1, device=self.seq_lens.device)

    def positions(self) -> torch.Tensor:
        """``q_positions``, or the default (:func:`default_q_positions`)."""
        if self.q_positions is not None:
            return self.q_positions
        return default_q_positions(self.seq_lens, self.starts())


def paged_decode_attention(batch: AttentionBatch) -> torch.Tensor:
    """Decode attention of one query per sequence over its paged blocks.

    Reads ``q`` ``[S, H_q, D]`` (the query at each sequence's last position),
    the caches, ``block_table`` (only the first ``ceil(seq_len / B)``
    entries of a row), ``seq_lens`` (0 gives a zero output) and ``scale``:
    plain attention, no ReRoPE nor explicit positions.

    Returns:
        ``[S, H_q, D]`` in ``q.dtype`` (computed in fp32).
    """
    if batch.rerope or batch.q_positions is not None:
        raise ValueError("the decode reference is plain attention at the last positions")
    q, k_cache, v_cache = batch.q, batch.k_cache, batch.v_cache
    s, h_q, d = q.shape
    b, h_kv = k_cache.shape[1], k_cache.shape[2]
    g = h_q // h_kv
    scale = softmax_scale(d, batch.scale)
    out = torch.zeros(s, h_q, d, dtype=torch.float32, device=q.device)
    for i in range(s):
        sl = int(batch.seq_lens[i])
        if sl == 0:
            continue
        nb = -(-sl // b)
        blocks = batch.block_table[i, :nb].long()
        k = k_cache[blocks].float().reshape(nb * b, h_kv, d)[:sl]
        v = v_cache[blocks].float().reshape(nb * b, h_kv, d)[:sl]
        k = k.repeat_interleave(g, dim=1)  # [L, H_q, D]
        v = v.repeat_interleave(g, dim=1)
        logits = torch.einsum("hd,lhd->hl", q[i].float(), k) * scale
        p = torch.softmax(logits, dim=-1)
        out[i] = torch.einsum("hl,lhd->hd", p, v)
    return out.to(q.dtype)


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


def paged_attention(batch: AttentionBatch, q_chunk: int = 512) -> torch.Tensor:
    """Causal-by-position attention over paged KV, optionally ReRoPE.

    Without ``window`` it is ordinary attention (``S1`` everywhere); with
    ``window``, ``q_w`` and ``k2_cache`` each score is ``S1`` if
    ``q_pos - j < window`` else ``S2`` (see the module doc). Rows with no
    visible key give 0. Returns ``[T, H_q, D]`` in ``q``'s dtype (fp32
    arithmetic); queries are processed ``q_chunk`` at a time to bound memory.
    """
    q, q_w, window = batch.q, batch.q_w, batch.window
    t, h_q, d = q.shape
    h_kv = batch.k_cache.shape[2]
    g = h_q // h_kv
    scale = softmax_scale(d, batch.scale)
    rerope = batch.rerope
    if rerope and (q_w is None or batch.k2_cache is None):
        raise ValueError("ReRoPE needs q_w and k2_cache")
    out = batch.out
    if out is None:
        out = torch.zeros(t, h_q, d, dtype=q.dtype, device=q.device)
    qsl = batch.starts().to(torch.long).cpu()
    sl = batch.seq_lens.to(torch.long).cpu()
    pos_all = batch.positions().to(device=q.device, dtype=torch.long)
    for s in range(sl.numel()):
        a, b_ = int(qsl[s]), int(qsl[s + 1])
        n = int(sl[s])
        if a == b_:
            continue
        if n == 0:
            out[a:b_] = 0
            continue
        row = batch.block_table[s]
        kf = _gather(batch.k_cache, row, n).float()
        vf = _gather(batch.v_cache, row, n).float()
        k2f = _gather(batch.k2_cache, row, n).float() if rerope else None
        for c0 in range(a, b_, q_chunk):
            c1 = min(b_, c0 + q_chunk)
            pos = pos_all[c0:c1]
            qc = _heads_first(q[c0:c1], h_kv, g)
            qw = _heads_first(q_w[c0:c1], h_kv, g) if rerope else None
            o = _chunk_attention(qc, qw, pos, kf, k2f, vf, window, scale)
            out[c0:c1] = (
                o.view(h_kv, g, c1 - c0, d)
                .permute(2, 0, 1, 3)
                .reshape(c1 - c0, h_q, d)
                .to(out.dtype)
            )
    return out


def _heads_first(x: torch.Tensor, h_kv: int, g: int) -> torch.Tensor:
    """``[t, H_q, D]`` as fp32 ``[H_kv, g * t, D]`` (a query group's rows
    together, for one batched product per KV head)."""
    t, _, d = x.shape
    return x.float().view(t, h_kv, g, d).permute(1, 2, 0, 3).reshape(h_kv, g * t, d)


def _chunk_attention(
    qc: torch.Tensor,
    qw: torch.Tensor | None,
    pos: torch.Tensor,
    kf: torch.Tensor,
    k2f: torch.Tensor | None,
    vf: torch.Tensor,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """One chunk of queries (``[H_kv, g * t, D]``, positions ``pos``) over
    the keys ``[n, H_kv, D]``. Only keys some query of the chunk can see are
    scored (``j <= max(pos)``). With ReRoPE, the keys at least ``window``
    before every query (``j <= min(pos) - window``, the "far" keys) take
    only ``S2`` and need no mask; only the band after them computes both
    scores and picks per element. The two parts share one softmax."""
    t = pos.numel()
    g = qc.shape[1] // t
    hi = min(int(pos.max()) + 1, kf.shape[0])
    lo = 0 if window is None else max(0, min(int(pos.min()) - window + 1, hi))
    qpos = pos.repeat(g)[:, None]  # row r of a head is query r % t
    j = torch.arange(lo, hi, device=qc.device)[None, :]
    band = torch.bmm(qc * scale, kf[lo:hi].permute(1, 2, 0))  # S1
    far_fused = window is not None and lo > 0 and _fused_cpu_attention_available(qc)
    far = None
    if window is not None:
        assert qw is not None and k2f is not None
        qw = qw * scale
        s2 = torch.bmm(qw, k2f[lo:hi].permute(1, 2, 0))
        band = torch.where(qpos - j < window, band, s2)
        if lo and not far_fused:
            far = torch.bmm(qw, k2f[:lo].permute(1, 2, 0))
    band.masked_fill_(j > qpos, float("-inf"))
    mx = band.amax(dim=-1, keepdim=True)
    if far is not None:
        mx = torch.maximum(mx, far.amax(dim=-1, keepdim=True))
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
    band.sub_(mx).exp_()
    denom = band.sum(dim=-1, keepdim=True)
    out = torch.bmm(band, vf[lo:hi].permute(1, 0, 2))
    if far is not None:
        far.sub_(mx).exp_()
        denom += far.sum(dim=-1, keepdim=True)
        out.baddbmm_(far, vf[:lo].permute(1, 0, 2))
    out = out / torch.where(denom > 0, denom, 1.0)
    if not far_fused:
        return out
    # The far keys take S2 alone and need no mask: one fused attention (no
    # score matrix in memory, which is what bounds this path on a CPU), its
    # log-sum-exp merged with the band's.
    assert qw is not None and k2f is not None
    far_out, far_lse = _fused_cpu_attention(qw, k2f[:lo], vf[:lo], 1.0)  # qw is scaled
    band_lse = mx + torch.log(denom)
    top = torch.maximum(band_lse, far_lse)
    w_band, w_far = torch.exp(band_lse - top), torch.exp(far_lse - top)
    return (out * w_band + far_out * w_far) / (w_band + w_far)


def _fused_cpu_attention_available(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and hasattr(
        torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"
    )


def _fused_cpu_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unmasked attention of ``q`` ``[H_kv, R, D]`` (a group's rows stacked)
    over ``k``, ``v`` ``[L, H_kv, D]``: ``([H_kv, R, D], log-sum-exp [H_kv, R, 1])``.
    It is torch's CPU flash kernel, called by its aten name because it
    returns the log-sum-exp a merge needs (``scaled_dot_product_attention``
    does not); where torch lacks it, the far keys are scored like the band."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.unsqueeze(0).contiguous(),
        k.permute(1, 0, 2).unsqueeze(0).contiguous(),
        v.permute(1, 0, 2).unsqueeze(0).contiguous(),
        0.0,
        False,
        scale=scale,
    )
    return out[0], lse[0].unsqueeze(-1)


def write_kv(cache: torch.Tensor, x: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``cache[slot // B, slot % B] = x[t]`` for every token with ``slot >= 0``."""
    b = cache.shape[1]
    s = slot_mapping.to(device=x.device, dtype=torch.long)
    valid = s >= 0
    sv = s[valid]
    cache[sv // b, sv % b] = x[valid].to(cache.dtype)
