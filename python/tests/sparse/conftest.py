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


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(1234)
