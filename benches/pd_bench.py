"""Prefill/decode disaggregation against one engine doing both, in the same run.

Starts, on 127.0.0.1: a prefill engine (``ucm serve --kv-role producer``),
a decode engine (``--kv-role consumer``), both on one ``Posix`` store,
``ucm proxy`` in front of them, and one plain vLLM engine (no connector).
Then sends ``--requests`` concurrent streaming completions of
``--prompt-tokens`` random tokens each (a fresh prompt set per round, so
nothing is cached), alternating between the two setups for ``--rounds``
rounds, and prints per setup: time to first token (mean, max), inter-token
latency (mean of each request's mean gap), and the prompt tokens the decode
engine computed per request (vLLM's ``prompt_tokens_by_source
{source="local_compute"}``: 1 when the handover works).

On a 2-core machine the three engines share the same cores: the figures
show the mechanics (what the decode engine computes, what the handover
costs) more than the speed-up P/D gives on separate machines, where decode
steps no longer queue behind other requests' prefills.

Run (a few minutes; not part of CI)::

    .venv/bin/python benches/pd_bench.py [--requests 4] [--prompt-tokens 1536]
        [--max-tokens 32] [--rounds 2] [--work DIR]

``--work DIR`` keeps the engines' logs (``P.log``, ``D.log``, ``proxy.log``,
``one.log``) and the store there.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python" / "tests"))

from support.tiny_serve import free_port, http, tiny_server_args

from ucm.vllm_demo.engine_process import engine_env
from ucm.vllm_demo.tiny_model import TinyModelSpec, make_tiny_llama

REPO = Path(__file__).resolve().parents[1]
MODEL = TinyModelSpec(layers=8, hidden=512, heads=8, kv_heads=4, intermediate=1024, vocab=512)


def local_compute(base: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(
        s.value
        for fam in text_string_to_metric_families(http(base + "/metrics", timeout=5)[1])
        for s in fam.samples
        if s.name == "vllm:prompt_tokens_by_source_total"
        and s.labels.get("source") == "local_compute"
    )


async def one(session: aiohttp.ClientSession, base: str, prompt: list[int], n: int) -> list[float]:
    """Arrival times (relative to the send) of each streamed token."""
    body = {
        "model": "m", "prompt": prompt, "max_tokens": n, "temperature": 0,
        "ignore_eos": True, "stream": True,
    }  # fmt: skip
    t0 = time.perf_counter()
    times = []
    async with session.post(base + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{base}: {r.status} {await r.text()}")
        async for line in r.content:
            s = line.decode().strip()
            if s.startswith("data: ") and s != "data: [DONE]":
                if json.loads(s[6:])["choices"]:
                    times.append(time.perf_counter() - t0)
    return times


async def round_of(base: str, prompts: list[list[int]], n: int) -> list[list[float]]:
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        return await asyncio.gather(*(one(session, base, p, n) for p in prompts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=1536)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--work",
        type=Path,
        help="directory for the model, store and engine logs (kept); default: a "
        "temporary one, removed at the end",
    )
    ap.add_argument(
        "--handover-timeout-s",
        type=float,
        help="the engines' handover_timeout_s (default: the config's)",
    )
    args = ap.parse_args()

    if args.work is not None:
        args.work.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="ucm-pd-bench-"))
    model = make_tiny_llama(work / "model", MODEL)
    max_len = args.prompt_tokens + args.max_tokens + 64
    ports = {k: free_port() for k in ("P", "D", "one", "proxy")}
    url = {k: f"http://127.0.0.1:{p}" for k, p in ports.items()}
    env = engine_env(UCM_STORAGE_BACKENDS=str(work / "store"), UCM_STORE_PIPELINE="Posix")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")
    if args.handover_timeout_s is not None:
        # engine_env drops the caller's UCM_* variables: set it here.
        env["UCM_HANDOVER_TIMEOUT_S"] = str(args.handover_timeout_s)
    py = [sys.executable, "-m", "ucm"]

    def serve_args(port: int) -> list[str]:
        return tiny_server_args(port, name="m", max_model_len=max_len, kv_cache_bytes=512 << 20)

    cmds = {
        "P": [*py, "serve", str(model), "--kv-role", "producer", *serve_args(ports["P"])],
        "D": [*py, "serve", str(model), "--kv-role", "consumer", *serve_args(ports["D"])],
        "one": [*py[:2], "ucm.integration.vllm.cli", "serve", str(model),
                *serve_args(ports["one"])],
        "proxy": [*py, "proxy", "--prefill", url["P"], "--decode", url["D"],
                  "--port", str(ports["proxy"])],
    }  # fmt: skip
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for name, cmd in cmds.items():
            log = open(work / f"{name}.log", "w")
            procs[name] = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(REPO),
                start_new_session=True,
            )  # fmt: skip
        for name in cmds:
            deadline = time.time() + 600
            while http(url[name] + "/health", timeout=5)[0] != 200:
                if procs[name].poll() is not None or time.time() > deadline:
                    sys.exit(f"{name} did not start; see {work / (name + '.log')}")
                time.sleep(1)
        rng = random.Random(0)
        results: dict[str, list[list[float]]] = {"1P+1D": [], "one engine": []}
        computed: dict[str, float] = {"1P+1D": 0.0, "one engine": 0.0}
        base_of = {"1P+1D": url["proxy"], "one engine": url["one"]}
        watch = {"1P+1D": url["D"], "one engine": url["one"]}
        # A warm-up request each, then rounds alternating between the setups.
        for setup in results:
            asyncio.run(round_of(base_of[setup], [[5] * 64], 2))
        for r in range(args.rounds):
            for setup in results if r % 2 == 0 else reversed(list(results)):
                prompts = [
                    [rng.randrange(4, MODEL.vocab) for _ in range(args.prompt_tokens)]
                    for _ in range(args.requests)
                ]
                before = local_compute(watch[setup])
                results[setup] += asyncio.run(round_of(base_of[setup], prompts, args.max_tokens))
                computed[setup] += local_compute(watch[setup]) - before
        print(
            f"{args.requests} concurrent requests x {args.rounds} rounds, "
            f"{args.prompt_tokens}-token prompts, {args.max_tokens} tokens each; "
            f"model {MODEL.layers} layers x hidden {MODEL.hidden}; {os.cpu_count()} cores"
        )
        print(
            f"{'setup':<12} {'TTFT mean':>10} {'TTFT max':>10} {'ITL mean':>10} "
            f"{'prompt tokens computed by the decoding engine / request':>58}"
        )
        summary = {}
        for setup, runs in results.items():
            ttft = [t[0] for t in runs]
            itl = [statistics.mean(b - a for a, b in itertools.pairwise(t)) for t in runs]
            summary[setup] = (statistics.mean(ttft), statistics.mean(itl))
            print(
                f"{setup:<12} {statistics.mean(ttft):>9.3f}s {max(ttft):>9.3f}s "
                f"{statistics.mean(itl) * 1e3:>8.1f}ms {computed[setup] / len(runs):>58.1f}"
            )
        (pt, pi), (ot, oi) = summary["1P+1D"], summary["one engine"]
        print(f"ratio 1P+1D / one engine: TTFT {pt / ot:.2f}x, ITL {pi / oi:.2f}x")
        print(
            "(2 cores shared by three engines: mechanics, not the speed-up of P/D on "
            "separate machines)"
            if (os.cpu_count() or 0) <= 4
            else ""
        )
    finally:
        for p in procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"engine logs and store kept in {work}")


if __name__ == "__main__":
    main()
