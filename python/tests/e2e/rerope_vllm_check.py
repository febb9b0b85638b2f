"""ReRoPE on vLLM (CPU build), run by ``test_rerope_vllm.py`` in a child process.

A random tiny Llama whose checkpoint says ``max_position_embeddings: 512``
serves a 2048-token prompt with ReRoPE (W = 128, L = 512). The same prompt
goes through the torch reference stack with the same weights, with and
without ReRoPE, and through vLLM again after the patch is uninstalled.
Prints one JSON line prefixed with ``@@RESULT@@``.

Usage: ``python rerope_vllm_check.py MODEL_DIR [--connector STORE_DIR]``.

With ``--connector`` ReRoPE is not installed by hand: the UCM connector
installs it from its config (``ucm_sparse_config: {ReRoPE: ...}``) and the
prompt is served twice, the second time loading its prefix from the store
(K and V only; the connector derives K2 of the loaded blocks).
"""

from __future__ import annotations

import json
import random
import sys

from ucm.vllm_demo.engine_process import prepare_engine_child

prepare_engine_child()

PROMPT_LEN = 2048
MAX_TOKENS = 8
WINDOW, TRAINING = 128, 512


def engine_args(model_dir: object) -> dict:
    """The engine: the model raised to 4096 positions, a small KV cache."""
    return dict(
        model=str(model_dir),
        dtype="float32",
        enforce_eager=True,
        block_size=32,
        max_model_len=4096,
        hf_overrides={"max_position_embeddings": 4096},
        kv_cache_memory_bytes=32 << 20,
        enable_prefix_caching=False,
        seed=0,
    )


def main() -> None:
    import torch
    from support import refmodel as rm

    from ucm.integration.vllm.sparse.rerope import install_rerope
    from ucm.sparse.kernels.rope import rope_cos_sin_cache
    from ucm.sparse.rerope.config import ReRoPEConfig
    from ucm.vllm_demo.tiny_model import TinyModelSpec, make_tiny_llama

    model_dir = make_tiny_llama(sys.argv[1], TinyModelSpec(max_positions=TRAINING))
    if len(sys.argv) > 3 and sys.argv[2] == "--connector":
        return connector_main(model_dir, sys.argv[3])
    from vllm import LLM, SamplingParams

    llm = LLM(**engine_args(model_dir))
    cfg = ReRoPEConfig(rerope_window=WINDOW, training_length=TRAINING)

    def same_table(model: torch.nn.Module) -> bool:
        rot = model.model.layers[0].self_attn.rotary_emb
        return torch.equal(rot.cos_sin_cache, rope_cos_sin_cache(rot.rotary_dim, 4096))

    rng = random.Random(0)
    prompt = [rng.randrange(4, 512) for _ in range(PROMPT_LEN)]
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=1)
    inst = install_rerope(llm, cfg)
    out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0].outputs[0]
    rerope_tokens = list(out.token_ids)
    rerope_lp = [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids, strict=True)]
    calls = dict(inst.agent.calls)
    mem = inst.agent.memory_report()
    inst.uninstall()
    native = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0].outputs[0]

    ref_model = rm.TinyLlama.from_pretrained(model_dir, max_positions=4096)
    blocks = (PROMPT_LEN + MAX_TOKENS) // 32 + 2
    res = {}
    for name, rcfg in (("rerope", cfg), ("plain", None)):
        cache = rm.PagedKV(ref_model.spec, blocks, 32, k2=rcfg is not None)
        r = rm.full_prefill(ref_model, cache, prompt, rerope=rcfg)
        first_lp = float(r.logits.log_softmax(-1).max())
        res[name] = (
            rm.decode(ref_model, cache, r.seq, r.logits, MAX_TOKENS, rerope=rcfg),
            first_lp,
        )
    result = {
        "same_rotary_table": all(llm.apply_model(same_table)),
        "layers": inst.layers,
        "calls": calls,
        "memory": mem,
        "rerope_tokens": rerope_tokens,
        "rerope_first_logprob": rerope_lp[0],
        "native_tokens": list(native.token_ids),
        "ref_rerope_tokens": res["rerope"][0],
        "ref_rerope_first_logprob": res["rerope"][1],
        "ref_plain_tokens": res["plain"][0],
        "prompt_len": len(prompt),
    }
    print("@@RESULT@@ " + json.dumps(result), flush=True)


def reference_tokens(model_dir: object, prompt: list[int]) -> tuple[list[int], float]:
    """Greedy tokens and first log probability of the torch reference stack with ReRoPE."""
    from support import refmodel as rm

    from ucm.sparse.rerope.config import ReRoPEConfig

    cfg = ReRoPEConfig(rerope_window=WINDOW, training_length=TRAINING)
    ref_model = rm.TinyLlama.from_pretrained(model_dir, max_positions=4096)
    cache = rm.PagedKV(ref_model.spec, (PROMPT_LEN + MAX_TOKENS) // 32 + 2, 32, k2=True)
    r = rm.full_prefill(ref_model, cache, prompt, rerope=cfg)
    lp = float(r.logits.log_softmax(-1).max())
    return rm.decode(ref_model, cache, r.seq, r.logits, MAX_TOKENS, rerope=cfg), lp


def connector_main(model_dir: object, store: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from ucm.vllm_demo.engine_process import CONNECTOR

    ucm = {
        "storage_backends": store,
        "store_pipeline": "Posix",
        "ucm_sparse_config": {"ReRoPE": {"rerope_window": WINDOW, "training_length": TRAINING}},
    }
    llm = LLM(
        **engine_args(model_dir),
        kv_transfer_config=KVTransferConfig(**CONNECTOR, kv_connector_extra_config=ucm),
    )
    rng = random.Random(0)
    prompt = [rng.randrange(4, 512) for _ in range(PROMPT_LEN)]
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=1)
    inst = get_kv_transfer_group().sparse.patch
    runs = []
    for _ in range(2):
        out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
        o = out.outputs[0]
        runs.append(
            {
                "tokens": list(o.token_ids),
                "first_logprob": o.logprobs[0][o.token_ids[0]].logprob,
                "cached": out.num_cached_tokens or 0,
                "rebuilt_blocks": inst.rebuilt_blocks,
            }
        )
    ref_tokens, ref_lp = reference_tokens(model_dir, prompt)
    result = {
        "layers": inst.layers,
        "runs": runs,
        "ref_tokens": ref_tokens,
        "ref_first_logprob": ref_lp,
        "prompt_len": len(prompt),
    }
    print("@@RESULT@@ " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
