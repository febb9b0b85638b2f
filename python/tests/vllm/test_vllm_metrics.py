"""Metrics: OpenTelemetry instruments exported in Prometheus format, single and
multi-process; the stats object vLLM carries between processes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ucm.integration.vllm.stats import UCMKVConnectorStats, merge_stats
from ucm.shared import metrics

BATCH = {
    "lookup_tokens": 100,
    "lookup_hit_tokens": 96,
    "load_blocks": 3,
    "load_bytes": 3 << 20,
    "load_busy_ms": 2.0,
    "load_durations_ms": [1.5, 2.5],
    "save_blocks": 1,
    "save_bytes": 1 << 20,
    "save_busy_ms": 1.0,
    "save_durations_ms": [1.0],
    "handover_received": 1,
    "handover_waits_ms": [1500.0],
    "handover_load_bytes": 2 << 20,
    "store_healthy": 1,
}


def values(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("ucm_") and "le" not in s.labels:
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def test_stats_aggregate_and_reduce() -> None:
    a = UCMKVConnectorStats(data=dict(BATCH))
    b = UCMKVConnectorStats(data={"load_blocks": 2, "load_durations_ms": [3.0], "store_healthy": 0})
    a.aggregate(b)
    assert a.data["load_blocks"] == 5
    assert a.data["load_durations_ms"] == [1.5, 2.5, 3.0]
    assert a.data["store_healthy"] == 0
    r = a.reduce()
    assert r["lookup_hit_rate"] == 0.96
    assert r["load_avg_ms"] == round(7.0 / 3, 3)
    assert r["handover_wait_avg_ms"] == 1500.0 and r["handover_received"] == 1
    assert not a.is_empty()
    assert UCMKVConnectorStats(data={"store_healthy": 1}).is_empty()
    assert merge_stats({}, {"x": 1}) == {"x": 1}


def test_prometheus_export_single_process() -> None:
    registry = CollectorRegistry()
    metrics._reset_for_tests()
    try:
        m = metrics.get_metrics(registry=registry)
        m.record(BATCH, {"model_name": "tiny", "engine": "0"})
        m.record(BATCH, {"model_name": "tiny", "engine": "0"})
        text = generate_latest(registry).decode()
    finally:
        metrics._reset_for_tests()
    v = values(text)
    assert v["ucm_lookup_tokens_total"] == 200
    assert v["ucm_lookup_hit_tokens_total"] == 192
    assert v["ucm_lookup_hit_rate"] == 0.96
    assert v["ucm_load_blocks_total"] == 6
    # The stats' milliseconds are exported as seconds.
    assert v["ucm_load_duration_seconds_count"] == 4
    assert v["ucm_load_duration_seconds_sum"] == pytest.approx(8.0e-3)
    assert v["ucm_handover_wait_seconds_count"] == 2
    assert v["ucm_handover_wait_seconds_sum"] == pytest.approx(3.0)
    assert v["ucm_handover_received_total"] == 2
    assert v["ucm_handover_load_bytes_total"] == 4 << 20
    assert abs(v["ucm_load_speed_gbps"] - (3 << 20) / 2e-3 / 1e9) < 1e-9
    assert v["ucm_save_speed_gbps"] > 0
    assert v["ucm_store_healthy"] == 1
    assert 'model_name="tiny"' in text and "otel_scope" not in text
    assert 'ucm_save_duration_seconds_bucket{engine="0",le="0.001",model_name="tiny"} 2.0' in text


def test_no_exported_metric_is_in_milliseconds() -> None:
    """Times are in seconds, as Prometheus and vLLM have them: no series
    name says milliseconds, and every instrument is exported."""
    registry = CollectorRegistry()
    metrics._reset_for_tests()
    try:
        m = metrics.get_metrics(registry=registry)
        m.start({"engine": "0"})
        m.record(BATCH, {"engine": "0"})
        text = generate_latest(registry).decode()
    finally:
        metrics._reset_for_tests()
    names = {
        fam.name for fam in text_string_to_metric_families(text) if fam.name.startswith("ucm_")
    }
    assert {f"ucm_{k}" for k in metrics.HISTOGRAMS} <= names
    assert len(names) == len(metrics.COUNTERS) + len(metrics.GAUGES) + len(metrics.HISTOGRAMS)
    assert not [n for n in names if n.endswith("_ms") or "_ms_" in n], names


def test_duration_buckets_from_the_metrics_config() -> None:
    assert metrics.duration_buckets({"duration_buckets_seconds": [0.01, 1]}) == [0.01, 1.0]
    # The original UCM key, in milliseconds, still works.
    assert metrics.duration_buckets({"duration_buckets_ms": [10, 1000]}) == [0.01, 1.0]
    assert metrics.duration_buckets({"enabled": True}) is None


def test_prometheus_export_multiprocess(tmp_path: Path) -> None:
    """Two processes record; a third (the /metrics handler) sums them."""
    script = textwrap.dedent(
        """
        import sys
        from ucm.shared import metrics
        m = metrics.get_metrics()
        m.record({"load_blocks": int(sys.argv[1]), "load_durations_ms": [5.0],
                  "lookup_tokens": 10, "lookup_hit_tokens": 5}, {"engine": "0"})
        metrics.flush()
        """
    )
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    for n in (3, 4):
        subprocess.run([sys.executable, "-c", script, str(n)], env=env, check=True)
    reader = textwrap.dedent(
        """
        from prometheus_client import CollectorRegistry, generate_latest, multiprocess
        r = CollectorRegistry()
        multiprocess.MultiProcessCollector(r)
        print(generate_latest(r).decode())
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", reader], env=env, check=True, capture_output=True, text=True
    ).stdout
    v = values(out)
    assert v["ucm_load_blocks_total"] == 7
    assert v["ucm_load_duration_seconds_count"] == 2
    assert v["ucm_load_duration_seconds_sum"] == pytest.approx(10.0e-3)
    assert v["ucm_lookup_hit_rate"] == 0.5
