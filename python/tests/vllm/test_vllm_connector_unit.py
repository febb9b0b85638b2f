"""The connector's two halves against a real store, without starting vLLM.

The scheduler side plans with fake requests and scheduler outputs; the worker
side moves bytes between a fake paged KV cache (vLLM's CPU layout) and the
store. Covers both modes, host staging (the GPU path), the asynchronous save
protocol, preemption, load failures and an unusable store.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from support import store_debug

from ucm.integration.vllm.config import resolve_config
from ucm.integration.vllm.rank_keys import RankKeys, rank_keys
from ucm.integration.vllm.scheduler import KVGeometry, UCMSchedulerSide
from ucm.integration.vllm.store_handle import StoreUnavailableError
from ucm.integration.vllm.worker import UCMWorkerSide

L, NB, H, BS, C = 3, 24, 2, 32, 64  # layers, vLLM blocks, KV heads, tokens/block, 2*head_dim
SHARD = H * BS * C * 4


@dataclass
class FakeRequest:
    request_id: str
    tokens: list[int]
    num_computed_tokens: int = 0
    mm_features: list[Any] = field(default_factory=list)
    prompt_embeds: Any = None
    lora_request: Any = None
    cache_salt: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def all_token_ids(self) -> list[int]:
        return self.tokens


class FakeKVManager:
    def __init__(self) -> None:
        self.blocks: dict[str, list[int]] = {}

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        return (self.blocks[req_id],)


def sched_output(
    new: list[tuple[str, int, int]] = (),
    cached: list[tuple[str, int, int]] = (),
    finished: set[str] = frozenset(),
    preempted: set[str] = frozenset(),
) -> Any:
    """new/cached: (req_id, num_computed_tokens, num_scheduled_tokens)."""
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id=r, num_computed_tokens=c, block_ids=None) for r, c, _ in new
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _, _ in cached], num_computed_tokens=[c for _, c, _ in cached]
        ),
        num_scheduled_tokens={r: n for r, _, n in [*new, *cached]},
        total_num_scheduled_tokens=sum(n for _, _, n in [*new, *cached]),
        finished_req_ids=set(finished),
        preempted_req_ids=set(preempted),
    )


class Side:
    """A scheduler half and a worker half over one fake KV cache."""

    def __init__(self, store: Path | dict[str, Any], **extra: Any) -> None:
        """``store``: a Posix store's directory, or a whole store config."""
        keys = store if isinstance(store, dict) else {
            "storage_backends": str(store), "store_pipeline": "Posix"
        }  # fmt: skip
        cfg = resolve_config({**keys, **extra}, env={})
        self.geom = KVGeometry(
            block_size=BS, shard_bytes=SHARD, num_layers=L, meta="unit-test", is_mla=False,
            tp_size=1,
        )  # fmt: skip
        self.sched = UCMSchedulerSide(None, None, cfg, self.geom)
        self.kvm = FakeKVManager()
        self.sched._kv_cache_manager = self.kvm
        self.worker = UCMWorkerSide(None, SimpleNamespace(num_blocks=NB), cfg, self.geom)
        self.kv = torch.zeros(L, NB, H, BS, C)
        self.worker.register_kv_caches(
            {f"model.layers.{i}.self_attn.attn": self.kv[i] for i in range(L)}
        )
        self.layerwise = cfg.connector.use_layerwise

    def admit(self, req: FakeRequest, blocks: list[int], local_tokens: int = 0) -> int:
        ext, is_async = self.sched.get_num_new_matched_tokens(req, local_tokens)
        assert is_async is False
        self.kvm.blocks[req.request_id] = blocks
        self.sched.update_state_after_alloc(req, None, ext)
        req.num_computed_tokens = local_tokens + ext
        return ext

    def step(self, so: Any, finished: set[str] = frozenset()) -> tuple[Any, set[str] | None]:
        """One engine step as vLLM's model runner drives the worker."""
        meta = self.sched.build_connector_meta(so)
        w = self.worker
        w.handle_preemptions(meta)
        w.bind(meta)
        w.start_load_kv()
        for i in range(L):  # the forward pass
            name = f"model.layers.{i}.self_attn.attn"
            w.wait_for_layer_load(name)
            w.save_kv_layer(name)
        w.wait_for_save()
        done, _ = w.get_finished(set(finished))
        errors = w.get_block_ids_with_load_errors()
        self.sched.update_connector_output(SimpleNamespace(invalid_block_ids=errors))
        w.clear()
        return meta, done

    def close(self) -> None:
        self.worker.shutdown()
        self.sched.shutdown()


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 30000) for _ in range(n)]


