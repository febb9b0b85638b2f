"""``ucm bench``: how fast a store moves blocks in a directory of yours,
against the raw disk (plain O_DIRECT pwrite/pread of the same bytes, I/O
size and queue depth, measured in the same run)."""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import click
import numpy as np
from tqdm import tqdm

QUEUE_DEPTH = 4


@click.command()
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--mib", default=256, show_default=True, help="MiB moved per measurement.")
@click.option("--block-kib", default=1024, show_default=True, help="Block size in KiB.")
@click.option("--rounds", default=3, show_default=True, help="Measurements per figure (median).")
@click.option(
    "--direct/--buffered",
    default=True,
    show_default=True,
    help="O_DIRECT for the store (the baseline is always O_DIRECT).",
)
def bench(directory: str, mib: int, block_kib: int, rounds: int, direct: bool) -> None:
    """Dump and load GB/s of a Posix store in DIRECTORY against the raw disk.

    A scratch directory is made inside DIRECTORY and removed afterwards."""
    import ucm.store
    from ucm.cli.raw_disk import direct_io_gbps

    parent = Path(directory)
    parent.mkdir(parents=True, exist_ok=True)
    block = block_kib << 10
    total = (mib << 20) // block * block
    n = total // block
    src = np.random.default_rng(0).integers(0, 255, total, dtype=np.uint8)
    dst = np.zeros_like(src)
    rows = [[src[i * block : (i + 1) * block]] for i in range(n)]
    out = [[dst[i * block : (i + 1) * block]] for i in range(n)]
    figures: dict[str, list[float]] = {k: [] for k in ("dump", "load", "disk write", "disk read")}
    with (
        tempfile.TemporaryDirectory(dir=parent, prefix="ucm-bench-") as scratch,
        tqdm(total=4 * rounds, desc="measuring", unit="run") as bar,
    ):
        for r in range(rounds):
            root = Path(scratch).resolve() / f"round{r}"  # stores take absolute dirs
            root.mkdir()
            store = ucm.store.open(
                {
                    "store_pipeline": "Posix",
                    "storage_backends": str(root),
                    "block_size": block,
                    "io_direct": direct,
                    "io_threads": QUEUE_DEPTH,
                    "timeout_ms": 0,
                },
            )
            ids = [r.to_bytes(8, "little") + i.to_bytes(8, "little") for i in range(n)]
            for name, call, buf in (("dump", store.dump, rows), ("load", store.load, out)):
                t0 = time.perf_counter()
                store.wait(call(ids, [0] * n, buf))
                figures[name].append(total / (time.perf_counter() - t0) / 1e9)
                bar.update()
            store.close()
            for name, op in (("disk write", "write"), ("disk read", "read")):
                figures[name].append(direct_io_gbps(scratch, op, total, block, QUEUE_DEPTH))
                bar.update()
    if not np.array_equal(src, dst):
        raise click.ClickException("loaded bytes differ from the dumped ones")
    med = {k: statistics.median(v) for k, v in figures.items()}
    click.echo(
        f"{n} blocks of {block_kib} KiB ({total >> 20} MiB), queue depth {QUEUE_DEPTH}, "
        f"median of {rounds} (GB/s)"
    )
    click.echo(
        f"  dump {med['dump']:6.2f}   disk write {med['disk write']:6.2f}   "
        f"x{med['dump'] / med['disk write']:.2f}"
    )
    click.echo(
        f"  load {med['load']:6.2f}   disk read  {med['disk read']:6.2f}   "
        f"x{med['load'] / med['disk read']:.2f}"
    )
