"""Offload on vLLM, scheduler side: an offloaded request's unselected prompt
blocks leave device KV.

Device KV of a sparsed request after its prefill: ``init window | k swap
blocks | local window | decode``. At the end of the prefill step the worker
builds the representatives and waits until the prompt's blocks are saved to
the store; at the next allocation :class:`OffloadAllocator` keeps the first
``k`` middle blocks as *swap blocks* (dropping them from the prefix cache,
as their contents will change) and replaces the other ``R - k`` middle
blocks in the request's block list with vLLM's ``null_block`` -- the
mechanism vLLM's sliding-window manager uses for blocks that left the
window -- which frees them. The block list keeps its length, so positions,
slot mapping and RoPE are unchanged and no ``BlockTable`` patch is needed.
The worker then loads each selected middle block into a swap block
(:mod:`.selection`).

Limits: speculative decoding (several tokens per decode step) is refused
for offloaded requests; a swap block shared with another request (prefix
hit) keeps that request's KV on the device.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ucm.integration.vllm.sparse.steps import SparseReqStep
from ucm.shared.logging import get_logger
from ucm.sparse.base import INVALID_SLOT
from ucm.sparse.kernels.triton_utils import cdiv
from ucm.sparse.offload import OffloadSparseBase

logger = get_logger(__name__)


@dataclass
class Footprint:
    """Device blocks one sparsed request holds (scheduler view), over its decode."""

    prompt_len: int
    dense_blocks: int = 0
    """Blocks the request would hold without sparsity (its block list's length)."""
    held_blocks: int = 0
    """Blocks it holds (not ``null_block``)."""
    max_decode_held: int = 0
    max_decode_dense: int = 0
    max_budget_blocks: int = 0
    """Blocks of the method's budget (``estimate_num_slots_sparsed``), for comparison."""
    compressed: bool = False


#: Footprints of finished requests of this process (newest last), for tests and benchmarks.
FINISHED_FOOTPRINTS: list[tuple[str, Footprint]] = []


class OffloadAllocator:
    """Releases offloaded requests' unselected blocks after vLLM's allocation."""

    def __init__(self, agent: OffloadSparseBase, block_size: int) -> None:
        self.agent = agent
        self.block_size = block_size
        self._swap: dict[str, list[int] | None] = {}
        # Requests whose prefill end (representatives, store keys) the workers
        # saw since their last preemption: only these may be compressed.
        self._prefilled: set[str] = set()
        self.footprints: dict[str, Footprint] = {}
        self._manager: Any = None

    def bind(self, manager: Any) -> None:
        """vLLM's ``KVCacheManager`` (its block lists and pool)."""
        self._manager = manager

    def add_facts(
        self,
        r: SparseReqStep,
        request: Any,
        store_keys: Callable[[Any], list[bytes] | None],
    ) -> None:
        """Adds the offload facts to a request's step: the store keys of its
        prompt blocks in the prefill's last step, its swap blocks after."""
        plan = self.agent.offload_plan(r.prompt_len)
        if plan is None:
            return
        if r.finishes_prefill:
            ids = store_keys(request)
            if ids is not None and len(ids) >= plan.middle_end:
                r.store_ids = list(ids[: plan.middle_end])
                self._prefilled.add(r.req_id)
        r.swap_blocks = self._swap.get(r.req_id)

    def preempted(self, rid: str) -> None:
        """vLLM freed all its blocks; the resumed prefill starts uncompressed."""
        self._swap.pop(rid, None)
        self._prefilled.discard(rid)

    def finished(self, rid: str) -> None:
        self.preempted(rid)
        fp = self.footprints.pop(rid, None)
        if fp is not None:
            FINISHED_FOOTPRINTS.append((rid, fp))
            del FINISHED_FOOTPRINTS[:-64]

    def _block_list(self, rid: str) -> list[Any] | None:
        try:
            return self._manager.coordinator.single_type_managers[0].req_to_blocks[rid]
        except (AttributeError, IndexError, KeyError):
            return None

    def wrap_allocate_slots(self, allocate_slots: Any) -> Any:
        """The replacement of ``KVCacheManager.allocate_slots`` (see :mod:`.hooks`)."""

        @functools.wraps(allocate_slots)
        def wrapped(request: Any, num_new_tokens: int, *args: Any, **kwargs: Any) -> Any:
            out = allocate_slots(request, num_new_tokens, *args, **kwargs)
            if out is not None:
                self._after_alloc(request, num_new_tokens)
            return out

        return wrapped

    def _after_alloc(self, request: Any, num_new_tokens: int) -> None:
        rid = request.request_id
        plan = self.agent.offload_plan(int(request.num_prompt_tokens))
        blocks = self._block_list(rid)
        if plan is None or blocks is None:
            return
        fp = self.footprints.setdefault(rid, Footprint(plan.prompt_len))
        # The method's slot budget: -1 during the prefill, else the compressed
        # KV length after this step.
        budget = self.agent.estimate_num_slots_sparsed(request)
        # Decoding: one new token (not a prompt chunk, nor a resumed prefill
        # that recomputes earlier outputs after a preemption).
        decoding = budget != INVALID_SLOT and (
            request.num_computed_tokens >= max(plan.prompt_len, request.num_tokens - 1)
        )
        # The prefill step built the representatives and waited for the
        # prompt's saves (worker, wait_for_save) before this allocation.
        if decoding and rid not in self._swap and rid in self._prefilled:
            self._swap[rid] = self._compress(rid, plan, blocks)
            fp.compressed = self._swap[rid] is not None
        fp.dense_blocks = len(blocks)
        fp.held_blocks = sum(1 for b in blocks if not b.is_null)
        if decoding:
            fp.max_decode_held = max(fp.max_decode_held, fp.held_blocks)
            fp.max_decode_dense = max(fp.max_decode_dense, fp.dense_blocks)
            fp.max_budget_blocks = max(fp.max_budget_blocks, cdiv(budget, self.block_size))

    def _compress(self, rid: str, plan: Any, blocks: list[Any]) -> list[int] | None:
        lo, hi, k = plan.middle_start, plan.middle_end, plan.num_selected
        if len(blocks) < hi:
            return None
        swap = blocks[lo : lo + k]
        if any(b.is_null or b.ref_cnt != 1 for b in swap):
            # Shared with another request (prefix hit): overwriting would
            # corrupt it. Keep this request's KV on the device.
            logger.info("sparse %s: swap blocks are shared; the request keeps its KV", rid)
            return None
        pool = self._manager.block_pool
        for b in swap:
            pool._maybe_evict_cached_block(b)  # its contents are about to change
        drop = [b for b in blocks[lo + k : hi] if not b.is_null]
        for i in range(lo + k, hi):
            blocks[i] = pool.null_block
        pool.free_blocks(drop)
        logger.debug("sparse %s: %d middle blocks released, %d swap blocks", rid, len(drop), k)
        return [b.block_id for b in swap]


__all__ = ["FINISHED_FOOTPRINTS", "Footprint", "OffloadAllocator"]
