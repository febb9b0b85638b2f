"""One vLLM engine for the Blend tests and ``benches/blend_ttft.py --vllm``, in a child process.

Usage: ``python python/tests/support/vllm_child.py SPEC`` (JSON text, or a JSON
file: prompts can exceed the argument limit). The spec holds ``model`` (a
checkpoint directory), ``ucm`` (the connector's ``kv_connector_extra_config``;
null: no connector), ``kv_role`` (default ``kv_both``), ``llm`` (more
``vllm.LLM`` arguments) and ``ops``: a list of ``{"name", "prompts":
[[ids]...], "params": [kv_transfer_params or null ...], "max_tokens",
"logprobs", "repeat", "blend_native_runs"}`` run in order, ``repeat``
(default 1) ``generate`` calls each (``blend_native_runs`` sets
:attr:`BlendWorker.native_runs` from then on). Prints one JSON line
prefixed with ``@@RESULT@@``: per op the greedy tokens, the first token's
top ``logprobs`` log probabilities, the wall and CPU (whole process)
seconds of every call, and what Blend counted during the last one
(:data:`ucm.integration.vllm.sparse.blend.STATS`, ``STEP_LOG``). The engine
core and the worker run in this process, so the counters of both connector
halves are visible here.

Test and benchmark tooling (the tests' ``support`` package), not product API.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def main() -> None:
    """The child: set up the environment before vLLM is imported, run the ops."""
    from ucm.vllm_demo.engine_process import prepare_engine_child

    prepare_engine_child()
    arg = sys.argv[1]
    spec = json.loads(Path(arg).read_text() if not arg.lstrip().startswith("{") else arg)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from ucm.integration.vllm.sparse import blend as vi
    from ucm.vllm_demo.engine_process import CONNECTOR

    kwargs = dict(
        model=spec["model"],
        dtype="float32",
        enforce_eager=True,
        block_size=32,
        max_model_len=8192,
        kv_cache_memory_bytes=128 << 20,
        enable_prefix_caching=False,
        seed=0,
    )
    kwargs.update(spec.get("llm") or {})
    if spec.get("ucm") is not None:
        conn = dict(CONNECTOR, kv_role=spec.get("kv_role", CONNECTOR["kv_role"]))
        kwargs["kv_transfer_config"] = KVTransferConfig(
            **conn, kv_connector_extra_config=spec["ucm"]
        )
    llm = LLM(**kwargs)
    results = []
    for op in spec["ops"]:
        if "blend_native_runs" in op:
            # the worker's BlendWorker (same process): vLLM's CPU kernel on runs
            # of kept rows, or Blend.sparse_attention (the path of other backends)
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            get_kv_transfer_group().sparse.patch.native_runs = bool(op["blend_native_runs"])
        params = op.get("params") or [None] * len(op["prompts"])
        sps = [
            SamplingParams(
                temperature=0,
                max_tokens=op.get("max_tokens", 8),
                ignore_eos=True,
                logprobs=op.get("logprobs", 1),
                extra_args={"kv_transfer_params": p} if p else None,
            )
            for p in params
        ]
        seconds, cpu_seconds = [], []
        for _ in range(op.get("repeat", 1)):
            before = dict(vi.STATS)
            n_steps = len(vi.STEP_LOG)
            t0, c0 = time.perf_counter(), time.process_time()
            outs = llm.generate(
                [TokensPrompt(prompt_token_ids=p) for p in op["prompts"]], sps, use_tqdm=False
            )
            seconds.append(time.perf_counter() - t0)
            cpu_seconds.append(time.process_time() - c0)
        stats = {k: v - before.get(k, 0) for k, v in vi.STATS.items() if v != before.get(k, 0)}
        results.append(
            {
                "name": op["name"],
                "tokens": [list(o.outputs[0].token_ids) for o in outs],
                "first_logprobs": [
                    {str(t): lp.logprob for t, lp in o.outputs[0].logprobs[0].items()} for o in outs
                ],
                "seconds": seconds,
                "cpu_seconds": cpu_seconds,
                "stats": stats,
                "steps": vi.STEP_LOG[n_steps:],
            }
        )
    print("@@RESULT@@ " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()


def run_child(spec: dict[str, Any], cwd: str | Path, timeout: float = 1800) -> dict[str, Any]:
    """Runs this module on ``spec`` in a new process; returns its ops by name.

    The child gets an offline environment with ``python/`` importable and no
    stray ``UCM_*`` settings (:func:`ucm.vllm_demo.engine_process.engine_env`).
    """
    import subprocess

    from ucm.vllm_demo.engine_process import engine_env

    env = engine_env()
    env.pop("TRITON_INTERPRET", None)
    spec_file = Path(cwd) / f"blend-child-{os.getpid()}-{time.monotonic_ns()}.json"
    spec_file.write_text(json.dumps(spec))  # prompts can exceed the argument limit
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), str(spec_file)],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(cwd),
        timeout=timeout,
    )
    spec_file.unlink(missing_ok=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("@@RESULT@@ ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM child failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return {r["name"]: r for r in json.loads(lines[-1].split(" ", 1)[1])}
