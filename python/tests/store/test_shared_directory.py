"""Several stores on one directory, each in its own process, as vLLM's
workers and several engines on one host run them: a block one store dumped
stays loadable while another fills the directory, and the configured
capacity bounds the directory, not each store's share of it."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.store_helpers import SHARD, SHARDS, base_config

from ucm.store import UcmConnectorFactory

#: Bytes of one block file: a 4 KiB header before each shard's data.
FILE_LEN = SHARDS * (4096 + SHARD)

#: A store in a child process, driven one JSON command per line on stdin and
#: answering one JSON line per command on stdout.
STORE_PROCESS = textwrap.dedent(
    """
    import hashlib, json, sys
    import numpy as np
    from ucm.store import UcmConnectorFactory

    SHARD, SHARDS = int(sys.argv[2]), int(sys.argv[3])

    def content(bid, shard):
        digest = hashlib.blake2b(bid + bytes([shard]), digest_size=8).digest()
        seed = int.from_bytes(digest, "little")
        return np.random.default_rng(seed).integers(0, 256, size=SHARD, dtype=np.uint8)

    def rows(arrs):
        return [[a[: SHARD // 2], a[SHARD // 2 :]] for a in arrs]

    store = UcmConnectorFactory.create_connector("UcmPipelineStore", json.loads(sys.argv[1]))
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        ids = [bytes.fromhex(h) for h in cmd.get("ids", [])]
        if cmd["op"] == "read":
            found = store.lookup(ids)
            out = [np.empty(SHARD, dtype=np.uint8) for _ in range(SHARDS)]
            for bid in ids:
                store.wait(store.load([bid] * SHARDS, list(range(SHARDS)), rows(out)))
            reply = {"found": sum(found)}
        elif cmd["op"] == "dump":
            for bid in ids:
                data = [content(bid, s) for s in range(SHARDS)]
                store.wait(store.dump([bid] * SHARDS, list(range(SHARDS)), rows(data)))
            reply = {"dumped": len(ids)}
        elif cmd["op"] == "settle":
            store.flush()
            reply = {"ok": True}
        else:
            break
        print(json.dumps(reply), flush=True)
    store.close()
    """
)


def content(bid: bytes, shard: int) -> np.ndarray:
    """Shard bytes derived from the id, so any process can check them."""
    seed = int.from_bytes(hashlib.blake2b(bid + bytes([shard]), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, size=SHARD, dtype=np.uint8)


def rows(arrs: list[np.ndarray]) -> list[list[np.ndarray]]:
    return [[a[: SHARD // 2], a[SHARD // 2 :]] for a in arrs]


class StoreProcess:
    """A store in its own process, on the same directory as the test's."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", STORE_PROCESS, json.dumps(cfg), str(SHARD), str(SHARDS)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.ask_line() == {"ready": True}

    def ask_line(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            assert self.proc.stderr is not None
            raise AssertionError(f"store process failed: {self.proc.stderr.read()[-3000:]}")
        return json.loads(line)

    def ask(self, op: str, ids: list[bytes] = ()) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, "ids": [i.hex() for i in ids]}) + "\n")
        self.proc.stdin.flush()
        return self.ask_line()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=120)


def capacity_gb(files: int) -> float:
    return files * FILE_LEN / (1 << 30)


def ids(tag: str, n: int) -> list[bytes]:
    return [hashlib.blake2b(f"{tag}-{i}".encode(), digest_size=16).digest() for i in range(n)]


@pytest.mark.parametrize(
    "evicting",
    [
        {"store_pipeline": "Posix"},
        {
            "store_pipeline": "Cache|Posix",
            "write_back_policy": "sync",
            "cache_buffer_capacity_gb": capacity_gb(4),
        },
    ],
    ids=["Posix", "Cache|Posix sync"],
)
def test_a_block_another_store_dumped_stays_loadable_while_a_small_store_fills_up(
    tmp_path: Path, evicting: dict[str, Any]
) -> None:
    """Store A dumps a block and waits; store B, in another process on the
    same directory and with room for 12 blocks, reads that block and then
    dumps 20 more. A loads its block at once: none of the other stores may
    evict a block dumped in the last 10 seconds, whoever read it since."""
    root = tmp_path / "store"
    root.mkdir()
    a = UcmConnectorFactory.create_connector("UcmPipelineStore", base_config(root))
    b = StoreProcess(base_config(root, posix_capacity_gb=capacity_gb(12), **evicting))
    try:
        failed = []
        for r, k in enumerate(ids("a", 12)):
            data = [content(k, s) for s in range(SHARDS)]
            a.wait(a.dump([k] * SHARDS, list(range(SHARDS)), rows(data)))
            assert b.ask("read", [k]) == {"found": 1}
            b.ask("dump", ids(f"b{r}", 20))
            out = [np.empty(SHARD, dtype=np.uint8) for _ in range(SHARDS)]
            try:
                a.wait(a.load([k] * SHARDS, list(range(SHARDS)), rows(out)))
            except Exception as e:
                failed.append(f"round {r}: {type(e).__name__}: {e}")
                continue
            assert all(np.array_equal(out[s], data[s]) for s in range(SHARDS)), f"round {r}"
        assert not failed, failed
    finally:
        b.close()
        a.close()


