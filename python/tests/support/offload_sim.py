"""A miniature engine that drives an offloading method like the vLLM hooks will.

One request, several layers, a paged KV cache per layer, and a dict standing
in for the UCM store. Prefill writes the prompt's KV into dense blocks and
"dumps" its full blocks to the store; the request is then compressed
(``[init | swap slots | local]``), its dense prompt blocks freed; each decode
step appends the new token at the compressed position, carries out the
selector's :class:`~ucm.sparse.offload.retrieval.StepActions` (loads copy blocks from
the store into swap slots) and runs the paged decode kernel over the
attention view. Every step's output is compared with dense attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ucm.sparse.kernels import attention, selection
from ucm.sparse.kernels.dispatch import Impl
from ucm.sparse.offload import OffloadPlan, OffloadSparseBase


@dataclass
class SimResult:
    rel_errors: list[float] = field(default_factory=list)
    device_blocks: list[int] = field(default_factory=list)
    dense_blocks: list[int] = field(default_factory=list)
    loads_per_step: list[int] = field(default_factory=list)
    store_reads: int = 0


def run_offload_sim(
    method: OffloadSparseBase,
    k_all: torch.Tensor,
    v_all: torch.Tensor,
    q_all: torch.Tensor,
    prompt_len: int,
    plan: OffloadPlan | None = None,
    prefill_queries: torch.Tensor | None = None,
    request_id: str = "r0",
    impl: Impl = "torch",
) -> SimResult:
    """Runs ``T = k_all.shape[1] - prompt_len`` decode steps.

    ``k_all``/``v_all`` ``[layers, P + T, H_kv, D]``, ``q_all``
    ``[layers, T, H_q, D]``; ``plan`` overrides the method's plan (e.g. to keep
    every middle block); ``impl`` picks the attention kernel (the torch
    reference by default: the interpreter is slow and the kernel has its own
    tests).
    """
    num_layers, total, h, d = k_all.shape
    steps = total - prompt_len
    b = method.block_size
    res = SimResult()
    plan = plan or method.offload_plan(prompt_len)
    assert plan is not None, "request would stay dense"
    pool_blocks = plan.dense_blocks(steps) + plan.device_blocks(steps) + 4
    caches = [(torch.zeros(pool_blocks, b, h, d), torch.zeros(pool_blocks, b, h, d))
              for _ in range(num_layers)]  # fmt: skip
    free = list(range(pool_blocks))
    # ---- prefill: dense blocks, full blocks dumped to the store
    n = plan.num_prompt_blocks
    dense_row = [free.pop(0) for _ in range(n)]
    store: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    for layer, (kc, vc) in enumerate(caches):
        for j, blk in enumerate(dense_row):
            lo, hi = j * b, min(prompt_len, (j + 1) * b)
            kc[blk, : hi - lo] = k_all[layer, lo:hi]
            vc[blk, : hi - lo] = v_all[layer, lo:hi]
            if hi - lo == b:
                store[(layer, j)] = (kc[blk].clone(), vc[blk].clone())
    if plan == method.offload_plan(prompt_len):
        sel = method.selector_for(request_id, prompt_len)
    else:  # an explicit plan, e.g. one that keeps every middle block
        sel = method.selectors[request_id] = method.make_selector(plan)
    assert sel is not None
    ids = torch.tensor(dense_row)
    for layer, (kc, _) in enumerate(caches):
        if not method.is_sparse_layer(layer):
            continue
        if prefill_queries is not None:
            sel.on_prefill_finished(layer, kc, ids, prefill_queries[layer])  # type: ignore[call-arg]
        else:
            sel.on_prefill_finished(layer, kc, ids)  # type: ignore[call-arg]
    # ---- compress: windows move to a fresh row, the dense prompt blocks are freed
    row = [free.pop(0) for _ in range(plan.device_blocks(0))]
    for kc, vc in caches:
        for logical, src in enumerate(dense_row):
            dst = plan.compressed_block_of_logical(logical)
            if dst is not None:
                kc[row[dst]] = kc[src]
                vc[row[dst]] = vc[src]
    free.extend(dense_row)
    # ---- decode
    for t in range(1, steps + 1):
        pos = plan.compressed_len(t) - 1  # compressed slot of the new token
        while len(row) < plan.device_blocks(t):
            row.append(free.pop(0))
        true_pos = prompt_len + t - 1
        for layer, (kc, vc) in enumerate(caches):
            kc[row[pos // b], pos % b] = k_all[layer, true_pos]
            vc[row[pos // b], pos % b] = v_all[layer, true_pos]
        res.device_blocks.append(len(row))
        res.dense_blocks.append(plan.dense_blocks(t))
        loads = 0
        for layer, (kc, vc) in enumerate(caches):
            q = q_all[layer, t - 1]
            actions = method.decode_step(request_id, layer, t, q)
            if actions is None:
                continue
            for op in actions.loads:  # the store load (async ones finish next step)
                src_k, src_v = store[(layer, op.block)]
                dst = row[plan.swap_slot_start + op.slot]
                kc[dst], vc[dst] = src_k, src_v
                res.store_reads += 1
            loads += len(actions.loads)
            blocks, length = plan.attention_view(row, actions.active_slots, t)
            table = torch.tensor([blocks], dtype=torch.int32)
            lens = torch.tensor([length])
            out = attention.paged_decode_attention(q[None], kc, vc, table, lens, impl=impl)[0]
            keys = k_all[layer, : true_pos + 1]
            vals = v_all[layer, : true_pos + 1]
            w = selection.dense_attention_weights(q, keys)
            g = q.shape[0] // h
            dense = torch.einsum("hl,lhd->hd", w, vals.repeat_interleave(g, dim=1))
            res.rel_errors.append(float((out - dense).norm() / dense.norm()))
        res.loads_per_step.append(loads)
    return res
