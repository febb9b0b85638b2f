"""``ucm proxy``'s ``GET /metrics``: after real requests have gone through it
(``python -m ucm proxy`` in front of fake engines, ``support.pd_proxy``), its
Prometheus series count them by outcome, time their phases, show those in
flight and count the engines' errors by role."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from support.pd_proxy import FakeEngine, running_proxy, scrape, value
from support.tiny_serve import free_port, http

REQUEST = {"model": "m", "prompt": "hello", "max_tokens": 4}


def test_metrics_count_and_time_requests_through_both_engines(tmp_path: Path) -> None:
    prefill, decode = FakeEngine("prefill"), FakeEngine("decode")
    try:
        with running_proxy(prefill.url, decode.url, free_port(), tmp_path / "log") as url:
            before = scrape(url)
            assert value(before, "ucm_proxy_requests_total", outcome="ok") == 0
            assert value(before, "ucm_proxy_requests_in_flight") == 0

            # A request held at the decode engine is in flight.
            decode.gate.clear()
            answer: list[tuple[int, str]] = []
            client = threading.Thread(
                target=lambda: answer.append(http(url + "/v1/completions", REQUEST))
            )
            client.start()
            deadline = time.monotonic() + 30
            while not decode.bodies:
                assert time.monotonic() < deadline, "the request never reached the decode engine"
                time.sleep(0.05)
            assert value(scrape(url), "ucm_proxy_requests_in_flight") == 1
            time.sleep(0.2)  # the decode phase takes at least this long
            decode.gate.set()
            client.join(60)
            assert answer and answer[0][0] == 200, answer

            assert http(url + "/v1/completions", REQUEST)[0] == 200
            refused = {**REQUEST, "kv_transfer_params": "not an object"}
            assert http(url + "/v1/completions", refused)[0] == 400
            m = scrape(url)
    finally:
        prefill.close()
        decode.close()
    assert value(m, "ucm_proxy_requests_total", outcome="ok") == 2
    assert value(m, "ucm_proxy_requests_total", outcome="client_error") == 1
    assert value(m, "ucm_proxy_requests_total", outcome="error") == 0
    assert value(m, "ucm_proxy_requests_in_flight") == 0
    # The refused request never reached the engines: two phases of each.
    for phase in ("prefill_duration", "decode_first_byte", "decode_duration"):
        assert value(m, f"ucm_proxy_{phase}_seconds_count") == 2, phase
    assert value(m, "ucm_proxy_request_duration_seconds_count") == 3
    first_byte = value(m, "ucm_proxy_decode_first_byte_seconds_sum")
    decoding = value(m, "ucm_proxy_decode_duration_seconds_sum")
    end_to_end = value(m, "ucm_proxy_request_duration_seconds_sum")
    assert 0.2 <= first_byte <= decoding <= end_to_end
    assert value(m, "ucm_proxy_decode_duration_seconds_bucket", le="0.1") <= 1
    for role in ("prefill", "decode"):
        assert value(m, "ucm_proxy_engine_errors_total", role=role) == 0
    assert value(m, "ucm_proxy_prefill_fallbacks_total") == 0


def test_metrics_count_engines_that_do_not_answer_by_role(tmp_path: Path) -> None:
    # Nothing listens on either port: the prefill engine's failure falls back
    # to the decode engine, whose failure is the request's error (502).
    down_prefill, down_decode = (f"http://127.0.0.1:{free_port()}" for _ in range(2))
    with running_proxy(down_prefill, down_decode, free_port(), tmp_path / "log") as url:
        assert http(url + "/v1/completions", REQUEST)[0] == 502
        m = scrape(url)
    assert value(m, "ucm_proxy_engine_errors_total", role="prefill") == 1
    assert value(m, "ucm_proxy_engine_errors_total", role="decode") == 1
    assert value(m, "ucm_proxy_prefill_fallbacks_total") == 1
    assert value(m, "ucm_proxy_requests_total", outcome="error") == 1
    assert value(m, "ucm_proxy_requests_total", outcome="ok") == 0
    # The prefill phase ran; no decode engine answered, so no decode phase.
    assert value(m, "ucm_proxy_prefill_duration_seconds_count") == 1
    assert value(m, "ucm_proxy_decode_duration_seconds_count") == 0
    assert value(m, "ucm_proxy_request_duration_seconds_count") == 1
