"""``ucm config``: check a config exactly as the connector would, and show
the merged result with where each value came from."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from ucm.shared.config import ConfigError


@click.group()
def config() -> None:
    """Check configs and list the keys."""


@config.command()
@click.argument("file", required=False, type=click.Path(dir_okay=False))
@click.option(
    "--extra",
    "extra_json",
    default="{}",
    help="kv_connector_extra_config as JSON, as given to vLLM.",
)
def check(file: str | None, extra_json: str) -> None:
    """Validate FILE (a UCM YAML config, a regular file of at most 1 MiB)
    merged with --extra and UCM_* environment variables, as the connector
    does at start-up, and print every key with its source. Exits 1 with the
    connector's message on error."""
    from ucm.integration.vllm.config_check import check_config, describe

    env = dict(os.environ)
    if file:
        env["UCM_CONFIG_FILE"] = str(Path(file).resolve())
    try:
        extra = json.loads(extra_json)
    except json.JSONDecodeError as e:
        raise click.BadParameter(f"not JSON: {e}", param_hint="--extra") from None
    except RecursionError:
        raise click.BadParameter("nested too deeply", param_hint="--extra") from None
    try:
        cfg = check_config(extra, env)
    except ConfigError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
    width = max(len(k) for k, _, _ in describe(cfg))
    for key, value, source in describe(cfg):
        click.echo(f"{key:<{width}}  {value!r}  ({source})")
    click.echo("ok")


@config.command()
def keys() -> None:
    """List every store key with its type, default and meaning."""
    from ucm.store.config_doc import key_tables

    click.echo(key_tables())
