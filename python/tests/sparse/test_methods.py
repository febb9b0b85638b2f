"""ESA, GSA and KVStar on synthetic data: selection, budgets, offload end to end."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from support.kernel_checks import assert_close
from support.offload_sim import run_offload_sim
from support.synthetic import planted_case, random_llama_case

from ucm.sparse import INVALID_SLOT, ESAConfig, GSAConfig, KVStarConfig, SparseModelInfo
from ucm.sparse import UcmSparseRole as Role
from ucm.sparse.esa import ESA, esa_representatives, esa_scores
from ucm.sparse.gsa import GSA, SRPHashEncoder, gsa_select
from ucm.sparse.kernels import attention, selection
from ucm.sparse.kvstar import KVStar, kvstar_channels
from ucm.sparse.offload import OffloadPlan, topk_sorted

B = 16
H_KV, G, D = 2, 4, 64


def info(layers: int = 2) -> SparseModelInfo:
    return SparseModelInfo(block_size=B, num_layers=layers, num_heads=H_KV * G,
                           num_kv_heads=H_KV, head_dim=D)  # fmt: skip


def decode_tensors(prompt_len: int, steps: int, layers: int = 2, seed: int = 0):
    """Per-layer planted KV of ``prompt_len + steps`` tokens and the decode queries.

    The signal is strong (half of each relevant block's keys boosted by 6-8
    logits), so attention concentrates on the planted blocks and a 30 %
    selection should reproduce the dense output closely.
    """
    ks, vs, qs, rel = [], [], [], []
    for layer in range(layers):
        c = planted_case(prompt_len + steps, info(), num_relevant=4, num_queries=steps,
                         seed=seed * 10 + layer, planted_fraction=0.5,
                         boost=(6.0, 8.0))  # fmt: skip
        ks.append(c.k)
        vs.append(c.v)
        qs.append(c.queries)
        rel.append(c.relevant)
    return torch.stack(ks), torch.stack(vs), torch.stack(qs), rel


# --------------------------------------------------------------------------- ESA


def test_topk_sorted_is_stable_and_ordered() -> None:
    s = torch.tensor([1.0, 5.0, 5.0, -1.0, 3.0])
    assert topk_sorted(s, 2) == [1, 2]
    assert topk_sorted(s, 3) == [1, 2, 4]
    assert topk_sorted(-s, 1, largest=True) == [3]
    assert topk_sorted(s, 0) == []


def test_esa_scores_find_planted_blocks() -> None:
    c = planted_case(64 * B, info(), num_relevant=5, seed=3)
    kc, _, ids = c.paged()
    reps = esa_representatives(kc, ids.long(), 8)
    assert reps.shape == (64, B // 8, H_KV, D)
    scores = esa_scores(c.queries[-1], reps)
    assert set(topk_sorted(scores, 5)) == set(c.relevant)
    # the definition: per query head, the best sub-block mean's scaled logit
    # per block, a softmax over the blocks, summed over the heads
    q = c.queries[-1].float()
    want = torch.zeros(64)
    for head in range(H_KV * G):
        keys = kc[ids.long(), :, head // G].float().reshape(64, B // 8, 8, D).mean(dim=2)
        logits = (keys @ q[head]).amax(dim=1) / D**0.5
        want += torch.softmax(logits, dim=0)
    assert_close(scores, want, torch.float32)


def test_esa_sub_block_representatives_find_one_salient_key() -> None:
    """One key that matches the query among others that don't: the block
    mean dilutes it below a block of uniformly mild keys, a sub-block mean
    keeps it."""
    q = torch.zeros(H_KV * G, D)
    q[:, 0] = 1.0
    kc = torch.zeros(2, B, H_KV, D)
    kc[0, :, :, 0] = 0.5  # block 0: every key mildly aligned
    kc[1, :, :, 1] = 1.0  # block 1: unrelated keys ...
    kc[1, 5, :, 0] = 6.0  # ... but one strongly aligned
    ids = torch.tensor([0, 1])
    whole = esa_scores(q, esa_representatives(kc, ids, None))
    sub = esa_scores(q, esa_representatives(kc, ids, 4))
    assert topk_sorted(whole, 1) == [0]
    assert topk_sorted(sub, 1) == [1]


def test_esa_scheduler_budget() -> None:
    esa = ESA(info(), Role.SCHEDULER, ESAConfig(sparse_ratio=0.3))
    esa.request_begin("a", list(range(1000)))
    req = SimpleNamespace(request_id="a", num_prompt_tokens=1000, num_output_tokens=0)
    assert esa.estimate_num_slots_sparsed(req) == INVALID_SLOT  # prefill
    req.num_output_tokens = 3
    plan = esa.offload_plan(1000)
    assert plan is not None
    assert esa.estimate_num_slots_sparsed(req) == plan.compressed_len(3)
    # N = 63, R = 60, k = 18: init 1 + 18 swap + local (1000 % 16 = 8) + 16
    assert plan.compressed_len(3) == (1 + 18) * 16 + 8 + 16 + 3
    short = SimpleNamespace(request_id="b", num_output_tokens=1, num_prompt_tokens=40)
    assert esa.estimate_num_slots_sparsed(short) == INVALID_SLOT
    full = ESA(info(), Role.SCHEDULER, ESAConfig(sparse_ratio=1.0))
    assert full.estimate_num_slots_sparsed(req) == INVALID_SLOT  # ratio 1.0: exactly dense
    esa.request_finished_in_scheduler("a")
    no_prompt = SimpleNamespace(request_id="a", num_output_tokens=2)
    assert esa.estimate_num_slots_sparsed(no_prompt) == INVALID_SLOT


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_esa_keep_all_plan_equals_dense_every_step(impl: str) -> None:
    """With every middle block kept, compression + loads + paged kernel == dense."""
    prompt, steps = 20 * B + 5, 12 if impl == "torch" else 4
    k, v, q, _ = decode_tensors(prompt, steps)
    esa = ESA(info(), Role.WORKER, ESAConfig(retrieval_stride=3, async_retrieval=False))
    esa.impl = impl  # type: ignore[assignment]
    plan = OffloadPlan(prompt, B, 1, 2, num_selected=20 + 1 - 1 - 2)
    res = run_offload_sim(esa, k, v, q, prompt, plan=plan, impl=impl)  # type: ignore[arg-type]
    assert max(res.rel_errors) < 1e-5
    assert res.loads_per_step[0] == 2 * plan.num_selected  # both layers, sync on step 1
    assert sum(res.loads_per_step[1:]) == 0  # nothing changes: no delta loads
    esa.shutdown()


@pytest.mark.parametrize("async_retrieval", [False, True])
def test_esa_offload_end_to_end_planted(async_retrieval: bool) -> None:
    prompt, steps = 40 * B + 7, 16
    k, v, q, _ = decode_tensors(prompt, steps, seed=1)
    esa = ESA(info(), Role.WORKER, ESAConfig(sparse_ratio=0.3, retrieval_stride=4,
                                            async_retrieval=async_retrieval))  # fmt: skip
    esa.impl = "torch"
    res = run_offload_sim(esa, k, v, q, prompt)
    plan = esa.offload_plan(prompt)
    assert plan is not None and plan.num_selected == math.floor(38 * 0.3)
    # device KV footprint: init + k + local (+ decode) blocks instead of all of them
    assert res.device_blocks[-1] == plan.device_blocks(steps) < 0.4 * res.dense_blocks[-1]
    # planted relevance keeps the sparse output close to dense
    assert sum(res.rel_errors) / len(res.rel_errors) < 0.1
    # delta loads after the first step are small compared to the first full load
    assert sum(res.loads_per_step[1:]) <= res.loads_per_step[0]
    esa.request_finished_in_worker("r0")
    assert "r0" not in esa.selectors
    esa.shutdown()


def test_esa_unknown_requests_and_layers() -> None:
    esa = ESA(info(), Role.WORKER, ESAConfig(async_retrieval=False))
    esa.impl = "torch"
    prompt, steps = 30 * B, 3
    k, v, q, _ = decode_tensors(prompt, steps)
    run_offload_sim(esa, k, v, q, prompt)
    assert esa.decode_step("nope", 0, 1, q[0, 0]) is None  # unknown request: dense
    with pytest.raises(KeyError, match="no representatives"):
        esa.selectors["r0"].begin_step(5, 1, q[1, 0])
    esa.shutdown()


# --------------------------------------------------------------------------- KVStar


def test_kvstar_channels_pick_largest_magnitude() -> None:
    kc = torch.randn(4, B, H_KV, D) * 0.1
    kc[..., 0, 5] += 10.0
    kc[..., 1, 60] -= 10.0
    ch = kvstar_channels(kc, torch.arange(4), 4 * B - 3, 0.25)
    assert ch.shape == (H_KV, 16) and ch.dtype == torch.int32
    assert 5 in ch[0].tolist() and 60 in ch[1].tolist()
    assert torch.equal(ch, torch.sort(ch, dim=-1).values)


def test_kvstar_votes_select_planted_blocks() -> None:
    c = planted_case(48 * B, info(), num_relevant=4, num_queries=4, seed=5,
                     planted_fraction=0.5, boost=(5.0, 7.0))  # fmt: skip
    kv = KVStar(info(1), Role.WORKER, KVStarConfig(sparse_ratio=0.1, retrieval_stride=4,
                                                  async_retrieval=False))  # fmt: skip
    sel = kv.selector_for("r", c.seq_len)
    kc, _, ids = c.paged()
    sel.on_prefill_finished(0, kc, ids.long(), c.queries)
    chosen = sel.select(0, c.queries)
    assert len(chosen) == math.ceil(45 * 0.1) == 5
    assert set(c.relevant) <= set(chosen)
    kv.shutdown()


def test_kvstar_offload_end_to_end_delayed_delta_loads() -> None:
    prompt, steps, stride = 32 * B + 9, 13, 4
    k, v, q, _ = decode_tensors(prompt, steps, seed=2)
    kv = KVStar(info(), Role.WORKER, KVStarConfig(sparse_ratio=0.25, retrieval_stride=stride,
                                                 async_retrieval=False))  # fmt: skip
    kv.impl = "torch"
    pre = q[:, :stride]  # stand-in for the last prefill queries
    res = run_offload_sim(kv, k, v, q, prompt, prefill_queries=pre)
    plan = kv.offload_plan(prompt)
    assert plan is not None and plan.num_selected == math.ceil(plan.num_middle * 0.25)
    # loads only at step 1 (sync) and at collect steps 2*stride, 3*stride (delayed)
    assert all(n == 0 for t, n in enumerate(res.loads_per_step, 1) if t not in (1, 8, 12))
    assert sum(res.rel_errors) / len(res.rel_errors) < 0.1
    sched = KVStar(info(), Role.SCHEDULER, KVStarConfig())
    req = SimpleNamespace(request_id="x", num_prompt_tokens=prompt, num_output_tokens=1)
    assert sched.estimate_num_slots_sparsed(req) == sched.offload_plan(prompt).compressed_len(1)
    kv.shutdown()


# --------------------------------------------------------------------------- GSA


def _gsa(cfg: GSAConfig, layers: int = 3) -> GSA:
    g = GSA(info(layers), Role.WORKER, cfg)
    g.allocate_code_caches(64)
    return g


def _write_prompt(g: GSA, layer: int, k: torch.Tensor, row: list[int]) -> None:
    slots = torch.tensor([row[t // B] * B + t % B for t in range(k.shape[0])])
    g.write_key_codes(layer, k, slots)


def test_gsa_code_cache_written_through_slots() -> None:
    g = _gsa(GSAConfig(topk_tokens=64, seq_len_threshold=64, concurrency_threshold=1))
    k = torch.randn(40, H_KV, D)
    row = [7, 3, 50]
    _write_prompt(g, 0, k, row)
    codes = g.encoder.encode(k)
    assert torch.equal(g.code_caches[0][3, 4], codes[B + 4])
    assert torch.equal(g.code_caches[0][50, 7], codes[2 * B + 7])
    assert g.encoder.nbits == D and g.encoder.words == 2


def test_gsa_select_planted_and_forced_blocks() -> None:
    c = planted_case(40 * B + 5, info(), num_relevant=3, seed=7, boost=(6.0, 8.0),
                     planted_fraction=1.0)  # fmt: skip
    enc = SRPHashEncoder(D, 128, seed=0)
    codes = torch.zeros(64, B, H_KV, 4, dtype=torch.int32)
    row = torch.randperm(64)[: c.num_blocks].to(torch.int32)
    slots = row.long().repeat_interleave(B)[: c.seq_len] * B + torch.arange(c.seq_len) % B
    enc.write_keys(c.k, codes, slots)
    qc = enc.encode_query(c.queries[-1:], H_KV)
    keep = torch.tensor([8])
    batch = selection.HammingBatch(qc, codes, row[None], torch.tensor([c.seq_len]))
    table, lens, chosen = gsa_select(batch, keep)
    picked = chosen[0][chosen[0] >= 0].tolist()
    n = c.num_blocks
    assert picked == sorted(picked) and len(picked) == 8
    assert 0 in picked and {n - 4, n - 3, n - 2, n - 1} <= set(picked)  # sink + recent
    assert set(c.relevant) <= set(picked)
    assert table[0, :8].tolist() == row[picked].tolist()
    assert int(lens[0]) == c.seq_len - (n - 8) * B
    # too small a budget still keeps the forced blocks (and so the partial tail)
    _, _, chosen2 = gsa_select(batch, torch.tensor([2]))
    assert (chosen2[0] >= 0).sum() == 5 and chosen2[0, 4] == n - 1


def test_gsa_gate_rollback_and_skip_layers() -> None:
    cfg = GSAConfig(topk_tokens=64, seq_len_threshold=128, concurrency_threshold=2,
                    rollback_layers=[0], skip_layers=[2])  # fmt: skip
    g = _gsa(cfg)
    assert sorted(g.code_caches) == [1]  # no codes for rollback or skip layers
    assert [g.layer_policy(i) for i in range(3)] == ["dense", "sparse", "reuse"]
    s = 2
    seq_lens = torch.tensor([200, 150])
    table = torch.arange(s * 13, dtype=torch.int32).reshape(s, 13)
    for i in range(s):
        _write_prompt(g, 1, torch.randn(int(seq_lens[i]), H_KV, D), table[i].tolist())
    q = torch.randn(s, H_KV * G, D)
    assert not g.begin_step([200, 100])  # only one long request: dense step
    assert g.select(1, q, table, seq_lens) is None
    assert g.begin_step(seq_lens)
    assert g.select(0, q, table, seq_lens) is None  # rollback layer
    sel = g.select(1, q, table, seq_lens)
    assert sel is not None
    assert g.select(2, q, table, seq_lens) is sel  # skip layer reuses layer 1
    _, new_lens = sel
    assert new_lens.tolist() == [200 - (13 - 5) * B, 150 - (10 - 5) * B]  # T=4 < 5 forced
    assert g.estimate_num_slots_sparsed(object()) == INVALID_SLOT
    assert g.num_sparse_steps == 1


def test_gsa_full_ratio_is_exactly_dense() -> None:
    """sparse_ratio 1.0 keeps every block in order: same table, same output."""
    g = _gsa(GSAConfig(sparse_ratio=1.0, seq_len_threshold=0, concurrency_threshold=1), 2)
    seq_lens = torch.tensor([100, 37])
    table = torch.tensor([[9, 1, 5, 2, 8, 0, 3], [4, 6, 7, 10, 11, 12, 13]], dtype=torch.int32)
    for i in range(2):
        _write_prompt(g, 0, torch.randn(int(seq_lens[i]), H_KV, D), table[i].tolist())
    q = torch.randn(2, H_KV * G, D)
    assert g.begin_step(seq_lens)
    new_table, new_lens = g.select(0, q, table, seq_lens)
    assert torch.equal(new_lens, seq_lens)
    for i in range(2):
        nb = -(-int(seq_lens[i]) // B)
        assert torch.equal(new_table[i, :nb], table[i, :nb])
    kc, vc = torch.randn(16, B, H_KV, D), torch.randn(16, B, H_KV, D)
    a = attention.paged_decode_attention(q, kc, vc, new_table, new_lens)
    assert torch.equal(a, attention.paged_decode_attention(q, kc, vc, table, seq_lens))


def test_random_llama_case_shapes() -> None:
    model = SparseModelInfo(block_size=B, num_layers=2, num_heads=H_KV * G, num_kv_heads=H_KV,
                            head_dim=32)  # fmt: skip
    c = random_llama_case(256, model, num_queries=3)
    assert c.k.shape == (256, H_KV, 32) and c.queries.shape == (3, H_KV * G, 32)
    assert torch.isfinite(c.k).all() and torch.isfinite(c.queries).all()
