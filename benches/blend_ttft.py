"""Cache Blend: time to first token and output divergence, full prefill vs blend.

Prompts are ``n`` RAG chunks of ``--chunk-tokens`` tokens (each ending with
the chunk-end token, i.e. the original UCM protocol) plus a question. The
chunk caches are built first by serving every chunk alone (BUILD_CHUNK_CACHE
requests). Then, for every chunk count in ``--chunks`` and every ratio in
``--ratios``, a prompt of randomly drawn chunks is served

* ``full``: an ordinary prefill of all tokens (no store);
* ``blend r``: Blend with ``blend_recompute_ratio = r`` (plan, load the chunk
  blocks, delta-RoPE, full prefill of the layers before the check layer,
  HKVD selection, shrunk prefill after it);

and, as ablations at the default ratio, ``random-sel`` (the same number of
recomputed tokens chosen at random instead of by key deviation) and
``no-delta`` (ratio 0 without moving the loaded keys: naive reuse).

Reported per row: TTFT (median of ``--repeat`` runs; load/rotation/selection
included for blend), speedup over full, rows computed after the check layer,
``work``: the share of full prefill's per-layer row work that the blend
does, ``(c * Q + (L - c) * K) / (L * T)`` for ``Q`` query rows, ``K`` rows
kept after check layer ``c`` of ``L`` and ``T`` prompt tokens (projections
and MLP scale with it; deterministic, unlike wall time on a shared machine),
and the divergence from full prefill: KL(full || blend) of the first token's
distribution, top-1 agreement, and the share of ``--decode`` greedy tokens
that match full prefill's continuation.

Backends (``--backend``):

* ``ref`` (default, runs anywhere): the torch reference stack
  :mod:`support.refmodel` (vLLM's CPU KV layout, random weights,
  ``--impl torch`` or ``triton``/``auto`` on a GPU);
* ``vllm`` (``--vllm``): real vLLM engines (CPU build here; any build with
  ``enforce_eager``, prefix caching off) on a random-weight Llama of the
  same shape written by :mod:`ucm.vllm_demo.tiny_model`, one engine
  per process (:mod:`support.vllm_child`). The reference outputs
  come from vLLM without a connector; an engine with the UCM connector fills
  a Posix store by serving every pool chunk alone. Then one engine per ratio
  with ``ucm_sparse_config: {Blend: {blend_recompute_ratio: r}}``
  (``kv_consumer``: nothing is saved while timing) alternates ``full`` --
  the prompt with its first token changed and an empty chunk list, so
  nothing is found in the store: a prefill of every token -- and ``blend r``
  in the same process, so a busy machine slows both alike. TTFT is the
  wall time of a ``generate`` with ``max_tokens=1`` (median of
  ``--repeat``, after one untimed call of each; the blend includes the
  store lookup, the chunk loads and delta-RoPE); ``CPU ms`` is the engine
  process's CPU time for the same call (median). ``rows@chk`` and ``work``
  come from the worker's own counters; divergence is computed from the
  first token's full distribution (all ``--vocab`` log probabilities) and
  the greedy continuation of ``--decode`` tokens.

Usage: ``python benches/blend_ttft.py [--chunks 4 8] [--quick] [--vllm] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python" / "tests"))

from support import refmodel as rm

from ucm.sparse.base import SparseModelInfo, UcmSparseRole
from ucm.sparse.blend import Blend, BlendConfig
from ucm.sparse.kernels import keys
from ucm.vllm_demo.tiny_model import TinyModelSpec

END = 3  # chunk-end token (the tiny vocab's <pad>)


def make_chunks(n: int, tokens: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        c = [rng.randrange(4, vocab) for _ in range(tokens)]
        c[-1] = END
        out.append(c)
    return out


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    lp, lq = p_logits.log_softmax(-1), q_logits.log_softmax(-1)
    return float((lp.exp() * (lp - lq)).sum())


def work(res: rm.PrefillResult, layers: int, check: int, tokens: int) -> float:
    """Share of full prefill's row-layer work done by a (blended) prefill."""
    kept = min(res.selected.values()) if res.selected else res.computed_rows
    return (check * res.computed_rows + (layers - check) * kept) / (layers * tokens)


