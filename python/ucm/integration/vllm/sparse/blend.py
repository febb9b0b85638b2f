"""Blend on vLLM 0.32 through the UCM connector (CPU and CUDA builds, ``enforce_eager``).

The sparse bridge (:mod:`.bridge`) sets up the objects of Blend for a method
that declares ``chunk_reuse`` and ``row_cutting`` (:class:`ucm.sparse.blend.Blend`):

* :class:`BlendScheduler`, the scheduler side's extension: plans each new
  request (:meth:`Blend.plan`); a BLEND plan reports only its exact prefix
  as external tokens, adds its chunk blocks to the request's loads (into the
  request's own vLLM blocks) and ships the plan with the request's block ids
  to the workers (:class:`BlendReqMeta` as the transfer's payload,
  ``ReqTransfer.sparse``). Nothing of a blended request is saved.
* :class:`BlendWorker` (:mod:`.blend_worker`), the worker's load observer
  and model patch.

Chunked prefill: a blended prefill must run in one step. The scheduler falls
back to prefix reuse when the request's uncached tokens exceed
``max_num_batched_tokens``; when vLLM still splits it (a partly used budget),
the worker does not blend it: every row is recomputed over the loaded blocks,
which gives the full-prefill result.

:data:`STATS` counts, per process, what happened (plans by mode, blended
steps, loaded chunk blocks, rows kept), for tests and benchmarks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ucm.integration.vllm.metadata import ReqTransfer
from ucm.integration.vllm.scheduler import SchedulerExtension
from ucm.shared.config import ConfigError
from ucm.shared.logging import get_logger
from ucm.sparse.base import SparseModelInfo, UcmSparseRole
from ucm.sparse.blend.chunks import BlendMode, BlendPlan
from ucm.sparse.blend.config import BlendConfig
from ucm.sparse.blend.method import Blend
from ucm.sparse.config import parse_sparse_config

_LOG = get_logger("ucm.sparse.blend")

#: Process-wide counters (scheduler and worker keys differ).
STATS: Counter[str] = Counter()
#: Per blended step (worker): ``{"rows", "kept": {layer: rows}, "reused"}``, newest last.
STEP_LOG: list[dict[str, Any]] = []


def blend_config_from(sparse_config: Mapping[str, Any] | None) -> BlendConfig | None:
    """The :class:`BlendConfig` of a connector's ``ucm_sparse_config``, if it selects Blend."""
    spec = parse_sparse_config(sparse_config)
    if spec is None or spec.name != "Blend":
        return None
    return spec.config


