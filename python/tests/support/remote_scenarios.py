"""What the S3 and NFS store tests both put a store through (kept out of
``conftest.py`` so test modules import them by name)."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest

from support.remote_helpers import bid, block_data, dump, load
from ucm.store import UcmKVStoreBase, UcmStoreError


def round_trip(store: UcmKVStoreBase) -> None:
    """Blocks 1 to 3, absent at first, dumped, found (by lookup and by
    prefix) and loaded back whole."""
    assert store.lookup([bid(1), bid(2)]) == [False, False]
    dump(store, [1, 2, 3])
    store.flush()
    assert store.lookup([bid(1), bid(9), bid(3)]) == [True, False, True]
    assert store.lookup_on_prefix([bid(1), bid(2), bid(9), bid(3)]) == 1
    got = load(store, [1, 2, 3])
    for n in (1, 2, 3):
        assert np.array_equal(got[n], block_data(n))


def ride_out_an_outage(
    store: UcmKVStoreBase, stop: Callable[[], None], restart: Callable[[], None]
) -> None:
    """Block 1 written back, the server stopped with ``stop``, blocks 2 and 3
    dumped into the cache, the server back with ``restart``: loads of what
    only the server had fail (the engine recomputes), dumps do not crash,
    cached blocks are still served, and the dirty blocks reach the server."""
    dump(store, [1])
    store.flush()
    stop()
    started = time.monotonic()
    dump(store, [2, 3])  # accepted by the cache; writing them back fails, no crash
    with pytest.raises(UcmStoreError):
        store.flush()
    assert store.get_stats()["dirty_blocks"] == 2
    with pytest.raises(UcmStoreError):
        load(store, [4])  # only the server could have it: recompute
    assert store.lookup([bid(4)]) == [False]
    assert np.array_equal(load(store, [2])[2], block_data(2))
    assert time.monotonic() - started < 15
    restart()
    deadline = time.monotonic() + 20
    while True:
        try:
            store.flush()
            break
        except UcmStoreError:
            assert time.monotonic() < deadline, "write-back never recovered"
            time.sleep(0.3)
    assert store.get_stats()["dirty_blocks"] == 0


def wait_until_found(store: UcmKVStoreBase, n: int, seconds: float = 10.0) -> None:
    """Polls until the lookup of block ``n`` answers found again."""
    deadline = time.monotonic() + seconds
    while store.lookup([bid(n)]) != [True]:
        assert time.monotonic() < deadline
        time.sleep(0.2)
