"""KVStar: multi-query voting over channel-pruned sub-block representatives.

At the end of prefill, per layer and kv head, the ``round(D * prune_ratio)``
channels with the largest mean ``|K|`` over the prompt are kept, and each
middle block is summarised by ``M = B / c`` sub-block representatives (the
mean of ``c = blk_repre_inner_token_merge`` consecutive keys, pruned
channels only). A *query group* (the last ``retrieval_stride`` queries) votes:
for every query and query head, a softmax over all ``n * M`` representatives,
a block's vote being its softmax mass summed over queries and heads. The top
``ceil(n * sparse_ratio)`` blocks are kept besides the init and local windows.

Cadence (:meth:`~ucm.sparse.offload.retrieval.RetrievalCadence.kvstar`): decode step
1 selects synchronously with the last prefill queries; every
``retrieval_stride`` steps the last decode queries are submitted, and the
result is loaded one stride later, only the blocks that changed (*delayed
delta loads*), so transfers are rare and retrieval overlaps decoding.

No public paper; UCM's deleted ``kvstar.md`` is the source (see
``shared/reference/ucm-original-connector-and-sparse.md`` section 3.4).
"""

from __future__ import annotations

import math

import torch

from ucm.sparse.kernels import selection
from ucm.sparse.kernels.dispatch import Impl
from ucm.sparse.kvstar.config import KVStarConfig
from ucm.sparse.offload import (
    Executor,
    OffloadPlan,
    OffloadSelectorBase,
    OffloadSparseBase,
    RetrievalCadence,
)


def kvstar_channels(
    k_cache: torch.Tensor,
    block_ids: torch.Tensor,
    prompt_len: int,
    prune_ratio: float,
) -> torch.Tensor:
    """``[H_kv, D']`` int32 channels with the largest mean ``|K|`` over the prompt.

    ``block_ids`` ``[N]`` are the prompt's blocks in order; the partial tail
    block contributes only its valid tokens. Channels are returned sorted.
    """
    _, _b, h, d = k_cache.shape
    dp = max(1, round(d * prune_ratio))
    k = k_cache[block_ids.long()].float().reshape(-1, h, d)[:prompt_len]
    mag = k.abs().mean(dim=0)  # [H, D]
    top = torch.topk(mag, dp, dim=-1).indices
    return torch.sort(top, dim=-1).values.to(torch.int32)


def kvstar_representatives(
    k_cache: torch.Tensor,
    block_ids: torch.Tensor,
    channels: torch.Tensor,
    tokens_per_rep: int,
    impl: Impl = "auto",
) -> torch.Tensor:
    """``[n, M, H_kv, D']`` fp32 sub-block representatives of full blocks."""
    full = torch.full((block_ids.numel(),), k_cache.shape[1], dtype=torch.int32)
    return selection.block_representatives(
        k_cache, block_ids, full, tokens_per_rep, channels, impl=impl
    )


def kvstar_scores(
    queries: torch.Tensor,
    reps: torch.Tensor,
    channels: torch.Tensor,
    scale: float,
    impl: Impl = "auto",
) -> torch.Tensor:
    """``[n]`` votes of a query group ``[X, H_q, D]`` (or one query ``[H_q, D]``)."""
    if queries.dim() == 2:
        queries = queries.unsqueeze(0)
    n = reps.shape[0]
    table = torch.arange(n, dtype=torch.int32, device=reps.device).unsqueeze(0)
    num = torch.tensor([n], dtype=torch.int32, device=reps.device)
    return selection.kvstar_vote_scores(
        queries.unsqueeze(0), reps, table, num, channels.unsqueeze(0), scale, impl=impl
    )[0]


class KVStarSelector(OffloadSelectorBase):
    """KVStar state of one request: per-layer channels, representatives, retrieval."""

    cadence = RetrievalCadence.kvstar
    groups_queries = True

    def __init__(
        self, plan: OffloadPlan, config: KVStarConfig, executor: Executor, impl: Impl = "auto"
    ) -> None:
        super().__init__(plan, config, executor, impl)
        self.channels: dict[int, torch.Tensor] = {}
        self.scale: float | None = None

    def representatives(
        self, layer: int, k_cache: torch.Tensor, prompt_block_ids: torch.Tensor
    ) -> torch.Tensor:
        """``layer``'s channels, and the representatives of the middle blocks."""
        c = self.config
        self.scale = 1.0 / math.sqrt(k_cache.shape[-1])
        ch = kvstar_channels(
            k_cache, prompt_block_ids, self.plan.prompt_len, c.blk_repre_dim_prune_ratio
        )
        self.channels[layer] = ch
        merge = min(c.blk_repre_inner_token_merge, k_cache.shape[1])
        ids = self.middle_blocks(prompt_block_ids)
        return kvstar_representatives(k_cache, ids, ch, merge, self.impl)

    def scores(self, layer: int, queries: torch.Tensor) -> torch.Tensor:
        """:func:`kvstar_scores`: the votes of the last queries ``[X, H_q, D]``."""
        assert self.scale is not None
        return kvstar_scores(queries, self.reps[layer], self.channels[layer], self.scale, self.impl)


class KVStar(OffloadSparseBase):
    """The KVStar method (registered as ``KVStar``, alias ``KVStarMultiStep``)."""

    config_class = KVStarConfig
    rounding = "ceil"
    selector_class = KVStarSelector
