"""Describing caller memory for the native stores.

Tensors are used in place: only their address and size cross into Rust.
A transfer names its memory in one of two safe forms:

* rows of tensors, ``tensors[i]`` being the tensors whose concatenated bytes
  form shard ``i``; each shard becomes a list of (address, length) segments,
  packed in CSR form (flat pointers, flat lengths, row offsets) so a batch
  crosses the binding in three arrays;
* :class:`Regions`: an address matrix pointing inside tensors the caller
  hands over with it (a whole KV cache, a staging buffer), which avoids
  building one tensor view per shard; the store checks every address range
  against those tensors.

Either way the store keeps the tensors alive until the transfer finished,
whatever happens to the task handle.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ucm.errors import InvalidParamError


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


@dataclass(frozen=True)
class Regions:
    """Shards given as addresses inside tensors the caller owns.

    ``addrs`` is an (n_shards, k) uint64 matrix: entry ``[i][j]`` is where
    tensor ``j`` of the store's ``tensor_size_list`` starts for shard ``i``.
    Every range must lie inside the memory of one of ``owners`` (contiguous
    torch CPU tensors or numpy arrays); the store checks this and keeps the
    owners alive until the transfer finished.
    """

    owners: Sequence[Any]
    addrs: Any

    def bounds(self, *, writable: bool) -> list[tuple[int, int]]:
        """(address, nbytes) of each owner's memory."""
        return [
            segment(t, f"Regions.owners[{i}]", writable=writable) for i, t in enumerate(self.owners)
        ]


def pack_tensors(
    tensors: Sequence[Sequence[Any]] | Regions,
    n_shards: int,
    *,
    writable: bool,
    sizes: Sequence[int] = (),
) -> tuple[list[int], list[int], list[int]]:
    """CSR description (ptrs, lens, offsets) of ``tensors[i][j]``, or of the
    address rows of a :class:`Regions` (whose columns are ``sizes`` bytes),
    checked against its owners."""
    if isinstance(tensors, Regions):
        return _pack_regions(tensors, n_shards, writable=writable, sizes=sizes)
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


def as_addr_matrix(addrs: Any, n_shards: int, what: str = "addresses") -> np.ndarray:
    """A C-contiguous (n_shards, k) uint64 array from an array or nested list;
    anything else (a negative or fractional address, None, text) is an
    :class:`InvalidParamError` naming ``what``."""
    try:
        arr = np.ascontiguousarray(np.asarray(addrs, dtype=np.uint64))
    except (OverflowError, TypeError, ValueError) as e:
        raise InvalidParamError(
            f"{what}: expected a 2-D array of addresses (unsigned 64-bit integers): {e}"
        ) from None
    if arr.ndim != 2 or arr.shape[0] != n_shards:
        raise InvalidParamError(
            f"{what} must be a 2-D array with one row per block id ({n_shards}), "
            f"got shape {arr.shape}"
        )
    return arr


def _pack_regions(
    regions: Regions, n_shards: int, *, writable: bool, sizes: Sequence[int]
) -> tuple[list[int], list[int], list[int]]:
    addrs = as_addr_matrix(regions.addrs, n_shards, "Regions.addrs")
    if addrs.shape[1] != len(sizes):
        raise InvalidParamError(
            f"Regions.addrs has {addrs.shape[1]} column(s) but the store's tensor_size_list "
            f"has {len(sizes)} entries"
        )
    bounds = sorted(regions.bounds(writable=writable))
    if not bounds:
        raise InvalidParamError("Regions.owners: at least one tensor is required")
    starts = np.array([b[0] for b in bounds], dtype=np.uint64)
    ends = np.array([b[0] + b[1] for b in bounds], dtype=np.uint64)
    lens = np.broadcast_to(np.asarray(sizes, dtype=np.uint64), addrs.shape)
    owner = np.searchsorted(starts, addrs, side="right").astype(np.int64) - 1
    inside = (owner >= 0) & (addrs + lens <= ends[np.clip(owner, 0, None)])
    if not inside.all():
        r, c = (int(x) for x in np.argwhere(~inside)[0])
        raise InvalidParamError(
            f"Regions.addrs[{r}][{c}]: {int(lens[r, c])} bytes at {int(addrs[r, c]):#x} lie "
            "outside the memory of the tensors given with them"
        )
    offsets = list(range(0, addrs.size + 1, addrs.shape[1]))
    return addrs.ravel().tolist(), lens.ravel().tolist(), offsets
