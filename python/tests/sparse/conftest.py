"""Sparse-attention tests: Triton kernels run on CPU through the interpreter.

``TRITON_INTERPRET=1`` must be set before ``triton`` (and the kernel module)
is imported: Triton decides at ``@triton.jit`` time whether a kernel is
interpreted. Shapes stay small, because the interpreter is slow.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

#: Per-dtype tolerances (atol, rtol) of kernel-vs-reference comparisons, in
#: one place. Kernels accumulate in fp32 like the references; the 16-bit rows
#: cover rounding of P before the P @ V product and of the output cast.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(1234)
