"""A vLLM engine in its own process, driven by JSON lines.

Used by the README's main job (:mod:`.demo`), ``benches/ttft.py`` and the
end-to-end tests: each engine is a fresh process (as after a restart), with
vLLM's engine core in that process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so
it starts in seconds. A bench that starts many engines can fork them from
one process that imported vLLM once (the tests' ``support.forker``).

Child side: ``python -m ucm.vllm_demo.engine_process '<json config>'`` with
``model``, optional ``ucm`` (the connector's ``kv_connector_extra_config``;
absent = no connector) and ``llm`` (more ``vllm.LLM`` arguments). Commands
arrive on stdin, one JSON object per line; each answer is one stdout line
starting with ``@@UCM@@``:

* ``{"op": "generate", "prompts": [[ids]...], "max_tokens": n}`` ->
  ``{"tokens", "text", "cached" (num_cached_tokens per prompt), "seconds",
  "cpu_seconds" (CPU time of the whole process, all threads), "ttft" and
  "decode_tps" (per prompt, from vLLM's request timestamps; decode tokens/s
  is None below two tokens)}``; with ``max_tokens`` 1 the time is the time
  to first token. Optional: ``"params"`` (one ``kv_transfer_params`` dict or
  null per prompt), ``"logprobs": k`` (adds ``"first_logprobs"``: the first
  token's top ``k`` log probabilities per prompt, ``{token: logprob}``),
  ``"ignore_eos"`` (default true: exactly ``max_tokens`` tokens).
* ``{"op": "metrics"}`` -> ``{"text"}``: the ``ucm_*`` lines of the
  process's Prometheus registry.
* ``{"op": "sparse"}`` -> what the sparse method counted since the last
  call: ``{"footprints"}`` (device blocks held by each finished offloaded
  request, :data:`ucm.integration.vllm.sparse.offload.FINISHED_FOOTPRINTS`),
  ``{"stats"}`` (the worker's sparse attention counters) and ``{"blend"}``
  (:data:`ucm.integration.vllm.sparse.blend.STATS`).
* ``{"op": "exit"}``: shuts the engine down (in-flight saves are flushed).
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any, Protocol

MARK = "@@UCM@@ "
CONNECTOR = {
    "kv_connector": "UCMConnector",
    "kv_connector_module_path": "ucm.integration.vllm.ucm_connector",
    "kv_role": "kv_both",
}


OFFLINE_ENGINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
"""Offline, with the engine core in the engine's own process (tests read its state)."""


def prepare_engine_child() -> None:
    """For a child process that runs vLLM itself; call before vLLM or
    :mod:`ucm.sparse` is imported. vLLM's CPU build runs the torch reference
    ops, so an inherited ``TRITON_INTERPRET`` (set by the test suite) goes."""
    os.environ.update(OFFLINE_ENGINE_ENV)
    os.environ.pop("TRITON_INTERPRET", None)


def engine_env(**extra: str) -> dict[str, str]:
    """Environment for an engine child: offline, in-process engine core,
    ``python/`` importable, no stray ``UCM_*`` settings."""
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2])
    env.update(OFFLINE_ENGINE_ENV)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    for k in [k for k in env if k.startswith("UCM_")]:
        del env[k]
    env.update(extra)
    return env


class EngineSpawner(Protocol):
    """Starts an engine some other way than a new interpreter
    (the tests' ``support.forker.EngineForker``): its process handle (``poll``,
    ``wait``, ``kill``) and the files to read answers from and write commands to."""

    def spawn(
        self, config: dict[str, Any], log: Path, cwd: Path
    ) -> tuple[Any, IO[str], IO[str]]: ...


