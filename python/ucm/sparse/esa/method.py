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

import torch

from ucm.sparse.esa.config import ESAConfig
from ucm.sparse.kernels import selection
from ucm.sparse.kernels.dispatch import Impl
from ucm.sparse.offload import (
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

    def on_prefill_finished(
        self,
        layer: int,
        k_cache: torch.Tensor,
        prompt_block_ids: torch.Tensor,
        prefill_queries: torch.Tensor | None = None,
    ) -> None:
        """Mean-key representatives of ``layer``'s middle blocks. The first
        selection uses the first decode query, not ``prefill_queries``."""
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
    selector_class = ESASelector