def save_prompt(side: Side, req_id: str, toks: list[int], blocks: list[int]) -> None:
    """Prefills a request (filling its KV with data) and finishes it."""
    req = FakeRequest(req_id, toks)
    assert side.admit(req, blocks) == 0
    for b in blocks:
        side.kv[:, b] = torch.randn(L, H, BS, C)
    meta, _ = side.step(sched_output(new=[(req_id, 0, len(toks))]))
    n_full = len(toks) // BS
    assert [t.save_from for t in meta.requests] == [blocks[:n_full]]
    delay, _ = side.sched.request_finished(req, blocks)
    assert delay is True  # blocks stay allocated until the saves are done
    done: set[str] = set()
    for _ in range(200):
        _, d = side.step(sched_output(finished={req_id} if not done else set()), {req_id})
        done |= d or set()
        if req_id in done:
            break
        time.sleep(0.01)
    assert done == {req_id}


@pytest.mark.parametrize(
    "writer,reader",
    [
        ({"use_layerwise": False}, {"use_layerwise": True}),
        ({"use_layerwise": True}, {"use_layerwise": False}),
        ({"use_layerwise": False}, {"use_layerwise": True, "layerwise_lookahead": 1}),
        ({"force_host_staging": True}, {"force_host_staging": True, "use_layerwise": True}),
    ],
    ids=["whole-step->layer-wise", "layer-wise->whole-step", "lookahead-1", "host-staging"],
)
def test_save_then_load_in_another_engine(tmp_path: Path, writer: dict, reader: dict) -> None:
    a = Side(tmp_path, **writer)
    toks = tokens(5 * BS + 7, 1)
    save_prompt(a, "r1", toks, [3, 9, 4, 11, 12, 20])
    a.close()

    b = Side(tmp_path, **reader)
    req = FakeRequest("r2", list(toks))
    assert b.admit(req, [1, 2, 5, 6, 7, 8]) == 5 * BS
    meta, _ = b.step(sched_output(new=[("r2", 5 * BS, 7)]))
    assert meta.requests[0].load_into == [1, 2, 5, 6, 7]
    assert meta.requests[0].save_keys == []
    for src, dst in zip([3, 9, 4, 11, 12], [1, 2, 5, 6, 7], strict=True):
        assert torch.equal(b.kv[:, dst], a.kv[:, src])
    assert b.kv[:, 8].abs().sum() == 0
    stats = b.worker.get_kv_connector_stats()
    assert stats is not None and stats.data["load_blocks"] == 5
    assert stats.data["load_bytes"] == 5 * L * SHARD
    s = b.sched.get_kv_connector_stats()
    assert s is not None and s.data["lookup_hit_tokens"] == 5 * BS
    b.close()


def test_full_hit_leaves_one_token_and_local_hits_are_skipped(tmp_path: Path) -> None:
    a = Side(tmp_path)
    toks = tokens(4 * BS, 2)
    save_prompt(a, "r1", toks, [0, 1, 2, 3])
    # Same engine, vLLM's prefix cache has the first 2 blocks: load blocks 2-3 only,
    # and the last token is left to compute.
    req = FakeRequest("r2", list(toks))
    ext = a.admit(req, [0, 1, 5, 6], local_tokens=2 * BS)
    assert ext == 2 * BS - 1
    meta, _ = a.step(sched_output(new=[("r2", 4 * BS - 1, 1)]))
    assert meta.requests[0].load_into == [5, 6]
    assert torch.equal(a.kv[:, 5], a.kv[:, 2])
    # Sub-block prompt: nothing to hash, nothing to load or save.
    short = FakeRequest("r3", tokens(BS - 1, 3))
    assert a.admit(short, [7]) == 0
    meta, _ = a.step(sched_output(new=[("r3", 0, BS - 1)]))
    assert meta.requests == []
    a.close()


