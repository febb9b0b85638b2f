"""Prefill/decode disaggregation on real servers: the docs' P/D commands
(``ucm serve --kv-role producer|consumer`` with ``configs/ucm-vllm-pd.yaml``,
``ucm proxy``) with the tiny model, on 127.0.0.1.

Started once for the module: one prefill engine, two decode engines, a
single engine without the connector (the reference answers), and two
proxies (1P+1D and 1P+2D). The engines' own prefix cache is off, so what a
decode engine does not compute must come from the prefill engine's blocks:
vLLM's ``prompt_tokens_by_source{source="local_compute"}`` counts what it
computed. The prefill engine is killed in the last test.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from support.docs import blocks_with
from support.engines import ROOT, engine_env
from support.tiny_serve import free_port, http, tiny_server_args

WORDS = (
    "cache block store prefix token layer engine decode prefill shared disk memory key value "
    "request answer model prompt load save"
).split()


def readme_pd_block() -> list[list[str]]:
    """The P/D bash block of ``docs/user-guide/pd.md``, as the words of each command."""
    (block,) = blocks_with("bash", "--kv-role producer")
    lines = block.code.replace("\\\n", " ").splitlines()
    words = [[w for w in shlex.split(line, comments=True) if w != "&"] for line in lines]
    return [w for w in words if w]


def text(n_words: int, seed: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * i + i * seed) % len(WORDS)] for i in range(n_words))


class Stack:
    """Processes started together, waited for together, stopped together."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, argv: list[str], **env: str) -> None:
        e = engine_env()
        e.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # the real thing: several processes
        e.update(env)
        with open(self.logs / f"{name}.log", "w") as log:
            self.procs[name] = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=e, cwd=str(ROOT),
                start_new_session=True,
            )  # fmt: skip

    def wait_healthy(self, name: str, base: str, timeout: float = 300) -> None:
        deadline = time.time() + timeout
        while http(base + "/health", timeout=5)[0] != 200:
            proc = self.procs[name]
            if proc.poll() is not None or time.time() > deadline:
                log = (self.logs / f"{name}.log").read_text()[-4000:]
                pytest.fail(f"{name} did not start ({proc.poll()}):\n{log}")
            time.sleep(1)

    def kill(self, name: str) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.procs[name].pid, signal.SIGKILL)
        self.procs[name].wait()

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


