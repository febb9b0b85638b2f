"""Blend on vLLM, worker side: the load observer and the per-instance model patches.

:class:`BlendWorker`, the worker's load observer and model patch (set up by
the sparse bridge for a method that declares ``row_cutting``), rotates
the loaded chunk keys to their new positions after the (whole-step) load,
and patches the model per instance (nothing on classes, undone by
:meth:`BlendWorker.uninstall`):

- each ``Attention`` module from the first check layer on: at a check
  layer, *before* the KV write (``unified_kv_cache_update`` runs inside
  ``Attention.forward``), binds the step lazily from the forward context
  (rows, slots and positions of every request; blended requests are found
  by the slot of their first query row), runs the HKVD selection
  (:meth:`Blend.attention_begin`), cuts q/k/v and rewrites
  ``forward_context.slot_mapping`` of this and every later layer to the
  kept rows, so vLLM writes only their KV;
- each attention ``impl.forward`` from the first check layer on: once rows
  were dropped, :meth:`Blend.sparse_attention` (position-causal paged
  attention over the cache) replaces the backend, whose kernels place a
  query at ``seq_len - q_len + i``;
- each decoder layer's ``forward`` (``layer_begin``: the model passes the
  full ``positions`` to every layer) and ``post_attention_layernorm``
  (``ffn_begin``: the residual still has the rows from before the cut);
- the model's ``forward``: scatters the kept rows back into a tensor of the
  step's row count, so the runner's ``hidden_states[logits_indices]``
  (each request's last row, always kept) needs no change. Dropped rows are
  zero there: prompt logprobs of a blended request are not meaningful.

Loads of a step with a blended request are whole-step even in layer-wise
mode, and start when the connector metadata is bound: vLLM calls
``wait_for_layer_load`` *after* the layer's KV write, which would overwrite
the fresh KV of the layers before the check layer with the loaded one, and
calls ``start_load_kv`` after the forward when no request of the step
reports external tokens (a blend whose prefix is in vLLM's prefix cache).

Chunked prefill: when vLLM splits a blended prefill after all (a partly used
budget), the worker does not blend it: every row is recomputed over the
loaded blocks, which gives the full-prefill result.

The plan each blended request carries is :class:`~.blend.BlendReqMeta`;
the counters are :data:`.blend.STATS` and :data:`.blend.STEP_LOG`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch

from ucm.integration.vllm.compat import SPARSE_HOOKS, check_vllm
from ucm.integration.vllm.metadata import ReqTransfer, UCMConnectorMetadata
from ucm.integration.vllm.sparse.blend import STATS, STEP_LOG, BlendReqMeta
from ucm.integration.vllm.sparse.hooks import HookHandle, find_vllm_model
from ucm.integration.vllm.sparse.model_info import sparse_model_info
from ucm.integration.vllm.worker import LoadObserver
from ucm.shared.logging import get_logger
from ucm.sparse.base import AttentionCall, LayerRows, UcmSparseRole, layer_index
from ucm.sparse.blend.chunks import BlendPlan
from ucm.sparse.blend.config import BlendConfig
from ucm.sparse.blend.method import Blend, build_step

_LOG = get_logger("ucm.sparse.blend")


def _find_layer_metadata(fc: Any, layer_name: str) -> Any:
    md = fc.attn_metadata
    if isinstance(md, dict):
        return md.get(layer_name)
    if isinstance(md, list):
        return md[0].get(layer_name) if md else None
    return md


class BlendWorker(LoadObserver):
    """The worker half (see the module doc)."""

    def __init__(
        self, vllm_config: Any, config: BlendConfig, *, agent: Blend | None = None
    ) -> None:
        if not vllm_config.model_config.enforce_eager:
            raise ValueError(
                "ucm_sparse_config.Blend needs enforce_eager=True: it patches the decoder "
                "layers per instance and shrinks their rows, which a compiled graph would not see"
            )
        self.vllm_config = vllm_config
        self.config = config
        self.agent = agent or Blend(sparse_model_info(vllm_config), UcmSparseRole.WORKER, config)
        self.first_check = min(config.blend_check_layers)
        self.check_layers = set(config.blend_check_layers)
        self.handle = HookHandle("blend")
        self._layers: dict[str, int] = {}
        self._reqs: dict[str, BlendReqMeta] = {}
        self._failed: set[str] = set()
        self.native_runs = True
        """vLLM CPU backend: attend the kept rows with vLLM's own kernel (as
        contiguous runs) rather than :meth:`Blend.sparse_attention`."""
        self._runs_key: Any = None
        self._runs_md: Any = None

    # ------------------------------------------------------------------ setup

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        check_vllm(SPARSE_HOOKS)
        self.agent.initialize_kv_cache_tensors(kv_caches)
        sfc = self.vllm_config.compilation_config.static_forward_context
        self._layers = {name: layer_index(name) for name in kv_caches}
        model = find_vllm_model(sfc)
        self.install(model, sfc)

    def install(self, model: torch.nn.Module, static_forward_context: dict[str, Any]) -> None:
        attn_ids = {
            id(m): name for name, m in static_forward_context.items() if name in self._layers
        }
        n_attn = n_dec = 0
        for _, mod in model.named_modules():
            attn = getattr(mod, "attn", None)
            if attn is not None and id(attn) in attn_ids and hasattr(mod, "rotary_emb"):
                name = attn_ids[id(attn)]
                rot = mod.rotary_emb
                if self.agent.cos_sin_cache is None:
                    self.agent.set_rotary(rot.cos_sin_cache, bool(rot.is_neox_style))
                if self._layers[name] >= self.first_check:
                    self.handle.patch_attr(attn, "forward", self._wrap_attention(name, attn))
                    self.handle.patch_attr(attn.impl, "forward", self._wrap_impl(name, attn.impl))
                    n_attn += 1
            self_attn = getattr(mod, "self_attn", None)
            inner = getattr(self_attn, "attn", None)
            if inner is not None and id(inner) in attn_ids:
                idx = self._layers[attn_ids[id(inner)]]
                if idx >= self.first_check:
                    self.handle.patch_attr(mod, "forward", self._wrap_decoder(idx, mod.forward))
                    norm = mod.post_attention_layernorm
                    self.handle.patch_attr(norm, "forward", self._wrap_post_norm(norm.forward))
                    n_dec += 1
        if self.agent.cos_sin_cache is None or n_attn == 0 or n_dec != n_attn:
            self.handle.uninstall()
            raise NotImplementedError(
                "Blend supports Llama/Qwen-style models (attention modules with rotary_emb and "
                f"attn, decoder layers with self_attn and post_attention_layernorm); found "
                f"{n_attn} attention and {n_dec} decoder layers to patch in "
                f"{type(model).__name__}"
            )
        self.handle.patch_attr(model, "forward", self._wrap_model(model.forward))
        _LOG.info(
            "Blend on vLLM: check layers %s, recompute ratio %.3f, %d layers patched",
            sorted(self.check_layers),
            self.config.blend_recompute_ratio,
            n_attn,
        )

    def uninstall(self) -> None:
        self.handle.uninstall()

    # ------------------------------------------------------------------ per step

    def bind(self, transfers: Iterable[ReqTransfer]) -> None:
        """The step's connector metadata: its blended requests."""
        self._reqs = {t.req_id: t.sparse for t in transfers if isinstance(t.sparse, BlendReqMeta)}
        self._failed = set()
        self.agent.bind_step(None)

    def prepare_loads(self, meta: UCMConnectorMetadata) -> bool:
        """The worker's load observer: a step with blended requests loads whole
        before the forward (see the module doc)."""
        self.bind(meta.requests)
        return self.has_requests

    def blocks_loaded(self, transfers: list[ReqTransfer], failed: set[str]) -> None:
        self.after_loads(failed)

    @property
    def has_requests(self) -> bool:
        return bool(self._reqs)

    def after_loads(self, failed_req_ids: set[str]) -> None:
        """The step's loads are in the cache: delta-RoPE on the moved chunk keys.

        Layers before the first check layer are left alone (their KV is
        recomputed). A request whose load failed is not blended.
        """
        self._failed = set(failed_req_ids) & set(self._reqs)
        blocks: list[int] = []
        deltas: list[int] = []
        for req_id, rm in self._reqs.items():
            if req_id in self._failed:
                continue
            b, d = rm.chunk_rotations()
            blocks += b
            deltas += d
            STATS["chunk_blocks_loaded"] += len(rm.plan.chunk_loads)
            STATS["prefix_blocks_loaded"] += len(rm.plan.loads) - len(rm.plan.chunk_loads)
        if not blocks:
            return
        ids = torch.tensor(blocks, dtype=torch.int64)
        dts = torch.tensor(deltas, dtype=torch.int64)
        for name, idx in self._layers.items():
            if idx >= self.first_check:
                self.agent.rotate_loaded_blocks(name, ids, dts)
        STATS["blocks_rotated"] += len(blocks)

    def _bind_step(self, layer_name: str, num_rows: int) -> None:
        """Builds the step's :class:`BlendStep` from the forward context (first check layer)."""
        from vllm.forward_context import get_forward_context

        self.agent.bind_step(None)
        reqs = {k: v for k, v in self._reqs.items() if k not in self._failed}
        if not reqs:
            return
        fc = get_forward_context()
        md = _find_layer_metadata(fc, layer_name)
        slot_map = fc.slot_mapping.get(layer_name) if isinstance(fc.slot_mapping, dict) else None
        if md is None or slot_map is None:
            return
        qsl = md.query_start_loc.cpu().to(torch.int64)
        nreq = qsl.numel() - 1
        n = int(md.num_actual_tokens)
        if n != num_rows or int(qsl[-1]) != n:
            STATS["skip_padded"] += 1  # padded batch: rows beyond the requests
            return
        slots = slot_map[:n].cpu().to(torch.int64)
        seq_lens = md.seq_lens.cpu().to(torch.int64)[:nreq]
        q_lens = qsl[1:] - qsl[:-1]
        positions = torch.cat(
            [torch.arange(int(s) - int(q), int(s)) for s, q in zip(seq_lens, q_lens, strict=True)]
        )
        start_of = {int(qsl[i]): i for i in range(nreq)}
        plans: dict[int, tuple[str, BlendPlan]] = {}
        for req_id, rm in reqs.items():
            rows = torch.nonzero(slots == rm.first_slot()).flatten()
            i = start_of.get(int(rows[0])) if rows.numel() == 1 else None
            plan = rm.plan
            if (
                i is None
                or int(q_lens[i]) != plan.num_tokens - plan.prefix_tokens
                or int(seq_lens[i]) != plan.num_tokens
            ):
                # Chunked or otherwise split: every row is recomputed over the
                # loaded blocks, which is the full prefill's result.
                STATS["skip_split"] += 1
                continue
            plans[i] = (req_id, plan)
        if not plans:
            return
        rows_spec = [
            (
                plans[i][0] if i in plans else f"#{i}",
                plans[i][1] if i in plans else None,
                int(qsl[i]),
                int(q_lens[i]),
            )
            for i in range(nreq)
        ]
        step = build_step(rows_spec, slots, positions)
        self.agent.bind_step(step)
        STATS["blend_steps"] += 1
        STATS["blended_prefills"] += len(plans)

    def _later_layers(self, idx: int) -> list[str]:
        return [name for name, i in self._layers.items() if i >= idx]

    # ------------------------------------------------------------------ patches

    def _wrap_attention(self, layer_name: str, attn: Any) -> Any:
        """``Attention.forward`` of a layer at or after the first check layer."""
        idx = self._layers[layer_name]
        orig = attn.forward
        is_check = idx in self.check_layers
        agent = self.agent

        @functools.wraps(orig)
        def forward(query, key, value, output_shape=None, output_dtype=None, **kwargs):
            if idx == self.first_check and self._reqs:
                self._bind_step(layer_name, query.shape[0])
            step = agent.step
            if step is None or not is_check or key is None:
                return orig(query, key, value, output_shape, output_dtype, **kwargs)
            from vllm.forward_context import get_forward_context

            q = query.view(query.shape[0], attn.num_heads, attn.head_size)
            k = key.view(key.shape[0], attn.num_kv_heads, attn.head_size)
            v = value.view(value.shape[0], attn.num_kv_heads, attn.head_size_v)
            call = agent.attention_begin(AttentionCall(layer_name, q, k, v))
            q, k, v = call.query, call.key, call.value
            fc = get_forward_context()
            old = fc.slot_mapping[layer_name]
            kept = step.slots[step.active].to(device=old.device, dtype=old.dtype)
            for name in self._later_layers(idx):
                fc.slot_mapping[name] = kept
            if output_shape is not None:
                output_shape = torch.Size((q.shape[0], *output_shape[1:]))
            n = q.shape[0]
            return orig(
                q.reshape(n, -1),
                k.reshape(n, -1),
                v.reshape(n, -1),
                output_shape,
                output_dtype,
                **kwargs,
            )

        return forward

    def _wrap_impl(self, layer_name: str, impl: Any) -> Any:
        orig = impl.forward
        agent = self.agent
        native = type(impl).__name__ == "CPUAttentionBackendImpl"

        @functools.wraps(orig)
        def forward(layer, query, key, value, kv_cache, attn_metadata, output=None, *a, **kw):
            step = agent.step
            if step is None or not step.shrunk or attn_metadata is None or output is None:
                return orig(layer, query, key, value, kv_cache, attn_metadata, output, *a, **kw)
            if native and self.native_runs:
                md = self._runs_metadata(attn_metadata, impl, layer, query.dtype)
                return orig(layer, query, key, value, kv_cache, md, output, *a, **kw)
            call = AttentionCall(
                layer_name,
                query,
                key,
                value,
                attn_metadata,
                output,
                kv_cache=kv_cache,
                scale=float(impl.scale),
            )
            if agent.sparse_attention(call):
                return output
            return orig(layer, query, key, value, kv_cache, attn_metadata, output, *a, **kw)

        return forward

    def _runs_metadata(self, md: Any, impl: Any, layer: Any, dtype: torch.dtype) -> Any:
        """vLLM CPU backend: the kept rows as a batch of contiguous runs.

        The CPU kernel places query ``i`` of a sequence at ``seq_len - q_len
        + i``. A run of kept rows at consecutive positions ``p0 .. p1`` of one
        request is therefore exact as its own sequence with ``seq_len = p1 +
        1`` (its keys are the request's blocks up to ``p1``), so the native
        kernel attends every kept row at its true position. Built once per
        selection (shared by the layers of the step).
        """
        import dataclasses

        from vllm import _custom_ops as ops
        from vllm import envs

        step = self.agent.step
        assert step is not None
        key = (id(md), step.num_active, len(step.selections))
        if self._runs_key == key and self._runs_md is not None:
            return self._runs_md
        pos = step.positions[step.active]
        req = torch.zeros(step.num_active, dtype=torch.int64)
        for i, r in enumerate(step.requests):
            req[(step.active >= r.start) & (step.active < r.end)] = i
        brk = torch.ones(step.num_active, dtype=torch.bool)
        brk[1:] = (pos[1:] != pos[:-1] + 1) | (req[1:] != req[:-1])
        starts = torch.nonzero(brk).flatten()
        ends = torch.cat([starts[1:], torch.tensor([step.num_active])])
        qsl = torch.cat([torch.zeros(1, dtype=torch.int64), ends]).to(torch.int32)
        seq_lens = (pos[ends - 1] + 1).to(torch.int32)
        dev = md.query_start_loc.device
        qsl, seq_lens = qsl.to(dev), seq_lens.to(dev)
        block_table = md.block_table[req[starts].to(md.block_table.device)]
        sched = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=int(starts.numel()),
            num_heads=impl.num_heads,
            num_kv_heads=impl.num_kv_heads,
            head_dim=impl.head_size,
            seq_lens=seq_lens,
            dtype=dtype,
            query_start_loc=qsl,
            causal=True,
            sliding_window_size=impl.sliding_window,
            isa=layer.isa,
            enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
            kv_cache_dtype=impl.kv_cache_dtype,
        )
        lens = qsl[1:] - qsl[:-1]
        self._runs_md = dataclasses.replace(
            md,
            num_actual_tokens=step.num_active,
            max_query_len=int(lens.max()),
            query_start_loc=qsl,
            max_seq_len=int(seq_lens.max()),
            seq_lens=seq_lens,
            block_table=block_table,
            slot_mapping=step.slots[step.active].to(md.slot_mapping.device),
            scheduler_metadata=sched,
        )
        self._runs_key = key
        STATS["attention_runs"] += int(starts.numel())
        return self._runs_md

    def _wrap_decoder(self, idx: int, orig: Any) -> Any:
        agent = self.agent

        @functools.wraps(orig)
        def forward(positions, hidden_states, residual, *args, **kwargs):
            if agent.step is not None and agent.step.shrunk:
                positions, hidden_states, residual = agent.layer_begin(
                    idx, LayerRows(positions, hidden_states, residual)
                )
            return orig(positions, hidden_states, residual, *args, **kwargs)

        return forward

    def _wrap_post_norm(self, orig: Any) -> Any:
        agent = self.agent

        @functools.wraps(orig)
        def forward(x, residual=None, *args, **kwargs):
            if residual is not None and agent.step is not None and agent.step.shrunk:
                x, residual = agent.ffn_begin(x, residual)
            return orig(x, residual, *args, **kwargs)

        return forward

    def _wrap_model(self, orig: Any) -> Any:
        agent = self.agent

        @functools.wraps(orig)
        def forward(*args, **kwargs):
            out = orig(*args, **kwargs)
            step = agent.step
            if step is None:
                return out
            agent.bind_step(None)  # a step binds once; the next forward starts clean
            self._reqs = {}
            self._runs_key = self._runs_md = None
            STEP_LOG.append(
                {
                    "rows": step.num_rows,
                    "kept": dict(step.selections),
                    "reused": int(step.reused.sum()),
                }
            )
            del STEP_LOG[:-64]
            STATS["rows_total"] += step.num_rows
            STATS["rows_kept"] += step.num_active
            if not step.shrunk or not isinstance(out, torch.Tensor):
                return out
            # The runner reads hidden_states[logits_indices] in original rows.
            full = out.new_zeros((step.num_rows, *out.shape[1:]))
            full[step.active.to(out.device)] = out
            return full

        return forward


__all__ = ["BlendWorker"]
