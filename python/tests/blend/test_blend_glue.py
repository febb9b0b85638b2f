"""The connector glue of Blend and ReRoPE that needs no engine: config selection,
the block-id salt, and what a blended request's transfer carries."""

from __future__ import annotations

import importlib.util

import pytest
from support import refmodel as rm

from ucm.integration.vllm.sparse.blend import BlendReqMeta, BlendScheduler, blend_config_from
from ucm.sparse.blend import BlendConfig, BlendMode, plan_request
from ucm.sparse.config import method_kv_namespace

B = 4
END = 3


def test_config_selection() -> None:
    cfg = blend_config_from({"Blend": {"blend_recompute_ratio": 0.5, "chunk_end_token_id": 7}})
    assert isinstance(cfg, BlendConfig) and cfg.blend_recompute_ratio == 0.5
    assert blend_config_from({"CacheBlend": {}}) == BlendConfig()  # the original's alias
    assert blend_config_from({"ReRoPE": {"training_length": 512}}) is None
    assert blend_config_from(None) is None


def test_rerope_salt_separates_configs() -> None:
    a = method_kv_namespace({"ReRoPE": {"rerope_window": 128, "training_length": 512}})
    b = method_kv_namespace({"ReRoPE": {"rerope_window": 64, "training_length": 512}})
    assert a and b and a != b
    assert method_kv_namespace({"Blend": {}}) == "" and method_kv_namespace(None) == ""


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_blended_transfer_carries_chunk_loads() -> None:
    from ucm.integration.vllm.metadata import ReqTransfer

    chunks = [[10 + 16 * c + i for i in range(2 * B - 1)] + [END] for c in range(3)]
    store = rm.DictStore()
    for c in chunks:  # chunk caches: the chunk served alone
        p = plan_request(c, B, "m", store, BlendConfig(chunk_end_token_id=END))
        assert p.mode is BlendMode.BUILD_CHUNK_CACHE
        store.blocks.update({i: {} for i in p.prefix_ids})
    prompt = chunks[1] + chunks[2] + chunks[0] + [99, 98, 97]
    cfg = BlendConfig(chunk_end_token_id=END, min_blend_hit_blocks=2)
    plan = plan_request(prompt, B, "m", store, cfg)
    assert plan.mode is BlendMode.BLEND and plan.prefix_hit_blocks == 2
    vblocks = [50, 51, 52, 53, 54, 55, 56, 57]
    t = ReqTransfer("r", load_keys=plan.prefix_ids[:2], load_into=vblocks[:2])
    BlendScheduler.attach(t, plan, vblocks)
    # prefix blocks first, then the chunk blocks in their new places
    assert t.load_into == [50, 51, 52, 53, 54, 55]
    assert t.load_keys[2:] == [ld.block_id for ld in plan.chunk_loads]
    meta = t.sparse
    assert isinstance(meta, BlendReqMeta) and meta.block_ids == vblocks[:7]
    assert meta.first_slot() == 52 * B  # first token after the 2-block prefix
    # chunk 2 was cached at 0 and now starts at 2 blocks, chunk 0 at 4 blocks
    assert meta.chunk_rotations() == ([52, 53, 54, 55], [2 * B, 2 * B, 4 * B, 4 * B])


class _Req:
    """The fields of vLLM's ``Request`` the scheduler glue reads."""

    def __init__(self, req_id: str, prompt: list[int], params: dict | None = None) -> None:
        self.request_id = req_id
        self.prompt_token_ids = prompt
        self.num_tokens = len(prompt)
        self.kv_transfer_params = params


def _store_with_chunks() -> tuple[rm.DictStore, list[list[int]]]:
    chunks = [[10 + 16 * c + i for i in range(2 * B - 1)] + [END] for c in range(3)]
    store = rm.DictStore()
    for c in chunks:
        p = plan_request(c, B, "m", store, BlendConfig(chunk_end_token_id=END))
        store.blocks.update({i: {} for i in p.prefix_ids})
    return store, chunks


def test_scheduler_lookup_decisions() -> None:
    from ucm.integration.vllm.sparse.blend import STATS
    from ucm.sparse import SparseModelInfo

    store, chunks = _store_with_chunks()
    info = SparseModelInfo(block_size=B, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8)
    cfg = BlendConfig(chunk_end_token_id=END, min_blend_hit_blocks=2)
    prompt = chunks[1] + chunks[2] + chunks[0] + [99, 98, 97]
    sched = BlendScheduler(info, cfg, max_batched=64)
    plan = sched.lookup(_Req("a", prompt), 0, store, "m", "blake3")
    assert plan is not None and plan.mode is BlendMode.BLEND
    # vLLM allocated with the prefix as external tokens: pending, sent once
    assert sched.allocated("a", plan.prefix_tokens) is plan
    assert sched.take("a") is plan and sched.take("a") is None

    before = dict(STATS)
    # uncached tokens beyond the step budget: vLLM would split the prefill
    small = BlendScheduler(info, cfg, max_batched=plan.num_tokens - plan.prefix_tokens - 1)
    assert small.lookup(_Req("b", prompt), 0, store, "m", "blake3") is None
    assert STATS["fallback_budget"] == before.get("fallback_budget", 0) + 1
    # a malformed chunk list is the client's error: served without Blend
    bad = _Req("c", prompt, {"ucm_blend_chunks": [[8, 4]]})
    assert sched.lookup(bad, 0, store, "m", "blake3") is None
    assert STATS["bad_chunk_list"] == before.get("bad_chunk_list", 0) + 1
    # a resumed request (prompt + outputs) is not re-blended
    resumed = _Req("d", prompt)
    resumed.num_tokens += 3
    assert sched.lookup(resumed, 0, store, "m", "blake3") is None
    # vLLM gave a different external count than planned: not blended
    assert sched.lookup(_Req("e", prompt), 0, store, "m", "blake3") is not None
    assert sched.allocated("e", 0) is None and sched.take("e") is None
