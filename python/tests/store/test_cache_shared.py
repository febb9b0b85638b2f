"""Shared-memory cache mode (``share_buffer_enable``) across real processes:
a block dumped by one process is a memory hit for another and for a
lookup-only scheduler; a participant killed with SIGKILL while holding the
cache lock neither blocks the others nor leaks the segment. A kept segment
whose bytes or slot table were changed after its last process left is
never trusted by the next one: changed shards are misses (read from Posix,
never written to it), a garbled table is discarded with a warning, and
/dev/shm filling up after start cannot crash the process. Nothing in a
segment hangs a process: garbage in its lock has it replaced, and a live
process holding the lock forever costs the others the lock's bound."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
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
    from test_cache_shared import shared_cfg, content, rows, bid, put
    import numpy as np
    from ucm.store import UcmConnectorFactory
    from support import store_debug

    cfg = json.loads(sys.argv[1])
    action = sys.argv[2]
    if action == "open":
        from ucm.store import StoreTimeoutError
        try:
            UcmConnectorFactory.create_connector("UcmPipelineStore", cfg).close()
        except StoreTimeoutError as e:
            print("TIMEOUT-ERROR", e, flush=True)
        else:
            print("OPENED", flush=True)
        sys.exit(0)
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
    elif action == "load-all":
        # A restarted engine: every block the parent stored, checked.
        for n in json.loads(sys.argv[3]):
            out = [np.zeros({shard}, dtype=np.uint8) for _ in range({shards})]
            store.wait(store.load([bid(n)] * {shards}, list(range({shards})), rows(out)))
            for s in range({shards}):
                assert np.array_equal(out[s], content(bid(n), s)), ("wrong bytes", n, s)
        print("STATS", json.dumps(store.get_stats()), flush=True)
    elif action == "dump-and-exit":
        # Dies right after its dump, leaving the block dirty in the segment.
        put(store, bid(1))
        print("DUMPED", flush=True)
        import os
        os._exit(0)
    elif action == "flush":
        store.flush()
        print("STATS", json.dumps(store.get_stats()), flush=True)
    elif action == "hang":
        out = [np.zeros({shard}, dtype=np.uint8) for _ in range({shards})]
        store.wait(store.dump([bid(5)] * {shards}, list(range({shards})),
                              rows([content(bid(5), s) for s in range({shards})])))
        print("LOCKED", flush=True)
        store_debug.hold_lock_forever(store)
    elif action == "ops-when-told":
        # A participant whose lock someone else holds: each operation's outcome.
        put(store, bid(1))
        print("READY", flush=True)
        sys.stdin.readline()
        def attempt(name, op):
            try:
                op()
                print(name, "ok", flush=True)
            except Exception as e:
                print(name, type(e).__name__, e, flush=True)
        def get():
            out = [np.zeros({shard}, dtype=np.uint8) for _ in range({shards})]
            store.wait(store.load([bid(1)] * {shards}, list(range({shards})), rows(out)))
            assert all(np.array_equal(out[s], content(bid(1), s)) for s in range({shards}))
        attempt("LOOKUP", lambda: store.lookup([bid(1)]))
        attempt("DUMP", lambda: put(store, bid(2)))
        attempt("LOAD", get)
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


def run_child(cfg: dict[str, Any], action: str, *args: str, **kw: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, json.dumps(cfg), action, *args],
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
    for n in range(16):  # fills the 4 MiB cache
        put(store, bid(n))
    print("FILLED", flush=True)
    """
).format(path=CHILD_PATH)


