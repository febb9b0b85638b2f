"""Moving KV blocks between vLLM's paged cache and the store.

:class:`KVTransfer` does the steps every transfer takes, for the connector's
worker (prefix loads and saves) and for the sparse bridge (selected blocks
loaded into swap blocks): the shard plan (one store shard per block and
layer, with the address of each of its runs), host staging where the KV cache
is device memory the store can't address, the store call, and the copy of
staged blocks into the cache. Callers keep their own bookkeeping: which
request a transfer belongs to, statistics, threads.

The store is called in exactly one place, :func:`_store_submit`, through its
safe API: the addresses go with the tensors that own the memory they point
into (the KV cache layers, or the host staging buffer), which the store
checks them against and keeps alive.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from ucm.integration.vllm.layout import KVLayout
from ucm.store.memory import Regions

if TYPE_CHECKING:
    from ucm.store import Task, UcmKVStoreBase


class StoreUnusable(Exception):
    """The store was unusable when a transfer was due."""


def _store_submit(
    op: Literal["load", "dump"],
    store: UcmKVStoreBase,
    keys: list[bytes],
    shard_idx: np.ndarray,
    addrs: np.ndarray,
    owners: list[Any],
) -> Task:
    """Submits a load into (or a dump from) ``addrs``, which point into the
    tensors ``owners`` (vLLM's KV caches, or the host staging buffer): the
    store checks every address range against them and keeps them alive until
    the transfer has finished, whatever happens to the task."""
    submit = store.load if op == "load" else store.dump
    return submit(keys, shard_idx, Regions(owners, addrs))


class HostStaging:
    """Moves blocks between a device KV cache and host buffers (GPU builds).

    The copies are issued on the current (compute) stream, so they are
    ordered after the attention that wrote the KV (saves) and before the
    attention that reads it (loads) without extra synchronization.
    """

    def __init__(self, layout: KVLayout, event_sync: bool) -> None:
        import torch

        self.layout = layout
        self.device = layout.layers[0].tensors[0].device
        self.is_cuda = self.device.type == "cuda"
        self.pin = self.is_cuda and torch.cuda.is_available()
        self.event_sync = event_sync

    def alloc(self, n_layers: int, n_blocks: int) -> tuple[Any, np.ndarray]:
        """A ``[n_layers, n_blocks, runs, run_bytes]`` host buffer and its run addresses."""
        import torch

        lay = self.layout
        buf = torch.empty(
            (n_layers, n_blocks, lay.runs, lay.run_bytes), dtype=torch.uint8, pin_memory=self.pin
        )
        base = np.uint64(buf.data_ptr())
        k = np.arange(n_layers * n_blocks * lay.runs, dtype=np.uint64).reshape(-1, lay.runs)
        return buf, base + k * np.uint64(lay.run_bytes)

    def gather(self, layer_pos: list[int], blocks: list[int]) -> tuple[Any, np.ndarray, Any]:
        """Copies ``blocks`` of these layers to a new host buffer; returns it,
        its addresses and an event to wait on before reading it (or None)."""
        import torch

        buf, addrs = self.alloc(len(layer_pos), len(blocks))
        idx = torch.as_tensor(blocks, dtype=torch.long, device=self.device)
        for li, pos in enumerate(layer_pos):
            for r, view in enumerate(self.layout.layers[pos].run_views):
                buf[li, :, r].copy_(view.index_select(0, idx), non_blocking=self.pin)
        event = None
        if self.is_cuda:
            if self.event_sync:
                event = torch.cuda.Event()
                event.record()
            else:
                torch.cuda.synchronize(self.device)
        return buf, addrs, event

    def scatter(self, buf: Any, layer_pos: list[int], blocks: list[int]) -> None:
        """Copies a host buffer filled by a load into the KV cache."""
        import torch

        idx = torch.as_tensor(blocks, dtype=torch.long, device=self.device)
        for li, pos in enumerate(layer_pos):
            for r, view in enumerate(self.layout.layers[pos].run_views):
                src = buf[li, :, r]
                if self.is_cuda:
                    src = src.to(self.device, non_blocking=self.pin)
                view.index_copy_(0, idx, src)


@dataclass
class PendingLoad:
    """A submitted load of some blocks for some layers (see :meth:`KVTransfer.load`)."""

    store: UcmKVStoreBase | None
    layer_pos: list[int]
    blocks: list[int]
    task: Task | None = None
    owners: list[Any] = field(default_factory=list)
    """The tensors the store writes into (KV cache layers or a staging buffer)."""
    staged: Any = None
    """The host staging buffer, copied into the cache by :meth:`KVTransfer.finish_load`."""
    error: BaseException | None = None

    def wait(self) -> BaseException | None:
        """Blocks until the store is done (any thread); returns the load's error, if any."""
        if self.error is None and self.store is not None and self.task is not None:
            try:
                self.store.wait(self.task)
            except Exception as e:
                self.error = e
        return self.error


@dataclass
class PendingSave:
    """A save of some blocks for some layers (see :meth:`KVTransfer.save`)."""

    store: UcmKVStoreBase
    keys: list[bytes] = field(default_factory=list)
    shard_idx: Any = None
    addrs: Any = None
    owners: list[Any] = field(default_factory=list)
    """The tensors the store reads from (KV cache layers or a staging buffer)."""
    copy_done: Any = None
    """Device event of the copy into the staging buffer; the dump waits for it."""
    task: Task | None = None
    error: BaseException | None = None

    def submit(self) -> None:
        """Submits the dump, once the copy into the staging buffer is done (blocks on it)."""
        if self.copy_done is not None:
            try:
                self.copy_done.synchronize()
            except Exception as e:  # pragma: no cover - device failure
                self.error = e
            self.copy_done = None
        if self.error is not None:
            return
        try:
            self.task = _store_submit(
                "dump", self.store, self.keys, self.shard_idx, self.addrs, self.owners
            )
        except Exception as e:
            self.error = e

    def wait(self) -> BaseException | None:
        """Blocks until the store is done; returns the save's error, if any.
        The source memory is released either way."""
        if self.error is None and self.task is not None:
            try:
                self.store.wait(self.task)
            except Exception as e:
                self.error = e
        self.owners = []
        self.addrs = None
        return self.error


class KVTransfer:
    """Loads and saves blocks of one worker's registered KV cache."""

    def __init__(self, layout: KVLayout, staging: HostStaging | None) -> None:
        self.layout = layout
        self.staging = staging
        self._layer_pos = layout.layer_by_name()

    @property
    def num_layers(self) -> int:
        """Attention layers of this worker (shards it moves per block)."""
        return len(self.layout.layers)

    def layer_position(self, layer_name: str) -> int | None:
        """Position of a vLLM attention layer in :attr:`layout` (None: not ours)."""
        return self._layer_pos.get(layer_name)

    def load(
        self,
        store: UcmKVStoreBase | None,
        layer_pos: list[int],
        keys: list[bytes],
        blocks: list[int],
    ) -> PendingLoad:
        """Submits a load of store blocks ``keys`` into vLLM blocks ``blocks`` for
        these layers. Never raises: a failure is the pending load's ``error``
        (:class:`StoreUnusable` when ``store`` is None)."""
        pending = PendingLoad(store, layer_pos, blocks)
        if store is None:
            pending.error = StoreUnusable("the store is unusable")
            return pending
        try:
            host_addrs = None
            if self.staging is not None:
                pending.staged, host_addrs = self.staging.alloc(len(layer_pos), len(keys))
                pending.owners = [pending.staged]
            else:
                pending.owners = self._kv_tensors(layer_pos)
            rep_keys, shard_idx, addrs = self._shard_plan(layer_pos, keys, blocks, host_addrs)
            pending.task = _store_submit("load", store, rep_keys, shard_idx, addrs, pending.owners)
        except Exception as e:
            pending.error = e
        return pending

    def finish_load(self, pending: PendingLoad) -> None:
        """After a successful :meth:`PendingLoad.wait`: copies staged blocks into
        the KV cache (on the compute stream; nothing to do without staging)."""
        if self.staging is not None and pending.staged is not None:
            self.staging.scatter(pending.staged, pending.layer_pos, pending.blocks)
        pending.staged = None
        pending.owners = []

    def save(
        self,
        store: UcmKVStoreBase,
        layer_pos: list[int],
        keys: list[bytes],
        blocks: list[int],
    ) -> PendingSave:
        """Saves vLLM blocks ``blocks`` of these layers as store blocks ``keys``.

        Submitted at once, unless the blocks are first copied to a staging
        buffer by the device: then ``copy_done`` is set and the caller submits
        (:meth:`PendingSave.submit`) off the compute thread. Never raises.
        """
        pending = PendingSave(store)
        try:
            host_addrs = None
            if self.staging is not None:
                buf, host_addrs, pending.copy_done = self.staging.gather(layer_pos, blocks)
                pending.owners = [buf]
            else:
                pending.owners = self._kv_tensors(layer_pos)
            pending.keys, pending.shard_idx, pending.addrs = self._shard_plan(
                layer_pos, keys, blocks, host_addrs
            )
        except Exception as e:
            pending.error = e
        if pending.copy_done is None:
            pending.submit()
        return pending

    def _kv_tensors(self, layer_pos: list[int]) -> list[Any]:
        return [t for p in layer_pos for t in self.layout.layers[p].tensors]

    def _shard_plan(
        self,
        layer_pos: list[int],
        keys: list[bytes],
        blocks: list[int],
        host_addrs: np.ndarray | None = None,
    ) -> tuple[list[bytes], np.ndarray, np.ndarray]:
        """Keys, shard indices and addresses of these blocks' shards for these
        layers, block-major (a block's shards are adjacent in its file, so
        multi-layer transfers read and write each file front to back).
        ``host_addrs`` (staging) are in the buffer's layer-major order."""
        n, nl = len(keys), len(layer_pos)
        lay = self.layout
        shard_idx = np.tile(np.array([lay.layers[p].shard_index for p in layer_pos], np.int64), n)
        if host_addrs is not None:
            per_layer = host_addrs.reshape(nl, n, lay.runs)
        else:
            vb = np.asarray(blocks, dtype=np.int64)
            per_layer = np.stack([lay.layers[p].addrs(vb) for p in layer_pos])
        addrs = np.ascontiguousarray(per_layer.transpose(1, 0, 2).reshape(n * nl, lay.runs))
        return [k for k in keys for _ in range(nl)], shard_idx, addrs


__all__ = [
    "HostStaging",
    "KVTransfer",
    "PendingLoad",
    "PendingSave",
    "StoreUnusable",
]
