"""``Blend``: the CacheBlend method as :class:`~ucm.sparse.base.UcmSparseBase` hooks.

The scheduler side plans requests (:meth:`Blend.plan`); the worker side moves
loaded chunk keys (:meth:`Blend.rotate_loaded_blocks`), selects the tokens
to recompute at the check layers (:meth:`Blend.attention_begin`), attends
for the surviving rows with their true positions
(:meth:`Blend.sparse_attention`), and shrinks the residual stream
(:meth:`Blend.layer_begin`, :meth:`Blend.ffn_begin`) and the logits rows
(:meth:`Blend.execute_finished`). A step's rows are described by a
:class:`~ucm.sparse.blend.select.BlendStep` bound with :meth:`Blend.bind_step`
(built from the plans by :func:`build_step`).

The same hooks drive the torch reference stack
(the tests' ``support.refmodel``) and vLLM
(:mod:`ucm.integration.vllm.sparse.blend`, see :mod:`ucm.sparse.blend`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ucm.sparse.base import (
    AttentionCall,
    LayerRows,
    SparseModelInfo,
    SparseNeeds,
    UcmSparseBase,
    UcmSparseRole,
    layer_index,
)
from ucm.sparse.blend.chunks import BlendMode, BlendPlan, BlockLookup, plan_request
from ucm.sparse.blend.config import BlendConfig
from ucm.sparse.blend.select import BlendRequestRows, BlendStep
from ucm.sparse.kernels import attention, keys
from ucm.sparse.kernels.dispatch import Impl
from ucm.sparse.kernels.views import kv_views


def build_step(
    requests: Sequence[tuple[str, BlendPlan | None, int, int]],
    slots: torch.Tensor,
    positions: torch.Tensor,
) -> BlendStep:
    """A :class:`BlendStep` for a batch.

    Args:
        requests: per request, in row order, ``(req_id, plan, first_row, num_rows)``:
            its rows are the query tokens of the step (a blended prefill's rows
            are prompt tokens ``plan.prefix_tokens ..``). ``plan`` None or not
            BLEND: every row is forced (decodes, ordinary prefills).
        slots: ``[rows]`` paged slot of every row (vLLM's ``slot_mapping``).
        positions: ``[rows]`` position of every row.
    """
    n = int(slots.numel())
    reused = torch.zeros(n, dtype=torch.bool)
    forced = torch.ones(n, dtype=torch.bool)
    rows = []
    for req_id, plan, first, count in requests:
        n_reused = 0
        if plan is not None and plan.mode is BlendMode.BLEND:
            lo = plan.prefix_tokens
            if count != plan.num_tokens - lo:
                raise ValueError(
                    f"request {req_id}: a blended prefill must compute prompt tokens "
                    f"{lo}..{plan.num_tokens} in one step, got {count} rows"
                )
            reused[first : first + count] = plan.reused_mask()[lo:]
            forced[first : first + count] = plan.forced_mask()[lo:]
            n_reused = plan.num_reused_tokens
        rows.append(BlendRequestRows(req_id, first, first + count, n_reused))
    return BlendStep(rows, reused, forced, slots.to(torch.int64).cpu(), positions.cpu())


class Blend(UcmSparseBase):
    """CacheBlend: reuse chunk KV anywhere in the prompt, recompute the deviating tokens."""

    config_class = BlendConfig
    needs = SparseNeeds(loads_before_forward=True, row_cutting=True, chunk_reuse=True)

    def __init__(
        self, model: SparseModelInfo | None, role: UcmSparseRole, config: BlendConfig | None = None
    ) -> None:
        super().__init__(model, role, config or BlendConfig())
        self.config: BlendConfig
        if self.model_info is not None:
            self.config.validate_for_model(self.model_info.num_layers)
        self._shares = self.config.check_layer_ratios()
        self._k_views: dict[str, torch.Tensor] = {}
        self._v_views: dict[str, torch.Tensor] = {}
        self.cos_sin_cache: torch.Tensor | None = None
        self.is_neox = True
        self.impl: Impl = "auto"
        self.step: BlendStep | None = None

    # ------------------------------------------------------------------ scheduler

    def plan(
        self,
        token_ids: Sequence[int],
        store: BlockLookup,
        meta: str | bytes,
        kv_transfer_params: Mapping[str, Any] | None = None,
        *,
        algo: str = "blake3",
        num_computed_tokens: int = 0,
    ) -> BlendPlan:
        """:func:`~ucm.sparse.blend.chunks.plan_request` with this method's config."""
        if self.model_info is None:
            raise RuntimeError("Blend.plan needs the model info (block size)")
        return plan_request(
            token_ids,
            self.model_info.block_size,
            meta,
            store,
            self.config,
            kv_transfer_params,
            algo=algo,
            num_computed_tokens=num_computed_tokens,
        )

    # ------------------------------------------------------------------ worker setup

    def initialize_kv_cache_tensors(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for name, kv in kv_caches.items():
            self._k_views[name], self._v_views[name] = kv_views(kv)

    def set_rotary(self, cos_sin_cache: torch.Tensor, is_neox: bool = True) -> None:
        """The model's rotary table (vLLM: ``rotary_emb.cos_sin_cache``) and pairing."""
        self.cos_sin_cache = cos_sin_cache
        self.is_neox = bool(is_neox)

    def rotate_loaded_blocks(
        self, layer_name: str, block_ids: torch.Tensor, deltas: torch.Tensor
    ) -> None:
        """Delta-RoPE on one layer's loaded chunk blocks (the connector's
        ``wait_for_layer_load``). Blocks with delta 0 may be left out."""
        if self.cos_sin_cache is None:
            raise RuntimeError("Blend.set_rotary was not called")
        keys.delta_rope(
            self._k_views[layer_name],
            block_ids,
            deltas,
            self.cos_sin_cache,
            self.is_neox,
            impl=self.impl,
        )

    # ------------------------------------------------------------------ per step

    def bind_step(self, step: BlendStep | None) -> None:
        """Makes ``step`` the current step (None: no blended request this step)."""
        self.step = step

    def _is_check_layer(self, layer_name: str) -> float | None:
        return self._shares.get(layer_index(layer_name))

    def attention_begin(self, call: AttentionCall) -> AttentionCall:
        """At a check layer: HKVD selection; q/k/v/output and the metadata cut to the kept rows.

        Must run before this layer's KV write (the loaded keys are compared
        with the fresh ones). The call's ``attn_metadata`` has its
        ``slot_mapping``, ``query_start_loc``, ``num_actual_tokens`` and
        ``max_query_len`` rewritten in place when present.
        """
        step = self.step
        share = self._is_check_layer(call.layer_name)
        if step is None or share is None:
            return call
        key = call.key
        k_view = self._k_views[call.layer_name]
        slots = step.slots[step.active].to(key.device)
        has_cached = step.reused[step.active].to(key.device)
        dev = keys.kv_deviation(k_view, torch.where(has_cached, slots, -1), key, impl=self.impl)
        local = step.select(layer_index(call.layer_name), dev.cpu(), share)
        local = local.to(call.query.device)
        output = call.output
        call = call.replace(
            query=call.query[local],
            key=key[local],
            value=call.value[local],
            output=None if output is None else output[local],
        )
        meta = call.attn_metadata
        if meta is not None:
            if hasattr(meta, "slot_mapping"):
                meta.slot_mapping = step.slots[step.active].to(meta.slot_mapping.device)
            qsl = step.active_query_start_loc()
            if hasattr(meta, "query_start_loc"):
                meta.query_start_loc = qsl.to(meta.query_start_loc.device)
            if hasattr(meta, "num_actual_tokens"):
                meta.num_actual_tokens = step.num_active
            if hasattr(meta, "max_query_len"):
                meta.max_query_len = int((qsl[1:] - qsl[:-1]).max()) if qsl.numel() > 1 else 0
        return call

    def sparse_attention(self, call: AttentionCall) -> bool:
        """After rows were dropped: attention of the surviving rows at their true positions.

        Backends infer a query's position from its index (bottom-right
        causal), which is wrong for a non-contiguous subset of a prompt; this
        attends key ``j`` iff ``j <= position``. Declines (False) otherwise.
        The scale is the call's, else the metadata's ``scale``, else ``D ** -0.5``.
        """
        step = self.step
        if step is None or not step.shrunk:
            return False
        assert call.kv_cache is not None and call.output is not None
        md, query = call.attn_metadata, call.query
        k_view, v_view = kv_views(call.kv_cache)
        attention.paged_attention(
            query,
            k_view,
            v_view,
            md.block_table,
            md.seq_lens,
            step.active_query_start_loc().to(query.device),
            step.positions[step.active].to(query.device),
            call.scale if call.scale is not None else getattr(md, "scale", None),
            out=call.output,
            impl=self.impl,
        )
        return True

    def layer_begin(self, layer_idx: int, rows: LayerRows) -> LayerRows:
        step = self.step
        if step is None or not step.shrunk:
            return rows
        return LayerRows(*(step.shrink(t) for t in rows))

    def ffn_begin(
        self, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        step = self.step
        if step is None or not step.shrunk:
            return hidden_states, residual
        return step.shrink(hidden_states), step.shrink(residual)

    def execute_finished(self, logits_indices: torch.Tensor) -> torch.Tensor:
        step = self.step
        if step is None or not step.shrunk:
            return logits_indices
        return step.logits_indices(logits_indices)
