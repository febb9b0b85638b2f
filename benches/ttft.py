"""Time to first token with UCMConnector on real vLLM (the CPU build here).

A random-weight Llama big enough that prefill costs real time (16 layers,
hidden 1024, 8 KV heads of 128, float32: 128 KiB of KV per token), prompts of
2k, 4k and 8k tokens. For each length, in one run:

* ``recompute``: no connector, nothing cached: the whole prefill;
* ``ucm miss``: with the connector, a prompt it has never seen (0 % hits;
  its blocks are saved): the connector's overhead against ``recompute``
  (both engines alive, measured alternately on the same prompts);
* ``ucm mem``: a fresh engine (new process) loading the prompt from UCM with
  the store's files in memory (page cache, or the Cache tier). A host may
  reclaim page-cache pages left idle (this VM drops those idle for about a
  minute), and an engine takes longer than that to start: the files are read
  back into the page cache once the engine is up, and the bytes that had
  left are printed (the same for the page-cache read probe and LMCache's
  file tier);
* ``ucm disk``: a fresh engine after the store's files were evicted from the
  page cache (``posix_fadvise(DONTNEED)``);
* ``vllm hit``: right after each load, the same engine serves the prompt
  again with ``ucm_skip_load`` (the connector loads nothing for it): vLLM's
  own in-memory prefix cache, which recomputes the prompt's last block,
  measured in the same process and moment as the load. Without that flag
  the connector would load the last block too and only one token would be
  computed (``hit+ucm``, printed as well): that is UCM's doing, not vLLM's;
* ``one token``: vLLM serving the prompt plus one token after the prompt,
  so every full block is cached and exactly one token is computed at full
  context: what a load from UCM computes too.

The ``floor`` of a from-memory load is ``one token`` plus the KV bytes over
the memory-copy bandwidth measured in the same run; ``pc floor`` is the same
with the page-cache read bandwidth instead (what a fresh engine's load from
the page cache cannot beat: the kernel copies every byte out of it);
``verified floor`` adds the KV bytes over the speed of the checksum every
load verifies (all CPUs, same run): a load from the page cache copies each
byte out of it and then checks it, both on the same CPUs. The raw
O_DIRECT read bandwidth of the store's disk and the page-cache read bandwidth
are printed too. Loads are measured for each of ``--pipelines`` (the default pipeline,
``Cache|Posix``, and ``Posix`` alone) and each of ``--modes``. A pipeline
named with `` kept`` after it (``"Cache|Posix kept"``) puts its Cache tier in
a shared segment that outlives its last process (``share_buffer_keep``): the
saving engine then saves through that segment, and a fresh engine finds the
blocks in it, as an engine restarted on the same host would (no ``UCM disk``
for it: the segment holds the blocks whatever the page cache does). Targets:
``UCM mem`` <= 1.0 x ``vllm hit`` and <= 1.15 x ``floor``; ``ucm miss`` <=
1.03 x ``recompute`` (also given in CPU time of the engine process, which
other load on a shared machine disturbs much less than wall time). Prefill
is chunked (``--chunk`` tokens per step), so saves of a chunk overlap the
compute of the next.

With ``--lmcache-path DIR`` (a directory LMCache is installed in, see
``benches/lmcache_engine.py``), LMCache is measured on the same prompts:
one engine with LMCache's connector serves each prompt (LMCache stores it);
then, ``--repeat`` times, a fresh LMCache server (empty memory tier) and a
fresh engine serve it again, its KV bytes coming from LMCache's file tier with
the files in the page cache: ``LMCache mem``, the counterpart of ``UCM mem``.
LMCache has no per-request switch to load nothing, so its ratio is taken
against the ``vLLM hit`` of the engine without a connector (printed, with
UCM's against the same, on a line of its own per prompt). A load that
LMCache did not serve (fewer cached tokens than ``UCM mem`` needs) is
printed as such, not as a load.

Run (a few minutes; not part of CI)::

    .venv/bin/python benches/ttft.py [--lengths 2048 4096 8192] [--modes layerwise wholestep]
        [--pipelines Cache|Posix Posix] [--io-direct] [--no-disk] [--repeat 2]
        [--lmcache-path DIR]

Loads are measured in both modes, each in ``--repeat`` fresh engines (best
kept); recompute and miss on ``--overhead-repeat`` prompts per length, best kept:
one 8k prefill alone varied by 15 % between runs on a 2-core machine, so one
prompt cannot show a few percent of overhead.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import native_baselines
from lmcache_engine import LMCacheServer, LMCacheSpawner, lmcache_import_error
from page_cache import evict, page_in
from ucm.vllm_demo.engine_process import EngineProcess, EngineSpawner, engine_env
from ucm.vllm_demo.tiny_model import TinyModelSpec, make_tiny_llama

REPO = Path(__file__).resolve().parents[1]
BENCH_SPEC = TinyModelSpec(
    layers=16, hidden=1024, heads=8, kv_heads=8, intermediate=2816, vocab=512, max_positions=16384
)
KV_BYTES_PER_TOKEN = 2 * BENCH_SPEC.kv_heads * BENCH_SPEC.head_dim * 4 * BENCH_SPEC.layers
BLOCK = 32


def split_label(label: str) -> tuple[str, bool]:
    """``"Cache|Posix kept"`` -> (``"Cache|Posix"``, kept in /dev/shm)."""
    pipeline, _, kept = label.strip().partition(" ")
    if kept not in ("", "kept"):
        raise SystemExit(f"--pipelines {label!r}: only ' kept' may follow the pipeline")
    return pipeline, kept == "kept"


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(4, 500) for _ in range(n)]


def _bench_dir() -> Path:
    d = REPO / ".ucm-demo" / "bench"
    d.mkdir(parents=True, exist_ok=True)
    return d


def raw_read_gbps(root: Path, total: int = 1 << 30) -> float:
    """Sequential O_DIRECT read bandwidth of the disk under ``root`` (1 MiB I/Os, QD 8)."""
    return statistics.median(
        native_baselines.direct_io_gbps(root, "read", total, 1 << 20, 8) for _ in range(3)
    )


def _parallel_copy_gbps(total: int, copy_part: Callable[[int, int], None]) -> float:
    """Best of 4 rounds of ``copy_part(offset, length)`` over ``total`` bytes,
    one slice per CPU in parallel, in GB/s."""
    threads = os.cpu_count() or 1
    part = total // threads
    best = 0.0
    with ThreadPoolExecutor(threads) as ex:
        for _ in range(4):
            t = time.perf_counter()
            list(ex.map(lambda i: copy_part(i * part, part), range(threads)))
            best = max(best, part * threads / (time.perf_counter() - t) / 1e9)
    return best


def pagecache_read_gbps(root: Path, total: int = 512 << 20) -> float:
    """Bandwidth of reading a file that is in the page cache into fresh
    (pre-faulted) memory, one thread per CPU: the one copy a from-memory load
    cannot avoid, so ``vllm hit + KV bytes / this`` is the floor of ``ucm mem``."""
    import numpy as np

    path = root / ".pagecache-probe"
    path.write_bytes(np.full(total, 7, np.uint8).tobytes())
    view = memoryview(np.ones(total, np.uint8))
    fd = os.open(path, os.O_RDONLY)
    try:

        def read(off: int, length: int) -> None:
            step = 4 << 20
            for o in range(off, off + length, step):
                os.preadv(fd, [view[o : min(o + step, off + length)]], o)

        return _parallel_copy_gbps(total, read)
    finally:
        os.close(fd)
        path.unlink()


def cold_read_child(store: Path, nbytes: int, settle: float) -> dict[str, float]:
    """In a fresh process, what a fresh engine's load from the page cache
    does with no store code: read ``nbytes`` of the store's block files
    (already in the page cache) into memory allocated and zeroed ``settle``
    seconds before, as vLLM's KV cache is, with the store's 4 I/O threads.
    Seconds of that first pass (``cold``) and of a second one (``warm``), and
    the bytes of each that were not in the page cache (read from the disk)."""
    import numpy as np
    import torch

    dst = torch.zeros(nbytes, dtype=torch.uint8).numpy()
    plan, off = [], 0
    for path in sorted(store.glob("??/*")):
        if off >= nbytes:
            break
        n = min(path.stat().st_size, nbytes - off)
        plan.append((path, off, n))
        off += n
    if off < nbytes:
        raise SystemExit(f"the store holds {off} bytes, fewer than {nbytes}")

    def read(item: tuple[Path, int, int]) -> int:
        """Reads one file's part; returns its bytes not in the page cache."""
        path, at, n = item
        fd = os.open(path, os.O_RDONLY)
        try:
            # A file partly evicted since it was saved would make this a
            # disk read: counted (with pages the kernel is reading ahead,
            # which also refuse RWF_NOWAIT), and printed with the figure.
            try:
                got = os.preadv(fd, [memoryview(dst[at : at + n])], 0, os.RWF_NOWAIT)
            except BlockingIOError:
                got = 0
            if got < n:
                os.preadv(fd, [memoryview(dst[at + got : at + n])], got)
            return n - got
        finally:
            os.close(fd)

    out: dict[str, float] = {}
    time.sleep(settle)
    with ThreadPoolExecutor(4) as ex:
        for key in ("cold", "warm"):
            t = time.perf_counter()
            uncached = sum(ex.map(read, plan))
            out[key] = time.perf_counter() - t
            out[f"{key}_uncached_bytes"] = uncached
    assert np.any(dst[-4096:]), "nothing was read"
    return out


