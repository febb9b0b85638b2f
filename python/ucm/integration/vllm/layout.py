"""Where each KV block of each layer lives in vLLM's paged KV cache.

A store block holds one shard per attention layer (shard index = global
layer index). A shard is the bytes of one vLLM block of one layer, as a list
of contiguous *runs* of equal length (the store's ``tensor_size_list``):

* CPU attention (``LBHNC``): a layer is ``[num_blocks, H, N, 2*D]`` and a
  block is one run of ``H*N*2D`` elements (K transposed, then V, per head;
  the bytes are opaque to us).
* GPU FlashAttention in vLLM 0.32 (``LBNHC`` by default): ``[num_blocks, H, N,
  2*D]`` viewed over an ``[B, N, H, 2D]`` buffer: again one run per block.
  Layer-outer layouts such as ``LHBNC`` give one run per head.
* Older FlashAttention layouts ``[2, num_blocks, N, H, D]`` give two runs (K
  and V planes); MLA's ``[num_blocks, N, D]`` one run.

The runs are found from the tensor's strides alone, so any layout whose
block interior is made of equal contiguous runs at a fixed stride per block
works. Addresses are ``base[r] + block * block_stride[r]`` per run.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ucm.shared.config import ConfigError


class LayoutError(ConfigError):
    """The KV cache can't be described as equal runs per block."""


@dataclass
class LayerRegions:
    """The runs of one layer: run ``r`` of block ``b`` is at
    ``base[r] + b * block_stride`` and is ``run_bytes`` long."""

    name: str
    shard_index: int
    base: np.ndarray  # uint64 [runs]
    block_stride: int
    run_bytes: int
    tensors: list[Any] = field(default_factory=list, repr=False)
    """The layer's KV tensors (what its runs point into)."""
    block_dim: int = 0
    run_views: list[Any] = field(default_factory=list, repr=False)
    """Per run: a ``[num_blocks, run_bytes]`` uint8 view (for host staging)."""

    @property
    def runs(self) -> int:
        return len(self.base)

    def addrs(self, blocks: np.ndarray) -> np.ndarray:
        """``[len(blocks), runs]`` uint64 addresses of these blocks' runs."""
        b = np.asarray(blocks, dtype=np.uint64)
        return self.base[None, :] + b[:, None] * np.uint64(self.block_stride)


@dataclass
class KVLayout:
    """All local attention layers, in shard order."""

    layers: list[LayerRegions]
    num_layers_total: int
    run_bytes: int
    runs: int
    device_type: str

    @property
    def shard_bytes(self) -> int:
        return self.run_bytes * self.runs

    @property
    def block_bytes(self) -> int:
        """Bytes of a whole store block (every layer of the model)."""
        return self.shard_bytes * self.num_layers_total

    @property
    def tensor_size_list(self) -> list[int]:
        return [self.run_bytes] * self.runs

    def layer_by_name(self) -> dict[str, int]:
        return {layer.name: i for i, layer in enumerate(self.layers)}

    def addrs_all_layers(self, blocks: np.ndarray) -> np.ndarray:
        """``[layers * len(blocks), runs]``: layer-major, then block."""
        return np.concatenate([layer.addrs(blocks) for layer in self.layers], axis=0)

    def shard_indices_all_layers(self, n_blocks: int) -> np.ndarray:
        return np.repeat(
            np.array([layer.shard_index for layer in self.layers], dtype=np.int64), n_blocks
        )


