"""HKVD selection, the step's row bookkeeping and the Blend hooks on synthetic tensors."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ucm.sparse import SparseModelInfo, UcmSparseRole
from ucm.sparse.base import AttentionCall, LayerRows, layer_index
from ucm.sparse.blend import Blend, BlendConfig, BlendStep, build_step, select_hkvd
from ucm.sparse.blend.chunks import BlendMode, BlendPlan, BlockLoad
from ucm.sparse.blend.select import BlendRequestRows
from ucm.sparse.kernels.views import cpu_kv_cache_views


def test_select_hkvd_top_deviation_plus_forced() -> None:
    dev = torch.tensor([0.1, 5.0, 3.0, 9.0, 1.0, 7.0])
    cand = torch.tensor([True, True, True, False, True, True])
    forced = torch.tensor([False, False, False, True, False, False])
    assert select_hkvd(dev, cand, forced, 2).tolist() == [1, 3, 5]
    assert select_hkvd(dev, cand, forced, 0).tolist() == [3]
    assert select_hkvd(dev, cand, forced, 99).tolist() == [0, 1, 2, 3, 4, 5]
    ties = torch.ones(4)
    assert select_hkvd(
        ties, torch.ones(4, dtype=torch.bool), torch.zeros(4, dtype=torch.bool), 2
    ).tolist() == [0, 1]


def _step() -> BlendStep:
    # request "d": 2 decode rows (forced); request "b": 8 rows, rows 4..8 reused,
    # the rest (missed blocks, the last token) forced
    reused = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 1, 0], dtype=torch.bool)
    rows = [BlendRequestRows("d", 0, 2, 0), BlendRequestRows("b", 2, 10, 5)]
    return BlendStep(rows, reused, ~reused, torch.arange(100, 110), torch.arange(10))


def test_step_select_shrink_and_logits() -> None:
    st = _step()
    dev = torch.tensor([0, 0, 0, 0, 1, 9, 2, 8, 3, 0], dtype=torch.float32)
    local = st.select(1, dev, 0.5)  # floor(0.5 * 5) = 2 reused rows: 5 and 7
    assert local.tolist() == [0, 1, 2, 3, 5, 7, 9]
    assert st.shrunk and st.num_active == 7 and st.selections == {1: 7}
    assert st.active_query_start_loc().tolist() == [0, 2, 7]
    pos = torch.arange(10) * 10
    assert st.shrink(pos).tolist() == [0, 10, 20, 30, 50, 70, 90]
    h = torch.randn(7, 3)
    assert st.shrink(h) is h  # already at the active count
    # a second check layer narrows among the active rows
    dev2 = torch.tensor([0, 0, 0, 0, 5, 1, 0], dtype=torch.float32)
    local2 = st.select(3, dev2, 0.2)  # floor(0.2 * 5) = 1 reused row: row 5
    assert local2.tolist() == [0, 1, 2, 3, 4, 6]
    assert st.active.tolist() == [0, 1, 2, 3, 5, 9]
    assert st.shrink(torch.arange(7)).tolist() == [0, 1, 2, 3, 4, 6]  # previous count
    assert st.shrink(pos).tolist() == [0, 10, 20, 30, 50, 90]  # original count
    assert st.logits_indices(torch.tensor([1, 9])).tolist() == [1, 5]
    with pytest.raises(RuntimeError, match="dropped"):
        st.logits_indices(torch.tensor([7]))


def test_build_step_from_plans() -> None:
    plan = BlendPlan(
        BlendMode.BLEND, num_tokens=12, block_size=4, prefix_ids=[b"x"] * 3, prefix_hit_blocks=1
    )
    plan.loads = [BlockLoad(0, b"x", -1, 0, 0), BlockLoad(1, b"c", 0, 0, 4)]
    st = build_step([("dec", None, 0, 1), ("r", plan, 1, 8)], torch.arange(9), torch.arange(9))
    assert st.reused.tolist() == [False] + [True] * 4 + [False] * 4
    assert st.forced.tolist() == [True] + [False] * 4 + [True] * 4
    assert st.requests[1].num_reused == 4
    with pytest.raises(ValueError, match="one step"):
        build_step([("r", plan, 0, 5)], torch.arange(5), torch.arange(5))


def test_layer_index() -> None:
    assert layer_index("model.layers.12.self_attn.attn") == 12
    assert layer_index("layers.0.attn") == 0
    with pytest.raises(ValueError):
        layer_index("lm_head")


def test_blend_attention_begin_rewrites_metadata() -> None:
    b, h, d, nb = 4, 2, 32, 8
    info = SparseModelInfo(block_size=b, num_layers=2, num_heads=4, num_kv_heads=h, head_dim=d)
    blend = Blend(
        info, UcmSparseRole.WORKER, BlendConfig(blend_recompute_ratio=0.5, blend_check_layers=[1])
    )
    blend.impl = "torch"
    kv = torch.randn(nb, h, b, 2 * d)
    name0, name1 = "model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"
    blend.initialize_kv_cache_tensors({name0: kv, name1: kv.clone()})
    q, k, v = torch.randn(6, 4, d), torch.randn(6, h, d), torch.randn(6, h, d)
    out = torch.empty_like(q)
    call = AttentionCall(name1, q, k, v, None, out)
    assert blend.attention_begin(call) is call  # no step: pass-through
    reused = torch.tensor([1, 1, 1, 1, 0, 0], dtype=torch.bool)
    slots = torch.tensor([8, 9, 10, 11, 12, 13])
    blend.bind_step(
        BlendStep([BlendRequestRows("r", 0, 6, 4)], reused, ~reused, slots, torch.arange(4, 10))
    )
    # make row 2 deviate most: the cache holds exactly the fresh keys except there
    kc, _ = cpu_kv_cache_views(blend_kv := kv.clone())
    blend.initialize_kv_cache_tensors({name1: blend_kv})
    kc[2, :] = k[:4]
    kc[2, 1] += 3.0
    kc[2, 3] += 1.0
    meta = SimpleNamespace(
        slot_mapping=slots.clone(),
        query_start_loc=torch.tensor([0, 6]),
        num_actual_tokens=6,
        max_query_len=6,
        seq_lens=torch.tensor([10]),
        block_table=torch.tensor([[0, 2, 3]]),
    )
    call = AttentionCall(name0, q, k, v, meta, out, blend_kv)
    assert blend.attention_begin(call) is call  # not a check layer
    cut = blend.attention_begin(call.replace(layer_name=name1))
    q2, o2 = cut.query, cut.output
    assert blend.step.active.tolist() == [1, 3, 4, 5]
    assert torch.equal(q2, q[[1, 3, 4, 5]]) and o2.shape[0] == 4
    assert meta.slot_mapping.tolist() == [9, 11, 12, 13]
    assert meta.query_start_loc.tolist() == [0, 4]
    assert (meta.num_actual_tokens, meta.max_query_len) == (4, 4)
    # later layers: positions and residual shrink, attention uses true positions
    rows = LayerRows(torch.arange(4, 10), torch.randn(4, 8), torch.randn(6, 8))
    pos, _hid, res = blend.layer_begin(2, rows)
    assert pos.tolist() == [5, 7, 8, 9] and res.shape[0] == 4
    assert blend.sparse_attention(cut)
    assert blend.execute_finished(torch.tensor([5])).tolist() == [3]
    blend.bind_step(None)
    assert not blend.sparse_attention(cut)
