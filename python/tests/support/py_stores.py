"""A store written in Python, as a user would: registered through the
factory and run through the same conformance suite as the built-in stores."""

from __future__ import annotations

import ctypes
import itertools
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from ucm.store import BlockNotFoundError, InvalidParamError, Task, UcmKVStoreBase
from ucm.store.memory import as_addr_matrix, pack_tensors


class DictStore(UcmKVStoreBase):
    """Keeps every shard in a dict; transfers run synchronously at submit."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self.shard_size = int(config["shard_size"])
        self.shards = int(config["block_size"]) // self.shard_size
        self.sizes = list(config.get("tensor_size_list") or [self.shard_size])
        self._data: dict[tuple[bytes, int], bytes] = {}
        self._tasks: dict[int, Exception | None] = {}
        self._next = 1
        self._lock = threading.Lock()

    def _check_ids(self, ids: Sequence[bytes]) -> None:
        for i, b in enumerate(ids):
            if not isinstance(b, bytes) or len(b) != 16:
                raise InvalidParamError(f"block_ids[{i}] must be exactly 16 bytes")

    def _present(self, bid: bytes) -> bool:
        return all((bid, s) in self._data for s in range(self.shards))

    def lookup(self, block_ids: Sequence[bytes]) -> list[bool]:
        self._check_ids(block_ids)
        with self._lock:
            return [self._present(b) for b in block_ids]

    def lookup_on_prefix(self, block_ids: Sequence[bytes]) -> int:
        hits = self.lookup(block_ids)
        return hits.index(False) - 1 if False in hits else len(hits) - 1

    def prefetch(self, block_ids: Sequence[bytes]) -> None:
        self._check_ids(block_ids)

    def _finish(self, err: Exception | None) -> Task:
        with self._lock:
            tid = self._next
            self._next += 1
            self._tasks[tid] = err
        return Task(tid)

    def _move(self, ids, idx, rows, load: bool) -> Task:
        self._check_ids(ids)
        if len(idx) != len(ids):
            raise InvalidParamError("shard_index must match block_ids")
        err: Exception | None = None
        for bid, s, segs in zip(ids, idx, rows, strict=True):
            if sum(n for _, n in segs) != self.shard_size:
                raise InvalidParamError("tensors must sum to shard_size")
            if load:
                with self._lock:
                    blob = self._data.get((bid, s)) if self._present(bid) else None
                if blob is None:
                    err = err or BlockNotFoundError(f"block {bid.hex()} shard {s}")
                    continue
                off = 0
                for p, n in segs:
                    ctypes.memmove(p, blob[off : off + n], n)
                    off += n
            else:
                blob = b"".join(ctypes.string_at(p, n) for p, n in segs)
                with self._lock:
                    self._data[(bid, s)] = blob
        return self._finish(err)

    @staticmethod
    def _rows(ptrs, lens, offsets):
        return [
            list(zip(ptrs[a:b], lens[a:b], strict=True)) for a, b in itertools.pairwise(offsets)
        ]

    def load(self, block_ids, shard_index, tensors) -> Task:
        rows = self._rows(*pack_tensors(tensors, len(block_ids), writable=True, sizes=self.sizes))
        return self._move(block_ids, list(shard_index), rows, load=True)

    def dump(self, block_ids, shard_index, tensors) -> Task:
        rows = self._rows(*pack_tensors(tensors, len(block_ids), writable=False, sizes=self.sizes))
        return self._move(block_ids, list(shard_index), rows, load=False)

    def _addr_rows(self, addrs: np.ndarray, n: int):
        m = as_addr_matrix(addrs, n)
        return [list(zip(map(int, r), self.sizes, strict=True)) for r in m]

    def load_data(self, block_ids, shard_index, dst_addr) -> Task:
        rows = self._addr_rows(dst_addr, len(block_ids))
        return self._move(block_ids, list(shard_index), rows, load=True)

    def dump_data(self, block_ids, shard_index, src_addr, prerequisite_handle: int = 0) -> Task:
        rows = self._addr_rows(src_addr, len(block_ids))
        return self._move(block_ids, list(shard_index), rows, load=False)

    def wait(self, task: Task) -> None:
        with self._lock:
            if task.task_id not in self._tasks:
                raise BlockNotFoundError(f"task {task.task_id} is unknown or was already waited")
            err = self._tasks.pop(task.task_id)
        if err is not None:
            raise err

    def check(self, task: Task) -> bool:
        with self._lock:
            if task.task_id not in self._tasks:
                raise BlockNotFoundError(f"task {task.task_id} is unknown or was already waited")
        return True
