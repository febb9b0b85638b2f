"""Selection quality of ESA, GSA and KVStar against dense attention.

For each case (one layer's KV of one sequence plus its last decode queries)
and each method at sparse ratios 0.1, 0.2 and 0.3, the method selects blocks
exactly as its selector does at a retrieval step, and the current (last)
query is scored against dense attention:

* ``kept``: selected blocks / all blocks (windows and forced blocks included);
* ``recall``: share of the true top-attention blocks (by dense attention mass
  of the current query, averaged over heads, same block count as selected)
  that the method selected;
* ``mass``: dense attention mass of the current query on the selected blocks;
* ``rel_err``: ``||o_sparse - o_dense|| / ||o_dense||`` of the attention
  output, ``o_sparse`` computed by the paged decode kernel over the selected
  blocks (torch reference on CPU).

``Oracle`` selects the true top blocks with the same budget as ESA (an upper
bound). Method settings: ESA and KVStar keep the init window (1 block), the
local window (2 blocks) and ``floor``/``ceil(R * ratio)`` middle blocks; ESA
uses the current query (a fresh retrieval); KVStar votes with the last
``retrieval_stride`` (8) queries, channel pruning 0.25, 2-token sub-blocks;
GSA keeps ``ceil(ratio * N)`` blocks (at least sink 1 + recent 4) by min
Hamming distance of 128-bit... ``head_dim``-bit SRP codes.

Case sources (``--source``, repeatable):

* ``planted``: random KV with planted relevant blocks (known ground truth),
  moderate boosts (2-5 logits on a quarter of each block's keys): about
  half of the attention mass stays on the diffuse background;
* ``planted-sharp``: the same with strong boosts (6-8 logits on half of
  each block's keys): attention concentrates on the planted blocks;
* ``random-llama``: q/k/v captured from a small random-weight Llama-style
  decoder in plain torch (:func:`support.synthetic.random_llama_case`);
* ``file:PATH``: a ``torch.save``'d list of dicts with keys ``k``, ``v``,
  ``queries``, ``block_size`` (e.g. captured from vLLM later).

New sources plug in through :data:`SOURCES` (name -> callable returning
:class:`~support.synthetic.SparseCase` objects).

Usage: ``python benches/sparse_quality.py [--source planted] [--quick] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python" / "tests"))

from support.synthetic import SparseCase, planted_case, random_llama_case

from ucm.sparse import SparseModelInfo
from ucm.sparse.esa import ESAConfig, esa_representatives, esa_scores
from ucm.sparse.gsa import SRPHashEncoder, gsa_select
from ucm.sparse.kernels import attention, selection
from ucm.sparse.kernels.dispatch import Impl, triton_usable
from ucm.sparse.kvstar import kvstar_channels, kvstar_representatives, kvstar_scores
from ucm.sparse.offload import make_offload_plan, topk_sorted

RATIOS = (0.1, 0.2, 0.3)
METHODS = ("ESA", "GSA", "KVStar", "Oracle")
N_INIT, N_LOCAL, KVSTAR_STRIDE = 1, 2, 8
IMPL: Impl = "auto"


# ----------------------------------------------------------------------------- sources


def _model(
    block_size: int, kv_heads: int, group: int, head_dim: int, num_layers: int = 1
) -> SparseModelInfo:
    """The geometry of a synthetic case: ``group`` query heads per kv head."""
    return SparseModelInfo(block_size, num_layers, kv_heads * group, kv_heads, head_dim)


def planted_source(quick: bool) -> Iterable[SparseCase]:
    seeds = range(2) if quick else range(6)
    for s in seeds:
        yield planted_case(4096, _model(32, 2, 4, 128), num_relevant=12, seed=s)
        yield planted_case(4096, _model(32, 1, 8, 64), num_relevant=8, seed=100 + s)


def planted_sharp_source(quick: bool) -> Iterable[SparseCase]:
    """Concentrated attention: half of each relevant block boosted by 6-8 logits."""
    seeds = range(2) if quick else range(6)
    for s in seeds:
        yield planted_case(
            4096,
            _model(32, 2, 4, 128),
            num_relevant=12,
            seed=200 + s,
            planted_fraction=0.5,
            boost=(6.0, 8.0),
        )


def random_llama_source(quick: bool) -> Iterable[SparseCase]:
    seeds = range(1) if quick else range(3)
    for s in seeds:
        yield random_llama_case(2048, _model(32, 2, 4, 64, num_layers=2), seed=s)


def file_source(path: str) -> Callable[[bool], Iterable[SparseCase]]:
    def load(quick: bool) -> Iterable[SparseCase]:
        for i, d in enumerate(torch.load(path)):
            yield SparseCase(
                f"{Path(path).stem}-{i}", d["k"], d["v"], d["queries"], int(d["block_size"])
            )

    return load


SOURCES: dict[str, Callable[[bool], Iterable[SparseCase]]] = {
    "planted": planted_source,
    "planted-sharp": planted_sharp_source,
    "random-llama": random_llama_source,
}


# ----------------------------------------------------------------------------- selection


def select_esa(case: SparseCase, ratio: float) -> list[int]:
    plan = make_offload_plan(case.seq_len, case.block_size, N_INIT, N_LOCAL, ratio, 1)
    n = case.num_blocks
    if plan is None:
        return list(range(n))
    kc, _, ids = case.paged()
    tokens = min(ESAConfig().block_repre_tokens, case.block_size)
    reps = esa_representatives(kc, ids[plan.middle_start : plan.middle_end].long(), tokens, IMPL)
    scores = esa_scores(case.queries[-1], reps)
    mid = [plan.middle_start + i for i in topk_sorted(scores, plan.num_selected)]
    return list(range(N_INIT)) + mid + list(range(plan.middle_end, n))


def select_kvstar(case: SparseCase, ratio: float) -> list[int]:
    plan = make_offload_plan(case.seq_len, case.block_size, N_INIT, N_LOCAL, ratio, 1, "ceil")
    n = case.num_blocks
    if plan is None:
        return list(range(n))
    kc, _, ids = case.paged()
    ch = kvstar_channels(kc, ids.long(), case.seq_len, 0.25)
    mids = ids[plan.middle_start : plan.middle_end].long()
    reps = kvstar_representatives(kc, mids, ch, 2, IMPL)
    scale = 1.0 / math.sqrt(case.k.shape[-1])
    votes = kvstar_scores(case.queries[-KVSTAR_STRIDE:], reps, ch, scale, IMPL)
    mid = [plan.middle_start + i for i in topk_sorted(votes, plan.num_selected)]
    return list(range(N_INIT)) + mid + list(range(plan.middle_end, n))


def select_gsa(case: SparseCase, ratio: float) -> list[int]:
    kc, _, ids = case.paged()
    d, h = case.k.shape[-1], case.k.shape[1]
    enc = SRPHashEncoder(d, max(32, d), seed=0, impl=IMPL)
    codes = enc.encode(kc.reshape(-1, h, d)).reshape(*kc.shape[:3], -1)
    qc = enc.encode_query(case.queries[-1:], h)
    keep = torch.tensor([math.ceil(ratio * case.num_blocks)])
    batch = selection.HammingBatch(qc, codes, ids[None], torch.tensor([case.seq_len]))
    _, _, chosen = gsa_select(batch, keep, impl=IMPL)
    return [int(x) for x in chosen[0] if x >= 0]


def block_mass(case: SparseCase) -> torch.Tensor:
    """``[N]`` dense attention mass of the current query per block (head mean)."""
    w = selection.dense_attention_weights(case.queries[-1], case.k)  # [H_q, L]
    pad = case.num_blocks * case.block_size - case.seq_len
    w = torch.nn.functional.pad(w, (0, pad))
    return w.reshape(w.shape[0], case.num_blocks, case.block_size).sum(-1).mean(0)


def select_oracle(case: SparseCase, ratio: float) -> list[int]:
    k = len(select_esa(case, ratio))
    return sorted(torch.topk(block_mass(case), k).indices.tolist())


SELECTORS: dict[str, Callable[[SparseCase, float], list[int]]] = {
    "ESA": select_esa,
    "GSA": select_gsa,
    "KVStar": select_kvstar,
    "Oracle": select_oracle,
}


# ----------------------------------------------------------------------------- metrics


def evaluate(case: SparseCase, selected: list[int]) -> dict[str, float]:
    mass = block_mass(case)
    n = case.num_blocks
    sel = sorted(set(selected))
    true_top = set(torch.topk(mass, len(sel)).indices.tolist())
    kc, vc, ids = case.paged()
    q = case.queries[-1:]
    dense = attention.paged_decode_attention(
        q, kc, vc, ids[None], torch.tensor([case.seq_len]), impl=IMPL
    )
    b = case.block_size
    length = case.seq_len - (n - len(sel)) * b if (n - 1) in sel else len(sel) * b
    table = torch.tensor([sel], dtype=torch.int32)
    sparse = attention.paged_decode_attention(q, kc, vc, table, torch.tensor([length]), impl=IMPL)
    return {
        "kept": len(sel) / n,
        "recall": len(true_top & set(sel)) / max(1, len(sel)),
        "mass": float(mass[sel].sum()),
        "rel_err": float((sparse - dense).norm() / dense.norm()),
    }


def run(sources: list[str], quick: bool) -> list[dict]:
    rows = []
    for src in sources:
        factory = file_source(src[5:]) if src.startswith("file:") else SOURCES[src]
        cases = list(factory(quick))
        for method in METHODS:
            for ratio in RATIOS:
                acc: dict[str, float] = {}
                for case in cases:
                    for key, val in evaluate(case, SELECTORS[method](case, ratio)).items():
                        acc[key] = acc.get(key, 0.0) + val / len(cases)
                rows.append(
                    {"source": src, "method": method, "ratio": ratio, "cases": len(cases), **acc}
                )
    return rows


def print_table(rows: list[dict]) -> None:
    print("| source | method | ratio | kept | recall | mass | rel_err |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['source']} ({r['cases']}) | {r['method']} | {r['ratio']:.1f} | "
            f"{r['kept']:.3f} | {r['recall']:.3f} | {r['mass']:.3f} | {r['rel_err']:.3f} |"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--source",
        action="append",
        help="a built-in source or file:PATH (repeatable; default: all built-ins)",
    )
    p.add_argument("--quick", action="store_true", help="fewer cases")
    p.add_argument("--json", type=Path, help="also write the rows as JSON")
    args = p.parse_args(argv)
    sources = args.source or list(SOURCES)
    for s in sources:
        if not s.startswith("file:") and s not in SOURCES:
            p.error(f"unknown source {s!r}; known: {', '.join(SOURCES)} or file:PATH")
    t0 = time.perf_counter()
    rows = run(sources, args.quick)
    print_table(rows)
    print(
        f"\n({time.perf_counter() - t0:.1f}s, impl={IMPL}, triton usable on CPU: "
        f"{triton_usable(torch.zeros(1))})"
    )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
