"""Blend config, chunk segmentation, position-independent chunk ids and the request plan."""

from __future__ import annotations

import pytest

from ucm.hashing import block_ids
from ucm.shared.config import ConfigError
from ucm.sparse import SparseModelInfo, UcmSparseFactory, UcmSparseRole
from ucm.sparse.blend import BUILD_PARAM, CHUNKS_PARAM, Blend, BlendConfig, chunks
from ucm.sparse.blend.chunks import BlendMode, ChunkSpan
from ucm.sparse.factory import build_method_config

B = 4
END = 0
META = b"test-model:1:torch.float32:0"


def info(layers: int = 4) -> SparseModelInfo:
    return SparseModelInfo(
        block_size=B, num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=32
    )


def chunk(n_blocks: int, base: int) -> list[int]:
    """A padded chunk: ``n_blocks * B`` tokens, the last one the end token."""
    toks = [base + i for i in range(n_blocks * B)]
    toks[-1] = END
    return toks


class SetStore:
    """Presence-only store."""

    def __init__(self, ids: list[bytes] | None = None) -> None:
        self.ids = set(ids or [])

    def lookup(self, ids):
        return [i in self.ids for i in ids]

    def lookup_on_prefix(self, ids):
        hits = self.lookup(ids)
        return hits.index(False) - 1 if False in hits else len(hits) - 1


# --------------------------------------------------------------------------- config


def test_config_defaults_and_registration() -> None:
    cfg = BlendConfig()
    assert cfg.blend_recompute_ratio == 0.15
    assert cfg.blend_check_layers == [1]
    assert cfg.chunk_end_token_id is None and cfg.min_blend_hit_blocks == 16
    for name in ("Blend", "CacheBlend"):
        m = UcmSparseFactory.create_sparse_method(
            name, info(), UcmSparseRole.WORKER, {"blend_recompute_ratio": 0.3}
        )
        assert isinstance(m, Blend) and m.config.blend_recompute_ratio == 0.3


@pytest.mark.parametrize(
    ("values", "key"),
    [
        ({"blend_recompute_ratio": 1.5}, "ucm_sparse_config.Blend.blend_recompute_ratio"),
        ({"blend_recompute_ratio": "x"}, "blend_recompute_ratio"),
        ({"blend_check_layers": []}, "ucm_sparse_config.Blend.blend_check_layers"),
        ({"blend_check_layers": [2, 1]}, "ucm_sparse_config.Blend.blend_check_layers"),
        ({"blend_check_layers": [-1]}, "blend_check_layers[0]"),
        ({"chunk_end_token_id": -3}, "ucm_sparse_config.Blend.chunk_end_token_id"),
        ({"min_blend_hit_blocks": 0}, "ucm_sparse_config.Blend.min_blend_hit_blocks"),
        ({"blend_ratio": 0.2}, "blend_ratio"),
    ],
)
def test_config_errors_name_the_key(values: dict, key: str) -> None:
    with pytest.raises(ConfigError) as e:
        build_method_config("Blend", values)
    assert key in str(e.value)


def test_config_check_layer_past_model_and_shares() -> None:
    with pytest.raises(ConfigError, match=r"ucm_sparse_config\.Blend\.blend_check_layers\[1\]"):
        Blend(info(layers=4), UcmSparseRole.WORKER, BlendConfig(blend_check_layers=[1, 4]))
    shares = BlendConfig(blend_recompute_ratio=0.16, blend_check_layers=[1, 3]).check_layer_ratios()
    assert shares[1] == pytest.approx(0.4) and shares[3] == pytest.approx(0.16)
    assert BlendConfig(blend_recompute_ratio=0.0).check_layer_ratios() == {1: 0.0}


# --------------------------------------------------------------------------- segmentation


def test_segment_by_end_token_only_at_block_ends() -> None:
    toks = chunk(2, 10) + chunk(1, 50) + [7, END, 8, 9] + [60, 61]  # END mid-block: ignored
    spans = chunks.segment_by_end_token(toks, B, END)
    assert spans == [ChunkSpan(0, 8), ChunkSpan(8, 12)]
    assert chunks.segment_by_end_token([1, 2, 3], B, END) == []  # no full block


