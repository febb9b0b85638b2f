"""Answer quality on a real model: sparse attention, Cache Blend and ReRoPE
against their dense baselines, on vLLM (CPU or GPU build).

The model is SmolLM2-135M-Instruct (``ucm model fetch``), float32, greedy.
The texts are made from a seed (``ucm.vllm_demo.corpus``): no data set.

* **Needles** (pass-key retrieval): a haystack of filler prose of 2k, 4k and
  7.5k tokens with one pass key hidden at a depth spread evenly over the
  text (``--needles`` per length), then the question and the start of the
  answer. Dense, then ESA, KVStar and GSA at each ``--ratios``. The dense
  engine computes every prompt (prefix caching on: a length's prompts
  share their filler) and saves it to a store that the sparse engines load
  it from (prefix caching off: the sparse methods act in decode, and a
  request releases only blocks no other request shares). Reported: accuracy (the five digits
  exactly), median per-request decode tokens/s (every request of a length
  decodes together), device KV blocks held per request during decode
  (mean; dense: the request's whole block list).
* **RAG**: ``--rag`` questions, each over 4 to 8 short documents about
  invented landmarks (each padded to whole blocks), asking one fact of one
  of them. Full prefill (no connector), then Blend at each
  ``--blend-ratios``, and plain chunk reuse (Blend at ratio 0: the chunks'
  stored KV moved to their positions, nothing but the question
  recomputed). The chunk caches are built first by serving every document
  alone. Reported: accuracy (the answer starts with the fact), first-token
  KL divergence from the full prefill (over the full prefill's top 20
  tokens; a token missing from the other run's top 20 gets its 20th log
  probability), median TTFT (one request at a time).
* **ReRoPE**: the model's ``max_position_embeddings`` lowered to 2048, then
  needles at 4k and 7.5k tokens served past it (``--rerope-needles`` of the
  needle part's prompts at those lengths, depths spread), without and with
  ReRoPE (``rerope_window`` 512, ``training_length`` 2048). SmolLM2 was
  trained to 8,192 positions, so "without" is plain RoPE inside its real
  range: the dense model of the needle part. When that part ran in the same
  invocation, its dense answers to the same prompts are the "without" row;
  otherwise an engine of its own computes them.

Every table repeats its baseline from the same run and gives its sample
counts. Usage::

    python benches/quality.py            # 20 needles per length, 24 RAG questions, 8 ReRoPE needles
    python benches/quality.py --quick    # 4 needles per length, 10 RAG questions, 3 ReRoPE needles
    python benches/quality.py --only needles --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python" / "tests"))

from support.forker import EngineForker

from ucm.models import ModelUnavailable, ensure, load_tokenizer
from ucm.vllm_demo.corpus import (
    ChatPrompt,
    Record,
    answer_digits,
    first_fact_is,
    landmark_sentences,
    make_haystack,
    make_records,
    rag_prompt,
    record_facts,
)
from ucm.vllm_demo.engine_process import EngineProcess, engine_env

BLOCK = 32
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # layers x K/V x KV heads x head dim x fp32
LOGPROBS = 20


class Bench:
    """The run's model and work directory; engines forked from one process
    that imported vLLM once (16 engines would spend minutes importing it)."""

    def __init__(self, model: Path, work: Path, verbose: bool) -> None:
        self.model, self.work, self.verbose = model, work, verbose
        self.forker = EngineForker(engine_env(), work / "forker.log")

    def close(self) -> None:
        self.forker.close()

    def engine(self, name: str, ucm: dict[str, Any] | None, **llm: Any) -> EngineProcess:
        t = time.time()
        cfg: dict[str, Any] = {"model": str(llm.pop("model", self.model)), "ucm": ucm, "llm": llm}
        e = EngineProcess(cfg, self.work / f"{name}.log", cwd=self.work, forker=self.forker)
        self.log(f"{name}: up in {time.time() - t:.0f}s")
        return e

    def log(self, msg: str) -> None:
        if self.verbose:
            print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------ needles


def needle_set(
    tok: Any, lengths: list[int], n: int, seed: int
) -> dict[int, list[tuple[list[int], str]]]:
    """Per length, ``n`` (prompt, key) pairs, needles at evenly spread depths;
    a length's prompts share their filler."""
    out: dict[int, list[tuple[list[int], str]]] = {}
    for length in lengths:
        rng = random.Random(seed * 1000 + length)
        items = []
        for i in range(n):
            depth = 0.05 + 0.9 * i / max(1, n - 1)
            hay = make_haystack(tok, length, [depth], rng, filler_seed=seed + length)
            items.append((hay.prompts()[0], hay.needles[0].key))
        out[length] = items
    return out


