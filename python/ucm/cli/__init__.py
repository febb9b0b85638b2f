"""The ``ucm`` command (also ``python -m ucm``): serve vLLM with the
connector, route prefill/decode engines, look after a store, check a config, measure a
directory, fetch the demo's model.

Built on click, a well-kept CLI library: ``--help`` on every command, exit
codes, and prompts come with it.
"""

from __future__ import annotations

import click

from ucm import __distribution__, __version__
from ucm.cli.bench_cmd import bench
from ucm.cli.config_cmd import config
from ucm.cli.model_cmd import model
from ucm.cli.proxy_cmd import proxy
from ucm.cli.serve_cmd import serve
from ucm.cli.store_cmd import store


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
# The version is the package's own, not the installed metadata's: a checkout
# on PYTHONPATH reports what it is, whatever is installed beside it.
@click.version_option(
    __version__, package_name=__distribution__, prog_name="ucm", message="%(package)s %(version)s"
)
def main() -> None:
    """Unified Cache Manager: persists vLLM's KV cache in tiered storage and
    serves it back instead of recomputing it."""


main.add_command(serve)
main.add_command(store)
main.add_command(config)
main.add_command(bench)
main.add_command(model)
main.add_command(proxy)

__all__ = ["main"]
