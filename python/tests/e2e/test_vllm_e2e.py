"""End to end on real vLLM (CPU build): a tiny random-weight Llama, float32, greedy.

Engines run in their own processes (``engine_proc.py``, in-process engine
core) and share one store directory:

* REF: no connector, the expected tokens of every batch;
* A (whole-step, Posix) serves batch 1 and a prompt to corrupt later;
* B (layer-wise, Posix, a new process) gets hits for all of A's full blocks,
  partial overlaps, sub-block prompts, many concurrent requests, and a
  corrupted block (recomputed);
* C (whole-step, ``Cache|Posix`` when this build has it) reads what B wrote
  layer-wise, including the block B re-saved after the corruption;
* D runs on a store made unwritable mid-run, then writable again.

Every batch's tokens must equal REF's for the same batch.
"""

from __future__ import annotations

import os
import random
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from support.engines import record_reference

BS = 32
MAX_TOKENS = 8


def _rand(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(4, 500) for _ in range(n)]


def make_prompts() -> dict[str, Any]:
    rng = random.Random(1234)
    p_long = _rand(rng, 300)  # 9 full blocks + 12 tokens
    p_aligned = _rand(rng, 96)  # exactly 3 blocks
    p_short = _rand(rng, 20)  # less than one block
    p_overlap = p_long[: 5 * BS] + _rand(rng, 90)  # shares 5 blocks with p_long
    shared = _rand(rng, 4 * BS)
    many = [shared + _rand(rng, rng.randrange(10, 100)) for _ in range(8)]
    many += [_rand(rng, rng.randrange(20, 400)) for _ in range(16)]
    return {
        "batch1": [p_long, p_aligned, p_short],
        "overlap": [p_overlap],
        "many": many,
        "corrupt": [_rand(rng, 8 * BS)],
        "c_new": [_rand(rng, 200)],
        "ro1": [_rand(rng, 150)],
        "ro2": [_rand(rng, 170)],
        "ro3": [_rand(rng, 190)],
    }


