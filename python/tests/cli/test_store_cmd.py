"""``ucm store``: info, ls, verify, gc and clear on a real Posix store; its
JSON output; and at scale, what ``info`` reads (no stat per block unless
asked) and ``verify`` on every core."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support.store_cli import SHARD, block_path, fill, run, run_on_terminal


def test_info_ls_verify_on_a_directory(tmp_path: Path) -> None:
    ids = fill(tmp_path, 4)
    code, out = run("info", "--dir", str(tmp_path), "--ages")
    assert code == 0 and "blocks     4" in out and "< 1 hour   4" in out, out
    assert "marker     format 1" in out and "bytes      65536 " in out, out
    code, out = run("ls", "--dir", str(tmp_path))
    assert code == 0 and {i.hex() for i in ids} <= set(out.split())
    code, out = run("verify", "--dir", str(tmp_path))
    assert code == 0 and "4 of 4 block(s) verified, 0 corrupt" in out
    # One bit flipped in the data of block 3's second shard (each shard is a
    # 4 KiB header, then its data).
    path = block_path(tmp_path, ids[2])
    raw = bytearray(path.read_bytes())
    raw[(4096 + SHARD) + 4096 + 100] ^= 1
    path.write_bytes(bytes(raw))
    code, out = run("verify", "--dir", str(tmp_path))
    assert code == 1
    assert f"corrupt {ids[2].hex()}" in out and "shard 1: data checksum mismatch" in out
    code, out = run("verify", "--dir", str(tmp_path), "--remove", "--yes")
    assert code == 0 and not path.exists(), out
    assert "3 of 4 block(s) verified, 1 corrupt (1 removed)" in out, out


def test_gc_removes_what_a_killed_store_left_and_corrupt_blocks(tmp_path: Path) -> None:
    ids = fill(tmp_path, 2)
    writer = textwrap.dedent(
        f"""
        import os, signal
        from ucm.store import UcmConnectorFactory
        UcmConnectorFactory.create_connector("UcmPipelineStore", {{
            "storage_backends": {str(tmp_path)!r}, "block_size": {2 * SHARD},
            "shard_size": {SHARD}}})
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    subprocess.run([sys.executable, "-c", writer], check=False)
    # The killed store adopted the closed one's spares; its own directory stays.
    assert len(list((tmp_path / ".work").iterdir())) == 1
    path = block_path(tmp_path, ids[0])
    path.write_bytes(path.read_bytes()[:100])  # truncated
    code, out = run("gc", "--dir", str(tmp_path), "--yes")
    assert code == 0, out
    assert "removed 1 corrupt block(s)" in out and not path.exists(), out
    assert list((tmp_path / ".work").iterdir()) == []
    assert run("verify", "--dir", str(tmp_path))[0] == 0


def test_clear_asks_first(tmp_path: Path) -> None:
    fill(tmp_path, 3)
    code, out = run_on_terminal("clear", "--dir", str(tmp_path), answer="n\n")
    assert code != 0 and "3 block file(s)" in out, out
    assert "blocks     3" in run("info", "--dir", str(tmp_path))[1]
    code, out = run_on_terminal("clear", "--dir", str(tmp_path), answer="y\n")
    assert code == 0 and "removed 3 block(s)" in out, out
    assert run("clear", "--dir", str(tmp_path), "--yes")[0] == 0


@pytest.mark.parametrize("shape", ["connector", "flat"])
def test_config_files_name_the_store(tmp_path: Path, shape: str) -> None:
    root = tmp_path / "kv"
    fill(root, 2)
    cfg = tmp_path / "c.yaml"
    if shape == "connector":
        cfg.write_text(
            "ucm_connectors:\n  - ucm_connector_name: UcmPipelineStore\n"
            f"    ucm_connector_config:\n      store_pipeline: Cache|Posix\n"
            f"      storage_backends: {root}\n      posix_capacity_gb: 1\n"
        )
    else:
        cfg.write_text(f"store_pipeline: Posix\nstorage_backends: {root}\nblock_size: 8192\n")
    code, out = run("info", "--config", str(cfg))
    assert code == 0 and "blocks     2" in out, out
    assert run("info")[0] != 0  # neither --dir nor --config
    bad = tmp_path / "bad.yaml"
    bad.write_text("store_pipeline: Cache|Empty\n")
    code, out = run("info", "--config", str(bad))
    assert code != 0 and "Posix, S3 and NFS" in out


def test_the_directory_is_taken_as_an_argument_too(tmp_path: Path) -> None:
    ids = fill(tmp_path, 2)
    code, by_option = run("info", "--dir", str(tmp_path), "--format", "json")
    assert code == 0, by_option
    code, by_argument = run("info", str(tmp_path), "--format", "json")
    assert code == 0 and json.loads(by_argument) == json.loads(by_option), by_argument
    code, out = run("ls", str(tmp_path))
    assert code == 0 and {i.hex() for i in ids} <= set(out.split()), out
    other = tmp_path / "elsewhere"
    code, out = run("info", str(tmp_path), "--dir", str(other))
    assert code == 2 and "two store directories given" in out, out
    assert not other.exists()


