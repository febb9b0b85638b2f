"""Delta-RoPE and key-deviation kernels against their torch references (TRITON_INTERPRET=1).

Layouts: the vLLM CPU paged layout (K transposed inside each (block, head)
slab, a strided view), a contiguous ``[NB, B, H, D]`` cache and a plain
``[T, H, D]`` tensor. Odd sizes: partial blocks, a non-power-of-two block
size, partial rotary dims, negative deltas.
"""

from __future__ import annotations

import pytest
import torch

from ucm.sparse.kernels import keys
from ucm.sparse.kernels.keys import launchers
from ucm.sparse.kernels.keys import reference as ref
from ucm.sparse.kernels.rope import apply_rope, rope_cos_sin_cache
from ucm.sparse.kernels.triton_utils import HAS_TRITON
from ucm.sparse.kernels.views import cpu_kv_cache_views

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


def _cpu_layout(nb: int, h: int, b: int, d: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(nb, h, b, 2 * d).to(dtype)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize(("d", "rot"), [(64, 64), (64, 32), (128, 96)])
def test_delta_rope_cpu_layout(is_neox: bool, d: int, rot: int, assert_close) -> None:
    b, h, nb = 32, 2, 7
    kv = _cpu_layout(nb, h, b, d, torch.float32)
    k, _ = cpu_kv_cache_views(kv)
    expected = k.clone()
    cs = rope_cos_sin_cache(rot, 1024)
    ids = torch.tensor([5, 0, 3])
    deltas = torch.tensor([17, -40, 900])
    ntok = torch.tensor([32, 9, 1])  # full, partial, one token
    v_before = cpu_kv_cache_views(kv)[1].clone()
    rotation = ref.BlockRotation(ids, deltas, cs, is_neox, ntok)
    launchers.delta_rope(k, rotation)
    ref.delta_rope(expected, rotation)
    assert_close(k, expected, torch.float32)
    assert torch.equal(cpu_kv_cache_views(kv)[1], v_before)  # V untouched
    assert torch.equal(k[0, 9:], expected[0, 9:])  # past num_tokens untouched
    assert torch.equal(k[:, :, :, rot:], expected[:, :, :, rot:])  # pass-through dims


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_delta_rope_half_dtypes_odd_block(dtype: torch.dtype, assert_close) -> None:
    b, h, d, nb = 24, 3, 64, 5  # block size not a power of two
    k = torch.randn(nb, b, h, d).to(dtype)
    expected = k.clone()
    cs = rope_cos_sin_cache(d, 512, dtype=dtype)
    ids = torch.tensor([1, 4, 2])
    deltas = torch.randint(-200, 200, (3, b))  # one delta per token
    rotation = ref.BlockRotation(ids, deltas, cs, True)
    launchers.delta_rope(k, rotation)
    ref.delta_rope(expected, rotation)
    assert k.dtype == dtype
    assert_close(k, expected, dtype)


@pytest.mark.parametrize("is_neox", [True, False])
def test_delta_rope_moves_keys_to_new_positions(is_neox: bool) -> None:
    """R(delta) R(p) k == R(p + delta) k: a chunk cached at 0 lands at its new start."""
    t, h, d = 37, 2, 64
    cs = rope_cos_sin_cache(d, 4096)
    raw = torch.randn(t, h, d)
    pos = torch.arange(t)
    for new_start in (0, 5, 1000):
        k = apply_rope(raw, pos, cs, is_neox)
        keys.delta_rope_tokens(k, torch.full((t,), new_start), cs, is_neox, impl="triton")
        torch.testing.assert_close(
            k, apply_rope(raw, pos + new_start, cs, is_neox), atol=2e-4, rtol=1e-4
        )
    # and back: a negative delta undoes it
    k = apply_rope(raw, pos + 300, cs, is_neox)
    keys.delta_rope_tokens(k, torch.full((t,), -300), cs, is_neox, impl="triton")
    torch.testing.assert_close(k, apply_rope(raw, pos, cs, is_neox), atol=2e-4, rtol=1e-4)


def test_delta_rope_tokens_plain_layout_per_token(assert_close) -> None:
    t, h, d = 45, 2, 32  # 45 = 2 full groups of 16 + a partial one
    cs = rope_cos_sin_cache(d, 256)
    k = torch.randn(t, h, d)
    deltas = torch.randint(-100, 100, (t,))
    expected = k.clone()
    launchers.delta_rope_tokens(k, deltas, cs, False)
    ref.delta_rope_tokens(expected, deltas, cs, False)
    assert_close(k, expected, torch.float32)
    # strided (non-contiguous) token view: every other token of a bigger tensor
    big = torch.randn(2 * t, h, d)
    view = big[::2]
    exp = view.clone()
    launchers.delta_rope_tokens(view, deltas, cs, True)
    ref.delta_rope_tokens(exp, deltas, cs, True)
    assert_close(big[::2], exp, torch.float32)


def test_delta_rope_validation() -> None:
    k = torch.randn(4, 8, 2, 32)
    cs = rope_cos_sin_cache(32, 64)
    with pytest.raises(ValueError, match="outside the rotary table"):
        launchers.delta_rope(k, ref.BlockRotation(torch.tensor([0]), torch.tensor([-64]), cs))
    with pytest.raises(ValueError, match="distinct"):
        launchers.delta_rope(k, ref.BlockRotation(torch.tensor([1, 1]), torch.tensor([1, 2]), cs))
    cs64 = rope_cos_sin_cache(64, 8)  # rot_dim 64 > head dim 32
    with pytest.raises(ValueError, match="rot_dim"):
        launchers.delta_rope(k, ref.BlockRotation(torch.tensor([0]), torch.tensor([1]), cs64))
    no_blocks = ref.BlockRotation(torch.zeros(0, dtype=torch.long), torch.zeros(0), cs)
    launchers.delta_rope(k, no_blocks)  # no-op


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_deviation_through_slots(dtype: torch.dtype, assert_close) -> None:
    b, h, d, nb = 32, 2, 64, 6
    kv = _cpu_layout(nb, h, b, d, dtype)
    k, _ = cpu_kv_cache_views(kv)
    t = 41
    slots = torch.randperm(nb * b)[:t]
    slots[3] = -1  # no cached key: 0
    fresh = torch.randn(t, h, d).to(dtype)
    out = launchers.kv_deviation(k, slots, fresh)
    expected = ref.kv_deviation(k, slots, fresh)
    assert out[3] == 0
    atol, rtol = (1e-4, 1e-5) if dtype == torch.float32 else (1e-2, 1e-3)
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)
    assert keys.kv_deviation(k, slots[:0], fresh[:0]).numel() == 0
