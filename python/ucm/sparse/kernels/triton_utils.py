"""Import shim that keeps Triton optional.

``import ucm.sparse`` must work on machines without Triton (or with a Triton
that cannot compile for the local device). Kernel modules import ``triton``
and ``tl`` from here; when Triton is missing they get placeholders whose
``jit`` decorator returns the plain function, so the module still imports and
:data:`HAS_TRITON` tells the launchers to fall back to the torch references.

Triton decides whether a kernel is *interpreted* (``TRITON_INTERPRET=1``, runs
on CPU tensors through numpy) when ``@triton.jit`` runs, i.e. when the kernel
module is imported. :data:`INTERPRET` records that decision so the dispatcher
knows whether CPU tensors can go to the kernels.
"""

from __future__ import annotations

import os
import types
from typing import Any

HAS_TRITON = False
INTERPRET = False

try:  # pragma: no cover - depends on the environment
    import triton
    import triton.language as tl

    HAS_TRITON = True
    try:
        from triton import knobs as _knobs

        INTERPRET = bool(_knobs.runtime.interpret)
    except (ImportError, AttributeError):
        INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
except ImportError:  # pragma: no cover - exercised by test_import_without_triton
    HAS_TRITON = False

    def _jit(fn: Any = None, **_kw: Any) -> Any:
        if fn is None:
            return lambda f: f
        return fn

    def _cdiv(a: int, b: int) -> int:
        return -(-a // b)

    def _next_power_of_2(n: int) -> int:
        return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()

    triton = types.SimpleNamespace(  # type: ignore[assignment]
        jit=_jit, cdiv=_cdiv, next_power_of_2=_next_power_of_2
    )

    class _ConstExpr:
        pass

    tl = types.SimpleNamespace(constexpr=_ConstExpr)  # type: ignore[assignment]


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= ``n`` (1 for n <= 1); no Triton needed."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers."""
    return -(-a // b)


__all__ = ["HAS_TRITON", "INTERPRET", "cdiv", "next_power_of_2", "tl", "triton"]