@pytest.fixture(scope="module")
def pd(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("pd")
    commands = readme_pd_block()
    producer, consumer, proxy = (
        next(c for c in commands if "producer" in c),
        next(c for c in commands if "consumer" in c),
        next(c for c in commands if c[:2] == ["ucm", "proxy"]),
    )
    ports = {k: free_port() for k in ("P", "D1", "D2", "ref", "proxy1", "proxy2")}
    url = {k: f"http://127.0.0.1:{p}" for k, p in ports.items()}
    py = [sys.executable, "-m", "ucm"]

    def engine(words: list[str], port: int) -> list[str]:
        # The docs' command for the tiny model: its options after the
        # model, but this test's port and small sizes.
        i = words.index("--port")
        opts = words[3:i] + words[i + 2 :]
        return [*py, "serve", str(tiny_model), *opts, *tiny_server_args(port)]

    stack = Stack(root)
    store = {"UCM_STORAGE_BACKENDS": str(root / "store")}
    try:
        stack.start("P", engine(producer, ports["P"]), **store)
        stack.start("D1", engine(consumer, ports["D1"]), **store)
        stack.start("D2", engine(consumer, ports["D2"]), **store)
        ref = [sys.executable, "-m", "ucm.integration.vllm.cli", "serve", str(tiny_model)]
        stack.start("ref", [*ref, *tiny_server_args(ports["ref"])])
        routes = {"proxy1": ["D1"], "proxy2": ["D1", "D2"]}
        for name, decodes in routes.items():
            argv = [*py, *proxy[1:]]
            argv[argv.index("--prefill") + 1] = url["P"]
            argv[argv.index("--decode") + 1] = ",".join(url[d] for d in decodes)
            argv[argv.index("--port") + 1] = str(ports[name])
            stack.start(name, [*argv, "--health-interval", "1"])
        for name in ports:
            stack.wait_healthy(name, url[name])
        yield {"url": url, "stack": stack, "curl": next(c for c in commands if c[0] == "curl")}
    finally:
        stack.close()


def post(base: str, route: str, body: dict[str, Any], timeout: float = 300) -> tuple[int, Any]:
    status, out = http(base + route, body, timeout=timeout)
    try:
        return status, json.loads(out)
    except json.JSONDecodeError:
        return status, out


def completion(base: str, prompt: str, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    status, out = post(base, "/v1/completions", {**body, "ignore_eos": True, **extra})
    assert status == 200, out
    return out


def computed(base: str) -> float:
    """Prompt tokens the engine computed (vLLM's counter), all requests so far."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for fam in text_string_to_metric_families(http(base + "/metrics")[1]):
        for s in fam.samples:
            if (
                s.name == "vllm:prompt_tokens_by_source_total"
                and s.labels.get("source") == "local_compute"
            ):
                total += s.value
    return total


def ucm_metric(base: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(
        s.value
        for fam in text_string_to_metric_families(http(base + "/metrics")[1])
        for s in fam.samples
        if s.name == name
    )


def test_readme_example_request_through_1p1d(pd: dict[str, Any]) -> None:
    url = pd["url"]
    curl = pd["curl"]
    body = json.loads(curl[curl.index("-d") + 1])
    assert curl[1].startswith("http://127.0.0.1:8000/v1/completions")
    body["model"] = "tiny"
    before = computed(url["D1"])
    status, out = post(url["proxy1"], "/v1/completions", {**body, "temperature": 0})
    assert status == 200, out
    _, ref = post(url["ref"], "/v1/completions", {**body, "temperature": 0})
    assert out["choices"][0]["text"] == ref["choices"][0]["text"]
    assert computed(url["D1"]) - before == 1


def test_decode_computes_one_token_and_answers_as_one_engine(pd: dict[str, Any]) -> None:
    """Prompts of several lengths (not block multiples, one under a block),
    through 1P+1D and 1P+2D: the same greedy tokens as the single engine;
    each decode engine computed one prompt token per request."""
    url = pd["url"]
    prompts = [text(n, n) for n in (5, 37, 90, 150, 211)]
    before = {d: computed(url[d]) for d in ("D1", "D2")}
    served = 0
    for proxy in ("proxy1", "proxy2"):
        for p in prompts:
            out = completion(url[proxy], p)
            ref = completion(url["ref"], p)
            assert out["choices"][0]["text"] == ref["choices"][0]["text"], (proxy, p)
            assert out["usage"]["prompt_tokens"] == ref["usage"]["prompt_tokens"]
            served += 1
    after = {d: computed(url[d]) for d in ("D1", "D2")}
    assert sum(after.values()) - sum(before.values()) == served
    assert after["D2"] > before["D2"]  # round robin reached the second decode engine
    assert ucm_metric(url["D1"], "ucm_handover_timeouts_total") == 0


def test_concurrent_requests_with_shared_prefixes(pd: dict[str, Any]) -> None:
    url = pd["url"]
    shared = text(120, 3)
    prompts = [f"{shared} {text(10 + 3 * i, 50 + i)}" for i in range(8)]
    before = computed(url["D1"]) + computed(url["D2"])
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda p: completion(url["proxy2"], p), prompts))
    for p, out in zip(prompts, outs, strict=True):
        assert out["choices"][0]["text"] == completion(url["ref"], p)["choices"][0]["text"]
    assert computed(url["D1"]) + computed(url["D2"]) - before == len(prompts)


def stream(base: str, route: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    req = urllib.request.Request(
        base + route,
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    events = []
    with urllib.request.urlopen(req, timeout=300) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def test_streaming_completions_and_chat(pd: dict[str, Any]) -> None:
    url = pd["url"]
    prompt = text(70, 9)
    ref = completion(url["ref"], prompt, max_tokens=12)["choices"][0]["text"]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0}
    events = stream(url["proxy2"], "/v1/completions", {**body, "ignore_eos": True})
    assert len(events) > 1
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == ref
    chat = {
        "model": "tiny",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
    }
    status, whole = post(url["ref"], "/v1/chat/completions", chat)
    assert status == 200, whole
    events = stream(url["proxy1"], "/v1/chat/completions", chat)
    got = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert got == whole["choices"][0]["message"]["content"]


def test_errors_pass_through_and_bad_params_are_not_fatal(pd: dict[str, Any]) -> None:
    url = pd["url"]
    # An engine's error comes back with its status.
    status, out = post(url["proxy1"], "/v1/completions", {"model": "nope", "prompt": "x"})
    assert status == 404, out
    status, out = post(
        url["proxy1"], "/v1/completions", {"model": "tiny", "prompt": "x" * 1, "max_tokens": -3}
    )
    assert status == 400, out
    # The proxy's own checks.
    status, out = post(
        url["proxy1"],
        "/v1/completions",
        {"model": "tiny", "prompt": "x", "kv_transfer_params": "all"},
    )
    assert status == 400 and "kv_transfer_params" in out["error"]["message"]
    # Hostile handover fields sent straight to a decode engine: served, computed there.
    prompt = text(60, 4)
    ref = completion(url["ref"], prompt)["choices"][0]["text"]
    huge = {"do_remote_prefill": True, "ucm_blocks": 10**40}
    status, out = post(
        url["D2"],
        "/v1/completions",
        {"model": "tiny", "prompt": prompt, "kv_transfer_params": huge},
    )
    assert status == 400 and "extra_args" in out["error"]["message"]  # vLLM's own check
    for bad in (
        {"ucm_blocks": 10**12, "ucm_tail_tokens": 0, "ucm_last_block": "00" * 16},
        {"ucm_blocks": [1] * 10000, "ucm_last_block": {"a": 1}},
        {"ucm_blocks": 1, "ucm_tail_tokens": 3, "ucm_last_block": "ab" * 16},
    ):
        params = {"do_remote_prefill": True, **bad}
        out = completion(url["D2"], prompt, kv_transfer_params=params)
        assert out["choices"][0]["text"] == ref


def test_prefill_engine_killed_mid_request(pd: dict[str, Any]) -> None:
    """Last: the prefill engine dies with requests in flight. Each request
    ends, with its answer (the decode engine computes the prompt) or a clear
    error; later requests are served by the decode engines alone."""
    url = pd["url"]
    prompts = [text(120 + 20 * i, 70 + i) for i in range(6)]
    with ThreadPoolExecutor(6) as pool:
        futures = [
            pool.submit(post, url["proxy2"], "/v1/completions",
                        {"model": "tiny", "prompt": p, "max_tokens": 8, "temperature": 0,
                         "ignore_eos": True})
            for p in prompts
        ]  # fmt: skip
        time.sleep(0.3)
        pd["stack"].kill("P")
        results = [f.result(timeout=300) for f in futures]
    for p, (status, out) in zip(prompts, results, strict=True):
        if status == 200:
            assert out["choices"][0]["text"] == completion(url["ref"], p)["choices"][0]["text"]
        else:
            assert status >= 500 and "error" in out, (status, out)
    prompt = text(80, 99)
    out = completion(url["proxy2"], prompt)
    assert out["choices"][0]["text"] == completion(url["ref"], prompt)["choices"][0]["text"]
    code, body = http(url["proxy2"] + "/health")
    assert code == 503 and json.loads(body)["prefill"] == {url["P"]: False}