def start_full_hit_load(side: Side, toks: list[int], blocks: list[int], others: int = 0) -> Any:
    """Admits a block-aligned prompt that is all in the store, binds its
    first step and starts its loads (vLLM then runs the forward). ``others``:
    tokens that requests without transfers compute in the same step."""
    req = FakeRequest("r2", list(toks))
    assert side.admit(req, blocks) == len(toks) - 1
    so = sched_output(new=[("r2", len(toks) - 1, 1)])
    so.total_num_scheduled_tokens += others
    meta = side.sched.build_connector_meta(so)
    side.worker.bind(meta)
    side.worker.start_load_kv()
    return side.worker


@pytest.mark.parametrize("lookahead", [0, 1])
def test_layerwise_loads_the_block_vllm_writes_before_the_forward(
    tmp_path: Path, lookahead: int
) -> None:
    """vLLM writes a layer's new KV before it waits for that layer's load; in
    a full hit that write lands in the last loaded block, so that block must
    be in place (every layer) when start_load_kv returns, and no later load
    may overwrite the write."""
    a = Side(tmp_path)
    toks = tokens(4 * BS, 8)
    save_prompt(a, "r1", toks, [0, 1, 2, 3])
    a.close()
    b = Side(tmp_path, use_layerwise=True, layerwise_lookahead=lookahead)
    # Other requests compute in the same step, so it loads layer by layer.
    w = start_full_hit_load(b, toks, [10, 11, 12, 13], others=2 * BS)
    assert torch.equal(b.kv[:, 13], a.kv[:, 3])  # before any layer wait
    written = torch.full((H, C), 7.0)
    for i in range(L):
        b.kv[i, 13, :, BS - 1] = written  # the KV write of the computed token
        w.wait_for_layer_load(f"model.layers.{i}.self_attn.attn")
        assert torch.equal(b.kv[i, 13, :, BS - 1], written), f"layer {i}"
    w.wait_for_save()
    assert w.get_block_ids_with_load_errors() == set()
    for src, dst in zip([0, 1, 2], [10, 11, 12], strict=True):
        assert torch.equal(b.kv[:, dst], a.kv[:, src])
    stats = w.get_kv_connector_stats()
    assert stats is not None and stats.data["load_blocks"] == 4
    # The last block's load, then one load per layer.
    assert len(stats.data["load_durations_ms"]) == 1 + L
    w.clear()
    b.close()


def test_a_layerwise_step_with_nothing_to_compute_loads_whole_step(tmp_path: Path) -> None:
    """A prompt that is all hits but its last token, alone in its step: no
    compute to hide per-layer loads behind, so everything is loaded (one
    load, every layer) before the forward starts."""
    a = Side(tmp_path)
    toks = tokens(4 * BS, 9)
    save_prompt(a, "r1", toks, [0, 1, 2, 3])
    a.close()
    b = Side(tmp_path, use_layerwise=True)
    w = start_full_hit_load(b, toks, [10, 11, 12, 13], others=BS - 2)
    for src, dst in zip([0, 1, 2, 3], [10, 11, 12, 13], strict=True):
        assert torch.equal(b.kv[:, dst], a.kv[:, src])  # before any layer wait
    for i in range(L):
        w.wait_for_layer_load(f"model.layers.{i}.self_attn.attn")
    w.wait_for_save()
    assert w.get_block_ids_with_load_errors() == set()
    stats = w.get_kv_connector_stats()
    assert stats is not None and stats.data["load_blocks"] == 4
    assert len(stats.data["load_durations_ms"]) == 1
    w.clear()
    b.close()


def test_partial_overlap_and_salts(tmp_path: Path) -> None:
    a = Side(tmp_path)
    toks = tokens(6 * BS, 4)
    save_prompt(a, "r1", toks, [0, 1, 2, 3, 4, 5])
    other = toks[: 4 * BS] + tokens(2 * BS, 5)
    assert a.admit(FakeRequest("r2", other), [6, 7, 8, 9, 10, 11]) == 4 * BS
    salted = FakeRequest("r3", list(toks), cache_salt="tenant-b")
    assert a.admit(salted, [12, 13, 14, 15, 16, 17]) == 0
    a.close()
    b = Side(tmp_path, hash_salt="another-deployment")
    assert b.admit(FakeRequest("r4", list(toks)), [0, 1, 2, 3, 4, 5]) == 0
    b.close()


