"""Every Triton kernel against its torch reference (under TRITON_INTERPRET=1).

Covers odd sizes: partial last blocks, empty sequences, GQA ratios 1/4/8,
head dims 64 and 128, a non-power-of-two block size, forced split counts
(more splits than blocks) and strided cache views.
"""

from __future__ import annotations

import math

import pytest
import torch
from support.kernel_checks import assert_close

from ucm.sparse.kernels import selection
from ucm.sparse.kernels.attention import launchers as attention_launchers
from ucm.sparse.kernels.attention import reference as attention_ref
from ucm.sparse.kernels.attention.reference import AttentionBatch
from ucm.sparse.kernels.dispatch import choose_num_splits, dot_pad, triton_usable
from ucm.sparse.kernels.selection import launchers
from ucm.sparse.kernels.selection import reference as ref
from ucm.sparse.kernels.triton_utils import HAS_TRITON
from ucm.sparse.kernels.views import cpu_kv_cache_views

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

GQA = [1, 4, 8]
HEAD_DIMS = [64, 128]
H_KV = 2


def _cache(nb: int, b: int, h: int, d: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(nb, b, h, d).to(dtype)


def _tables(s: int, max_blocks: int, nb: int) -> torch.Tensor:
    return torch.stack([torch.randperm(nb)[:max_blocks] for _ in range(s)]).to(torch.int32)


# --------------------------------------------------------------------------- attention


@pytest.mark.parametrize("g", GQA)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_paged_decode_gqa_head_dims(g: int, d: int) -> None:
    b, nb = 16, 24
    k, v = _cache(nb, b, H_KV, d), _cache(nb, b, H_KV, d)
    q = torch.randn(3, H_KV * g, d)
    table = _tables(3, 6, nb)
    seq_lens = torch.tensor([16 * 6, 37, 1], dtype=torch.int32)  # full, partial tail, one key
    batch = AttentionBatch(q, k, v, table, seq_lens)
    out = attention_launchers.paged_decode_attention(batch)
    assert_close(out, attention_ref.paged_decode_attention(batch), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_paged_decode_half_dtypes(dtype: torch.dtype) -> None:
    b, nb, d, g = 32, 12, 64, 4
    k, v = _cache(nb, b, H_KV, d, dtype), _cache(nb, b, H_KV, d, dtype)
    q = torch.randn(2, H_KV * g, d).to(dtype)
    table = _tables(2, 5, nb)
    seq_lens = torch.tensor([150, 33], dtype=torch.int32)
    batch = AttentionBatch(q, k, v, table, seq_lens)
    out = attention_launchers.paged_decode_attention(batch)
    assert out.dtype == dtype
    assert_close(out, attention_ref.paged_decode_attention(batch), dtype)


@pytest.mark.parametrize("splits", [1, 3, 8])
def test_paged_decode_splits_and_empty(splits: int) -> None:
    """More splits than blocks leaves splits empty; a zero-length sequence gives 0."""
    b, nb, d = 16, 10, 64
    k, v = _cache(nb, b, H_KV, d), _cache(nb, b, H_KV, d)
    q = torch.randn(3, H_KV * 4, d)
    table = _tables(3, 4, nb)
    seq_lens = torch.tensor([50, 0, 64], dtype=torch.int32)
    batch = AttentionBatch(q, k, v, table, seq_lens)
    out = attention_launchers.paged_decode_attention(batch, num_splits=splits)
    expected = attention_ref.paged_decode_attention(batch)
    assert_close(out, expected, torch.float32)
    assert torch.count_nonzero(out[1]) == 0


def test_paged_decode_odd_block_size_and_scale() -> None:
    b, nb, d = 24, 8, 64  # not a power of two: padded tile, masked tokens
    k, v = _cache(nb, b, H_KV, d), _cache(nb, b, H_KV, d)
    q = torch.randn(2, H_KV * 8, d)
    table = _tables(2, 5, nb)
    seq_lens = torch.tensor([24 * 4 + 7, 24], dtype=torch.int32)
    batch = AttentionBatch(q, k, v, table, seq_lens, scale=0.3)
    out = attention_launchers.paged_decode_attention(batch)
    assert_close(out, attention_ref.paged_decode_attention(batch), torch.float32)


def test_paged_decode_reads_vllm_cpu_layout_in_place() -> None:
    """The kernel reads K (stored transposed) and V straight from the CPU layout."""
    nb, h, n, c = 6, H_KV, 32, 64
    layer = torch.randn(nb, h, n, 2 * c)
    k, v = cpu_kv_cache_views(layer)
    assert k.shape == (nb, n, h, c)
    q = torch.randn(2, h * 4, c)
    table = torch.tensor([[5, 0, 3], [1, 2, 4]], dtype=torch.int32)
    seq_lens = torch.tensor([80, 64], dtype=torch.int32)
    out = attention_launchers.paged_decode_attention(AttentionBatch(q, k, v, table, seq_lens))
    kc, vc = k.contiguous(), v.contiguous()
    assert_close(
        out,
        attention_ref.paged_decode_attention(AttentionBatch(q, kc, vc, table, seq_lens)),
        torch.float32,
    )


def test_paged_decode_over_selection_matches_gathered_dense() -> None:
    """Attention over a selected block list equals dense attention over those keys."""
    b, nb, d, g = 16, 20, 128, 8
    k, v = _cache(nb, b, H_KV, d), _cache(nb, b, H_KV, d)
    q = torch.randn(1, H_KV * g, d)
    selected = torch.tensor([[0, 7, 9, 19]], dtype=torch.int32)
    seq_len = torch.tensor([3 * b + 5], dtype=torch.int32)
    out = attention_launchers.paged_decode_attention(AttentionBatch(q, k, v, selected, seq_len))
    keys = k[selected[0].long()].reshape(-1, H_KV, d)[: int(seq_len)]
    vals = v[selected[0].long()].reshape(-1, H_KV, d)[: int(seq_len)]
    w = ref.dense_attention_weights(q[0], keys)  # [H_q, L]
    dense = torch.einsum("hl,lhd->hd", w, vals.repeat_interleave(g, dim=1))
    assert_close(out[0], dense, torch.float32)


def test_choose_num_splits() -> None:
    assert choose_num_splits(64, 8, 2048) == 1
    assert choose_num_splits(1, 8, 8192) == 32
    assert choose_num_splits(1, 8, 8) == 2  # >= 4 blocks per split
    assert choose_num_splits(1, 1, 3) == 1
    for s, h, n in [(1, 8, 8192), (3, 4, 999), (2, 1, 100)]:
        x = choose_num_splits(s, h, n)
        assert x & (x - 1) == 0 and 1 <= x <= 64


def test_dot_pad() -> None:
    assert [dot_pad(n) for n in (1, 8, 16, 17, 24, 128)] == [16, 16, 16, 32, 32, 128]


# --------------------------------------------------------------------------- representatives


@pytest.mark.parametrize(
    ("b", "d", "c", "pruned"),
    [(16, 64, None, False), (32, 128, None, False), (16, 128, 2, True), (32, 64, 3, True)],
)
def test_block_representatives(b: int, d: int, c: int | None, pruned: bool) -> None:
    nb = 12
    k = _cache(nb, b, H_KV, d)
    ids = torch.tensor([4, 0, 11, 7])
    ntok = torch.tensor([b, b, 5, 1], dtype=torch.int32)  # partial blocks included
    channels = None
    if pruned:
        channels = torch.stack([torch.randperm(d)[: d // 4] for _ in range(H_KV)]).to(torch.int32)
    blocks = ref.KeyBlocks(k, ids, ntok, c, channels)
    got = launchers.block_representatives(blocks)
    want = ref.block_representatives(blocks)
    m = math.ceil(b / (c or b))
    assert got.shape == (4, m, H_KV, d // 4 if pruned else d)
    assert_close(got, want, torch.float32)


def test_block_representatives_half_and_strided() -> None:
    layer = torch.randn(5, H_KV, 16, 2 * 64).to(torch.bfloat16)
    k, _ = cpu_kv_cache_views(layer)
    ids = torch.tensor([1, 3])
    ntok = torch.tensor([16, 16])
    got = launchers.block_representatives(ref.KeyBlocks(k, ids, ntok))
    want = ref.block_representatives(ref.KeyBlocks(k.contiguous(), ids, ntok))
    assert_close(got, want, torch.float32)


# --------------------------------------------------------------------------- ESA scores


@pytest.mark.parametrize("g", GQA)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_block_scores_dot(g: int, d: int) -> None:
    pool = torch.randn(40, H_KV, d)
    q = torch.randn(3, H_KV * g, d)
    table = torch.randint(0, 40, (3, 70), dtype=torch.int32)
    num = torch.tensor([70, 13, 0], dtype=torch.int32)
    cands = ref.Candidates(pool, table, num)
    got = launchers.block_scores_dot(q, cands)
    want = ref.block_scores_dot(q, cands)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    fin = torch.isfinite(want)
    assert_close(got[fin], want[fin], torch.float32)


def test_block_scores_dot_fewer_query_heads_and_fp16() -> None:
    pool = torch.randn(10, 4, 64).half()
    q = torch.randn(2, 2, 64).half()  # 2 query heads, 4 kv heads: repeated
    table = torch.arange(10, dtype=torch.int32).repeat(2, 1)
    num = torch.tensor([10, 6])
    cands = ref.Candidates(pool, table, num)
    got = launchers.block_scores_dot(q, cands)
    want = ref.block_scores_dot(q, cands)
    fin = torch.isfinite(want)
    assert_close(got[fin], want[fin], torch.float16)


# --------------------------------------------------------------------------- KVStar votes


@pytest.mark.parametrize("g", GQA)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_kvstar_vote(g: int, d: int) -> None:
    dp, m = d // 4, 4
    pool = torch.randn(50, m, H_KV, dp)
    q = torch.randn(2, 3, H_KV * g, d)
    table = torch.randint(0, 50, (2, 37), dtype=torch.int32)
    num = torch.tensor([37, 5], dtype=torch.int32)
    ch = torch.stack([torch.randperm(d)[:dp] for _ in range(2 * H_KV)]).reshape(2, H_KV, dp)
    scale = 1 / math.sqrt(d)
    cands = ref.Candidates(pool, table, num)
    got = launchers.kvstar_vote_scores(q, cands, ch, scale)
    want = ref.kvstar_vote_scores(q, cands, ch, scale)
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(got))
    assert_close(got[fin], want[fin], torch.float32)
    # every (query, head) distributes a unit of mass
    torch.testing.assert_close(got[0, :37].sum(), torch.tensor(3.0 * H_KV * g))


# --------------------------------------------------------------------------- SRP codes


@pytest.mark.parametrize(("d", "nbits"), [(64, 64), (128, 128), (64, 256), (128, 32)])
def test_srp_encode(d: int, nbits: int) -> None:
    proj = ref.srp_projection(d, nbits, seed=3)
    x = torch.randn(7, 3, d)
    got = launchers.srp_encode(x, proj)
    want = ref.srp_encode(x, proj)
    assert got.shape == (7, 3, nbits // 32) and got.dtype == torch.int32
    diff = ref._popcount32(got ^ want).sum()
    # the kernel and torch may disagree only on projections within rounding of 0
    near_zero = ((x @ proj).abs() < 1e-5).sum()
    assert int(diff) <= int(near_zero)


def test_srp_projection_is_orthonormal_per_group() -> None:
    p = ref.srp_projection(64, 128, seed=1)
    assert p.shape == (64, 128)
    for j in (0, 64):
        blk = p[:, j : j + 64].double()
        torch.testing.assert_close(blk.T @ blk, torch.eye(64, dtype=torch.float64), atol=1e-5,
                                   rtol=0)  # fmt: skip
    assert torch.equal(p, ref.srp_projection(64, 128, seed=1))
    assert not torch.equal(p, ref.srp_projection(64, 128, seed=2))


def test_srp_encode_to_cache_skips_padding() -> None:
    d, nb, b = 64, 6, 16
    proj = ref.srp_projection(d, 64)
    k = torch.randn(5, H_KV, d)
    slots = torch.tensor([0, 17, -1, 40, nb * b - 1])
    got = torch.zeros(nb, b, H_KV, 2, dtype=torch.int32)
    want = got.clone()
    launchers.srp_encode_to_cache(k, proj, got, slots)
    ref.srp_encode_to_cache(k, proj, want, slots)
    assert torch.equal(got, want)
    assert torch.count_nonzero(got[0, 2]) == 0  # slot 2 was never written


# --------------------------------------------------------------------------- Hamming scores


@pytest.mark.parametrize(("h", "w", "b"), [(1, 2, 16), (2, 4, 32), (8, 2, 16), (4, 1, 24)])
def test_block_scores_hamming(h: int, w: int, b: int) -> None:
    nb = 30
    codes = torch.randint(-(2**31), 2**31 - 1, (nb, b, h, w), dtype=torch.int32)
    q = torch.randint(-(2**31), 2**31 - 1, (4, h, w), dtype=torch.int32)
    table = _tables(4, 20, nb)
    seq_lens = torch.tensor([20 * b, 7 * b + 3, 2 * b, 0], dtype=torch.int32)
    batch = ref.HammingBatch(q, codes, table, seq_lens, sink_blocks=1, recent_blocks=4)
    got = launchers.block_scores_hamming(batch)
    want = ref.block_scores_hamming(batch)
    assert torch.equal(got, want)
    assert got[0, 0] == selection.FORCED_SCORE and (got[0, 16:] == selection.FORCED_SCORE).all()
    assert (got[0, 1:16] >= 0).all()
    assert (got[2, :2] == selection.FORCED_SCORE).all()  # short: everything forced
    assert (got[3] == selection.INVALID_SCORE).all()  # empty sequence


def test_hamming_identical_code_scores_zero() -> None:
    nb, b, h = 8, 16, 2
    codes = torch.randint(-(2**31), 2**31 - 1, (nb, b, h, 2), dtype=torch.int32)
    q = codes[5, 3].clone().unsqueeze(0)  # the query equals one key's codes
    table = torch.arange(nb, dtype=torch.int32).unsqueeze(0)
    seq_lens = torch.tensor([nb * b])
    batch = ref.HammingBatch(q, codes, table, seq_lens, sink_blocks=0, recent_blocks=0)
    got = launchers.block_scores_hamming(batch)
    assert got[0, 5] == 0
    assert torch.equal(got, ref.block_scores_hamming(batch))


# --------------------------------------------------------------------------- dispatcher


def test_dispatch_impls_agree_and_validate() -> None:
    k = _cache(6, 16, H_KV, 64)
    ids, nt = torch.tensor([1, 2]), torch.tensor([16, 9])
    a = selection.block_representatives(k, ids, nt, impl="triton")
    b = selection.block_representatives(k, ids, nt, impl="torch")
    c = selection.block_representatives(k, ids, nt)
    assert_close(a, b, torch.float32)
    assert_close(c, b, torch.float32)
    assert triton_usable(k)
    with pytest.raises(ValueError, match="impl must be"):
        selection.block_representatives(k, ids, nt, impl="cuda")  # type: ignore[arg-type]


def test_launcher_shape_errors() -> None:
    k = _cache(4, 16, 2, 64)
    table = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple"):
        attention_launchers.paged_decode_attention(
            AttentionBatch(torch.randn(1, 3, 64), k, k, table, torch.tensor([4]))
        )
    with pytest.raises(ValueError, match="head dim"):
        attention_launchers.paged_decode_attention(
            AttentionBatch(torch.randn(1, 2, 32), k, k, table, torch.tensor([4]))
        )
    with pytest.raises(ValueError, match="power of two"):
        launchers.srp_encode(torch.randn(2, 2, 64), torch.randn(64, 48))