def test_explicit_spans_win_and_are_validated() -> None:
    toks = chunk(2, 10) + chunk(1, 50) + [1, 2, 3]
    cfg = BlendConfig(chunk_end_token_id=END)
    assert chunks.find_chunks(toks, B, cfg, {CHUNKS_PARAM: [[0, 4], [4, 12]]}) == [
        ChunkSpan(0, 4),
        ChunkSpan(4, 12),
    ]
    assert chunks.find_chunks(toks, B, cfg) == [ChunkSpan(0, 8), ChunkSpan(8, 12)]
    assert chunks.find_chunks(toks, B, BlendConfig()) == []
    key = "kv_transfer_params.ucm_blend_chunks"
    for bad, where in [
        ("0-4", key),
        ([[0, 4, 5]], f"{key}[0]"),
        ([[4, 8], [0, 4]], f"{key}[1]"),  # unsorted
        ([[0, 6], [4, 8]], f"{key}[1]"),  # overlapping
        ([[0, 99]], f"{key}[0]"),  # past the prompt
        ([[3, 3]], f"{key}[0]"),  # empty
        ([["a", 2]], f"{key}[0]"),
    ]:
        with pytest.raises(ConfigError) as e:
            chunks.parse_chunk_spans(bad, len(toks))
        assert where in str(e.value)


def test_build_request_detection() -> None:
    cfg = BlendConfig(chunk_end_token_id=END)
    assert chunks.is_build_request(chunk(2, 10), B, cfg)
    assert not chunks.is_build_request([*chunk(2, 10), 5], B, cfg)  # not a whole number of blocks
    assert not chunks.is_build_request(chunk(2, 10), B, BlendConfig())  # no end token configured
    assert chunks.is_build_request([1, 2, 3], B, BlendConfig(), {BUILD_PARAM: True})
    assert not chunks.is_build_request(chunk(2, 10), B, cfg, {BUILD_PARAM: False})


# --------------------------------------------------------------------------- ids


@pytest.mark.parametrize("algo", ["blake3", "md5_ucm"])
def test_chunk_ids_are_position_independent(algo: str) -> None:
    a, b = chunk(2, 10), chunk(3, 100)
    p1 = a + b + [1, 2]
    p2 = b + [7] * B + a + [3]
    c1 = chunks.chunk_block_ids(p1, [ChunkSpan(0, 8), ChunkSpan(8, 20)], B, META, algo)
    c2 = chunks.chunk_block_ids(p2, [ChunkSpan(0, 12), ChunkSpan(16, 24)], B, META, algo)
    assert c1[0].ids == c2[1].ids == block_ids(a, B, META, algo, None)
    assert c1[1].ids == c2[0].ids == block_ids(b, B, META, algo, None)
    assert (c1[1].first_block, c2[1].first_block) == (2, 4)
    # a non-first chunk's ids differ from the prompt's chained prefix ids
    assert c1[1].ids != block_ids(p1, B, META, algo)[2:5]


def test_unaligned_chunk_is_not_loadable() -> None:
    toks = list(range(1, 20))
    (c,) = chunks.chunk_block_ids(toks, [ChunkSpan(2, 14)], B, META)
    assert c.first_block is None and len(c.ids) == 3


# --------------------------------------------------------------------------- plan


def _store_with_chunks(*chunk_tokens: list[int]) -> SetStore:
    ids: list[bytes] = []
    for c in chunk_tokens:
        ids += block_ids(c, B, META)
    return SetStore(ids)


