"""Block-selection rules on the needle prompts of ``benches/quality.py``,
offline: the real model in ``transformers``, no vLLM, no store.

Each prompt is prefilled densely once; then every rule decodes 10 tokens
greedily from a copy of that cache, each layer attending only to what an
offloading method keeps on the device: the init block, the selected middle
blocks, the last two prompt blocks and the decode tokens (``--ratio`` of the
middle blocks, 32-token blocks). A rule selects per layer with the first
decode query and re-selects every 5 steps (KVStar rules: with the last 8
prefill queries, every 8 steps), at once rather than a step late as the
engine does. An answer is right when its first digits are the key.

This is how the scoring of ESA was chosen: on SmolLM2 it reproduces the
engine's dense, ESA and KVStar counts of ``benches/quality.py`` within a
needle, at a fraction of the time, and it can try rules the engine does not
have. Rules (``--rules``):

* ``dense``: every block;
* ``esa-mean``: the original ESA: one mean key per block, a flattened dot
  product with the group-mean query;
* ``esa:C``: ESA as shipped (:func:`ucm.sparse.esa.esa_scores`) with
  ``block_repre_tokens`` C;
* ``kvstar:P:C``: KVStar's vote, channel share P, C-token sub-blocks;
* ``tokmax``: each block's best single key per head (the ``esa:1`` limit);
* ``oracle``: the exact attention mass of each block (needs every key).

Usage::

    python benches/needle_selection.py --lengths 2048 4096 7680 --needles 20
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quality import needle_set
from ucm.models import ModelUnavailable, ensure, load_tokenizer
from ucm.sparse.esa import esa_scores
from ucm.sparse.kernels import selection
from ucm.vllm_demo.corpus import answer_digits

B, N_INIT, N_LOCAL, DECODE = 32, 1, 2, 10


class Rule:
    """One selection rule and the decode state it needs."""

    def __init__(self, spec: str, ratio: float) -> None:
        self.spec = spec
        name, *args = spec.split(":")
        self.name, self.args, self.ratio = name, [float(a) for a in args], ratio
        self.kvstar = name == "kvstar"
        self.stride = 8 if self.kvstar else 5

    def scores(self, q: torch.Tensor, keys: torch.Tensor, prompt: int) -> torch.Tensor:
        """Scores of the middle blocks: ``q`` ``[X, H_q, D]``, ``keys`` ``[H_kv, T, D]``."""
        h_kv, _, d = keys.shape
        mid = keys[:, N_INIT * B : (-(-prompt // B) - N_LOCAL) * B]
        r = mid.shape[1] // B
        blocks = mid.reshape(h_kv, r, B, d)
        g = q.shape[1] // h_kv
        qh = q.reshape(q.shape[0], h_kv, g, d)
        scale = 1 / math.sqrt(d)
        if self.name == "esa-mean":
            table = torch.arange(r, dtype=torch.int32).unsqueeze(0)
            pool = blocks.mean(2).permute(1, 0, 2)
            return selection.block_scores_dot(q[-1:], pool, table, torch.tensor([r]))[0]
        if self.name in ("esa", "tokmax"):
            c = 1 if self.name == "tokmax" else int(self.args[0]) if self.args else 4
            reps = blocks.reshape(h_kv, r, B // c, c, d).mean(3).permute(1, 2, 0, 3)
            return esa_scores(q[-1], reps)
        if self.name == "oracle":
            p = (torch.einsum("hgd,htd->hgt", qh[-1], keys[:, :prompt]) * scale).softmax(-1)
            return p[:, :, N_INIT * B : N_INIT * B + r * B].reshape(h_kv, g, r, B).sum((0, 1, 3))
        if self.kvstar:
            share, c = (self.args + [0.25, 2.0][len(self.args) :])[:2]
            dp = max(1, round(d * share))
            ch = keys[:, :prompt].abs().mean(1).topk(dp, -1).indices.sort(-1).values
            m = B // int(c)
            reps = blocks.reshape(h_kv, r, m, int(c), d).mean(3)
            reps = torch.gather(reps, 3, ch[:, None, None, :].expand(h_kv, r, m, dp))
            qp = torch.gather(qh, 3, ch[None, :, None, :].expand(q.shape[0], h_kv, g, dp))
            logits = torch.einsum("xhgd,hrmd->xhgrm", qp, reps) * scale
            shape = (q.shape[0], h_kv, g, r, m)
            return logits.reshape(*shape[:3], r * m).softmax(-1).reshape(shape).sum((0, 1, 2, 4))
        raise ValueError(f"unknown rule {self.spec!r}")

    def keep(self, q: torch.Tensor, keys: torch.Tensor, prompt: int) -> list[int]:
        s = self.scores(q, keys, prompt)
        k = (math.ceil if self.kvstar else math.floor)(s.numel() * self.ratio)
        return sorted(N_INIT + int(i) for i in torch.topk(s, k).indices)


class SparseDecode:
    """The attention function of every layer (registered with ``transformers``)."""

    def __init__(self) -> None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        self.sdpa = sdpa_attention_forward
        self.rule: Rule | None = None
        self.prompt, self.step = 0, 0
        self.prefill_q: dict[int, torch.Tensor] = {}
        self.queries: dict[int, list[torch.Tensor]] = {}
        self.kept: dict[int, list[int]] = {}

    def start(self, rule: Rule | None, prompt: int) -> None:
        self.rule, self.prompt, self.step = rule, prompt, 0
        self.queries, self.kept = {}, {}

    def __call__(self, module: Any, query, key, value, mask, scaling=None, dropout=0.0, **kw):
        layer = module.layer_idx
        if query.shape[2] > 1:  # prefill: dense; keep the last queries for KVStar's vote
            self.prefill_q[layer] = query[0, :, -8:].transpose(0, 1).clone()
            return self.sdpa(module, query, key, value, mask, scaling=scaling, **kw)
        rule = self.rule
        if rule is None:
            return self.sdpa(module, query, key, value, None, scaling=scaling, **kw)
        q = query[0, :, 0]
        seen = self.queries.setdefault(layer, [])
        seen.append(q)
        first = layer not in self.kept
        if first or (self.step - 1) % rule.stride == 0:
            ctx = (
                (self.prefill_q[layer] if first else torch.stack(seen[-rule.stride :]))
                if rule.kvstar
                else q.unsqueeze(0)
            )
            self.kept[layer] = rule.keep(ctx, key[0], self.prompt)
        local = (-(-self.prompt // B) - N_LOCAL) * B
        idx = list(range(N_INIT * B))
        for j in self.kept[layer]:
            idx += range(j * B, (j + 1) * B)
        ix = torch.tensor(idx + list(range(local, key.shape[2])))
        return self.sdpa(module, query, key[:, :, ix], value[:, :, ix], None, scaling=scaling)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 7680])
    ap.add_argument("--needles", type=int, default=20)
    ap.add_argument("--rules", nargs="+", default=["dense", "esa-mean", "esa:4", "kvstar"])
    ap.add_argument("--ratio", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=11, help="as quality.py's (same prompts)")
    args = ap.parse_args(argv)
    try:
        model_dir = ensure()
    except ModelUnavailable as e:
        print(f"the real model is not available: {e}", file=sys.stderr)
        return 2
    from transformers import AttentionInterface, AutoModelForCausalLM

    attention = SparseDecode()
    AttentionInterface.register("ucm_needle_selection", attention)
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="ucm_needle_selection"
    ).eval()
    tok = load_tokenizer(model_dir)
    rules = [None if s == "dense" else Rule(s, args.ratio) for s in args.rules]
    t0 = time.time()
    print(f"needles right of {args.needles} per length, ratio {args.ratio}")
    print("length  " + "  ".join(f"{s:>10}" for s in args.rules))
    for length, items in needle_set(tok, args.lengths, args.needles, args.seed).items():
        right = [0] * len(rules)
        for prompt, key in items:
            with torch.no_grad():
                attention.start(None, len(prompt))
                out = model(torch.tensor([prompt]), use_cache=True)
                first = int(out.logits[0, -1].argmax())
                for i, rule in enumerate(rules):
                    attention.start(rule, len(prompt))
                    cache, toks = copy.deepcopy(out.past_key_values), [first]
                    for step in range(1, DECODE):
                        attention.step = step
                        o = model(torch.tensor([[toks[-1]]]), past_key_values=cache)
                        toks.append(int(o.logits[0, -1].argmax()))
                    right[i] += answer_digits(tok.decode(toks)) == key
        print(f"{length:>6}  " + "  ".join(f"{r:>10}" for r in right), flush=True)
    print(f"({(time.time() - t0) / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