def _blocks(tokens: int) -> int:
    return -(-tokens // BLOCK)


SPARSE_METHODS = ("ESA", "KVStar", "GSA")
# A needle's answer is a space and five digits (one token each); the two
# tokens after them show whether the number goes on (then it is wrong).
NEEDLE_DECODE = 8


def run_needles(
    b: Bench,
    sets: dict[int, list[tuple[list[int], str]]],
    ratios: list[float],
    decode: int,
    methods: tuple[str, ...] = SPARSE_METHODS,
) -> list[dict[str, Any]]:
    store = b.work / "store-needles"
    max_len = max(len(p) for items in sets.values() for p, _ in items) + decode + BLOCK
    llm = {
        "max_model_len": max_len,
        "max_num_batched_tokens": 8192,
        "kv_cache_memory_bytes": 3 << 30,
    }
    configs: list[tuple[str, float | None, dict[str, Any] | None]] = [("dense", None, None)]
    for r in ratios:
        method_config = {
            "ESA": {"sparse_ratio": r, "retrieval_stride": 5},
            "KVStar": {"sparse_ratio": r},
            # Thresholds low enough that every request here is sparse.
            "GSA": {"sparse_ratio": r, "seq_len_threshold": 1024, "concurrency_threshold": 1},
        }
        configs += [(m, r, {m: method_config[m]}) for m in methods]
    rows = []
    for method, ratio, sparse in configs:
        ucm: dict[str, Any] = {"storage_backends": str(store)}
        if sparse:
            ucm["ucm_sparse_config"] = sparse
        # Prefix caching only where the prompts are computed (their filler is
        # shared): a block shared between requests stays on the device, so
        # the sparse engines load every prompt from the store instead.
        e = b.engine(f"needles-{method}-{ratio}", ucm, **llm, enable_prefix_caching=sparse is None)
        try:
            e.generate([[1, 2, 3] * 11], max_tokens=2)  # first-call costs
            e.call(op="sparse")
            for length, items in sets.items():
                prompts = [p for p, _ in items]
                t = time.time()
                out = e.call(op="generate", prompts=prompts, max_tokens=decode)
                fps = e.call(op="sparse")["footprints"]
                right = [
                    answer_digits(x) == k for x, (_, k) in zip(out["text"], items, strict=True)
                ]
                correct = sum(right)
                tps = [x for x in out["decode_tps"] if x]
                held = (
                    statistics.mean(f["max_decode_held"] for f in fps)
                    if fps
                    else statistics.mean(_blocks(len(p) + decode) for p in prompts)
                )
                rows.append(
                    {
                        "method": method,
                        "ratio": ratio,
                        "length": length,
                        "n": len(items),
                        "correct": correct,
                        "decode_tps": statistics.median(tps) if tps else None,
                        "blocks_held": held,
                        "dense_blocks": statistics.mean(_blocks(len(p) + decode) for p in prompts),
                        "offloaded": bool(fps),
                        "loaded_tokens": sum(out["cached"]),
                        "right": right,
                    }
                )
                b.log(
                    f"{method} {ratio} {length}: {correct}/{len(items)} "
                    f"({time.time() - t:.0f}s) e.g. {out['text'][0]!r}"
                )
        finally:
            e.close()
    return rows


# ------------------------------------------------------------------------------ RAG


def _pad(ids: list[int], pad: int) -> list[int]:
    return ids + [pad] * (-len(ids) % BLOCK)


def _document_chunk(tok: Any, doc: Record, rng: random.Random) -> list[int]:
    """A document's tokens filled up to whole blocks (a chunk must be) with
    more prose about the landmark, not with padding tokens: runs of newlines
    between documents confuse a small model more than a few extra sentences."""
    chat = ChatPrompt(tok)
    body, end = chat.ids(doc.text), chat.ids("\n\n")
    prose = chat.ids(" " + " ".join(landmark_sentences(rng, 6)))
    n = len(body) + len(end)
    return body + prose[: -n % BLOCK] + end


def rag_set(tok: Any, n: int, seed: int) -> dict[str, Any]:
    """``n`` questions over 4-8 documents drawn from a pool; every document
    and the instructions padded to whole blocks (a chunk must be)."""
    rng = random.Random(seed)
    pool = make_records(rng, 24, keeper_only=True)
    pad = tok("\n", add_special_tokens=False)["input_ids"][-1]
    chunk_ids = [_document_chunk(tok, r, rng) for r in pool]
    items = []
    for i in range(n):
        k = 4 + i % 5
        pick = rng.sample(range(len(pool)), k)
        target = pool[rng.choice(pick)]
        docs, chunks = [pool[j] for j in pick], [chunk_ids[j] for j in pick]
        p = rag_prompt(tok, docs, target, rng, chunks, fields=("keeper",))
        head = p.chunks[0][0]
        padded_head = _pad(p.tokens[:head], pad)
        shift = len(padded_head) - head
        tokens = padded_head + p.tokens[head:]
        spans = [[s + shift, e + shift] for s, e in p.chunks]
        items.append({"tokens": tokens, "chunks": spans, "expected": p.expected, "k": k})
    return {"chunks": chunk_ids, "items": items, "facts": record_facts(pool)}


def _kl(ref: dict[str, float], other: dict[str, float]) -> float:
    floor = min(other.values())
    return sum(math.exp(lp) * (lp - other.get(t, floor)) for t, lp in ref.items())


def run_rag(b: Bench, rag: dict[str, Any], ratios: list[float], decode: int) -> list[dict]:
    store = b.work / "store-rag"
    max_len = max(len(it["tokens"]) for it in rag["items"]) + decode + BLOCK
    llm = {
        "max_model_len": max_len,
        "max_num_batched_tokens": max(2048, max_len),
        "kv_cache_memory_bytes": 1 << 30,
        # Only UCM's reuse counts: no device prefix hits between questions.
        "enable_prefix_caching": False,
    }
    configs: list[tuple[str, float | None]] = [("full prefill", None)]
    configs += [(f"Blend {r}", r) for r in ratios] + [("chunk reuse", 0.0)]
    rows, ref_lp = [], []
    for ci, (name, ratio) in enumerate(configs):
        ucm = None
        if ratio is not None:
            blend = {"blend_recompute_ratio": ratio, "min_blend_hit_blocks": 4}
            ucm = {"storage_backends": str(store), "ucm_sparse_config": {"Blend": blend}}
        e = b.engine(f"rag-{name.replace(' ', '-')}", ucm, **llm)
        try:
            e.generate([[1, 2, 3] * 11], max_tokens=2)
            if ci == 1:  # the chunk caches, built once: every document served alone
                e.call(op="generate", prompts=rag["chunks"], max_tokens=1)
            e.call(op="sparse")
            correct, kls, ttfts = 0, [], []
            for i, it in enumerate(rag["items"]):
                params = None
                if ratio is not None:
                    # The blended prompt is not saved: the next ratio must blend again.
                    params = [{"ucm_blend_chunks": it["chunks"], "ucm_skip_save": True}]
                out = e.call(
                    op="generate",
                    prompts=[it["tokens"]],
                    params=params,
                    max_tokens=decode,
                    ignore_eos=False,
                    logprobs=LOGPROBS,
                )
                correct += first_fact_is(out["text"][0], it["expected"], rag["facts"])
                ttfts.append(out["ttft"][0] or out["seconds"])
                lp = out["first_logprobs"][0]
                if ratio is None:
                    ref_lp.append(lp)
                else:
                    kls.append(_kl(ref_lp[i], lp))
            stats = e.call(op="sparse")["blend"]
            rows.append(
                {
                    "variant": name,
                    "ratio": ratio,
                    "n": len(rag["items"]),
                    "correct": correct,
                    "kl_mean": statistics.mean(kls) if kls else 0.0,
                    "kl_max": max(kls) if kls else 0.0,
                    "ttft_s": statistics.median(ttfts),
                    "blend_stats": stats,
                }
            )
            b.log(f"{name}: {correct}/{len(rag['items'])} {stats}")
        finally:
            e.close()
    return rows


# ------------------------------------------------------------------------------ ReRoPE

TRAINING = 2048
WINDOW = 512


def short_context_model(b: Bench) -> Path:
    """The model's directory with ``max_position_embeddings`` lowered (weights linked)."""
    out = b.work / "model-2k"
    out.mkdir(exist_ok=True)
    for f in b.model.iterdir():
        if f.name != "config.json" and not (out / f.name).exists():
            (out / f.name).symlink_to(f)
    cfg = json.loads((b.model / "config.json").read_text())
    cfg["max_position_embeddings"] = TRAINING
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def rerope_subset(n_of: int, n: int) -> list[int]:
    """``n`` indices spread evenly over a needle set of ``n_of`` (depths 5 % to 95 %)."""
    if n >= n_of:
        return list(range(n_of))
    return [round(i * (n_of - 1) / max(1, n - 1)) for i in range(n)]


def dense_rights(
    needle_rows: list[dict[str, Any]], length: int, idx: list[int]
) -> list[bool] | None:
    """The needle table's dense answers (right or not) for prompts ``idx`` of ``length``."""
    for r in needle_rows:
        if r["method"] == "dense" and r["length"] == length:
            return [r["right"][i] for i in idx]
    return None


def run_rerope(
    b: Bench,
    sets: dict[int, list[tuple[list[int], str]]],
    decode: int,
    without: dict[int, list[bool]],
) -> list[dict[str, Any]]:
    """``without``: per length, the plain model's answers already measured on
    the same prompts (the needle table's dense run); other lengths get their
    own engine."""
    model = short_context_model(b)
    max_len = max(len(p) for items in sets.values() for p, _ in items) + decode + BLOCK
    llm = {
        "model": model,
        "max_model_len": max_len,
        # The checkpoint says 2048: vLLM is told the longer length explicitly.
        "hf_overrides": {"max_position_embeddings": max_len},
        "max_num_batched_tokens": 8192,
        "kv_cache_memory_bytes": 3 << 30,
        "enable_prefix_caching": True,
    }
    rows = []
    for name, sparse in (
        ("without", None),
        ("ReRoPE", {"ReRoPE": {"rerope_window": WINDOW, "training_length": TRAINING}}),
    ):
        if sparse is None:
            for length, right in without.items():
                rows.append(
                    {
                        "variant": name,
                        "length": length,
                        "n": len(right),
                        "correct": sum(right),
                        "from": "dense needles",
                    }
                )
                b.log(f"rerope {name} {length}: {sum(right)}/{len(right)} (the dense needle run)")
        todo = {n: items for n, items in sets.items() if sparse or n not in without}
        if not todo:
            continue
        ucm: dict[str, Any] = {"storage_backends": str(b.work / f"store-rerope-{name}")}
        if sparse:
            ucm["ucm_sparse_config"] = sparse
        e = b.engine(f"rerope-{name}", ucm, **dict(llm))
        try:
            for length, items in todo.items():
                out = e.call(op="generate", prompts=[p for p, _ in items], max_tokens=decode)
                correct = sum(
                    answer_digits(x) == k for x, (_, k) in zip(out["text"], items, strict=True)
                )
                rows.append(
                    {"variant": name, "length": length, "n": len(items), "correct": correct}
                )
                b.log(f"rerope {name} {length}: {correct}/{len(items)} e.g. {out['text'][0]!r}")
        finally:
            e.close()
    rows.sort(key=lambda r: (r["variant"] != "without", r["length"]))
    return rows


# ------------------------------------------------------------------------------ output


def _pct(c: int, n: int) -> str:
    return f"{c}/{n} ({100 * c / n:.0f} %)"


def print_tables(res: dict[str, Any]) -> None:
    if "needles" in res:
        print("\npass-key retrieval (accuracy; median decode tok/s; device KV blocks held/request)")
        print(
            f"{'method':<8} {'ratio':>5} {'length':>6} {'accuracy':>13} {'tok/s':>7} {'blocks':>13}"
        )
        for r in res["needles"]:
            ratio = "-" if r["ratio"] is None else f"{r['ratio']:.1f}"
            tps = "-" if r["decode_tps"] is None else f"{r['decode_tps']:.1f}"
            held = f"{r['blocks_held']:.0f}/{r['dense_blocks']:.0f}"
            print(
                f"{r['method']:<8} {ratio:>5} {r['length']:>6} "
                f"{_pct(r['correct'], r['n']):>13} {tps:>7} {held:>13}"
            )
    if "rag" in res:
        print("\nRAG over 4-8 documents (accuracy; first-token KL vs full prefill; median TTFT)")
        print(f"{'variant':<13} {'accuracy':>13} {'KL mean':>8} {'KL max':>8} {'TTFT ms':>8}")
        for r in res["rag"]:
            print(
                f"{r['variant']:<13} {_pct(r['correct'], r['n']):>13} {r['kl_mean']:>8.4f} "
                f"{r['kl_max']:>8.4f} {1e3 * r['ttft_s']:>8.1f}"
            )
    if "rerope" in res:
        print(f"\npass-key retrieval past max_position_embeddings = {TRAINING}")
        print(f"{'variant':<8} {'length':>6} {'accuracy':>13}")
        for r in res["rerope"]:
            print(f"{r['variant']:<8} {r['length']:>6} {_pct(r['correct'], r['n']):>13}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few samples per cell")
    ap.add_argument("--only", choices=("needles", "rag", "rerope"), action="append")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 7680])
    ap.add_argument("--needles", type=int, help="needles per length (20; --quick: 4)")
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.1, 0.2, 0.3])
    ap.add_argument("--methods", nargs="+", choices=SPARSE_METHODS, default=list(SPARSE_METHODS))
    ap.add_argument("--rag", type=int, help="RAG questions (24; --quick: 10)")
    ap.add_argument("--blend-ratios", type=float, nargs="+", default=[0.05, 0.15, 0.3])
    ap.add_argument("--rerope-lengths", type=int, nargs="+", default=[4096, 7680])
    ap.add_argument("--rerope-needles", type=int, help="needles per ReRoPE length (8; --quick: 3)")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument(
        "--work",
        type=lambda p: Path(p).absolute(),
        help="work directory (default: a temporary one)",
    )
    ap.add_argument("--json", type=Path, help="write the results here too")
    ap.add_argument("-v", "--verbose", action="store_true", help="progress on stderr")
    args = ap.parse_args(argv)
    # --quick changes the sizes not given explicitly.
    sizes = (4, 10, 3) if args.quick else (20, 24, 8)
    for name, size in zip(("needles", "rag", "rerope_needles"), sizes, strict=True):
        if getattr(args, name) is None:
            setattr(args, name, size)
    parts = args.only or ["needles", "rag", "rerope"]
    try:
        model = ensure()
    except ModelUnavailable as e:
        print(f"the real model is not available: {e}", file=sys.stderr)
        return 2
    tok = load_tokenizer(model)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="ucm-quality-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        b = Bench(model, work, args.verbose)
        res: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}

        def done(part: str, rows: list[dict[str, Any]], t: float) -> None:
            # Each table as soon as it is measured (and saved): a long run
            # stopped later keeps what it finished.
            res[part] = rows
            res[f"{part}_seconds"] = time.time() - t
            print_tables({part: rows})
            print(f"({part}: {res[f'{part}_seconds'] / 60:.1f} min)", flush=True)
            if args.json:
                args.json.write_text(json.dumps(res, indent=2))

        try:
            if "needles" in parts:
                t = time.time()
                sets = needle_set(tok, args.lengths, args.needles, args.seed)
                done(
                    "needles",
                    run_needles(b, sets, args.ratios, NEEDLE_DECODE, tuple(args.methods)),
                    t,
                )
            if "rag" in parts:
                t = time.time()
                rag = rag_set(tok, args.rag, args.seed)
                done("rag", run_rag(b, rag, args.blend_ratios, 12), t)
            if "rerope" in parts:
                t = time.time()
                # The needle table's prompts (a subset): where that table was
                # measured, its dense run is the "without" row.
                full = needle_set(tok, args.rerope_lengths, args.needles, args.seed)
                idx = rerope_subset(args.needles, args.rerope_needles)
                sets = {n: [items[i] for i in idx] for n, items in full.items()}
                without = {}
                for n in sets:
                    right = dense_rights(res.get("needles", []), n, idx)
                    if right is not None:
                        without[n] = right
                done("rerope", run_rerope(b, sets, NEEDLE_DECODE, without), t)
        finally:
            b.close()
    print(f"\ntotal: {(time.time() - t0) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