@dataclass
class BlendReqMeta:
    """What a worker needs of one blended request (travels in the connector metadata)."""

    plan: BlendPlan
    block_ids: list[int]
    """vLLM block ids of the request's prompt blocks (group 0)."""

    def chunk_rotations(self) -> tuple[list[int], list[int]]:
        """vLLM block ids and position deltas of the loaded chunk blocks that moved."""
        loads = [ld for ld in self.plan.chunk_loads if ld.delta != 0]
        return [self.block_ids[ld.block_index] for ld in loads], [ld.delta for ld in loads]

    def first_slot(self) -> int:
        """Paged slot of the request's first query row (the first token after the prefix)."""
        p, b = self.plan.prefix_tokens, self.plan.block_size
        return self.block_ids[p // b] * b + p % b


# ---------------------------------------------------------------------------- scheduler


class BlendScheduler(SchedulerExtension):
    """The scheduler half (see the module doc)."""

    def __init__(
        self,
        model: SparseModelInfo | None,
        config: BlendConfig,
        max_batched: int,
        *,
        agent: Blend | None = None,
        hash_algo: str = "blake3",
    ) -> None:
        """``model``: the model and its KV layout; ``max_batched``: the most
        tokens a step schedules (vLLM's ``max_num_batched_tokens``);
        ``agent``: the bridge's scheduler instance of Blend (default: a new
        one); ``hash_algo``: the connector's block id algorithm."""
        self.agent = agent or Blend(model, UcmSparseRole.SCHEDULER, config)
        self.hash_algo = hash_algo
        self.max_batched = max_batched
        self._looked_up: dict[str, BlendPlan] = {}
        self._pending: dict[str, BlendPlan] = {}

    def lookup(
        self,
        request: Any,
        num_computed_tokens: int,
        store: Any,
        meta: str,
        algo: str,
    ) -> BlendPlan | None:
        """Plans a request; returns its BLEND plan, or None (the plain connector path:
        chunk-cache builds, too few chunk hits, prompts too long for one step)."""
        req_id = request.request_id
        self._looked_up.pop(req_id, None)
        prompt = request.prompt_token_ids
        if prompt is None or request.num_tokens != len(prompt):
            return None  # a resumed request with outputs: its KV is no chunk layout
        try:
            plan = self.agent.plan(
                prompt,
                store,
                meta,
                request.kv_transfer_params,
                algo=algo,
                num_computed_tokens=num_computed_tokens,
            )
        except ConfigError as e:  # a client's bad chunk list: serve it without Blend
            STATS["bad_chunk_list"] += 1
            _LOG.warning("Blend: request %s is served without blending: %s", req_id, e)
            return None
        STATS[f"plan_{plan.mode.value}"] += 1
        if plan.mode is not BlendMode.BLEND:
            return None
        if plan.num_tokens - plan.prefix_tokens > self.max_batched:
            # vLLM would split the prefill; the selection needs every row at once.
            STATS["fallback_budget"] += 1
            return None
        self._looked_up[req_id] = plan
        return plan

    def allocated(self, req_id: str, num_external_tokens: int) -> BlendPlan | None:
        """vLLM allocated the request's blocks: its plan becomes pending (sent in its next
        metadata). None when the request was not blended."""
        plan = self._looked_up.pop(req_id, None)
        if plan is None:
            return None
        if num_external_tokens != plan.prefix_tokens - plan.device_hit_blocks * plan.block_size:
            STATS["fallback_alloc"] += 1
            return None
        self._pending[req_id] = plan
        STATS["blend_requests"] += 1
        STATS["chunk_hit_blocks"] += plan.chunk_hit_blocks
        return plan

    def take(self, req_id: str) -> BlendPlan | None:
        """The plan to send with this step's metadata (once)."""
        return self._pending.pop(req_id, None)

    def has_pending(self, req_id: str) -> bool:
        return req_id in self._pending

    @staticmethod
    def attach(transfer: ReqTransfer, plan: BlendPlan, vblocks: list[int]) -> None:
        """Adds the chunk loads and the plan to a request's ``ReqTransfer``.

        When vLLM allocated fewer blocks than the prompt has (it split the
        prefill after all), nothing is added: the request is computed
        normally past its prefix.
        """
        n_blocks = -(-plan.num_tokens // plan.block_size)
        if len(vblocks) < n_blocks:
            STATS["skip_split_alloc"] += 1
            return
        for ld in plan.chunk_loads:
            transfer.load_keys.append(ld.block_id)
            transfer.load_into.append(vblocks[ld.block_index])
        transfer.sparse = BlendReqMeta(plan, list(vblocks[:n_blocks]))

    def forget(self, req_id: str) -> None:
        self._looked_up.pop(req_id, None)
        self._pending.pop(req_id, None)

    # -- the scheduler side's extension (ucm.integration.vllm.scheduler) -------
    def match(self, request: Any, computed_tokens: int, store: Any, namespace: str) -> int | None:
        plan = self.lookup(request, computed_tokens, store, namespace, self.hash_algo)
        return None if plan is None else plan.prefix_hit_blocks

    def after_alloc(self, request_id: str, num_external_tokens: int) -> bool:
        return self.allocated(request_id, num_external_tokens) is not None

    def has_payload(self, request_id: str) -> bool:
        return self.has_pending(request_id)

    def extend_transfer(
        self, transfer: ReqTransfer, load_start: int, vllm_blocks: list[int]
    ) -> None:
        plan = self.take(transfer.req_id)
        if plan is not None:
            self.attach(transfer, plan, vllm_blocks)


__all__ = [
    "STATS",
    "STEP_LOG",
    "BlendReqMeta",
    "BlendScheduler",
    "blend_config_from",
]