class EngineProcess:
    """Parent side: starts the child and talks to it."""

    def __init__(
        self,
        config: dict[str, Any],
        log: str | Path,
        env: dict[str, str] | None = None,
        cwd: str | Path | None = None,
        forker: EngineSpawner | None = None,
    ) -> None:
        """``forker``: fork the engine from there (its environment, not
        ``env``) instead of starting a new interpreter."""
        self.log_path = Path(log)
        self._log = open(self.log_path, "w")
        workdir = Path(cwd or self.log_path.parent)
        self.proc: Any
        if forker is not None:
            self.proc, self._out, self._in = forker.spawn(config, self.log_path, workdir)
        else:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ucm.vllm_demo.engine_process", json.dumps(config)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._log,
                text=True,
                env=env or engine_env(),
                cwd=str(workdir),
            )
            assert self.proc.stdin is not None and self.proc.stdout is not None
            self._out, self._in = self.proc.stdout, self.proc.stdin
        self._lock = threading.Lock()
        first = self._read()
        if not first.get("ready"):
            raise RuntimeError(f"engine did not start: {first}")

    def _read(self) -> dict[str, Any]:
        while True:
            line = self._out.readline()
            if not line:
                self.proc.wait(timeout=60)
                status = getattr(self.proc, "status_text", self.proc.returncode)
                raise RuntimeError(f"engine exited ({status}); log tail:\n{self.log_tail()}")
            if line.startswith(MARK):
                return json.loads(line[len(MARK) :])
            self._log.write(line)

    def call(self, **cmd: Any) -> dict[str, Any]:
        with self._lock:
            self._in.write(json.dumps(cmd) + "\n")
            self._in.flush()
            return self._read()

    def generate(self, prompts: list[list[int]], max_tokens: int = 8) -> dict[str, Any]:
        return self.call(op="generate", prompts=prompts, max_tokens=max_tokens)

    def ttft(self, prompt: list[int]) -> tuple[float, int]:
        """Seconds to the first token of one prompt, and its cached-token count."""
        out = self.generate([prompt], max_tokens=1)
        return out["seconds"], out["cached"][0]

    def metrics(self) -> dict[str, float]:
        """The engine's ``ucm_*`` samples, summed over labels."""
        from prometheus_client.parser import text_string_to_metric_families

        out: dict[str, float] = {}
        text = self.call(op="metrics")["text"]
        for fam in text_string_to_metric_families(text + "\n"):
            for s in fam.samples:
                out[s.name] = out.get(s.name, 0.0) + s.value
        return out

    def log_text(self) -> str:
        if not self._log.closed:  # after close() too: what the engine logged last
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call(op="exit")
                self.proc.wait(timeout=300)
            except Exception:
                self.proc.kill()
                self.proc.wait()
        for f in (self._in, self._out):
            try:
                f.close()
            except OSError:
                pass  # the child is gone: nothing left to flush to it
        if not self._log.closed:
            self._log.close()


def _reply(out: IO[str], obj: dict[str, Any]) -> None:
    out.write(MARK + json.dumps(obj) + "\n")
    out.flush()


def _ttft(out: Any) -> float | None:
    m = getattr(out, "metrics", None)
    return float(m.first_token_latency) if m is not None and m.first_token_latency else None


def _decode_tps(out: Any) -> float | None:
    m = getattr(out, "metrics", None)
    n = len(out.outputs[0].token_ids)
    if m is None or n < 2 or m.last_token_ts <= m.first_token_ts:
        return None
    return (n - 1) / (m.last_token_ts - m.first_token_ts)


_SPARSE_SEEN: dict[str, Any] = {"footprints": set(), "stats": {}, "blend": {}}


