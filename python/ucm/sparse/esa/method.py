"""ESA: mean-key block retrieval with offload of unselected blocks.

At the end of prefill each middle block ``j`` of a layer gets one
representative per kv head, the mean of its keys ``r_j`` (``[H_kv, D]``).
A decode query is averaged over each GQA group to ``q_bar`` (``[H_kv, D]``)
and block ``j`` scores ``<q_bar, r_j>`` (flattened dot product, no scaling).
The device keeps the init window, the local window and the top
``k = floor(R * sparse_ratio)`` middle blocks; the rest of the prompt KV lives
in the UCM store. Selection is synchronous on the first decode step and then
re-run every ``retrieval_stride`` steps asynchronously, loading only the
blocks that changed (:class:`~ucm.sparse.offload.retrieval.RetrievalCadence.esa`).

There is no paper; the design is Quest/InfLLM-style (see
``shared/reference/ucm-original-connector-and-sparse.md`` section 3.1).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ucm.sparse.esa.config import ESAConfig
from ucm.sparse.kernels import selection
from ucm.sparse.kernels.dispatch import Impl
from ucm.sparse.offload import (
    Executor,
    OffloadPlan,
    OffloadRetrieval,
    OffloadSelectorBase,
    OffloadSparseBase,
    RetrievalCadence,
    topk_sorted,
)


def esa_representatives(
    k_cache: torch.Tensor, block_ids: torch.Tensor, impl: Impl = "auto"
) -> torch.Tensor:
    """``[n, H_kv, D]`` fp32 mean keys of full blocks ``block_ids`` of ``k_cache``."""
    full = torch.full((block_ids.numel(),), k_cache.shape[1], dtype=torch.int32)
    return selection.block_representatives(k_cache, block_ids, full, impl=impl)[:, 0]


def esa_scores(q: torch.Tensor, reps: torch.Tensor, impl: Impl = "auto") -> torch.Tensor:
    """``[n]`` ESA scores of one query ``[H_q, D]`` against ``reps`` ``[n, H_kv, D]``."""
    n = reps.shape[0]
    table = torch.arange(n, dtype=torch.int32, device=reps.device).unsqueeze(0)
    num = torch.tensor([n], dtype=torch.int32, device=reps.device)
    return selection.block_scores_dot(q.unsqueeze(0), reps, table, num, impl=impl)[0]


class ESASelector(OffloadSelectorBase):
    """ESA state of one request: per-layer representatives and retrieval."""

    def __init__(
        self,
        plan: OffloadPlan,
        config: ESAConfig,
        executor: Executor,
        impl: Impl = "auto",
    ) -> None:
        super().__init__(plan, executor)
        self.config = config
        self.impl = impl
        self.reps: dict[int, torch.Tensor] = {}

    def on_prefill_finished(
        self, layer: int, k_cache: torch.Tensor, prompt_block_ids: torch.Tensor
    ) -> None:
        """Builds ``layer``'s representatives from the prompt's blocks.

        ``prompt_block_ids`` ``[N]``: physical block of each logical prompt
        block in ``k_cache`` (``[num_blocks, B, H_kv, D]``), before compression.
        """
        p = self.plan
        ids = prompt_block_ids[p.middle_start : p.middle_end]
        self.reps[layer] = esa_representatives(k_cache, ids, self.impl)
        self.layers[layer] = OffloadRetrieval(
            p.num_selected,
            RetrievalCadence.esa(self.config.retrieval_stride),
            functools.partial(self.select, layer),
            self.executor,
        )

    def select(self, layer: int, query: torch.Tensor) -> list[int]:
        """Logical indices of the ``k`` best middle blocks for ``query`` ``[H_q, D]``."""
        scores = esa_scores(query, self.reps[layer], self.impl)
        return [self.plan.middle_start + i for i in topk_sorted(scores, self.plan.num_selected)]


class ESA(OffloadSparseBase):
    """The ESA method (registered as ``ESA``)."""

    config_class = ESAConfig
    rounding = "floor"

    def __init__(self, vllm_config: Any, role: Any, config: ESAConfig | None = None) -> None:
        super().__init__(vllm_config, role, config)
        self.impl: Impl = "auto"

    def make_selector(self, plan: OffloadPlan) -> ESASelector:
        return ESASelector(plan, self.config, self.executor, self.impl)

    def on_prefill_finished(
        self,
        request_id: str,
        layer: int,
        k_cache: torch.Tensor,
        prompt_block_ids: torch.Tensor,
        prompt_len: int,
        prefill_queries: torch.Tensor | None = None,
    ) -> ESASelector | None:
        """End of the last prefill chunk of ``layer``; None when the request stays
        dense. ESA's first selection uses the first decode query, not
        ``prefill_queries``."""
        if not self.is_sparse_layer(layer):
            return None
        sel = self.selector_for(request_id, prompt_len)
        if sel is not None:
            sel.on_prefill_finished(layer, k_cache, prompt_block_ids)
        return sel  # type: ignore[return-value]
