"""ReRoPE attention kernels: time against plain (RoPE) attention, plus a correctness check.

For each sequence length and window, one sequence's prefill (all tokens) and
one decode step are timed with the ReRoPE kernels (``window = W``) and with
the same kernels compiled as plain position-causal attention
(``REROPE=False``); the ratio is the ReRoPE overhead. Only the tiles on the
window's edge compute both scores, so the prefill overhead should shrink as
``W / L`` does; decode reads one extra K2 block per block beyond the window.

On CUDA the Triton kernels run (``--impl triton``); on CPU only the torch
reference runs (``--impl torch``; small sizes), which is what vLLM's CPU
build uses. Before timing, the kernels are checked against the reference at
a small size.

Usage: ``python benches/rerope_kernels.py [--lens 2048 8192 32768] [--windows 512 4096]``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

from ucm.sparse.kernels import attention


def case(n: int, h_kv: int, g: int, d: int, b: int, dtype: torch.dtype, dev: str):
    nb = math.ceil(n / b)
    kc, k2c, vc = (torch.randn(nb, b, h_kv, d, device=dev).to(dtype) for _ in range(3))
    q, q_w = (torch.randn(n, h_kv * g, d, device=dev).to(dtype) for _ in range(2))
    table = torch.arange(nb, device=dev, dtype=torch.int32).view(1, -1)
    return q, q_w, kc, k2c, vc, table


def timed(fn, dev: str, reps: int) -> float:
    fn()
    if dev == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    if dev == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def bench_length(n: int, args: argparse.Namespace, dtype: torch.dtype, dev: str) -> list[str]:
    """Table rows for sequence length ``n``, one per window shorter than ``n``."""
    q, q_w, kc, k2c, vc, table = case(
        n, args.kv_heads, args.group, args.head_dim, args.block_size, dtype, dev
    )
    sl = torch.tensor([n], device=dev)
    qd, qwd = q[-1:].contiguous(), q_w[-1:].contiguous()
    starts = {
        "prefill": torch.tensor([0, n], device=dev),
        "decode": torch.tensor([0, 1], device=dev),
    }

    def attn(kind: str, window: int | None) -> None:
        qq, ww = (q, q_w) if kind == "prefill" else (qd, qwd)
        kw = {} if window is None else {"q_w": ww, "k2_cache": k2c, "window": window}
        attention.paged_attention(
            qq, kc, vc, table, sl, starts[kind], max_query_len=qq.shape[0], impl=args.impl, **kw
        )

    plain_p = timed(lambda: attn("prefill", None), dev, args.reps)
    plain_d = timed(lambda: attn("decode", None), dev, args.reps * 4)
    rows = []
    for w in args.windows:
        if w >= n:
            continue
        pre = timed(lambda w=w: attn("prefill", w), dev, args.reps)
        dec = timed(lambda w=w: attn("decode", w), dev, args.reps * 4)
        rows.append(
            f"{n:>7} {w:>6} {1e3 * pre:>11.2f} {1e3 * plain_p:>9.2f} {pre / plain_p:>5.2f} "
            f"{1e6 * dec:>10.1f} {1e6 * plain_d:>9.1f} {dec / plain_d:>5.2f}"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lens", type=int, nargs="+", default=None)
    ap.add_argument("--windows", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    ap.add_argument("--impl", choices=["auto", "triton", "torch"], default="auto")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    if dev == "cpu":
        dtype = torch.float32
    lens = args.lens or ([2048, 8192, 32768] if dev == "cuda" else [1024, 2048])

    # correctness at a small size, against the torch reference
    q, q_w, kc, k2c, vc, table = case(
        300, args.kv_heads, args.group, args.head_dim, args.block_size, dtype, dev
    )
    sl, qsl = torch.tensor([300], device=dev), torch.tensor([0, 300], device=dev)
    kw = dict(q_w=q_w, k2_cache=k2c, window=40)
    got = attention.paged_attention(q, kc, vc, table, sl, qsl, impl=args.impl, **kw)
    exp = attention.paged_attention(q, kc, vc, table, sl, qsl, impl="torch", **kw)
    err = (got.float() - exp.float()).abs().max().item()
    print(f"device {dev}, dtype {dtype}, max |kernel - reference| at L=300, W=40: {err:.2e}")

    print(
        f"{'L':>7} {'W':>6} {'prefill ms':>11} {'plain ms':>9} {'x':>5} "
        f"{'decode us':>10} {'plain us':>9} {'x':>5}"
    )
    for n in lens:
        for row in bench_length(n, args, dtype, dev):
            print(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
