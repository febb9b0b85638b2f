"""Kernel tests run on CPU through the Triton interpreter.

``TRITON_INTERPRET=1`` must be set before ``triton`` (and any kernel module)
is imported: Triton decides at ``@triton.jit`` time whether a kernel is
interpreted. Shapes stay small and odd (partial blocks, non-power-of-two
sizes) because the interpreter is slow.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Callable

import pytest
import torch

#: Per-dtype (atol, rtol) of kernel-vs-reference comparisons. Kernels and
#: references compute in fp32; the 16-bit rows cover the rounding of the
#: inputs the kernel casts (P before P @ V, rotated keys on store) and of
#: the output.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


@pytest.fixture
def assert_close() -> Callable[..., None]:
    """``assert_close(actual, expected, dtype)`` with the dtype's tolerance."""

    def check(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
        atol, rtol = TOLERANCES[dtype]
        torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)

    return check


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(1234)
