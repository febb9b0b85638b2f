"""vLLM's native CPU offloading (``OffloadingConnector``) on vLLM's CPU build.

``OffloadingConnector`` with its default ``CPUOffloadingSpec`` keeps KV in a
host-memory pool managed by the scheduler (``CPUOffloadingManager``: LRU,
prepare/complete for loads and stores) and moves blocks between that pool and
the engine's KV cache with CUDA streams and copy kernels. On the CPU build
the spec refuses to make its worker ("CPU Offloading is currently only
supported on CUDA-alike and XPU GPUs"): the engine's KV cache is host memory
too, and there is no stream to copy on.

This module is the smallest change that runs it there: the same spec (the
same manager, pool size and eviction, so the scheduler side is vLLM's own),
with a worker that copies the blocks with the CPU, synchronously, inside
``submit_store``/``submit_load``. vLLM submits stores at the start of the
next step and loads before the step that needs them, and reports both
through ``get_finished``, so a synchronous copy keeps every ordering the
CUDA worker gives. Select it with::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "HostCopyOffloadingSpec",
            "spec_module_path": "offload_cpu", "cpu_bytes_to_use": N}}'

with this directory on ``PYTHONPATH`` (the engine's worker process imports it).
On a GPU build, use vLLM's own spec (leave ``spec_name`` out).
"""

from __future__ import annotations

import time

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec


class HostCopyWorker(OffloadingWorker):
    """Copies blocks between the engine's KV cache (host memory on the CPU
    build) and a host pool of ``num_chunks`` chunks of ``blocks_per_chunk``
    blocks per KV tensor, as vLLM's CUDA worker lays it out (direct layout)."""

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, num_chunks: int):
        self.bpc = blocks_per_chunk
        self.engine: list[torch.Tensor] = []
        self.host: list[torch.Tensor] = []
        for t in kv_caches.tensors:
            page = t.page_size_bytes
            self.engine.append(t.tensor.view(torch.int8).view(-1, page))
            self.host.append(torch.zeros((num_chunks * blocks_per_chunk, page), dtype=torch.int8))
        # The tensors each KV cache group's blocks live in.
        self.group_tensors = [
            sorted({ref.tensor_idx for ref in refs}) for refs in kv_caches.group_data_refs
        ]
        self._done: list[TransferResult] = []

    def _copy(
        self, job_id: int, engine_spec: GPULoadStoreSpec, host_spec: LoadStoreSpec, to_host: bool
    ) -> bool:
        assert isinstance(host_spec, BlockIDsLoadStoreSpec)
        t0 = time.perf_counter()
        engine_ids = engine_spec.block_ids.astype(np.int64)
        chunks = host_spec.block_ids.astype(np.int64)
        nbytes = 0
        e_off = h_off = 0
        for g, (n, first) in enumerate(
            zip(engine_spec.group_sizes, engine_spec.block_indices, strict=True)
        ):
            if n == 0:
                continue
            # A group's first host chunk may start mid-chunk: skip its first
            # ``first % bpc`` blocks (vLLM's CUDA worker does the same).
            skip = first % self.bpc
            n_chunks = -(-(n + skip) // self.bpc)
            sub = chunks[h_off : h_off + n_chunks, None] * self.bpc + np.arange(self.bpc)
            host_idx = torch.from_numpy(sub.ravel()[skip : skip + n].copy())
            eng_idx = torch.from_numpy(engine_ids[e_off : e_off + n].copy())
            for ti in self.group_tensors[g]:
                if to_host:
                    self.host[ti].index_copy_(0, host_idx, self.engine[ti].index_select(0, eng_idx))
                else:
                    self.engine[ti].index_copy_(0, eng_idx, self.host[ti].index_select(0, host_idx))
                nbytes += n * self.engine[ti].shape[1]
            e_off += n
            h_off += n_chunks
        self._done.append(
            TransferResult(
                job_id, True, transfer_size=nbytes, transfer_time=time.perf_counter() - t0
            )
        )
        return True

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        return self._copy(job_id, src_spec, dst_spec, to_host=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._copy(job_id, dst_spec, src_spec, to_host=False)

    def get_finished(self) -> list[TransferResult]:
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return  # every copy is done when its submit returns

    def shutdown(self) -> None:
        self.host.clear()
        self.engine.clear()


class HostCopyOffloadingSpec(CPUOffloadingSpec):
    """vLLM's ``CPUOffloadingSpec`` with :class:`HostCopyWorker` as its worker."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = HostCopyWorker(kv_caches, self.blocks_per_chunk, self.num_chunks)
        return self._worker