def run_with_small_shm(script: str, cfg: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    """Runs ``script`` (given ``cfg`` as JSON) in a mount namespace whose
    ``/dev/shm`` is an 8 MiB tmpfs; skips where that can't be set up."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small /dev/shm needs root")
    mount = 'mount -t tmpfs -o size=8m tmpfs /dev/shm && exec "$0" "$@"'
    argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount]
    try:
        probe = subprocess.run([*argv, "true"], capture_output=True, timeout=30)
    except FileNotFoundError:
        pytest.skip("no unshare here")
    if probe.returncode != 0:
        pytest.skip(f"no mount namespace here: {probe.stderr.decode()[-300:]}")
    return subprocess.run(
        [*argv, sys.executable, "-c", script, json.dumps(cfg)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_segment_too_big_for_the_free_shm_is_refused_at_start(tmp_path: Path, uid: str) -> None:
    """A shared segment's pages are reserved in ``/dev/shm`` when it is
    created (a page first written into a full one would be a SIGBUS): one
    that the free space can't hold is refused then, naming the segment and
    the figures, instead of killing the process once the cache fills."""
    cfg = shared_cfg(tmp_path, uid, cache_buffer_capacity_gb=4 / 1024)
    child = run_with_small_shm(SMALL_SHM, cfg)
    assert child.returncode == 0, (child.returncode, child.stderr[-3000:])
    assert "REFUSED" in child.stdout, child.stdout
    assert f"/dev/shm/ucm_cache_{uid}" in child.stdout and "MiB free" in child.stdout


# ----------------------------------------------- a kept segment changed offline


def kept_cfg(root: Path, uid: str, **kw: Any) -> dict[str, Any]:
    return shared_cfg(root, uid, share_buffer_keep=True, write_back_policy="sync", **kw)


def child_stats(cfg: dict[str, Any], action: str, *args: str) -> tuple[dict[str, float], str]:
    """Runs ``action`` in a fresh process, as a restarted engine; its
    statistics and its log."""
    child = run_child(cfg, action, *args)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, (child.returncode, err[-3000:])
    line = next(x for x in out.splitlines() if x.startswith("STATS "))
    return json.loads(line[len("STATS ") :]), err


def slot_offset(shm: Path, data: np.ndarray) -> int:
    """Offset in the segment file of the slot holding ``data``."""
    raw = shm.read_bytes()
    needle = data.tobytes()
    for off in range(0, len(raw) - len(needle), 4096):
        if raw[off : off + len(needle)] == needle:
            return off
    raise AssertionError(f"shard not found in {shm}")


def flip_byte(shm: Path, off: int) -> None:
    """Changes one byte of the segment file, as a stray writer would."""
    with open(shm, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x40]))


def keep_segment(cfg: dict[str, Any], blocks: list[int]) -> Path:
    """Stores ``blocks`` through a kept segment, then leaves it."""
    store = UcmConnectorFactory.create_connector("UcmPipelineStore", cfg)
    shm = Path(store.describe()["shm_path"])
    for n in blocks:
        put(store, bid(n))
    store.close()
    assert shm.exists(), "kept segment removed"
    return shm


def test_a_byte_flipped_in_a_kept_segment_is_read_from_posix(tmp_path: Path, uid: str) -> None:
    cfg = kept_cfg(tmp_path, uid)
    shm = keep_segment(cfg, [1, 2])
    try:
        flip_byte(shm, slot_offset(shm, content(bid(1), 2)) + 999)
        stats, _ = child_stats(cfg, "load-all", "[1, 2]")
        assert stats["corrupt_shards"] == 1, stats
        assert stats["bypass_loads"] == 1, "the flipped shard came from Posix"
    finally:
        shm.unlink(missing_ok=True)


def test_a_byte_flipped_before_write_back_never_reaches_posix(tmp_path: Path, uid: str) -> None:
    cfg = shared_cfg(tmp_path, uid, share_buffer_keep=True)  # lazy write-back
    shm = Path(f"/dev/shm/ucm_cache_{uid}")
    try:
        child = run_child(cfg, "dump-and-exit")
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0 and "DUMPED" in out, err[-3000:]
        flip_byte(shm, slot_offset(shm, content(bid(1), 2)) + 5)
        # The next process adopts the dead one's dirty block and flushes it.
        stats, _ = child_stats(cfg, "flush")
    finally:
        shm.unlink(missing_ok=True)
    posix = UcmConnectorFactory.create_connector("UcmPipelineStore", base_config(tmp_path))
    try:
        assert posix.lookup([bid(1)]) == [False], "the flipped block reached Posix"
        assert not list(tmp_path.rglob(bid(1).hex() + "*")), "a block file was written"
    finally:
        posix.close()
    assert stats["corrupt_shards"] == 1, stats
    assert stats["dirty_blocks"] == 0, stats


def test_a_garbled_slot_table_is_discarded_with_a_warning(tmp_path: Path, uid: str) -> None:
    cfg = kept_cfg(tmp_path, uid)
    store = UcmConnectorFactory.create_connector("UcmPipelineStore", cfg)
    facts = store.describe()
    store.close()
    start, end = (int(x) for x in facts["shm_slot_table"].split(".."))
    shm = keep_segment(cfg, [0, 1, 2, 3])
    try:
        junk = np.random.default_rng(7).integers(0, 256, size=end - start, dtype=np.uint8)
        with open(shm, "r+b") as f:
            f.seek(start)
            f.write(junk.tobytes())
        stats, log = child_stats(cfg, "load-all", "[0, 1, 2, 3]")
        assert "PanicException" not in log and "panicked" not in log, log[-3000:]
        assert stats["slots_discarded_at_join"] > 0, stats
        assert log.count("slot table was damaged") == 1, log[-3000:]
    finally:
        shm.unlink(missing_ok=True)


SHM_FILLS_UP = textwrap.dedent(
    """
    import json, sys
    sys.path[:0] = {path!r}
    from test_cache_shared import shared_cfg, put, bid
    from ucm.store import UcmConnectorFactory

    cfg = json.loads(sys.argv[1])
    store = UcmConnectorFactory.create_connector("UcmPipelineStore", cfg)
    # Another program fills what this 8 MiB /dev/shm has left.
    try:
        with open("/dev/shm/filler", "wb") as f:
            for _ in range(8):
                f.write(b"x" * (1 << 20))
                f.flush()
    except OSError as e:
        print("FILLER STOPPED", e, flush=True)
    for n in range(16):  # fills the 4 MiB cache, page by page
        put(store, bid(n))
    print("FILLED", flush=True)
    store.close()
    """
).format(path=CHILD_PATH)


def test_shm_filling_up_after_start_cannot_crash_the_process(tmp_path: Path, uid: str) -> None:
    """The segment's pages are reserved when it is created: another program
    filling ``/dev/shm`` afterwards gets the error itself, and the cache's
    later writes into its pages cannot die of SIGBUS. The start-up commit is
    off, so nothing but the reservation protects those pages."""
    cfg = shared_cfg(tmp_path, uid, cache_buffer_capacity_gb=4 / 1024, cache_prefault=False)
    child = run_with_small_shm(SHM_FILLS_UP, cfg)
    assert child.returncode == 0, (child.returncode, child.stderr[-3000:])
    assert "FILLER STOPPED" in child.stdout and "FILLED" in child.stdout, child.stdout


# ------------------------------------------------------ a lock nobody can take


def finish(child: subprocess.Popen[str], timeout: float) -> tuple[str, str]:
    """Waits for ``child``, killing it if it hangs: its output."""
    try:
        out, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        out, err = child.communicate()
        raise AssertionError(f"hung for {timeout} s\n{out[-2000:]}\n{err[-3000:]}") from None
    assert child.returncode == 0, (child.returncode, out[-2000:], err[-3000:])
    return out, err


def wait_line(child: subprocess.Popen[str], marker: str, timeout: float = 60) -> None:
    """Waits until ``child`` prints ``marker``, failing if it doesn't in time."""
    seen = threading.Event()

    def read() -> None:
        assert child.stdout is not None
        for line in child.stdout:
            if marker in line:
                seen.set()
                return

    threading.Thread(target=read, daemon=True).start()
    if not seen.wait(timeout):
        child.kill()
        err = child.stderr.read() if child.stderr else ""
        raise AssertionError(f"no {marker} within {timeout} s: {err[-3000:]}")


@pytest.mark.parametrize("damage", ["random bytes", "held by a stranger"])
def test_garbage_in_a_kept_segments_lock_is_replaced_with_a_warning(
    tmp_path: Path, uid: str, damage: str
) -> None:
    """Garbage over a kept segment's lock never hangs or crashes the next
    process, nor fails its start: the segment is replaced, with one warning
    naming it, and its blocks are read from Posix. Bytes that cannot be a
    mutex of ours are seen at once (the bound, half of ``timeout_ms``, is far
    above the child's limit); a well-formed lock word naming a live thread
    that is no participant costs the bound, here 1 s."""
    random = damage == "random bytes"
    cfg = kept_cfg(tmp_path, uid, timeout_ms=600_000 if random else 2000)
    store = UcmConnectorFactory.create_connector("UcmPipelineStore", cfg)
    start, end = (int(x) for x in store.describe()["shm_lock"].split(".."))
    store.close()
    shm = keep_segment(cfg, [0, 1])
    try:
        inode = shm.stat().st_ino
        with open(shm, "r+b") as f:
            if random:
                f.seek(start)
                f.write(np.random.default_rng(11).bytes(end - start))
            else:
                me = os.getpid().to_bytes(4, "little")
                f.seek(start)  # the lock word
                f.write(me)
                f.seek(start + 8)  # its owner
                f.write(me)
        out, log = finish(run_child(cfg, "load-all", "[0, 1]"), timeout=60)
        stats = json.loads(next(x for x in out.splitlines() if x.startswith("STATS "))[6:])
        assert stats["l1_hits"] == 0, stats
        assert shm.stat().st_ino != inode, "the damaged segment was kept"
        assert "PanicException" not in log and "panicked" not in log, log[-3000:]
        warnings = [x for x in log.splitlines() if str(shm) in x and "its lock" in x]
        assert len(warnings) == 1, log[-3000:]
    finally:
        shm.unlink(missing_ok=True)


def test_a_live_lock_holder_fails_a_new_open_and_bounds_the_others(
    tmp_path: Path, uid: str
) -> None:
    """A live process holding the lock forever (stuck, stopped) hangs
    nobody: a new process's open fails within the lock's bound (half of
    ``timeout_ms``, 1 s here)
    with a timeout naming the segment, the live processes and what to do;
    a participant's lookup and dump fail within it, and its load is a miss
    read from Posix."""
    cfg = shared_cfg(tmp_path, uid, timeout_ms=2000, write_back_policy="sync")
    shm = Path(f"/dev/shm/ucm_cache_{uid}")
    part = run_child(cfg, "ops-when-told", stdin=subprocess.PIPE)
    hold = None
    try:
        wait_line(part, "READY")
        hold = run_child(cfg, "hang")
        wait_line(hold, "LOCKED")
        out, _ = finish(run_child(cfg, "open"), timeout=60)
        assert "TIMEOUT-ERROR" in out, out
        for needle in (str(shm), str(hold.pid), str(part.pid), f"rm {shm}"):
            assert needle in out, (needle, out)
        assert part.stdin is not None
        part.stdin.write("GO\n")
        part.stdin.flush()
        out, _ = finish(part, timeout=60)
        for needle in ("LOOKUP StoreTimeoutError", "DUMP StoreTimeoutError", "LOAD ok"):
            assert needle in out, (needle, out)
    finally:
        for child in (part, hold):
            if child is not None and child.poll() is None:
                child.kill()
                child.wait(timeout=30)
        shm.unlink(missing_ok=True)
