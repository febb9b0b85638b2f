"""Tells this project's ``ucm`` package from another one of the same name.

The PyPI distribution ``ucm`` is an unrelated project (a connection
manager) whose top-level package is also ``ucm``. Installed beside
``ucm-kvcache``, or ahead of it on ``sys.path``, ``import ucm`` finds its
code, and vLLM's imports of our plugin and connector fail with a bare
``No module named 'ucm.integration'``. This package lives outside ``ucm``
so that it still imports then, and says what is wrong and how to fix it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata as md
import re
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

DISTRIBUTION = "ucm-kvcache"


class ForeignUcmError(RuntimeError):
    """The ``ucm`` package Python imports is not this project's."""


def is_ours(module: ModuleType) -> bool:
    return getattr(module, "__distribution__", None) == DISTRIBUTION


def conflict_message(module: ModuleType) -> str:
    where = getattr(module, "__file__", None) or ", ".join(getattr(module, "__path__", []))
    others = sorted(
        d
        for d in md.packages_distributions().get("ucm", [])
        if re.sub(r"[-_.]+", "-", d).lower() != DISTRIBUTION
    )
    owner = f" (installed by {', '.join(others)})" if others else ""
    return (
        f"the `ucm` package Python imports, {where}{owner}, is not Unified Cache "
        f"Manager's ({DISTRIBUTION}): the PyPI package `ucm` is an unrelated project "
        "with the same import name, and the two cannot be installed together. "
        f"Fix: `pip uninstall ucm`, then reinstall {DISTRIBUTION} "
        "(`pip install --force-reinstall --no-deps` with the wheel or name you installed "
        "it from: both wrote files under ucm/), or take the other `ucm` off PYTHONPATH."
    )


def check_ucm() -> None:
    """Raises :class:`ForeignUcmError` when ``import ucm`` gives another
    project's package. Without any ``ucm`` it does nothing: the import that
    needs it reports that plainly."""
    try:
        module = importlib.import_module("ucm")
    except ModuleNotFoundError as e:
        if e.name == "ucm":
            return
        raise
    if not is_ours(module):
        raise ForeignUcmError(conflict_message(module))


class ForeignUcmImportGuard(importlib.abc.MetaPathFinder):
    """Turns the import of a ``ucm`` submodule that the foreign package lacks
    (vLLM loading ``ucm.integration.vllm.ucm_connector`` by its module path)
    into :class:`ForeignUcmError`; its own submodules import as before."""

    def __init__(self, message: str) -> None:
        self.message = message

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: ModuleType | None = None,
    ) -> ModuleSpec | None:
        if not fullname.startswith("ucm."):
            return None
        if importlib.machinery.PathFinder.find_spec(fullname, path, target) is not None:
            return None
        raise ForeignUcmError(self.message)


def guard_imports(message: str) -> None:
    if not any(isinstance(f, ForeignUcmImportGuard) for f in sys.meta_path):
        sys.meta_path.insert(0, ForeignUcmImportGuard(message))


__all__ = [
    "DISTRIBUTION",
    "ForeignUcmError",
    "ForeignUcmImportGuard",
    "check_ucm",
    "conflict_message",
    "guard_imports",
    "is_ours",
]
