"""Describing caller memory for the native stores.

Tensors are used in place: only their address and size cross into Rust.
Each shard becomes a list of (address, length) segments, packed in CSR form
(flat pointers, flat lengths, row offsets) so a batch crosses the binding in
three arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ucm.store.errors import InvalidParamError


def segment(obj: Any, where: str, *, writable: bool) -> tuple[int, int]:
    """(address, nbytes) of a contiguous CPU tensor or numpy array."""
    if hasattr(obj, "data_ptr") and hasattr(obj, "is_contiguous"):  # torch.Tensor
        if obj.device.type != "cpu":
            raise InvalidParamError(
                f"{where}: tensor is on {obj.device}; this store moves host memory only"
            )
        if not obj.is_contiguous():
            raise InvalidParamError(f"{where}: tensor is not contiguous")
        return int(obj.data_ptr()), int(obj.numel() * obj.element_size())
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise InvalidParamError(f"{where}: array is not C-contiguous")
        if writable and not obj.flags.writeable:
            raise InvalidParamError(f"{where}: array is read-only and can't be loaded into")
        return int(obj.ctypes.data), int(obj.nbytes)
    raise InvalidParamError(
        f"{where}: expected a torch CPU tensor or a numpy array, got {type(obj).__name__}"
    )


def pack_tensors(
    tensors: Sequence[Sequence[Any]], n_shards: int, *, writable: bool
) -> tuple[list[int], list[int], list[int]]:
    """CSR description (ptrs, lens, offsets) of ``tensors[i][j]``."""
    if len(tensors) != n_shards:
        raise InvalidParamError(
            f"tensors has {len(tensors)} row(s) but block_ids has {n_shards}; they must match"
        )
    ptrs: list[int] = []
    lens: list[int] = []
    offsets = [0]
    for i, row in enumerate(tensors):
        if not isinstance(row, list | tuple):
            row = [row]
        for j, t in enumerate(row):
            p, n = segment(t, f"tensors[{i}][{j}]", writable=writable)
            ptrs.append(p)
            lens.append(n)
        offsets.append(len(ptrs))
    return ptrs, lens, offsets


def as_addr_matrix(addrs: Any, n_shards: int) -> np.ndarray:
    """A C-contiguous (n_shards, k) uint64 array from an array or nested list."""
    arr = np.ascontiguousarray(np.asarray(addrs, dtype=np.uint64))
    if arr.ndim != 2 or arr.shape[0] != n_shards:
        raise InvalidParamError(
            f"addresses must be a 2-D array with one row per block id ({n_shards}), "
            f"got shape {arr.shape}"
        )
    return arr
