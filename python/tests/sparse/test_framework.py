"""UcmSparseBase defaults, the factory, config parsing, the global agent and the
model info read from a vLLM config."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ucm.integration.vllm.sparse import state
from ucm.integration.vllm.sparse.model_info import sparse_model_info
from ucm.shared.config import ConfigError
from ucm.sparse import (
    INVALID_SLOT,
    AttentionCall,
    ESAConfig,
    GSAConfig,
    KVStarConfig,
    LayerRows,
    SparseModelInfo,
    UcmSparseBase,
    UcmSparseFactory,
    UcmSparseMetadata,
    UcmSparseRole,
    parse_sparse_config,
    sparse_config_from_connector,
)
from ucm.sparse.esa import ESA
from ucm.sparse.gsa import GSA
from ucm.sparse.kvstar import KVStar

INFO = SparseModelInfo(block_size=16, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=64)


class Recorder(UcmSparseBase):
    """A user method as in the original UCM's extension example."""

    def build_sparse_meta(self, scheduler_output, requests=None, input_batch=None, attn=None):
        meta = UcmSparseMetadata(step=scheduler_output)
        self.bind_sparse_metadata(meta)
        return meta

    def attention_begin(self, call):
        return call.replace(query=call.query * 2)


def test_base_defaults_pass_through() -> None:
    m = UcmSparseBase(INFO, UcmSparseRole.WORKER)
    q, k, v = torch.ones(2), torch.zeros(2), torch.ones(3)
    call = AttentionCall("l0", q, k, v)
    assert m.attention_begin(call) is call
    assert m.attention_finished(call) is None
    pos, h, r = torch.arange(3), torch.ones(3, 4), None
    rows = LayerRows(pos, h, r)
    assert m.layer_begin(0, rows) is rows and m.layer_finished(0, rows) is rows
    assert m.ffn_begin(h, r) == (h, r) and m.ffn_finished(h, r) == (h, r)
    idx = torch.tensor([1, 2])
    assert m.execute_finished(idx) is idx
    assert m.estimate_num_slots_sparsed(object()) == INVALID_SLOT
    assert m.allocate_slots(None, None, 5) is None
    assert not m.sparse_attention(call.replace(output=q))
    meta = m.build_sparse_meta(None)
    assert m.has_sparse_metadata() and m.sparse_metadata is meta
    m.clear_sparse_metadata()
    assert not m.has_sparse_metadata()
    for hook in ("request_begin", "request_finished_in_scheduler", "request_finished_in_worker"):
        assert getattr(m, hook)("r1", *([[]] if hook == "request_begin" else [])) is None


def test_model_info_from_duck_typed_vllm_config() -> None:
    class MC:
        max_model_len = 4096
        dtype = torch.bfloat16
        hf_config = type("H", (), {"max_position_embeddings": 2048})()

        def get_num_layers(self, pc):
            return 4

        def get_num_attention_heads(self, pc):
            return 32

        def get_num_kv_heads(self, pc):
            return 8

        def get_head_size(self):
            return 128

    class Cfg:
        model_config = MC()
        parallel_config = None
        cache_config = type("C", (), {"block_size": 32})()
        scheduler_config = type("S", (), {"max_num_seqs": 16})()

    info = sparse_model_info(Cfg())
    assert (info.block_size, info.num_layers, info.num_heads, info.num_kv_heads) == (32, 4, 32, 8)
    assert (info.head_dim, info.max_num_seqs, info.dtype) == (128, 16, torch.bfloat16)
    assert (info.max_model_len, info.device, info.max_position_embeddings) == (4096, "cpu", 2048)
    assert UcmSparseBase(info, UcmSparseRole.SCHEDULER).model_info is info
    del MC.hf_config  # a model config without one: the trained context is unknown
    assert sparse_model_info(Cfg()).max_position_embeddings is None


def test_factory_builtins_and_aliases() -> None:
    assert UcmSparseFactory.registered() == ["Blend", "ESA", "GSA", "KVStar", "ReRoPE"]
    assert UcmSparseFactory.get_class("ESA") is ESA
    assert UcmSparseFactory.get_class("GSAOnDevice") is GSA
    assert UcmSparseFactory.get_class("KVStarMultiStep") is KVStar
    m = UcmSparseFactory.create_sparse_method("ESA", INFO, UcmSparseRole.SCHEDULER, {})
    assert isinstance(m, ESA) and m.config == ESAConfig()
    with pytest.raises(ConfigError, match=r"unknown sparse method 'Nope'.*ESA, GSA, KVStar"):
        UcmSparseFactory.get_class("Nope")