def ucm_bytes(root: Path) -> int:
    """Bytes of the block files and work files under ``root`` (each file
    once, whatever moves while the walk runs)."""
    seen: dict[int, int] = {}
    for p in root.rglob("*"):
        try:
            st = p.lstat()
        except FileNotFoundError:
            continue
        if p.is_file() and not p.is_symlink() and p.parent != root:
            seen[st.st_ino] = st.st_size
    return sum(seen.values())


def test_four_processes_with_one_capacity_keep_the_directory_within_it(tmp_path: Path) -> None:
    """Four stores, each in its own process with the same capacity C, dump
    three times C each into one directory: the directory stays within C
    (blocks and spare files together), not four times C."""
    root = tmp_path / "store"
    root.mkdir()
    files = 24
    cap = files * FILE_LEN
    cfg = base_config(root, posix_capacity_gb=capacity_gb(files), posix_spare_files=2)
    stores = [StoreProcess(cfg) for _ in range(4)]
    peak = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], ucm_bytes(root))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        threads = [
            threading.Thread(target=s.ask, args=("dump", ids(f"p{n}", 3 * files)))
            for n, s in enumerate(stores)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        stop.set()
        sampler.join()
    deadline = time.monotonic() + 20
    while ucm_bytes(root) > cap and time.monotonic() < deadline:
        time.sleep(0.05)
    settled = ucm_bytes(root)
    for s in stores:
        s.close()
    assert settled <= cap, f"{settled / cap:.2f} x the capacity once settled"
    # While four writers dump at once, each may hold a block it is writing
    # and run ahead of its evictor by a few blocks.
    assert peak[0] <= 1.5 * cap, f"peaked at {peak[0] / cap:.2f} x the capacity"


def test_the_smallest_capacity_bounds_a_shared_directory(tmp_path: Path) -> None:
    """Stores with different capacities on one directory: the directory
    stays within the smallest of them (the guarantees say so)."""
    root = tmp_path / "store"
    root.mkdir()
    small = StoreProcess(base_config(root, posix_capacity_gb=capacity_gb(10)))
    large = StoreProcess(base_config(root, posix_capacity_gb=capacity_gb(40)))
    try:
        large.ask("dump", ids("large", 30))
        # The large store's blocks are older than the 10 s during which
        # another store must leave them alone.
        time.sleep(10.5)
        small.ask("dump", ids("small", 5))
        deadline = time.monotonic() + 20
        while ucm_bytes(root) > 10 * FILE_LEN and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ucm_bytes(root) <= 10 * FILE_LEN
        # The small store's own new blocks are the ones kept.
        assert small.ask("read", ids("small", 5)) == {"found": 5}
    finally:
        small.close()
        large.close()


def test_a_store_without_a_capacity_adds_to_the_directory_and_never_evicts(
    tmp_path: Path,
) -> None:
    """A store without a capacity, beside one with room for 10 blocks: it
    dumps three times that, evicts none of it, and each of its blocks stays
    (the other store leaves blocks dumped in the last 10 seconds alone)."""
    root = tmp_path / "store"
    root.mkdir()
    capped = StoreProcess(base_config(root, posix_capacity_gb=capacity_gb(10)))
    uncapped = UcmConnectorFactory.create_connector("UcmPipelineStore", base_config(root))
    try:
        mine = ids("uncapped", 30)
        for k in mine:
            data = [content(k, s) for s in range(SHARDS)]
            uncapped.wait(uncapped.dump([k] * SHARDS, list(range(SHARDS)), rows(data)))
        assert uncapped.stats()["evictions"] == 0
        assert capped.ask("read", mine) == {"found": 30}
        assert ucm_bytes(root) >= 30 * FILE_LEN
        assert uncapped.lookup(mine) == [True] * 30
    finally:
        capped.close()
        uncapped.close()
