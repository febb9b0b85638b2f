"""Plain-torch reference implementations of the block selection ops.

These are the specification of every Triton kernel in
:mod:`ucm.sparse.kernels.selection.jit`: the kernel tests compare against them, and the
dispatcher in :mod:`ucm.sparse.kernels.selection` falls back to them when Triton is missing
or cannot run on the tensors' device. They favour clarity over speed.

Shape conventions (used throughout :mod:`ucm.sparse`):

* ``S`` sequences in a batch; ``H_q`` query heads, ``H_kv`` kv heads,
  ``G = H_q // H_kv`` query heads per kv head (GQA group); ``D`` head dim.
* Paged KV cache of one layer: ``k_cache`` / ``v_cache`` with *logical* shape
  ``[num_blocks, B, H_kv, D]`` (``B`` = tokens per block). Any strided view is
  accepted, so a cache stored as ``[num_blocks, H_kv, B, D]`` or the vLLM CPU
  layout (see :func:`ucm.sparse.kernels.views.cpu_kv_cache_views`) is passed as a
  permuted/strided view without copying.
* ``block_table`` ``[S, max_blocks]`` int32: physical block ids of each
  sequence in attention order; entries past the sequence's blocks are ignored.
* ``seq_lens`` ``[S]`` int32: keys visible to the (single, last) query of each
  sequence. Every block but the last one of a sequence is full; the last one
  holds ``seq_len - (nblocks - 1) * B`` tokens (a partial last block).
* Representatives live in a *pool* ``[P, ...]`` addressed per sequence through
  ``rep_table`` ``[S, n_max]`` int32 and ``num_reps`` ``[S]`` int32.
* Sign-random-projection (SRP) codes: ``nbits`` sign bits packed into
  ``W = nbits // 32`` int32 words, bit ``j`` of a code is bit ``j % 32`` of
  word ``j // 32`` (bit set <=> projection > 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ucm.sparse.kernels.dispatch import softmax_scale
from ucm.sparse.kernels.triton_utils import cdiv

#: Hamming score of a forced (always kept) block: below any real distance.
FORCED_SCORE = -1
#: Hamming score of a block past the end of a sequence: never selected.
INVALID_SCORE = 2**31 - 1


def group_mean_query(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Averages the query heads of each GQA group: ``[..., H_q, D] -> [..., H_kv, D]`` (fp32).

    With fewer query heads than kv heads (``H_kv % H_q == 0``) the query heads
    are repeated instead, as the original ESA does.
    """
    h_q = q.shape[-2]
    qf = q.float()
    if h_q >= num_kv_heads:
        if h_q % num_kv_heads:
            raise ValueError(f"{h_q} query heads are not a multiple of {num_kv_heads} kv heads")
        g = h_q // num_kv_heads
        return qf.reshape(*q.shape[:-2], num_kv_heads, g, q.shape[-1]).mean(dim=-2)
    if num_kv_heads % h_q:
        raise ValueError(f"{num_kv_heads} kv heads are not a multiple of {h_q} query heads")
    return qf.repeat_interleave(num_kv_heads // h_q, dim=-2)


@dataclass(frozen=True)
class KeyBlocks:
    """Paged key blocks that :func:`block_representatives` summarises.

    Attributes:
        k_cache: ``[num_blocks, B, H_kv, D]`` (any strides, any float dtype).
        block_ids: ``[n]`` physical block ids to summarise.
        num_tokens: ``[n]`` valid tokens of each block, ``1..B`` (partial last
            block: fewer than ``B``).
        tokens_per_rep: ``c``, tokens averaged into one representative; the
            block yields ``M = ceil(B / c)`` sub-block representatives.
            ``None`` means ``c = B`` (ESA: one representative per block).
        channels: ``[n, H_kv, D']`` or ``[H_kv, D']`` int channel indices kept
            per kv head (KVStar's pruned channels); ``None`` keeps all ``D``.
    """

    k_cache: torch.Tensor
    block_ids: torch.Tensor
    num_tokens: torch.Tensor
    tokens_per_rep: int | None = None
    channels: torch.Tensor | None = None

    def reps(self) -> tuple[int, int]:
        """``(c, M)``: tokens per representative and representatives per
        block; ``ValueError`` unless ``1 <= c <= B``."""
        b = self.k_cache.shape[1]
        c = b if self.tokens_per_rep is None else int(self.tokens_per_rep)
        if not 1 <= c <= b:
            raise ValueError(f"tokens_per_rep must be in [1, {b}], got {c}")
        return c, cdiv(b, c)

    def block_channels(self) -> torch.Tensor | None:
        """``channels`` as ``[n, H_kv, D']`` (a shared ``[H_kv, D']`` expanded)."""
        ch = self.channels
        if ch is not None and ch.dim() == 2:
            ch = ch.unsqueeze(0).expand(self.block_ids.numel(), -1, -1)
        return ch


def block_representatives(blocks: KeyBlocks) -> torch.Tensor:
    """Mean-key representatives of paged blocks: ``[n, M, H_kv, D']``
    float32. A sub-block without valid tokens is 0."""
    _, b, h, _ = blocks.k_cache.shape
    c, m = blocks.reps()
    n = int(blocks.block_ids.numel())
    k = blocks.k_cache[blocks.block_ids.long()].float()  # [n, B, H, D]
    ch = blocks.block_channels()
    if ch is not None:
        # gather [n, B, H, D'] from [n, B, H, D]
        k = torch.gather(k, 3, ch.long().unsqueeze(1).expand(n, b, h, ch.shape[-1]))
    tok = torch.arange(b, device=k.device)
    valid = tok.unsqueeze(0) < blocks.num_tokens.to(k.device).long().unsqueeze(1)  # [n, B]
    k = k * valid[:, :, None, None]
    pad = m * c - b
    if pad:
        k = torch.cat([k, k.new_zeros(n, pad, h, k.shape[-1])], dim=1)
        valid = torch.cat([valid, valid.new_zeros(n, pad)], dim=1)
    sums = k.reshape(n, m, c, h, k.shape[-1]).sum(dim=2)
    counts = valid.reshape(n, m, c).sum(dim=2).float()
    return sums / counts.clamp(min=1.0)[:, :, None, None]


@dataclass(frozen=True)
class Candidates:
    """Each sequence's candidate blocks, as representatives in a pool.

    Attributes:
        rep_pool: ``[P, H_kv, D]`` (ESA) or ``[P, M, H_kv, D']`` (KVStar)
            float representatives.
        rep_table: ``[S, n_max]`` int pool slot of each candidate block.
        num_reps: ``[S]`` int candidates of each sequence (``<= n_max``).
    """

    rep_pool: torch.Tensor
    rep_table: torch.Tensor
    num_reps: torch.Tensor

    def mask_padding(self, scores: torch.Tensor) -> torch.Tensor:
        """``scores`` ``[S, n_max]`` with the entries ``>= num_reps`` set to ``-inf``."""
        idx = torch.arange(scores.shape[1], device=scores.device)
        pad = idx.unsqueeze(0) >= self.num_reps.to(scores.device).long().unsqueeze(1)
        return scores.masked_fill(pad, float("-inf"))


def block_scores_dot(q: torch.Tensor, cands: Candidates) -> torch.Tensor:
    """ESA block scores: ``<group-mean query, representative>`` over all kv heads.

    ``q`` ``[S, H_q, D]``: one decode query per sequence. Returns ``[S, n_max]``
    float32; entries ``>= num_reps`` are ``-inf``.
    """
    qm = group_mean_query(q, cands.rep_pool.shape[1])  # [S, H_kv, D]
    reps = cands.rep_pool[cands.rep_table.long().clamp(min=0)].float()  # [S, n_max, H_kv, D]
    return cands.mask_padding(torch.einsum("shd,snhd->sn", qm, reps))


def kvstar_vote_scores(
    q: torch.Tensor, cands: Candidates, channels: torch.Tensor, scale: float
) -> torch.Tensor:
    """KVStar multi-query softmax voting.

    For each query ``x`` and query head ``H`` (kv head ``h = H // G``) the
    logits ``scale * <q[x, H, channels[h]], rep>`` over all ``n * M``
    sub-block representatives of the sequence go through one softmax; a
    block's vote is the softmax mass of its ``M`` representatives, summed
    over all queries and heads.

    Args:
        q: ``[S, X, H_q, D]`` the last ``X`` queries of each sequence.
        cands: the candidates, ``rep_pool`` ``[P, M, H_kv, D']`` sub-block
            representatives.
        channels: ``[S, H_kv, D']`` int channel indices of each sequence.
        scale: logit scale (the attention's ``1/sqrt(D)``).

    Returns:
        ``[S, n_max]`` float32 votes in ``[0, X * H_q]``; padding is ``-inf``.
    """
    s, x, h_q, _d = q.shape
    _, m, h_kv, dp = cands.rep_pool.shape
    n_max = cands.rep_table.shape[1]
    g = h_q // h_kv
    out = torch.full((s, n_max), float("-inf"), dtype=torch.float32, device=q.device)
    for i in range(s):
        n = int(cands.num_reps[i])
        if n == 0:
            continue
        reps = cands.rep_pool[cands.rep_table[i, :n].long()].float()  # [n, M, H_kv, D']
        ch = channels[i].long()  # [H_kv, D']
        ch_q = ch.repeat_interleave(g, dim=0)  # [H_q, D']
        qi = torch.gather(q[i].float(), 2, ch_q.unsqueeze(0).expand(x, h_q, dp))  # [X, H_q, D']
        reps_q = reps.repeat_interleave(g, dim=2)  # [n, M, H_q, D']
        logits = torch.einsum("xhd,nmhd->xhnm", qi, reps_q) * scale
        p = torch.softmax(logits.reshape(x, h_q, n * m), dim=-1).reshape(x, h_q, n, m)
        out[i, :n] = p.sum(dim=(0, 1, 3))
    return out


def srp_projection(
    head_dim: int,
    nbits: int,
    seed: int = 0,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """A Haar-random projection ``[D, nbits]`` float32 for sign-random-projection codes.

    Columns come in orthonormal groups of ``D`` (QR of a Gaussian matrix with
    the sign fix that makes the rotation Haar-distributed); ``nbits > D`` stacks
    independent rotations. This is what the original GSAOnDevice deploys
    (untrained HATA weights).
    """
    if nbits % 32:
        raise ValueError(f"nbits must be a multiple of 32, got {nbits}")
    gen = torch.Generator().manual_seed(seed)
    cols = []
    remaining = nbits
    while remaining > 0:
        a = torch.randn(head_dim, head_dim, generator=gen, dtype=torch.float64)
        qm, r = torch.linalg.qr(a)
        qm = qm * torch.sign(torch.diagonal(r)).unsqueeze(0)
        take = min(remaining, head_dim)
        cols.append(qm[:, :take])
        remaining -= take
    return torch.cat(cols, dim=1).float().to(device)


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """``[..., nbits]`` bool -> ``[..., nbits // 32]`` int32 words."""
    *lead, nbits = bits.shape
    w = bits.reshape(*lead, nbits // 32, 32).long()
    shifts = torch.arange(32, device=bits.device, dtype=torch.long)
    words = (w << shifts).sum(dim=-1)
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


def srp_encode(x: torch.Tensor, proj: torch.Tensor) -> torch.Tensor:
    """Sign-random-projection codes: ``[..., D] -> [..., nbits // 32]`` int32."""
    return _pack_bits((x.float() @ proj.float()) > 0)


def srp_encode_to_cache(
    k: torch.Tensor,
    proj: torch.Tensor,
    code_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes the codes of new keys into a paged code cache, as KV is cached.

    Args:
        k: ``[T, H_kv, D]`` the keys being written this step.
        proj: ``[D, nbits]``.
        code_cache: ``[num_blocks, B, H_kv, W]`` int32, updated in place.
        slot_mapping: ``[T]`` int flat slot ``block * B + offset``; ``-1`` skips
            the token (vLLM's padding convention).
    """
    b = code_cache.shape[1]
    codes = srp_encode(k, proj)  # [T, H, W]
    slots = slot_mapping.long()
    keep = slots >= 0
    slots = slots[keep]
    code_cache[slots // b, slots % b] = codes[keep]


def _popcount32(x: torch.Tensor) -> torch.Tensor:
    """Set bits of each int32, as int32 (SWAR, on int64 to avoid sign issues)."""
    v = x.long() & 0xFFFFFFFF
    v = v - ((v >> 1) & 0x55555555)
    v = (v & 0x33333333) + ((v >> 2) & 0x33333333)
    v = (v + (v >> 4)) & 0x0F0F0F0F
    v = ((v * 0x01010101) & 0xFFFFFFFF) >> 24
    return v.to(torch.int32)


@dataclass(frozen=True)
class HammingBatch:
    """A decode batch that :func:`block_scores_hamming` scores (GSA).

    Attributes:
        q_codes: ``[S, H_kv, W]`` int32 codes of the group-mean query.
        k_code_cache: ``[num_blocks, B, H_kv, W]`` int32 paged key codes.
        block_table: ``[S, max_blocks]`` int.
        seq_lens: ``[S]`` int.
        sink_blocks, recent_blocks: the first and last blocks of each
            sequence, always kept.
    """

    q_codes: torch.Tensor
    k_code_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    sink_blocks: int = 1
    recent_blocks: int = 4


def block_scores_hamming(batch: HammingBatch) -> torch.Tensor:
    """GSA (HATA) block scores: min Hamming distance over a block's tokens.

    ``dist(t) = min over kv heads h of popcount(q_codes[h] ^ k_code[t, h])``;
    a block scores the min over its valid tokens (lower = more relevant).
    The first ``sink_blocks`` and last ``recent_blocks`` blocks of a sequence
    score :data:`FORCED_SCORE`; blocks past its end score :data:`INVALID_SCORE`.
    Returns ``[S, max_blocks]`` int32.
    """
    q_codes = batch.q_codes
    s, max_blocks = batch.block_table.shape
    b = batch.k_code_cache.shape[1]
    out = torch.full((s, max_blocks), INVALID_SCORE, dtype=torch.int32, device=q_codes.device)
    for i in range(s):
        sl = int(batch.seq_lens[i])
        nb = -(-sl // b)
        if nb == 0:
            continue
        codes = batch.k_code_cache[batch.block_table[i, :nb].long()]  # [nb, B, H, W]
        x = codes ^ q_codes[i].unsqueeze(0).unsqueeze(0)
        dist = _popcount32(x).sum(dim=-1).amin(dim=-1).long()  # [nb, B]
        tok = torch.arange(nb * b, device=dist.device).reshape(nb, b)
        dist = dist.masked_fill(tok >= sl, INVALID_SCORE)
        score = dist.amin(dim=1).to(torch.int32)
        blk = torch.arange(nb, device=score.device)
        forced = (blk < batch.sink_blocks) | (blk >= nb - batch.recent_blocks)
        score = score.masked_fill(forced, FORCED_SCORE)
        out[i, :nb] = score
    return out


def dense_attention_weights(
    q: torch.Tensor, k: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Softmax attention weights of one query over contiguous keys.

    ``q`` ``[H_q, D]``, ``k`` ``[L, H_kv, D]`` -> ``[H_q, L]`` float32 (used by
    benchmarks and tests to find the true top-attention blocks).
    """
    h_q, d = q.shape
    g = h_q // k.shape[1]
    scale = softmax_scale(d, scale)
    kk = k.float().repeat_interleave(g, dim=1)
    return torch.softmax(torch.einsum("hd,lhd->hl", q.float(), kk) * scale, dim=-1)
