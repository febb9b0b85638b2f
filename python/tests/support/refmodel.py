"""A small Llama-style decoder in plain torch, with vLLM's CPU paged KV layout.

It exists to test Blend and ReRoPE end to end without vLLM: the decoder
layer mirrors vLLM's Llama (fused residual-add RMSNorm, GQA attention with
NeoX RoPE from a ``cos_sin_cache``, SwiGLU MLP), the KV cache of each layer is
a ``[num_blocks, H_kv, B, 2D]`` tensor in the CPU backend's layout (K stored
transposed), and a sparse method's hooks are called where vLLM calls them
(``layer_begin``, ``attention_begin`` before the layer's KV write,
``sparse_attention``, ``ffn_begin`` before the post-attention norm,
``execute_finished``).

* :class:`TinyLlama` -- random weights, or a Hugging Face Llama checkpoint
  (``from_pretrained``; e.g. the one :mod:`ucm.vllm_demo.tiny_model`
  writes) so its outputs can be compared with vLLM's;
* :class:`PagedKV` -- per-layer paged caches and a trivial block allocator;
* :class:`DictStore` -- an in-memory block store (``lookup``,
  ``lookup_on_prefix``, per-layer K/V blocks);
* :class:`Request` -- a request's tokens and blocks;
* :func:`serve_prefill` / :func:`full_prefill` / :func:`decode` -- a request through the store:
  plan (Blend), load (+ delta-RoPE), compute, dump.

Test and benchmark tooling (the tests' ``support`` package), not product API.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ucm.sparse.base import AttentionCall, LayerRows, UcmSparseBase
from ucm.sparse.blend.chunks import BlendMode, BlendPlan, plan_request
from ucm.sparse.blend.config import BlendConfig
from ucm.sparse.blend.method import Blend, build_step
from ucm.sparse.kernels import attention, keys
from ucm.sparse.kernels.dispatch import Impl
from ucm.sparse.kernels.rope import apply_rope, rope_cos_sin_cache
from ucm.sparse.kernels.views import kv_views
from ucm.sparse.rerope.config import ReRoPEConfig
from ucm.sparse.rerope.reference import rerope_prepare
from ucm.vllm_demo.tiny_model import TinyModelSpec


@dataclass(frozen=True)
class TinyLlamaSpec(TinyModelSpec):
    """The shape of the model (:class:`~ucm.vllm_demo.tiny_model.TinyModelSpec`)
    and what the reference computes with beyond it."""

    head_size: int | None = None
    """The checkpoint's ``head_dim`` where it is not ``hidden / heads``."""
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    rotary_dim: int | None = None
    is_neox: bool = True
    init_std: float = 0.06

    @property
    def head_dim(self) -> int:
        return self.head_size or super().head_dim

    @property
    def rot(self) -> int:
        return self.rotary_dim or self.head_dim


def layer_name(i: int) -> str:
    """vLLM's name of layer ``i``'s attention."""
    return f"model.layers.{i}.self_attn.attn"


