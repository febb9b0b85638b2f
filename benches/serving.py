"""Serving under load: many users, multi-round conversations over long
documents, far more KV than the engine's own memory holds.

Each system is started as vLLM's OpenAI server on the same model and engine
settings, one at a time, and the same seeded workload is driven against it:

* ``multi-round`` (default): U users, each with a document of ``--doc-tokens``
  tokens, ask ``--rounds`` questions of ``--question-tokens`` tokens; each
  round's prompt is the previous round's prompt, its answer (the server's own
  ``--answer-tokens`` tokens, greedy) and the new question. Users take turns
  (round 0 of every user, then round 1 of every user, ...), so between two
  rounds of a user every other user is served and, with U sized from the
  engine's KV memory, the user's context has left the engine's own prefix
  cache: reuse has to come from the KV layer under test.
* ``shared-doc``: the same, but ``--users-per-doc`` users ask about each
  document, so a user's first round can already reuse another user's
  document.

Requests go out at a fixed concurrency (``--concurrency 1 4 16``, the
default sweep) or with Poisson arrivals (``--rates``, requests/s, at most
``--max-inflight`` in flight). At each sweep point the engine's KV memory
holds the requests in flight (``C x`` the longest sequence ``x --kv-headroom``)
and U is chosen so that the distinct KV of all users is ``--kv-ratio`` times
that (4 by default). Every point starts a fresh server and store.

Systems (``--systems``, all by default):

* ``limit``: vLLM alone with KV memory for every user's context: what a KV
  layer can at best come close to;
* ``vllm``: vLLM alone (its prefix cache on), the small KV memory;
* ``offload``: vLLM's native CPU offloading (``OffloadingConnector``), a host
  pool of ``--host-kv-gib``; on the CPU build through the small worker shim
  in ``benches/offload_cpu.py``;
* ``lmcache``: LMCache (CPU memory of the same budget, plus files on the
  local disk), run as in ``benches/lmcache_engine.py`` (``--lmcache-path``);
* ``ucm``: UCMConnector with its default store (``Cache|Posix``), the Cache
  tier sized to the same budget;
* ``ucm-posix``: UCMConnector with ``Posix`` alone (the page cache in front).

Figures per system and point: TTFT p50/p90/p99 of reuse requests (a later
round, or a document someone asked about before) and p50 of cold ones,
inter-token latency p50/p99, request and output-token throughput (of the
whole point, and of its reuse phase), total time, the share of prompt tokens
served from cache (``cached_tokens`` in each response's usage), the host
memory peak of the server's processes (PSS, sampled every second; the page
cache under a ``Posix`` store is printed apart) and, for ucm, the
connector's counters from ``/metrics`` and the store's own figures (loads,
bytes, evictions; logged by the worker at shutdown). Ratios are taken
against ``limit`` and ``vllm`` of the same run; outputs are compared token
by token with ``vllm``'s (greedy decoding): the count of requests that
differ is printed. A table (Markdown), ``results.json`` and ``ttft.png``
(the TTFT distribution per system and point) are written to ``--out``.

Why a client of our own: ``vllm bench serve`` has no multi-round dataset
(its ``custom`` prompts can't contain the server's own earlier answers) and
does not return each request's tokens, which the identity check needs.

Run (defaults sized for SmolLM2-135M on a small CPU host, ``ucm model fetch``)::

    .venv/bin/python benches/serving.py [--systems limit vllm offload lmcache ucm ucm-posix]
        [--concurrency 1 4 16 | --rates 0.5 1 2] [--workload multi-round|shared-doc]
        [--doc-tokens 512 --rounds 3 --question-tokens 32 --answer-tokens 16]
        [--lmcache-path DIR] [--repeats 3] [--out DIR]

On a GPU host, the same script with a larger model and longer documents, e.g.
``--model Qwen/Qwen2.5-7B-Instruct --dtype auto --doc-tokens 8000
--answer-tokens 100 --concurrency 1 4 16 64``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python" / "tests"))

BENCHES = Path(__file__).resolve().parent
REPO = BENCHES.parent
SYSTEMS = ("limit", "vllm", "offload", "lmcache", "ucm", "ucm-posix")
REFERENCE = "vllm"  # outputs are compared with this system's
SERVED_NAME = "bench"
STORE_FIGURES_MARK = "UCM store figures"


# -- workload -----------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """The conversation shape, the same at every sweep point."""

    workload: str  # "multi-round" or "shared-doc"
    doc_tokens: int
    question_tokens: int
    answer_tokens: int
    rounds: int
    users_per_doc: int  # shared-doc only
    kv_ratio: float  # distinct KV of all users over the engine's KV memory
    kv_headroom: float  # engine KV memory over what the requests in flight need
    host_ratio: float  # host budget over the distinct KV (when --host-kv-gib is not given)
    seed: int

    def prompt_tokens(self, rnd: int) -> int:
        return (
            self.doc_tokens
            + rnd * (self.question_tokens + self.answer_tokens)
            + (self.question_tokens)
        )

    @property
    def max_seq(self) -> int:
        """Tokens of a user's whole conversation (its last prompt and answer)."""
        return self.prompt_tokens(self.rounds - 1) + self.answer_tokens


