"""Connector statistics: collected where they happen, shown where vLLM serves /metrics.

The scheduler side (lookups) and the worker side (loads, saves) fill a
:class:`StatsCollector`; vLLM pulls it every step through
``get_kv_connector_stats()``, ships it (as :class:`UCMKVConnectorStats`) from
the engine-core and worker processes to the API server, and hands it to
:class:`UCMPromMetrics.observe`, which records it through the OpenTelemetry
SDK (:mod:`ucm.shared.metrics`). So the metrics reach ``/metrics`` whatever
processes vLLM runs, with vLLM's own ``model_name``/``engine`` labels.
"""

from __future__ import annotations

import threading
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from ucm.integration.vllm.config import resolve_config
from ucm.shared import metrics as ucm_metrics
from ucm.shared.logging import get_logger

#: The keys holding lists, each with the key of its average in
#: :meth:`UCMKVConnectorStats.reduce`.
AVERAGE_KEYS = {
    "load_durations_ms": "load_avg_ms",
    "save_durations_ms": "save_avg_ms",
    "handover_waits_ms": "handover_wait_avg_ms",
}
LIST_KEYS = tuple(AVERAGE_KEYS)
FLOAT_KEYS = ("load_busy_ms", "save_busy_ms")
MIN_KEYS = ("store_healthy",)
MAX_KEYS = ("store_degraded",)

logger = get_logger(__name__)


def merge_stats(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Sums counters, concatenates observations, takes the min of health flags
    and the max of degraded flags."""
    out = dict(a)
    for k, v in b.items():
        if k in LIST_KEYS:
            out[k] = list(out.get(k, [])) + list(v)
        elif k in MIN_KEYS:
            out[k] = min(out[k], v) if k in out else v
        elif k in MAX_KEYS:
            out[k] = max(out[k], v) if k in out else v
        else:
            out[k] = out.get(k, 0) + v
    return out


class StatsCollector:
    """Thread-safe accumulator (the worker's reaper thread records saves)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, Any] = {}

    def add(self, **values: Any) -> None:
        with self._lock:
            self._data = merge_stats(self._data, values)

    def set_health(self, healthy: bool) -> None:
        with self._lock:
            self._data["store_healthy"] = int(healthy)

    def take(self) -> dict[str, Any]:
        with self._lock:
            data, self._data = self._data, {}
        return data


class UCMKVConnectorStats(KVConnectorStats):
    """The dict of counters and observations vLLM carries between processes."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if other is not None and other.data:
            self.data = merge_stats(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = {}
        for k in ("lookup_tokens", "lookup_hit_tokens", "load_blocks", "save_blocks"):
            if d.get(k):
                out[k] = d[k]
        for k in (
            "load_failed_blocks",
            "save_failed_blocks",
            "save_skipped_blocks",
            "handover_timeouts",
            "handover_mismatches",
            "handover_save_failures",
            "handover_received",
            "handover_answered",
        ):
            if d.get(k):
                out[k] = d[k]
        for k, v in ucm_metrics.derived_gauges(d).items():
            out[k] = round(v, 4)
        for k, avg in AVERAGE_KEYS.items():
            if d.get(k):
                out[avg] = round(sum(d[k]) / len(d[k]), 3)
        return out

    def is_empty(self) -> bool:
        return not any(v for k, v in self.data.items() if k not in MIN_KEYS)


class UCMPromMetrics(KVConnectorPromMetrics):
    """Records UCM stats through OpenTelemetry, exported to vLLM's /metrics."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
        buckets_seconds: list[float] | None = None,
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._metrics = ucm_metrics.get_metrics(buckets_seconds)
        self._attrs = {
            idx: {str(k): str(v) for k, v in zip(labelnames, values, strict=False)}
            for idx, values in per_engine_labelvalues.items()
        }
        for attrs in self._attrs.values():
            self._metrics.start(attrs)
        ucm_metrics.after_record()

    @classmethod
    def for_engine(cls, vllm_config: Any, *vllm_args: Any) -> UCMPromMetrics | None:
        """The connector's ``build_prom_metrics``: the metrics with the
        duration buckets of the UCM config, or None when that config turns
        them off. ``vllm_args`` (metric types, label names, per-engine label
        values) are vLLM's, passed through as vLLM gives them."""
        extra: dict[str, Any] = {}
        if vllm_config.kv_transfer_config is not None:
            extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        try:
            mcfg = resolve_config(extra).metrics
        except Exception as e:  # the engine reports config errors itself
            logger.warning("UCM metrics disabled: %s", e)
            return None
        if not mcfg.get("enabled", True):
            return None
        return cls(vllm_config, *vllm_args, buckets_seconds=ucm_metrics.duration_buckets(mcfg))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        if not transfer_stats_data:
            return
        self._metrics.record(transfer_stats_data, self._attrs.get(engine_idx, {}))
        ucm_metrics.after_record()


__all__ = ["StatsCollector", "UCMKVConnectorStats", "UCMPromMetrics", "merge_stats"]
