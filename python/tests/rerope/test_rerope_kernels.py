"""ReRoPE attention: definition, references and Triton kernels (TRITON_INTERPRET=1).

* every distance inside the window: ReRoPE == standard RoPE attention;
* beyond the window: prefill and decode kernels == the two-score paged
  reference == the definition (relative form, computed differently);
* GQA 1 and 4, head dims 64 and 128, partial last blocks, a non-power-of-two
  block size, chunked prefill against cached context, mixed batches, split
  counts, 16-bit dtypes, log-n scaling.
"""

from __future__ import annotations

import math

import pytest
import torch

from ucm.sparse.kernels.attention import launchers
from ucm.sparse.kernels.attention import reference as attention_ref
from ucm.sparse.kernels.attention.reference import AttentionBatch
from ucm.sparse.kernels.rope import apply_rope, rope_cos_sin_cache
from ucm.sparse.kernels.triton_utils import HAS_TRITON
from ucm.sparse.rerope import reference as ref

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
H_KV = 2


def paged(x: torch.Tensor, b: int, nb: int, table_row: torch.Tensor, cache: torch.Tensor) -> None:
    """Writes ``x`` ``[n, H, D]`` (positions 0..n-1) into ``cache`` through ``table_row``."""
    n = x.shape[0]
    p = torch.arange(n)
    cache[table_row[p // b].long(), p % b] = x.to(cache.dtype)


def sequence_case(
    n: int,
    g: int,
    d: int,
    w: int,
    b: int = 16,
    train: int | None = None,
    dtype: torch.dtype = torch.float32,
    nb: int = 24,
):
    """One sequence of ``n`` tokens: raw q/k/v, prepared tensors, paged caches."""
    cs = rope_cos_sin_cache(d, 4096)
    q, k, v = torch.randn(n, H_KV * g, d), torch.randn(n, H_KV, d), torch.randn(n, H_KV, d)
    pos = torch.arange(n)
    q_rot, q_w, k_rot, k2 = ref.rerope_prepare(q, k, pos, cs, w, train)
    table = torch.randperm(nb)[: math.ceil(n / b)].view(1, -1).to(torch.int32)
    caches = [torch.zeros(nb, b, H_KV, d, dtype=dtype) for _ in range(3)]
    for c, x in zip(caches, (k_rot, k2, v), strict=True):
        paged(x, b, nb, table[0], c)
    return dict(
        cs=cs,
        q=q,
        k=k,
        v=v,
        q_rot=q_rot.to(dtype),
        q_w=q_w.to(dtype),
        kc=caches[0],
        k2c=caches[1],
        vc=caches[2],
        table=table,
    )


def case_batch(c: dict, n: int, w: int | None, last: bool = False) -> AttentionBatch:
    """The case's ``n`` queries as one sequence (``last``: only its last query, decode)."""
    rows = slice(-1, None) if last else slice(None)
    qsl = None if last else torch.tensor([0, n])
    q, q_w = c["q_rot"][rows], c["q_w"][rows]
    return AttentionBatch(
        q,
        c["kc"],
        c["vc"],
        c["table"],
        torch.tensor([n]),
        qsl,
        q_w=q_w,
        k2_cache=c["k2c"],
        window=w,
    )


def prefill(c: dict, n: int, w: int | None) -> torch.Tensor:
    return launchers.paged_prefill_attention(case_batch(c, n, w))


def test_within_window_is_rope_attention(assert_close) -> None:
    n, g, d = 45, 4, 64
    c = sequence_case(n, g, d, w=64, train=4096)
    # the definition with every distance < W is causal attention over rotated q, k
    pos = torch.arange(n)
    qr, kr = apply_rope(c["q"], pos, c["cs"]), apply_rope(c["k"], pos, c["cs"])
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        qr.transpose(0, 1),
        kr.repeat_interleave(g, 1).transpose(0, 1),
        c["v"].repeat_interleave(g, 1).transpose(0, 1),
        is_causal=True,
    ).transpose(0, 1)
    dense = ref.rerope_attention_dense(c["q"], c["k"], c["v"], c["cs"], 64, 4096)
    torch.testing.assert_close(dense, sdpa, atol=1e-5, rtol=1e-5)
    assert torch.equal(ref.rerope_attention_dense(c["q"], c["k"], c["v"], c["cs"], None), dense)
    # the kernels never touch S2 there: equal to the plain (REROPE=False) kernel
    plain = prefill(c, n, None)
    assert_close(prefill(c, n, 64), plain, torch.float32)
    assert_close(plain, sdpa, torch.float32)
    dec = launchers.paged_decode_attention(case_batch(c, n, n, last=True))
    assert_close(dec, sdpa[-1:], torch.float32)


@pytest.mark.parametrize("g", [1, 4])
@pytest.mark.parametrize("d", [64, 128])
def test_beyond_window_prefill(g: int, d: int, assert_close) -> None:
    n, w = 83, 20  # partial last block (83 = 5 * 16 + 3)
    c = sequence_case(n, g, d, w, train=32)  # log-n scaling active past position 31
    out = prefill(c, n, w)
    expected = attention_ref.paged_attention(case_batch(c, n, w))
    assert_close(out, expected, torch.float32)
    definition = ref.rerope_attention_dense(c["q"], c["k"], c["v"], c["cs"], w, 32)
    torch.testing.assert_close(out, definition, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(out, prefill(c, n, None), atol=1e-3)  # the window matters


@pytest.mark.parametrize(("w", "splits"), [(5, 1), (40, 3), (1000, 2)])
def test_decode_kernel(w: int, splits: int, assert_close) -> None:
    g, d, b, nb = 4, 64, 16, 30
    lens = torch.tensor([71, 16, 1, 130])
    s = lens.numel()
    cs = rope_cos_sin_cache(d, 1024)
    kc, k2c, vc = (torch.randn(nb, b, H_KV, d) for _ in range(3))
    table = torch.stack([torch.randperm(nb)[:9] for _ in range(s)]).to(torch.int32)
    q, q_w = torch.randn(s, H_KV * g, d), torch.randn(s, H_KV * g, d)
    one_each = AttentionBatch(
        q, kc, vc, table, lens, torch.arange(s + 1), q_w=q_w, k2_cache=k2c, window=w
    )
    out = launchers.paged_decode_attention(one_each, num_splits=splits)
    expected = attention_ref.paged_attention(one_each)
    assert_close(out, expected, torch.float32)
    # the same queries through the prefill launch (one token per sequence)
    pre = launchers.paged_prefill_attention(one_each)
    assert_close(pre, expected, torch.float32)
    del cs


@pytest.mark.parametrize("b", [24, 64])
def test_chunked_prefill_mixed_batch_odd_block(b: int, assert_close) -> None:
    """Queries that are the tail of longer sequences (cached context), a decode row,
    an empty query, explicit non-contiguous positions; block size 24 (key tiles
    across blocks) and 64 (two key tiles per block)."""
    g, d, nb = 2, 64, 20
    kc, k2c, vc = (torch.randn(nb, b, H_KV, d) for _ in range(3))
    lens = torch.tensor([100, 7, 60, 33])
    qlens = torch.tensor([30, 7, 0, 1])
    qsl = torch.cat([torch.zeros(1, dtype=torch.long), qlens.cumsum(0)])
    t = int(qlens.sum())
    table = torch.stack([torch.randperm(nb)[:5] for _ in range(4)]).to(torch.int32)
    q, q_w = torch.randn(t, H_KV * g, d), torch.randn(t, H_KV * g, d)
    for w in (None, 9):
        batch = AttentionBatch(q, kc, vc, table, lens, qsl, q_w=q_w, k2_cache=k2c, window=w)
        out = launchers.paged_prefill_attention(batch)
        exp = attention_ref.paged_attention(batch)
        assert_close(out, exp, torch.float32)
    # Blend-style rows: a non-contiguous subset of a prompt at its true positions
    pos = torch.tensor([3, 10, 11, 40, 41, 42, 77, 99])
    qsub = torch.randn(8, H_KV * g, d)
    one = AttentionBatch(qsub, kc, vc, table[:1], lens[:1], torch.tensor([0, 8]), q_positions=pos)
    out = launchers.paged_prefill_attention(one)
    exp = attention_ref.paged_attention(one)
    assert_close(out, exp, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_dtypes(dtype: torch.dtype, assert_close) -> None:
    n, g, d, w = 50, 4, 64, 12
    c = sequence_case(n, g, d, w, b=32, train=16, dtype=dtype)
    out = prefill(c, n, w)
    assert out.dtype == dtype
    exp = attention_ref.paged_attention(case_batch(c, n, w))
    assert_close(out, exp, dtype)
    dec = launchers.paged_decode_attention(case_batch(c, n, w, last=True))
    assert_close(dec, exp[-1:], dtype)


def test_log_n_scale_and_prepare() -> None:
    s = ref.log_n_scale(torch.tensor([0, 15, 16, 255, 1023]), 16)
    assert s[:2].tolist() == [1.0, 1.0]
    torch.testing.assert_close(s[2:], torch.tensor([math.log(17) / math.log(16), 2.0, 2.5]))
    assert ref.log_n_scale(torch.tensor([5000]), None).tolist() == [1.0]
    cs = rope_cos_sin_cache(32, 128)
    q, k = torch.randn(40, 4, 32), torch.randn(40, 2, 32)
    pos = torch.arange(40)
    q_rot, q_w, k_rot, k2 = ref.rerope_prepare(q, k, pos, cs, 8, 16)
    assert torch.equal(k2, k) and k2.data_ptr() != k.data_ptr()
    scale = ref.log_n_scale(pos, 16).view(-1, 1, 1)
    torch.testing.assert_close(q_w, apply_rope(q * scale, torch.full((40,), 8), cs))
    torch.testing.assert_close(q_rot, apply_rope(q * scale, pos, cs))
    torch.testing.assert_close(k_rot, apply_rope(k, pos, cs))


def test_launcher_checks() -> None:
    kc = torch.randn(4, 16, 2, 64)
    q = torch.randn(3, 4, 64)
    args = (
        q,
        kc,
        kc,
        torch.zeros(1, 1, dtype=torch.int32),
        torch.tensor([3]),
        torch.tensor([0, 3]),
    )
    with pytest.raises(ValueError, match="q_w and k2_cache"):
        launchers.paged_prefill_attention(AttentionBatch(*args, window=4))
    with pytest.raises(ValueError, match="head dim"):
        launchers.paged_prefill_attention(AttentionBatch(torch.randn(3, 4, 32), *args[1:]))
    with pytest.raises(ValueError, match="multiple"):
        launchers.paged_prefill_attention(AttentionBatch(torch.randn(3, 3, 64), *args[1:]))
    assert launchers.prefill_tiles(1) == (64, 64) and launchers.prefill_tiles(3) == (64, 21)
    assert launchers.prefill_tiles(128) == (128, 1)
