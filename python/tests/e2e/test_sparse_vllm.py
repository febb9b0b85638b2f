"""ESA, GSA and KVStar end to end on vLLM's CPU build, through the UCM connector.

The engines run in a child process (``sparse_vllm_check.py``) so vLLM's
global state never leaks into the test process; the model is a random
2-layer Llama (hidden 256, float32), decoding is greedy, blocks are 32 tokens.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
from support.engines import run_check_script

BLOCK = 32  # sparse_vllm_check.BLOCK

HERE = Path(__file__).resolve().parent

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"
)


def _run_child(scenario: str, tmp_path: Path, request: pytest.FixtureRequest) -> dict[str, Any]:
    cache = getattr(request.config, "cache", None)  # None with -p no:cacheprovider
    model_dir = cache.mkdir("ucm-sparse-tiny256") if cache is not None else tmp_path / "model"
    args = (str(model_dir), str(tmp_path), scenario)
    return run_check_script(HERE / "sparse_vllm_check.py", *args, cwd=tmp_path, timeout=900)


# ---------------------------------------------------------------------------- vLLM


@needs_vllm
def test_ratio_one_is_exactly_dense_and_hooks_uninstall(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """(a) ESA, KVStar and GSA at ``sparse_ratio: 1.0`` give the dense tokens;
    (c) every hook is removed at shutdown and a later dense engine is unaffected."""
    r = _run_child("exact", tmp_path, request)
    dense = r["dense"]
    assert len(dense) == 3 and all(len(t) == 8 for t in dense)
    for name in ("ESA", "KVStar", "GSA"):
        assert r[name] == dense, name
    # ESA/KVStar at 1.0 keep every block: the requests stay dense (no sparse row).
    assert r["ESA_stats"]["sparse_rows"] == 0 and r["KVStar_stats"]["sparse_rows"] == 0
    # GSA's thresholds are reached: its own attention ran on every decode step of
    # the non-rollback layer (3 requests x 7 steps), over all blocks.
    g = r["GSA_stats"]
    assert g["sparse_rows"] == 3 * 7 and g["attended_blocks"] == g["dense_blocks"]
    assert g["kernel_skipped"] == 7
    # Hooks: installed while serving, all gone after shutdown; none without a method.
    assert r["dense_close"]["before"] == {"impl_wrapped": 0, "alloc_wrapped": False}
    for name, alloc in (("ESA", True), ("KVStar", True), ("GSA", False)):
        c = r[f"{name}_close"]
        assert c["before"] == {"impl_wrapped": 2, "alloc_wrapped": alloc}, name
        assert c["after"] == {"impl_wrapped": 0, "alloc_wrapped": False, "agent": False}, name
    assert r["dense_after"] == dense
    # A method registered by the user gets the generic hooks, on both roles.
    c = r["Counting_calls"]
    assert r["Counting"] == dense
    # 3 requests, then 1 more whose step tells the workers the 3 finished.
    assert c["request_begin"] == 4 and c["request_finished_in_scheduler"] == 4
    assert c["request_finished_in_worker"] == 3
    # 2 layers x every forward step (3 prefills + 7 decode steps at least).
    assert c["attention_begin"] == c["attention_finished"] >= 2 * 8
    assert c["build_sparse_meta"] >= 8
    assert r["Counting_close"]["after"] == {
        "impl_wrapped": 0,
        "alloc_wrapped": False,
        "agent": False,
    }
    # GSA below its concurrency threshold: dense attention, dense tokens.
    assert r["GSA_gated"] == dense and r["GSA_gated_stats"]["sparse_rows"] == 0
    # GSA at 0.3: sparse attention over a third of the blocks; the first token
    # comes from the dense prefill.
    g3 = r["GSA_03_stats"]
    assert g3["sparse_rows"] == 3 * 7 and g3["attended_blocks"] < 0.5 * g3["dense_blocks"]
    assert [t[0] for t in r["GSA_03"]] == [t[0] for t in dense]
    assert all(len(t) == 8 for t in r["GSA_03"])


@needs_vllm
def test_gsa_selects_the_same_blocks_after_a_load(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """GSA's key codes cover blocks loaded from the store: a fresh engine that
    loads the prompts selects, at every decode step and layer, the blocks an
    engine that computed them selected."""
    r = _run_child("gsa_load", tmp_path, request)
    assert r["computed_cached"] == [0, 0, 0]
    # Every full block came from the store (prefix caching is off).
    assert r["loaded_cached"] == [n - n % BLOCK for n in (700, 1000, 333)]
    assert r["computed_stats"]["sparse_rows"] == r["loaded_stats"]["sparse_rows"] == 3 * 7
    assert r["loaded_selections"] == r["computed_selections"]
    assert r["loaded"] == r["computed"]
    assert r["loaded_stats"]["block_layers_coded_from_kv"] > 0


@needs_vllm
def test_esa_8k_offload_shrinks_device_kv(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """(b) ESA at ``sparse_ratio: 0.3`` serves an 8k-token prompt; the unselected
    blocks leave device KV and the selected ones come back from the store."""
    r = _run_child("offload", tmp_path, request)
    fp = r["footprint"]
    bs = 32
    n_prompt = r["prompt_len"] // bs  # 256 blocks
    k = int((n_prompt - 1 - 2) * 0.3)  # init 1, local 2 -> floor(253 * 0.3) = 75
    dense_blocks = -(-(r["prompt_len"] + r["decode_tokens"]) // bs)
    expected = 1 + k + 2 + -(-r["decode_tokens"] // bs)
    mib = r["block_bytes"] / 2**20
    print(
        f"\n8k ESA 0.3 device KV during decode: {fp['max_decode_held']} blocks "
        f"({fp['max_decode_held'] * mib:.1f} MiB) vs dense {fp['max_decode_dense']} blocks "
        f"({fp['max_decode_dense'] * mib:.1f} MiB); decode tok/s dense "
        f"{r['dense_decode_tps']}, in-place sparse {r['inplace_decode_tps']}, offload "
        f"{r['offload_decode_tps']}; blocks loaded from the store "
        f"{r['offload_stats']['blocks_loaded']}"
    )
    assert fp["compressed"]
    assert fp["max_decode_dense"] == dense_blocks
    assert fp["max_decode_held"] <= expected
    # ... which is exactly the method's own slot budget (estimate_num_slots_sparsed).
    assert fp["max_decode_held"] == fp["max_budget_blocks"]
    assert fp["max_decode_held"] / fp["max_decode_dense"] < 0.32
    # The first token comes from the (dense) prefill; decode tokens then differ.
    assert r["inplace"][0] == r["dense"][0]
    assert len(r["offload"]) == r["decode_tokens"]
    # Offloading changes where the selected blocks live, not what is attended:
    # blocks loaded back from the store give the same tokens as reading them in place.
    assert r["offload"] == r["inplace"]
    s = r["offload_stats"]
    assert s["blocks_loaded"] > 0 and s["load_failures"] == 0
    # Re-selections load only their delta, overlapped with the step's forward.
    assert 0 < s["loads_deferred"] < s["blocks_loaded"]
    assert s["sparse_rows"] == 2 * (r["decode_tokens"] - 1)
    # Each sparse decode attends at most init + k + local (+ decode) blocks.
    assert s["attended_blocks"] <= s["sparse_rows"] * expected
    assert r["inplace_stats"]["blocks_loaded"] == 0
    # The same prompt again, its KV now from vLLM's prefix cache and the store.
    assert r["offload_again"] == r["offload"]
    assert r["offload_again_stats"]["load_failures"] == 0
    # Two requests where one decodes while the other is prefilled: vLLM's kernel
    # runs on the mixed batch and the sparse rows are replaced; same equalities.
    assert r["offload_pair_stats"]["mixed_batches"] > 0
    assert r["offload_pair"] == r["inplace_pair"]
    assert [t[0] for t in r["offload_pair"]] == [t[0] for t in r["dense_pair"]]
    assert r["offload_pair_stats"]["load_failures"] == 0
    # KVStar (delayed delta loads): offloading gives the in-place tokens too.
    ks = r["kvstar_offload_pair_stats"]
    assert ks["blocks_loaded"] > 0 and ks["load_failures"] == 0 and ks["mixed_batches"] > 0
    assert ks["loads_deferred"] > 0
    assert r["kvstar_offload_pair"] == r["kvstar_inplace_pair"]
    assert [t[0] for t in r["kvstar_offload_pair"]] == [t[0] for t in r["dense_pair"]]


@needs_vllm
def test_readme_user_method(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """The sparse page's user-method example runs as it stands: its own file and a
    registration, no other change; the bridge installs its attention hooks."""
    r = _run_child("readme", tmp_path, request)
    dense = r["dense"]
    # Attending every block is the dense attention: the same tokens.
    assert r["wide"] == dense
    for label in ("wide", "readme"):
        assert r[f"{label}_close"]["before"] == {"impl_wrapped": 2, "alloc_wrapped": False}
        assert r[f"{label}_close"]["after"] == {
            "impl_wrapped": 0,
            "alloc_wrapped": False,
            "agent": False,
        }
    # The example's window: the prefill is dense (same first tokens), decode is sparse.
    assert [t[0] for t in r["readme"]] == [t[0] for t in dense]
    assert r["readme"] != dense
