"""ESA, GSA and KVStar inside vLLM (CPU build), run by ``test_sparse_vllm.py`` in a child process.

Usage: ``python sparse_vllm_check.py MODEL_DIR WORK_DIR SCENARIO`` with SCENARIO

* ``exact``: a dense run, then ESA, GSA and KVStar at ``sparse_ratio: 1.0``
  (GSA with its thresholds reached, so its sparse path runs over all
  blocks), then the hooks' removal after shutdown and a dense run again;
* ``offload``: an 8k-token prompt dense, with ESA at ``sparse_ratio: 0.3``
  reading the selected blocks in place (``kv_role: kv_consumer``: nothing is
  saved, so nothing can be offloaded), and with ESA at 0.3 offloading
  (``kv_both``): the unselected blocks leave device KV and the selected ones
  come back from the store; then two requests served together (mixed
  prefill/decode batches), also with KVStar in place and offloading;
* ``gsa_load``: GSA at ``sparse_ratio: 0.3`` computing its prompts and
  saving them, then a fresh engine loading them from the store: the blocks
  each decode step selects (recorded by a ``GSA`` subclass) must be the same;
* ``readme``: the user method of ``docs/user-guide/sparse.md`` (its two code
  blocks as they stand: the method's file, then its registration and config),
  dense, with a window that covers every block, and with the example's config.

Engines run one after another in this process (in-process engine core), each
with its own store directory. Prints one JSON line prefixed ``@@RESULT@@``.
"""

from __future__ import annotations

import collections
import json
import random
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

from ucm.vllm_demo.engine_process import prepare_engine_child

prepare_engine_child()

# After the environment: ucm.sparse reads TRITON_INTERPRET when imported.
from ucm.sparse.base import AttentionCall, UcmSparseBase  # noqa: E402
from ucm.sparse.gsa import GSA  # noqa: E402

BLOCK = 32
SPEC = {"layers": 2, "hidden": 256, "heads": 4, "kv_heads": 2, "intermediate": 512}


class CountingSparse(UcmSparseBase):
    """A user method registered at run time: counts its hooks, attends densely."""

    calls: collections.Counter = collections.Counter()

    def request_begin(self, request_id: str, prompt_token_ids: list[int]) -> None:
        self.calls["request_begin"] += 1

    def request_finished_in_scheduler(self, request_id: str) -> None:
        self.calls["request_finished_in_scheduler"] += 1

    def request_finished_in_worker(self, request_id: str) -> None:
        self.calls["request_finished_in_worker"] += 1

    def build_sparse_meta(self, scheduler_output: Any, *args: Any, **kw: Any) -> Any:
        self.calls["build_sparse_meta"] += 1
        return super().build_sparse_meta(scheduler_output)

    def attention_begin(self, call: AttentionCall) -> AttentionCall:
        # Counts only calls inside a step (between build_sparse_meta and execute_finished).
        self.calls["attention_begin"] += int(self.has_sparse_metadata())
        return call

    def attention_finished(self, call: AttentionCall) -> None:
        self.calls["attention_finished"] += 1


