"""The extension's same-run baselines the benchmarks divide by: plain
O_DIRECT I/O and the load checksum on bytes in memory.

They exist only in an extension built with the ``bench`` cargo feature
(``maturin develop --release --features bench``, as ``tools/setup.sh``
builds it); wheels leave them out. A benchmark calls :func:`require` first,
so that an extension without them fails at the start, with what to do.
"""

from __future__ import annotations

from pathlib import Path

from ucm import _native

MISSING = (
    "this benchmark needs the native extension built with the `bench` feature "
    "(the measurement baselines are not in wheels): run tools/setup.sh, or "
    "maturin develop --release --features bench"
)


def require() -> None:
    """Exits with :data:`MISSING` unless the extension has the baselines."""
    if not hasattr(_native, "baseline_direct_io_gbps"):
        raise SystemExit(MISSING)


def direct_io_gbps(
    directory: str | Path, op: str, total_bytes: int, io_size: int, queue_depth: int
) -> float:
    """GB/s of plain sequential O_DIRECT ``op`` ("read" or "write") of a
    scratch file in ``directory``, ``io_size`` I/Os at ``queue_depth``."""
    require()
    return _native.baseline_direct_io_gbps(str(directory), op, total_bytes, io_size, queue_depth)


def checksum_gbps(total_bytes: int, piece_bytes: int, threads: int) -> float:
    """GB/s of the load checksum over ``total_bytes`` in memory, in shards of
    ``piece_bytes``, on ``threads`` threads."""
    require()
    return _native.baseline_checksum_gbps(total_bytes, piece_bytes, threads)
