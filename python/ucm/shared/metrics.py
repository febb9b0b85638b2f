"""UCM metrics, recorded through the OpenTelemetry SDK and exported to Prometheus.

Instruments (Prometheus names)::

    ucm_lookup_hit_rate                gauge      external hit tokens / looked-up tokens
    ucm_load_duration_seconds          histogram  one load (a step's loads, or one layer's)
    ucm_save_duration_seconds          histogram  one save task, submit to completion
    ucm_load_speed_gbps                gauge      GB/s of the last loads
    ucm_save_speed_gbps                gauge      GB/s of the last saves
    ucm_lookup_tokens_total            counter    tokens looked up (beyond vLLM's own hits)
    ucm_lookup_hit_tokens_total        counter    of which found in the store
    ucm_{load,save}_{blocks,bytes}_total      counters
    ucm_{load,save}_failed_blocks_total       counters
    ucm_save_skipped_blocks_total      counter    saves skipped while the store was unusable
    ucm_store_errors_total             counter    store failures (open, I/O, full, timeout)
    ucm_store_healthy                  gauge      1 while the store is usable, else 0
    ucm_store_degraded                 gauge      1 while serving without a store that
                                                  couldn't be opened (allow_degraded)
    ucm_handover_timeouts_total        counter    P/D: handed-over blocks not there in time
    ucm_handover_mismatches_total      counter    P/D: handed-over blocks of another deployment
    ucm_handover_save_failures_total   counter    P/D: prefill answers leaving out failed saves
    ucm_handover_received_total        counter    P/D decode: requests that came with a
                                                  prefill engine's handover
    ucm_handover_answered_total        counter    P/D prefill: requests answered with a
                                                  handover (blocks in the store)
    ucm_handover_load_bytes_total      counter    P/D decode: bytes loaded of handed-over
                                                  blocks (also in ucm_load_bytes_total)
    ucm_handover_wait_seconds          histogram  P/D decode: a request's wait for its
                                                  handed-over blocks (0: there at once;
                                                  about handover_timeout_s: timed out)

The P/D router, ``ucm proxy``, serves series of its own (``ucm_proxy_*``:
requests, phase times, engine errors) on its own ``/metrics``; they are
listed in :mod:`ucm.integration.vllm.proxy_metrics`.

Times are exported in seconds, as Prometheus and vLLM name and measure
them; the connector's stats carry milliseconds, converted when recorded.

Exporting: with ``prometheus_client``'s default registry (one process serves
``/metrics``, as ``vllm serve`` with one API server does) a
:class:`PrometheusMetricReader` exposes them there. When
``PROMETHEUS_MULTIPROC_DIR`` is set (vLLM with several API servers), the
values are written into that directory in ``prometheus_client``'s
multi-process file format instead, so whichever process answers ``/metrics``
shows them.

:meth:`UcmMetrics.record` takes the dict of counters and observations that the
connector's stats carry (see ``ucm.integration.vllm.stats``).
"""

# Why our own multi-process writer: the instruments are recorded through
# OpenTelemetry, the documented recording API, whose Prometheus exporter is a
# collector in the recording process's registry. Under PROMETHEUS_MULTIPROC_DIR
# vLLM's /metrics reads a fresh registry holding only a MultiProcessCollector
# (vllm/v1/metrics/prometheus.py, get_prometheus_registry), which reads the
# *.db files and nothing else, so the values must be written there. The writer
# below already is prometheus_client's multiprocess mode: its own file code
# (MmapedDict, mmap_key) in files of our own; ours is the OTel-to-file mapping,
# about 100 lines. prometheus_client's metric types, or the ones vLLM hands to
# build_prom_metrics, write those files themselves only for values recorded
# through them: adopting them means replacing OpenTelemetry as the recording
# API (and the names and tests that pin its output), not swapping a library.

from __future__ import annotations

import atexit
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ucm.shared.logging import get_logger

logger = get_logger(__name__)

DEFAULT_DURATION_BUCKETS_SECONDS: tuple[float, ...] = (
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30,
)  # fmt: skip
#: Seconds per millisecond: the stats' durations are in milliseconds.
SECONDS_PER_MS = 1e-3