@pytest.mark.parametrize("lookahead", [0, 1])
def test_corrupt_block_is_reported_and_saved_again(tmp_path: Path, lookahead: int) -> None:
    a = Side(tmp_path)
    toks = tokens(4 * BS, 6)
    save_prompt(a, "r1", toks, [0, 1, 2, 3])
    a.close()
    # Corrupt the third block's file.
    ids = a.sched.store_keys(FakeRequest("x", toks))
    path = Path(store_debug.block_path(a.sched.store.get(), ids[2]))
    raw = bytearray(path.read_bytes())
    raw[4096 + 100] ^= 0xFF
    path.write_bytes(bytes(raw))

    b = Side(tmp_path, use_layerwise=True, layerwise_lookahead=lookahead)
    w = start_full_hit_load(b, toks, [10, 11, 12, 13], others=2 * BS)
    for i in range(L):
        w.wait_for_layer_load(f"model.layers.{i}.self_attn.attn")
    w.wait_for_save()
    errors = w.get_block_ids_with_load_errors()
    if lookahead == 0:
        # Every layer's load was in flight when the failure was seen: blocks
        # before the corrupt one were loaded in all layers.
        assert errors == {12, 13}  # from the corrupt block on: vLLM recomputes them
    else:
        # The failure stopped the later layers' loads: blocks 10 and 11 have
        # only their first layer, so they are reported too.
        assert errors == {10, 11, 12, 13}
    b.sched.update_connector_output(SimpleNamespace(invalid_block_ids=errors))
    stats = w.get_kv_connector_stats()
    assert stats is not None and stats.data["load_failed_blocks"] == len(errors)
    w.clear()
    # vLLM rewinds the request to the first failed block and recomputes: the
    # recomputed blocks are saved again (the corrupt one was removed).
    first = min(errors) - 10
    meta, _ = b.step(sched_output(cached=[("r2", first * BS, (4 - first) * BS)]))
    assert meta.requests[0].save_from == sorted(errors)
    b.close()


def test_preemption_waits_for_saves_and_finish_is_reported_once(tmp_path: Path) -> None:
    a = Side(tmp_path)
    req = FakeRequest("r1", tokens(3 * BS, 7))
    a.admit(req, [0, 1, 2])
    meta, _ = a.step(sched_output(new=[("r1", 0, 3 * BS)]))
    assert meta.has_saves
    a.step(sched_output(preempted={"r1"}))
    assert a.worker.saves.pending("r1") == 0  # waited in handle_preemptions
    delay, _ = a.sched.request_finished(req, [0, 1, 2])
    assert delay is True
    _, done = a.step(sched_output(finished={"r1"}), {"r1"})
    assert done == {"r1"}
    _, done = a.step(sched_output(), set())
    assert done is None
    # A request that never saved is freed at once.
    req2 = FakeRequest("r2", tokens(BS - 3, 8))
    a.admit(req2, [5])
    a.step(sched_output(new=[("r2", 0, BS - 3)]))
    assert a.sched.request_finished(req2, [5]) == (False, None)
    a.close()


