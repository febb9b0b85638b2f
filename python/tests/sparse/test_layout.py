"""Offload block arithmetic, GSA lengths and KV-cache views."""

from __future__ import annotations

import pytest
import torch

from ucm.sparse.gsa import gsa_shortened_len, gsa_topk_blocks
from ucm.sparse.kernels.views import cpu_kv_cache_views, flash_kv_cache_views
from ucm.sparse.offload import OffloadPlan, make_offload_plan


def test_plan_matches_original_esa_budget() -> None:
    # P = 8010, B = 32: N = 251, R = 251 - 1 - 2 = 248, k = floor(0.3 * 248) = 74
    p = make_offload_plan(8010, 32, 1, 2, 0.3, 4)
    assert p is not None
    assert (p.num_prompt_blocks, p.num_middle, p.num_selected) == (251, 248, 74)
    assert (p.middle_start, p.middle_end) == (1, 249)
    assert p.local_tokens == 8010 % 32 + 32  # partial tail + one full block
    assert p.device_prompt_tokens == (1 + 74) * 32 + p.local_tokens
    assert p.compressed_len(5) == p.device_prompt_tokens + 5
    assert p.device_blocks(1) == -(-p.compressed_len(1) // 32)
    assert p.dense_blocks(1) == 251
    assert make_offload_plan(8000, 32, 1, 2, 0.3, 4).local_tokens == 64  # no partial tail
    # the footprint drops to about init + ratio * middle + local
    assert p.device_blocks(1) / p.dense_blocks(1) == pytest.approx(0.31, abs=0.01)


def test_plan_exact_multiple_and_ceil_rounding() -> None:
    p = make_offload_plan(32 * 10, 32, 1, 2, 0.25, 4, rounding="ceil")
    assert p is not None and p.num_middle == 7 and p.num_selected == 2
    assert p.local_tokens == 64
    assert make_offload_plan(32 * 10, 32, 1, 2, 0.25, 4, rounding="floor").num_selected == 1


@pytest.mark.parametrize(
    ("prompt_len", "ratio", "min_blocks"),
    [(100, 0.3, 5), (32 * 3, 0.5, 1), (32 * 20, 1.0, 4), (0, 0.3, 1), (32 * 10, 0.3, 11)],
)
def test_plan_dense_cases(prompt_len: int, ratio: float, min_blocks: int) -> None:
    """Short prompts, no middle, ratio 1.0 (keep all: exactly dense) stay dense."""
    assert make_offload_plan(prompt_len, 32, 1, 2, ratio, min_blocks) is None


def test_attention_view_drops_inactive_slots() -> None:
    p = OffloadPlan(prompt_len=16 * 10 + 5, block_size=16, n_init=1, n_local=2, num_selected=3)
    assert p.num_prompt_blocks == 11 and p.num_middle == 8
    row = list(range(100, 100 + p.device_blocks(3)))
    blocks, n = p.attention_view(row, [0, 1, 2], 3)
    assert blocks == row and n == p.compressed_len(3)
    blocks, n = p.attention_view(row, [2, 0], 3)
    assert blocks == [100, 101, 103, *row[4:]]
    assert n == p.compressed_len(3) - 16
    assert p.compressed_block_of_logical(0) == 0
    assert p.compressed_block_of_logical(5) is None
    assert p.compressed_block_of_logical(9) == p.local_start
    with pytest.raises(ValueError, match="need"):
        p.attention_view(row[:2], [0], 3)


def test_gsa_lengths() -> None:
    assert gsa_topk_blocks(1000, 16, 256, None) == 16
    assert gsa_topk_blocks(100, 16, 256, None) == 7  # fewer blocks than T: all
    assert gsa_topk_blocks(1000, 16, None, 0.1) == 7  # ceil(63 * 0.1)
    assert gsa_shortened_len(1000, 16, 16) == 1000 - (63 - 16) * 16
    assert gsa_shortened_len(100, 16, 7) == 100
    # the partial tail block stays: the length keeps 1000 % 16 tokens of it
    assert gsa_shortened_len(1000, 16, 16) % 16 == 1000 % 16


def test_cpu_kv_cache_views_match_the_documented_layout() -> None:
    nb, h, n, c = 3, 2, 32, 8
    layer = torch.arange(nb * h * n * 2 * c, dtype=torch.float32).reshape(nb, h, n, 2 * c)
    k, v = cpu_kv_cache_views(layer)
    slab = layer.view(nb, h, 2, n * c)
    for b_, h_, t in [(0, 0, 0), (2, 1, 31), (1, 0, 17)]:
        assert torch.equal(k[b_, t, h_], slab[b_, h_, 0].view(c, n)[:, t])
        assert torch.equal(v[b_, t, h_], slab[b_, h_, 1].view(n, c)[t])
    k[1, 3, 0, 2] = -1.0  # views alias the cache
    assert slab[1, 0, 0].view(c, n)[2, 3] == -1.0
    with pytest.raises(ValueError):
        cpu_kv_cache_views(torch.zeros(2, 2, 2))


def test_flash_views() -> None:
    kv = torch.randn(2, 4, 16, 2, 8)
    k, v = flash_kv_cache_views(kv)
    assert k.data_ptr() == kv[0].data_ptr() and v.shape == (4, 16, 2, 8)
    with pytest.raises(ValueError):
        flash_kv_cache_views(torch.zeros(3, 4, 16, 2, 8))