def test_plan_blend_loads_chunks_with_deltas() -> None:
    a, b, c = chunk(2, 10), chunk(2, 100), chunk(2, 200)
    store = _store_with_chunks(b, c)  # a (the first chunk) is not cached
    prompt = a + b + c + [1, 2, 3, 4, 5]
    cfg = BlendConfig(chunk_end_token_id=END, min_blend_hit_blocks=2)
    plan = chunks.plan_request(prompt, B, META, store, cfg)
    assert plan.mode is BlendMode.BLEND and plan.prefix_hit_blocks == 0
    assert plan.chunk_hit_blocks == 4 and plan.chunk_blocks_total == 6
    assert [
        (ld.block_index, ld.chunk_index, ld.cached_start, ld.new_start, ld.delta)
        for ld in plan.loads
    ] == [(2, 1, 0, 8, 8), (3, 1, 4, 12, 8), (4, 2, 0, 16, 16), (5, 2, 4, 20, 16)]
    reused, forced = plan.reused_mask(), plan.forced_mask()
    assert reused[8:24].all() and not reused[:8].any() and not reused[24:].any()
    assert forced[:8].all() and forced[24:].all() and not forced[8:24].any()
    assert plan.dump_block_indices == []
    assert plan.summary()["reused_tokens"] == 16


def test_plan_prefix_hit_then_chunks_and_device_hits() -> None:
    a, b = chunk(2, 10), chunk(3, 100)
    prompt = a + b + [1, 2, 3]
    store = _store_with_chunks(a, b)  # a is also the exact prefix
    cfg = BlendConfig(chunk_end_token_id=END, min_blend_hit_blocks=1)
    plan = chunks.plan_request(prompt, B, META, store, cfg)
    assert plan.mode is BlendMode.BLEND and plan.prefix_hit_blocks == 2
    assert [ld.chunk_index for ld in plan.loads] == [-1, -1, 1, 1, 1]
    assert plan.prefix_tokens == 8 and not plan.forced_mask()[:8].any()
    # vLLM's own prefix cache holds block 0: not loaded again
    plan = chunks.plan_request(prompt, B, META, store, cfg, num_computed_tokens=4)
    assert plan.device_hit_blocks == 1 and plan.prefix_hit_blocks == 2
    assert [ld.block_index for ld in plan.loads] == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="multiple"):
        chunks.plan_request(prompt, B, META, store, cfg, num_computed_tokens=3)


def test_plan_missed_chunk_blocks_are_forced() -> None:
    a, b = chunk(2, 10), chunk(3, 100)
    ids_b = block_ids(b, B, META)
    store = SetStore([ids_b[0], ids_b[2]])  # middle block evicted
    prompt = a + b + [9]
    plan = chunks.plan_request(
        prompt, B, META, store, BlendConfig(chunk_end_token_id=END, min_blend_hit_blocks=2)
    )
    assert plan.mode is BlendMode.BLEND
    assert [ld.block_index for ld in plan.loads] == [2, 4]
    assert plan.forced_mask()[12:16].all() and plan.reused_mask()[16:20].all()


def test_plan_fallback_below_threshold_and_build() -> None:
    a, b = chunk(2, 10), chunk(2, 100)
    store = _store_with_chunks(b)
    prompt = a + b + [1]
    cfg = BlendConfig(chunk_end_token_id=END, min_blend_hit_blocks=3)
    plan = chunks.plan_request(prompt, B, META, store, cfg)
    assert plan.mode is BlendMode.PREFIX and plan.loads == [] and plan.chunk_hit_blocks == 2
    assert plan.dump_block_indices == [0, 1, 2, 3] and plan.forced_mask().all()
    build = chunks.plan_request(a, B, META, store, cfg)
    assert build.mode is BlendMode.BUILD_CHUNK_CACHE and build.dump_block_indices == [0, 1]
    assert build.prefix_ids == block_ids(a, B, META)


def test_plan_explicit_spans() -> None:
    a, b = chunk(2, 10), chunk(2, 100)
    sys_prompt = [1, 2, 3, 4]
    prompt = sys_prompt + a + b + [5, 6]
    store = _store_with_chunks(a, b)
    params = {CHUNKS_PARAM: [[4, 12], [12, 20]]}
    plan = chunks.plan_request(prompt, B, META, store, BlendConfig(min_blend_hit_blocks=4), params)
    assert plan.mode is BlendMode.BLEND
    assert [(ld.block_index, ld.delta) for ld in plan.loads] == [(1, 4), (2, 4), (3, 12), (4, 12)]
    assert plan.forced_mask()[:4].all() and plan.forced_mask()[20:].all()
