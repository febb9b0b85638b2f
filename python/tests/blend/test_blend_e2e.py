"""Blend end to end on the torch reference stack (vLLM's CPU KV layout, random weights).

Chunk caches are built by serving each chunk alone; a RAG prompt of those
chunks is then blended. ``blend_recompute_ratio: 1.0`` must equal a full
prefill exactly; the default ratio must load the chunks, compute fewer rows
and stay close to the full prefill.
"""

from __future__ import annotations

import random

import pytest
import torch
from support import refmodel as rm

from ucm.sparse import SparseModelInfo, UcmSparseRole
from ucm.sparse.blend import CHUNKS_PARAM, Blend, BlendConfig, BlendMode
from ucm.sparse.kernels.triton_utils import HAS_TRITON

B = 16
END = 3


def kl(p: torch.Tensor, q: torch.Tensor) -> float:
    lp, lq = p.log_softmax(-1), q.log_softmax(-1)
    return float((lp.exp() * (lp - lq)).sum())


class Setup:
    def __init__(
        self, layers: int = 4, hidden: int = 128, n_chunks: int = 4, blocks: int = 4, seed: int = 0
    ) -> None:
        self.spec = rm.TinyLlamaSpec(
            layers=layers, hidden=hidden, heads=4, kv_heads=2, intermediate=2 * hidden, seed=seed
        )
        self.model = rm.TinyLlama(self.spec)
        rng = random.Random(seed)
        self.chunks = []
        for _ in range(n_chunks):
            c = [rng.randrange(4, self.spec.vocab) for _ in range(blocks * B)]
            c[-1] = END
            self.chunks.append(c)
        self.question = [rng.randrange(4, self.spec.vocab) for _ in range(11)]
        self.store = rm.DictStore()

    def blend(self, ratio: float, impl: str = "torch", **kw) -> tuple[Blend, rm.PagedKV]:
        info = SparseModelInfo(
            block_size=B,
            num_layers=self.spec.layers,
            num_heads=4,
            num_kv_heads=2,
            head_dim=self.spec.head_dim,
        )
        cfg = BlendConfig(
            blend_recompute_ratio=ratio,
            chunk_end_token_id=END,
            min_blend_hit_blocks=kw.pop("min_hits", 4),
            **kw,
        )
        blend = Blend(info, UcmSparseRole.WORKER, cfg)
        blend.impl = impl
        cache = rm.PagedKV(self.spec, 96, B)
        blend.initialize_kv_cache_tensors(cache.kv)
        blend.set_rotary(self.model.cos_sin_cache, self.spec.is_neox)
        return blend, cache

    def build(self, which: list[int]) -> None:
        blend, cache = self.blend(0.15)
        for i in which:
            r = rm.serve_prefill(self.model, cache, self.store, self.chunks[i], blend=blend)
            assert r.plan is not None and r.plan.mode is BlendMode.BUILD_CHUNK_CACHE
            cache.free(r.seq.blocks)

    def prompt(self, order: list[int]) -> list[int]:
        return [t for i in order for t in self.chunks[i]] + self.question

    def full(self, prompt: list[int], impl: str = "torch") -> tuple[rm.PrefillResult, rm.PagedKV]:
        cache = rm.PagedKV(self.spec, 96, B)
        return rm.full_prefill(self.model, cache, prompt, impl=impl), cache


@pytest.fixture(scope="module")
def setup() -> Setup:
    s = Setup()
    s.build([0, 1, 2, 3])
    return s


@pytest.mark.parametrize("order", [[2, 0, 3, 1], [0, 1, 2, 3]])
def test_ratio_one_equals_full_recompute(setup: Setup, order: list[int]) -> None:
    """[0, ...]: the first chunk is also an exact prefix hit; [2, ...]: chunk 2 at 0."""
    prompt = setup.prompt(order)
    ref, ref_cache = setup.full(prompt)
    blend, cache = setup.blend(1.0)
    loads0 = setup.store.loads
    res = rm.serve_prefill(setup.model, cache, setup.store, prompt, blend=blend)
    assert res.plan.mode is BlendMode.BLEND
    assert setup.store.loads - loads0 == 16  # every chunk block came from the store
    assert torch.equal(res.logits, ref.logits)
    cont = rm.decode(setup.model, cache, res.seq, res.logits, 6)
    assert cont == rm.decode(setup.model, ref_cache, ref.seq, ref.logits, 6)


