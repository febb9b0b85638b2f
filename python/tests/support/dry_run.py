"""Reading what ``ucm serve --dry-run`` prints."""

from __future__ import annotations

import shlex


def dry_run_argv(output: str) -> list[str]:
    """The vLLM command line of a dry run's output as ``["vllm", "serve",
    ...]``, whichever command runs vLLM here (``vllm``, or on the CPU build
    ``python -m ucm.integration.vllm.cli``)."""
    (line,) = [x for x in output.splitlines() if " serve " in x and "=" not in x.split()[0]]
    words = shlex.split(line)
    return ["vllm", *words[words.index("serve") :]]