class TinyLlama:
    """Weights and the per-layer math; state lives in :class:`PagedKV`."""

    def __init__(self, spec: TinyLlamaSpec, weights: Mapping[str, torch.Tensor] | None = None):
        self.spec = spec
        if weights is None:
            weights = self._random(spec)
        self.w = {k: v.float() for k, v in weights.items()}
        self.cos_sin_cache = rope_cos_sin_cache(spec.rot, spec.max_positions, spec.rope_theta)

    @staticmethod
    def _random(spec: TinyLlamaSpec) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(spec.seed)

        def rnd(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g) * spec.init_std

        d, hq, hk = spec.head_dim, spec.heads, spec.kv_heads
        w = {
            "model.embed_tokens.weight": rnd(spec.vocab, spec.hidden),
            "model.norm.weight": torch.ones(spec.hidden),
            "lm_head.weight": rnd(spec.vocab, spec.hidden),
        }
        for i in range(spec.layers):
            p = f"model.layers.{i}."
            w[p + "self_attn.q_proj.weight"] = rnd(hq * d, spec.hidden)
            w[p + "self_attn.k_proj.weight"] = rnd(hk * d, spec.hidden)
            w[p + "self_attn.v_proj.weight"] = rnd(hk * d, spec.hidden)
            w[p + "self_attn.o_proj.weight"] = rnd(spec.hidden, hq * d)
            w[p + "mlp.gate_proj.weight"] = rnd(spec.intermediate, spec.hidden)
            w[p + "mlp.up_proj.weight"] = rnd(spec.intermediate, spec.hidden)
            w[p + "mlp.down_proj.weight"] = rnd(spec.hidden, spec.intermediate)
            w[p + "input_layernorm.weight"] = torch.ones(spec.hidden)
            w[p + "post_attention_layernorm.weight"] = torch.ones(spec.hidden)
        return w

    @classmethod
    def from_pretrained(cls, path: str | Path, max_positions: int | None = None) -> TinyLlama:
        """Loads a Hugging Face Llama checkpoint (``config.json`` + safetensors)."""
        from safetensors.torch import load_file

        path = Path(path)
        cfg = json.loads((path / "config.json").read_text())
        spec = TinyLlamaSpec(
            vocab=cfg["vocab_size"],
            hidden=cfg["hidden_size"],
            layers=cfg["num_hidden_layers"],
            heads=cfg["num_attention_heads"],
            kv_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
            head_size=cfg.get("head_dim"),
            intermediate=cfg["intermediate_size"],
            rope_theta=float(
                cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
            ),
            rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_positions=max_positions or cfg.get("max_position_embeddings", 2048),
        )
        weights: dict[str, torch.Tensor] = {}
        for f in sorted(path.glob("*.safetensors")):
            weights.update(load_file(str(f)))
        if "lm_head.weight" not in weights:
            weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
        return cls(spec, weights)

    # ------------------------------------------------------------------ pieces

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + self.spec.rms_eps) * self.w[name]

    def _add_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, name: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = x if residual is None else x + residual
        return self._norm(residual, name), residual

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.w["model.embed_tokens.weight"][tokens.long()]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.w["lm_head.weight"].T

    def qkv(self, i: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s, p = self.spec, f"model.layers.{i}.self_attn."
        q = (x @ self.w[p + "q_proj.weight"].T).view(-1, s.heads, s.head_dim)
        k = (x @ self.w[p + "k_proj.weight"].T).view(-1, s.kv_heads, s.head_dim)
        v = (x @ self.w[p + "v_proj.weight"].T).view(-1, s.kv_heads, s.head_dim)
        return q, k, v

    def mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        p = f"model.layers.{i}.mlp."
        gate = x @ self.w[p + "gate_proj.weight"].T
        up = x @ self.w[p + "up_proj.weight"].T
        return (torch.nn.functional.silu(gate) * up) @ self.w[p + "down_proj.weight"].T


class PagedKV:
    """Per-layer paged KV in vLLM's CPU layout, plus ReRoPE's un-rotated-key caches."""

    def __init__(self, spec: TinyLlamaSpec, num_blocks: int, block_size: int, k2: bool = False):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv = {
            layer_name(i): torch.zeros(num_blocks, spec.kv_heads, block_size, 2 * spec.head_dim)
            for i in range(spec.layers)
        }
        self.k2 = (
            {
                layer_name(i): torch.zeros(num_blocks, block_size, spec.kv_heads, spec.head_dim)
                for i in range(spec.layers)
            }
            if k2
            else {}
        )
        self._free = list(range(num_blocks))

    def views(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        return kv_views(self.kv[name])

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"out of KV blocks: need {n}, {len(self._free)} free")
        out, self._free = self._free[:n], self._free[n:]
        return out

    def free(self, blocks: Sequence[int]) -> None:
        self._free.extend(blocks)


@dataclass
class StepMeta:
    """The attention metadata of one step (one sequence here), like vLLM's."""

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    num_actual_tokens: int
    max_query_len: int


@dataclass
class Request:
    """One request's device state."""

    tokens: list[int]
    blocks: list[int] = field(default_factory=list)

    def slots(self, start: int, end: int, block_size: int) -> torch.Tensor:
        p = torch.arange(start, end)
        table = torch.tensor(self.blocks, dtype=torch.int64)
        return table[p // block_size] * block_size + p % block_size


def forward(
    model: TinyLlama,
    cache: PagedKV,
    seq: Request,
    start: int,
    agent: UcmSparseBase | None = None,
    rerope: ReRoPEConfig | None = None,
    impl: Impl = "torch",
) -> torch.Tensor:
    """Computes ``seq.tokens[start:]`` against the cached ``[0, start)``; returns the last logits.

    Hooks of ``agent`` are called as vLLM calls them (module doc). With
    ``rerope`` the attention is ReRoPE (q log-n scaled, ``k2`` cached).
    """
    s, b = model.spec, cache.block_size
    n = len(seq.tokens)
    need = -(-n // b)
    if len(seq.blocks) < need:
        seq.blocks += cache.allocate(need - len(seq.blocks))
    positions = torch.arange(start, n)
    slots = seq.slots(start, n, b)
    meta = StepMeta(
        slot_mapping=slots,
        query_start_loc=torch.tensor([0, n - start], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_table=torch.tensor([seq.blocks], dtype=torch.int32),
        num_actual_tokens=n - start,
        max_query_len=n - start,
    )
    hidden = model.embed(torch.tensor(seq.tokens[start:]))
    residual: torch.Tensor | None = None
    logits_idx = torch.tensor([n - start - 1])
    scale = 1.0 / math.sqrt(s.head_dim)
    for i in range(s.layers):
        name = layer_name(i)
        pos = positions
        if agent is not None:
            pos, hidden, residual = agent.layer_begin(i, LayerRows(positions, hidden, residual))
        x, residual = model._add_norm(hidden, residual, f"model.layers.{i}.input_layernorm.weight")
        q, k, v = model.qkv(i, x)
        if rerope is not None:
            q, q_w, k, k2 = rerope_prepare(
                q,
                k,
                pos,
                model.cos_sin_cache,
                rerope.rerope_window,
                rerope.training_length if rerope.log_n_scaling else None,
                s.is_neox,
            )
        else:
            q = apply_rope(q, pos, model.cos_sin_cache, s.is_neox)
            k = apply_rope(k, pos, model.cos_sin_cache, s.is_neox)
        out = torch.empty_like(q)
        call = AttentionCall(name, q, k, v, meta, out, kv_cache=cache.kv[name], scale=scale)
        if agent is not None:
            call = agent.attention_begin(call)
        q, k, v, out = call.query, call.key, call.value, call.output
        k_view, v_view = cache.views(name)
        attention.write_kv(k_view, k, meta.slot_mapping)
        attention.write_kv(v_view, v, meta.slot_mapping)
        paged = (q, k_view, v_view, meta.block_table, meta.seq_lens, meta.query_start_loc)
        if rerope is not None:
            attention.write_kv(cache.k2[name], k2, meta.slot_mapping)
            attention.paged_attention(
                *paged,
                None,
                scale,
                q_w=q_w,
                k2_cache=cache.k2[name],
                window=rerope.rerope_window,
                out=out,
                impl=impl,
            )
        elif agent is None or not agent.sparse_attention(call):
            attention.paged_attention(
                *paged,
                pos[-q.shape[0] :],
                scale,
                out=out,
                impl=impl,
            )
        o = out.reshape(out.shape[0], -1) @ model.w[f"model.layers.{i}.self_attn.o_proj.weight"].T
        if agent is not None:
            o, residual = agent.ffn_begin(o, residual)
        x, residual = model._add_norm(
            o, residual, f"model.layers.{i}.post_attention_layernorm.weight"
        )
        hidden = model.mlp(i, x)
    final, _ = model._add_norm(hidden, residual, "model.norm.weight")
    if agent is not None:
        logits_idx = agent.execute_finished(logits_idx)
    return model.logits(final[logits_idx])[0]


# ---------------------------------------------------------------------------- store


class DictStore:
    """An in-memory store: block id -> per-layer ``(K, V)`` blocks ``[B, H, D]``."""

    def __init__(self) -> None:
        self.blocks: dict[bytes, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.loads = 0
        self.dumps = 0

    def lookup(self, block_ids: Sequence[bytes]) -> list[bool]:
        return [i in self.blocks for i in block_ids]

    def lookup_on_prefix(self, block_ids: Sequence[bytes]) -> int:
        hits = self.lookup(block_ids)
        return hits.index(False) - 1 if False in hits else len(hits) - 1

    def dump(self, cache: PagedKV, block_id: bytes, physical: int) -> None:
        self.blocks[block_id] = {
            name: (cache.views(name)[0][physical].clone(), cache.views(name)[1][physical].clone())
            for name in cache.kv
        }
        self.dumps += 1

    def load(self, cache: PagedKV, block_id: bytes, physical: int) -> None:
        for name, (k, v) in self.blocks[block_id].items():
            kv, vv = cache.views(name)
            kv[physical] = k
            vv[physical] = v
        self.loads += 1


@dataclass
class PrefillResult:
    logits: torch.Tensor
    """``[vocab]`` logits of the last prompt token."""
    plan: BlendPlan | None
    seq: Request
    selected: dict[int, int] = field(default_factory=dict)
    """Check layer -> rows kept there (blended prefills)."""
    computed_rows: int = 0


def serve_prefill(
    model: TinyLlama,
    cache: PagedKV,
    store: DictStore,
    tokens: Sequence[int],
    *,
    meta: bytes = b"tiny",
    blend: Blend | None = None,
    config: BlendConfig | None = None,
    kv_transfer_params: Mapping[str, Any] | None = None,
    delta_rope: bool = True,
    impl: Impl = "torch",
) -> PrefillResult:
    """One prefill through the store, like the Blend connector would run it.

    Plans the request (``config``, default :class:`BlendConfig`), loads the
    planned blocks, rotates loaded chunk keys to their new positions
    (``delta_rope=False`` skips it: the ablation), binds the step to
    ``blend`` (when the plan is BLEND), computes the query tokens and dumps
    the blocks the plan says to.
    """
    config = config or (blend.config if blend is not None else BlendConfig())
    b = cache.block_size
    plan = plan_request(tokens, b, meta, store, config, kv_transfer_params)
    seq = Request(list(tokens))
    seq.blocks = cache.allocate(-(-len(tokens) // b))
    for ld in plan.loads:
        store.load(cache, ld.block_id, seq.blocks[ld.block_index])
    chunk_loads = [ld for ld in plan.chunk_loads if ld.delta != 0]
    if delta_rope and chunk_loads and plan.mode is BlendMode.BLEND:
        ids = torch.tensor([seq.blocks[ld.block_index] for ld in chunk_loads])
        deltas = torch.tensor([ld.delta for ld in chunk_loads])
        for name in cache.kv:
            if blend is not None:  # the hook the connector calls in wait_for_layer_load
                blend.rotate_loaded_blocks(name, ids, deltas)
                continue
            keys.delta_rope(
                cache.views(name)[0],
                ids,
                deltas,
                model.cos_sin_cache,
                model.spec.is_neox,
                impl=impl,
            )
    start = plan.prefix_tokens
    if start >= len(tokens):  # whole prompt cached: recompute the last token
        start = len(tokens) - 1
    agent = None
    if blend is not None and plan.mode is BlendMode.BLEND:
        if start != plan.prefix_tokens:
            raise AssertionError("a blended prompt always has uncached query tokens")
        slots = seq.slots(start, len(tokens), b)
        blend.bind_step(
            build_step(
                [("r", plan, 0, len(tokens) - start)], slots, torch.arange(start, len(tokens))
            )
        )
        agent = blend
    try:
        logits = forward(model, cache, seq, start, agent, impl=impl)
    finally:
        step = blend.step if agent is not None else None
        if agent is not None:
            blend.bind_step(None)
    for i in plan.dump_block_indices:
        store.dump(cache, plan.prefix_ids[i], seq.blocks[i])
    return PrefillResult(
        logits, plan, seq, dict(step.selections) if step else {}, len(tokens) - start
    )


def full_prefill(
    model: TinyLlama,
    cache: PagedKV,
    tokens: Sequence[int],
    impl: Impl = "torch",
    rerope: ReRoPEConfig | None = None,
) -> PrefillResult:
    """Plain prefill of every token (no store): the reference a blend is compared with."""
    seq = Request(list(tokens))
    logits = forward(model, cache, seq, 0, None, rerope=rerope, impl=impl)
    return PrefillResult(logits, None, seq, {}, len(tokens))


def decode(
    model: TinyLlama,
    cache: PagedKV,
    seq: Request,
    first_logits: torch.Tensor,
    steps: int,
    rerope: ReRoPEConfig | None = None,
    impl: Impl = "torch",
) -> list[int]:
    """Greedy decoding of ``steps`` tokens after a prefill (reads the request's KV)."""
    out = []
    logits = first_logits
    for _ in range(steps):
        tok = int(torch.argmax(logits))
        out.append(tok)
        seq.tokens.append(tok)
        logits = forward(model, cache, seq, len(seq.tokens) - 1, None, rerope=rerope, impl=impl)
    return out
