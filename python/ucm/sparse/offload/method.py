"""Common base of the offloading methods (ESA, KVStar).

Scheduler side: the compressed slot budget of each request
(:meth:`OffloadSparseBase.estimate_num_slots_sparsed`). Worker side: one
*selector* per request holding per-layer representatives and
:class:`~ucm.sparse.offload.retrieval.OffloadRetrieval` state machines, driven through
three engine-neutral calls the vLLM hook layer (or a test) makes:

* :meth:`OffloadSparseBase.on_prefill_finished` at the end of the last prefill
  chunk of each layer (representatives, windows);
* :meth:`OffloadSparseBase.decode_step` before each decode attention of a
  layer (what to wait for, what to load, which blocks to attend);
* :meth:`OffloadSparseBase.request_finished_in_worker`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from ucm.sparse.base import (
    INVALID_SLOT,
    SparseModelInfo,
    SparseNeeds,
    UcmSparseBase,
    UcmSparseRole,
)
from ucm.sparse.kernels.dispatch import Impl
from ucm.sparse.offload.plan import OffloadPlan, make_offload_plan
from ucm.sparse.offload.retrieval import (
    Executor,
    InlineExecutor,
    OffloadRetrieval,
    RetrievalCadence,
    StepActions,
    ThreadExecutor,
)


def topk_sorted(scores: torch.Tensor, k: int, largest: bool = True) -> list[int]:
    """Indices of the ``k`` best scores in ascending index order (ties: lower index)."""
    if k <= 0:
        return []
    k = min(k, scores.numel())
    order = torch.sort(scores.float(), descending=largest, stable=True).indices[:k]
    return sorted(int(i) for i in order.tolist())


class OffloadSelectorBase:
    """Per-request selection state across layers (subclassed per method).

    A method gives each layer's :meth:`representatives`, its :meth:`scores`
    of the middle blocks for a query context and its :attr:`cadence`; the
    selection (:meth:`select`) keeps the best ``num_selected`` blocks.
    """

    cadence: ClassVar[Callable[[int], RetrievalCadence]]
    """When re-selections happen, given the ``retrieval_stride``
    (``RetrievalCadence.esa``, say)."""
    groups_queries: ClassVar[bool] = False
    """A query context is the last ``retrieval_stride`` queries, and the first
    selection votes with the last prefill queries (KVStar); False: the
    current query (ESA)."""

    def __init__(
        self, plan: OffloadPlan, config: Any, executor: Executor, impl: Impl = "auto"
    ) -> None:
        self.plan = plan
        self.config = config
        self.executor = executor
        self.impl = impl
        self.layers: dict[int, Any] = {}
        self.reps: dict[int, torch.Tensor] = {}

    def on_prefill_finished(
        self,
        layer: int,
        k_cache: torch.Tensor,
        prompt_block_ids: torch.Tensor,
        prefill_queries: torch.Tensor | None = None,
    ) -> None:
        """Builds ``layer``'s representatives from the prompt's blocks and
        starts its retrieval.

        ``prompt_block_ids`` ``[N]``: physical block of each logical prompt
        block in ``k_cache`` (``[num_blocks, B, H_kv, D]``), before
        compression; ``prefill_queries`` ``[X, H_q, D]``: the queries of the
        chunk (used with :attr:`groups_queries`).
        """
        self.reps[layer] = self.representatives(layer, k_cache, prompt_block_ids)
        stride = self.config.retrieval_stride
        first = None
        if self.groups_queries and prefill_queries is not None:
            first = prefill_queries[-stride:].detach().clone()
        self.layers[layer] = OffloadRetrieval(
            self.plan.num_selected,
            self.cadence(stride),
            functools.partial(self.select, layer),
            self.executor,
            group_size=stride if self.groups_queries else 1,
            initial_queries=first,
        )

    def middle_blocks(self, prompt_block_ids: torch.Tensor) -> torch.Tensor:
        """The physical blocks of the prompt's middle (the ones selected from)."""
        return prompt_block_ids[self.plan.middle_start : self.plan.middle_end]

    def representatives(
        self, layer: int, k_cache: torch.Tensor, prompt_block_ids: torch.Tensor
    ) -> torch.Tensor:
        """``layer``'s representatives of the middle blocks (see :meth:`on_prefill_finished`)."""
        raise NotImplementedError

    def scores(self, layer: int, queries: torch.Tensor) -> torch.Tensor:
        """``[n]`` score of each middle block for a query context."""
        raise NotImplementedError

    def select(self, layer: int, queries: torch.Tensor) -> list[int]:
        """Logical indices of the ``num_selected`` best-scored middle blocks."""
        best = topk_sorted(self.scores(layer, queries), self.plan.num_selected)
        return [self.plan.middle_start + i for i in best]

    def begin_step(self, layer: int, step: int, query: torch.Tensor) -> StepActions:
        """Decode ``step`` of ``layer`` with query ``[H_q, D]``; see :class:`StepActions`."""
        try:
            retrieval = self.layers[layer]
        except KeyError:
            raise KeyError(f"layer {layer} has no representatives (prefill not finished)") from None
        return retrieval.begin_step(step, query)

    def cancel(self) -> None:
        for r in self.layers.values():
            r.cancel()


