"""Test and tooling hooks of the built-in stores, outside the store API.

Test and benchmark tooling (the tests' ``support`` package), not product API.
"""

from __future__ import annotations

from ucm import _native
from ucm.store.pipeline import UcmPipelineStore


def block_path(store: UcmPipelineStore, block_id: bytes) -> str | None:
    """Where a block's file lives (a Posix stage, under any caches)."""
    return _native.debug_block_path(store.native, block_id)


def hold_lock_forever(store: UcmPipelineStore) -> None:
    """Takes a shared cache's lock and never returns: for tests that kill
    the process to check that the others recover."""
    _native.debug_hold_lock_forever(store.native)
