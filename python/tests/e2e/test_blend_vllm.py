"""Blend end to end on vLLM's CPU build through the UCM connector.

A random tiny Llama (4 layers, hidden 256, float32), greedy, block size 32,
chunks of 128 tokens (4 blocks). Engines run in child processes
(:mod:`support.vllm_child`) that share one Posix store directory:

* REF, no connector: the full-prefill tokens of every prompt;
* BLEND (``blend_recompute_ratio`` 1.0, vLLM's prefix cache on): builds the
  chunk caches by serving each chunk alone, then serves the chunks in
  another order plus a question (its first chunk a device prefix hit): every
  reused token is recomputed, so the tokens equal REF's; the chunk blocks
  were still looked up, loaded and rotated;
* BLEND (default ratio 0.15, check layers 1 and 2, layer-wise connector), a
  new process on the same store: the blended prompt completes with the chunk
  blocks loaded, 39 % then 15 % of the reused rows kept at the check layers,
  and gives the torch reference stack's blend result; a prompt with too few chunk hits falls
  back to prefix reuse (tokens equal REF's); chunks marked by an explicit
  ``ucm_blend_chunks`` list in ``kv_transfer_params`` blend too, and the
  same prompt without the list is plain prefix reuse.
"""

from __future__ import annotations

import importlib.util
import math
import random
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"
)

BS = 32
#: The default-ratio engine selects at two layers (CacheBlend's gradual
#: filtering): the second cut runs on rows the first one already shrank.
CHECK = [1, 2]
CHUNK = 128  # 4 blocks
END = 3  # chunk_end_token_id (the tiny model's <pad>)
MIN_HITS = 8


def _rand(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(4, 500) for _ in range(n)]


def _chunk(rng: random.Random) -> list[int]:
    """A chunk of the end-token protocol: ``CHUNK`` tokens, the last one ``END``."""
    return [*_rand(rng, CHUNK - 1), END]


def run_engine(spec: dict[str, Any], cwd: Path) -> dict[str, Any]:
    from support.vllm_child import run_child

    return run_child(spec, cwd, timeout=600)


def expected_kept(forced: int, reused: int) -> dict[str, int]:
    """Rows kept at each check layer of :data:`CHECK` with the default ratio."""
    from ucm.sparse.blend import BlendConfig

    shares = BlendConfig(blend_check_layers=CHECK).check_layer_ratios()
    return {str(k): forced + math.floor(s * reused + 1e-9) for k, s in shares.items()}


def blend_ucm(store: Path, **blend: Any) -> dict[str, Any]:
    cfg = {"chunk_end_token_id": END, "min_blend_hit_blocks": MIN_HITS}
    cfg.update(blend)
    return {
        "storage_backends": str(store),
        "store_pipeline": "Posix",
        "ucm_sparse_config": {"Blend": cfg},
    }


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Any:
    from ucm.vllm_demo.tiny_model import TinyModelSpec, make_tiny_llama

    model = make_tiny_llama(
        request.config.cache.mkdir("ucm-blend-tiny-l4h256"),
        TinyModelSpec(layers=4, hidden=256, heads=4, kv_heads=2, intermediate=512),
    )
    rng = random.Random(7)
    chunks = [_chunk(rng) for _ in range(4)]
    question = _rand(rng, 40)
    other = _chunk(rng)
    plain = [_rand(rng, CHUNK) for _ in range(3)]  # no end token: explicit spans only
    q2 = _rand(rng, 24)
    p = {
        "blend": chunks[2] + chunks[0] + chunks[3] + chunks[1] + question,
        # one known chunk (4 blocks) and one unseen: below MIN_HITS -> prefix reuse
        "fallback": chunks[1] + other + question,
        "explicit": plain[1] + plain[0] + plain[2] + q2,
    }
    spans = [[i * CHUNK, (i + 1) * CHUNK] for i in range(3)]
    tmp = tmp_path_factory.mktemp("blend-vllm")
    return {
        "model": str(model),
        "store": tmp / "store",
        "tmp": tmp,
        "chunks": chunks,
        "plain": plain,
        "prompts": p,
        "spans": spans,
    }


def reference_blend(world: dict[str, Any]) -> tuple[list[int], float]:
    """Greedy tokens and first-token log probability of the blended prompt on
    :mod:`support.refmodel` (default ratio, check layer 1)."""
    from support import refmodel as rm

    from ucm.sparse import SparseModelInfo, UcmSparseRole
    from ucm.sparse.blend import Blend, BlendConfig

    model = rm.TinyLlama.from_pretrained(world["model"])
    info = SparseModelInfo(block_size=BS, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64)
    cfg = BlendConfig(
        chunk_end_token_id=END, min_blend_hit_blocks=MIN_HITS, blend_check_layers=CHECK
    )
    blend = Blend(info, UcmSparseRole.WORKER, cfg)
    blend.impl = "torch"
    cache = rm.PagedKV(model.spec, 64, BS)
    blend.initialize_kv_cache_tensors(cache.kv)
    blend.set_rotary(model.cos_sin_cache, model.spec.is_neox)
    store = rm.DictStore()
    for c in world["chunks"]:
        cache.free(rm.serve_prefill(model, cache, store, c, blend=blend).seq.blocks)
    r = rm.serve_prefill(model, cache, store, world["prompts"]["blend"], blend=blend)
    kept = expected_kept(len(world["prompts"]["blend"]) - 4 * CHUNK, 12 * BS)
    assert r.selected == {int(k): v for k, v in kept.items()}
    lp = float(r.logits.log_softmax(-1).max())
    return rm.decode(model, cache, r.seq, r.logits, 8), lp


