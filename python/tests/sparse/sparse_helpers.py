"""Tolerances and comparison helpers of the kernel tests (kept out of
``conftest.py`` so that test modules can import them by a unique name)."""

from __future__ import annotations

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
