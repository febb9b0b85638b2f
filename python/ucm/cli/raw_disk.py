"""The raw disk figure ``ucm bench`` sets a store against: plain sequential
O_DIRECT ``pwrite``/``pread`` of a scratch file, no engine, no store.

``queue_depth`` threads each move their contiguous share of the file, one
``io_size`` I/O per call (the GIL is released for each system call, so the
threads keep that many I/Os in flight). A read first has the file written
in full, untimed and synced, so it reads allocated, written blocks; O_DIRECT
keeps the page cache out of it. The scratch file is removed however the
measurement ends.
"""

from __future__ import annotations

import itertools
import mmap
import os
import random
import threading
import time
from pathlib import Path

#: O_DIRECT needs offsets, lengths and buffers aligned to this.
ALIGN = 4096

_SEQ = itertools.count()


def _align_up(n: int) -> int:
    return -(-max(n, 1) // ALIGN) * ALIGN


def _aligned_buffer(size: int, seed: int) -> mmap.mmap:
    """Page-aligned memory (an anonymous map) filled with random bytes."""
    buf = mmap.mmap(-1, size)
    buf.write(random.Random(seed).randbytes(size))
    return buf


def _move(fd: int, op: str, buf: mmap.mmap, offset: int) -> None:
    """One I/O of the whole buffer at ``offset``, retrying short transfers."""
    view = memoryview(buf)
    done = 0
    while done < len(view):
        part = view[done:]
        n = (
            os.preadv(fd, [part], offset + done)
            if op == "read"
            else os.pwrite(fd, part, offset + done)
        )
        if n <= 0:
            raise OSError(f"raw disk {op}: no progress at offset {offset + done}")
        done += n


def direct_io_gbps(
    directory: str | Path, op: str, total_bytes: int, io_size: int, queue_depth: int
) -> float:
    """GB/s (10^9 bytes per second) of one timed pass of ``op`` ("read" or
    "write") over a scratch file in ``directory`` of ``total_bytes`` rounded
    down to whole I/Os per thread (at least one each); ``io_size`` is rounded
    up to 4 KiB."""
    if op not in ("read", "write"):
        raise ValueError(f'op must be "read" or "write", got {op!r}')
    io_size = _align_up(io_size)
    qd = max(queue_depth, 1)
    ios = max(total_bytes // io_size // qd, 1)
    share = ios * io_size
    path = Path(directory) / f".ucm-raw-disk-{os.getpid()}-{next(_SEQ)}.dat"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, share * qd)
        except OSError:
            os.ftruncate(fd, share * qd)
        if op == "read":
            chunk = _aligned_buffer(io_size, 7)
            for off in range(0, share * qd, io_size):
                _move(fd, "write", chunk, off)
            os.fdatasync(fd)
        return share * qd / max(_timed_pass(fd, op, io_size, ios, qd), 1e-9) / 1e9
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


def _timed_pass(fd: int, op: str, io_size: int, ios: int, qd: int) -> float:
    """Seconds for ``qd`` threads to move their shares, timed from a common start."""
    start = threading.Barrier(qd + 1)
    errors: list[BaseException] = []

    buffers = [_aligned_buffer(io_size, t + 1) for t in range(qd)]

    def worker(t: int) -> None:
        start.wait()
        try:
            for i in range(ios):
                _move(fd, op, buffers[t], (t * ios + i) * io_size)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(qd)]
    for th in threads:
        th.start()
    start.wait()
    t0 = time.perf_counter()
    for th in threads:
        th.join()
    secs = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return secs