def test_blend_on_vllm(world: dict[str, Any]) -> None:
    p, tmp = world["prompts"], world["tmp"]
    ref = run_engine(
        {
            "model": world["model"],
            "ucm": None,
            "ops": [{"name": k, "prompts": [v]} for k, v in p.items()],
        },
        tmp,
    )

    # -- ratio 1.0: chunk caches built by serving each chunk alone, then a full
    #    recompute; vLLM's prefix cache on, so the chunk served first is a
    #    device hit of the blended prompt (its exact prefix)
    full = run_engine(
        {
            "model": world["model"],
            "ucm": blend_ucm(world["store"], blend_recompute_ratio=1.0),
            "llm": {"enable_prefix_caching": True},
            "ops": [
                {"name": "build", "prompts": world["chunks"], "max_tokens": 1},
                {
                    "name": "build_plain",
                    "prompts": world["plain"],
                    "params": [{"ucm_blend_build": True}] * 3,
                    "max_tokens": 1,
                },
                {"name": "blend", "prompts": [p["blend"]]},
            ],
        },
        tmp,
    )
    assert full["build"]["stats"].get("plan_build_chunk_cache") == 4
    assert full["build_plain"]["stats"].get("plan_build_chunk_cache") == 3
    s = full["blend"]["stats"]
    # chunk 2 is the prompt's exact prefix (4 blocks, in vLLM's prefix cache:
    # not loaded); chunks 0, 3, 1 are chunk hits
    assert s.get("plan_blend") == 1 and s.get("chunk_hit_blocks") == 12, s
    assert s.get("chunk_blocks_loaded") == 12 and not s.get("prefix_blocks_loaded"), s
    assert s.get("blocks_rotated") == 12 and s.get("blend_steps") == 1, s
    rows = len(p["blend"]) - CHUNK
    assert full["blend"]["steps"][0]["rows"] == rows
    assert full["blend"]["steps"][0]["kept"] == {"1": rows}  # ratio 1.0 keeps every row
    assert full["blend"]["tokens"] == ref["blend"]["tokens"]

    # -- default ratio (0.15), a new engine on the same store, layer-wise mode
    #    (a step with a blended request still loads whole-step)
    part = run_engine(
        {
            "model": world["model"],
            "ucm": {**blend_ucm(world["store"], blend_check_layers=CHECK), "use_layerwise": True},
            "ops": [
                {"name": "blend", "prompts": [p["blend"]]},
                {  # the kept rows' attention of non-CPU backends (torch here)
                    "name": "blend_generic",
                    "prompts": [p["blend"]],
                    "blend_native_runs": False,
                },
                {"name": "fallback", "prompts": [p["fallback"]], "blend_native_runs": True},
                {
                    "name": "explicit",
                    "prompts": [p["explicit"]],
                    "params": [{"ucm_blend_chunks": world["spans"]}],
                },
                {"name": "explicit_absent", "prompts": [p["explicit"]]},
            ],
        },
        tmp,
    )
    s = part["blend"]["stats"]
    assert s.get("plan_blend") == 1 and s.get("chunk_blocks_loaded") == 12, s
    assert s.get("blend_steps") == 1 and s.get("prefix_blocks_loaded") == 4, s
    step = part["blend"]["steps"][0]
    reused, forced = 12 * BS, len(p["blend"]) - 4 * CHUNK
    assert step["reused"] == reused
    assert step["kept"] == expected_kept(forced, reused), step
    # The same blend on the torch reference stack (same weights, same store
    # protocol): the row cutting, position-causal attention of the kept rows
    # and the logits remap inside vLLM give the reference's tokens.
    ref_tokens, ref_lp = reference_blend(world)
    assert part["blend"]["tokens"][0] == ref_tokens
    (lp,) = part["blend"]["first_logprobs"][0].values()
    assert abs(lp - ref_lp) < 1e-3
    assert part["blend"]["tokens"] != ref["blend"]["tokens"]  # 15 % is not a full recompute
    # vLLM's CPU kernel on runs of kept rows vs Blend.sparse_attention: same result
    assert part["blend"]["stats"].get("attention_runs", 0) > 0
    assert not part["blend_generic"]["stats"].get("attention_runs")
    assert part["blend_generic"]["steps"][0]["kept"] == step["kept"]
    assert part["blend_generic"]["tokens"] == part["blend"]["tokens"]
    (lp2,) = part["blend_generic"]["first_logprobs"][0].values()
    assert abs(lp2 - lp) < 1e-3

    s = part["fallback"]["stats"]
    assert s.get("plan_prefix") == 1 and not s.get("plan_blend") and not s.get("blend_steps"), s
    assert part["fallback"]["tokens"] == ref["fallback"]["tokens"]

    s = part["explicit"]["stats"]
    assert s.get("plan_blend") == 1 and s.get("chunk_blocks_loaded") == 8, s
    assert s.get("prefix_blocks_loaded") == 4, s
    assert part["explicit"]["steps"][0]["kept"] == expected_kept(
        len(p["explicit"]) - 3 * CHUNK, 8 * BS
    )
    s = part["explicit_absent"]["stats"]
    assert s.get("plan_prefix") == 1 and not s.get("blend_steps"), s
    assert part["explicit_absent"]["tokens"] == ref["explicit"]["tokens"]