def test_factory_registers_user_method(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    UcmSparseFactory.register_sparse_method("MySparse", __name__, "Recorder")
    try:
        with pytest.raises(ValueError, match="already registered"):
            UcmSparseFactory.register_sparse_method("MySparse", "x", "Y")
        with pytest.raises(ValueError, match="already registered"):
            UcmSparseFactory.register_sparse_method("GSAOnDevice", "x", "Y")
        spec = parse_sparse_config({"MySparse": {"anything": 1}})
        assert spec is not None and spec.config == {"anything": 1}  # no config_class: raw
        m = UcmSparseFactory.create_sparse_method("MySparse", INFO, UcmSparseRole.WORKER)
        assert isinstance(m, Recorder)
        assert m.build_sparse_meta(7).step == 7
        q = torch.ones(2)
        assert torch.equal(m.attention_begin(AttentionCall("l", q, q, q)).query, q * 2)
    finally:
        UcmSparseFactory.unregister_sparse_method("MySparse")


@pytest.mark.parametrize(
    ("class_name", "match"),
    [("dumps", "not a UcmSparseBase"), ("NoSuchClass", "has no class 'NoSuchClass'")],
)
def test_factory_rejects_a_bad_registration(class_name: str, match: str) -> None:
    UcmSparseFactory.register_sparse_method("Bad", "json", class_name)
    try:
        with pytest.raises(ConfigError, match=match):
            UcmSparseFactory.get_class("Bad")
    finally:
        UcmSparseFactory.unregister_sparse_method("Bad")


def test_parse_seed_yaml_shape() -> None:
    """The original UCM's YAML: ESA with sparse_ratio, local_window_sz, retrieval_stride."""
    spec = parse_sparse_config(
        {"ESA": {"sparse_ratio": 0.3, "local_window_sz": 2, "retrieval_stride": 5}}
    )
    assert spec is not None and spec.name == "ESA"
    assert spec.config == ESAConfig(sparse_ratio=0.3, local_window_sz=2, retrieval_stride=5)
    assert parse_sparse_config(None) is None and parse_sparse_config({}) is None
    extra = {"ucm_connectors": [], "ucm_sparse_config": {"GSAOnDevice": {}}}
    spec = sparse_config_from_connector(extra)
    assert spec is not None and spec.name == "GSA" and spec.config.topk_tokens == 2048
    assert sparse_config_from_connector({"use_layerwise": True}) is None
    spec = parse_sparse_config({"KVStar": {"sparse_ratio": "0.5", "retrieval_stride": "4"}})
    assert spec is not None and spec.config.sparse_ratio == 0.5  # strings from env/YAML
    assert spec.config.retrieval_stride == 4


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ({"ESA": {"sparse_ratio": 1.5}}, r"ucm_sparse_config\.ESA\.sparse_ratio: must be in"),
        ({"ESA": {"sparse_ratio": "x"}}, r"sparse_ratio \(ucm_sparse_config\.ESA\): expected"),
        ({"ESA": {"retrieval_stride": 0}}, r"ucm_sparse_config\.ESA\.retrieval_stride"),
        ({"ESA": {"local_window_sz": 0}}, r"ESA\.local_window_sz: must be >= 1"),
        ({"ESA": {"bogus": 1}}, r"unknown config key 'bogus' \(ucm_sparse_config\.ESA\)"),
        ({"GSA": {"rollback_layers": [-1]}}, r"GSA\.rollback_layers\[0\]: must be >= 0"),
        ({"ESA": 3}, r"ucm_sparse_config\.ESA: expected a mapping"),
        ({"GSA": {"topk_tokens": 64, "sparse_ratio": 0.2}}, r"GSA\.topk_tokens: give either"),
        ({"GSA": {"topk_tokens": 4096}}, r"GSA\.seq_len_threshold: must be >= topk_tokens"),
        ({"GSA": {"hash_bits": 48}}, r"GSA\.hash_bits: must be a power of two"),
        ({"GSA": {"skip_layers": [0]}}, r"GSA\.skip_layers: layer 0"),
        ({"GSA": {"rollback_layers": [1], "skip_layers": [1]}}, r"also a rollback layer"),
        ({"GSA": {"recent_blocks": 0}}, r"GSA\.recent_blocks: must be >= 1"),
        ({"KVStar": {"blk_repre_dim_prune_ratio": 0}}, r"KVStar\.blk_repre_dim_prune_ratio"),
        ({"KVStar": {"blk_repre_inner_token_merge": 0}}, r"blk_repre_inner_token_merge"),
        ({"ESA": {}, "GSA": {}}, r"exactly one method"),
        ({"Quest": {}}, r"unknown sparse method 'Quest'"),
    ],
)
def test_config_errors_name_the_key(raw: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_sparse_config(raw)


def test_config_defaults() -> None:
    assert ESAConfig() == ESAConfig(0.3, 5, 1, 2, 4)
    k = KVStarConfig()
    assert (k.sparse_ratio, k.retrieval_stride, k.blk_repre_inner_token_merge) == (0.25, 8, 2)
    g = GSAConfig(sparse_ratio=0.2)
    assert g.topk_tokens is None and g.sink_blocks == 1 and g.recent_blocks == 4


def test_global_agent_lifecycle() -> None:
    assert not state.has_ucm_sparse()
    with pytest.raises(RuntimeError):
        state.get_ucm_sparse()
    assert state.ensure_ucm_sparse_initialized(INFO, UcmSparseRole.WORKER, None) is None
    spec = parse_sparse_config({"ESA": {"async_retrieval": True}})
    try:
        a = state.ensure_ucm_sparse_initialized(INFO, UcmSparseRole.WORKER, spec)
        assert state.has_ucm_sparse() and state.get_ucm_sparse() is a
        assert state.ensure_ucm_sparse_initialized(INFO, UcmSparseRole.WORKER, spec) is a
    finally:
        state.shutdown_ucm_sparse()
    assert not state.has_ucm_sparse()


def test_import_without_triton() -> None:
    """``import ucm.sparse`` and every op work (torch fallback) when triton is missing."""
    code = textwrap.dedent(
        """
        import sys
        sys.modules["triton"] = None  # "import triton" raises ImportError
        import torch
        import ucm.sparse
        from ucm.sparse.kernels import attention, selection
        from ucm.sparse.kernels.dispatch import triton_usable
        assert not ucm.sparse.HAS_TRITON and not triton_usable(torch.zeros(1))
        k = torch.randn(4, 16, 2, 64)
        reps = selection.block_representatives(k, torch.tensor([0, 1]), torch.tensor([16, 3]))
        assert reps.shape == (2, 1, 2, 64)
        out = attention.paged_decode_attention(torch.randn(1, 8, 64), k, k,
                                         torch.tensor([[0, 1]]), torch.tensor([20]))
        assert out.shape == (1, 8, 64)
        try:
            attention.paged_decode_attention(torch.randn(1, 8, 64), k, k, torch.tensor([[0]]),
                                       torch.tensor([3]), impl="triton")
        except RuntimeError as e:
            assert "not installed" in str(e)
        else:
            raise AssertionError("expected RuntimeError")
        import ucm.sparse.esa, ucm.sparse.gsa, ucm.sparse.kvstar
        print("ok")
        """
    )
    env_path = str(Path(__file__).resolve().parents[2])
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"},
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_kernels_compile_for_sm90(tmp_path: Path) -> None:
    """Every kernel lowers to a cubin for H100 (no GPU needed; ptxas ships with triton)."""
    pytest.importorskip("triton")
    script = Path(__file__).with_name("cuda_compile_check.py")
    env = {
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
        "PATH": "/usr/bin:/bin",
        "TRITON_CACHE_DIR": str(tmp_path / "triton-cache"),
        "HOME": str(tmp_path),
    }
    r = subprocess.run(
        [sys.executable, str(script), "90"], capture_output=True, text=True, timeout=300, env=env
    )
    if r.returncode != 0 and ("ptxas" in r.stderr and "not found" in r.stderr):
        pytest.skip("ptxas is not available")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "compiled 8 kernels for sm_90" in r.stdout