def test_a_store_that_cant_be_opened_refuses_the_start(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(StoreUnavailableError) as e:
        Side(blocker / "store")
    msg = str(e.value)
    assert "can't be opened" in msg and str(blocker / "store") in msg
    assert "Fix: make" in msg and "allow_degraded: true" in msg


def test_unusable_store_serves_without_caching(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    a = Side(
        blocker / "store", allow_degraded=True, store_retry_interval_s=0.05, warning_interval_s=0
    )
    assert a.sched.store.degraded and a.worker.store.degraded
    assert a.sched.store.get() is None
    req = FakeRequest("r1", tokens(3 * BS, 9))
    assert a.admit(req, [0, 1, 2]) == 0
    a.step(sched_output(new=[("r1", 0, 3 * BS)]))
    stats = a.worker.get_kv_connector_stats()
    assert stats is not None
    assert stats.data["store_healthy"] == 0
    assert stats.data["save_skipped_blocks"] == 3
    assert stats.data["store_errors"] >= 1
    assert stats.data["store_degraded"] == 1
    s = a.sched.get_kv_connector_stats()
    assert s is not None and s.data["store_healthy"] == 0 and s.data["store_degraded"] == 1
    # The directory becomes possible: the store opens and is no longer degraded.
    blocker.unlink()
    time.sleep(0.2)
    assert a.sched.store.get() is not None and not a.sched.store.degraded
    s = a.sched.get_kv_connector_stats()
    assert s is not None and s.data.get("store_degraded", 0) == 0
    a.close()


def test_metadata_is_picklable() -> None:
    import pickle

    from ucm.integration.vllm.metadata import ReqTransfer, UCMConnectorMetadata

    m = UCMConnectorMetadata(
        requests=[ReqTransfer("r", [b"x" * 16], [1], [], [])], preempted_req_ids={"p"}
    )
    m2 = pickle.loads(pickle.dumps(m))
    assert m2.requests[0].load_into == [1] and m2.has_loads and not m2.has_saves
    assert np.array([1]).dtype  # numpy stays importable alongside


def test_consumer_only_and_producer_only_roles(tmp_path: Path) -> None:
    a = Side(tmp_path)
    toks = tokens(3 * BS, 11)
    save_prompt(a, "r1", toks, [0, 1, 2])
    a.close()
    b = Side(tmp_path)
    b.sched.save_enabled = False  # kv_consumer
    req = FakeRequest("r2", toks + tokens(2 * BS, 12))
    assert b.admit(req, [3, 4, 5, 6, 7]) == 3 * BS
    meta, _ = b.step(sched_output(new=[("r2", 3 * BS, 2 * BS)]))
    assert meta.requests[0].load_into == [3, 4, 5] and meta.requests[0].save_keys == []
    b.sched.load_enabled, b.sched.save_enabled = False, True  # kv_producer
    assert b.admit(FakeRequest("r3", list(toks)), [8, 9, 10]) == 0
    b.close()


def test_workers_unable_to_load_stop_the_hits(tmp_path: Path) -> None:
    a = Side(tmp_path)
    toks = tokens(3 * BS, 13)
    save_prompt(a, "r1", toks, [0, 1, 2])
    a.close()
    b = Side(tmp_path, store_retry_interval_s=60)
    # The worker's store is unusable (e.g. its process can't reach the directory).
    b.worker.store.report_failure(OSError("EIO"), "test")
    req = FakeRequest("r2", list(toks))
    assert b.admit(req, [3, 4, 5]) == 3 * BS - 1
    meta = b.sched.build_connector_meta(sched_output(new=[("r2", 3 * BS - 1, 1)]))
    w = b.worker
    w.bind(meta)
    w.start_load_kv()
    w.wait_for_save()
    errors = w.get_block_ids_with_load_errors()
    assert errors == {3, 4, 5}
    stats = w.get_kv_connector_stats()
    b.sched.update_connector_output(
        SimpleNamespace(invalid_block_ids=errors, kv_connector_stats=stats)
    )
    w.clear()
    assert b.admit(FakeRequest("r3", list(toks)), [6, 7, 8]) == 0  # no more promises
    b.close()


def test_tensor_parallel_ranks_and_mla(tmp_path: Path) -> None:
    toks = tokens(2 * BS, 14)
    # Rank 1 of a TP group saves its heads under its own keys ...
    a = Side(tmp_path)
    a.worker.tp_rank, a.worker.rank_keys = 1, RankKeys(1)
    req = FakeRequest("r1", toks)
    a.admit(req, [0, 1])
    a.kv[:, :2] = torch.randn(L, 2, H, BS, C)
    a.step(sched_output(new=[("r1", 0, 2 * BS)]))
    a.worker.wait_for_saves(None, 10)
    rank0_ids = a.sched.store_keys(req)
    store = a.worker.store.get()
    assert store.lookup(rank0_ids) == [False, False]
    assert store.lookup(rank_keys(rank0_ids, 1)) == [True, True]
    a.close()
    # ... and MLA (replicated KV): only rank 0 writes, every rank reports its finish.
    b = Side(tmp_path / "mla")
    b.worker.tp_rank, b.worker.rank_keys, b.worker.is_writer = 1, RankKeys(0), False
    req = FakeRequest("r2", toks)
    b.admit(req, [0, 1])
    b.step(sched_output(new=[("r2", 0, 2 * BS)]))
    assert b.sched.request_finished(req, [0, 1]) == (True, None)
    _, done = b.step(sched_output(finished={"r2"}), {"r2"})
    assert done == {"r2"}
    assert b.worker.store.get().lookup(b.sched.store_keys(req)) == [False, False]
    b.close()
