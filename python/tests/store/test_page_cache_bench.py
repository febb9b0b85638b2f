"""The benchmarks' page-cache helper (``benches/page_cache.py``) on a real
file: ``evict`` drops it, ``page_in`` reports what was missing and brings it
back, and a second ``page_in`` finds nothing missing."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[3]


def _helper() -> ModuleType:
    spec = importlib.util.spec_from_file_location("page_cache", REPO / "benches" / "page_cache.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _resident(pc: ModuleType, path: Path) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        return pc.resident_bytes(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def test_page_in_reports_and_restores_what_left_the_page_cache(tmp_path: Path) -> None:
    pc = _helper()
    size = 8 << 20
    sub = tmp_path / "ab"
    sub.mkdir()
    block = sub / "block"
    block.write_bytes(os.urandom(size))
    (tmp_path / "empty").touch()
    (tmp_path / "link").symlink_to(block)  # not a second copy of its bytes
    work = tmp_path / ".work"  # a store's spares: no load reads them
    work.mkdir()
    (work / "spare.0").write_bytes(bytes(1 << 20))

    assert pc.evict(tmp_path) == size
    left = size - _resident(pc, block)
    if left == 0:
        pytest.skip(f"{tmp_path}'s file system keeps files in memory (tmpfs?)")

    total, missing = pc.page_in(tmp_path)
    assert total == size
    assert missing == left
    assert _resident(pc, block) == size
    assert pc.page_in(tmp_path) == (size, 0)