def test_default_ratio_loads_chunks_and_deviates_little(setup: Setup) -> None:
    prompt = setup.prompt([2, 0, 3, 1])
    ref, _ = setup.full(prompt)
    results = {}
    for ratio, delta in [(0.15, True), (0.5, True), (0.0, True), (0.0, False)]:
        blend, cache = setup.blend(ratio)
        res = rm.serve_prefill(
            setup.model, cache, setup.store, prompt, blend=blend, delta_rope=delta
        )
        results[(ratio, delta)] = (kl(ref.logits, res.logits), res)
    k15, res = results[(0.15, True)]
    # chunk 2 sits at 0, an exact prefix hit; the other 3 chunks x 64 tokens are
    # reused; the 11 question tokens are always computed
    assert res.plan.prefix_tokens == 64 and res.plan.num_reused_tokens == 192
    assert res.selected == {1: 11 + int(0.15 * 192)}
    assert res.computed_rows == len(prompt) - 64  # before the check layer: every query row
    assert k15 < 0.15
    # more recompute -> closer; moving the keys matters (naive reuse is worst)
    assert results[(0.5, True)][0] < k15 < results[(0.0, True)][0] < results[(0.0, False)][0]


def test_explicit_chunk_spans(setup: Setup) -> None:
    sys_prompt = [5] * B  # one block of system prompt, not a chunk
    prompt = sys_prompt + setup.prompt([1, 3])
    spans = [[B, B + 64], [B + 64, B + 128]]
    blend, cache = setup.blend(1.0)
    res = rm.serve_prefill(
        setup.model,
        cache,
        setup.store,
        prompt,
        blend=blend,
        config=BlendConfig(blend_recompute_ratio=1.0, min_blend_hit_blocks=4),
        kv_transfer_params={CHUNKS_PARAM: spans},
    )
    assert res.plan.mode is BlendMode.BLEND and res.plan.chunk_hit_blocks == 8
    assert {ld.delta for ld in res.plan.chunk_loads} == {B, B + 64}
    assert torch.equal(res.logits, setup.full(prompt)[0].logits)


def test_fallback_to_prefix_reuse(setup: Setup) -> None:
    prompt = setup.prompt([3, 2])
    blend, cache = setup.blend(0.15, min_hits=9)  # 8 chunk blocks < 9
    dumps0 = setup.store.dumps
    res = rm.serve_prefill(setup.model, cache, setup.store, prompt, blend=blend)
    assert res.plan.mode is BlendMode.PREFIX
    assert res.plan.prefix_hit_blocks == 4  # chunk 3 is at 0: an exact prefix
    assert res.selected == {}  # no step bound: nothing shrinks
    assert setup.store.dumps - dumps0 == len(prompt) // B - 4
    torch.testing.assert_close(res.logits, setup.full(prompt)[0].logits, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_path_matches_torch_path() -> None:
    """Every op through the kernels (interpreter): delta-RoPE, deviation, both attentions."""
    s = Setup(layers=3, hidden=64, n_chunks=2, blocks=2, seed=1)
    s.build([0, 1])
    prompt = s.prompt([1, 0])
    ref, _ = s.full(prompt)
    for ratio in (1.0, 0.25):
        out = {}
        for impl in ("torch", "triton"):
            blend, cache = s.blend(ratio, impl=impl, min_hits=2)
            out[impl] = rm.serve_prefill(s.model, cache, s.store, prompt, blend=blend, impl=impl)
        assert out["triton"].selected == out["torch"].selected
        torch.testing.assert_close(out["triton"].logits, out["torch"].logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out["torch"].logits, out["torch"].logits)
    assert kl(ref.logits, out["triton"].logits) < 0.2