COUNTERS: dict[str, str] = {
    "lookup_tokens": "Tokens looked up in the store (beyond vLLM's own prefix-cache hits)",
    "lookup_hit_tokens": "Looked-up tokens found in the store",
    "load_blocks": "KV blocks loaded from the store",
    "load_bytes": "Bytes loaded from the store",
    "load_failed_blocks": "KV blocks whose load failed (recomputed by vLLM)",
    "save_blocks": "KV blocks saved to the store",
    "save_bytes": "Bytes saved to the store",
    "save_failed_blocks": "KV blocks whose save failed",
    "save_skipped_blocks": "KV blocks not saved because the store was unusable",
    "store_errors": "Store failures (open, I/O, full disk, timeout)",
    "handover_timeouts": "P/D decode requests whose handed-over blocks were not all in the "
    "store within handover_timeout_s (the rest was computed)",
    "handover_mismatches": "P/D decode requests whose handed-over blocks were keyed for "
    "another deployment (model, salt, block size); the prompt was computed",
    "handover_save_failures": "P/D prefill requests whose answer left out blocks that failed "
    "to save (the decode engine computes them)",
    "handover_received": "P/D decode requests that came with a prefill engine's handover",
    "handover_answered": "P/D prefill requests answered with a handover (blocks in the store)",
    "handover_load_bytes": "P/D bytes loaded of blocks a prefill engine handed over "
    "(counted in load_bytes too)",
}
#: Histogram name: (the stats key of its observations, in milliseconds; description).
HISTOGRAMS: dict[str, tuple[str, str]] = {
    "load_duration_seconds": ("load_durations_ms", "Duration of one load, in seconds"),
    "save_duration_seconds": (
        "save_durations_ms",
        "Duration of one save, submit to completion, in seconds",
    ),
    "handover_wait_seconds": (
        "handover_waits_ms",
        "P/D decode: a request's wait for the blocks a prefill engine handed over, in seconds",
    ),
}
GAUGES: dict[str, str] = {
    "lookup_hit_rate": "Fraction of looked-up tokens found in the store (last interval)",
    "load_speed_gbps": "Load throughput in GB/s (last interval)",
    "save_speed_gbps": "Save throughput in GB/s (last interval)",
    "store_healthy": "1 while the store is usable, 0 while it is not",
    "store_degraded": "1 while serving without the store it couldn't open at start-up "
    "(allow_degraded), else 0",
}
PREFIX = "ucm_"


def _speed_gbps(nbytes: float, ms: float) -> float | None:
    if nbytes <= 0 or ms <= 0:
        return None
    return nbytes / (ms * 1e-3) / 1e9


def duration_buckets(metrics_config: Mapping[str, Any]) -> list[float] | None:
    """The histogram bucket bounds in seconds of a metrics config:
    ``duration_buckets_seconds``, or ``duration_buckets_ms`` (the original
    UCM key, still accepted) converted; None for the defaults."""
    if metrics_config.get("duration_buckets_seconds") is not None:
        return [float(b) for b in metrics_config["duration_buckets_seconds"]]
    if metrics_config.get("duration_buckets_ms") is not None:
        return [float(b) * SECONDS_PER_MS for b in metrics_config["duration_buckets_ms"]]
    return None


def derived_gauges(data: Mapping[str, Any]) -> dict[str, float]:
    """Gauge values implied by one batch of stats (missing when undefined)."""
    out: dict[str, float] = {}
    looked = data.get("lookup_tokens", 0)
    if looked:
        out["lookup_hit_rate"] = data.get("lookup_hit_tokens", 0) / looked
    for kind in ("load", "save"):
        ms = data.get(f"{kind}_busy_ms", 0.0)
        speed = _speed_gbps(data.get(f"{kind}_bytes", 0), ms)
        if speed is not None:
            out[f"{kind}_speed_gbps"] = speed
    if "store_healthy" in data:
        out["store_healthy"] = float(data["store_healthy"])
    if "store_degraded" in data:
        out["store_degraded"] = float(data["store_degraded"])
    return out


