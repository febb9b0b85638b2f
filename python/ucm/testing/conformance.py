"""The store conformance suite: what every store backend must do, as checks
you can run against your own store.

Each check takes a freshly opened, empty store and the :class:`StoreTraits`
that say what it promises (a store that keeps nothing, like ``Empty``, still
has to answer every call correctly), and raises ``AssertionError`` when the
store breaks the contract. The checks move blocks of :data:`SHARDS` shards
of :data:`SHARD_SIZE` bytes, each shard two float16 tensors of half that
size: open the store with :func:`layout_config` merged into its config.
The tensor round trip needs torch.

Run it with pytest on a store of yours, one test per check::

    import pytest
    from ucm.testing import conformance

    @pytest.fixture
    def store(tmp_path):
        store = MyStore({"root": str(tmp_path), **conformance.layout_config()})
        yield store
        store.close()

    @pytest.mark.parametrize("check", conformance.CHECKS, ids=lambda c: c.__name__)
    def test_my_store_conforms(store, check):
        check(store, conformance.StoreTraits())

A store registered with ``UcmConnectorFactory`` (or a pipeline of stages)
is opened the same way, through ``UcmConnectorFactory.create_connector``.
UCM's own tests run this suite against every built-in backend
(``python/tests/store/test_conformance.py``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from ucm.store import BlockNotFoundError, InvalidParamError, UcmKVStoreBase, UcmStoreError

#: Bytes of one shard the checks move.
SHARD_SIZE = 64 * 1024
#: Shards of one block.
SHARDS = 4


@dataclass(frozen=True)
class StoreTraits:
    """What a store promises; capability differences are data, not skipped checks."""

    #: Dumped blocks can be looked up and loaded back (False: a store that
    #: keeps nothing, every lookup misses and every load fails).
    keeps_data: bool = True
    #: Shard sizes are validated against the store's configured layout.
    knows_layout: bool = True


def layout_config() -> dict[str, Any]:
    """The config keys of the block layout the checks move."""
    return {
        "block_size": SHARD_SIZE * SHARDS,
        "shard_size": SHARD_SIZE,
        "tensor_size_list": [SHARD_SIZE // 2, SHARD_SIZE // 2],
    }


@dataclass
class _Caught:
    """The error a :func:`_raises` block raised (None until it has)."""

    value: Exception | None = None


@contextmanager
def _raises(error: type[Exception], match: str | None = None) -> Iterator[_Caught]:
    """Expects the block to raise ``error`` (with ``match`` in its message)."""
    caught = _Caught()
    try:
        yield caught
    except error as e:
        if match is not None and not re.search(match, str(e)):
            raise AssertionError(f"{type(e).__name__} {e!r} does not match {match!r}") from e
        caught.value = e
        return
    raise AssertionError(f"expected {error.__name__}, nothing was raised")


def block_ids(n: int, salt: int = 0) -> list[bytes]:
    """``n`` distinct 16-byte block ids; another ``salt`` gives other ids."""
    return [int(i + salt * 1_000_003).to_bytes(8, "little") + b"\x5a" * 8 for i in range(n)]


def shard_tensors(seed: int) -> list[Any]:
    """The two float16 tensors of one shard, random from ``seed``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    half = SHARD_SIZE // 2 // 2  # float16 elements per half shard
    return [torch.randn(half, generator=g).half(), torch.randn(half, generator=g).half()]


def dump_blocks(store: UcmKVStoreBase, ids: list[bytes]) -> list[list[list[Any]]]:
    """Dumps every shard of ``ids`` and returns the tensors, per block and shard."""
    data = [[shard_tensors(hash((b, s)) & 0xFFFF) for s in range(SHARDS)] for b in ids]
    flat_ids = [b for b in ids for _ in range(SHARDS)]
    flat_idx = [s for _ in ids for s in range(SHARDS)]
    flat_t = [t for blk in data for t in blk]
    store.wait(store.dump(flat_ids, flat_idx, flat_t))
    return data


def check_lookup_misses_then_hits(store: UcmKVStoreBase, traits: StoreTraits) -> None:
    """Lookups miss before a dump and hit after it; the prefix stops at the first miss."""
    blocks = block_ids(6)
    assert store.lookup(blocks) == [False] * 6
    assert store.lookup_on_prefix(blocks) == -1
    dump_blocks(store, [blocks[0], blocks[1], blocks[3]])
    expect = [True, True, False, True, False, False] if traits.keeps_data else [False] * 6
    assert store.lookup(blocks) == expect
    assert store.lookup_on_prefix(blocks) == (1 if traits.keeps_data else -1)
    assert store.lookup_on_prefix([]) == -1
    store.prefetch(blocks)  # a hint: never fails, even on misses


