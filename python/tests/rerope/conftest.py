"""Kernel tests run on CPU through the Triton interpreter (set by the root
``conftest.py``); shapes stay small and odd because the interpreter is slow."""

from support.kernel_checks import assert_close_fixture, seeded_torch  # noqa: F401
