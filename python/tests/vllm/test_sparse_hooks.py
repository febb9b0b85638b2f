"""The per-instance hook wrappers (with stand-ins for vLLM objects) and their version gate."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ucm.integration.vllm.compat import UnsupportedVllmError
from ucm.integration.vllm.sparse import hooks as vllm_hooks
from ucm.integration.vllm.sparse import state
from ucm.integration.vllm.sparse.hooks import install_scheduler_hooks, install_worker_hooks
from ucm.sparse import AttentionCall, SparseModelInfo, UcmSparseBase, UcmSparseRole

INFO = SparseModelInfo(block_size=16, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)
OK = "0.32.0+cpu"


@pytest.mark.parametrize("v", ["0.11.0", "0.31.9", "0.34.0", "1.0.0"])
def test_unsupported_versions_are_refused_before_anything_is_wrapped(
    v: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("UCM_ALLOW_UNSUPPORTED_VLLM", raising=False)
    agent = UcmSparseBase(INFO, UcmSparseRole.WORKER)
    match = rf"UCM sparse attention.*supports vLLM 0\.32\.x, 0\.33\.x; the installed vLLM is {v}"
    with pytest.raises(UnsupportedVllmError, match=match):
        install_worker_hooks({}, agent, version=v)
    with pytest.raises(UnsupportedVllmError, match=match):
        install_scheduler_hooks(SimpleNamespace(allocate_slots=lambda *a: None), version=v)


class Impl:
    def __init__(self) -> None:
        self.calls = 0

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None, **kw):
        self.calls += 1
        output.fill_(1.0)
        return output


class Agent(UcmSparseBase):
    def __init__(self, take_over: bool) -> None:
        super().__init__(INFO, UcmSparseRole.WORKER)
        self.take_over = take_over
        self.events: list[str] = []

    def attention_begin(self, call: AttentionCall) -> AttentionCall:
        self.events.append(f"begin:{call.layer_name}")
        return call

    def sparse_attention(self, call: AttentionCall) -> bool:
        self.events.append(f"sparse:{call.layer_name}")
        if self.take_over:
            call.output.fill_(2.0)
        return self.take_over

    def attention_finished(self, call: AttentionCall) -> None:
        self.events.append(f"finished:{call.layer_name}:{float(call.output[0])}")


def _layers() -> dict[str, SimpleNamespace]:
    return {f"model.layers.{i}.self_attn.attn": SimpleNamespace(impl=Impl()) for i in range(2)}


@pytest.mark.parametrize("take_over", [False, True])
def test_worker_hooks_wrap_each_layer_and_uninstall(take_over: bool) -> None:
    layers = _layers()
    agent = Agent(take_over)
    state.set_ucm_sparse(agent)
    try:
        handle = install_worker_hooks(layers, agent, version=OK)
        again = install_worker_hooks(layers, agent, version=OK)  # idempotent: nothing rewrapped
        assert again._undo == []
        name, layer = next(iter(layers.items()))
        assert vllm_hooks.is_wrapped(layer.impl.forward)
        out = torch.zeros(3)
        r = layer.impl.forward(layer, torch.ones(3), None, None, None, object(), out)
        assert float(r[0]) == (2.0 if take_over else 1.0)
        assert layer.impl.calls == (0 if take_over else 1)
        assert agent.events == [f"begin:{name}", f"sparse:{name}", f"finished:{name}:{r[0]}"]
        # no metadata (profile / dummy run): straight to the backend, no hooks
        agent.events.clear()
        layer.impl.forward(layer, torch.ones(3), None, None, None, None, torch.zeros(3))
        assert agent.events == []
        handle.uninstall()
        handle.uninstall()
        assert all(not vllm_hooks.is_wrapped(x.impl.forward) for x in layers.values())
        assert "forward" not in layer.impl.__dict__  # the class method is back
    finally:
        state.set_ucm_sparse(None)


def test_worker_hooks_without_agent_are_pass_through() -> None:
    layers = _layers()
    handle = install_worker_hooks(layers, Agent(True), version=OK)
    layer = next(iter(layers.values()))
    out = layer.impl.forward(layer, torch.ones(3), None, None, None, object(), torch.zeros(3))
    assert float(out[0]) == 1.0  # no agent in this process: backend only
    handle.uninstall()


def test_methods_needing_layer_patches_are_refused() -> None:
    class Blendish(UcmSparseBase):
        def ffn_begin(self, hidden_states, residual):
            return hidden_states, residual

    with pytest.raises(NotImplementedError, match="ffn_begin"):
        install_worker_hooks({}, Blendish(INFO, UcmSparseRole.WORKER), version=OK)


class Manager:
    def __init__(self) -> None:
        self.dense_calls: list[int] = []

    def allocate_slots(self, request, num_new_tokens, num_new_computed_tokens=0):
        self.dense_calls.append(num_new_tokens)
        return "dense-blocks"


class Budget(UcmSparseBase):
    def estimate_num_slots_sparsed(self, request) -> int:
        return 100 if request.sparse else -1

    def allocate_slots(self, kv_cache_manager, request, num_slots_sparsed):
        return ("sparse-blocks", kv_cache_manager, num_slots_sparsed)


def test_scheduler_hook_routes_allocation_and_uninstalls() -> None:
    m = Manager()
    state.set_ucm_sparse(Budget(INFO, UcmSparseRole.SCHEDULER))
    try:
        handle = install_scheduler_hooks(m, version=OK)
        assert m.allocate_slots(SimpleNamespace(sparse=False), 7) == "dense-blocks"
        assert m.allocate_slots(SimpleNamespace(sparse=True), 1) == ("sparse-blocks", m, 100)
        assert m.dense_calls == [7]
        handle.uninstall()
        assert "allocate_slots" not in m.__dict__
        assert m.allocate_slots(SimpleNamespace(sparse=True), 3) == "dense-blocks"
    finally:
        state.set_ucm_sparse(None)
