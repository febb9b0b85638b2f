"""``ucm config``: check a config exactly as the connector would, and show
the merged result with where each value came from."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from ucm.cli.config_kind import KINDS, detect_kind
from ucm.shared.config import ConfigError, load_yaml


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
@click.option(
    "--kind",
    type=click.Choice(KINDS),
    default="auto",
    show_default=True,
    help="What FILE is: a connector config (for vLLM) or a store config "
    "(for ucm.store.open); auto tells them apart by their keys.",
)
def check(file: str | None, extra_json: str, kind: str) -> None:
    """Validate FILE (a UCM YAML config, a regular file of at most 1 MiB).

    A connector config is merged with --extra and UCM_* environment
    variables, as the connector does at start-up; a store config (block
    geometry and store keys, like configs/store-posix.yaml) is checked as
    ucm.store.open checks it. Prints every key with its source; exits 1 with
    the message on error."""
    if file and kind == "auto":
        try:
            kind = detect_kind(load_yaml(file))
        except ConfigError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(1)
    if kind == "store":
        if not file:
            raise click.UsageError("--kind store needs a FILE")
        if extra_json != "{}":
            raise click.UsageError("--extra is a connector option; a store config has no extras")
        check_store_file(file)
        return
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


def check_store_file(file: str) -> None:
    """``ucm config check`` of a store config: its stages' keys as the core
    checks them, defaults filled in."""
    from ucm.store.config import PipelineStoreConfig, StageConfig

    try:
        cfg = PipelineStoreConfig.from_yaml(file)
    except ConfigError as e:
        click.echo(f"error (store config): {e}", err=True)
        sys.exit(1)
    click.echo(f"store config, store_pipeline {cfg.store_pipeline!r}")
    rows = []
    for name, stage in cfg.stages:
        if not isinstance(stage, StageConfig):  # a store registered from Python
            stage = StageConfig(name, stage)
        for key, value in stage.values.items():
            shown = "<redacted>" if key in stage.secret and value else value
            rows.append((f"{name}.{key}", shown))
    width = max((len(k) for k, _ in rows), default=0)
    for key, value in rows:
        click.echo(f"{key:<{width}}  {value!r}")
    click.echo("ok")


@config.command()
def keys() -> None:
    """List every store key with its type, default and meaning."""
    from ucm.store.config_doc import key_tables

    click.echo(key_tables())
