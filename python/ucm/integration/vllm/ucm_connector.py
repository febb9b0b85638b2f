"""``UCMConnector``: prefix KV-cache offload and reuse for vLLM through UCM stores.

Use it with::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "UCMConnector",
        "kv_connector_module_path": "ucm.integration.vllm.ucm_connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"storage_backends": "/data/ucm"}}'

Every later request that shares a prefix with anything served before (by
this engine or another one using the same store) loads those blocks instead
of computing them. Configuration: :mod:`ucm.integration.vllm.config`.

The class is a thin facade (vLLM's own connectors are built the same way):
the scheduler half lives in :mod:`.scheduler`, the worker half in
:mod:`.worker`. Supported: the vLLM versions :mod:`.compat` names (0.32-0.33),
CPU and GPU builds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ucm.integration.vllm.compat import CONNECTOR_API, LAYER_WISE, PD_HANDOVER, check_vllm

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError as _e:  # pragma: no cover - API moved
    check_vllm(CONNECTOR_API)  # names the version and the missing internals
    raise RuntimeError(f"UCMConnector: this vLLM lacks the v1 KV connector API: {_e}") from _e

from ucm.integration.vllm.config import resolve_config
from ucm.integration.vllm.metadata import UCMConnectorMetadata
from ucm.integration.vllm.scheduler import UCMSchedulerSide, kv_geometry
from ucm.integration.vllm.stats import UCMKVConnectorStats, UCMPromMetrics
from ucm.shared.logging import get_logger

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from ucm.integration.vllm.sparse.bridge import SparseSchedulerBridge, SparseWorkerBridge
    from ucm.integration.vllm.worker import UCMWorkerSide

logger = get_logger(__name__)


class UCMConnector(KVConnectorBase_V1):
    """Prefix KV cache offload and reuse through a UCM store."""

    _cache_hit_source = CacheHitSource.DISK

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        check_vllm(CONNECTOR_API, PD_HANDOVER)
        if kv_cache_config is None:
            raise RuntimeError("UCMConnector needs the kv_cache_config argument (vLLM >= 0.32)")
        super().__init__(vllm_config, role, kv_cache_config)
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise RuntimeError(
                "UCMConnector does not support pipeline parallelism yet: stages would write "
                "different shards of the same block from different processes"
            )
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.ucm_config = resolve_config(extra)
        if self.ucm_config.connector.use_layerwise:
            check_vllm(LAYER_WISE)
        self.geometry = kv_geometry(vllm_config, kv_cache_config, self.ucm_config)
        self._scheduler: UCMSchedulerSide | None = None
        self._worker: UCMWorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            # vLLM's default ("fail") would fail a request whenever a block
            # can't be loaded; a cache miss must only cost a recompute.
            self._kv_transfer_config.kv_load_failure_policy = (
                self.ucm_config.connector.load_failure_policy
            )
            self._scheduler = UCMSchedulerSide(
                vllm_config,
                kv_cache_config,
                self.ucm_config,
                self.geometry,
                load=self._kv_transfer_config.is_kv_consumer,
                save=self._kv_transfer_config.is_kv_producer,
            )
        else:
            from ucm.integration.vllm.worker import UCMWorkerSide

            self._worker = UCMWorkerSide(
                vllm_config, kv_cache_config, self.ucm_config, self.geometry
            )
        # The sparse method's bridge (ucm.sparse); None unless ucm_sparse_config names one.
        from ucm.integration.vllm.sparse.bridge import create_bridge

        self._sparse = create_bridge(
            vllm_config,
            role == KVConnectorRole.SCHEDULER,
            self.ucm_config,
            self._scheduler if self._scheduler is not None else self._worker,
        )
        logger.info(
            "UCMConnector (%s): store %s %s, %s mode, block %d tokens, hash %s",
            role.name.lower(),
            self.ucm_config.store.name,
            self.ucm_config.store.config.get("store_pipeline", ""),
            "layer-wise" if self.ucm_config.connector.use_layerwise else "whole-step",
            self.geometry.block_size,
            self.ucm_config.connector.hash_algo,
        )

    @property
    def sparse(self) -> SparseSchedulerBridge | SparseWorkerBridge | None:
        """The bridge of the configured sparse method (``ucm_sparse_config``), or None."""
        return self._sparse

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a save lost to preemption is only a future miss.
        return False

    # ==============================
    # Worker-side methods
    # ==============================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)
        if self._sparse is not None:  # ucm.sparse: attention hooks
            self._sparse.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, UCMConnectorMetadata):
            self._worker.bind(connector_metadata)
        if self._sparse is not None:  # ucm.sparse: build_sparse_meta + execute_begin
            # (not in start_load_kv: vLLM 0.32 calls it after the forward when
            # no load is synchronous)
            self._sparse.start_step(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self._worker is not None:
            self._worker.clear()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self._worker is not None and isinstance(kv_connector_metadata, UCMConnectorMetadata):
            self._worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:
            self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: Any,
        **kwargs: Any,
    ) -> None:
        if self._worker is not None:
            self._worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.wait_for_save()
        if self._sparse is not None:  # ucm.sparse: execute_finished
            self._sparse.execute_finished()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        if self._sparse is not None and finished_req_ids:  # ucm.sparse: request finished
            self._sparse.requests_finished(finished_req_ids)
        return self._worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._worker is None:
            return set()
        return self._worker.get_block_ids_with_load_errors()

    def get_kv_connector_stats(self) -> UCMKVConnectorStats | None:
        if self._worker is not None:
            return self._worker.get_kv_connector_stats()
        if self._scheduler is not None:
            return self._scheduler.get_kv_connector_stats()
        return None

    def shutdown(self) -> None:
        if self._sparse is not None:  # ucm.sparse: uninstall the hooks
            self._sparse.shutdown()
            self._sparse = None
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # ==============================
    # Scheduler-side methods
    # ==============================
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._scheduler is not None:
            self._scheduler.bind_kv_cache_manager(kv_cache_manager)
        if self._sparse is not None:  # ucm.sparse: allocation hook
            self._sparse.bind_kv_cache_manager(kv_cache_manager)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        if self._sparse is not None:  # ucm.sparse: request_begin
            self._sparse.request_begin(request)
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        meta = self._scheduler.build_connector_meta(scheduler_output)
        if self._sparse is not None:  # ucm.sparse: per-step request facts for the workers
            self._sparse.attach(meta, scheduler_output)
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._scheduler is not None:
            self._scheduler.update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        if self._sparse is not None:  # ucm.sparse: request_finished_in_scheduler
            self._sparse.request_finished(request)
        return self._scheduler.request_finished(request, block_ids)

    # ==============================
    # Class-level hooks
    # ==============================
    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # Layer-wise hooks run between attention layers: CUDA graphs must
        # leave them out (piecewise capture). So must the sparse attention
        # hooks (ucm.sparse), which wrap each layer's impl.forward.
        try:
            c = resolve_config(extra_config).connector
            return c.use_layerwise or bool(c.ucm_sparse_config)
        except Exception:
            return False

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> UCMKVConnectorStats | None:
        return UCMKVConnectorStats(data=dict(data)) if data is not None else UCMKVConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, *vllm_args: Any) -> UCMPromMetrics | None:
        return UCMPromMetrics.for_engine(vllm_config, *vllm_args)


__all__ = ["UCMConnector"]
