"""Shared-memory cache mode (``share_buffer_enable``) across real processes:
a block dumped by one process is a memory hit for another and for a
lookup-only scheduler; a participant killed with SIGKILL while holding the
cache lock neither blocks the others nor leaks the segment."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.store_helpers import SHARD, SHARDS, base_config

from ucm.store import InvalidParamError, UcmConnectorFactory

#: The child imports this module (its folder) and ``support`` (the tests folder).
CHILD_PATH = [str(Path(__file__).parent), str(Path(__file__).parents[1])]

CHILD = textwrap.dedent(
    """
    import json, sys
    sys.path[:0] = {path!r}
    from test_cache_shared import shared_cfg, content, rows, bid
    import numpy as np
    from ucm.store import UcmConnectorFactory
    from ucm.testing import store_debug

    cfg = json.loads(sys.argv[1])
    action = sys.argv[2]
    store = UcmConnectorFactory.create_connector("UcmPipelineStore", cfg)
    if action == "read":
        # The block is only in the shared cache (lazy write-back): a hit here
        # proves the memory is shared.
        assert store.lookup([bid(1)]) == [True], "not visible"
        out = [np.zeros({shard}, dtype=np.uint8) for _ in range({shards})]
        store.wait(store.load([bid(1)] * {shards}, list(range({shards})), rows(out)))
        for s in range({shards}):
            assert np.array_equal(out[s], content(bid(1), s))
        stats = store.get_stats()
        assert stats["l1_hits"] == {shards}, stats
        print("READ-OK", flush=True)
    elif action == "lookup":
        print("LOOKUP", store.lookup([bid(1), bid(2)]), flush=True)
    elif action == "hang":
        out = [np.zeros({shard}, dtype=np.uint8) for _ in range({shards})]
        store.wait(store.dump([bid(5)] * {shards}, list(range({shards})),
                              rows([content(bid(5), s) for s in range({shards})])))
        print("LOCKED", flush=True)
        store_debug.hold_lock_forever(store)
    store.close()
    """
).format(path=CHILD_PATH, shard=SHARD, shards=SHARDS)


def content(b: bytes, shard: int) -> np.ndarray:
    seed = int.from_bytes(b[:8], "little") * 7 + shard
    return np.random.default_rng(seed).integers(0, 256, size=SHARD, dtype=np.uint8)


def rows(arrs: list[np.ndarray]) -> list[list[np.ndarray]]:
    return [[a[: SHARD // 2], a[SHARD // 2 :]] for a in arrs]


def bid(n: int) -> bytes:
    return n.to_bytes(8, "little") + b"\x17" * 8


def shared_cfg(root: Path, uid: str, **kw: Any) -> dict[str, Any]:
    cfg = base_config(
        root,
        store_pipeline="Cache|Posix",
        cache_buffer_capacity_gb=32 * SHARD / (1 << 30),
        share_buffer_enable=True,
        unique_id=uid,
        write_back_policy="lazy",
    )
    cfg["storage_backends"] = str(root)
    cfg.update(kw)
    return cfg


def run_child(cfg: dict[str, Any], action: str, **kw: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, json.dumps(cfg), action],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


@pytest.fixture
def uid() -> str:
    return f"pytest-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def put(store: Any, b: bytes) -> None:
    data = [content(b, s) for s in range(SHARDS)]
    store.wait(store.dump([b] * SHARDS, list(range(SHARDS)), rows(data)))


def test_two_processes_and_a_scheduler_share_one_cache(tmp_path: Path, uid: str) -> None:
    cfg = shared_cfg(tmp_path, uid)
    store = UcmConnectorFactory.create_connector("UcmPipelineStore", cfg)
    shm = Path(store.describe()["shm_path"])
    assert shm.exists()
    put(store, bid(1))
    assert not store.stats()["blocks"], "lazy: not in Posix yet"
    child = run_child(cfg, "read")
    out, err = child.communicate(timeout=60)
    assert child.returncode == 0 and "READ-OK" in out, err[-3000:]
    # A lookup-only scheduler (device_id = -1) sees the workers' memory.
    sched = run_child(dict(cfg, device_id=-1), "lookup")
    out, err = sched.communicate(timeout=60)
    assert sched.returncode == 0, err[-3000:]
    assert "LOOKUP [True, False]" in out
    # Another layout is rejected while the segment is in use.
    with pytest.raises(InvalidParamError, match="another layout"):
        UcmConnectorFactory.create_connector(
            "UcmPipelineStore", dict(cfg, cache_buffer_capacity_gb=64 * SHARD / (1 << 30))
        )
    store.close()  # flushes: block 1 reaches Posix
    assert not shm.exists(), "the last participant out removes the segment"
    posix = UcmConnectorFactory.create_connector("UcmPipelineStore", base_config(tmp_path))
    assert posix.lookup([bid(1)]) == [True]
    posix.close()


def test_participant_killed_holding_the_lock(tmp_path: Path, uid: str) -> None:
    cfg = shared_cfg(tmp_path, uid)
    store = UcmConnectorFactory.create_connector("UcmPipelineStore", cfg)
    shm = Path(store.describe()["shm_path"])
    put(store, bid(1))
    child = run_child(cfg, "hang")
    assert child.stdout is not None
    line = child.stdout.readline()
    assert "LOCKED" in line, child.stderr.read() if child.stderr else ""
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    # The robust lock is recovered, the table rebuilt; both blocks (ours and
    # the dead child's, still dirty: lazy) are served and then written back.
    put(store, bid(2))
    for b in (bid(1), bid(2), bid(5)):
        out = [np.zeros(SHARD, dtype=np.uint8) for _ in range(SHARDS)]
        store.wait(store.load([b] * SHARDS, list(range(SHARDS)), rows(out)))
        assert all(np.array_equal(out[s], content(b, s)) for s in range(SHARDS))
    store.close()
    assert not shm.exists(), "segment leaked after the last participant left"
    posix = UcmConnectorFactory.create_connector("UcmPipelineStore", base_config(tmp_path))
    assert posix.lookup([bid(1), bid(2), bid(5)]) == [True] * 3, "orphaned dirty data lost"
    posix.close()


SMALL_SHM = textwrap.dedent(
    """
    import json, sys
    sys.path[:0] = {path!r}
    from test_cache_shared import shared_cfg, put, bid
    from pathlib import Path
    from ucm.store import NoSpaceError, UcmConnectorFactory

    cfg = json.loads(sys.argv[1])
    # Another program's 6 MiB: 2 MiB of this 8 MiB /dev/shm stay free.
    Path("/dev/shm/filler").write_bytes(b"x" * (6 << 20))
    try:
        store = UcmConnectorFactory.create_connector("UcmPipelineStore", cfg)
    except NoSpaceError as e:
        print("REFUSED", e, flush=True)
        sys.exit(0)
    for n in range(16):  # fills the 4 MiB cache: a write into a page /dev/shm can't give dies
        put(store, bid(n))
    print("FILLED", flush=True)
    """
).format(path=CHILD_PATH)


def test_a_segment_too_big_for_the_free_shm_is_refused_at_start(tmp_path: Path, uid: str) -> None:
    """A shared segment is sparse: its pages come out of ``/dev/shm`` when
    first written, and a write that finds it full is a SIGBUS. Opening one
    that the free space can't hold must fail then, naming the segment,
    instead of killing the process once the cache fills."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small /dev/shm needs root")
    cfg = shared_cfg(tmp_path, uid, cache_buffer_capacity_gb=4 / 1024)
    mount = 'mount -t tmpfs -o size=8m tmpfs /dev/shm && exec "$0" "$@"'
    argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount]
    try:
        probe = subprocess.run([*argv, "true"], capture_output=True, timeout=30)
    except FileNotFoundError:
        pytest.skip("no unshare here")
    if probe.returncode != 0:
        pytest.skip(f"no mount namespace here: {probe.stderr.decode()[-300:]}")
    child = subprocess.run(
        [*argv, sys.executable, "-c", SMALL_SHM, json.dumps(cfg)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 0, (child.returncode, child.stderr[-3000:])
    assert "REFUSED" in child.stdout, child.stdout
    assert f"/dev/shm/ucm_cache_{uid}" in child.stdout and "MiB free" in child.stdout
