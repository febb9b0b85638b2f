"""No sequence of calls from Python makes the core touch freed memory.

Each scenario runs in a child process: a use-after-free there aborts the
process (heap corruption) or stores bytes that were never dumped, and both
show up as a failed child. The children drop their tasks (and tensors)
without waiting, then allocate and fill new memory of the same size so the
allocator hands the freed pages straight back.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PRELUDE = textwrap.dedent(
    """
    import gc, sys, torch
    from ucm.store import UcmConnectorFactory

    SHARD, SHARDS = 16384, 4

    def open_store(root, pipeline="Posix", **extra):
        cfg = {
            "store_pipeline": pipeline,
            "storage_backends": root,
            "block_size": SHARD * SHARDS,
            "shard_size": SHARD,
            "tensor_size_list": [SHARD],
            "io_threads": 2,
            "timeout_ms": 60000,
        }
        if pipeline.startswith("Cache"):
            cfg["cache_buffer_capacity_gb"] = 0.0625
        cfg.update(extra)
        return UcmConnectorFactory.create_connector("UcmPipelineStore", cfg)

    def pattern(n):
        return torch.full((SHARDS, SHARD), n % 251 + 1, dtype=torch.uint8)

    def bid(n):
        return n.to_bytes(16, "little")

    def whole(n):
        # ids, shard indices of block n
        return [bid(n)] * SHARDS, list(range(SHARDS))

    def rows(t):
        return [[t[s]] for s in range(SHARDS)]

    def churn():
        # Reuse what was just freed: same sizes, different bytes.
        junk = [torch.full((SHARDS, SHARD), 0xEE, dtype=torch.uint8) for _ in range(8)]
        del junk
    """
)

DUMPS = PRELUDE + textwrap.dedent(
    """
    root, pipeline, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    store = open_store(root, pipeline)
    for i in range(n):
        data = pattern(i)
        store.dump(*whole(i), rows(data))
        del data  # the task handle is dropped too: nobody waits
        churn()
    gc.collect()
    store.close()
    # A fresh store reads back what the first one acknowledged: every block
    # either holds exactly its dumped bytes or is absent, never other bytes.
    store = open_store(root)
    wrong = present = 0
    for i in range(n):
        if not store.lookup([bid(i)])[0]:
            continue
        present += 1
        out = torch.zeros((SHARDS, SHARD), dtype=torch.uint8)
        store.wait(store.load(*whole(i), rows(out)))
        wrong += not torch.equal(out, pattern(i))
    store.close()
    print(f"present={present} wrong={wrong}")
    sys.exit(1 if wrong or present < n else 0)
    """
)

LOADS = PRELUDE + textwrap.dedent(
    """
    root, pipeline, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    store = open_store(root, pipeline)
    blocks = 16
    for i in range(blocks):
        data = pattern(i)
        store.wait(store.dump(*whole(i), rows(data)))
    store.flush()
    survivors = []
    for i in range(n):
        out = torch.empty((SHARDS, SHARD), dtype=torch.uint8)
        store.load(*whole(i % blocks), rows(out))
        del out
        # Memory allocated now must keep its bytes: no late load lands in it.
        keep = torch.full((SHARDS, SHARD), 0x5A, dtype=torch.uint8)
        survivors.append(keep)
        if len(survivors) > 64:
            assert bool((survivors.pop(0) == 0x5A).all()), "a dropped load wrote into reused memory"
    if sys.argv[4] == "close":
        store.close()  # with loads still in flight
    elif sys.argv[4] == "gc":
        del store  # garbage-collected with loads in flight
        gc.collect()
    # else: interpreter exit with loads in flight
    for keep in survivors:
        assert bool((keep == 0x5A).all()), "a dropped load wrote into reused memory"
    print("ok")
    """
)


def run_child(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.parametrize("pipeline", ["Posix", "Cache|Posix"])
def test_dropped_dumps_store_only_the_dumped_bytes(tmp_path: Path, pipeline: str) -> None:
    res = run_child(DUMPS, str(tmp_path), pipeline, "2000")
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]


@pytest.mark.parametrize(
    ("pipeline", "ending"),
    [("Posix", "close"), ("Posix", "gc"), ("Posix", "exit"), ("Cache|Posix", "exit")],
)
def test_dropped_loads_never_write_freed_memory(tmp_path: Path, pipeline: str, ending: str) -> None:
    res = run_child(LOADS, str(tmp_path), pipeline, "3000", ending)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert "ok" in res.stdout


def test_task_handles_are_checked(make_store) -> None:
    from ucm.store import InvalidParamError, Task

    store = make_store()
    for bad in (None, "x", -1, 0, 2**64, 2**70, 1.5, True):
        with pytest.raises(InvalidParamError, match="task must be a handle"):
            store.wait(bad)
        with pytest.raises(InvalidParamError, match="task must be a handle"):
            store.check(Task(bad))  # type: ignore[arg-type]


def test_regions_are_checked_against_their_tensors(make_store) -> None:
    import numpy as np
    import torch
    from support.store_helpers import SHARD, SHARDS

    from ucm.store import InvalidParamError, Regions

    store = make_store()
    half = SHARD // 2
    kv = torch.arange(SHARDS * SHARD, dtype=torch.int32).to(torch.uint8)
    base = kv.data_ptr()
    addrs = np.array(
        [[base + s * SHARD, base + s * SHARD + half] for s in range(SHARDS)], np.uint64
    )
    bid = b"r" * 16
    store.wait(store.dump([bid] * SHARDS, list(range(SHARDS)), Regions([kv], addrs)))
    out = torch.zeros_like(kv)
    dst = addrs - np.uint64(base) + np.uint64(out.data_ptr())
    store.wait(store.load([bid] * SHARDS, list(range(SHARDS)), Regions([out], dst)))
    assert torch.equal(out, kv)
    # One byte past the end of the owner, or memory of no owner at all.
    past = dst.copy()
    past[-1, 1] += np.uint64(1)
    with pytest.raises(InvalidParamError, match=r"addresses\[3\]\[1\].*outside the memory"):
        store.load([bid] * SHARDS, list(range(SHARDS)), Regions([out], past))
    with pytest.raises(InvalidParamError, match="outside the memory"):
        store.dump([bid] * SHARDS, list(range(SHARDS)), Regions([out], addrs))
    ro = np.zeros(SHARDS * SHARD, np.uint8)
    ro.flags.writeable = False
    with pytest.raises(InvalidParamError, match="read-only"):
        store.load(
            [bid],
            [0],
            Regions([ro], np.array([[ro.ctypes.data, ro.ctypes.data + half]], np.uint64)),
        )