S = TypeVar("S", bound=TinyModelSpec)


def model_spec(args: argparse.Namespace, spec_cls: type[S], **extra: Any) -> S:
    """The model the options describe, for either backend's model class."""
    return spec_cls(
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        intermediate=2 * args.hidden,
        vocab=args.vocab,
        seed=args.seed,
        **extra,
    )


def run(args: argparse.Namespace) -> list[dict]:
    torch.manual_seed(args.seed)
    spec = model_spec(
        args,
        rm.TinyLlamaSpec,
        max_positions=max(8192, (max(args.chunks) + 1) * args.chunk_tokens + 512),
    )
    model = rm.TinyLlama(spec)
    b = args.block_size
    tokens_max = max(args.chunks) * args.chunk_tokens + args.question + args.decode
    blocks = 2 * (tokens_max // b + 2) + args.pool * args.chunk_tokens // b
    info = SparseModelInfo(
        block_size=b,
        num_layers=spec.layers,
        num_heads=spec.heads,
        num_kv_heads=spec.kv_heads,
        head_dim=spec.head_dim,
    )

    def make_blend(ratio: float) -> tuple[Blend, rm.PagedKV]:
        cfg = BlendConfig(
            blend_recompute_ratio=ratio,
            blend_check_layers=[args.check_layer],
            chunk_end_token_id=END,
            min_blend_hit_blocks=4,
        )
        blend = Blend(info, UcmSparseRole.WORKER, cfg)
        blend.impl = args.impl
        cache = rm.PagedKV(spec, blocks, b)
        blend.initialize_kv_cache_tensors(cache.kv)
        blend.set_rotary(model.cos_sin_cache, spec.is_neox)
        return blend, cache

    # Chunk caches: every chunk of the pool served alone once.
    pool = make_chunks(args.pool, args.chunk_tokens, spec.vocab, args.seed + 1)
    store = rm.DictStore()
    blend0, cache0 = make_blend(args.ratios[0])
    t0 = time.perf_counter()
    for c in pool:
        r = rm.serve_prefill(model, cache0, store, c, blend=blend0, impl=args.impl)
        cache0.free(r.seq.blocks)
    print(
        f"built {len(pool)} chunk caches ({len(store.blocks)} blocks) in "
        f"{time.perf_counter() - t0:.1f} s",
        file=sys.stderr,
    )

    # warm-up (allocator, first-call overheads) before anything is timed
    rm.full_prefill(model, rm.PagedKV(spec, blocks, b), pool[0] + pool[1], impl=args.impl)
    rows = []
    rng = random.Random(args.seed + 2)
    for n in args.chunks:
        picked = rng.sample(range(len(pool)), n)
        question = [rng.randrange(4, spec.vocab) for _ in range(args.question)]
        prompt = [t for i in picked for t in pool[i]] + question
        times, ref = [], None
        for _ in range(args.repeat):
            cache = rm.PagedKV(spec, blocks, b)
            t0 = time.perf_counter()
            ref = rm.full_prefill(model, cache, prompt, impl=args.impl)
            times.append(time.perf_counter() - t0)
        full_t = statistics.median(times)
        ref_cont = rm.decode(model, cache, ref.seq, ref.logits, args.decode, impl=args.impl)
        rows.append(
            {
                "chunks": n,
                "tokens": len(prompt),
                "variant": "full",
                "ratio": None,
                "ttft_s": full_t,
                "speedup": 1.0,
                "rows_after_check": len(prompt),
                "work": 1.0,
                "kl": 0.0,
                "top1": True,
                "cont_match": 1.0,
            }
        )

        variants = [(f"blend r={r:g}", r, True, False) for r in args.ratios]
        variants += [("random-sel r=0.15", 0.15, True, True), ("no-delta r=0", 0.0, False, False)]
        for name, ratio, delta, random_sel in variants:
            times, res, cache = [], None, None
            for _ in range(args.repeat):
                blend, cache = make_blend(ratio)
                orig = keys.kv_deviation
                if random_sel:
                    keys.kv_deviation = lambda kc, s, kf, impl="auto": torch.rand(kf.shape[0])
                try:
                    t0 = time.perf_counter()
                    res = rm.serve_prefill(
                        model, cache, store, prompt, blend=blend, delta_rope=delta, impl=args.impl
                    )
                    times.append(time.perf_counter() - t0)
                finally:
                    keys.kv_deviation = orig
            assert res is not None and cache is not None
            cont = rm.decode(model, cache, res.seq, res.logits, args.decode, impl=args.impl)
            t = statistics.median(times)
            rows.append(
                {
                    "chunks": n,
                    "tokens": len(prompt),
                    "variant": name,
                    "ratio": ratio,
                    "mode": res.plan.mode.value,
                    "ttft_s": t,
                    "speedup": full_t / t,
                    "rows_after_check": min(res.selected.values()) if res.selected else None,
                    "work": work(res, spec.layers, args.check_layer, len(prompt)),
                    "kl": kl(ref.logits, res.logits),
                    "top1": int(res.logits.argmax()) == int(ref.logits.argmax()),
                    "cont_match": sum(a == c for a, c in zip(cont, ref_cont, strict=True))
                    / max(1, args.decode),
                }
            )
    return rows


def _dist(first_logprobs: dict[str, float], vocab: int) -> torch.Tensor:
    lp = torch.full((vocab,), -1e9, dtype=torch.float64)
    for t, v in first_logprobs.items():
        lp[int(t)] = v
    return lp


def run_vllm(args: argparse.Namespace) -> list[dict]:
    """The ``vllm`` backend (see the module doc)."""
    import tempfile

    from support.vllm_child import run_child

    from ucm.vllm_demo.tiny_model import make_tiny_llama

    work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="ucm-blend-bench-"))
    spec = model_spec(args, TinyModelSpec)
    model = str(make_tiny_llama(work_dir / "model", spec))
    pool = make_chunks(args.pool, args.chunk_tokens, args.vocab, args.seed + 1)
    rng = random.Random(args.seed + 2)
    prompts = {}
    for n in args.chunks:
        picked = rng.sample(range(len(pool)), n)
        question = [rng.randrange(4, args.vocab) for _ in range(args.question)]
        prompts[n] = [t for i in picked for t in pool[i]] + question
    max_len = max(len(p) for p in prompts.values()) + args.decode + 64
    llm = {
        "max_model_len": max_len,
        "max_num_batched_tokens": max_len,
        "max_logprobs": args.vocab,
        "kv_cache_memory_bytes": 512 << 20,
    }
    store = {"storage_backends": str(work_dir / "store"), "store_pipeline": "Posix"}
    warmup = {"name": "warmup", "prompts": [pool[0][: args.chunk_tokens // 2]], "max_tokens": 1}

    def dec_ops() -> list[dict]:
        return [
            {"name": f"dec{n}", "prompts": [p], "max_tokens": args.decode, "logprobs": args.vocab}
            for n, p in prompts.items()
        ]

    # 1. The reference outputs: vLLM without a connector (full prefill).
    t0 = time.perf_counter()
    ref = run_child({"model": model, "ucm": None, "llm": llm, "ops": dec_ops()}, work_dir)
    # 2. The chunk caches: every pool chunk served alone (nothing else is
    #    saved: a saved prompt would be a plain prefix hit later).
    run_child(
        {
            "model": model,
            "ucm": store,
            "llm": llm,
            "ops": [{"name": "build", "prompts": pool, "max_tokens": 1}],
        },
        work_dir,
    )
    print(f"reference and build engines done in {time.perf_counter() - t0:.0f} s", file=sys.stderr)

    # 3. Per ratio, one engine that only loads (kv_consumer: nothing is saved
    #    while timing). Full prefill ("full") and blend alternate in the same
    #    process, so a busy machine slows both alike: "full" is the prompt
    #    with its first token changed (no chained prefix hit) and an empty
    #    chunk list (no chunk hit), i.e. a prefill of every token.
    results = {}
    for ratio in args.ratios:
        ucm = dict(store)
        ucm["ucm_sparse_config"] = {
            "Blend": {
                "blend_recompute_ratio": ratio,
                "blend_check_layers": [args.check_layer],
                "chunk_end_token_id": END,
                "min_blend_hit_blocks": 4,
            }
        }
        ops = [warmup]
        for n, p in prompts.items():
            full_p = [(p[0] + 1 - 4) % (args.vocab - 4) + 4, *p[1:]]
            for i in range(-1, args.repeat):  # -1: untimed, first call at these shapes
                ops.append(
                    {
                        "name": f"full{n}.{i}",
                        "prompts": [full_p],
                        "params": [{"ucm_blend_chunks": []}],
                        "max_tokens": 1,
                    }
                )
                ops.append({"name": f"blend{n}.{i}", "prompts": [p], "max_tokens": 1})
        t0 = time.perf_counter()
        results[ratio] = run_child(
            {
                "model": model,
                "ucm": ucm,
                "kv_role": "kv_consumer",
                "llm": llm,
                "ops": ops + dec_ops(),
            },
            work_dir,
        )
        print(f"blend r={ratio:g} engine done in {time.perf_counter() - t0:.0f} s", file=sys.stderr)

    def runs(res: dict, prefix: str, key: str) -> list[float]:
        return [res[f"{prefix}.{i}"][key][0] for i in range(args.repeat)]

    def med(res: dict, prefix: str, key: str) -> float:
        return statistics.median(runs(res, prefix, key))

    rows = []
    for n, p in prompts.items():
        f_dec = ref[f"dec{n}"]
        f_lp = _dist(f_dec["first_logprobs"][0], args.vocab)
        for ratio, res in results.items():
            f_t, f_cpu = med(res, f"full{n}", "seconds"), med(res, f"full{n}", "cpu_seconds")
            assert not res[f"full{n}.0"]["steps"], "the full-prefill variant was blended"
            rows.append(
                {
                    "chunks": n,
                    "tokens": len(p),
                    "variant": f"full (r={ratio:g} eng.)",
                    "ratio": None,
                    "ttft_s": f_t,
                    "ttft_runs_s": runs(res, f"full{n}", "seconds"),
                    "cpu_s": f_cpu,
                    "cpu_speedup": 1.0,
                    "speedup": 1.0,
                    "rows_after_check": len(p),
                    "work": 1.0,
                    "kl": 0.0,
                    "top1": True,
                    "cont_match": 1.0,
                }
            )
            t, cpu = med(res, f"blend{n}", "seconds"), med(res, f"blend{n}", "cpu_seconds")
            dec = res[f"dec{n}"]
            last = res[f"blend{n}.{args.repeat - 1}"]
            steps = last["steps"]
            q_rows = steps[-1]["rows"] if steps else len(p)
            kept = min(steps[-1]["kept"].values()) if steps else q_rows
            c, layers = args.check_layer, args.layers
            lp = _dist(dec["first_logprobs"][0], args.vocab)
            rows.append(
                {
                    "chunks": n,
                    "tokens": len(p),
                    "variant": f"blend r={ratio:g}",
                    "ratio": ratio,
                    "mode": "blend" if steps else "prefix",
                    "ttft_s": t,
                    "ttft_runs_s": runs(res, f"blend{n}", "seconds"),
                    "cpu_s": cpu,
                    "cpu_speedup": f_cpu / cpu,
                    "speedup": f_t / t,
                    "rows_after_check": kept,
                    "work": (c * q_rows + (layers - c) * kept) / (layers * len(p)),
                    "kl": float((f_lp.exp() * (f_lp - lp)).sum()),
                    "top1": dec["tokens"][0][0] == f_dec["tokens"][0][0],
                    "cont_match": sum(
                        a == b for a, b in zip(dec["tokens"][0], f_dec["tokens"][0], strict=True)
                    )
                    / max(1, args.decode),
                    "chunk_blocks_loaded": last["stats"].get("chunk_blocks_loaded", 0),
                }
            )
    return rows


# The result table: (title, alignment, width, the cell of a row); the vLLM
# backend adds its wall-clock and CPU-time columns after the speedup.
Column = tuple[str, str, int, Callable[[dict[str, Any]], str]]
COLUMNS: list[Column] = [
    ("chunks", ">", 6, lambda r: str(r["chunks"])),
    ("tokens", ">", 6, lambda r: str(r["tokens"])),
    ("variant", "<", 19, lambda r: str(r["variant"])),
    ("TTFT ms", ">", 9, lambda r: f"{1e3 * r['ttft_s']:.1f}"),
    ("speedup", ">", 7, lambda r: f"{r['speedup']:.2f}"),
    (
        "rows@chk",
        ">",
        8,
        lambda r: "-" if r["rows_after_check"] is None else str(r["rows_after_check"]),
    ),
    ("work", ">", 5, lambda r: f"{r['work']:.2f}"),
    ("KL", ">", 9, lambda r: f"{r['kl']:.2e}"),
    ("top1", ">", 5, lambda r: str(r["top1"])),
    ("cont", ">", 5, lambda r: f"{r['cont_match']:.2f}"),
]
VLLM_COLUMNS: list[Column] = [
    ("min ms", ">", 8, lambda r: f"{1e3 * min(r['ttft_runs_s']):.1f}"),
    ("CPU ms", ">", 8, lambda r: f"{1e3 * r['cpu_s']:.1f}"),
    ("CPU x", ">", 6, lambda r: f"{r['cpu_speedup']:.2f}"),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=["ref", "vllm"], default="ref")
    ap.add_argument("--vllm", action="store_true", help="same as --backend vllm")
    ap.add_argument(
        "--work-dir", type=lambda p: Path(p).absolute(), help="vllm: model and store directory"
    )
    ap.add_argument("--chunks", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--chunk-tokens", type=int, default=512)
    ap.add_argument("--question", type=int, default=64)
    ap.add_argument("--pool", type=int, default=10, help="distinct chunks cached")
    ap.add_argument(
        "--ratios",
        type=float,
        nargs="+",
        help="default: 1 0.5 0.15 0.05 (ref), 1 0.15 (vllm: one engine per ratio)",
    )
    ap.add_argument("--check-layer", type=int, default=1)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--impl", choices=["torch", "triton", "auto"], default="torch")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="2-4 chunks of 128 tokens, 4 layers")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.vllm:
        args.backend = "vllm"
    if args.quick:
        args.chunks, args.chunk_tokens, args.layers, args.hidden = [2, 4], 128, 4, 128
        args.heads, args.pool, args.repeat, args.decode = 4, 6, 1, 8
    if args.ratios is None:
        args.ratios = [1.0, 0.15] if args.backend == "vllm" else [1.0, 0.5, 0.15, 0.05]
    vllm = args.backend == "vllm"
    rows = run_vllm(args) if vllm else run(args)
    columns = COLUMNS[:5] + VLLM_COLUMNS + COLUMNS[5:] if vllm else COLUMNS
    print(" ".join(f"{title:{align}{width}}" for title, align, width, _ in columns))
    for r in rows:
        print(" ".join(f"{cell(r):{align}{width}}" for _, align, width, cell in columns))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
