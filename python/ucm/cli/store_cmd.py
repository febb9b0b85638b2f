"""``ucm store``: look after a store's contents from outside the engines.

The store is named by a directory (``--dir``, a Posix store) or by a config
file (``--config``): a connector config (``ucm_connectors: ...``, as given
to vLLM) or a flat store config (``store_pipeline: ...``). Its persistent
stage (the one below any ``Cache``) is what these commands read: a Posix
directory, the objects under an S3 prefix, or an NFS export (through the
built-in client or a kernel mount). They work beside running engines: a
live engine's work files are never touched, and a block removed under it
only costs it a miss.

Only what ucm wrote is ever removed, and only from a store (see the group's
help): the native side checks every file right before removing it; this
module shows the plan, asks, and runs the long jobs (on every core, without
the GIL) behind a progress bar.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ucm import _native
from ucm.shared.config import ConfigError, load_yaml
from ucm.store.config import stage_schemas

if TYPE_CHECKING:
    from tqdm import tqdm

#: Age buckets of ``ucm store info``: (upper bound in seconds, label).
AGES = ((3600, "< 1 hour"), (86400, "< 1 day"), (7 * 86400, "< 1 week"), (30 * 86400, "< 30 days"))
#: Paths of each kind shown before asking; ``--dry-run`` lists every one.
SHOWN = 5
#: What the items of each kind of a removal plan are, counted.
KINDS = {
    "block": "block file(s)",
    "corrupt": "corrupt block file(s)",
    "work": "work director(ies) of stopped stores",
    "temp": "temporary file(s) their writers abandoned",
}

Say = Callable[[str], None]


def persistent_stage(values: dict[str, Any], source: str) -> tuple[str, dict[str, Any]]:
    """The lowest stage of a flat store config and its keys."""
    pipeline = str(values.get("store_pipeline", "Posix"))
    stage = pipeline.split("|")[-1].strip()
    schemas = stage_schemas()
    if stage not in schemas or not schemas[stage].maintainable:
        readable = [s.name for s in dict.fromkeys(schemas.values()) if s.maintainable]
        raise ConfigError(
            f"store_pipeline ({source}): {pipeline!r} keeps its blocks in {stage!r}, which "
            f"ucm store can't read ({in_words(readable)} stages only)"
        )
    return stage, values


def in_words(names: list[str]) -> str:
    """``["A", "B", "C"]`` as "A, B and C"."""
    return " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)


def from_config_file(path: Path) -> tuple[str, dict[str, Any]]:
    data = load_yaml(path)
    if "store_pipeline" in data and "ucm_connectors" not in data:
        return persistent_stage(data, str(path))
    from ucm.integration.vllm.config import resolve_config

    cfg = resolve_config({}, env={"UCM_CONFIG_FILE": str(path)})
    return persistent_stage(dict(cfg.store.config), str(path))


class Target:
    """The store the command works on (a directory that is not one is refused)."""

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

    def identity(self) -> list[dict[str, Any]]:
        """How each root was recognised as a store."""
        out = []
        for path, how, n in self.maint.identity():
            entry: dict[str, Any] = {"path": path, "marker": None}
            if how == "marked":
                entry["marker"] = f"format {n}"
            elif how == "adoptable":
                entry["sampled_blocks"] = n
            else:
                entry["checked"] = "per object"
            out.append(entry)
        return out

    def about(self) -> dict[str, Any]:
        return {"stage": self.stage, "location": self.maint.location, "roots": self.identity()}


def marker_line(root: dict[str, Any]) -> str:
    if root["marker"]:
        return root["marker"]
    if "sampled_blocks" in root:
        return (
            f"none at {root['path']}: its {root['sampled_blocks']} sampled block file(s) are "
            "ucm blocks; the first command that removes something marks it"
        )
    return "none: each object is checked to be a ucm block before it is removed"


def run_job(job: Any) -> Any:
    """Waits for a native job, its progress on stderr (a terminal's); Ctrl-C
    stops it at its next block."""
    bar: tqdm | None = None
    phase = None
    try:
        while True:
            finished = job.wait(0.1)
            if job.phase != phase:
                if bar is not None:
                    bar.close()
                phase = job.phase
                unit = "item" if phase == "removing" else "block"
                from tqdm import tqdm  # only for commands that show progress

                bar = tqdm(desc=phase, total=job.total, unit=unit, file=sys.stderr, disable=None)
            assert bar is not None
            if bar.total is None and job.total is not None:
                bar.total = job.total
                bar.refresh()
            bar.update(job.done - bar.n)
            if finished:
                break
    except BaseException:
        job.cancel()
        job.wait(10.0)
        raise
    finally:
        if bar is not None:
            bar.close()
    return job.result()


def where(f: Any) -> Any:
    """The store a command acts on: ``DIR`` (as ``du`` or ``ls`` take it),
    ``--dir DIR`` or ``--config FILE``."""

    @functools.wraps(f)
    def merged(*args: Any, positional_dir: str | None, directory: str | None, **kw: Any) -> Any:
        if positional_dir and directory and Path(positional_dir) != Path(directory):
            raise click.UsageError(
                f"two store directories given ({positional_dir} and --dir {directory}): give one"
            )
        return f(*args, directory=directory or positional_dir, **kw)

    merged = click.option(
        "--dir",
        "directory",
        type=click.Path(file_okay=False),
        help="A Posix store's directory (recognised as a store: see `ucm store --help`).",
    )(merged)
    merged = click.option(
        "--config",
        "config",
        type=click.Path(exists=True, dir_okay=False),
        help="A connector or store config file (YAML).",
    )(merged)
    return click.argument(
        "positional_dir", required=False, metavar="[DIR]", type=click.Path(file_okay=False)
    )(merged)


def removing(f: Any) -> Any:
    f = click.option("--yes", is_flag=True, help="Remove without asking.")(f)
    return click.option(
        "--dry-run", is_flag=True, help="List what would be removed and what left; remove nothing."
    )(f)


def say_for(fmt: str) -> Say:
    """Where a command's lines go: stderr when stdout carries the JSON
    document, else stdout."""
    if fmt == "json":
        return lambda s: click.echo(s, err=True)
    return click.echo


def output_format(f: Any) -> Any:
    return click.option(
        "--format",
        "fmt",
        type=click.Choice(["text", "json"]),
        default="text",
        show_default=True,
        help="json: one JSON document on stdout (progress and questions on stderr).",
    )(f)


@click.group()
def store() -> None:
    """Inspect and clean a store: info, ls, verify, gc, clear.

    Only what ucm wrote is ever removed. A block goes only after its file
    (or object) was read and its first header found to name that block; a
    stopped store's work files go only by the names stores give them. Links,
    FIFOs, users' files and copies at block names are listed and left alone;
    a block directory that is a link is never followed.

    A directory is a store when it carries the marker stores write
    (.ucm-store). One without it (written before the marker existed) is
    accepted when the block files sampled from it, the first of each block
    directory up to 64, are all ucm blocks; the first command that removes
    something then marks it. Any other directory is refused, naming it. An S3
    prefix, or an export reached by the built-in NFS client, needs no marker:
    nothing is removed there but what sits at block keys, each checked, and
    writers' abandoned temporaries.

    Commands that remove (clear, gc, verify --remove) list what they will
    remove and ask first: --yes does not ask, and with no terminal to ask
    on they refuse without it; --dry-run lists what would go and removes
    nothing.
    """


@store.command()
@where
@click.option(
    "--ages",
    is_flag=True,
    help="Also read every block's size and age (one stat per block, on every core). "
    "Without it a Posix store's bytes are estimated from the size of one block per "
    "block directory, and the ages are not read.",
)
@output_format
def info(config: str | None, directory: str | None, ages: bool, fmt: str) -> None:
    """Blocks, bytes, capacity and (with --ages) the age of the blocks."""
    t = Target(config, directory)
    try:
        s = t.maint.summary(ages, [float(lim) for lim, _ in AGES])
    except Exception as e:
        raise click.ClickException(str(e)) from None
    cap = t.values.get("posix_capacity_gb")
    cap_bytes = int(float(cap) * (1 << 30)) if cap else None
    counts = s["ages"]
    age_labels = [label for _, label in AGES] + ["older"]
    doc = {
        **t.about(),
        "blocks": s["blocks"],
        "bytes": s["bytes"],
        "estimated_bytes": s["estimated_bytes"],
        "sized_blocks": s["sized"],
        "capacity_bytes": cap_bytes,
        "ages": dict(zip(age_labels, counts, strict=True)) if counts is not None else None,
        "not_blocks": [{"path": p, "reason": r} for p, r in s["odd"]],
    }
    if fmt == "json":
        click.echo(json.dumps(doc, indent=2))
        return
    click.echo(f"store      {t.stage} at {t.maint.location}")
    for root in doc["roots"]:
        click.echo(f"marker     {marker_line(root)}")
    click.echo(f"blocks     {s['blocks']}")
    total = s["bytes"] if s["bytes"] is not None else s["estimated_bytes"] or 0
    if s["bytes"] is not None:
        click.echo(f"bytes      {total} ({total / (1 << 30):.3f} GiB)")
    else:
        click.echo(
            f"bytes      ~{total} ({total / (1 << 30):.3f} GiB, from the sizes of "
            f"{s['sized']} block(s); --ages reads them all)"
        )
    if cap_bytes:
        click.echo(f"capacity   {float(cap):.3f} GiB ({100 * total / cap_bytes:.1f} % used)")
    else:
        click.echo("capacity   unbounded")
    if counts is None:
        click.echo("ages       not read (--ages reads them: one stat per block)")
    else:
        click.echo("ages")
        for label, n in zip(age_labels, counts, strict=True):
            click.echo(f"  {label:<10} {n}")
    for path, reason in s["odd"]:
        click.echo(f"not a block: {path}: {reason}")


@store.command(name="ls")
@where
@click.option("--limit", type=int, default=None, help="At most this many blocks (newest first).")
@output_format
def ls_(config: str | None, directory: str | None, limit: int | None, fmt: str) -> None:
    """Every block: id, bytes, age (newest first)."""
    t = Target(config, directory)
    now = time.time()
    rows = sorted(t.maint.blocks(), key=lambda b: -b[2])[:limit]
    if fmt == "json":
        listed = [
            {"id": bid.hex(), "bytes": size, "age_s": round(now - mtime, 3)}
            for bid, size, mtime in rows
        ]
        click.echo(json.dumps({**t.about(), "blocks": listed}, indent=2))
        return
    for bid, size, mtime in rows:
        click.echo(f"{bid.hex()}  {size:>12}  {now - mtime:10.0f} s")


def describe(kind: str, files: int, detail: str) -> str:
    """Why an item of a plan goes."""
    return {
        "block": "block file",
        "corrupt": f"corrupt: {detail}",
        "work": f"work directory of a stopped store, {files} file(s) it wrote",
        "temp": "temporary file its writer abandoned",
    }.get(kind, kind)


def carry_out(t: Target, plan: Any, dry_run: bool, yes: bool, say: Say) -> dict[str, Any] | None:
    """Shows `plan`, asks (unless `yes`) and carries it out; with `dry_run`
    lists it and removes nothing. What was removed (None: nothing was)."""
    items, kept = plan.items(), plan.kept()
    adopting = [r["path"] for r in t.identity() if "sampled_blocks" in r]
    total = sum(size for _, size, _, _, _ in items)
    if dry_run:
        for label, _, kind, files, detail in items:
            say(f"would remove {label} ({describe(kind, files, detail)})")
        for label, why in kept:
            say(f"would leave {label}: {why}")
        for root in adopting:
            say(f"would mark {root} as a ucm store")
        say(f"dry run: {len(items)} item(s), {total} bytes would be removed; nothing was removed")
        return None
    for label, why in kept:
        say(f"leaving {label}: {why}")
    if not items:
        say("nothing to remove")
        return None
    say(f"about to remove from {t.maint.location} ({total} bytes):")
    by_kind: dict[str, list[tuple[str, int, str]]] = {}
    for label, _, kind, files, detail in items:
        by_kind.setdefault(kind, []).append((label, files, detail))
    for kind, group in by_kind.items():
        say(f"  {len(group)} {KINDS.get(kind, kind)}")
        for label, files, detail in group[:SHOWN]:
            say(f"    {label}" + (f" ({describe(kind, files, detail)})" if kind != "block" else ""))
        if len(group) > SHOWN:
            say(f"    ... and {len(group) - SHOWN} more (--dry-run lists every one)")
    for root in adopting:
        say(f"  and mark {root} as a ucm store (its sampled block files are ucm blocks)")
    if not yes:
        if not sys.stdin.isatty():
            raise click.ClickException(
                "nothing was removed: there is no terminal to ask on; give --yes to remove "
                "without asking (--dry-run lists what would go)"
            )
        click.confirm("remove them?", abort=True, err=True)
    try:
        outcome: dict[str, Any] = run_job(t.maint.start_execute(plan))
    except Exception as e:
        raise click.ClickException(str(e)) from None
    for root in outcome["marked"]:
        say(f"marked {root} as a ucm store")
    for label, why in outcome["kept"]:
        say(f"left {label}: {why}")
    for label, err in outcome["failed"]:
        say(f"could not remove {label}: {err}")
    return outcome


def removed(outcome: dict[str, Any] | None, kind: str) -> tuple[int, int, int]:
    """(items, files, bytes) of `kind` an outcome removed."""
    if outcome is None:
        return (0, 0, 0)
    items, files, size = outcome["removed"].get(kind, (0, 0, 0))
    return int(items), int(files), int(size)


def plan_of(job: Any) -> Any:
    try:
        return run_job(job)
    except Exception as e:
        raise click.ClickException(str(e)) from None


@store.command()
@where
@click.option(
    "--remove",
    is_flag=True,
    help="Remove the corrupt blocks (each checked to be a ucm block file first; asks).",
)
@removing
@output_format
def verify(
    config: str | None, directory: str | None, remove: bool, dry_run: bool, yes: bool, fmt: str
) -> None:
    """Read every block and check every shard's header and checksum, on every
    core, with a progress bar.

    Exits 1 when some block fails (and was not removed)."""
    if (dry_run or yes) and not remove:
        raise click.UsageError("--dry-run and --yes go with --remove")
    t = Target(config, directory)
    report = plan_of(t.maint.start_verify())
    json_out = fmt == "json"
    say = say_for(fmt)
    failures = report["failures"]
    if not json_out:
        for bid, err, _ in failures:
            click.echo(f"corrupt {bid.hex()}: {err}")
        for path, reason in report["odd"]:
            click.echo(f"not a block: {path}: {reason}")
    corrupt = [(bid, err) for bid, err, is_corrupt in failures if is_corrupt]
    outcome = None
    if remove and corrupt:
        plan = plan_of(t.maint.start_plan_corrupt([b for b, _ in corrupt], [e for _, e in corrupt]))
        outcome = carry_out(t, plan, dry_run, yes, say)
    gone = removed(outcome, "corrupt")[0]
    n = report["blocks"] - report["vanished"]
    if json_out:
        doc = {
            **t.about(),
            "blocks": n,
            "verified": n - len(failures),
            "failed": [{"id": bid.hex(), "error": err, "corrupt": c} for bid, err, c in failures],
            "removed": gone,
            "vanished": report["vanished"],
            "not_blocks": [{"path": p, "reason": r} for p, r in report["odd"]],
        }
        click.echo(json.dumps(doc, indent=2))
    else:
        click.echo(
            f"{n - len(failures)} of {n} block(s) verified, {len(failures)} corrupt"
            + (f" ({gone} removed)" if gone else "")
        )
    if len(failures) > gone:
        sys.exit(1)


def removal_doc(
    t: Target, plan: Any, outcome: dict[str, Any] | None, dry_run: bool
) -> dict[str, Any]:
    """The JSON document of a command that removes: what the plan held,
    what it left alone and, unless a dry run, what went."""
    gone = None
    if outcome is not None:
        gone = {
            kind: dict(zip(("items", "files", "bytes"), removed(outcome, kind), strict=True))
            for kind in outcome["removed"]
        }
    return {
        **t.about(),
        "dry_run": dry_run,
        "planned": [
            {"item": label, "bytes": size, "kind": kind, "files": files, "detail": detail}
            for label, size, kind, files, detail in plan.items()
        ],
        "left": [{"item": label, "why": why} for label, why in plan.kept()],
        "removed": gone,
        "failed": []
        if outcome is None
        else [{"item": i, "error": e} for i, e in outcome["failed"]],
    }


def run_removal(t: Target, plan: Any, dry_run: bool, yes: bool, fmt: str) -> dict[str, Any] | None:
    """:func:`carry_out`, its lines on stderr when the answer is JSON (then
    printed on stdout)."""
    outcome = carry_out(t, plan, dry_run, yes, say_for(fmt))
    if fmt == "json":
        click.echo(json.dumps(removal_doc(t, plan, outcome, dry_run), indent=2))
    return outcome


@store.command()
@where
@removing
@output_format
def gc(config: str | None, directory: str | None, dry_run: bool, yes: bool, fmt: str) -> None:
    """Remove what stopped stores left (their work directories, abandoned
    temporaries) and the corrupt blocks (every block verified)."""
    t = Target(config, directory)
    outcome = run_removal(t, plan_of(t.maint.start_plan_gc()), dry_run, yes, fmt)
    if outcome is not None and fmt == "text":
        c, w, tmp = removed(outcome, "corrupt"), removed(outcome, "work"), removed(outcome, "temp")
        click.echo(
            f"removed {c[0]} corrupt block(s), {w[1]} file(s) in {w[0]} work "
            f"director{'y' if w[0] == 1 else 'ies'} of stopped stores, "
            f"{tmp[0]} abandoned temporary file(s)"
        )


@store.command()
@where
@removing
@output_format
def clear(config: str | None, directory: str | None, dry_run: bool, yes: bool, fmt: str) -> None:
    """Remove every block (each checked to be a ucm block file first)."""
    t = Target(config, directory)
    outcome = run_removal(t, plan_of(t.maint.start_plan_clear()), dry_run, yes, fmt)
    if outcome is not None and fmt == "text":
        n, _, size = removed(outcome, "block")
        click.echo(f"removed {n} block(s) ({size} bytes)")
