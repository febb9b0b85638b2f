"""The ``ucm`` command (also ``python -m ucm``): serve vLLM with the
connector, route prefill/decode engines, look after a store, check a config, measure a
directory, fetch the demo's model.

Built on click, a well-kept CLI library: ``--help`` on every command, exit
codes, and prompts come with it.
"""

from __future__ import annotations

import importlib

import click

from ucm import __distribution__, __version__

# Each command's module is imported only when that command runs: together
# they pull in numpy, tqdm and the store bindings, about a second of imports
# that `ucm store info` on a large store should not pay before its work.
COMMANDS = {
    "serve": "ucm.cli.serve_cmd",
    "store": "ucm.cli.store_cmd",
    "config": "ucm.cli.config_cmd",
    "bench": "ucm.cli.bench_cmd",
    "model": "ucm.cli.model_cmd",
    "proxy": "ucm.cli.proxy_cmd",
}


class LazyGroup(click.Group):
    """A group whose subcommands are imported when first looked up."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        module = COMMANDS.get(cmd_name)
        if module is None:
            return None
        command = getattr(importlib.import_module(module), cmd_name)
        if not isinstance(command, click.Command):
            raise TypeError(f"{module}.{cmd_name} is not a click command")
        return command


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
# The version is the package's own, not the installed metadata's: a checkout
# on PYTHONPATH reports what it is, whatever is installed beside it.
@click.version_option(
    __version__, package_name=__distribution__, prog_name="ucm", message="%(package)s %(version)s"
)
def main() -> None:
    """Unified Cache Manager: persists vLLM's KV cache in tiered storage and
    serves it back instead of recomputing it."""


__all__ = ["main"]
