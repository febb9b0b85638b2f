"""``UcmPipelineStore``: the built-in stores behind the common API.

``store_pipeline`` names the stages top to bottom: ``"Posix"``, ``"S3"``,
``"NFS"``, ``"Mooncake"``, ``"Empty"``, a ``Cache`` over any of them
(``"Cache|Posix"``, ``"Cache|Mooncake"``...), or ``"Cache|<name>"`` where ``<name>``
is a store registered through :class:`~ucm.store.factory.UcmConnectorFactory`
(a :class:`~ucm.store.base.UcmKVStoreBase` subclass written in Python).

The stack is composed in the Rust core: the bottom stage is opened first,
then each ``Cache`` is built over it, so a ``Cache|Posix`` transfer never
crosses into Python. A Python stage under the cache is called back (with the
GIL) only for cache misses, write-backs and lookups the cache can't answer.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from functools import partialmethod
from typing import Any

import numpy as np

from ucm import _native
from ucm.errors import InvalidParamError
from ucm.store.base import Task, UcmKVStoreBase
from ucm.store.config import PipelineStoreConfig, StageConfig, stage_schemas
from ucm.store.memory import Regions, as_addr_matrix, pack_tensors


def _connect(client: str, cfg: StageConfig) -> Any:
    """The client of another system that the stage ``cfg`` is opened with
    (the stage registry names it)."""
    if client == "mooncake":
        from ucm.store.mooncake import MooncakePool

        return MooncakePool.connect(cfg)
    raise InvalidParamError(f"stage {cfg.name}: no way to build its {client!r} client")


def _close_quietly(native: _native.NativeStore) -> None:
    try:
        native.close()
    except Exception:  # at interpreter exit, nobody can act on it
        pass


class UcmPipelineStore(UcmKVStoreBase):
    """The built-in stores, configured by one flat mapping (see
    :class:`~ucm.store.config.PipelineStoreConfig`)."""

    def __init__(self, config: Mapping[str, Any] | PipelineStoreConfig) -> None:
        if not isinstance(config, PipelineStoreConfig):
            config = PipelineStoreConfig.from_dict(config)
        super().__init__(dict(stages=config.stages, store_pipeline=config.store_pipeline))
        self.pipeline_config = config
        stages = config.stages
        schemas = stage_schemas()
        builtin = [(cfg.name, dict(cfg.values)) for name, cfg in stages if name in schemas]
        bottom_name, bottom_cfg = stages[-1]
        external: UcmKVStoreBase | None = None
        if bottom_name not in schemas:
            if len(stages) == 1:
                raise InvalidParamError(
                    f"store_pipeline {config.store_pipeline!r}: a registered store alone is not "
                    f"a pipeline; create it with UcmConnectorFactory.create_connector"
                    f"({bottom_name!r}, config), or put it under a cache ('Cache|{bottom_name}')"
                )
            from ucm.store.factory import UcmConnectorFactory

            external = UcmConnectorFactory.create_connector(bottom_name, bottom_cfg)
        clients: dict[str, Any] = {}
        try:
            for name, cfg in stages:
                client = schemas[name].client if name in schemas else None
                if client is not None:
                    clients[client] = _connect(client, cfg)
        except BaseException:
            for opened in [*clients.values(), external]:
                if opened is not None:
                    opened.close()
            raise
        try:
            # The bottom stage first, then each tier over it; if a stage
            # fails, the core closes what it was given and what it opened.
            native = _native.NativeStore.open_pipeline(builtin, external, clients)
        except BaseException:
            for client in clients.values():
                client.close()
            raise
        self.stage_name = stages[0][0]
        self._sizes: list[int] = list(getattr(stages[0][1], "tensor_size_list", None) or [])
        self._native = native
        # Close (and so flush, and leave a shared segment) at interpreter exit
        # even if nobody calls close().
        self._finalizer = weakref.finalize(self, _close_quietly, native)

    @property
    def native(self) -> _native.NativeStore:
        """The native store at the top of the pipeline (what the debug hooks
        of the tests' ``support.store_debug`` act on)."""
        return self._native

    # -- lookups ---------------------------------------------------------
    def lookup(self, block_ids: Sequence[bytes]) -> list[bool]:
        return self._native.lookup(block_ids)

    def lookup_on_prefix(self, block_ids: Sequence[bytes]) -> int:
        return self._native.lookup_on_prefix(block_ids)

    def prefetch(self, block_ids: Sequence[bytes]) -> None:
        self._native.prefetch(block_ids)

    # -- transfers -------------------------------------------------------
    # The native store keeps the tensors of a transfer alive until the
    # transfer finished, so a dropped Task never frees memory in use.
    def _transfer(
        self,
        block_ids: Sequence[bytes],
        shard_index: Sequence[int],
        tensors: Sequence[Sequence[Any]] | Regions,
        load: bool,
    ) -> Task:
        """A load (into ``tensors``, which must be writable) or a dump.
        :meth:`load` and :meth:`dump` are this with ``load`` fixed."""
        if isinstance(tensors, Regions):
            bounds = tensors.bounds(writable=load)
            addrs = as_addr_matrix(tensors.addrs, len(block_ids), "Regions.addrs")
            return self._addr_transfer(
                block_ids, shard_index, addrs, load=load, owner=tensors, bounds=bounds
            )
        tid = self._native.transfer(
            "load" if load else "dump",
            block_ids,
            list(shard_index),
            segments=pack_tensors(tensors, len(block_ids), writable=load),
            owner=tensors,
        )
        return Task(tid)

    load = partialmethod(_transfer, load=True)
    dump = partialmethod(_transfer, load=False)

    def load_data(
        self, block_ids: Sequence[bytes], shard_index: Sequence[int], dst_addr: np.ndarray
    ) -> Task:
        """Like :meth:`load`, into raw addresses. **Unchecked**: the store
        can't tell what the addresses point to, nor keep that memory alive;
        it must stay allocated and untouched until :meth:`wait` returned. A
        wrong address corrupts the process. Prefer :meth:`load` with tensors
        or :class:`~ucm.store.memory.Regions`."""
        return self._addr_transfer(block_ids, shard_index, dst_addr, load=True)

    def _addr_transfer(
        self,
        block_ids: Sequence[bytes],
        shard_index: Sequence[int],
        addr: np.ndarray,
        prerequisite_handle: int = 0,
        *,
        load: bool,
        owner: Regions | None = None,
        bounds: list[tuple[int, int]] | None = None,
    ) -> Task:
        """A load or dump with addresses; :meth:`dump_data` is this with
        ``load`` false. Without ``bounds`` (the memory of ``owner``, which is
        kept alive meanwhile) it is **unchecked**, like :meth:`load_data`: the
        memory must stay allocated and unchanged until :meth:`wait` returned."""
        addrs = as_addr_matrix(addr, len(block_ids))
        tid = self._native.transfer(
            "load" if load else "dump",
            block_ids,
            _indices(shard_index),
            addrs=addrs,
            sizes=self._col_sizes(addrs),
            bounds=bounds,
            prerequisite_handle=prerequisite_handle,
            owner=owner,
        )
        return Task(tid)

    dump_data = partialmethod(_addr_transfer, load=False)

    def _col_sizes(self, addrs: np.ndarray) -> list[int]:
        # Stages without a layout (Empty) read and write nothing.
        return self._sizes or [0] * addrs.shape[1]

    def wait(self, task: Task) -> None:
        self._native.wait(_task_id(task))

    def check(self, task: Task) -> bool:
        return self._native.check(_task_id(task))

    # -- management ------------------------------------------------------
    def _posix_prefix(self) -> str | None:
        """Where the Posix stage's figures sit in the native ones (each stage
        above it adds ``backend.``), or None without a Posix stage."""
        names = [name for name, _ in self.pipeline_config.stages]
        return "backend." * names.index("Posix") if "Posix" in names else None

    def stats(self) -> dict[str, Any]:
        """Counters of the Posix stage (blocks, bytes, loads, dumps,
        evictions...) and its ``io_engine``; empty without a Posix stage."""
        prefix = self._posix_prefix()
        if prefix is None:
            return {}
        out: dict[str, Any] = {
            k[len(prefix) :]: int(v)
            for k, v in self._native.get_stats().items()
            if k.startswith(prefix) and "." not in k[len(prefix) :]
        }
        out["io_engine"] = self.describe().get(f"{prefix}io_engine")
        return out

    def get_stats(self) -> dict[str, float]:
        """Figures of the whole pipeline: for a ``Cache`` stage ``l1_hit_rate``,
        ``l2_hit_rate``, ``avg_load_latency_ms``, ``p99_load_latency_ms``,
        ``eviction_count``, ``bytes_loaded_l1``/``_l2``, ``bytes_dumped_l1``/``_l2``,
        ``dirty_blocks``, ``write_back_failures`` and more, the figures of the
        stage below under ``backend.``; the Posix stage's counters also under
        ``posix.``."""
        out = dict(self._native.get_stats())
        prefix = self._posix_prefix()
        if prefix is not None:
            for k, v in list(out.items()):
                if k.startswith(prefix) and "." not in k[len(prefix) :]:
                    out[f"posix.{k[len(prefix) :]}"] = v
        return out

    def describe(self) -> dict[str, str]:
        """Facts about the stages that are not figures: the Posix stage's
        ``io_engine``, ``storage_backends`` and ``durability``, a cache's
        ``slots`` and ``shm_path`` (shared mode); the stage below's under
        ``backend.``."""
        return dict(self._native.describe())

    def flush(self) -> None:
        """Writes every dirty cached block to the backend; raises
        :class:`~ucm.errors.TaskFailedError` naming how many could not be
        written (they stay dirty in the cache and are retried)."""
        self._native.flush()

    def close(self) -> None:
        """Flushes (a cache), then stops every stage. Raises if the flush
        failed; the stores are closed either way."""
        self._finalizer.detach()
        self._native.close()


def _task_id(task: Any) -> Any:
    """The handle inside a :class:`Task`; anything else goes to the native
    store as it is, which names what it got."""
    return task.task_id if isinstance(task, Task) else task


def _indices(shard_index: Sequence[int] | np.ndarray) -> np.ndarray | list[int]:
    if isinstance(shard_index, np.ndarray):
        return np.ascontiguousarray(shard_index, dtype=np.int64)
    return list(shard_index)
