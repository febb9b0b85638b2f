"""ESA: block retrieval over sub-block mean keys, with offload of unselected blocks.

At the end of prefill each middle block ``j`` of a layer gets ``M = B / c``
representatives per kv head, the means of its runs of
``c = block_repre_tokens`` consecutive keys (``[M, H_kv, D]``). A decode
query scores the blocks head by head: for query head ``H`` (kv head ``h``)
block ``j``'s logit is its best representative's ``<q_H, r_jm> / sqrt(D)``,
a softmax over the blocks turns the logits into shares, and the block's
score is its share summed over the query heads. The device keeps the init
window, the local window and the top ``k = floor(R * sparse_ratio)`` middle
blocks; the rest of the prompt KV lives in the UCM store. Selection is
synchronous on the first decode step and then re-run every
``retrieval_stride`` steps asynchronously, loading only the blocks that
changed (:class:`~ucm.sparse.offload.retrieval.RetrievalCadence.esa`).

Why not the original ESA's one mean key per block scored by a flattened dot
product with the group-mean query (``block_repre_tokens`` = block size comes
close to it): a salient key, such as the few tokens of a fact the answer
copies, is averaged away among the block's other keys, and the few heads
with large logits outvote the rest. On needle retrieval with a real model
(``benches/quality.py``) sub-block maxima with one vote per head keep the
needle blocks that the block mean loses.

There is no paper; the design is Quest/InfLLM-style (see
``shared/reference/ucm-original-connector-and-sparse.md`` section 3.1).
"""

from __future__ import annotations

import math

import torch

from ucm.sparse.esa.config import ESAConfig
from ucm.sparse.kernels import selection
from ucm.sparse.kernels.dispatch import Impl
from ucm.sparse.offload import OffloadSelectorBase, OffloadSparseBase, RetrievalCadence


def esa_representatives(
    k_cache: torch.Tensor,
    block_ids: torch.Tensor,
    tokens_per_rep: int | None = None,
    impl: Impl = "auto",
) -> torch.Tensor:
    """``[n, M, H_kv, D]`` mean keys of the ``tokens_per_rep``-token runs of
    full blocks ``block_ids`` (``None``: one per block), in the cache's dtype:
    they stay on the device for the request's whole decode."""
    full = torch.full((block_ids.numel(),), k_cache.shape[1], dtype=torch.int32)
    reps = selection.block_representatives(k_cache, block_ids, full, tokens_per_rep, impl=impl)
    return reps.to(k_cache.dtype)


def esa_scores(q: torch.Tensor, reps: torch.Tensor) -> torch.Tensor:
    """``[n]`` ESA scores of one query ``[H_q, D]`` against ``reps`` ``[n, M, H_kv, D]``
    (see the module doc); fp32, summing to the number of query heads."""
    h_kv, d = reps.shape[2], reps.shape[3]
    g = q.shape[0] // h_kv
    qh = q.float().reshape(h_kv, g, d)
    logits = torch.einsum("hgd,nmhd->hgnm", qh, reps.float()) / math.sqrt(d)
    return logits.amax(dim=-1).softmax(dim=-1).sum(dim=(0, 1))


class ESASelector(OffloadSelectorBase):
    """ESA state of one request: per-layer representatives and retrieval.
    The first selection uses the first decode query, not the prefill's."""

    cadence = RetrievalCadence.esa

    def representatives(
        self, layer: int, k_cache: torch.Tensor, prompt_block_ids: torch.Tensor
    ) -> torch.Tensor:
        """Mean-key representatives of the middle blocks."""
        tokens = min(self.config.block_repre_tokens, k_cache.shape[1])
        return esa_representatives(k_cache, self.middle_blocks(prompt_block_ids), tokens, self.impl)

    def scores(self, layer: int, queries: torch.Tensor) -> torch.Tensor:
        """:func:`esa_scores` of the current query ``[H_q, D]``."""
        return esa_scores(queries, self.reps[layer])


class ESA(OffloadSparseBase):
    """The ESA method (registered as ``ESA``)."""

    config_class = ESAConfig
    rounding = "floor"
    selector_class = ESASelector
