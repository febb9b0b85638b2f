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
  :mod:`ucm.sparse.blend.refmodel` (vLLM's CPU KV layout, random weights,
  ``--impl torch`` or ``triton``/``auto`` on a GPU);
* ``vllm``: placeholder for the vLLM run once the Blend connector exists
  (prints what it would need and exits 2).

Usage: ``python benches/blend_ttft.py [--chunks 4 8] [--quick] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

from ucm.sparse.base import SparseModelInfo, UcmSparseRole
from ucm.sparse.blend import Blend, BlendConfig
from ucm.sparse.blend import ops as blend_ops
from ucm.sparse.blend import refmodel as rm

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


def run(args: argparse.Namespace) -> list[dict]:
    torch.manual_seed(args.seed)
    spec = rm.TinyLlamaSpec(
        vocab=args.vocab,
        hidden=args.hidden,
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.kv_heads,
        intermediate=2 * args.hidden,
        seed=args.seed,
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
        head_dim=spec.d,
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
                orig = blend_ops.kv_deviation
                if random_sel:
                    blend_ops.kv_deviation = lambda kc, s, kf, impl="auto": torch.rand(kf.shape[0])
                try:
                    t0 = time.perf_counter()
                    res = rm.serve_prefill(
                        model, cache, store, prompt, blend=blend, delta_rope=delta, impl=args.impl
                    )
                    times.append(time.perf_counter() - t0)
                finally:
                    blend_ops.kv_deviation = orig
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=["ref", "vllm"], default="ref")
    ap.add_argument("--chunks", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--chunk-tokens", type=int, default=512)
    ap.add_argument("--question", type=int, default=64)
    ap.add_argument("--pool", type=int, default=10, help="distinct chunks cached")
    ap.add_argument("--ratios", type=float, nargs="+", default=[1.0, 0.5, 0.15, 0.05])
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
    if args.backend == "vllm":
        print(
            "the vLLM backend needs the Blend connector (ucm/integration/vllm) and the "
            "decoder-layer hooks; see ucm.sparse.blend for the plan",
            file=sys.stderr,
        )
        return 2
    if args.quick:
        args.chunks, args.chunk_tokens, args.layers, args.hidden = [2, 4], 128, 4, 128
        args.heads, args.pool, args.repeat, args.decode = 4, 6, 1, 8
    rows = run(args)
    hdr = (
        f"{'chunks':>6} {'tokens':>6} {'variant':<18} {'TTFT ms':>9} {'speedup':>7} "
        f"{'rows@chk':>8} {'work':>5} {'KL':>9} {'top1':>5} {'cont':>5}"
    )
    print(hdr)
    for r in rows:
        rc = "-" if r["rows_after_check"] is None else str(r["rows_after_check"])
        print(
            f"{r['chunks']:>6} {r['tokens']:>6} {r['variant']:<18} {1e3 * r['ttft_s']:>9.1f} "
            f"{r['speedup']:>7.2f} {rc:>8} {r['work']:>5.2f} {r['kl']:>9.2e} {r['top1']!s:>5} "
            f"{r['cont_match']:>5.2f}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
