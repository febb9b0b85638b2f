"""Tensor parallel end to end on real vLLM (CPU build, ``tensor_parallel_size=2``).

A tiny random-weight GQA Llama (float32, 8 query / 4 KV heads, 3 layers, so
each TP=2 rank holds 2 KV heads), greedy, one Posix store directory:

* REF: TP=1, no connector: the expected tokens (TP=2 gives the same tokens
  on this model in float32; A's cold run checks it);
* A (TP=2, whole-step) serves the prompts cold and saves them;
* B (TP=2, layer-wise, a new process) gets store hits for every full block,
  each rank loading its own keys, and gives REF's tokens;
* the store: two files per block (rank 0 under the scheduler's ids, rank 1
  under ``rank_keys(ids, 1)``), each the size of half the KV heads, and each
  rank's shards equal to its half of the heads of the TP=1 KV;
* B again, after one rank-1 file of a block was removed: only rank 0's keys
  are looked up, so rank 1's load fails; vLLM recomputes, rank 1 re-saves;
* C (TP=1, the same store) hits none of the TP=2 blocks (other hash meta)
  and gives REF's tokens;
* a TP=2 MLA model (DeepSeek-V2 shaped): the replicated latent KV is saved
  once (rank 0) and loaded by both ranks.

vLLM's CPU build runs TP>1 with the multiprocessing executor (one worker
process per rank, a shared-memory communicator). Its automatic thread
binding wants one NUMA node per rank, so the engines here bind one CPU per
rank explicitly (``VLLM_CPU_OMP_THREADS_BIND``).
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.engines import record_reference

from ucm.integration.vllm.rank_keys import rank_keys

BS = 32
MAX_TOKENS = 8
LAYERS, HEADS, KV_HEADS, HIDDEN = 3, 8, 4, 256
HEAD_DIM = HIDDEN // HEADS
HEADER = 4096  # Posix block file: every shard region is a 4 KiB header, then the data


def shard_bytes(kv_heads: int) -> int:
    """One block of one layer on the CPU backend: [heads, BS, 2 * head_dim] float32."""
    return kv_heads * BS * 2 * HEAD_DIM * 4


def tp2_env() -> dict[str, str]:
    """One CPU per rank (the automatic binding asserts one NUMA node per rank)."""
    cpus = sorted(os.sched_getaffinity(0))
    bind = f"{cpus[0]}|{cpus[1]}" if len(cpus) >= 2 else "nobind"
    return {"VLLM_CPU_OMP_THREADS_BIND": bind, "OMP_NUM_THREADS": "1"}


def _rand(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(4, 500) for _ in range(n)]


def make_prompts() -> dict[str, list[list[int]]]:
    rng = random.Random(4321)
    p_long = _rand(rng, 300)  # 9 full blocks + 12 tokens
    return {
        # 9 + 3 (block-aligned) + 0 (shorter than a block) + 6 full blocks
        "batch": [p_long, _rand(rng, 96), _rand(rng, 20), _rand(rng, 200)],
        # 5 blocks shared with p_long, then 1 new full block
        "overlap": [p_long[: 5 * BS] + _rand(rng, 50)],
        # served alone; later one of its rank-1 files is removed
        "torn": [_rand(rng, 5 * BS + 7)],
    }


def full_blocks(prompts: list[list[int]]) -> int:
    return sum(len(p) // BS for p in prompts)


def block_files(root: Path) -> dict[str, Path]:
    """Published block files of a Posix store directory, by hex id."""
    return {
        f.name: f
        for f in root.glob("??/*")
        if f.is_file() and len(f.name) == 32 and all(c in "0123456789abcdef" for c in f.name)
    }


def shards(path: Path, kv_heads: int) -> list[np.ndarray]:
    """The per-layer shards of a block file, as float32 ``[kv_heads, BS * 2 * head_dim]``."""
    data = path.read_bytes()
    size = shard_bytes(kv_heads)
    stride = HEADER + size  # sizes here are multiples of 4 KiB: no padding
    assert len(data) == LAYERS * stride, f"{path.name}: {len(data)} bytes"
    return [
        np.frombuffer(data, np.float32, size // 4, i * stride + HEADER).reshape(kv_heads, -1)
        for i in range(LAYERS)
    ]


def wait_for_files(root: Path, n: int, timeout: float = 30.0) -> dict[str, Path]:
    """The store's files once there are ``n`` (saves finish after the request)."""
    deadline = time.monotonic() + timeout
    while len(files := block_files(root)) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    return files


