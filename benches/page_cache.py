"""The page-cache state of a store's files, for benchmarks that load "from
memory" or "from the disk" and must know which one they measured.

A host may reclaim page-cache pages that sat idle for a while (a DAMON
``pageout`` scheme, memory pressure, a balloon driver): then a load that was
meant to come from memory partly reads the disk, and its figure says nothing
about the code under test. :func:`page_in` restores the state the label
claims and reports how much had left; :func:`evict` sets the opposite one.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Iterator
from pathlib import Path

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


def files_under(root: Path) -> Iterator[str]:
    """Every regular file below ``root`` outside hidden directories: those
    are a store's work areas (spare and temporary files), which no load
    reads."""
    for dirpath, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in names:
            path = os.path.join(dirpath, name)
            if os.path.isfile(path) and not os.path.islink(path):
                yield path


def resident_bytes(fd: int, size: int) -> int:
    """Bytes of the open file ``fd`` (``size`` bytes long) in the page cache."""
    if size == 0:
        return 0
    # Python's mmap objects hide their address when read-only, and
    # mincore(2) has no binding in the standard library.
    addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap for mincore: {os.strerror(err)}")
    try:
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = (ctypes.c_ubyte * pages)()
        if _libc.mincore(addr, size, vec) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mincore: {os.strerror(err)}")
        # Bit 0 is "resident"; the others are reserved.
        resident = sum(b & 1 for b in bytes(vec))
    finally:
        _libc.munmap(addr, size)
    return min(resident * mmap.PAGESIZE, size)


def resident_under(root: Path) -> int:
    """Bytes of the files under ``root`` that are in the page cache."""
    total = 0
    for path in files_under(root):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # removed meanwhile
        try:
            total += resident_bytes(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
    return total


def page_in(root: Path) -> tuple[int, int]:
    """Reads every file under ``root`` through the page cache, so the next
    reads of them come from memory. Returns (bytes of those files, bytes of
    them that were not in the page cache before)."""
    buf = bytearray(4 << 20)
    view = memoryview(buf)
    total = missing = 0
    for path in files_under(root):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # removed meanwhile: nothing left to read
        try:
            size = os.fstat(fd).st_size
            missing += size - resident_bytes(fd, size)
            total += size
            off = 0
            while off < size:
                got = os.preadv(fd, [view], off)
                if got == 0:
                    break
                off += got
        finally:
            os.close(fd)
    return total, missing


def evict(root: Path) -> int:
    """Drops the files under ``root`` from the page cache (written back
    first); returns their bytes."""
    os.sync()
    total = 0
    for path in files_under(root):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total
