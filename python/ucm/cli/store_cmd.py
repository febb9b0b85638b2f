"""``ucm store``: look after a store's contents from outside the engines.

The store is named by a directory (``--dir``, a Posix store) or by a config
file (``--config``): a connector config (``ucm_connectors: ...``, as given
to vLLM) or a flat store config (``store_pipeline: ...``). Its persistent
stage (the one below any ``Cache``) is what these commands read: a Posix
directory, the objects under an S3 prefix, or an NFS export (through the
built-in client or a kernel mount). They work
beside running engines: a live engine's work files are never touched, and a
block removed under it only costs it a miss.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
from tqdm import tqdm

from ucm import _native
from ucm.shared.config import ConfigError, load_yaml

#: Age buckets of ``ucm store info``: (upper bound in seconds, label).
AGES = ((3600, "< 1 hour"), (86400, "< 1 day"), (7 * 86400, "< 1 week"), (30 * 86400, "< 30 days"))


def persistent_stage(values: dict[str, Any], source: str) -> tuple[str, dict[str, Any]]:
    """The lowest stage of a flat store config and its keys."""
    pipeline = str(values.get("store_pipeline", "Posix"))
    stage = pipeline.split("|")[-1].strip()
    if stage not in ("Posix", "S3", "Ds3fs", "DS3FS", "NFS"):
        raise ConfigError(
            f"store_pipeline ({source}): {pipeline!r} keeps its blocks in {stage!r}, which "
            "ucm store can't read (Posix, S3 and NFS stages only)"
        )
    return stage, values


def from_config_file(path: Path) -> tuple[str, dict[str, Any]]:
    data = load_yaml(path)
    if "store_pipeline" in data and "ucm_connectors" not in data:
        return persistent_stage(data, str(path))
    from ucm.integration.vllm.config import resolve_config

    cfg = resolve_config({}, env={"UCM_CONFIG_FILE": str(path)})
    return persistent_stage(dict(cfg.store.config), str(path))


class Target:
    """The store the command works on."""

    def __init__(self, config: str | None, directory: str | None) -> None:
        if (config is None) == (directory is None):
            raise click.UsageError("give exactly one of --config FILE and --dir DIR")
        try:
            if directory is not None:
                self.stage, self.values = "Posix", {"storage_backends": directory}
            else:
                self.stage, self.values = from_config_file(Path(str(config)))
            self.maint = _native.Maintenance.open(self.stage, self.values)
        except Exception as e:  # a config or store error: the message says it all
            raise click.ClickException(str(e)) from None

    def blocks(self) -> list[tuple[bytes, int, float]]:
        return list(self.maint.blocks())

    def verify_all(self, desc: str) -> Iterator[tuple[bytes, Exception]]:
        """(id, error) of every block that fails verification."""
        for bid, _, _ in tqdm(self.blocks(), desc=desc, unit="block", file=sys.stderr):
            try:
                self.maint.verify(bid)
            except FileNotFoundError:
                continue  # removed meanwhile (evicted by an engine)
            except Exception as e:
                if type(e).__name__ == "BlockNotFoundError":
                    continue
                yield bid, e


def where(f: Any) -> Any:
    f = click.option(
        "--dir", "directory", type=click.Path(file_okay=False), help="A Posix store's directory."
    )(f)
    return click.option(
        "--config",
        "config",
        type=click.Path(exists=True, dir_okay=False),
        help="A connector or store config file (YAML).",
    )(f)


@click.group()
def store() -> None:
    """Inspect and clean a store: info, ls, verify, gc, clear."""


@store.command()
@where
def info(config: str | None, directory: str | None) -> None:
    """Blocks, bytes, capacity and the age of the blocks."""
    t = Target(config, directory)
    blocks = t.blocks()
    total = sum(b for _, b, _ in blocks)
    click.echo(f"store      {t.stage} at {t.maint.location}")
    click.echo(f"blocks     {len(blocks)}")
    click.echo(f"bytes      {total} ({total / (1 << 30):.3f} GiB)")
    cap = t.values.get("posix_capacity_gb")
    if cap:
        click.echo(
            f"capacity   {float(cap):.3f} GiB ({100 * total / (float(cap) * (1 << 30)):.1f} % used)"
        )
    else:
        click.echo("capacity   unbounded")
    now = time.time()
    counts = [0] * (len(AGES) + 1)
    for _, _, mtime in blocks:
        age = now - mtime
        counts[next((i for i, (lim, _) in enumerate(AGES) if age < lim), len(AGES))] += 1
    click.echo("ages")
    for (_, label), n in zip((*AGES, (0, "older")), counts, strict=True):
        click.echo(f"  {label:<10} {n}")


@store.command(name="ls")
@where
@click.option("--limit", type=int, default=None, help="At most this many blocks (newest first).")
def ls_(config: str | None, directory: str | None, limit: int | None) -> None:
    """Every block: id, bytes, age (newest first)."""
    t = Target(config, directory)
    now = time.time()
    rows = sorted(t.blocks(), key=lambda b: -b[2])
    for bid, size, mtime in rows[:limit]:
        click.echo(f"{bid.hex()}  {size:>12}  {now - mtime:10.0f} s")


@store.command()
@where
@click.option("--remove", is_flag=True, help="Remove the blocks that fail.")
def verify(config: str | None, directory: str | None, remove: bool) -> None:
    """Read every block and check every shard's header and checksum.

    Exits 1 when some block fails."""
    t = Target(config, directory)
    bad = list(t.verify_all("verifying"))
    for bid, err in bad:
        click.echo(f"corrupt {bid.hex()}: {err}")
        if remove:
            t.maint.remove(bid)
    n = len(t.blocks()) + (len(bad) if remove else 0)
    click.echo(
        f"{n - len(bad)} of {n} block(s) verified, {len(bad)} corrupt"
        + (" (removed)" if remove and bad else "")
    )
    if bad and not remove:
        sys.exit(1)


@store.command()
@where
def gc(config: str | None, directory: str | None) -> None:
    """Remove what stopped stores left behind, and corrupt blocks."""
    t = Target(config, directory)
    report = dict(t.maint.gc())
    bad = [bid for bid, _ in t.verify_all("checking")]
    for bid in bad:
        t.maint.remove(bid)
    click.echo(
        f"removed {report['temporaries']} temporary file(s) of stopped stores, "
        f"{report['foreign']} non-block file(s) at block names, "
        f"{len(bad)} corrupt block(s)"
    )


@store.command()
@where
@click.option("--yes", is_flag=True, help="Do not ask.")
def clear(config: str | None, directory: str | None, yes: bool) -> None:
    """Remove every block."""
    t = Target(config, directory)
    blocks = t.blocks()
    if not yes:
        click.confirm(f"remove all {len(blocks)} block(s) at {t.maint.location}?", abort=True)
    removed = sum(
        bool(t.maint.remove(bid))
        for bid, _, _ in tqdm(blocks, desc="removing", unit="block", file=sys.stderr)
    )
    click.echo(f"removed {removed} block(s)")