def full_blocks(prompts: list[list[int]]) -> int:
    return sum(len(p) // BS for p in prompts)


def block_files(root: Path) -> set[Path]:
    """Published block files of a Posix store directory."""
    return {
        f
        for f in root.glob("??/*")
        if f.is_file() and len(f.name) == 32 and all(c in "0123456789abcdef" for c in f.name)
    }


def cache_posix_available(tmp: Path) -> bool:
    from ucm.store import UcmConnectorFactory

    tmp.mkdir(parents=True, exist_ok=True)
    try:
        s = UcmConnectorFactory.create_connector(
            "UcmPipelineStore",
            {
                "store_pipeline": "Cache|Posix",
                "storage_backends": str(tmp),
                "block_size": 8192,
                "shard_size": 4096,
                "tensor_size_list": [4096],
                "cache_buffer_capacity_gb": 0.01,
            },
        )
    except Exception:
        return False
    s.close()
    return True


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("ucm-e2e")
    store = root / "store"
    store.mkdir()
    return {
        "model": str(tiny_model),
        "store": store,
        "prompts": make_prompts(),
        "cache_posix": cache_posix_available(root / "probe"),
        "ref": {},
    }


def ucm_cfg(world: dict[str, Any], **kw: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {"storage_backends": str(world["store"]), "store_pipeline": "Posix"}
    cfg.update(kw)
    return cfg


def test_reference_engine(world: dict[str, Any], engines: Any) -> None:
    record_reference(engines("ref", {"model": world["model"]}), world, MAX_TOKENS)


def test_engine_a_saves_full_blocks(world: dict[str, Any], engines: Any) -> None:
    store: Path = world["store"]
    a = engines("A", {"model": world["model"], "ucm": ucm_cfg(world, use_layerwise=False)})
    out = a.generate(world["prompts"]["batch1"], MAX_TOKENS)
    assert out["tokens"] == world["ref"]["batch1"]
    assert out["cached"] == [0, 0, 0]
    before = block_files(store)
    out = a.generate(world["prompts"]["corrupt"], MAX_TOKENS)
    assert out["tokens"] == world["ref"]["corrupt"]
    a.close()  # flushes in-flight saves
    files = block_files(store)
    world["corrupt_files"] = sorted(files - before)
    assert len(before) == full_blocks(world["prompts"]["batch1"])
    assert len(world["corrupt_files"]) == 8


def test_fresh_engine_hits_all_full_blocks(world: dict[str, Any], engines: Any) -> None:
    """Cross-process reuse, partial overlap and a prompt shorter than a block,
    in layer-wise mode reading blocks written in whole-step mode."""
    b = engines("B", {"model": world["model"], "ucm": ucm_cfg(world, use_layerwise=True)})
    world["B"] = b
    # Partial overlap: the 5 shared blocks come from the store, the rest is computed.
    out = b.generate(world["prompts"]["overlap"], MAX_TOKENS)
    assert out["cached"] == [5 * BS]
    assert out["tokens"] == world["ref"]["overlap"]
    m = b.metrics()
    assert m["ucm_lookup_hit_tokens_total"] == 5 * BS
    assert m["ucm_load_blocks_total"] == 5
    # Every full block hits (p_long's first 5 from vLLM's own cache now, the
    # other 4 from the store); a block-aligned prompt recomputes its last
    # token; a prompt shorter than a block has nothing to hit.
    out = b.generate(world["prompts"]["batch1"], MAX_TOKENS)
    assert out["cached"] == [9 * BS, 3 * BS - 1, 0]
    assert out["tokens"] == world["ref"]["batch1"]
    m = b.metrics()
    assert m["ucm_lookup_hit_tokens_total"] == 5 * BS + 4 * BS + 3 * BS - 1
    assert m["ucm_load_blocks_total"] == 5 + 4 + 3
    assert m["ucm_load_bytes_total"] > 0
    assert m.get("ucm_load_failed_blocks_total", 0) == 0
    assert 0 < m["ucm_lookup_hit_rate"] <= 1


def test_many_concurrent_requests(world: dict[str, Any]) -> None:
    b = world["B"]
    out = b.generate(world["prompts"]["many"], MAX_TOKENS)
    assert out["tokens"] == world["ref"]["many"]


def test_corrupted_block_is_recomputed(world: dict[str, Any]) -> None:
    b = world["B"]
    victim: Path = world["corrupt_files"][len(world["corrupt_files"]) // 2]
    with open(victim, "r+b") as f:
        f.seek(4096 + 1000)  # inside the first shard's data
        data = f.read(64)
        f.seek(4096 + 1000)
        f.write(bytes((x ^ 0x5A) for x in data))
    before = b.metrics().get("ucm_load_failed_blocks_total", 0)
    out = b.generate(world["prompts"]["corrupt"], MAX_TOKENS)
    assert out["tokens"] == world["ref"]["corrupt"]
    m = b.metrics()
    assert m.get("ucm_load_failed_blocks_total", 0) > before
    assert "vLLM recomputes them" in b.log_text()
    b.close()
    # The recomputed blocks were saved again.
    assert victim.exists()


def test_whole_step_engine_reads_layerwise_blocks(world: dict[str, Any], engines: Any) -> None:
    pipeline = "Cache|Posix" if world["cache_posix"] else "Posix"
    extra: dict[str, Any] = {"store_pipeline": pipeline}
    if world["cache_posix"]:
        extra["cache_buffer_capacity_gb"] = 0.25
    c = engines("C", {"model": world["model"], "ucm": ucm_cfg(world, **extra)})
    out = c.generate(world["prompts"]["many"], MAX_TOKENS)
    assert out["tokens"] == world["ref"]["many"]
    expect = [
        (len(p) // BS) * BS - (1 if len(p) % BS == 0 else 0) for p in world["prompts"]["many"]
    ]
    assert out["cached"] == expect
    out = c.generate(world["prompts"]["corrupt"], MAX_TOKENS)
    assert out["tokens"] == world["ref"]["corrupt"]
    assert out["cached"] == [8 * BS - 1]
    before = block_files(world["store"])
    out = c.generate(world["prompts"]["c_new"], MAX_TOKENS)
    assert out["tokens"] == world["ref"]["c_new"]
    c.close()  # Cache|Posix writes back asynchronously; close flushes
    assert len(block_files(world["store"]) - before) == full_blocks(world["prompts"]["c_new"])
    if not world["cache_posix"]:
        pytest.skip("this build has no Cache stage: ran on Posix only")


def small_cache_cfg(store: Path, **kw: Any) -> dict[str, Any]:
    """A ``Cache|Posix`` store at ``store`` with a 256 MiB Cache tier."""
    return {
        "storage_backends": str(store),
        "store_pipeline": "Cache|Posix",
        "cache_buffer_capacity_gb": 0.25,
        **kw,
    }


def test_blocks_only_in_the_workers_cache_are_hits(
    world: dict[str, Any], engines: Any, tmp_path: Path
) -> None:
    """A prompt repeated before the worker's Cache tier wrote it back to
    Posix: the scheduler, which reads only Posix, still finds it."""
    if not world["cache_posix"]:
        pytest.skip("this build has no Cache stage")
    store = tmp_path / "wb-store"
    cfg = small_cache_cfg(store, write_back_interval=600, write_back_batch_size=4096)
    e = engines("E", {"model": world["model"], "ucm": cfg, "llm": {"enable_prefix_caching": False}})
    prompt = world["prompts"]["c_new"]
    first = e.generate(prompt, MAX_TOKENS)
    assert first["tokens"] == world["ref"]["c_new"]
    assert block_files(store) == set(), "written back already: the test proves nothing"
    again = e.generate(prompt, MAX_TOKENS)
    assert again["tokens"] == world["ref"]["c_new"]
    assert again["cached"] == [full_blocks(prompt) * BS]
    e.close()  # flushes
    assert len(block_files(store)) == full_blocks(prompt)


def test_a_restarted_engine_loads_from_a_kept_segment(
    world: dict[str, Any], engines: Any, tmp_path: Path
) -> None:
    """``share_buffer_keep``: the Cache segment outlives the engine that
    filled it, under a name the connector derives, and the next engine
    serves the blocks from it. Every block file is corrupted in between: a
    load that read them would fail its checksum and be recomputed."""
    if not world["cache_posix"]:
        pytest.skip("this build has no Cache stage")
    store = tmp_path / "kept-store"
    cfg = small_cache_cfg(store, share_buffer_enable=True, share_buffer_keep=True)
    prompt = world["prompts"]["c_new"]
    shm = Path("/dev/shm")
    before = set(shm.glob("ucm_cache_vllm-*"))
    try:
        first = engines("K1", {"model": world["model"], "ucm": cfg})
        assert first.generate(prompt, MAX_TOKENS)["tokens"] == world["ref"]["c_new"]
        first.close()  # flushes: every block is in Posix as well
        kept = [
            Path(line.split("kept shared cache segment ")[1].split()[0])
            for line in first.log_text().splitlines()
            if "kept shared cache segment " in line
        ]
        assert kept and kept[0] in set(shm.glob("ucm_cache_vllm-*")) - before, first.log_tail()
        files = block_files(store)
        assert len(files) == full_blocks(prompt)
        for f in files:
            with open(f, "r+b") as fh:
                fh.seek(4096 + 1000)
                data = fh.read(64)
                fh.seek(4096 + 1000)
                fh.write(bytes(x ^ 0x5A for x in data))
        second = engines("K2", {"model": world["model"], "ucm": cfg})
        out = second.generate(prompt, MAX_TOKENS)
        assert out["tokens"] == world["ref"]["c_new"]
        assert out["cached"] == [full_blocks(prompt) * BS]
        m = second.metrics()
        assert m["ucm_load_blocks_total"] == full_blocks(prompt)
        assert m.get("ucm_load_failed_blocks_total", 0) == 0, "read the corrupted files"
        second.close()
        assert kept[0].exists(), "the kept segment went with the second engine"
    finally:
        for leftover in set(shm.glob("ucm_cache_vllm-*")) - before:
            leftover.unlink(missing_ok=True)


# -- the store made unwritable mid-run ------------------------------------------


class Unwritable:
    """Makes a directory read-only and back: a tmpfs remount as root, else chmod."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.mounted = False
        if os.geteuid() == 0:
            r = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(path)],
                capture_output=True,
                text=True,
            )
            self.mounted = r.returncode == 0

    def set(self, writable: bool) -> None:
        if self.mounted:
            mode = "rw" if writable else "ro"
            subprocess.run(["mount", "-o", f"remount,{mode}", str(self.path)], check=True)
        else:
            for d in [self.path, *(p for p in self.path.rglob("*") if p.is_dir())]:
                d.chmod(0o700 if writable else 0o500)

    def close(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], check=False)


def test_unwritable_store_serving_continues(
    world: dict[str, Any], engines: Any, tmp_path: Path
) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: a read-only mount (chmod does not stop root)")
    root = tmp_path / "ro-store"
    root.mkdir()
    guard = Unwritable(root)
    if not guard.mounted:
        pytest.skip("cannot mount a tmpfs here")
    try:
        cfg = {
            "storage_backends": str(root),
            "store_pipeline": "Posix",
            "store_retry_interval_s": 0.2,
            "store_retry_max_s": 0.5,
            "warning_interval_s": 0,
        }
        d = engines("D", {"model": world["model"], "ucm": cfg})
        p = world["prompts"]
        out = d.generate(p["ro1"], MAX_TOKENS)
        assert out["tokens"] == world["ref"]["ro1"]
        time.sleep(0.3)
        n1 = len(block_files(root))
        assert n1 == full_blocks(p["ro1"])

        guard.set(writable=False)
        out = d.generate(p["ro2"], MAX_TOKENS)
        assert out["tokens"] == world["ref"]["ro2"]
        time.sleep(0.3)
        m = d.metrics()
        assert m.get("ucm_save_failed_blocks_total", 0) > 0
        assert m.get("ucm_store_errors_total", 0) > 0
        assert m["ucm_store_healthy"] == 0
        assert "serving continues without caching" in d.log_text()
        assert len(block_files(root)) == n1

        guard.set(writable=True)
        time.sleep(1.0)  # past the retry back-off
        out = d.generate(p["ro3"], MAX_TOKENS)
        assert out["tokens"] == world["ref"]["ro3"]
        # ro2 again: vLLM's prefix cache has it, the store does not: saved now.
        out = d.generate(p["ro2"], MAX_TOKENS)
        assert out["tokens"] == world["ref"]["ro2"]
        for _ in range(50):
            if len(block_files(root)) == full_blocks(p["ro1"] + p["ro2"] + p["ro3"]):
                break
            time.sleep(0.1)
        assert len(block_files(root)) == full_blocks(p["ro1"] + p["ro2"] + p["ro3"])
        assert "caching resumed" in d.log_text()
        assert d.metrics()["ucm_store_healthy"] == 1
        d.close()
    finally:
        guard.close()
