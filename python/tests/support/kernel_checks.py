"""Tolerances, comparison and seeding of the Triton kernel tests (sparse,
Blend, ReRoPE), in one place. Kept out of ``conftest.py`` so test modules can
import them by a unique name; each kernel folder's ``conftest.py`` imports
the fixtures. The root ``conftest.py`` sets ``TRITON_INTERPRET=1`` before
any kernel module is imported."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

#: Per-dtype tolerances (atol, rtol) of kernel-vs-reference comparisons.
#: Kernels accumulate in fp32 like the references; the 16-bit rows cover the
#: rounding of the inputs a kernel casts (P before P @ V, rotated keys on
#: store) and of the output.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


@pytest.fixture(name="assert_close")
def assert_close_fixture() -> Callable[..., None]:
    """``assert_close(actual, expected, dtype)`` with the dtype's tolerance."""
    return assert_close


@pytest.fixture(autouse=True)
def seeded_torch() -> None:
    torch.manual_seed(1234)
