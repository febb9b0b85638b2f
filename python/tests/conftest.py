"""Shared fixtures: stores on real temporary directories, small tmpfs mounts."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol, TypeVar

import pytest

# Triton kernels run on the CPU through the interpreter unless a GPU run
# asks otherwise; it must be set before anything imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")

from support.mooncake_server import MooncakeCluster
from support.servers import MotoServer, NfsServer
from support.store_helpers import base_config

import ucm.store
from ucm.store import UcmKVStoreBase


class _Server(Protocol):
    def close(self) -> None: ...


S = TypeVar("S", bound=_Server)


def _running(
    start: Callable[[], S], what: str, missing: tuple[type[Exception], ...]
) -> Iterator[S]:
    """A fixture's body for a local server: skip the test when the machine
    can't run it (``missing``), and stop the server after it."""
    try:
        server = start()
    except missing as e:
        pytest.skip(f"no {what}: {e}")
    yield server
    server.close()


@pytest.fixture(scope="module")
def moto() -> Iterator[MotoServer]:
    """A local S3 server (moto) for the module's tests."""
    yield from _running(MotoServer, "S3 server (moto)", (FileNotFoundError,))


@pytest.fixture(scope="module")
def nfs() -> Iterator[NfsServer]:
    """A local NFS server for the module's tests."""
    yield from _running(NfsServer, "NFS server", (FileNotFoundError, PermissionError))


@pytest.fixture(scope="session")
def mooncake() -> Iterator[MooncakeCluster]:
    """A Mooncake master and store service on two private hosts, shared by
    the session's tests (each uses its own key prefix)."""
    yield from _running(MooncakeCluster, "Mooncake cluster", (FileNotFoundError,))


@pytest.fixture
def make_store(tmp_path: Path) -> Iterator[Callable[..., UcmKVStoreBase]]:
    """Creates Posix stores under ``tmp_path`` (a disk directory, not tmpfs)."""
    made: list[UcmKVStoreBase] = []

    def make(root: Path | None = None, **overrides: Any) -> UcmKVStoreBase:
        root = root or tmp_path / "store"
        root.mkdir(parents=True, exist_ok=True)
        store = ucm.store.open(base_config(root, **overrides))
        made.append(store)
        return store

    yield make
    for s in made:
        s.close()


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Callable[[str, str], Path]]:
    """Mounts size-limited tmpfs file systems (needs root, as in CI)."""
    mounts: list[Path] = []

    def mount(size: str, options: str = "") -> Path:
        target = tmp_path / f"mnt-{uuid.uuid4().hex[:8]}"
        target.mkdir()
        opts = f"size={size}" + (f",{options}" if options else "")
        res = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(target)],
            capture_output=True,
            text=True,
        )
        if res.returncode != 0:
            if os.geteuid() != 0:
                pytest.skip(f"mounting a tmpfs needs root: {res.stderr.strip()}")
            raise RuntimeError(f"mount failed: {res.stderr}")
        mounts.append(target)
        return target

    yield mount
    for m in reversed(mounts):
        subprocess.run(["umount", "-l", str(m)], check=False)