@dataclass(frozen=True)
class Point:
    """One sweep point: how requests arrive and how big everything is."""

    concurrency: int  # fixed concurrency, or the in-flight cap under Poisson arrivals
    rate: float | None  # requests/s (Poisson), None: fixed concurrency
    users: int
    docs: int
    engine_kv_tokens: int
    limit_kv_tokens: int
    distinct_tokens: int

    @property
    def label(self) -> str:
        return f"rate {self.rate:g}/s" if self.rate is not None else f"C={self.concurrency}"


def _round_up(n: float, to: int) -> int:
    return int(math.ceil(n / to) * to)


def size_point(
    shape: Shape, block: int, concurrency: int, rate: float | None, users: int | None
) -> Point:
    """Users, documents and KV memories of one sweep point (see the module doc)."""
    engine = _round_up(concurrency * shape.max_seq * shape.kv_headroom, block)
    per_user = shape.rounds * (shape.question_tokens + shape.answer_tokens)
    if shape.workload == "shared-doc":
        k = shape.users_per_doc
        docs = math.ceil(shape.kv_ratio * engine / (shape.doc_tokens + k * per_user))
        if users is not None:
            docs = max(1, math.ceil(users / k))
        n_users = users if users is not None else docs * k
        distinct = docs * shape.doc_tokens + n_users * per_user
    else:
        n_users = users if users is not None else math.ceil(shape.kv_ratio * engine / shape.max_seq)
        docs = n_users
        distinct = n_users * shape.max_seq
    limit = _round_up(distinct * 1.1 + concurrency * shape.max_seq, block)
    return Point(concurrency, rate, n_users, docs, engine, max(limit, engine), distinct)


@dataclass
class Turn:
    """One request of the plan: a user's round."""

    user: int
    rnd: int
    doc: int
    question: list[int]
    reuse: bool  # shares a prefix with an earlier request (a later round, a shared document)


def plan_point(
    shape: Shape, point: Point, vocab: tuple[int, int]
) -> tuple[list[list[int]], list[Turn]]:
    """The documents and the turns in the order they are issued; seeded by
    the shape and the point only, so every system gets the same workload."""
    rng = random.Random(f"{shape.seed}:{shape.workload}:{point.label}:{point.users}")
    lo, hi = vocab
    docs = [[rng.randrange(lo, hi) for _ in range(shape.doc_tokens)] for _ in range(point.docs)]
    turns = []
    seen_docs: set[int] = set()
    for rnd in range(shape.rounds):
        for u in range(point.users):
            d = u % point.docs
            q = [rng.randrange(lo, hi) for _ in range(shape.question_tokens)]
            turns.append(Turn(u, rnd, d, q, reuse=rnd > 0 or d in seen_docs))
            seen_docs.add(d)
    return docs, turns


# -- model ----------------------------------------------------------------------


@dataclass(frozen=True)
class ModelInfo:
    path: str
    layers: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_positions: int
    dtype_bytes: int

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @staticmethod
    def read(path: str, dtype: str) -> ModelInfo:
        """From the checkpoint's ``config.json`` (a local directory, or a hub
        name already in the local cache)."""
        p = Path(path)
        if not p.is_dir():
            from huggingface_hub import snapshot_download

            p = Path(snapshot_download(path, allow_patterns=["config.json"]))
        cfg = json.loads((p / "config.json").read_text())
        cfg = cfg.get("text_config", cfg)
        heads = int(cfg["num_attention_heads"])
        size = {"float32": 4, "float": 4}.get(dtype)
        if size is None and dtype == "auto":
            size = 4 if str(cfg.get("torch_dtype", cfg.get("dtype", ""))) == "float32" else 2
        return ModelInfo(
            path=path,
            layers=int(cfg["num_hidden_layers"]),
            kv_heads=int(cfg.get("num_key_value_heads", heads)),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            vocab=int(cfg["vocab_size"]),
            max_positions=int(cfg.get("max_position_embeddings", 1 << 20)),
            dtype_bytes=size or 2,
        )


def default_model() -> str | None:
    """The model ``ucm model fetch`` converts (SmolLM2-135M), if present."""
    try:
        from ucm.models import available

        path = available()
    except Exception:
        return None
    return str(path) if path is not None else None


def cpu_build() -> bool:
    import importlib.metadata as md

    try:
        md.version("vllm")
        return False
    except md.PackageNotFoundError:
        return True


# -- systems and servers ----------------------------------------------------------


@dataclass
class RunContext:
    """What a system's server needs for one point."""

    args: argparse.Namespace
    model: ModelInfo
    point: Point
    work: Path  # a fresh directory for this server
    host_bytes: int  # host KV budget of the offloading systems


