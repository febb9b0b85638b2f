"""Prefill/decode handover between two connectors over one real store, without vLLM
engines: the prefill side's answer, the decode side's bounded wait, and bad
``kv_transfer_params``."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from test_vllm_connector_unit import BS, FakeRequest, H, L, Side, sched_output, tokens

from ucm.integration.vllm.handover import Handover


@dataclass
class PDRequest(FakeRequest):
    kv_transfer_params: dict[str, Any] | None = None

    # Nothing is decoded in these tests: the prompt is all the tokens.
    num_prompt_tokens = FakeRequest.num_tokens
    prompt_token_ids = FakeRequest.all_token_ids


def run_worker(side: Side, meta: Any) -> None:
    """The worker half of one engine step (vLLM's model runner)."""
    w = side.worker
    w.bind(meta)
    w.start_load_kv()
    for i in range(L):
        name = f"model.layers.{i}.self_attn.attn"
        w.wait_for_layer_load(name)
        w.save_kv_layer(name)
    w.wait_for_save()
    w.clear()


def prefill(side: Side, req_id: str, toks: list[int], blocks: list[int]) -> tuple[Any, Any]:
    """The prefill step of a handover request as vLLM runs it: the plan,
    the worker (its saves waited for), then ``request_finished``. Returns
    the step's plan and the answer's ``kv_transfer_params``."""
    req = PDRequest(req_id, toks, kv_transfer_params={"do_remote_decode": True})
    assert side.admit(req, blocks) == 0
    for b in blocks:
        side.kv[:, b] = torch.randn(L, H, BS, side.kv.shape[-1])
    meta = side.sched.build_connector_meta(sched_output(new=[(req_id, 0, len(toks))]))
    run_worker(side, meta)
    _, params = side.sched.request_finished(req, blocks)
    return meta, params


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole-step", "layer-wise"])
def test_decode_waits_for_the_handed_over_prompt_and_loads_all_of_it(
    tmp_path: Path, layerwise: bool
) -> None:
    # Two stores: the prefill engine's blocks reach the decode engine's
    # store only when copied over (as a replicating file system would).
    p = Side(tmp_path / "p", use_layerwise=layerwise)
    d = Side(tmp_path / "d", use_layerwise=not layerwise)
    toks = tokens(3 * BS + 5, 11)
    meta, params = prefill(p, "p1", toks, [4, 7, 2, 9])
    (t,) = meta.requests
    assert t.handover and t.save_from == [4, 7, 2, 9]  # the partial last block too
    assert p.worker.saves.pending("p1") == 0  # the step ended after its saves
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["ucm_blocks"] == 3 and params["ucm_tail_tokens"] == 5

    req = PDRequest("d1", list(toks), kv_transfer_params=dict(params))
    # The blocks are not in this store yet: ask again later, don't compute.
    assert d.sched.get_num_new_matched_tokens(req, 0) == (None, False)
    shutil.copytree(tmp_path / "p", tmp_path / "d", dirs_exist_ok=True)
    assert d.admit(req, [1, 3, 5, 6]) == len(toks) - 1  # all but the last token
    meta, _ = d.step(sched_output(new=[("d1", len(toks) - 1, 1)]))
    assert meta.requests[0].load_into == [1, 3, 5, 6]
    for src, dst in zip([4, 7, 2, 9], [1, 3, 5, 6], strict=True):
        assert torch.equal(d.kv[:, dst], p.kv[:, src])
    p.close()
    d.close()


def test_handovers_are_counted_and_timed_and_their_loads_measured(tmp_path: Path) -> None:
    """The prefill side counts the handover it answered; the decode side the
    one it received (once, however often it looks up), how long it waited
    for the blocks, and the bytes it loaded of them, which a plain request's
    load is not counted in."""
    p = Side(tmp_path / "p")
    d = Side(tmp_path / "d")
    toks = tokens(3 * BS + 5, 16)
    _, params = prefill(p, "p1", toks, [4, 7, 2, 9])
    stats = p.sched.get_kv_connector_stats()
    assert stats is not None and stats.data["handover_answered"] == 1
    req = PDRequest("d1", list(toks), kv_transfer_params=dict(params))
    assert d.sched.get_num_new_matched_tokens(req, 0) == (None, False)
    time.sleep(0.2)
    assert d.sched.get_num_new_matched_tokens(req, 0) == (None, False)
    shutil.copytree(tmp_path / "p", tmp_path / "d", dirs_exist_ok=True)
    assert d.admit(req, [1, 3, 5, 6]) == len(toks) - 1
    d.step(sched_output(new=[("d1", len(toks) - 1, 1)]))
    stats = d.sched.get_kv_connector_stats()
    assert stats is not None
    assert stats.data["handover_received"] == 1
    (waited_ms,) = stats.data["handover_waits_ms"]
    assert 200 <= waited_ms < 60_000
    loads = d.worker.get_kv_connector_stats()
    assert loads is not None and loads.data["load_blocks"] == 4
    assert loads.data["handover_load_bytes"] == loads.data["load_bytes"] > 0

    # The same prompt without a handover: loaded, but no handover of it.
    plain = PDRequest("d2", list(toks))
    assert d.admit(plain, [10, 11, 12, 13]) == 3 * BS
    d.step(sched_output(new=[("d2", 3 * BS, len(toks) - 3 * BS)]))
    stats = d.sched.get_kv_connector_stats()
    assert stats is None or not {"handover_received", "handover_waits_ms"} & set(stats.data)
    loads = d.worker.get_kv_connector_stats()
    assert loads is not None and loads.data["load_blocks"] == 3
    assert "handover_load_bytes" not in loads.data
    p.close()
    d.close()


def test_handover_through_a_mooncake_pool(mooncake: Any) -> None:
    """The same handover with both engines' stores in a Mooncake pool: the
    prefill side's answer names the blocks the pool holds, and the decode
    side loads all of the prompt but its last token from it."""
    import uuid

    store = {"store_pipeline": "Mooncake", **mooncake.store_keys(uuid.uuid4().hex[:12])}
    store["mooncake_negative_cache_ttl_ms"] = 0
    with mooncake.on_host(0):
        p = Side(store)
        d = Side(store)
    toks = tokens(2 * BS + 3, 21)
    _, params = prefill(p, "p1", toks, [4, 7, 2])
    assert (params["ucm_blocks"], params["ucm_tail_tokens"]) == (2, 3)
    req = PDRequest("d1", list(toks), kv_transfer_params=dict(params))
    assert d.admit(req, [1, 3, 5]) == len(toks) - 1
    d.step(sched_output(new=[("d1", len(toks) - 1, 1)]))
    for src, dst in zip([4, 7, 2], [1, 3, 5], strict=True):
        assert torch.equal(d.kv[:, dst], p.kv[:, src])
    p.close()
    d.close()


def test_a_short_prompt_is_handed_over_as_one_partial_block(tmp_path: Path) -> None:
    p = Side(tmp_path)
    toks = tokens(BS - 4, 12)
    _, params = prefill(p, "p1", toks, [3])
    assert (params["ucm_blocks"], params["ucm_tail_tokens"]) == (0, BS - 4)
    d = Side(tmp_path)
    req = PDRequest("d1", list(toks), kv_transfer_params=params)
    assert d.admit(req, [8]) == BS - 5
    d.step(sched_output(new=[("d1", BS - 5, 1)]))
    assert torch.equal(d.kv[:, 8], p.kv[:, 3])
    p.close()
    d.close()


def test_the_wait_is_bounded_and_counted(tmp_path: Path) -> None:
    p = Side(tmp_path / "p")
    toks = tokens(2 * BS + 3, 13)
    _, params = prefill(p, "p1", toks, [0, 1, 2])
    d = Side(tmp_path / "d", handover_timeout_s=0.2)  # the blocks never reach its store
    req = PDRequest("d1", list(toks), kv_transfer_params=params)
    assert d.sched.get_num_new_matched_tokens(req, 0) == (None, False)
    time.sleep(0.25)
    assert d.sched.get_num_new_matched_tokens(req, 0) == (0, False)  # computed here
    assert d.sched.get_num_new_matched_tokens(req, 0) == (0, False)  # no second wait
    stats = d.sched.get_kv_connector_stats()
    assert stats is not None and stats.data["handover_timeouts"] == 1
    assert stats.data["handover_received"] == 1
    (waited_ms,) = stats.data["handover_waits_ms"]  # once, when it timed out
    assert 200 <= waited_ms < 60_000
    p.close()
    d.close()


@pytest.mark.parametrize(
    "bad",
    [
        {"ucm_blocks": "3"},
        {"ucm_blocks": True},
        {"ucm_blocks": -1},
        {"ucm_blocks": 10**30},
        {"ucm_tail_tokens": BS},
        {"ucm_tail_tokens": [1] * 100_000},
        {"ucm_last_block": "zz" * 16},
        {"ucm_last_block": None},
        {"ucm_last_block": ["00" * 16] * 100_000},
        {"ucm_last_block": "00" * 16},  # well formed, but not this prompt's
    ],
    ids=lambda b: next(iter(b)) + "=" + type(next(iter(b.values()))).__name__,
)
def test_bad_handover_params_are_ignored_not_waited_for(
    tmp_path: Path, bad: dict[str, Any]
) -> None:
    p = Side(tmp_path)
    toks = tokens(2 * BS + 3, 14)
    _, params = prefill(p, "p1", toks, [0, 1, 2])
    d = Side(tmp_path, handover_timeout_s=600)
    req = PDRequest("d1", list(toks), kv_transfer_params={**params, **bad})
    t0 = time.monotonic()
    # Served as a plain request: the full blocks are found by the prefix lookup.
    assert d.sched.get_num_new_matched_tokens(req, 0) == (2 * BS, False)
    assert time.monotonic() - t0 < 60
    p.close()
    d.close()


def test_a_failed_save_is_left_out_of_the_answer(
    tmp_path: Path, small_tmpfs: Callable[[str, str], Path]
) -> None:
    """The prefill side's store has room for about one block: the saves of
    the others fail, its answer names only what the store shows (counted in
    ``handover_save_failures``), and the decode side computes the rest at
    once instead of waiting for blocks that never come."""
    root = small_tmpfs("100k", "")
    p = Side(root)
    toks = tokens(3 * BS + 5, 15)
    _, params = prefill(p, "p1", toks, [0, 1, 2, 3])
    named = 0 if params is None else params["ucm_blocks"]
    assert named < 3 and (params is None or params["ucm_tail_tokens"] == 0)
    stats = p.sched.get_kv_connector_stats()
    assert stats is not None and stats.data["handover_save_failures"] == 1
    d = Side(root, handover_timeout_s=600)
    req = PDRequest("d1", list(toks), kv_transfer_params=params)
    t0 = time.monotonic()
    assert d.sched.get_num_new_matched_tokens(req, 0) == (named * BS, False)
    assert time.monotonic() - t0 < 60
    p.close()
    d.close()


def test_handover_params_round_trip() -> None:
    h = Handover(blocks=2, tail_tokens=3, last_block=bytes(range(16)))
    req = PDRequest("r", tokens(2 * BS + 3, 1), kv_transfer_params=h.params())
    assert Handover.of(req, BS) == h
    # Another connector's P/D fields are not ours: no handover.
    nixl = {"do_remote_prefill": True, "remote_block_ids": [1, 2]}
    assert Handover.of(PDRequest("r", [1, 2], kv_transfer_params=nixl), BS) is None


def test_concurrent_prompts_chunked_over_steps_are_answered_with_readable_blocks(
    tmp_path: Path,
) -> None:
    """Four handover requests share a small token budget, so their prompts are
    computed in chunks over several steps and complete in different ones: each
    answer names only blocks the decode side finds at once, and every request
    is reported done saving."""
    p = Side(tmp_path)
    d = Side(tmp_path, handover_timeout_s=600)
    lengths = [2 * BS + 5, BS, BS + 1, 5]
    reqs, progress = [], {}
    free = list(range(24))
    for i, n in enumerate(lengths):
        r = PDRequest(f"p{i}", tokens(n, 20 + i), kv_transfer_params={"do_remote_decode": True})
        blocks = [free.pop() for _ in range(-(-n // BS))]
        assert p.admit(r, blocks) == 0
        for b in blocks:
            p.kv[:, b] = torch.randn(L, H, BS, p.kv.shape[-1])
        reqs.append((r, blocks))
        progress[r.request_id] = 0
    answered, finished, done = 0, set[str](), set[str]()
    for _ in range(50):
        budget, new, cached = BS + 7, [], []
        for r, _ in reqs:
            c = progress[r.request_id]
            n = min(r.num_tokens - c, budget)
            if n > 0:
                budget -= n
                (cached if c else new).append((r.request_id, c, n))
        _, d_ = p.step(sched_output(new=new, cached=cached, finished=finished), set(finished))
        done |= d_ or set()
        finished = set()
        for r, blocks in reqs:
            c = progress[r.request_id]
            step = next((n for rid, _, n in new + cached if rid == r.request_id), 0)
            progress[r.request_id] = c + step
            if step and c + step == r.num_tokens:
                _, params = p.sched.request_finished(r, blocks)
                finished.add(r.request_id)
                dreq = PDRequest("d" + r.request_id, list(r.tokens), kv_transfer_params=params)
                assert d.sched.get_num_new_matched_tokens(dreq, 0) == (r.num_tokens - 1, False)
                answered += 1
        if done == {r.request_id for r, _ in reqs}:
            break
    assert answered == len(reqs) and done == {r.request_id for r, _ in reqs}
    p.close()
    d.close()