def _manager_blocks(t: Any, num_blocks: int) -> Any:
    """When the attention kernel splits each vLLM block into k kernel blocks
    (the tensor has ``num_blocks * k`` of them), views it as
    ``[num_blocks, k, ...]`` so one vLLM block is k consecutive kernel blocks."""
    shape = tuple(t.shape)
    if num_blocks in shape[:2] or num_blocks <= 0:
        return t
    for d in (0, 1):
        if d < len(shape) and shape[d] % num_blocks == 0 and shape[d] > num_blocks:
            return t.unflatten(d, (num_blocks, shape[d] // num_blocks))
    return t


def _block_dim(shape: Sequence[int], num_blocks: int) -> int:
    for d in (0, 1):
        if d < len(shape) and shape[d] == num_blocks:
            return d
    for d, s in enumerate(shape):
        if s == num_blocks:
            return d
    raise LayoutError(f"no dimension of size num_blocks={num_blocks} in KV tensor of shape {shape}")


def runs_of(
    shape: Sequence[int], strides: Sequence[int], block_dim: int, elem: int
) -> tuple[list[int], int]:
    """Byte offsets (relative to a block's start) and length of the contiguous
    runs making up one block of a tensor with this shape and strides."""
    dims = [
        (size, stride)
        for d, (size, stride) in enumerate(zip(shape, strides, strict=True))
        if d != block_dim and size != 1
    ]
    dims.sort(key=lambda s: s[1])
    run = 1
    i = 0
    while i < len(dims) and dims[i][1] == run:
        run *= dims[i][0]
        i += 1
    if run == 1 and dims:
        raise LayoutError(
            f"KV tensor of shape {tuple(shape)} and strides {tuple(strides)} has no "
            "contiguous innermost dimension"
        )
    outer = dims[i:]
    offsets = [
        sum(i * st for i, (_, st) in zip(combo, outer, strict=True))
        for combo in itertools.product(*(range(sz) for sz, _ in outer))
    ]
    return [o * elem for o in sorted(offsets)], run * elem


def _byte_view(t: Any, byte_offset: int, rows: int, row_stride: int, row_bytes: int) -> Any:
    """A ``[rows, row_bytes]`` uint8 view into ``t``'s storage."""
    import torch

    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(
        t.untyped_storage(), byte_offset, (rows, row_bytes), (row_stride, 1)
    )


def build_layout(
    kv_caches: Mapping[str, Any],
    num_blocks: int,
    layer_index: Callable[[str], int],
    num_layers_total: int,
    *,
    with_views: bool = False,
) -> KVLayout:
    """Describes vLLM's ``register_kv_caches`` tensors (one per layer, or a
    tuple/list of tensors per layer)."""
    layers: list[LayerRegions] = []
    sig: tuple[int, int] | None = None
    device_type = "cpu"
    for name, kv in kv_caches.items():
        tensors = list(kv) if isinstance(kv, list | tuple) else [kv]
        bases: list[int] = []
        strides: list[int] = []
        views: list[Any] = []
        run_bytes = None
        bdim = 0
        for t in tensors:
            device_type = t.device.type
            elem = t.element_size()
            t = _manager_blocks(t, num_blocks)
            bdim = _block_dim(tuple(t.shape), num_blocks)
            offs, rb = runs_of(tuple(t.shape), tuple(t.stride()), bdim, elem)
            if run_bytes is not None and rb != run_bytes:
                raise LayoutError(f"layer {name}: tensors with different run sizes")
            run_bytes = rb
            bstride = t.stride(bdim) * elem
            base0 = t.data_ptr()
            for o in offs:
                bases.append(base0 + o)
                strides.append(bstride)
                if with_views:
                    views.append(
                        _byte_view(t, t.storage_offset() * elem + o, num_blocks, bstride, rb)
                    )
        if len(set(strides)) != 1:
            raise LayoutError(f"layer {name}: runs with different block strides {set(strides)}")
        assert run_bytes is not None
        this = (run_bytes, len(bases))
        if sig is not None and this != sig:
            raise LayoutError(
                f"layer {name}: {this[1]} runs of {this[0]} bytes per block, other layers have "
                f"{sig[1]} of {sig[0]}; models with different KV shapes per layer are not supported"
            )
        sig = this
        layers.append(
            LayerRegions(
                name=name,
                shard_index=layer_index(name),
                base=np.array(bases, dtype=np.uint64),
                block_stride=strides[0],
                run_bytes=run_bytes,
                tensors=tensors,
                block_dim=bdim,
                run_views=views,
            )
        )
    if not layers or sig is None:
        raise LayoutError("no KV cache tensors were registered")
    layers.sort(key=lambda layer: layer.shard_index)
    idx = [layer.shard_index for layer in layers]
    if len(set(idx)) != len(idx) or max(idx) >= num_layers_total:
        raise LayoutError(f"bad layer indices {idx} for {num_layers_total} layers")
    return KVLayout(
        layers=layers,
        num_layers_total=num_layers_total,
        run_bytes=sig[0],
        runs=sig[1],
        device_type=device_type,
    )


__all__ = ["KVLayout", "LayerRegions", "LayoutError", "build_layout", "runs_of"]