class Run:
    def __init__(self, model: Path, work: Path, name: str, sparse: dict | None, **kw: Any) -> None:
        from vllm import LLM
        from vllm.config import KVTransferConfig

        extra: dict[str, Any] = {"storage_backends": str(work / f"store-{name}")}
        if sparse is not None:
            extra["ucm_sparse_config"] = sparse
        role = kw.pop("kv_role", "kv_both")
        args: dict[str, Any] = dict(
            model=str(model),
            dtype="float32",
            enforce_eager=True,
            block_size=BLOCK,
            max_model_len=kw.pop("max_model_len", 4096),
            kv_cache_memory_bytes=64 << 20,
            enable_prefix_caching=False,
            seed=0,
            disable_log_stats=False,  # per-request timestamps (decode tokens/s)
            kv_transfer_config=KVTransferConfig(
                kv_connector="UCMConnector",
                kv_connector_module_path="ucm.integration.vllm.ucm_connector",
                kv_role=role,
                kv_connector_extra_config=extra,
            ),
        )
        args.update(kw)
        self.llm = LLM(**args)
        core = self.llm.llm_engine.engine_core.engine_core
        self.scheduler = core.scheduler
        self.connector = self.scheduler.connector
        worker = core.model_executor.driver_worker.worker
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        self.worker_connector = get_kv_transfer_group()
        ctx = worker.model_runner.vllm_config.compilation_config.static_forward_context
        self.impls = [layer.impl for layer in ctx.values() if hasattr(layer, "impl")]

    def generate(self, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
        from vllm import SamplingParams

        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        secs = time.perf_counter() - t0
        self.cached = [o.num_cached_tokens for o in outs]
        m = outs[0].metrics
        self.decode_tps = None
        if m is not None and m.last_token_ts > m.first_token_ts:
            self.decode_tps = (max_tokens - 1) / (m.last_token_ts - m.first_token_ts)
        return [list(o.outputs[0].token_ids) for o in outs], secs

    def worker_stats(self) -> dict[str, int]:
        bridge = getattr(self.worker_connector, "_sparse", None)
        return dict(bridge.stats) if bridge is not None else {}

    def close(self) -> dict[str, Any]:
        """Shuts the engine down; reports whether every hook was removed."""
        from ucm.integration.vllm.sparse import state
        from ucm.integration.vllm.sparse.hooks import is_wrapped

        kvm = self.scheduler.kv_cache_manager
        was = {
            "impl_wrapped": sum(is_wrapped(i.forward) for i in self.impls),
            "alloc_wrapped": is_wrapped(kvm.allocate_slots),
        }
        self.llm.llm_engine.engine_core.shutdown()
        from vllm.distributed.kv_transfer import ensure_kv_transfer_shutdown

        ensure_kv_transfer_shutdown()
        after = {
            "impl_wrapped": sum(is_wrapped(i.forward) for i in self.impls),
            "alloc_wrapped": is_wrapped(kvm.allocate_slots),
            "agent": state.has_ucm_sparse(),
        }
        del self.llm
        import gc

        gc.collect()
        return {"before": was, "after": after}


def scenario_exact(model: Path, work: Path) -> dict[str, Any]:
    rng = random.Random(1)
    prompts = [[rng.randrange(4, 512) for _ in range(n)] for n in (700, 1000, 333)]
    res: dict[str, Any] = {}
    dense = Run(model, work, "dense", None)
    res["dense"], _ = dense.generate(prompts, 8)
    res["dense_close"] = dense.close()
    cases = {
        "ESA": {"ESA": {"sparse_ratio": 1.0, "async_retrieval": False}},
        "KVStar": {"KVStar": {"sparse_ratio": 1.0}},
        "GSA": {
            "GSA": {
                "sparse_ratio": 1.0,
                "seq_len_threshold": 256,
                "concurrency_threshold": 1,
                "rollback_layers": [0],
            }
        },
        # Thresholds never reached (3 long requests < 4): dense every step.
        "GSA_gated": {
            "GSA": {"sparse_ratio": 0.3, "seq_len_threshold": 256, "concurrency_threshold": 4}
        },
        # Really sparse: keeps 30 % of the blocks (at least sink + recent).
        "GSA_03": {
            "GSA": {
                "sparse_ratio": 0.3,
                "seq_len_threshold": 256,
                "concurrency_threshold": 1,
                "rollback_layers": [0],
            }
        },
    }
    for name, cfg in cases.items():
        r = Run(model, work, name, cfg)
        res[name], _ = r.generate(prompts, 8)
        res[f"{name}_stats"] = r.worker_stats()
        res[f"{name}_close"] = r.close()
    # A method registered by the user (module path, class name) gets the generic hooks.
    from ucm.sparse.factory import UcmSparseFactory

    UcmSparseFactory.register_sparse_method("Counting", "sparse_vllm_check", "CountingSparse")
    import sparse_vllm_check as me  # the module the factory imports (not __main__)

    r = Run(model, work, "counting", {"Counting": {}})
    res["Counting"], _ = r.generate(prompts, 8)
    # Workers hear of finished requests with the next step (as vLLM's runner does).
    r.generate(prompts[2:], 1)
    res["Counting_close"] = r.close()
    res["Counting_calls"] = dict(me.CountingSparse.calls)
    again = Run(model, work, "dense2", None)
    res["dense_after"], _ = again.generate(prompts, 8)
    again.close()
    return res


def scenario_offload(model: Path, work: Path) -> dict[str, Any]:
    from ucm.integration.vllm.sparse import offload

    rng = random.Random(2)
    prompt = [rng.randrange(4, 512) for _ in range(8192)]
    # Two more, served together with a 2048-token step budget: the first one
    # decodes while the second is still being prefilled (mixed batches).
    pair = [[rng.randrange(4, 512) for _ in range(n)] for n in (4096, 3000)]
    n_out = 16
    esa = {"ESA": {"sparse_ratio": 0.3, "retrieval_stride": 5, "async_retrieval": True}}
    # Prefix caching on (vLLM's default): the swap blocks must leave it.
    kw = {"max_model_len": 8192 + 64, "max_num_batched_tokens": 2048, "enable_prefix_caching": True}
    res: dict[str, Any] = {"prompt_len": len(prompt), "decode_tokens": n_out}
    kvstar = {"KVStar": {"sparse_ratio": 0.3, "retrieval_stride": 4}}
    for name, sparse, role in (
        ("dense", None, "kv_both"),
        ("inplace", esa, "kv_consumer"),
        ("offload", esa, "kv_both"),
        ("kvstar_inplace", kvstar, "kv_consumer"),
        ("kvstar_offload", kvstar, "kv_both"),
    ):
        r = Run(model, work, name, sparse, kv_role=role, **kw)
        if name.startswith("kvstar"):  # KVStar: the pair only (delayed delta loads)
            res[f"{name}_pair"], _ = r.generate(pair, n_out)
            res[f"{name}_pair_stats"] = r.worker_stats()
            r.close()
            continue
        (toks,), secs = r.generate([prompt], n_out)
        res[name] = toks
        res[f"{name}_seconds"] = secs
        res[f"{name}_decode_tps"] = r.decode_tps
        res[f"{name}_stats"] = r.worker_stats()
        if name == "offload":
            _rid, fp = offload.FINISHED_FOOTPRINTS[-1]
            res["footprint"] = {
                "prompt_len": fp.prompt_len,
                "compressed": fp.compressed,
                "max_decode_held": fp.max_decode_held,
                "max_decode_dense": fp.max_decode_dense,
                "max_budget_blocks": fp.max_budget_blocks,
            }
            res["block_bytes"] = r.connector.geometry.block_bytes  # one block, all layers
        if name == "offload":
            # Again: init blocks hit vLLM's prefix cache, the rest hits the store.
            (res["offload_again"],), _ = r.generate([prompt], n_out)
            res["offload_again_stats"] = r.worker_stats()
        res[f"{name}_pair"], _ = r.generate(pair, n_out)
        res[f"{name}_pair_stats"] = r.worker_stats()
        r.close()
    return res


class RecordingGSA(GSA):
    """GSA that records, per decode row and layer, the logical blocks it selects."""

    selections: ClassVar[list[tuple[int, int, list[int]]]] = []

    def select(self, layer, query, block_table, seq_lens):  # type: ignore[no-untyped-def]
        out = super().select(layer, query, block_table, seq_lens)
        if out is not None:
            table, lens = out
            for i in range(table.shape[0]):
                row = block_table[i].tolist()
                kept = -(-int(lens[i]) // BLOCK)
                logical = [row.index(int(b)) for b in table[i, :kept]]
                self.selections.append((layer, int(seq_lens[i]), logical))
        return out


def scenario_gsa_load(model: Path, work: Path) -> dict[str, Any]:
    from ucm.sparse.factory import UcmSparseFactory

    UcmSparseFactory.register_sparse_method("RecordingGSA", "sparse_vllm_check", "RecordingGSA")
    import sparse_vllm_check as me  # the module the factory imports (not __main__)

    rng = random.Random(5)
    prompts = [[rng.randrange(4, 512) for _ in range(n)] for n in (700, 1000, 333)]
    cfg = {
        "RecordingGSA": {
            "sparse_ratio": 0.3,
            "seq_len_threshold": 256,
            "concurrency_threshold": 1,
            "rollback_layers": [0],
        }
    }
    res: dict[str, Any] = {}
    for label in ("computed", "loaded"):
        me.RecordingGSA.selections.clear()
        r = Run(model, work, "gsa-load", cfg)  # one store: the second engine loads
        res[label], _ = r.generate(prompts, 8)
        res[f"{label}_stats"] = r.worker_stats()
        res[f"{label}_selections"] = sorted(me.RecordingGSA.selections)
        res[f"{label}_cached"] = r.cached
        r.close()
    return res


def readme_user_method() -> tuple[str, str]:
    """The user-method example of the sparse page: the method's file and its registration."""
    text = (Path(__file__).resolve().parents[3] / "docs/user-guide/sparse.md").read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    method = next(b for b in blocks if b.startswith("# my_sparse.py"))
    register = next(b for b in blocks if "register_sparse_method(" in b)
    return method, register


def scenario_readme(model: Path, work: Path) -> dict[str, Any]:
    method, register = readme_user_method()
    (work / "my_sparse.py").write_text(method)
    sys.path.insert(0, str(work))  # where the user's module lives
    namespace: dict[str, Any] = {}
    exec(register, namespace)
    sparse = namespace["extra_config"]["ucm_sparse_config"]
    ((name, _),) = sparse.items()
    rng = random.Random(3)
    prompts = [[rng.randrange(4, 512) for _ in range(n)] for n in (700, 1000, 333)]
    res: dict[str, Any] = {}
    for label, cfg in (
        ("dense", None),
        ("wide", {name: {"recent_blocks": 1000}}),  # every block: the dense attention
        ("readme", sparse),
    ):
        r = Run(model, work, label, cfg)
        res[label], _ = r.generate(prompts, 8)
        res[f"{label}_close"] = r.close()
    return res


def main() -> None:
    from ucm.vllm_demo.tiny_model import TinyModelSpec, make_tiny_llama

    model = make_tiny_llama(sys.argv[1], TinyModelSpec(**SPEC))
    work = Path(sys.argv[2])
    scenario = sys.argv[3]
    fn = {
        "exact": scenario_exact,
        "offload": scenario_offload,
        "gsa_load": scenario_gsa_load,
        "readme": scenario_readme,
    }[scenario]
    res = fn(model, work)
    print("@@RESULT@@ " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