class OffloadSparseBase(UcmSparseBase):
    """Shared scheduler budget and worker bookkeeping of ESA and KVStar."""

    needs = SparseNeeds(offload=True)
    rounding = "floor"
    selector_class: type[OffloadSelectorBase] = OffloadSelectorBase

    def __init__(
        self, model: SparseModelInfo | None, role: UcmSparseRole, config: Any = None
    ) -> None:
        if config is None:
            config = self.config_class()  # type: ignore[misc]
        super().__init__(model, role, config)
        self._prompt_lens: dict[str, int] = {}
        self.selectors: dict[str, OffloadSelectorBase] = {}
        self._executor: Executor | None = None
        self.impl: Impl = "auto"

    # -- shared arithmetic ------------------------------------------------

    @property
    def block_size(self) -> int:
        if self.model_info is None:
            raise RuntimeError(f"{type(self).__name__} needs the model info (block size)")
        return self.model_info.block_size

    def offload_plan(self, prompt_len: int) -> OffloadPlan | None:
        """The request's block split, or None when it stays dense."""
        c = self.config
        return make_offload_plan(
            prompt_len,
            self.block_size,
            c.init_window_sz,
            c.local_window_sz,
            c.sparse_ratio,
            c.min_blocks,
            self.rounding,
        )

    def is_sparse_layer(self, layer: int) -> bool:
        """Always True: offloading compresses every layer's KV (one block table)."""
        return True

    @property
    def executor(self) -> Executor:
        if self._executor is None:
            self._executor = ThreadExecutor() if self.config.async_retrieval else InlineExecutor()
        return self._executor

    # -- scheduler side ---------------------------------------------------

    def request_begin(self, request_id: str, prompt_token_ids: list[int]) -> None:
        self._prompt_lens[request_id] = len(prompt_token_ids)

    def estimate_num_slots_sparsed(self, request: Any) -> int:
        """Compressed KV length after this step; -1 during prefill or when dense."""
        num_out = int(getattr(request, "num_output_tokens", 0))
        if num_out < 1:
            return INVALID_SLOT
        prompt_len = int(
            getattr(request, "num_prompt_tokens", self._prompt_lens.get(request.request_id, 0))
        )
        plan = self.offload_plan(prompt_len)
        if plan is None:
            return INVALID_SLOT
        return plan.compressed_len(num_out)

    def request_finished_in_scheduler(self, request_id: str) -> None:
        self._prompt_lens.pop(request_id, None)

    # -- worker side --------------------------------------------------------

    def make_selector(self, plan: OffloadPlan) -> OffloadSelectorBase:
        return self.selector_class(plan, self.config, self.executor, self.impl)

    def on_prefill_finished(
        self,
        request_id: str,
        layer: int,
        k_cache: torch.Tensor,
        prompt_block_ids: torch.Tensor,
        prompt_len: int,
        prefill_queries: torch.Tensor | None = None,
    ) -> OffloadSelectorBase | None:
        """End of the last prefill chunk of ``layer``: builds the request's
        representatives of that layer (:meth:`OffloadSelectorBase.on_prefill_finished`);
        None when the request stays dense."""
        if not self.is_sparse_layer(layer):
            return None
        sel = self.selector_for(request_id, prompt_len)
        if sel is not None:
            sel.on_prefill_finished(layer, k_cache, prompt_block_ids, prefill_queries)
        return sel

    def selector_for(self, request_id: str, prompt_len: int) -> OffloadSelectorBase | None:
        """The request's selector (created on first use), or None when it stays dense."""
        sel = self.selectors.get(request_id)
        if sel is None:
            plan = self.offload_plan(prompt_len)
            if plan is None:
                return None
            sel = self.selectors[request_id] = self.make_selector(plan)
        return sel

    def decode_step(
        self, request_id: str, layer: int, step: int, query: torch.Tensor
    ) -> StepActions | None:
        """Actions of a decode attention; None when the request or layer is dense."""
        sel = self.selectors.get(request_id)
        if sel is None or not self.is_sparse_layer(layer):
            return None
        return sel.begin_step(layer, step, query)

    def request_finished_in_worker(self, request_id: str) -> None:
        sel = self.selectors.pop(request_id, None)
        if sel is not None:
            sel.cancel()

    def shutdown(self) -> None:
        for sel in self.selectors.values():
            sel.cancel()
        self.selectors.clear()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
