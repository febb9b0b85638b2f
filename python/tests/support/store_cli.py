"""Helpers of the ``ucm store`` tests: real stores filled through the store
API, the real command (in this process through click's runner, or as a
child process, on a terminal or not), and a record of a directory tree to
tell that nothing in it changed."""

from __future__ import annotations

import hashlib
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import torch
from click.testing import CliRunner

from ucm.cli import main
from ucm.store import UcmConnectorFactory

SHARD = 4096


def fill(root: Path, n: int, first: int = 1, shards: int = 2) -> list[bytes]:
    """Blocks ``[first; 16] .. [first + n - 1; 16]`` of `shards` 4 KiB shards
    each, dumped by a real Posix store in `root` (closed after)."""
    store = UcmConnectorFactory.create_connector(
        "UcmPipelineStore",
        {
            "storage_backends": str(root),
            "block_size": shards * SHARD,
            "shard_size": SHARD,
            "tensor_size_list": [SHARD],
            "posix_spare_files": 2,
        },
    )
    data = torch.arange(shards * SHARD, dtype=torch.int32).to(torch.uint8)
    rows = [[data[s * SHARD : (s + 1) * SHARD]] for s in range(shards)]
    ids = [bytes([first + i]) * 16 for i in range(n)]
    for bid in ids:
        store.wait(store.dump([bid] * shards, list(range(shards)), rows))
    store.close()
    return ids


def block_path(root: Path, bid: bytes) -> Path:
    return root / bid.hex()[:2] / bid.hex()


def run(*args: str, input: str | None = None) -> tuple[int, str]:
    """``ucm store ARGS`` through click's runner (stdin is not a terminal)."""
    res = CliRunner().invoke(main, ["store", *args], input=input)
    return res.exit_code, res.output


def run_child(*args: str) -> tuple[int, str]:
    """``python -m ucm store ARGS`` in a child process, stdin not a terminal."""
    res = subprocess.run(
        [sys.executable, "-m", "ucm", "store", *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return res.returncode, res.stdout + res.stderr


def run_on_terminal(*args: str, answer: str) -> tuple[int, str]:
    """``python -m ucm store ARGS`` with a terminal as its stdin, typing
    `answer` once it asks."""
    master, slave = os.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ucm", "store", *args],
        stdin=slave,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    os.close(slave)
    out = b""
    assert proc.stdout is not None
    deadline = time.monotonic() + 300
    while b"?" not in out and proc.poll() is None and time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if ready:
            out += os.read(proc.stdout.fileno(), 65536)
    os.write(master, answer.encode())
    rest, _ = proc.communicate(timeout=300)
    os.close(master)
    return proc.returncode, (out + rest).decode()


def snapshot(root: Path) -> dict[str, str]:
    """Every entry under `root`, never followed: its kind and the SHA-256 of
    its bytes (a link: its target)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            rel = str(path.relative_to(root))
            if path.is_symlink():
                out[rel] = f"link to {os.readlink(path)}"
            elif path.is_dir():
                out[rel] = "dir"
            elif path.is_file():
                out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
            else:
                out[rel] = "special"
    return out
