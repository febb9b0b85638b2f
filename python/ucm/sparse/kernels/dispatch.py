"""What every kernel family shares: choosing Triton or the torch reference,
argument checks, the interpreter lock, and tile arithmetic.

Every op takes ``impl``:

* ``"auto"`` (default): the Triton kernel when Triton is installed and can run
  on the tensors (CUDA tensors, or any tensor when the kernels were created
  under ``TRITON_INTERPRET=1``), else the torch reference;
* ``"triton"``: the kernel, or :class:`RuntimeError` if it can't run;
* ``"torch"``: the reference.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import threading
from types import ModuleType
from typing import Literal

import torch

from ucm.sparse.kernels.triton_utils import HAS_TRITON, INTERPRET, cdiv, next_power_of_2

Impl = Literal["auto", "triton", "torch"]

#: tl.dot needs every dimension >= 16.
MIN_DOT = 16

# The Triton interpreter keeps launch state in globals: two threads launching
# at once (an asynchronous retrieval next to the forward) corrupt each other.
# Compiled launches are thread-safe and take no lock.
_INTERPRETER_LOCK = threading.Lock()


def triton_usable(t: torch.Tensor) -> bool:
    """Whether the Triton kernels can run on tensors on ``t``'s device."""
    if not HAS_TRITON:
        return False
    return t.is_cuda or INTERPRET


def launchers_of(family: str) -> ModuleType | None:
    """The ``launchers`` module of a kernel family (e.g. ``__name__`` of
    :mod:`ucm.sparse.kernels.attention`), or None without Triton."""
    return importlib.import_module(f"{family}.launchers") if HAS_TRITON else None


def use_triton(impl: Impl, t: torch.Tensor) -> bool:
    """Whether an op called with ``impl`` on tensors like ``t`` runs its kernel."""
    if impl == "torch":
        return False
    if impl == "triton":
        if not triton_usable(t):
            raise RuntimeError(
                "Triton kernels cannot run here: "
                + ("triton is not installed" if not HAS_TRITON else f"tensors on {t.device}")
                + " (set TRITON_INTERPRET=1 before importing ucm.sparse to run them on CPU)"
            )
        return True
    if impl != "auto":
        raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")
    return triton_usable(t)


def launch_guard() -> contextlib.AbstractContextManager:
    """Held around every kernel launch (serialises interpreted launches)."""
    return _INTERPRETER_LOCK if INTERPRET else contextlib.nullcontext()


def require(cond: bool, msg: str) -> None:
    """A launcher's argument check: ``ValueError(msg)`` unless ``cond``."""
    if not cond:
        raise ValueError(msg)


def gqa_group(h_q: int, h_kv: int) -> int:
    """Query heads per kv head; ``ValueError`` unless ``h_kv`` divides ``h_q``."""
    require(h_q % h_kv == 0, f"{h_q} query heads are not a multiple of {h_kv} kv heads")
    return h_q // h_kv


def softmax_scale(head_dim: int, scale: float | None) -> float:
    """The attention softmax scale: ``scale``, or ``1/sqrt(head_dim)`` when None."""
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def dot_pad(n: int) -> int:
    """Padded size of a ``tl.dot`` operand dimension (power of two, >= 16)."""
    return max(MIN_DOT, next_power_of_2(n))


def strides_of(*tensors: torch.Tensor) -> tuple[int, ...]:
    """Every stride of each tensor in turn: how a kernel takes its operands' layouts."""
    return tuple(x for t in tensors for x in t.stride())


def with_pads(**sizes: int) -> dict[str, int]:
    """Constexpr sizes with their tile sizes: each ``NAME=n`` and
    ``NAME_PAD=next_power_of_2(n)`` (``tl.arange`` lengths are powers of two)."""
    out: dict[str, int] = {}
    for name, n in sizes.items():
        out[name] = n
        out[f"{name}_PAD"] = next_power_of_2(n)
    return out


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_blocks: int, target_programs: int = 256
) -> int:
    """Flash-decoding split count: enough programs to fill a GPU, >= 4 blocks per split.

    With few sequences and kv heads a long sequence would run on a handful of
    programs; splitting its blocks over ``NUM_SPLITS`` programs and reducing
    afterwards keeps the machine busy. Powers of two keep compiled variants few.
    """
    base = max(1, num_seqs * num_kv_heads)
    want = cdiv(target_programs, base)
    cap = max(1, max_blocks // 4)
    splits = max(1, min(want, cap, 64))
    return 1 << (splits.bit_length() - 1)


__all__ = [
    "MIN_DOT",
    "Impl",
    "choose_num_splits",
    "dot_pad",
    "gqa_group",
    "launch_guard",
    "launchers_of",
    "require",
    "softmax_scale",
    "strides_of",
    "triton_usable",
    "use_triton",
    "with_pads",
]