def cold_read_seconds(store: Path, nbytes: int, settle: float) -> dict[str, float]:
    """:func:`cold_read_child` in a new interpreter."""
    proc = subprocess.run(
        [sys.executable, __file__, "--cold-read", str(store), str(nbytes), str(settle)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def checksum_gbps(total: int = 512 << 20) -> float:
    """Speed of the checksum every load verifies (one per shard of the
    bench model: a layer's K and V of one block), on all CPUs."""
    shard = 2 * BLOCK * BENCH_SPEC.kv_heads * BENCH_SPEC.head_dim * 4
    return native_baselines.checksum_gbps(total, shard, os.cpu_count() or 1)


def memcpy_gbps(total: int = 512 << 20) -> float:
    """Bandwidth of a plain memory-to-memory copy, one thread per CPU: what
    even a load that never touches a file (the Cache tier) pays per byte."""
    import numpy as np

    src = np.full(total, 7, np.uint8)
    dst = np.ones(total, np.uint8)

    def copy(off: int, length: int) -> None:
        np.copyto(dst[off : off + length], src[off : off + length])

    return _parallel_copy_gbps(total, copy)


def vllm_own_hit(e: EngineProcess, prompt: list[int], tries: int = 2) -> tuple[float, int]:
    """Best TTFT of ``prompt`` served from vLLM's own prefix cache alone in
    engine ``e`` (the connector is told to load nothing for these requests),
    and its cached-token count."""
    best_t, cached = float("inf"), 0
    for _ in range(tries):
        out = e.call(
            op="generate", prompts=[prompt], max_tokens=1, params=[{"ucm_skip_load": True}]
        )
        best_t, cached = min(best_t, out["seconds"]), out["cached"][0]
    return best_t, cached


def lmcache_cells(r: dict[str, float]) -> str:
    """The LMCache columns of a prompt's first table row."""
    if "lmcache_mem" in r:
        t = r["lmcache_mem"]
        return f"| {t:.3f}s | {t / r['vllm_hit_plain']:.2f} |"
    if "lmcache_cached" in r:
        return f"| no load ({r['lmcache_cached']:.0f} tokens cached) | — |"
    return "| — | — |"


def lmcache_loads(
    args: argparse.Namespace,
    work: Path,
    env: dict[str, str],
    engine: Callable[..., EngineProcess],
    prompts: dict[int, list[list[int]]],
    res: dict[int, dict[str, float]],
    paged_in: Callable[[str, Path], None],
) -> str:
    """Measures LMCache's loads of prompt 0 of each length into ``res``
    (``lmcache_mem``, ``lmcache_cached``, ``lmcache_hit``); returns a line
    that says what was measured, or why not."""
    if args.lmcache_path is None:
        return "LMCache: not available (pass --lmcache-path)"
    error = lmcache_import_error(args.lmcache_path, env)
    if error is not None:
        return f"LMCache: not available from {args.lmcache_path}: {error}"
    chunk = args.lmcache_chunk
    disk = work / "lmcache-l2"
    logs = work / "logs"
    spawner = LMCacheSpawner(args.lmcache_path, env)
    # Room in memory for every prompt and the warm-up, twice over.
    l1_gib = 1 + 2 * sum(args.lengths) * KV_BYTES_PER_TOKEN / 2**30

    def server(name: str) -> LMCacheServer:
        return LMCacheServer(
            args.lmcache_path, env, disk, chunk, l1_gib, logs / f"{name}.log", l2=args.lmcache_l2
        )

    # One engine serves each prompt (LMCache misses and stores it); its
    # server has written every chunk to the file tier before it stops.
    s = server("lmcache-server-save")
    try:
        saver = engine("lmcache-save", None, (s, spawner))
        for n in args.lengths:
            t, cached = saver.ttft(prompts[n][0])
            assert cached == 0, ("LMCache save", n, cached)
            print(f"{n}: LMCache miss {t:.2f}s", flush=True)
        saver.close()
        want = sum(n // chunk for n in args.lengths)
        have = s.wait_for_files(want)
        assert have >= want, ("LMCache file tier", have, want)
    finally:
        s.close()
    os.sync()

    # A fresh server (nothing in its memory tier) and a fresh engine per
    # repeat: the KV bytes come from the files, which are in the page cache.
    for rep in range(args.repeat):
        s = server(f"lmcache-server-{rep}")
        try:
            e = engine(f"lmcache-mem-{rep}", None, (s, spawner))
            paged_in(f"LMCache engine {rep}", disk)
            for n in args.lengths:
                p = prompts[n][0]
                t, cached = e.ttft(p)
                res[n]["lmcache_cached"] = min(res[n].get("lmcache_cached", n), cached)
                if cached < n - BLOCK:
                    print(f"{n}: LMCache did not load ({cached} tokens cached)", flush=True)
                    continue
                again = min(e.ttft(p)[0] for _ in range(2))
                res[n]["lmcache_mem"] = min(res[n].get("lmcache_mem", float("inf")), t)
                res[n]["lmcache_hit"] = min(res[n].get("lmcache_hit", float("inf")), again)
                print(
                    f"{n}: LMCache mem {t:.3f}s ({cached} tokens), hit+LMCache {again:.3f}s",
                    flush=True,
                )
            e.close()
        finally:
            s.close()
    for n in args.lengths:
        # A load that failed in any fresh engine is not reported as a load.
        if res[n].get("lmcache_cached", 0) < n - BLOCK:
            res[n].pop("lmcache_mem", None)
            res[n].pop("lmcache_hit", None)
    return (
        f"LMCache: multi-process server, {chunk}-token chunks, file tier ({args.lmcache_l2}) "
        "in the page cache, "
        f"fresh server and engine per load, best of {args.repeat}; its x vLLM hit is against "
        "the engine without a connector (LMCache cannot be told to load nothing for a request)"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument(
        "--modes", nargs="+", choices=("layerwise", "wholestep"), default=["wholestep", "layerwise"]
    )
    ap.add_argument(
        "--pipelines",
        nargs="+",
        default=["Cache|Posix", "Posix"],
        help="store pipelines to load with (the first one also saves, or the first one "
        "ending in ' kept': a Cache tier kept in /dev/shm after its last process)",
    )
    ap.add_argument("--io-direct", action="store_true", help="O_DIRECT store I/O")
    ap.add_argument("--no-disk", action="store_true", help="skip the loads from a cold disk")
    ap.add_argument(
        "--dir",
        type=lambda p: Path(p).absolute(),
        default=None,
        help="store directory (default: temp)",
    )
    ap.add_argument("--model-dir", type=Path, default=REPO / ".ucm-demo" / "bench-model")
    ap.add_argument("--repeat", type=int, default=2, help="fresh engines per load measurement")
    ap.add_argument(
        "--overhead-repeat", type=int, default=2, help="prompts per length for the miss overhead"
    )
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument(
        "--chunk", type=int, default=2048, help="max_num_batched_tokens (prefill chunk size)"
    )
    ap.add_argument(
        "--lmcache-path",
        type=Path,
        default=None,
        help="directory LMCache is installed in: adds LMCache's loads (see lmcache_engine.py)",
    )
    ap.add_argument(
        "--lmcache-chunk", type=int, default=256, help="LMCache's tokens per chunk (its default)"
    )
    ap.add_argument(
        "--lmcache-l2",
        choices=("fs", "fs_native"),
        default="fs_native",
        help="LMCache's file tier: its C++ one (fs_native) or its Python one (fs)",
    )
    ap.add_argument("--cold-read", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.cold_read:
        root, nbytes, settle = args.cold_read
        print(json.dumps(cold_read_child(Path(root), int(nbytes), float(settle))))
        return 0
    assert args.lmcache_chunk % BLOCK == 0, "LMCache chunks must be whole vLLM blocks"
    native_baselines.require()

    t0 = time.time()
    model = make_tiny_llama(args.model_dir, BENCH_SPEC)
    print(f"model: {model} ({time.time() - t0:.0f}s)", flush=True)
    if args.dir:
        args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ucm-ttft-", dir=args.dir or _bench_dir()))
    store = work / "store"
    store.mkdir()
    logs = work / "logs"
    logs.mkdir()
    raw = raw_read_gbps(store)
    print(f"raw O_DIRECT sequential read: {raw:.2f} GB/s ({store})", flush=True)
    pc = pagecache_read_gbps(store)
    print(f"page-cache read: {pc:.2f} GB/s", flush=True)
    mc = memcpy_gbps()
    print(f"memory-to-memory copy, all CPUs: {mc:.2f} GB/s", flush=True)
    ck = checksum_gbps()
    print(f"load checksum, all CPUs: {ck:.2f} GB/s", flush=True)

    max_len = max(args.lengths) + 64
    llm = {
        "max_model_len": max_len,
        "max_num_batched_tokens": args.chunk,
        "enable_chunked_prefill": True,
        "kv_cache_memory_bytes": int(KV_BYTES_PER_TOKEN * max_len * 3.5),
    }
    modes = args.modes

    segment = f"ttft-{os.getpid()}"

    def ucm_config(label: str, mode: str) -> dict[str, Any]:
        pipeline, kept = split_label(label)
        cfg: dict[str, Any] = {
            "storage_backends": str(store),
            "store_pipeline": pipeline,
            "use_layerwise": mode == "layerwise",
        }
        if kept:
            cfg.update(share_buffer_enable=True, share_buffer_keep=True, unique_id=segment)
        if args.io_direct:
            cfg["io_direct"] = True
        return cfg

    rng = random.Random(7)
    # Prompt 0 of each length is stored and then loaded; the others only
    # repeat the overhead measurement.
    prompts = {n: [_tokens(rng, n) for _ in range(args.overhead_repeat)] for n in args.lengths}
    res: dict[int, dict[str, float]] = {n: {} for n in args.lengths}
    warmup = _tokens(rng, 8 * BLOCK)
    env = engine_env()

    def engine(
        name: str,
        ucm: dict[str, Any] | None,
        lmcache: tuple[LMCacheServer, EngineSpawner] | None = None,
    ) -> EngineProcess:
        t = time.time()
        cfg: dict[str, Any] = {"model": str(model), "llm": llm}
        if ucm is not None:
            cfg["ucm"] = ucm
        spawner = None
        if lmcache is not None:
            server, spawner = lmcache
            # The harness's connector is UCM's; another one goes through
            # vLLM's own kv_transfer_config argument.
            cfg["llm"] = {**llm, "kv_transfer_config": server.kv_transfer_config()}
        e = EngineProcess(cfg, logs / f"{name}.log", env=env, cwd=work, forker=spawner)
        # Warm-up: first-call costs (and, from the second connector engine
        # on, the load path) off the measurements; then let start-up
        # background work (store scans, spare files, the warm-up's saves) end.
        e.generate([warmup], max_tokens=1)
        time.sleep(3)
        print(f"engine {name} up ({time.time() - t:.0f}s)", flush=True)
        return e

    def best(n: int, key: str, value: float) -> None:
        res[n][key] = min(res[n].get(key, float("inf")), value)

    # Bytes of the files a from-memory load reads that had left the page
    # cache since they were written, per load (this VM, for one, reclaims
    # page-cache pages idle for about a minute): paged back in before it.
    paged_out: dict[str, int] = {}

    def paged_in(what: str, root: Path) -> None:
        total, missing = page_in(root)
        paged_out[what] = missing
        if missing:
            print(
                f"{what}: {missing / 2**20:.0f} MiB of {total / 2**20:.0f} MiB of files had "
                "left the page cache; read back in before loading",
                flush=True,
            )

    # 1. Recompute vs the connector at 0 % hits: both engines alive, measured
    #    alternately on the same prompts (other load on the machine hits both).
    #    The connector engine saves the prompts. Then, in the plain engine,
    #    vLLM's own hit (it recomputes the last block) and the one-token
    #    floor: the prompt plus one token, whose every full block is cached,
    #    so exactly one token is computed at full context, which is what a
    #    load from UCM computes too.
    plain = engine("no-connector", None)
    kept = [p for p in args.pipelines if split_label(p)[1]]
    saver = engine("ucm-save", ucm_config((kept or args.pipelines)[0], "wholestep"))
    for n in args.lengths:
        for i, p in enumerate(prompts[n]):
            order = [(plain, "recompute"), (saver, "ucm_miss")]
            for e, key in order if i % 2 == 0 else order[::-1]:
                out = e.generate([p], max_tokens=1)
                assert out["cached"] == [0], (key, out["cached"])
                best(n, key, out["seconds"])
                best(n, key + "_cpu", out["cpu_seconds"])
        longer = prompts[n][0] + [3]
        for _ in range(3):
            best(n, "vllm_hit_plain", plain.ttft(prompts[n][0])[0])
            t, cached = plain.ttft(longer)
            assert cached == n, ("one-token floor", n, cached)
            best(n, "one_token", t)
        r = res[n]
        print(
            f"{n}: recompute {r['recompute']:.2f}s ({r['recompute_cpu']:.2f}s CPU), "
            f"ucm miss {r['ucm_miss']:.2f}s ({r['ucm_miss_cpu']:.2f}s CPU), "
            f"vllm hit {r['vllm_hit_plain']:.3f}s, one token at full context {r['one_token']:.3f}s",
            flush=True,
        )
    save_m = saver.metrics()
    saver.close()  # flushes the saves
    plain.close()
    # The kernel writes the saved files' dirty pages back some seconds
    # later, on these same 2 cores: whichever fresh engine came first would
    # pay for it. Written back now, every pipeline loads on a quiet machine.
    os.sync()

    # The same bytes, read from the same files with no store code, in a
    # fresh process into memory zeroed as long before as an engine's KV
    # cache (its warm-up and settle): the first pass over memory idle for
    # seconds can be much slower than memcpy's repeated passes on a VM.
    for n in args.lengths:
        nbytes = (n // BLOCK) * BLOCK * KV_BYTES_PER_TOKEN
        paged_in(f"{n}: page-cache read", store)
        rd = cold_read_seconds(store, nbytes, settle=3.0)
        res[n].update(cold_read=rd["cold"], warm_read=rd["warm"])
        print(
            f"{n}: the KV bytes read from the page cache into fresh memory: first pass "
            f"{nbytes / rd['cold'] / 1e9:.2f} GB/s, second {nbytes / rd['warm'] / 1e9:.2f} GB/s"
            f" ({rd['cold_uncached_bytes'] / 2**20:.0f} MiB of it not copied without waiting:"
            " not in the page cache, or being read ahead)",
            flush=True,
        )

    # 2. Fresh engines (new processes) load prompt 0 from UCM: from memory (the
    #    saving engine's files are in the page cache), and off the disk after
    #    evicting them. Right after, the same engine serves the prompt again:
    #    vLLM's own in-memory prefix hit, measured in the same process and
    #    moment as the load it is compared with.
    load_m: dict[str, dict[str, float]] = {}
    wheres = ("mem",) if args.no_disk else ("mem", "disk")
    for pipe in args.pipelines:
        for mode in modes:
            for where in wheres if not split_label(pipe)[1] else ("mem",):
                for rep in range(args.repeat):
                    tag = pipe.replace("|", "+").replace(" ", "-")
                    e = engine(f"ucm-{tag}-{where}-{mode}-{rep}", ucm_config(pipe, mode))
                    if where == "disk":
                        gib = evict(store) / 2**30
                        print(f"evicted {gib:.2f} GiB of store files from the page cache")
                    else:
                        paged_in(f"{pipe} {mode} engine {rep}", store)
                    for n in args.lengths:
                        p = prompts[n][0]
                        t, cached = e.ttft(p)
                        assert cached >= n - BLOCK, (n, cached)
                        hit, hit_cached = vllm_own_hit(e, p)
                        assert hit_cached == (n - 1) // BLOCK * BLOCK, (n, hit_cached)
                        with_ucm = min(e.ttft(p)[0] for _ in range(2))
                        best(n, f"{pipe}/{where}_{mode}", t)
                        best(n, f"{pipe}/{where}_{mode}_hit", hit)
                        best(n, f"{pipe}/{where}_{mode}_hit_ucm", with_ucm)
                        print(
                            f"{n}: {pipe} {where} {mode}: UCM {t:.3f}s ({cached} tokens), "
                            f"vLLM hit {hit:.3f}s ({hit_cached} tokens), "
                            f"hit+ucm {with_ucm:.3f}s",
                            flush=True,
                        )
                    load_m[f"{pipe}/{where}_{mode}"] = e.metrics()
                    e.close()

    lmc_note = lmcache_loads(args, work, env, engine, prompts, res, paged_in)

    print()
    print(
        f"raw O_DIRECT read {raw:.2f} GB/s, page-cache read {pc:.2f} GB/s, memcpy {mc:.2f} GB/s, "
        f"load checksum {ck:.2f} GB/s, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.1f}; "
        f"best of {args.repeat} fresh engines per cell"
    )
    print(
        "floor = one token computed at full context + KV bytes / memcpy bandwidth; "
        "verified floor = one token + KV bytes / page-cache read + KV bytes / checksum; "
        "cold floor = one token + the first pass of those bytes from the page cache into "
        "fresh memory (no store code); "
        "UCM mem = a fresh engine loading from the page cache or the Cache tier; "
        "its vLLM hit = the same engine right after, from vLLM's own prefix cache "
        "(ucm_skip_load), the x hit baseline"
    )
    print(
        "| prompt | recompute | UCM miss overhead: wall, CPU | vLLM hit | one token | floor "
        "| pc floor | verified floor | cold floor "
        "| pipeline | mode | UCM mem | its vLLM hit | x hit | x floor | x verified floor "
        "| x cold floor "
        "| UCM disk | disk - hit "
        "| KV bytes / raw BW | LMCache mem | LMCache x vLLM hit |"
    )
    print("|" + "---|" * 22)
    for n in args.lengths:
        r = res[n]
        nbytes = (n // BLOCK) * BLOCK * KV_BYTES_PER_TOKEN
        bound = nbytes / (raw * 1e9) if raw == raw and raw > 0 else float("nan")
        floor = r["one_token"] + nbytes / (mc * 1e9)
        pc_floor = r["one_token"] + nbytes / (pc * 1e9)
        verified_floor = pc_floor + nbytes / (ck * 1e9)
        cold_floor = r["one_token"] + r["cold_read"]
        r.update(
            kv_bytes=nbytes,
            raw_bound=bound,
            floor=floor,
            pc_floor=pc_floor,
            verified_floor=verified_floor,
            cold_floor=cold_floor,
        )
        first = True
        for pipe in args.pipelines:
            for mode in modes:
                mem, mem_hit = r[f"{pipe}/mem_{mode}"], r[f"{pipe}/mem_{mode}_hit"]
                if f"{pipe}/disk_{mode}" not in r:
                    disk_cells = "| — | — | — "
                else:
                    disk, disk_hit = r[f"{pipe}/disk_{mode}"], r[f"{pipe}/disk_{mode}_hit"]
                    above = disk - disk_hit
                    disk_cells = (
                        f"| {disk:.3f}s | {above:.3f}s | {bound:.3f}s ({nbytes / 2**20:.0f} MiB) "
                    )
                lmc = "| | |" if not first else lmcache_cells(r)
                head = (
                    f"| {n} | {r['recompute']:.2f}s | "
                    f"{(r['ucm_miss'] / r['recompute'] - 1) * 100:+.1f}%, "
                    f"{(r['ucm_miss_cpu'] / r['recompute_cpu'] - 1) * 100:+.1f}% "
                    f"| {r['vllm_hit_plain']:.3f}s | {r['one_token']:.3f}s | {floor:.3f}s "
                    f"| {pc_floor:.3f}s | {verified_floor:.3f}s | {cold_floor:.3f}s"
                    if first
                    else "| | | | | | | | |"
                )
                first = False
                cell = pipe.replace("|", "\\|")  # a table cell
                print(
                    f"{head} | {cell} | {mode} | {mem:.3f}s | {mem_hit:.3f}s | {mem / mem_hit:.2f} "
                    f"| {mem / floor:.2f} | {mem / verified_floor:.2f} | {mem / cold_floor:.2f} "
                    f"{disk_cells}{lmc}"
                )
    print()
    # The part of the floor target that physics on this host leaves to loads
    # out of the page cache, i.e. every pipeline but a kept segment.
    ceiling = ", ".join(f"{n}: {res[n]['pc_floor'] / res[n]['floor']:.2f} x" for n in args.lengths)
    print(
        f"pc floor / floor: {ceiling}; no load out of the page cache can come nearer "
        "the floor than this (only a kept /dev/shm segment loads by memcpy)"
    )
    print(
        f"saving engine: {save_m.get('ucm_save_blocks_total', 0):.0f} blocks saved at "
        f"{save_m.get('ucm_save_speed_gbps', 0):.2f} GB/s"
    )
    for key, m in load_m.items():
        print(f"{key}: last loads at {m.get('ucm_load_speed_gbps', 0):.2f} GB/s")
    print(lmc_note)
    out = {k: v for k, v in paged_out.items() if v}
    print(
        "files paged back in before loads from memory: "
        + (", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in out.items()) or "none had left")
    )
    if any("lmcache_mem" in res[n] for n in args.lengths):
        for n in args.lengths:
            r = res[n]
            if "lmcache_mem" not in r:
                continue
            # The first pipeline in its first mode is what a user runs by
            # default (Cache|Posix, whole-step): that is the comparison.
            first = f"{args.pipelines[0]}/mem_{modes[0]}"
            ucm = r[first]
            print(
                f"{n}: against the vLLM hit of the engine without a connector "
                f"({r['vllm_hit_plain']:.3f}s): LMCache mem {r['lmcache_mem']:.3f}s "
                f"= {r['lmcache_mem'] / r['vllm_hit_plain']:.2f} x, UCM {first} "
                f"{ucm:.3f}s = {ucm / r['vllm_hit_plain']:.2f} x, "
                f"UCM / LMCache {ucm / r['lmcache_mem']:.2f}"
            )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "raw_gbps": raw,
                    "pagecache_gbps": pc,
                    "memcpy_gbps": mc,
                    "checksum_gbps": ck,
                    "modes": modes,
                    "pipelines": args.pipelines,
                    "lmcache": lmc_note,
                    "paged_out_bytes": paged_out,
                    "results": res,
                }
            )
        )
    shutil.rmtree(store, ignore_errors=True)
    Path(f"/dev/shm/ucm_cache_{segment}").unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
