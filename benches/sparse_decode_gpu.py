"""Decode attention latency: dense vs ESA, GSA and KVStar at 32k and 128k tokens.

One attention layer of a Llama-3-8B-like model (32 query heads, 8 kv heads,
head dim 128, bf16, vLLM's GPU block size 16) over a paged KV cache. For each
context length the batch is sized to a realistic decode batch, every
sequence is full length, and each method is timed per decode step:

* ``dense``: the paged flash-decoding Triton kernel over every block;
* ``ESA`` / ``KVStar``: the same kernel over the blocks kept in device KV
  (init 1 + ratio of the middle + local 2); the selection (``score``:
  block scoring + top-k) runs once per ``retrieval_stride`` steps, so its
  per-step share is ``score / stride`` (5 for ESA, 8 for KVStar);
* ``GSA``: per step, query hashing + Hamming block scores + top-k + gather,
  then the kernel over ``ceil(ratio * N)`` blocks.

``speedup`` is dense time over the method's per-step time (attention plus
amortised selection). Also printed: the torch SDPA (flash) time over
contiguous KV of the same length, for scale. Run on an H100/H200-class GPU::

    python benches/sparse_decode_gpu.py            # ~1-2 minutes
    python benches/sparse_decode_gpu.py --ratios 0.1,0.3

``--cpu-smoke`` runs the same code path on CPU with tiny sizes under
``TRITON_INTERPRET=1`` (set by the script before Triton is imported), to
check the script itself where no GPU is available. Not run in CI.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if "--cpu-smoke" in sys.argv:  # must precede the first triton import
    os.environ["TRITON_INTERPRET"] = "1"

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

from ucm.sparse.esa import ESAConfig, esa_scores
from ucm.sparse.gsa import SRPHashEncoder, gsa_select
from ucm.sparse.kernels import attention, selection
from ucm.sparse.offload import make_offload_plan


@dataclass(frozen=True)
class Shape:
    heads: int
    kv_heads: int
    head_dim: int
    block: int
    dtype: torch.dtype


GPU_SHAPE = Shape(32, 8, 128, 16, torch.bfloat16)
SMOKE_SHAPE = Shape(8, 2, 64, 16, torch.float32)
GPU_CASES = [(32 * 1024, 8), (128 * 1024, 2)]  # (tokens, batch)
SMOKE_CASES = [(512, 2), (1024, 1)]


def bench(fn, device: str, reps: int) -> float:
    """Median milliseconds of ``fn()``."""
    if device == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=reps))
    fn()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def kept_blocks_offload(n: int, ratio: float, rounding: str, block: int) -> int:
    plan = make_offload_plan(n * block, block, 1, 2, ratio, 1, rounding)
    return n if plan is None else plan.n_init + plan.num_selected + plan.n_local


def run_case(tokens: int, batch: int, shape: Shape, ratios: list[float], device: str, reps: int):
    s, b = batch, shape.block
    n = tokens // b
    num_blocks = s * n
    torch.manual_seed(0)
    kv_shape = (num_blocks, b, shape.kv_heads, shape.head_dim)
    k = torch.randn(kv_shape, device=device, dtype=shape.dtype)
    v = torch.randn(kv_shape, device=device, dtype=shape.dtype)
    q = torch.randn(s, shape.heads, shape.head_dim, device=device, dtype=shape.dtype)
    perm = torch.randperm(num_blocks, device=device)
    table = perm.view(s, n).to(torch.int32)  # scattered blocks, like a real pool
    seq_lens = torch.full((s,), tokens, dtype=torch.int32, device=device)
    rows = []

    def attn(tbl: torch.Tensor, lens: torch.Tensor):
        return lambda: attention.paged_decode_attention(q, k, v, tbl, lens, impl="triton")

    scale = 1.0 / math.sqrt(shape.head_dim)
    dense_ms = bench(attn(table, seq_lens), device, reps)
    rows.append(("dense", 1.0, 1.0, dense_ms, 0.0, dense_ms))
    if device == "cuda":
        kc = k[perm.view(s, n).long()].reshape(s, tokens, shape.kv_heads, shape.head_dim)
        vc = v[perm.view(s, n).long()].reshape(s, tokens, shape.kv_heads, shape.head_dim)
        qq = q.unsqueeze(2)  # [S, H, 1, D]
        kk, vv = kc.transpose(1, 2), vc.transpose(1, 2)

        def sdpa():
            return torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, enable_gqa=True)

        t = bench(sdpa, device, reps)
        rows.append(("sdpa (contig.)", 1.0, 1.0, t, 0.0, t))
        del kc, vc, kk, vv
    for ratio in ratios:
        # ESA and KVStar: attention over the kept blocks; selection every stride
        for name, rounding, stride in (("ESA", "floor", 5), ("KVStar", "ceil", 8)):
            kept = kept_blocks_offload(n, ratio, rounding, b)
            sel_table = table[:, :kept].contiguous()
            lens = torch.full((s,), tokens - (n - kept) * b, dtype=torch.int32, device=device)
            t_attn = bench(attn(sel_table, lens), device, reps)
            r = n - 3
            table_r = torch.arange(s * r, dtype=torch.int32, device=device).view(s, r)
            num_r = torch.full((s,), r, dtype=torch.int32, device=device)
            k_sel = max(1, kept - 3)
            if name == "ESA":
                per_block = b // ESAConfig().block_repre_tokens
                reps = torch.randn(s, r, per_block, shape.kv_heads, shape.head_dim, device=device)

                def score(reps=reps, k_sel=k_sel):
                    sc = torch.stack([esa_scores(q[i], reps[i]) for i in range(s)])
                    return torch.topk(sc, k_sel, dim=1).indices
            else:
                dp, m = shape.head_dim // 4, 8
                pool = torch.randn(s * r, m, shape.kv_heads, dp, device=device)
                ch = torch.arange(dp, device=device, dtype=torch.int32)
                ch = ch.expand(s, shape.kv_heads, dp).contiguous()
                qx = q.unsqueeze(1).expand(s, stride, shape.heads, shape.head_dim).contiguous()

                def score(pool=pool, ch=ch, qx=qx, table_r=table_r, num_r=num_r, k_sel=k_sel):
                    sc = selection.kvstar_vote_scores(
                        qx, pool, table_r, num_r, ch, scale, impl="triton"
                    )
                    return torch.topk(sc, k_sel, dim=1).indices

            t_score = bench(score, device, reps)
            step = t_attn + t_score / stride
            rows.append((name, ratio, kept / n, t_attn, t_score, step))
        # GSA: per-step hashing + scoring + selection, then attention
        enc = SRPHashEncoder(shape.head_dim, shape.head_dim, seed=0, device=device, impl="triton")
        codes = torch.randint(
            -(2**31),
            2**31 - 1,
            (num_blocks, b, shape.kv_heads, enc.words),
            dtype=torch.int32,
            device=device,
        )
        keep = torch.full((s,), math.ceil(ratio * n), dtype=torch.long, device=device)

        def gsa_pick(codes=codes, keep=keep, enc=enc):
            qc = enc.encode_query(q, shape.kv_heads)
            return gsa_select(selection.HammingBatch(qc, codes, table, seq_lens), keep, "triton")

        t_score = bench(gsa_pick, device, reps)
        new_table, new_lens, _ = gsa_pick()
        t_attn = bench(attn(new_table.to(torch.int32), new_lens.to(torch.int32)), device, reps)
        kept = int(keep[0])
        rows.append(("GSA", ratio, kept / n, t_attn, t_score, t_attn + t_score))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ratios", default="0.1,0.3", help="comma-separated sparse ratios")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on CPU (interpreter)")
    p.add_argument("--reps", type=int, default=100, help="do_bench rep time in ms (GPU)")
    args = p.parse_args(argv)
    ratios = [float(x) for x in args.ratios.split(",")]
    if args.cpu_smoke:
        device, shape, cases = "cpu", SMOKE_SHAPE, SMOKE_CASES
    else:
        if not torch.cuda.is_available():
            p.error("no CUDA device; use --cpu-smoke to check the script on CPU")
        device, shape, cases = "cuda", GPU_SHAPE, GPU_CASES
        print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(
        f"# heads {shape.heads}/{shape.kv_heads}, head dim {shape.head_dim}, "
        f"block {shape.block}, {str(shape.dtype).replace('torch.', '')}"
    )
    print("| tokens | batch | method | ratio | kept | attn ms | select ms | step ms | speedup |")
    print("|---|---|---|---|---|---|---|---|---|")
    for tokens, batch in cases:
        rows = run_case(tokens, batch, shape, ratios, device, args.reps)
        dense = rows[0][5]
        for name, ratio, kept, t_attn, t_sel, step in rows:
            print(
                f"| {tokens} | {batch} | {name} | {ratio:.1f} | {kept:.3f} | {t_attn:.3f} | "
                f"{t_sel:.3f} | {step:.3f} | {dense / step:.2f}x |"
            )
        if device == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