class UcmMetrics:
    """The UCM instruments on one OpenTelemetry meter."""

    def __init__(self, meter: Any) -> None:
        self.counters = {
            k: meter.create_counter(PREFIX + k, description=d) for k, d in COUNTERS.items()
        }
        self.histograms = {
            k: (src, meter.create_histogram(PREFIX + k, description=d))
            for k, (src, d) in HISTOGRAMS.items()
        }
        self.gauges = {k: meter.create_gauge(PREFIX + k, description=d) for k, d in GAUGES.items()}

    def start(self, attributes: Mapping[str, str] | None = None) -> None:
        """Creates every counter and gauge series at its initial value, so a
        dashboard sees them (at zero, the store healthy) from the first
        scrape instead of only after the first save or failure."""
        attrs = dict(attributes or {})
        for c in self.counters.values():
            c.add(0, attrs)
        for k, g in self.gauges.items():
            g.set(1.0 if k == "store_healthy" else 0.0, attrs)

    def record(self, data: Mapping[str, Any], attributes: Mapping[str, str] | None = None) -> None:
        """Records one batch of connector stats."""
        attrs = dict(attributes or {})
        for k, c in self.counters.items():
            v = data.get(k, 0)
            if v:
                c.add(v, attrs)
        for src, h in self.histograms.values():
            for v in data.get(src, ()) or ():
                h.record(float(v) * SECONDS_PER_MS, attrs)
        for k, v in derived_gauges(data).items():
            self.gauges[k].set(v, attrs)


# -- process-wide provider ---------------------------------------------------

_lock = threading.Lock()
_metrics: UcmMetrics | None = None
_provider: Any = None
_multiproc_reader: Any = None


def _views(buckets: Sequence[float]) -> list[Any]:
    from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View

    return [
        View(
            instrument_name=PREFIX + k,
            aggregation=ExplicitBucketHistogramAggregation(boundaries=list(buckets)),
        )
        for k in HISTOGRAMS
    ]


def get_metrics(
    buckets_seconds: Sequence[float] | None = None, *, registry: Any = None
) -> UcmMetrics:
    """The process's :class:`UcmMetrics`, created (with its exporter) on first use;
    ``buckets_seconds``: the duration histograms' bucket bounds."""
    global _metrics, _provider, _multiproc_reader
    with _lock:
        if _metrics is not None:
            return _metrics
        from opentelemetry.sdk.metrics import MeterProvider

        readers: list[Any] = []
        mp_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if mp_dir:
            _multiproc_reader = PrometheusMultiprocReader(mp_dir)
            readers.append(_multiproc_reader)
        else:
            from opentelemetry.exporter.prometheus import PrometheusMetricReader

            kwargs: dict[str, Any] = {"disable_target_info": True, "scope_info_enabled": False}
            if registry is not None:
                kwargs["registry"] = registry
            readers.append(PrometheusMetricReader(**kwargs))
        _provider = MeterProvider(
            metric_readers=readers,
            views=_views(buckets_seconds or DEFAULT_DURATION_BUCKETS_SECONDS),
        )
        _metrics = UcmMetrics(_provider.get_meter("ucm"))
        return _metrics


def flush() -> None:
    """Pushes recorded values to the multi-process files now (no-op otherwise)."""
    if _multiproc_reader is not None:
        _multiproc_reader.flush(force=True)


def after_record() -> None:
    """Called after each record; writes multi-process files at most every 200 ms."""
    if _multiproc_reader is not None:
        _multiproc_reader.flush(force=False)


def _reset_for_tests() -> None:
    global _metrics, _provider, _multiproc_reader
    with _lock:
        if _provider is not None:
            try:
                _provider.shutdown()
            except Exception:  # pragma: no cover - best effort
                pass
        _metrics = _provider = _multiproc_reader = None


# -- multi-process export ------------------------------------------------------


