"""Compiles every sparse Triton kernel for an H100 (sm_90) without a GPU.

Triton lowers to PTX and runs ``ptxas`` (shipped with the triton wheel) for
a chosen target, so this catches kernels that only work in the interpreter
(unsupported ops, dtype mismatches in ``tl.dot``, bad constexpr use).
Run without ``TRITON_INTERPRET``: ``python cuda_compile_check.py``.
Prints one line per kernel variant and ``compiled N kernels``.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ucm.sparse.kernels.attention import jit as A
from ucm.sparse.kernels.selection import jit as K

FLOAT_ARGS = {"scale"}


def compile_one(fn, pointers: dict[str, str], constexprs: dict[str, object], arch: int) -> None:
    sig = {}
    for name in fn.arg_names:
        if name in pointers:
            sig[name] = pointers[name]
        elif name in constexprs:
            sig[name] = "constexpr"
        elif name in FLOAT_ARGS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    missing = [n for n in fn.arg_names if n.endswith("_ptr") and n not in pointers]
    if missing:
        raise SystemExit(f"{fn.__name__}: no dtype for {missing}")
    src = ASTSource(fn, sig, constexprs=constexprs)
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32))
    assert kernel.asm.get("cubin"), f"{fn.__name__}: no cubin"


def variants():
    attn_ptrs = {
        "q_ptr": "*bf16", "qw_ptr": "*bf16", "k_ptr": "*bf16", "k2_ptr": "*bf16",
        "v_ptr": "*bf16", "out_ptr": "*bf16", "table_ptr": "*i32", "seq_lens_ptr": "*i32",
        "qsl_ptr": "*i32", "qpos_ptr": "*i32", "part_ptr": "*fp32",
    }  # fmt: skip
    decode = dict(GROUP=8, HEAD_DIM=128, D_PAD=128, BLOCK_SIZE=16, BLOCK_M=16, BLOCK_Q=1,
                  BLOCK_N=16, NUM_SPLITS=16, ONE_QUERY=True, REROPE=False, IEEE=False,
                  UPCAST=False)  # fmt: skip
    # one block per key tile (a single block-table read per tile)
    yield "paged_attention decode split bf16", A.paged_attention_kernel, attn_ptrs, decode
    fp32_ptrs = {k: ("*fp32" if v == "*bf16" else v) for k, v in attn_ptrs.items()}
    prefill = dict(decode, GROUP=4, HEAD_DIM=64, D_PAD=64, BLOCK_M=64, BLOCK_Q=16, BLOCK_N=32,
                   NUM_SPLITS=1, ONE_QUERY=False, REROPE=True, IEEE=True)  # fmt: skip
    # key tiles across blocks (a block-table read per token)
    yield "paged_attention prefill rerope fp32", A.paged_attention_kernel, fp32_ptrs, prefill
    yield (
        "paged_decode_reduce",
        A.paged_decode_reduce_kernel,
        {"part_ptr": "*fp32", "out_ptr": "*bf16"},
        dict(HEAD_DIM=128, HEAD_DIM_PAD=128, NUM_SPLITS=16, NUM_SPLITS_PAD=16),
    )
    yield (
        "block_repr",
        K.block_repr_kernel,
        {
            "k_ptr": "*bf16",
            "block_ids_ptr": "*i64",
            "num_tokens_ptr": "*i32",
            "ch_ptr": "*i32",
            "out_ptr": "*fp32",
        },
        dict(BLOCK_SIZE=16, C=2, C_PAD=2, NUM_REPS=8, DP=32, DP_PAD=32, HAS_CHANNELS=True),
    )
    yield (
        "block_score_dot",
        K.block_score_dot_kernel,
        {
            "q_ptr": "*bf16",
            "rep_ptr": "*fp32",
            "table_ptr": "*i32",
            "nreps_ptr": "*i32",
            "out_ptr": "*fp32",
        },
        dict(NUM_KV_HEADS=8, GROUP=8, GROUP_PAD=8, HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_N=64),
    )
    yield (
        "kvstar_vote",
        K.kvstar_vote_kernel,
        {
            "q_ptr": "*bf16",
            "rep_ptr": "*fp32",
            "table_ptr": "*i32",
            "nreps_ptr": "*i32",
            "ch_ptr": "*i32",
            "out_ptr": "*fp32",
        },
        dict(NUM_HEADS_Q=32, GROUP=4, M=8, M_PAD=8, DP=32, DP_PAD=32, BLOCK_N=32),
    )
    yield (
        "srp_encode",
        K.srp_encode_kernel,
        {"x_ptr": "*bf16", "proj_ptr": "*fp32", "out_ptr": "*i32", "slot_ptr": "*i64"},
        dict(
            NUM_HEADS=8,
            HEAD_DIM=128,
            D_PAD=128,
            NBITS=128,
            BLOCK_R=32,
            CACHE_BLOCK=16,
            USE_SLOTS=True,
        ),
    )
    yield (
        "hamming_block_score",
        K.hamming_block_score_kernel,
        {
            "qc_ptr": "*i32",
            "kc_ptr": "*i32",
            "table_ptr": "*i32",
            "seq_lens_ptr": "*i32",
            "out_ptr": "*i32",
        },
        dict(
            NUM_KV_HEADS=8, WORDS=4, BLOCK_SIZE=16, BLOCK_SIZE_PAD=16, BLOCK_NB=16, SINK=1, RECENT=4
        ),
    )


def main() -> int:
    arch = int(sys.argv[1]) if len(sys.argv) > 1 else 90
    n = 0
    for name, fn, ptrs, consts in variants():
        t0 = time.perf_counter()
        compile_one(fn, ptrs, consts, arch)
        print(f"{name}: ok ({time.perf_counter() - t0:.1f}s)")
        n += 1
    print(f"compiled {n} kernels for sm_{arch}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
