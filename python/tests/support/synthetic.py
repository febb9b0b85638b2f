"""Synthetic KV and queries for tests and the quality benchmark.

A :class:`SparseCase` is one layer's KV of one sequence plus its last queries.
Two sources:

* :func:`planted_case`: random keys with a few *relevant* middle blocks
  whose keys lean towards a per-head direction the queries also point to, so
  the true top-attention blocks are known;
* :func:`random_llama_case`: q/k/v captured from a small random-weight
  Llama-style decoder (RMSNorm, GQA attention with RoPE, SwiGLU MLP) run in
  plain torch on a random token sequence -- no vLLM needed.

Any callable returning :class:`SparseCase` objects can be plugged into
``benches/sparse_quality.py`` as another source (e.g. KV captured from vLLM).

Test and benchmark tooling (the tests' ``support`` package), not product API.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ucm.sparse.base import SparseModelInfo


@dataclass
class SparseCase:
    """One sequence of one layer.

    ``k``/``v`` ``[L, H_kv, D]`` (L tokens, the last one the current decode
    token); ``queries`` ``[X, H_q, D]`` the last X decode queries, the current
    one last; ``relevant`` the planted blocks (empty when unknown).
    """

    name: str
    k: torch.Tensor
    v: torch.Tensor
    queries: torch.Tensor
    block_size: int
    relevant: list[int] = field(default_factory=list)

    @property
    def seq_len(self) -> int:
        return self.k.shape[0]

    @property
    def num_blocks(self) -> int:
        return -(-self.seq_len // self.block_size)

    def paged(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(k_cache, v_cache, block_ids)``: the sequence as blocks ``0..N-1``."""
        n, b = self.num_blocks, self.block_size
        pad = n * b - self.seq_len
        k, v = self.k, self.v
        if pad:
            k = torch.cat([k, k.new_zeros(pad, *k.shape[1:])])
            v = torch.cat([v, v.new_zeros(pad, *v.shape[1:])])
        shape = (n, b, *self.k.shape[1:])
        return k.reshape(shape), v.reshape(shape), torch.arange(n, dtype=torch.int32)


def planted_case(
    seq_len: int,
    model: SparseModelInfo,
    num_relevant: int = 12,
    num_queries: int = 8,
    planted_fraction: float = 0.25,
    boost: tuple[float, float] = (2.0, 5.0),
    query_noise: float = 0.6,
    seed: int = 0,
) -> SparseCase:
    """Random KV of ``model``'s block size, heads and head size, with
    ``num_relevant`` planted middle blocks.

    In each relevant block a ``planted_fraction`` of the tokens get
    ``boost * u_h`` added to their key (``u_h`` a unit direction per kv head,
    ``boost`` drawn per block), so a query ``sqrt(D) * (u_h + noise)`` gives
    them a logit gap of about ``boost``. Queries of one GQA group share
    ``u_h``; consecutive decode queries differ by fresh noise.
    """
    g = torch.Generator().manual_seed(seed)
    h, d, b = model.num_kv_heads, model.head_dim, model.block_size
    group = model.num_heads // h
    k = torch.randn(seq_len, h, d, generator=g)
    v = torch.randn(seq_len, h, d, generator=g)
    n = -(-seq_len // b)
    u = torch.randn(h, d, generator=g)
    u = u / u.norm(dim=-1, keepdim=True)
    lo, hi = 2, max(3, n - 3)  # middle blocks only (not the windows)
    relevant = sorted(torch.randperm(hi - lo, generator=g)[:num_relevant].add(lo).tolist())
    per_block = max(1, round(b * planted_fraction))
    for j in relevant:
        strength = boost[0] + (boost[1] - boost[0]) * torch.rand(1, generator=g).item()
        toks = j * b + torch.randperm(b, generator=g)[:per_block]
        toks = toks[toks < seq_len]
        k[toks] += strength * u
    noise = torch.randn(num_queries, h, group, d, generator=g) * query_noise / math.sqrt(d)
    q = math.sqrt(d) * (u[None, :, None, :] + noise)
    q = q.reshape(num_queries, h * group, d)
    return SparseCase(f"planted-s{seed}", k, v, q, b, relevant)


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = pos.float()[:, None] * inv[None, :]  # [L, D/2]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def _rms(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def random_llama_case(
    seq_len: int,
    model: SparseModelInfo,
    capture_layer: int = -1,
    num_queries: int = 8,
    vocab: int = 512,
    seed: int = 0,
) -> SparseCase:
    """q/k/v of one layer of a random Llama-style decoder of ``model``'s
    layers, heads and head size, on random tokens.

    The token sequence repeats random segments (as documents quote themselves),
    so some keys recur. The model runs causally over the whole sequence (fp32,
    no KV cache); the last ``num_queries`` positions' queries of layer
    ``capture_layer`` are the decode queries.
    """
    g = torch.Generator().manual_seed(seed)
    h_kv, h_q, d = model.num_kv_heads, model.num_heads, model.head_dim
    group, num_layers = h_q // h_kv, model.num_layers
    hidden = h_q * d
    inter = 2 * hidden

    def w(i: int, o: int) -> torch.Tensor:
        return torch.randn(i, o, generator=g) / math.sqrt(i)

    base = torch.randint(0, vocab, (seq_len,), generator=g)
    for _ in range(seq_len // 256):  # copy random segments forward
        ln = int(torch.randint(16, 64, (1,), generator=g))
        src = int(torch.randint(0, seq_len // 2, (1,), generator=g))
        dst = int(torch.randint(seq_len // 2, seq_len - ln, (1,), generator=g))
        base[dst : dst + ln] = base[src : src + ln]
    emb = torch.randn(vocab, hidden, generator=g)
    x = emb[base]
    pos = torch.arange(seq_len)
    mask = torch.full((seq_len, seq_len), float("-inf")).triu(1)
    layer_idx = capture_layer % num_layers
    captured = None
    for layer in range(num_layers):
        wq, wk, wv, wo = (
            w(hidden, h_q * d),
            w(hidden, h_kv * d),
            w(hidden, h_kv * d),
            w(hidden, hidden),
        )
        hn = _rms(x)
        q = _rope((hn @ wq).view(seq_len, h_q, d), pos)
        k = _rope((hn @ wk).view(seq_len, h_kv, d), pos)
        v = (hn @ wv).view(seq_len, h_kv, d)
        if layer == layer_idx:
            captured = (q[-num_queries:].clone(), k.clone(), v.clone())
            if layer == num_layers - 1:
                break
        kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        att = torch.einsum("qhd,khd->hqk", q, kk) / math.sqrt(d) + mask
        o = torch.einsum("hqk,khd->qhd", att.softmax(-1), vv).reshape(seq_len, hidden)
        x = x + o @ wo
        hn = _rms(x)
        gate, up, down = w(hidden, inter), w(hidden, inter), w(inter, hidden)
        x = x + (torch.nn.functional.silu(hn @ gate) * (hn @ up)) @ down
    assert captured is not None
    q, k, v = captured
    return SparseCase(f"random-llama-s{seed}", k, v, q, model.block_size)
