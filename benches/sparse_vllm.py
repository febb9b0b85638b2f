"""Sparse attention inside vLLM: device KV footprint and decode speed, dense vs ESA/KVStar.

Each configuration runs in a fresh process (vLLM CPU or GPU build, in-process
engine core) with the UCM connector and a local store: a random tiny Llama
(``--layers``, ``--hidden``; float32), one warm-up request, then ``--reps``
requests of ``--prompt`` random tokens decoding ``--decode`` tokens each
(greedy). Reported per configuration: median decode tokens/s (from vLLM's
per-request timestamps) and, for the offloading methods, the device blocks
the request held during decode against its dense block count::

    python benches/sparse_vllm.py                       # 8k prompt, ESA 0.3
    python benches/sparse_vllm.py --methods ESA,KVStar --ratio 0.1 --prompt 16384

On the CPU build the sparse attention is the torch reference (vLLM's CPU
build has no Triton backend), so decode there is not faster than vLLM's own
CPU kernel at these sizes; the footprint is the point. Not run in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MARK = "@@BENCH@@ "


def child(args: argparse.Namespace) -> None:
    os.environ.update(
        HF_HUB_OFFLINE="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_NO_USAGE_STATS="1",
        TOKENIZERS_PARALLELISM="false",
    )
    os.environ.pop("TRITON_INTERPRET", None)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from ucm.integration.vllm.sparse import offload
    from ucm.vllm_demo.tiny_model import TinyModelSpec, make_tiny_llama

    spec = TinyModelSpec(
        layers=args.layers, hidden=args.hidden, heads=4, kv_heads=2, intermediate=2 * args.hidden
    )
    model = make_tiny_llama(Path(args.work) / f"model-{args.layers}-{args.hidden}", spec)
    extra: dict[str, Any] = {"storage_backends": str(Path(args.work) / f"store-{args.child}")}
    if args.child != "dense":
        extra["ucm_sparse_config"] = {args.child: {"sparse_ratio": args.ratio}}
    llm = LLM(
        model=str(model),
        dtype="float32",
        enforce_eager=True,
        block_size=args.block_size,
        max_model_len=args.prompt + args.decode + 64,
        kv_cache_memory_bytes=args.kv_mib << 20,
        enable_prefix_caching=False,
        disable_log_stats=False,
        seed=0,
        kv_transfer_config=KVTransferConfig(
            kv_connector="UCMConnector",
            kv_connector_module_path="ucm.integration.vllm.ucm_connector",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        ),
    )
    sp = SamplingParams(temperature=0, max_tokens=args.decode, ignore_eos=True)
    rng = random.Random(0)
    tps, held, dense = [], [], []
    for i in range(args.reps + 1):
        prompt = [rng.randrange(4, 500) for _ in range(args.prompt)]
        out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
        m = out.metrics
        if i == 0 or m is None or m.last_token_ts <= m.first_token_ts:
            continue  # warm-up
        tps.append((args.decode - 1) / (m.last_token_ts - m.first_token_ts))
        if offload.FINISHED_FOOTPRINTS:
            fp = offload.FINISHED_FOOTPRINTS[-1][1]
            held.append(fp.max_decode_held)
            dense.append(fp.max_decode_dense)
    bb = llm.llm_engine.engine_core.engine_core.scheduler.connector.geometry.block_bytes
    print(
        MARK
        + json.dumps(
            {
                "tps": statistics.median(tps),
                "held": max(held) if held else None,
                "dense": max(dense) if dense else None,
                "block_bytes": bb,
            }
        ),
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--ratio", type=float, default=0.3)
    ap.add_argument("--methods", default="ESA")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--kv-mib", type=int, default=128)
    ap.add_argument("--work", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    work = (
        str(Path(args.work).absolute())
        if args.work
        else tempfile.mkdtemp(prefix="ucm-sparse-bench-")
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT / "python"), env.get("PYTHONPATH")) if p
    )
    print(f"prompt {args.prompt} tokens, decode {args.decode}, ratio {args.ratio}, work {work}")
    print(f"{'config':<10} {'decode tok/s':>12} {'device KV blocks (decode)':>28}")
    for cfg in ["dense", *args.methods.split(",")]:
        opts = ("prompt", "decode", "ratio", "reps", "layers", "hidden", "block_size", "kv_mib")
        cmd = [sys.executable, __file__, "--work", work, "--child", cfg]
        for o in opts:
            cmd += [f"--{o.replace('_', '-')}", str(getattr(args, o))]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)]
        if proc.returncode or not lines:
            print(f"{cfg:<10} failed:\n{proc.stderr[-3000:]}")
            continue
        r = json.loads(lines[-1][len(MARK) :])
        mib = r["block_bytes"] / 2**20
        if r["held"] is None:
            n = -(-(args.prompt + args.decode) // args.block_size)
            kv = f"{n} ({n * mib:.1f} MiB)"
        else:
            kv = (
                f"{r['held']} of {r['dense']} ({r['held'] * mib:.1f} of {r['dense'] * mib:.1f} MiB)"
            )
        print(f"{cfg:<10} {r['tps']:>12.1f} {kv:>28}")


if __name__ == "__main__":
    main()
