"""ReRoPE config, the K2 cache and the hooks, the model-side rotary wrapper (no vLLM)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from ucm.integration.vllm.sparse.rerope import ReRoPERotary
from ucm.shared.config import ConfigError
from ucm.sparse import AttentionCall, SparseModelInfo, UcmSparseFactory, UcmSparseRole
from ucm.sparse.factory import build_method_config
from ucm.sparse.kernels.attention import reference as attention_ref
from ucm.sparse.kernels.rope import apply_rope, rope_cos_sin_cache
from ucm.sparse.kernels.views import cpu_kv_cache_views
from ucm.sparse.rerope import ReRoPE, ReRoPEConfig
from ucm.sparse.rerope import reference as ref

INFO = SparseModelInfo(block_size=16, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32)
NAME = "model.layers.0.self_attn.attn"


def test_config_and_factory() -> None:
    cfg = build_method_config("ReRoPE", {"rerope_window": 64, "training_length": "512"})
    assert cfg == ReRoPEConfig(rerope_window=64, training_length=512)
    m = UcmSparseFactory.create_sparse_method(
        "ReRoPE", INFO, UcmSparseRole.WORKER, {"training_length": 1024}
    )
    assert isinstance(m, ReRoPE) and m.window == 512 and m.log_n_base == 1024
    for values, key in [
        ({"rerope_window": 0}, "rerope_window"),
        ({"training_length": 1}, "training_length"),
        ({"rerope_window": 600, "training_length": 512}, "rerope_window"),
        ({"window": 3}, "window"),
    ]:
        with pytest.raises(ConfigError) as e:
            build_method_config("ReRoPE", values)
        assert key in str(e.value)
    with pytest.raises(ConfigError, match="training_length"):
        ReRoPE(INFO, UcmSparseRole.WORKER, ReRoPEConfig())  # no model config to take it from
    trained = replace(INFO, max_position_embeddings=2048)
    assert ReRoPE(trained, UcmSparseRole.WORKER).config.training_length == 2048
    assert ReRoPEConfig().resolved(2048).training_length == 2048
    assert ReRoPEConfig(32, training_length=64).resolved(2048).training_length == 64


def _agent(window: int = 8, always_on: bool = False) -> tuple[ReRoPE, torch.Tensor]:
    agent = ReRoPE(
        INFO,
        UcmSparseRole.WORKER,
        ReRoPEConfig(rerope_window=window, training_length=16, always_on=always_on),
    )
    agent.impl = "torch"
    kv = torch.zeros(6, 2, 16, 64)  # vLLM CPU layout [NB, H, B, 2D]
    agent.initialize_kv_cache_tensors({NAME: kv})
    return agent, kv


def test_k2_cache_memory_is_half_the_kv() -> None:
    agent, kv = _agent()
    assert agent.k2_caches[NAME].shape == (6, 16, 2, 32)
    rep = agent.memory_report()
    assert rep["overhead"] == 0.5 and rep["k2_bytes"] == kv.numel() * 4 / 2


def test_hooks_write_k2_and_compute_rerope() -> None:
    agent, kv = _agent(window=8)
    n = 27
    cs = rope_cos_sin_cache(32, 256)
    q, k, v = torch.randn(n, 4, 32), torch.randn(n, 2, 32), torch.randn(n, 2, 32)
    pos = torch.arange(n)
    q_rot, q_w, k_rot, k2 = ref.rerope_prepare(q, k, pos, cs, 8, 16)
    kc, vc = cpu_kv_cache_views(kv)
    slots = torch.tensor([1, 3]).repeat_interleave(16)[:n] * 16 + torch.arange(n) % 16
    attention_ref.write_kv(kc, k_rot, slots)  # what vLLM's do_kv_cache_update does
    attention_ref.write_kv(vc, v, slots)
    meta = SimpleNamespace(
        slot_mapping=slots,
        num_actual_tokens=n,
        max_seq_len=n,
        max_query_len=n,
        seq_lens=torch.tensor([n]),
        query_start_loc=torch.tensor([0, n]),
        block_table=torch.tensor([[1, 3]]),
    )
    out = torch.zeros(n, 4, 32)
    agent.stash(NAME, q_w, k2)
    call = AttentionCall(NAME, q_rot, k_rot, v, meta, out, kv)
    assert agent.attention_begin(call) is call
    assert torch.equal(agent.k2_caches[NAME][3, : n - 16], k[16:])
    assert agent.sparse_attention(call)
    expected = ref.rerope_attention_dense(q, k, v, cs, 8, 16)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # short step (every sequence within the window): the backend runs
    agent.stash(NAME, q_w, k2)
    meta.max_seq_len = 8
    assert not agent.sparse_attention(call)
    assert agent.calls == {"rerope": 1, "native": 1}
    always, _ = _agent(window=8, always_on=True)
    always.stash(NAME, q_w, k2)
    assert always._use_rerope(meta)


class FakeRotary(torch.nn.Module):
    """vLLM's rotary interface: ``(positions, q [T, Hq*D], k [T, Hk*D]) -> (q, k)``,
    rotating in place like the CUDA op."""

    def __init__(self, cs: torch.Tensor, d: int) -> None:
        super().__init__()
        self.cs, self.d = cs, d

    def forward(self, positions, q, k):
        t = q.shape[0]
        q.copy_(apply_rope(q.view(t, -1, self.d), positions, self.cs).view(t, -1))
        k.copy_(apply_rope(k.view(t, -1, self.d), positions, self.cs).view(t, -1))
        return q, k


def test_rotary_wrapper_produces_q_qw_k_k2() -> None:
    agent, _ = _agent(window=8)
    cs = rope_cos_sin_cache(32, 256)
    wrapper = ReRoPERotary(FakeRotary(cs, 32), agent, NAME, 32)
    n = 40
    q, k = torch.randn(n, 4 * 32), torch.randn(n, 2 * 32)
    pos = torch.arange(n)
    q_in, k_in = q.clone(), k.clone()
    q_rot, k_rot = wrapper(pos, q_in, k_in)
    e_q, e_qw, e_k, e_k2 = ref.rerope_prepare(q.view(n, 4, 32), k.view(n, 2, 32), pos, cs, 8, 16)
    torch.testing.assert_close(q_rot.view(n, 4, 32), e_q)
    torch.testing.assert_close(k_rot.view(n, 2, 32), e_k)
    q_w, k2 = agent._stash[NAME]
    torch.testing.assert_close(q_w, e_qw)
    assert torch.equal(k2, e_k2)  # un-rotated even though the inner op rotates in place


def test_rebuild_k2_of_loaded_blocks() -> None:
    """K loaded from a store (no K2 there): K2 = R(-p) K recovers the un-rotated keys."""
    agent, kv = _agent()
    cs = rope_cos_sin_cache(32, 256)
    agent.set_rotary(cs, True)
    kc, _ = cpu_kv_cache_views(kv)
    raw = torch.randn(32, 2, 32)
    kc[4] = apply_rope(raw[:16], torch.arange(16, 32), cs)  # prompt block 1 -> physical 4
    kc[2] = apply_rope(raw[16:], torch.arange(80, 96), cs)  # prompt block 5 -> physical 2
    agent.rebuild_k2(NAME, kv, torch.tensor([4, 2]), torch.tensor([16, 80]))
    k2 = agent.k2_caches[NAME]
    torch.testing.assert_close(k2[4], raw[:16], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k2[2], raw[16:], atol=1e-5, rtol=1e-5)
    assert not k2[0].any()
