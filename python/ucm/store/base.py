"""The store API every UCM store implements (the v1 API of the original UCM).

Block ids are exactly 16 bytes. A block is split into ``block_size /
shard_size`` shards; ``load``/``dump`` move whole shards, each described by
the list of tensors (or raw addresses) whose concatenated bytes form it.
Transfers are asynchronous: they return a :class:`Task` at once, and
:meth:`UcmKVStoreBase.wait` (blocking, GIL released) or
:meth:`UcmKVStoreBase.check` (never blocks) tell how it went.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ucm.store.memory import Regions


@dataclass(eq=False)
class Task:
    """Handle of a submitted load or dump.

    Dropping it without waiting is harmless: a store keeps the memory of a
    transfer alive until the transfer finished (the built-in stores hold the
    tensors in the native store; a store written in Python may use
    ``keepalive`` for what its own threads still use).
    """

    task_id: int
    keepalive: Any = field(default=None, repr=False)


class UcmKVStoreBase(abc.ABC):
    """Abstract store: subclass it to write a store in Python.

    All methods must be thread-safe. A store written in Python and registered
    through :class:`~ucm.store.factory.UcmConnectorFactory` is used exactly
    like the built-in ones.
    """

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config

    @abc.abstractmethod
    def lookup(self, block_ids: Sequence[bytes]) -> list[bool]:
        """Presence of each block, independently of the others."""

    @abc.abstractmethod
    def lookup_on_prefix(self, block_ids: Sequence[bytes]) -> int:
        """Index of the last block of the longest present prefix, or -1."""

    @abc.abstractmethod
    def prefetch(self, block_ids: Sequence[bytes]) -> None:
        """Hint that these blocks will be loaded soon (no error on misses)."""

    @abc.abstractmethod
    def load(
        self,
        block_ids: Sequence[bytes],
        shard_index: Sequence[int],
        tensors: Sequence[Sequence[Any]] | Regions,
    ) -> Task:
        """Copies shard ``shard_index[i]`` of block ``block_ids[i]`` into the
        tensors ``tensors[i]`` (torch CPU tensors or numpy arrays, used in
        place), or into the addresses of a :class:`~ucm.store.memory.Regions`
        (checked against its tensors). This is the safe form: the tensors stay
        alive until the transfer finished, even if the task is dropped.
        :func:`~ucm.store.memory.pack_tensors` turns either form into
        (address, length) segments for a store written in Python."""

    @abc.abstractmethod
    def dump(
        self,
        block_ids: Sequence[bytes],
        shard_index: Sequence[int],
        tensors: Sequence[Sequence[Any]] | Regions,
    ) -> Task:
        """Stores the tensors ``tensors[i]`` (or the regions of a
        :class:`~ucm.store.memory.Regions`) as shard ``shard_index[i]`` of
        block ``block_ids[i]``. Safe like :meth:`load`."""

    @abc.abstractmethod
    def load_data(
        self, block_ids: Sequence[bytes], shard_index: Sequence[int], dst_addr: np.ndarray
    ) -> Task:
        """Like :meth:`load`, into raw addresses: a 2-D uint64 array with one
        row per shard and one column per tensor of ``tensor_size_list``.

        **Unchecked**: nothing tells the store what the addresses point to or
        keeps that memory alive. It must stay allocated and untouched until
        :meth:`wait` returned, and a wrong address corrupts the process. For
        the connector's and other internal use, :meth:`load` with a
        :class:`~ucm.store.memory.Regions` is the safe equivalent."""

    @abc.abstractmethod
    def dump_data(
        self,
        block_ids: Sequence[bytes],
        shard_index: Sequence[int],
        src_addr: np.ndarray,
        prerequisite_handle: int = 0,
    ) -> Task:
        """Like :meth:`dump`, from raw addresses. ``prerequisite_handle`` is an
        event the store waits on before reading device memory (0 = none).
        **Unchecked**, like :meth:`load_data`."""

    @abc.abstractmethod
    def wait(self, task: Task) -> None:
        """Blocks until the task finished; raises a
        :class:`~ucm.errors.UcmStoreError` subclass if it failed or
        timed out. Consumes the handle: a second wait raises."""

    @abc.abstractmethod
    def check(self, task: Task) -> bool:
        """True when the task finished (successfully or not). Never blocks."""

    def close(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """Finishes in-flight work and releases resources."""

    def flush(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """Forces every block accepted by ``dump`` down to persistent storage;
        raises if some could not be written. Write-through stores have nothing
        to do."""

    def get_stats(self) -> dict[str, float]:
        """The store's figures (hit rates, latencies, bytes, ...); empty by
        default. Pipelines with a ``Cache`` stage report ``l1_hit_rate``,
        ``l2_hit_rate``, ``avg_load_latency_ms``, ``p99_load_latency_ms``,
        ``eviction_count``, bytes loaded and dumped per tier, ``dirty_blocks``
        and ``write_back_failures``."""
        return {}

    def __enter__(self) -> UcmKVStoreBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
