"""``UcmPipelineStore``: the built-in stores behind the common API.

``store_pipeline`` names the stages top to bottom. This release provides the
single stages ``"Posix"`` and ``"Empty"``, implemented in the Rust core.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ucm import _native
from ucm.store.base import Task, UcmKVStoreBase
from ucm.store.config import GIB, EmptyStoreConfig, PipelineStoreConfig, PosixStoreConfig
from ucm.store.errors import InvalidParamError
from ucm.store.memory import as_addr_matrix, pack_tensors


def _open_native(name: str, cfg: Any) -> _native.NativeStore:
    if isinstance(cfg, PosixStoreConfig):
        return _native.NativeStore.posix(
            storage_backends=list(cfg.storage_backends),
            block_size=cfg.block_size,
            shard_size=cfg.shard_size,
            tensor_size_list=list(cfg.tensor_size_list or []),
            io_direct=cfg.io_direct,
            io_engine=cfg.io_engine,
            io_threads=cfg.io_threads,
            timeout_ms=cfg.timeout_ms,
            capacity_bytes=int(cfg.posix_capacity_gb * GIB),
            device_id=cfg.device_id,
            spare_files=cfg.posix_spare_files,
        )
    if isinstance(cfg, EmptyStoreConfig):
        return _native.NativeStore.empty(timeout_ms=cfg.timeout_ms)
    raise InvalidParamError(f"store_pipeline: stage {name!r} has no native implementation")


class UcmPipelineStore(UcmKVStoreBase):
    """The built-in stores, configured by one flat mapping (see
    :class:`~ucm.store.config.PipelineStoreConfig`)."""

    def __init__(self, config: Mapping[str, Any] | PipelineStoreConfig) -> None:
        if not isinstance(config, PipelineStoreConfig):
            config = PipelineStoreConfig.from_dict(config)
        super().__init__(dict(stages=config.stages, store_pipeline=config.store_pipeline))
        self.pipeline_config = config
        if len(config.stages) != 1:
            raise InvalidParamError(
                f"store_pipeline {config.store_pipeline!r}: composing stages is not "
                "available in this build; use a single stage ('Posix' or 'Empty')"
            )
        name, cfg = config.stages[0]
        self.stage_name = name
        self._sizes: list[int] = list(getattr(cfg, "tensor_size_list", None) or [])
        self._native = _open_native(name, cfg)

    # -- lookups ---------------------------------------------------------
    def lookup(self, block_ids: Sequence[bytes]) -> list[bool]:
        return self._native.lookup(block_ids)

    def lookup_on_prefix(self, block_ids: Sequence[bytes]) -> int:
        return self._native.lookup_on_prefix(block_ids)

    def prefetch(self, block_ids: Sequence[bytes]) -> None:
        self._native.prefetch(block_ids)

    # -- transfers -------------------------------------------------------
    def load(
        self,
        block_ids: Sequence[bytes],
        shard_index: Sequence[int],
        tensors: Sequence[Sequence[Any]],
    ) -> Task:
        ptrs, lens, offsets = pack_tensors(tensors, len(block_ids), writable=True)
        tid = self._native.load_segs(block_ids, list(shard_index), ptrs, lens, offsets)
        return Task(tid, keepalive=tensors)

    def dump(
        self,
        block_ids: Sequence[bytes],
        shard_index: Sequence[int],
        tensors: Sequence[Sequence[Any]],
    ) -> Task:
        ptrs, lens, offsets = pack_tensors(tensors, len(block_ids), writable=False)
        tid = self._native.dump_segs(block_ids, list(shard_index), ptrs, lens, offsets)
        return Task(tid, keepalive=tensors)

    def load_data(
        self, block_ids: Sequence[bytes], shard_index: Sequence[int], dst_addr: np.ndarray
    ) -> Task:
        addrs = as_addr_matrix(dst_addr, len(block_ids))
        tid = self._native.load_addrs(
            block_ids, _indices(shard_index), addrs, self._col_sizes(addrs)
        )
        return Task(tid)

    def dump_data(
        self,
        block_ids: Sequence[bytes],
        shard_index: Sequence[int],
        src_addr: np.ndarray,
        prerequisite_handle: int = 0,
    ) -> Task:
        addrs = as_addr_matrix(src_addr, len(block_ids))
        tid = self._native.dump_addrs(
            block_ids, _indices(shard_index), addrs, self._col_sizes(addrs), prerequisite_handle
        )
        return Task(tid)

    def _col_sizes(self, addrs: np.ndarray) -> list[int]:
        # Stages without a layout (Empty) read and write nothing.
        return self._sizes or [0] * addrs.shape[1]

    def wait(self, task: Task) -> None:
        try:
            self._native.wait(task.task_id)
        finally:
            task.keepalive = None

    def check(self, task: Task) -> bool:
        return self._native.check(task.task_id)

    # -- management ------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters of the store (blocks, bytes, loads, dumps, evictions...)."""
        return dict(self._native.stats())

    def block_path(self, block_id: bytes) -> str | None:
        """Where a block's file lives (Posix), for tools and tests."""
        return self._native.block_path(block_id)

    def close(self) -> None:
        self._native.close()


def _indices(shard_index: Sequence[int] | np.ndarray) -> np.ndarray | list[int]:
    if isinstance(shard_index, np.ndarray):
        return np.ascontiguousarray(shard_index, dtype=np.int64)
    return list(shard_index)
