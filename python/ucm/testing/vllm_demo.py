"""The main job: vLLM with UCMConnector skips the prefill of a prompt it has seen,
even after a restart.

Makes a small random-weight Llama locally, starts vLLM (the CPU build, or a
GPU build where one is installed) with ``UCMConnector`` on its embedded
default store (``Cache|Posix``, ``Posix`` without a Cache stage) under a local
directory, sends a long prompt, restarts the engine (a new process: vLLM's
own in-memory prefix cache is gone), sends the prompt again and prints the
cold and warm time to first token and the hit rate::

    python -m ucm.testing.vllm_demo [--tokens 2048] [--dir .ucm-demo/vllm]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

from ucm.testing.harness import EngineProcess, engine_env
from ucm.testing.tiny_model import TinyModelSpec, make_tiny_llama

DEMO_SPEC = TinyModelSpec(
    layers=8, hidden=512, heads=8, kv_heads=4, intermediate=1408, vocab=512, max_positions=16384
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048, help="prompt length")
    ap.add_argument("--dir", type=Path, default=Path(".ucm-demo/vllm"), help="work directory")
    ap.add_argument("--layerwise", action="store_true", help="layer-wise transfers")
    args = ap.parse_args(argv)

    import vllm

    from ucm.integration.vllm.config import default_store_config

    work = args.dir.resolve()
    store = work / "store"
    store.mkdir(parents=True, exist_ok=True)
    pipeline = default_store_config()["store_pipeline"]
    print(f"UCM main job: vLLM {vllm.__version__} + UCMConnector ({pipeline} store at {store})")
    t = time.time()
    model = make_tiny_llama(work / "model", DEMO_SPEC)
    s = DEMO_SPEC
    print(
        f"model: random-weight Llama, {s.layers} layers, hidden {s.hidden}, "
        f"{s.kv_heads} KV heads of {s.head_dim}, float32 ({time.time() - t:.0f}s to make)"
    )
    max_len = args.tokens + 64
    config = {
        "model": str(model),
        "ucm": {"storage_backends": str(store), "use_layerwise": args.layerwise},
        "llm": {
            "max_model_len": max_len,
            "max_num_batched_tokens": max(2048, max_len),
            "kv_cache_memory_bytes": 2 * max_len * 2 * s.kv_heads * s.head_dim * 4 * s.layers,
        },
    }
    # A prompt no earlier run stored: the first engine really computes it.
    rng = random.Random(time.time_ns())
    prompt = [rng.randrange(4, s.vocab) for _ in range(args.tokens)]
    warmup = [rng.randrange(4, s.vocab) for _ in range(64)]
    print(f"prompt: {len(prompt)} tokens")

    def stored() -> int:
        return sum(1 for f in store.glob("??/*") if len(f.name) == 32)

    before = stored()
    results = []
    for run, label in enumerate(("cold", "warm")):
        t = time.time()
        e = EngineProcess(config, work / f"engine-{run + 1}.log", env=engine_env(), cwd=work)
        up = time.time() - t
        e.ttft(warmup)  # first-call costs off the measurement
        ttft, cached = e.ttft(prompt)
        m = e.metrics()
        e.close()  # the restart: saves are flushed, the process exits
        results.append((ttft, cached))
        what = "nothing stored yet" if run == 0 else "restarted: a new process"
        print(f"{label:>4} (engine {run + 1}, {what}, up in {up:.0f}s): TTFT {ttft:.3f} s", end="")
        if run == 0:
            print(f", {stored() - before} blocks saved")
        else:
            rate = m.get("ucm_lookup_hit_rate", 0.0)
            print(
                f", {cached}/{len(prompt)} prompt tokens loaded from UCM "
                f"(hit rate {rate * 100:.1f} %)"
            )
    (cold, _), (warm, cached) = results
    print(
        f"time to first token: cold {cold:.3f} s, warm {warm:.3f} s "
        f"({cold / warm:.1f}x faster); hit rate {cached / len(prompt) * 100:.1f} %"
    )
    if cached == 0:
        print("no hit: see the engine logs in", work, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