def check_round_trip_tensors(store: UcmKVStoreBase, traits: StoreTraits) -> None:
    """Tensors load back bit for bit; a store that keeps nothing fails the load."""
    import torch

    blocks = block_ids(5, salt=1)
    data = dump_blocks(store, blocks)
    out = [[[torch.empty_like(t) for t in data[i][s]] for s in range(SHARDS)] for i in range(5)]
    task = store.load(
        [x for x in blocks for _ in range(SHARDS)],
        [s for _ in blocks for s in range(SHARDS)],
        [t for blk in out for t in blk],
    )
    if not traits.keeps_data:
        with _raises(BlockNotFoundError) as caught:
            store.wait(task)
        assert getattr(caught.value, "code", None) == -50005
        return
    store.wait(task)
    for i in range(5):
        for s in range(SHARDS):
            for a, c in zip(data[i][s], out[i][s], strict=True):
                assert torch.equal(a, c)


def check_round_trip_numpy_and_raw_addresses(store: UcmKVStoreBase, traits: StoreTraits) -> None:
    """Numpy arrays and raw addresses (``dump_data``/``load_data``) round trip too."""
    blocks = block_ids(3, salt=2)
    rng = np.random.default_rng(7)
    src = rng.integers(0, 255, size=(3, SHARDS, 2, SHARD_SIZE // 2), dtype=np.uint8)
    flat_ids = [x for x in blocks for _ in range(SHARDS)]
    flat_idx = [s for _ in blocks for s in range(SHARDS)]
    addrs = np.array(
        [[src[i, s, k].ctypes.data for k in range(2)] for i in range(3) for s in range(SHARDS)],
        dtype=np.uint64,
    )
    store.wait(store.dump_data(flat_ids, flat_idx, addrs))
    dst = np.zeros_like(src)
    rows = [[dst[i, s, 0], dst[i, s, 1]] for i in range(3) for s in range(SHARDS)]
    task = store.load(flat_ids, flat_idx, rows)
    if not traits.keeps_data:
        with _raises(UcmStoreError):
            store.wait(task)
        return
    store.wait(task)
    assert np.array_equal(src, dst)
    # and back through load_data into raw addresses
    dst2 = np.zeros_like(src)
    addrs2 = np.array(
        [[dst2[i, s, k].ctypes.data for k in range(2)] for i in range(3) for s in range(SHARDS)],
        dtype=np.uint64,
    )
    store.wait(store.load_data(flat_ids, flat_idx, addrs2))
    assert np.array_equal(src, dst2)


def check_check_never_blocks_and_wait_consumes(store: UcmKVStoreBase, traits: StoreTraits) -> None:
    """``check`` answers a bool; a task can be waited for once only."""
    blocks = block_ids(2, salt=3)
    t = store.dump(
        [x for x in blocks for _ in range(SHARDS)],
        [s for _ in blocks for s in range(SHARDS)],
        [shard_tensors(i) for i in range(2 * SHARDS)],
    )
    assert isinstance(store.check(t), bool)
    store.wait(t)
    with _raises(UcmStoreError):
        store.wait(t)


def check_bad_ids_are_rejected(store: UcmKVStoreBase, traits: StoreTraits) -> None:
    """Ids of other than 16 bytes, mismatched lists and (where the store
    knows its layout) wrong shard sizes are refused with ``InvalidParamError``."""
    import torch

    for bad in ([b"x" * 15], [b"x" * 17]):
        with _raises(InvalidParamError, match="16 bytes"):
            store.lookup(bad)
        with _raises(InvalidParamError):
            store.dump(bad, [0], [shard_tensors(0)])
    with _raises(InvalidParamError):
        store.dump([b"x" * 16], [0, 1], [shard_tensors(0)])
    if traits.knows_layout:
        with _raises(InvalidParamError, match="shard_size"):
            store.dump([b"x" * 16], [0], [[torch.zeros(10)]])


#: Every check, in the order they are best run.
CHECKS: tuple[Callable[[UcmKVStoreBase, StoreTraits], None], ...] = (
    check_lookup_misses_then_hits,
    check_round_trip_tensors,
    check_round_trip_numpy_and_raw_addresses,
    check_check_never_blocks_and_wait_consumes,
    check_bad_ids_are_rejected,
)