def _make_multiproc_reader_class() -> type:
    from opentelemetry.sdk.metrics import Counter, Histogram
    from opentelemetry.sdk.metrics._internal.instrument import Gauge as _SdkGauge
    from opentelemetry.sdk.metrics.export import (
        AggregationTemporality,
        Gauge,
        MetricReader,
        Sum,
    )
    from opentelemetry.sdk.metrics.export import Histogram as HistogramData

    class _Reader(MetricReader):
        """Writes the cumulative values into prometheus_client's multi-process files.

        The files are this process's own (``counter_ucm-<pid>.db`` ...), never
        the ones prometheus_client itself keeps open, so the two never race.
        """

        def __init__(self, directory: str) -> None:
            super().__init__(
                preferred_temporality={
                    Counter: AggregationTemporality.CUMULATIVE,
                    Histogram: AggregationTemporality.CUMULATIVE,
                    _SdkGauge: AggregationTemporality.CUMULATIVE,
                }
            )
            self._dir = directory
            self._files: dict[str, Any] = {}
            self._last = 0.0
            self._flush_lock = threading.Lock()
            atexit.register(self.flush, True)

        def flush(self, force: bool = False) -> None:
            now = time.monotonic()
            if not force and now - self._last < 0.2:
                return
            self._last = now
            try:
                self.collect()
            except Exception as e:  # pragma: no cover - never break serving
                logger.debug("writing ucm metrics failed: %s", e)

        def _file(self, prefix: str) -> Any:
            from prometheus_client.mmap_dict import MmapedDict

            f = self._files.get(prefix)
            if f is None:
                path = os.path.join(self._dir, f"{prefix}_ucm-{os.getpid()}.db")
                f = self._files[prefix] = MmapedDict(path)
            return f

        def _receive_metrics(self, metrics_data: Any, timeout_millis: float = 0, **kw: Any) -> None:
            from prometheus_client.mmap_dict import mmap_key
            from prometheus_client.utils import floatToGoString

            if metrics_data is None:
                return
            with self._flush_lock:
                ts = time.time()
                for rm in metrics_data.resource_metrics:
                    for sm in rm.scope_metrics:
                        for m in sm.metrics:
                            name, help_text, data = m.name, m.description or m.name, m.data
                            for p in data.data_points:
                                labels = {str(k): str(v) for k, v in (p.attributes or {}).items()}
                                ln, lv = list(labels), list(labels.values())
                                if isinstance(data, Sum):
                                    key = mmap_key(name, name + "_total", ln, lv, help_text)
                                    self._file("counter").write_value(key, float(p.value), ts)
                                elif isinstance(data, Gauge):
                                    key = mmap_key(name, name, ln, lv, help_text)
                                    f = self._file("gauge_mostrecent")
                                    f.write_value(key, float(p.value), ts)
                                elif isinstance(data, HistogramData):
                                    f = self._file("histogram")
                                    bounds = [*list(p.explicit_bounds), float("inf")]
                                    for b, cnt in zip(bounds, p.bucket_counts, strict=False):
                                        key = mmap_key(
                                            name,
                                            name + "_bucket",
                                            [*ln, "le"],
                                            [*lv, floatToGoString(b)],
                                            help_text,
                                        )
                                        f.write_value(key, float(cnt), ts)
                                    key = mmap_key(name, name + "_sum", ln, lv, help_text)
                                    f.write_value(key, float(p.sum), ts)

        def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
            for f in self._files.values():
                try:
                    f.close()
                except Exception:  # pragma: no cover
                    pass
            self._files.clear()

    return _Reader


_reader_cls: type | None = None


def PrometheusMultiprocReader(directory: str) -> Any:
    """An OpenTelemetry reader writing prometheus_client multi-process files."""
    global _reader_cls
    if _reader_cls is None:
        _reader_cls = _make_multiproc_reader_class()
    return _reader_cls(directory)


__all__ = [
    "COUNTERS",
    "DEFAULT_DURATION_BUCKETS_SECONDS",
    "GAUGES",
    "HISTOGRAMS",
    "UcmMetrics",
    "after_record",
    "derived_gauges",
    "duration_buckets",
    "flush",
    "get_metrics",
]