def test_json_output(tmp_path: Path) -> None:
    ids = fill(tmp_path, 3)
    code, out = run("info", "--dir", str(tmp_path), "--format", "json", "--ages")
    assert code == 0, out
    doc = json.loads(out)
    assert doc["stage"] == "Posix" and doc["location"] == str(tmp_path)
    assert doc["roots"] == [{"path": str(tmp_path), "marker": "format 1"}]
    assert (doc["blocks"], doc["bytes"], doc["ages"]["< 1 hour"]) == (3, 3 * 16384, 3)
    block_path(tmp_path, ids[1]).write_bytes(b"\0" * 100)
    verify = ["verify", "--dir", str(tmp_path), "--format", "json"]
    res = subprocess.run(
        [sys.executable, "-m", "ucm", "store", *verify],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 1, res.stderr
    doc = json.loads(res.stdout)
    assert (doc["blocks"], doc["verified"], doc["removed"]) == (3, 2, 0)
    (failed,) = doc["failed"]
    assert failed["id"] == ids[1].hex() and failed["corrupt"] and "bad magic" in failed["error"]


FILL_MANY = """
    import sys
    import torch
    from ucm.store import UcmConnectorFactory

    root, n = sys.argv[1], int(sys.argv[2])
    store = UcmConnectorFactory.create_connector("UcmPipelineStore", {
        "storage_backends": root, "block_size": 4096, "shard_size": 4096,
        "tensor_size_list": [4096], "posix_spare_files": 0})
    data = [torch.zeros(4096, dtype=torch.uint8)]
    for start in range(0, n, 500):
        ids = [(i + 1).to_bytes(16, "little") for i in range(start, min(n, start + 500))]
        store.wait(store.dump(ids, [0] * len(ids), [data] * len(ids)))
    store.close()
"""


def stat_calls(tmp_path: Path, root: Path, *args: str) -> int:
    """Calls of the stat family on paths under `root` by ``ucm store ARGS``."""
    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("strace is not installed")
    trace = tmp_path / "trace"
    traced = ["-f", "-qq", "-y", "-e", "trace=statx,newfstatat,lstat,stat", "-o", str(trace)]
    res = subprocess.run(
        [strace, *traced, sys.executable, "-m", "ucm", "store", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout + res.stderr[-2000:]
    return sum(str(root) in line for line in trace.read_text().splitlines())


def test_info_at_scale_reads_no_block_it_does_not_need(tmp_path: Path) -> None:
    """On 3000 blocks: `info` lists the block directories and stats one block
    of each (the bytes' sample); `--ages` stats every block; `verify` reads
    them all, on the store's threads."""
    root = tmp_path / "kv"
    n = 3000
    subprocess.run(
        [sys.executable, "-c", textwrap.dedent(FILL_MANY), str(root), str(n)],
        check=True,
        timeout=600,
    )
    calls = stat_calls(tmp_path, root, "info", "--dir", str(root))
    assert calls < 600, f"{calls} stat calls for {n} blocks"
    code, out = run("info", "--dir", str(root))
    assert code == 0 and f"blocks     {n}\n" in out and f"~{n * 8192} " in out, out
    assert "ages       not read" in out
    calls = stat_calls(tmp_path, root, "info", "--dir", str(root), "--ages")
    assert calls >= n, calls
    code, out = run("verify", "--dir", str(root))
    assert code == 0 and f"{n} of {n} block(s) verified, 0 corrupt" in out, out


def json_of(*args: str) -> dict:
    """``python -m ucm store ARGS --format json``: its stdout, parsed."""
    res = subprocess.run(
        [sys.executable, "-m", "ucm", "store", *args, "--format", "json"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    return json.loads(res.stdout)


def test_ls_gc_and_clear_answer_in_json(tmp_path: Path) -> None:
    """Every ``ucm store`` command takes ``--format json``: one document on
    stdout, what a command that removes says on stderr."""
    ids = fill(tmp_path, 3)
    doc = json_of("ls", str(tmp_path))
    assert doc["location"] == str(tmp_path)
    assert sorted(b["id"] for b in doc["blocks"]) == sorted(i.hex() for i in ids)
    assert all(b["bytes"] > 0 and b["age_s"] >= 0 for b in doc["blocks"])

    path = block_path(tmp_path, ids[0])
    path.write_bytes(path.read_bytes()[:100])  # truncated: gc removes it
    doc = json_of("gc", str(tmp_path), "--yes")
    # The corrupt block, and the spare files the filling store left.
    assert sorted(p["kind"] for p in doc["planned"]) == ["corrupt", "work"], doc
    assert doc["removed"]["corrupt"]["items"] == 1 and not path.exists()

    doc = json_of("clear", str(tmp_path), "--dry-run")
    assert doc["dry_run"] and doc["removed"] is None and len(doc["planned"]) == 2
    assert all(block_path(tmp_path, i).exists() for i in ids[1:]), "a dry run removed blocks"

    doc = json_of("clear", str(tmp_path), "--yes")
    assert doc["removed"]["block"]["items"] == 2 and doc["failed"] == []
    assert not any(block_path(tmp_path, i).exists() for i in ids[1:])
