"""The metrics of ``ucm proxy``, served in Prometheus text format on its ``GET /metrics``.

Series::

    ucm_proxy_requests_total{outcome}        counter    requests answered; outcome: ok (2xx,
                                                        complete), client_error (4xx), error
                                                        (5xx, no engine, answer cut off),
                                                        client_gone (the client hung up
                                                        before the answer's end)
    ucm_proxy_requests_in_flight             gauge      requests being routed now
    ucm_proxy_prefill_duration_seconds       histogram  prefill phase: until a prefill engine
                                                        answered (or none could)
    ucm_proxy_decode_first_byte_seconds      histogram  decode phase: until the first byte of
                                                        the decode engine's answer body
    ucm_proxy_decode_duration_seconds        histogram  decode phase: until its last byte
    ucm_proxy_request_duration_seconds       histogram  end to end, arrival to the last byte
    ucm_proxy_engine_errors_total{role}      counter    prefill or decode engines that could
                                                        not be reached, timed out, or broke
                                                        off or garbled an answer
    ucm_proxy_prefill_fallbacks_total        counter    requests no prefill engine answered
                                                        (the decode engine computed the prompt)

For a streamed answer the first byte is the first token's chunk, so the
decode phase's first-byte time is the time to the first token after the
prefill phase.
"""

# Why prometheus_client directly and not ucm.shared.metrics: that module
# records the engines' stats through OpenTelemetry because vLLM ships them
# between processes into vLLM's own /metrics. The proxy is one process
# serving its own /metrics, so its series are plain prometheus_client
# instruments in a registry of its own (each proxy its own, never the global
# one, so two proxies in one process, as in tests, do not collide).

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest

#: Bucket bounds of the latency histograms, in seconds: an LLM request takes
#: from milliseconds (a cached prompt, one token) to minutes (a long answer).
LATENCY_BUCKETS_SECONDS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600,
)  # fmt: skip
OUTCOMES = ("ok", "client_error", "error", "client_gone")
ROLES = ("prefill", "decode")
PREFIX = "ucm_proxy_"


@dataclass
class DecodePhase:
    """When one request's decode phase began, got its first byte and ended,
    and whether the engine broke its answer off or the client hung up."""

    start: float = field(default_factory=time.monotonic)
    first_byte: float | None = None
    end: float | None = None
    cut_off: bool = False
    client_gone: bool = False


class ProxyMetrics:
    """One proxy's series, in a registry of its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r, b = self.registry, LATENCY_BUCKETS_SECONDS
        self.requests = Counter(
            PREFIX + "requests", "Requests answered, by outcome", ["outcome"], registry=r
        )
        self.in_flight = Gauge(
            PREFIX + "requests_in_flight", "Requests being routed now", registry=r
        )
        self.prefill_duration = Histogram(
            PREFIX + "prefill_duration_seconds",
            "Prefill phase: until a prefill engine answered (or none could), in seconds",
            buckets=b,
            registry=r,
        )
        self.decode_first_byte = Histogram(
            PREFIX + "decode_first_byte_seconds",
            "Decode phase: until the first byte of the decode engine's answer body, in seconds",
            buckets=b,
            registry=r,
        )
        self.decode_duration = Histogram(
            PREFIX + "decode_duration_seconds",
            "Decode phase: until the last byte of the decode engine's answer, in seconds",
            buckets=b,
            registry=r,
        )
        self.request_duration = Histogram(
            PREFIX + "request_duration_seconds",
            "A request end to end, arrival to the last byte of its answer, in seconds",
            buckets=b,
            registry=r,
        )
        self.engine_errors = Counter(
            PREFIX + "engine_errors",
            "Engines that could not be reached, timed out, or broke off an answer, by role",
            ["role"],
            registry=r,
        )
        self.prefill_fallbacks = Counter(
            PREFIX + "prefill_fallbacks",
            "Requests no prefill engine answered (the decode engine computed the prompt)",
            registry=r,
        )
        # Every labelled series exists from the first scrape, at zero, so a
        # dashboard's rate() has a start instead of appearing at the first error.
        for outcome in OUTCOMES:
            self.requests.labels(outcome=outcome)
        for role in ROLES:
            self.engine_errors.labels(role=role)

    def request_done(self, status: int, phase: DecodePhase, seconds: float) -> None:
        """One request answered with ``status``, its decode phase ``phase``."""
        # A client that hung up is neither an engine's error nor the client's
        # (it may just have had enough): counted apart, so it does not page.
        if phase.client_gone:
            outcome = "client_gone"
        elif phase.cut_off or status >= 500:
            outcome = "error"
        elif status >= 400:
            outcome = "client_error"
        else:
            outcome = "ok"
        self.requests.labels(outcome=outcome).inc()
        self.request_duration.observe(seconds)

    def decode_done(self, phase: DecodePhase) -> None:
        """A decode engine's answer ended (one without a body: its end is its first byte)."""
        end = phase.end if phase.end is not None else time.monotonic()
        first = phase.first_byte if phase.first_byte is not None else end
        self.decode_first_byte.observe(first - phase.start)
        self.decode_duration.observe(end - phase.start)

    def engine_error(self, role: str) -> None:
        self.engine_errors.labels(role=role).inc()

    def exposition(self) -> tuple[bytes, str]:
        """The current values in Prometheus text format, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


__all__ = ["LATENCY_BUCKETS_SECONDS", "DecodePhase", "ProxyMetrics"]