def _sparse_counters() -> dict[str, Any]:
    """The sparse method's counters since the previous call (engine core in this process)."""
    from dataclasses import asdict

    from ucm.integration.vllm.sparse import blend, offload

    seen = _SPARSE_SEEN
    new_fps = [
        asdict(fp) for rid, fp in offload.FINISHED_FOOTPRINTS if rid not in seen["footprints"]
    ]
    seen["footprints"] = {rid for rid, _ in offload.FINISHED_FOOTPRINTS}
    stats: dict[str, int] = {}
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        bridge = getattr(get_kv_transfer_group(), "_sparse", None)
        stats = dict(getattr(bridge, "stats", None) or {})
    except Exception:
        pass

    def delta(now: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
        return {k: v - before.get(k, 0) for k, v in now.items() if v != before.get(k, 0)}

    out = {
        "footprints": new_fps,
        "stats": delta(stats, seen["stats"]),
        "blend": delta(dict(blend.STATS), seen["blend"]),
    }
    seen["stats"], seen["blend"] = stats, dict(blend.STATS)
    return out


# What run_engine and the engine it starts import (the first is what most
# of an engine's start-up goes to).
ENGINE_MODULES = (
    "vllm.entrypoints.llm",
    "vllm.v1.engine.core",
    "vllm.v1.worker.cpu_worker",
    "vllm.v1.worker.cpu_model_runner",
    "vllm.model_executor.models.llama",
    "ucm.integration.vllm.ucm_connector",
)


def import_engine_modules() -> None:
    """Imports :data:`ENGINE_MODULES` (for the tests' ``support.forker``, which
    forks engines after importing them once)."""
    for name in ENGINE_MODULES:
        importlib.import_module(name)


def run_engine(cfg: dict[str, Any], inp: IO[str], out: IO[str]) -> None:
    """Child side: starts the engine for ``cfg`` and answers commands from
    ``inp`` on ``out`` until ``exit`` or the end of ``inp``."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = dict(
        model=cfg["model"],
        enforce_eager=True,
        max_model_len=2048,
        block_size=32,
        dtype="float32",
        kv_cache_memory_bytes=64 << 20,
        enable_prefix_caching=True,
        disable_log_stats=False,
        seed=0,
    )
    kwargs.update(cfg.get("llm", {}))
    if cfg.get("ucm") is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            **CONNECTOR, kv_connector_extra_config=cfg["ucm"]
        )
    llm = LLM(**kwargs)
    _reply(out, {"ready": True})
    for line in inp:
        cmd = json.loads(line)
        op = cmd.get("op")
        if op == "generate":
            kv_params = cmd.get("params") or [None] * len(cmd["prompts"])
            params = [
                SamplingParams(
                    temperature=0,
                    max_tokens=cmd.get("max_tokens", 8),
                    ignore_eos=cmd.get("ignore_eos", True),
                    logprobs=cmd.get("logprobs"),
                    extra_args={"kv_transfer_params": kp} if kp else None,
                )
                for kp in kv_params
            ]
            prompts = [TokensPrompt(prompt_token_ids=p) for p in cmd["prompts"]]
            t, cpu = time.perf_counter(), time.process_time()
            outs = llm.generate(prompts, params, use_tqdm=False)
            dt, dcpu = time.perf_counter() - t, time.process_time() - cpu
            reply = {
                "tokens": [list(o.outputs[0].token_ids) for o in outs],
                "text": [o.outputs[0].text for o in outs],
                "cached": [o.num_cached_tokens or 0 for o in outs],
                "seconds": dt,
                "cpu_seconds": dcpu,
                "ttft": [_ttft(o) for o in outs],
                "decode_tps": [_decode_tps(o) for o in outs],
            }
            if cmd.get("logprobs"):
                reply["first_logprobs"] = [
                    {str(k): v.logprob for k, v in o.outputs[0].logprobs[0].items()} for o in outs
                ]
            _reply(out, reply)
        elif op == "sparse":
            _reply(out, _sparse_counters())
        elif op == "metrics":
            from prometheus_client import REGISTRY, generate_latest

            text = generate_latest(REGISTRY).decode()
            _reply(out, {"text": "\n".join(x for x in text.splitlines() if "ucm_" in x)})
        elif op == "exit":
            del llm
            gc.collect()
            _reply(out, {"bye": True})
            return
        else:
            _reply(out, {"error": f"unknown op {op!r}"})


if __name__ == "__main__":
    run_engine(json.loads(sys.argv[1]), sys.stdin, sys.stdout)