def rank_pairs(files: set[str]) -> list[tuple[str, str]]:
    """(rank 0 key, rank 1 key) of every block: rank 0's file is the
    scheduler's id, rank 1's ``rank_keys(id, 1)``."""
    return sorted(
        (k, r1) for k in files if (r1 := rank_keys([bytes.fromhex(k)], 1)[0].hex()) in files
    )


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from ucm.vllm_demo.tiny_model import TinyModelSpec, make_tiny_llama

    spec = TinyModelSpec(
        layers=LAYERS, hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, intermediate=512
    )
    assert spec.head_dim == HEAD_DIM and KV_HEADS % 2 == 0
    root = tmp_path_factory.mktemp("ucm-tp")
    store = root / "store"
    store.mkdir()
    return {
        "model": str(make_tiny_llama(root / "model", spec)),
        "store": store,
        "prompts": make_prompts(),
        "ref": {},
    }


def engine_cfg(world: dict[str, Any], tp: int, **ucm: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {"model": world["model"], "llm": {"tensor_parallel_size": tp}}
    if ucm:
        cfg["ucm"] = {"storage_backends": str(world["store"]), "store_pipeline": "Posix", **ucm}
    return cfg


def test_reference_tp1_no_connector(world: dict[str, Any], engines: Any) -> None:
    record_reference(engines("ref", engine_cfg(world, 1)), world, MAX_TOKENS)


def test_tp2_engine_a_saves_per_rank_blocks(world: dict[str, Any], engines: Any) -> None:
    store: Path = world["store"]
    a = engines("A", engine_cfg(world, 2, use_layerwise=False), **tp2_env())
    assert "tensor_parallel_size=2" in a.log_text()
    batch = world["prompts"]["batch"]
    out = a.generate(batch, MAX_TOKENS)
    assert out["cached"] == [0] * len(batch)
    # The cold TP=2 run gives TP=1's tokens (float32; only the all-reduce
    # order differs).
    assert out["tokens"] == world["ref"]["batch"]
    n = full_blocks(batch)
    files = wait_for_files(store, 2 * n)
    assert len(files) == 2 * n
    out = a.generate(world["prompts"]["torn"], MAX_TOKENS)
    assert out["tokens"] == world["ref"]["torn"]
    a.close()  # flushes in-flight saves

    # Rank 0's and rank 1's keys pair up exactly and are distinct.
    pairs = rank_pairs(set(files))
    assert len(pairs) == n
    assert {k for pair in pairs for k in pair} == set(files)
    # Every file holds half the KV heads of every layer.
    for f in files.values():
        assert f.stat().st_size == LAYERS * (HEADER + shard_bytes(KV_HEADS // 2)), f
    world["pairs"] = [(files[k0], files[k1]) for k0, k1 in pairs]
    torn = {k: f for k, f in block_files(store).items() if k not in files}
    torn_pairs = rank_pairs(set(torn))
    assert len(torn) == 2 * len(torn_pairs) == 2 * full_blocks(world["prompts"]["torn"])
    world["tp2_files"] = set(files) | set(torn)
    world["torn_pairs"] = [(torn[k0], torn[k1]) for k0, k1 in torn_pairs]


def test_tp2_fresh_engine_hits_all_full_blocks(world: dict[str, Any], engines: Any) -> None:
    """A new TP=2 process, layer-wise, reads what A wrote whole-step."""
    b = engines("B", engine_cfg(world, 2, use_layerwise=True), **tp2_env())
    world["B"] = b
    p = world["prompts"]
    # Partial overlap: the 5 shared blocks come from the store.
    out = b.generate(p["overlap"], MAX_TOKENS)
    assert out["cached"] == [5 * BS]
    assert out["tokens"] == world["ref"]["overlap"]
    # Every full block hits: p_long's first 5 from vLLM's own prefix cache now,
    # the rest from the store; a block-aligned prompt recomputes its last
    # token; one shorter than a block has nothing to hit.
    out = b.generate(p["batch"], MAX_TOKENS)
    assert out["cached"] == [9 * BS, 3 * BS - 1, 0, 6 * BS]
    assert out["tokens"] == world["ref"]["batch"]
    m = b.metrics()
    hit_blocks = 5 + 4 + 3 + 6
    assert m["ucm_lookup_hit_tokens_total"] == (hit_blocks * BS) - 1
    # Each rank loaded its own store block for every hit, and none failed
    # (a rank missing its keys would fail and recompute: same tokens, so
    # these counters are what shows rank 1 found its own blocks).
    assert m.get("ucm_load_failed_blocks_total", 0) == 0
    assert m["ucm_load_blocks_total"] == 2 * hit_blocks
    assert m["ucm_load_bytes_total"] == 2 * hit_blocks * LAYERS * shard_bytes(KV_HEADS // 2)
    assert "vLLM recomputes them" not in b.log_text()


def test_tp2_block_missing_on_one_rank_is_recomputed(world: dict[str, Any]) -> None:
    """Only rank 0's keys are looked up: a block whose rank-1 file is gone is a
    hit that rank 1 fails to load; vLLM recomputes it and rank 1 saves it again."""
    b = world["B"]
    _, victim = world["torn_pairs"][0]
    victim.unlink()
    out = b.generate(world["prompts"]["torn"], MAX_TOKENS)
    assert out["tokens"] == world["ref"]["torn"]
    m = b.metrics()
    assert m.get("ucm_load_failed_blocks_total", 0) > 0
    assert "vLLM recomputes them" in b.log_text()
    # A missing block is the block's problem, not the store's: caching goes on.
    assert m.get("ucm_store_errors_total", 0) == 0
    assert m.get("ucm_store_healthy", 1) == 1
    b.close()
    assert m.get("ucm_save_failed_blocks_total", 0) == 0
    assert victim.exists()
    assert victim.stat().st_size == LAYERS * (HEADER + shard_bytes(KV_HEADS // 2))
    # B saved the overlap prompt's one new block, once per rank.
    new = set(block_files(world["store"])) - world["tp2_files"]
    assert len(new) == 2 and len(rank_pairs(new)) == 1


def test_tp1_engine_does_not_hit_tp2_blocks(world: dict[str, Any], engines: Any) -> None:
    before = set(block_files(world["store"]))
    c = engines("C", engine_cfg(world, 1, use_layerwise=False))
    batch = world["prompts"]["batch"]
    out = c.generate(batch, MAX_TOKENS)
    assert out["cached"] == [0] * len(batch)
    assert out["tokens"] == world["ref"]["batch"]
    m = c.metrics()
    assert m.get("ucm_lookup_hit_tokens_total", 0) == 0
    assert m.get("ucm_load_blocks_total", 0) == 0
    assert m["ucm_lookup_tokens_total"] > 0  # it did look
    c.close()
    # C saved its own blocks (all KV heads) under its own keys.
    new = {k: f for k, f in block_files(world["store"]).items() if k not in before}
    assert len(new) == full_blocks(batch)
    for f in new.values():
        assert f.stat().st_size == LAYERS * (HEADER + shard_bytes(KV_HEADS)), f
    world["tp1_files"] = list(new.values())


def test_each_rank_holds_its_own_heads(world: dict[str, Any]) -> None:
    """Rank r's shards are the TP=1 KV of heads [r*H/2, (r+1)*H/2), every layer."""
    half = KV_HEADS // 2
    tp1 = [shards(f, KV_HEADS) for f in world["tp1_files"]]
    worst = 0.0
    matched: set[int] = set()
    for f0, f1 in world["pairs"]:
        r0, r1 = shards(f0, half), shards(f1, half)
        # The TP=1 block of the same tokens: the one whose first heads of
        # layer 0 are closest to rank 0's.
        dist = [float(np.abs(t[0][:half] - r0[0]).max()) for t in tp1]
        i = int(np.argmin(dist))
        matched.add(i)
        for layer in range(LAYERS):
            full = tp1[i][layer]
            lo, hi = full[:half], full[half:]
            # Same computation but the all-reduce's summation order: float32 noise.
            np.testing.assert_allclose(r0[layer], lo, rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(r1[layer], hi, rtol=1e-4, atol=1e-4)
            worst = max(
                worst, float(np.abs(r0[layer] - lo).max()), float(np.abs(r1[layer] - hi).max())
            )
            # ... and not the other rank's heads.
            assert np.abs(r0[layer] - hi).max() > 100 * max(worst, 1e-6)
            assert np.abs(r1[layer] - lo).max() > 100 * max(worst, 1e-6)
    assert len(matched) == len(world["pairs"]) == len(tp1)
    print(f"TP=2 shards vs TP=1 KV: max abs difference {worst:.3g}")


# -- MLA: replicated latent KV, saved once ---------------------------------------

MLA_BS = 16  # vLLM's CPU MLA backend forces 16-token blocks
# A random-weight DeepSeek-V2 small enough for the CPU: the CPU MLA kernels
# need a 512 + 64 latent (kv_lora_rank + qk_rope_head_dim). Experts are
# required fields, but first_k_dense_replace = layers makes every MLP dense.
TINY_MLA = json.loads((Path(__file__).parent / "tiny_mla_config.json").read_text())
MLA_LAYERS = TINY_MLA["num_hidden_layers"]
KV_LORA, ROPE = TINY_MLA["kv_lora_rank"], TINY_MLA["qk_rope_head_dim"]


def make_tiny_mla(out: Path, tokenizer_from: Path) -> Path:
    """A random-weight DeepSeek-V2 (MLA attention, dense MLPs), float32."""
    import shutil

    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    for f in tokenizer_from.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    cfg = DeepseekV2Config(**TINY_MLA)
    torch.manual_seed(0)
    model = DeepseekV2ForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def test_tp2_mla_latent_kv_is_saved_once(
    world: dict[str, Any], engines: Any, tmp_path: Path
) -> None:
    """MLA: every rank holds the same latent KV, so only rank 0 writes it (one
    file per block, the scheduler's id) and every rank loads that file.

    Tokens are not compared here: with vLLM 0.32's CPU MLA backend, a tiny
    random MLA model gave different greedy tokens for a prompt served alone
    and in a batch, without any connector, so tokens can't tell a bad load
    from the backend's own differences.
    """
    model = make_tiny_mla(tmp_path / "mla-model", Path(world["model"]))
    store = tmp_path / "mla-store"
    cfg = {
        "model": str(model),
        # Pinned: on a CPU with AMX, vLLM would pick its AMX MLA backend,
        # which refuses float32 weights; the reference backend runs on every
        # x86-64 CPU.
        "llm": {
            "tensor_parallel_size": 2,
            "block_size": MLA_BS,
            "attention_config": {"backend": "CPU_MLA"},
        },
        "ucm": {"storage_backends": str(store), "store_pipeline": "Posix"},
    }
    rng = random.Random(99)
    prompts = [_rand(rng, 100), _rand(rng, 40)]  # 6 + 2 full blocks
    n = sum(len(p) // MLA_BS for p in prompts)
    e = engines("MLA", cfg, **tp2_env())
    assert "Using CPU_MLA backend" in e.log_text()
    out = e.generate(prompts, MAX_TOKENS)
    assert out["cached"] == [0, 0]
    files = wait_for_files(store, n)
    time.sleep(0.5)  # a second rank writing would show up by now
    files = block_files(store)
    assert len(files) == n  # once per block, not once per rank
    shard = MLA_BS * (KV_LORA + ROPE) * 4
    for f in files.values():
        assert f.stat().st_size == MLA_LAYERS * (HEADER + shard), f
    # vLLM turns its own prefix cache off for MLA on CPU: the same prompts
    # again are served from the store, by both ranks.
    out = e.generate(prompts, MAX_TOKENS)
    assert out["cached"] == [len(p) // MLA_BS * MLA_BS for p in prompts]
    m = e.metrics()
    assert m.get("ucm_load_failed_blocks_total", 0) == 0
    assert m["ucm_load_blocks_total"] == 2 * n  # each rank loaded rank 0's block
    assert m["ucm_save_blocks_total"] == n  # only rank 0 saved
    e.close()
    assert set(block_files(store)) == set(files)


def test_pinned_mla_backend_holds_on_a_cpu_with_amx(monkeypatch: pytest.MonkeyPatch) -> None:
    """The MLA test pins vLLM's reference CPU_MLA backend, because on a CPU
    with AMX vLLM would otherwise pick AMX_MLA (which refuses float32): the
    pin must win where AMX is present (simulated here)."""
    import torch
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    sel = AttentionSelectorConfig(
        head_size=KV_LORA + ROPE,
        dtype=torch.float32,
        kv_cache_dtype=None,
        block_size=MLA_BS,
        use_mla=True,
    )
    chosen = CpuPlatform.get_attn_backend_cls(AttentionBackendEnum.CPU_MLA, sel)
    assert chosen == AttentionBackendEnum.CPU_MLA.get_path()
    unpinned = CpuPlatform.get_attn_backend_cls(None, sel)
    assert unpinned == AttentionBackendEnum.AMX_MLA.get_path()