def _common_server_args(ctx: RunContext, port: int, kv_tokens: int) -> list[str]:
    a, m = ctx.args, ctx.model
    max_len = min(_round_up(ctx.args.shape.max_seq + a.block_size, a.block_size), m.max_positions)
    out = [
        "serve",
        m.path,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        SERVED_NAME,
        "--dtype",
        a.dtype,
        "--max-model-len",
        str(max_len),
        "--block-size",
        str(a.block_size),
        "--kv-cache-memory-bytes",
        str(kv_tokens * m.kv_bytes_per_token),
        "--enable-prompt-tokens-details",
        "--seed",
        "0",
    ]
    if a.enforce_eager:
        out.append("--enforce-eager")
    if a.max_num_batched_tokens:
        out += ["--max-num-batched-tokens", str(a.max_num_batched_tokens)]
    return out + list(a.server_arg)


def _ucm_transfer(ctx: RunContext, pipeline: str | None) -> dict[str, Any]:
    extra: dict[str, Any] = {"storage_backends": str(ctx.work / "store")}
    if pipeline is not None:
        extra["store_pipeline"] = pipeline
    else:
        # The default pipeline, its Cache tier given the same host budget as
        # the other offloading systems.
        extra["cache_buffer_capacity_gb"] = round(ctx.host_bytes / 2**30, 3)
    return {
        "kv_connector": "UCMConnector",
        "kv_connector_module_path": "ucm.integration.vllm.ucm_connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def _offload_transfer(ctx: RunContext) -> dict[str, Any]:
    extra: dict[str, Any] = {"cpu_bytes_to_use": ctx.host_bytes}
    if cpu_build():
        extra.update(spec_name="HostCopyOffloadingSpec", spec_module_path="offload_cpu")
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def server_env(extra_path: list[str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    # The CPU build's KV size in GiB would override --kv-cache-memory-bytes.
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    for k in [k for k in env if k.startswith("UCM_")]:
        del env[k]
    paths = [str(REPO / "python"), str(BENCHES), *(extra_path or [])]
    env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    return env


class ProcessSampler:
    """Peak PSS of a process tree (and some extra processes), sampled every
    second, and the CPU seconds each process of it used meanwhile."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.peak = 0
        self._cpu0: dict[int, float] = {}
        self._cpu: dict[int, tuple[str, float]] = {}
        self._stop = threading.Event()
        self.sample()
        self._cpu0 = {p: c for p, (_, c) in self._cpu.items()}
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _tree(pid: int) -> list[int]:
        out, todo = [], [pid]
        while todo:
            p = todo.pop()
            out.append(p)
            try:
                for task in os.listdir(f"/proc/{p}/task"):
                    with open(f"/proc/{p}/task/{task}/children") as f:
                        todo.extend(int(c) for c in f.read().split())
            except OSError:
                continue
        return out

    @staticmethod
    def _pss(pid: int) -> int:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    @staticmethod
    def _cpu_of(pid: int) -> tuple[str, float] | None:
        """The process's name and its user + system CPU seconds."""
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            return None
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        return name, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def sample(self) -> None:
        pids = [p for root in self.pids for p in self._tree(root)]
        self.peak = max(self.peak, sum(self._pss(p) for p in pids))
        for p in pids:
            cpu = self._cpu_of(p)
            if cpu is not None:
                self._cpu[p] = cpu

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self.sample()

    def stop(self) -> tuple[int, dict[str, float]]:
        """The memory peak (bytes) and the CPU seconds per process name."""
        self._stop.set()
        self._thread.join()
        self.sample()
        cpu: dict[str, float] = {}
        for p, (name, c) in self._cpu.items():
            cpu[name] = cpu.get(name, 0.0) + c - self._cpu0.get(p, 0.0)
        return self.peak, cpu


class Server:
    """A ``vllm serve`` process group; stopped (the whole group) on close."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path, timeout_s: float) -> None:
        from support.tiny_serve import http

        self.log_path = log
        self._logf = open(log, "w")
        self.proc = subprocess.Popen(
            [sys.executable, str(BENCHES / "vllm_server.py"), *argv],
            stdout=self._logf,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=str(log.parent),
            start_new_session=True,
        )
        port = argv[argv.index("--port") + 1]
        self.base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout_s
        try:
            while http(self.base + "/health", timeout=5)[0] != 200:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
                    raise RuntimeError(f"server did not start (see {log}):\n{tail}")
                time.sleep(1)
        except BaseException:  # an interrupt too: no server is left behind
            self.close()
            raise

    def metrics_text(self) -> str:
        from support.tiny_serve import http

        return http(self.base + "/metrics", timeout=30)[1]

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                pass
        # Whatever of the group outlived the API server (an engine core
        # still busy, a resource tracker) goes too.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.wait()
        self._logf.close()


@contextlib.contextmanager
def start_system(name: str, ctx: RunContext, port: int) -> Iterator[tuple[Server, list[int]]]:
    """Starts ``name``'s server (and LMCache's own server for ``lmcache``);
    yields it and the pids whose memory counts."""
    a, p = ctx.args, ctx.point
    env = server_env()
    if Path(ctx.model.path).is_dir():
        env["HF_HUB_OFFLINE"] = "1"
    if a.cpu_reserved is not None:
        # vLLM's CPU build keeps CPUs off the model's threads: one for its
        # own processes, and one more when a KV connector is configured. On
        # a small host the second can't be met and the model gets every
        # CPU, so systems with a connector would compute on more CPUs than
        # vLLM alone: every system gets the same reservation instead.
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(a.cpu_reserved)
    kv = p.limit_kv_tokens if name == "limit" else p.engine_kv_tokens
    argv = _common_server_args(ctx, port, kv)
    sidecar = None
    if name == "ucm":
        argv += ["--kv-transfer-config", json.dumps(_ucm_transfer(ctx, None))]
    elif name == "ucm-posix":
        argv += ["--kv-transfer-config", json.dumps(_ucm_transfer(ctx, "Posix"))]
    elif name == "offload":
        argv += ["--kv-transfer-config", json.dumps(_offload_transfer(ctx))]
    elif name == "lmcache":
        from lmcache_engine import LMCacheServer, with_lmcache
        from vllm_server import LMCACHE_ENV

        sidecar = LMCacheServer(
            a.lmcache_path,
            env,
            ctx.work / "lmcache-l2",
            a.lmcache_chunk,
            ctx.host_bytes / 2**30,
            ctx.work / "lmcache-server.log",
        )
        env = with_lmcache(env, a.lmcache_path)
        env[LMCACHE_ENV] = "1"
        argv += ["--kv-transfer-config", json.dumps(sidecar.kv_transfer_config())]
    try:
        server = Server(argv, env, ctx.work / "server.log", a.startup_timeout)
        try:
            yield server, [server.proc.pid] + ([sidecar.proc.pid] if sidecar else [])
        finally:
            server.close()
    finally:
        if sidecar is not None:
            sidecar.close()


# -- client -----------------------------------------------------------------------


@dataclass
class Result:
    user: int
    rnd: int
    reuse: bool
    prompt_tokens: int
    cached_tokens: int
    start: float
    ttft: float
    end: float
    itl: list[float]
    tokens: list[int]
    error: str | None = None


async def complete(session: Any, url: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One streamed completion: first-token time, chunk gaps, tokens, usage."""
    body = {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    t0 = time.perf_counter()
    first, last = None, None
    gaps: list[float] = []
    tokens: list[int] = []
    usage: dict[str, Any] = {}
    buf = b""
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        # Server-sent events, parsed by hand: the first event carries the
        # prompt's token ids, longer than aiohttp's line limit.
        async for chunk in resp.content.iter_any():
            buf += chunk
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                data = event.strip().removeprefix(b"data:").strip()
                if not data or data == b"[DONE]":
                    continue
                obj = json.loads(data)
                if obj.get("usage"):
                    usage = obj["usage"]
                for ch in obj.get("choices") or ():
                    ids = ch.get("token_ids") or []
                    if not ids:
                        continue
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    else:
                        gaps.append(now - (last or now))
                    last = now
                    tokens.extend(ids)
    end = time.perf_counter()
    details = usage.get("prompt_tokens_details") or {}
    return {
        "start": t0,
        "ttft": (first or end) - t0,
        "end": end,
        "itl": gaps,
        "tokens": tokens,
        "prompt_tokens": int(usage.get("prompt_tokens", len(prompt))),
        "cached_tokens": int(details.get("cached_tokens") or 0),
    }


async def drive(
    base: str, shape: Shape, point: Point, docs: list[list[int]], turns: list[Turn]
) -> tuple[list[Result], float]:
    """Issues the turns in order (a user's round waits for its previous
    round) at the point's concurrency or Poisson rate; returns the results
    and the wall time."""
    import aiohttp

    url = base + "/v1/completions"
    history: dict[int, list[int]] = {}
    done: dict[tuple[int, int], asyncio.Event] = {(t.user, t.rnd): asyncio.Event() for t in turns}
    results: list[Result] = []
    slots = asyncio.Semaphore(point.concurrency)
    rng = random.Random(f"{shape.seed}:arrivals:{point.label}")

    async def one(session: aiohttp.ClientSession, t: Turn) -> None:
        try:
            if t.rnd > 0:
                await done[(t.user, t.rnd - 1)].wait()
            prompt = history.get(t.user, docs[t.doc]) + t.question
            try:
                r = await complete(session, url, prompt, shape.answer_tokens)
                res = Result(t.user, t.rnd, t.reuse, **r)
            except Exception as e:  # reported, and the user's later rounds go on
                now = time.perf_counter()
                res = Result(
                    t.user,
                    t.rnd,
                    t.reuse,
                    len(prompt),
                    0,
                    now,
                    0.0,
                    now,
                    [],
                    [],
                    error=str(e)[:300],
                )
            history[t.user] = prompt + res.tokens
            results.append(res)
        finally:
            slots.release()
            done[(t.user, t.rnd)].set()

    timeout = aiohttp.ClientTimeout(total=None, sock_read=1800)
    conn = aiohttp.TCPConnector(limit=0)
    t0 = time.perf_counter()
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
        tasks = []
        for t in turns:
            if point.rate is not None:
                await asyncio.sleep(rng.expovariate(point.rate))
            await slots.acquire()
            tasks.append(asyncio.create_task(one(session, t)))
        await asyncio.gather(*tasks)
    return results, time.perf_counter() - t0


# -- figures ----------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def summarize(results: list[Result], wall: float) -> dict[str, float]:
    ok = [r for r in results if r.error is None]
    reuse = [r for r in ok if r.reuse]
    cold = [r for r in ok if not r.reuse]
    itl = [g for r in ok for g in r.itl]
    out_tokens = sum(len(r.tokens) for r in ok)
    s: dict[str, float] = {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "wall_s": wall,
        "ttft_p50": pct([r.ttft for r in reuse], 50),
        "ttft_p90": pct([r.ttft for r in reuse], 90),
        "ttft_p99": pct([r.ttft for r in reuse], 99),
        "cold_ttft_p50": pct([r.ttft for r in cold], 50),
        "itl_p50": pct(itl, 50),
        "itl_p99": pct(itl, 99),
        "req_per_s": len(ok) / wall if wall > 0 else float("nan"),
        "out_tok_per_s": out_tokens / wall if wall > 0 else float("nan"),
        "hit_rate": sum(r.cached_tokens for r in reuse)
        / max(1, sum(r.prompt_tokens for r in reuse)),
    }
    if reuse:
        # The reuse phase: from the first reuse request's start to the last
        # one's end (multi-round: rounds 1 and later).
        span = max(r.end for r in reuse) - min(r.start for r in reuse)
        s["reuse_req_per_s"] = len(reuse) / span if span > 0 else float("nan")
        s["reuse_out_tok_per_s"] = (
            sum(len(r.tokens) for r in reuse) / span if span > 0 else float("nan")
        )
    return s


def ucm_counters(metrics_text: str) -> dict[str, float]:
    """The connector's ``ucm_*`` counters and its duration histograms' sums
    and counts on /metrics, summed over labels."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(metrics_text):
        for s in fam.samples:
            if s.name.startswith("ucm_") and s.name.endswith(("_total", "_sum", "_count")):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def store_figures(log: Path) -> dict[str, float]:
    """The store's own figures, from the line each worker logs at shutdown."""
    out: dict[str, float] = {}
    for line in log.read_text(errors="replace").splitlines():
        if STORE_FIGURES_MARK in line and "{" in line:
            with contextlib.suppress(ValueError):
                for k, v in json.loads(line[line.index("{") :]).items():
                    if isinstance(v, int | float):
                        out[k] = out.get(k, 0) + v
    return out


def page_cache_bytes(root: Path) -> int:
    """Bytes of the files under ``root`` in the page cache."""
    from page_cache import resident_under

    return resident_under(root)


# -- one run of one system at one point ---------------------------------------------------


@dataclass
class Run:
    system: str
    point: str
    repeat: int
    summary: dict[str, float]
    results: list[Result] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


def run_one(
    name: str, args: argparse.Namespace, model: ModelInfo, point: Point, repeat: int, root: Path
) -> Run:
    from support.tiny_serve import free_port

    shape: Shape = args.shape
    docs, turns = plan_point(shape, point, args.vocab)
    work = Path(tempfile.mkdtemp(prefix=f"{name}-{point.label.replace(' ', '')}-", dir=root))
    host = args.host_bytes or int(
        point.distinct_tokens * model.kv_bytes_per_token * shape.host_ratio
    )
    ctx = RunContext(args, model, point, work, max(host, 64 << 20))
    t0 = time.time()
    with start_system(name, ctx, free_port()) as (server, pids):
        up = time.time() - t0
        procs = ProcessSampler(pids)
        # Warm-up: first-request costs off the measurements.
        wrng = random.Random(f"warm:{point.label}:{name}:{repeat}")
        warm = [wrng.randrange(*args.vocab) for _ in range(2 * args.block_size + 3)]
        asyncio.run(_warm(server.base, warm))
        results, wall = asyncio.run(drive(server.base, shape, point, docs, turns))
        peak, cpu = procs.stop()
        counters = ucm_counters(server.metrics_text()) if name.startswith("ucm") else {}
    extra: dict[str, Any] = {"startup_s": up, "mem_peak_bytes": peak, "cpu_s": cpu}
    if name.startswith("ucm"):
        extra["counters"] = counters
        extra["store"] = store_figures(work / "server.log")
        extra["page_cache_bytes"] = page_cache_bytes(work / "store")
    summary = summarize(results, wall)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    else:
        extra["work"] = str(work)
    return Run(name, point.label, repeat, summary, results, extra)


async def _warm(base: str, prompt: list[int]) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as s:
        await complete(s, base + "/v1/completions", prompt, 2)


# -- report ---------------------------------------------------------------------------


def mismatches(runs: list[Run], reference: str) -> dict[tuple[str, str, int], int]:
    """Per (system, point, repeat): requests whose tokens differ from the
    reference system's (same point, same repeat, else its first repeat)."""
    ref: dict[tuple[str, int], dict[tuple[int, int], list[int]]] = {}
    for r in runs:
        if r.system == reference:
            ref[(r.point, r.repeat)] = {(x.user, x.rnd): x.tokens for x in r.results}
    out = {}
    for r in runs:
        want = ref.get((r.point, r.repeat)) or ref.get((r.point, 0))
        if want is None:
            continue
        out[(r.system, r.point, r.repeat)] = sum(
            1 for x in r.results if x.error is not None or want.get((x.user, x.rnd)) != x.tokens
        )
    return out


def _agg(runs: list[Run], key: str) -> tuple[float, float, float]:
    v = [r.summary.get(key, float("nan")) for r in runs]
    v = [x for x in v if x == x]
    if not v:
        return float("nan"), float("nan"), float("nan")
    return statistics.median(v), min(v), max(v)


def table(runs: list[Run], systems: list[str], points: list[str], reference: str) -> str:
    diff = mismatches(runs, reference)
    lines = []
    many = len({r.repeat for r in runs}) > 1
    for pt in points:
        here = {s: [r for r in runs if r.system == s and r.point == pt] for s in systems}
        base = {
            k: _agg(here.get("limit", []), k)[0]
            for k in ("ttft_p50", "ttft_p99", "reuse_req_per_s")
        }
        alone = {
            k: _agg(here.get(reference, []), k)[0]
            for k in ("ttft_p50", "cold_ttft_p50", "reuse_req_per_s")
        }
        lines.append(f"### {pt}")
        lines.append("")
        lines.append(
            "| system | reuse TTFT p50 | p90 | p99 | cold TTFT p50 | ITL p50 | ITL p99 | req/s "
            "| out tok/s | reuse req/s | total | hit rate | mem peak | p50 x limit | p99 x limit "
            "| reuse req/s x limit | x vLLM alone (p50, req/s) | cold x vLLM alone | differ |"
        )
        lines.append("|" + "---|" * 20)
        for s in systems:
            rs = here.get(s) or []
            if not rs:
                continue

            def cell(key: str, fmt: str, rs: list[Run] = rs) -> str:
                med, lo, hi = _agg(rs, key)
                if med != med:
                    return "—"
                text = format(med, fmt)
                return f"{text} [{format(lo, fmt)}-{format(hi, fmt)}]" if many else text

            def ratio(key: str, b: dict[str, float], rs: list[Run] = rs) -> str:
                med = _agg(rs, key)[0]
                return (
                    f"{med / b[key]:.2f}" if b.get(key) and med == med and b[key] == b[key] else "—"
                )

            peak = statistics.median(r.extra.get("mem_peak_bytes", 0) for r in rs) / 2**30
            nd = [diff[(s, pt, r.repeat)] for r in rs if (s, pt, r.repeat) in diff]
            lines.append(
                f"| {s} | {cell('ttft_p50', '.3f')}s | {cell('ttft_p90', '.3f')}s "
                f"| {cell('ttft_p99', '.3f')}s | {cell('cold_ttft_p50', '.3f')}s "
                f"| {cell('itl_p50', '.3f')}s | {cell('itl_p99', '.3f')}s "
                f"| {cell('req_per_s', '.2f')} "
                f"| {cell('out_tok_per_s', '.1f')} | {cell('reuse_req_per_s', '.2f')} "
                f"| {cell('wall_s', '.0f')}s | {cell('hit_rate', '.2f')} | {peak:.2f} GiB "
                f"| {ratio('ttft_p50', base)} | {ratio('ttft_p99', base)} "
                f"| {ratio('reuse_req_per_s', base)} "
                f"| {ratio('ttft_p50', alone)}, {ratio('reuse_req_per_s', alone)} "
                f"| {ratio('cold_ttft_p50', alone)} | {max(nd) if nd else '—'} |"
            )
        lines.append("")
        for s in systems:
            for r in here.get(s) or []:
                cpu = r.extra.get("cpu_s", {})
                figs = [
                    "server CPU "
                    + ", ".join(f"{k} {v:.0f}s" for k, v in sorted(cpu.items()) if v >= 0.5)
                ]
                if not s.startswith("ucm"):
                    lines.append(f"- {s} (repeat {r.repeat}): " + ", ".join(figs))
                    continue
                c, st = r.extra.get("counters", {}), r.extra.get("store", {})
                loads = c.get("ucm_load_duration_seconds_count", 0)
                load_s = c.get("ucm_load_duration_seconds_sum", 0)
                figs += [
                    f"loads {c.get('ucm_load_blocks_total', 0):.0f} blocks "
                    f"({c.get('ucm_load_bytes_total', 0) / 2**20:.0f} MiB, "
                    f"{load_s * 1e3 / max(loads, 1):.1f} ms each "
                    f"of {loads:.0f})",
                    f"saves {c.get('ucm_save_blocks_total', 0):.0f} blocks",
                    f"lookups hit {c.get('ucm_lookup_hit_tokens_total', 0):.0f} of "
                    f"{c.get('ucm_lookup_tokens_total', 0):.0f} tokens",
                ]
                for k in ("eviction_count", "l1_hit_rate", "bytes_loaded_l1", "bytes_loaded_l2"):
                    if k in st:
                        v = st[k]
                        figs.append(
                            f"{k} {v / 2**20:.0f} MiB" if k.startswith("bytes") else f"{k} {v:g}"
                        )
                cached = r.extra.get("page_cache_bytes", 0) / 2**20
                figs.append(f"store files in page cache {cached:.0f} MiB")
                lines.append(f"- {s} (repeat {r.repeat}): " + ", ".join(figs))
        lines.append("")
    return "\n".join(lines)


def plot(runs: list[Run], systems: list[str], points: list[str], path: Path) -> str:
    """TTFT of reuse requests, one empirical CDF per system, a panel per point."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot: matplotlib is not installed (pip install matplotlib)"
    fig, axes = plt.subplots(1, len(points), figsize=(5 * len(points), 4), squeeze=False)
    for ax, pt in zip(axes[0], points, strict=True):
        for s in systems:
            v = sorted(
                x.ttft
                for r in runs
                if r.system == s and r.point == pt
                for x in r.results
                if x.reuse and x.error is None
            )
            if v:
                ax.step(v, [(i + 1) / len(v) for i in range(len(v))], where="post", label=s)
        ax.set_xscale("log")
        ax.set_xlabel("TTFT of reuse requests (s)")
        ax.set_title(pt)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("fraction of requests")
    axes[0][-1].legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot: {path}"


# -- main -------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the model `ucm model fetch` converts")
    ap.add_argument("--dtype", default=None, help="default: float32 on vLLM's CPU build, else auto")
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    ap.add_argument("--workload", choices=("multi-round", "shared-doc"), default="multi-round")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument(
        "--rates",
        type=float,
        nargs="+",
        default=None,
        help="Poisson arrivals (requests/s) instead of fixed concurrency",
    )
    ap.add_argument("--max-inflight", type=int, default=16, help="in-flight cap under --rates")
    ap.add_argument("--doc-tokens", type=int, default=512)
    ap.add_argument("--question-tokens", type=int, default=32)
    ap.add_argument("--answer-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--users", type=int, default=None, help="default: sized from --kv-ratio")
    ap.add_argument("--users-per-doc", type=int, default=4, help="shared-doc: users per document")
    ap.add_argument(
        "--kv-ratio",
        type=float,
        default=4.0,
        help="distinct KV of all users over the engine's KV memory",
    )
    ap.add_argument(
        "--kv-headroom",
        type=float,
        default=1.25,
        help="engine KV memory over what the requests in flight need",
    )
    ap.add_argument(
        "--host-kv-gib",
        type=float,
        default=None,
        help="host KV budget of offload, LMCache and ucm's Cache tier "
        "(default: --host-ratio x the distinct KV of all users)",
    )
    ap.add_argument("--host-ratio", type=float, default=1.25)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument(
        "--cpu-reserved",
        type=int,
        default=None,
        help="vLLM's CPU build: CPUs kept off the model's threads, the same for every system "
        "(default 1 there: vLLM's own reservation without a KV connector)",
    )
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument(
        "--no-enforce-eager",
        dest="enforce_eager",
        action="store_false",
        help="let vLLM compile the model (eager by default: compiling takes minutes here)",
    )
    ap.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="one more argument for every server (repeatable)",
    )
    ap.add_argument(
        "--lmcache-path",
        type=Path,
        default=None,
        help="where LMCache is installed (see benches/lmcache_engine.py)",
    )
    ap.add_argument("--lmcache-chunk", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--startup-timeout", type=float, default=600)
    ap.add_argument("--out", type=Path, default=None, help="default: .ucm-demo/serving/<time>")
    ap.add_argument(
        "--keep", action="store_true", help="keep each server's directory (logs, store)"
    )
    args = ap.parse_args(argv)
    args.model = args.model or default_model()
    if args.model is None:
        ap.error("no --model, and the default one is not fetched (ucm model fetch)")
    if args.cpu_reserved is None and cpu_build():
        args.cpu_reserved = 1
    if args.dtype is None:
        # The CPU build computes bfloat16 without AMX several times slower
        # than float32 (measured on this project's CI machines).
        args.dtype = "float32" if cpu_build() else "auto"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = ModelInfo.read(args.model, args.dtype)
    args.shape = Shape(
        workload=args.workload,
        doc_tokens=args.doc_tokens,
        question_tokens=args.question_tokens,
        answer_tokens=args.answer_tokens,
        rounds=args.rounds,
        users_per_doc=args.users_per_doc,
        kv_ratio=args.kv_ratio,
        kv_headroom=args.kv_headroom,
        host_ratio=args.host_ratio,
        seed=args.seed,
    )
    args.vocab = (min(100, model.vocab // 8), model.vocab)
    args.host_bytes = int(args.host_kv_gib * 2**30) if args.host_kv_gib else 0
    if args.lmcache_path is not None:
        args.lmcache_path = args.lmcache_path.resolve()  # the servers run elsewhere
    if "lmcache" in args.systems:
        from lmcache_engine import lmcache_import_error

        error = (
            "no --lmcache-path"
            if args.lmcache_path is None
            else lmcache_import_error(args.lmcache_path, server_env())
        )
        if error is not None:
            print(f"lmcache: left out ({error})", flush=True)
            args.systems = [s for s in args.systems if s != "lmcache"]
    if args.rates:
        points = [
            size_point(args.shape, args.block_size, args.max_inflight, r, args.users)
            for r in args.rates
        ]
    else:
        points = [
            size_point(args.shape, args.block_size, c, None, args.users) for c in args.concurrency
        ]
    out = args.out or REPO / ".ucm-demo" / "serving" / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="servers-", dir=out))
    kvb = model.kv_bytes_per_token
    print(
        f"model {model.path} ({model.layers} layers, {model.kv_heads} KV heads of "
        f"{model.head_dim}, {args.dtype}: {kvb / 1024:.1f} KiB of KV per token); "
        f"{args.workload}: documents of {args.doc_tokens} tokens, {args.rounds} rounds of "
        f"{args.question_tokens}-token questions and {args.answer_tokens}-token answers",
        flush=True,
    )
    for p in points:
        host = args.host_bytes or int(p.distinct_tokens * kvb * args.host_ratio)
        print(
            f"{p.label}: {p.users} users ({p.docs} documents), distinct KV "
            f"{p.distinct_tokens * kvb / 2**30:.2f} GiB "
            f"= {p.distinct_tokens / p.engine_kv_tokens:.1f} x "
            f"the engine's {p.engine_kv_tokens * kvb / 2**30:.2f} GiB; limit "
            f"{p.limit_kv_tokens * kvb / 2**30:.2f} GiB; host budget {host / 2**30:.2f} GiB",
            flush=True,
        )
    runs: list[Run] = []
    t_all = time.time()
    try:
        # Repeats outermost: a change in the machine's load hits every system.
        for rep in range(args.repeats):
            for name in args.systems:
                for p in points:
                    t = time.time()
                    run = run_one(name, args, model, p, rep, root)
                    runs.append(run)
                    s = run.summary
                    print(
                        f"[{rep}] {name} {p.label}: reuse TTFT p50 {s['ttft_p50']:.3f}s "
                        f"p99 {s['ttft_p99']:.3f}s, cold p50 {s['cold_ttft_p50']:.3f}s, "
                        f"{s.get('reuse_req_per_s', float('nan')):.2f} reuse req/s, hit rate "
                        f"{s['hit_rate']:.2f}, {s['errors']:.0f} errors, {s['wall_s']:.0f}s "
                        f"(+{run.extra['startup_s']:.0f}s start-up; {time.time() - t:.0f}s in all)",
                        flush=True,
                    )
    finally:
        shutil.rmtree(root, ignore_errors=True) if not args.keep else None
        labels = [p.label for p in points]
        systems = [s for s in SYSTEMS if s in args.systems]
        reference = REFERENCE if REFERENCE in systems else systems[0]
        text = table(runs, systems, labels, reference)
        header = (
            f"{args.workload}, {args.doc_tokens}-token documents, {args.rounds} rounds, "
            f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, "
            f"{args.repeats} repeat(s) ({'median [min-max]' if args.repeats > 1 else 'one run'}); "
            f"x limit / x vLLM alone: ratios to `limit` / `{reference}` at the same point; "
            f"differ: requests whose tokens differ from `{reference}`'s; "
            f"{time.time() - t_all:.0f}s in all"
        )
        print()
        print(header)
        print()
        print(text)
        (out / "table.md").write_text(header + "\n\n" + text + "\n")
        print(plot(runs, systems, labels, out / "ttft.png"))
        (out / "results.json").write_text(
            json.dumps(
                {
                    "args": {
                        k: (str(v) if isinstance(v, Path) else v)
                        for k, v in vars(args).items()
                        if k != "shape"
                    },
                    "shape": asdict(args.shape),
                    "points": [asdict(p) for p in points],
                    "model": asdict(model),
                    "runs": [asdict(r) for r in runs],
                },
                default=str,
            )
        )
        print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
