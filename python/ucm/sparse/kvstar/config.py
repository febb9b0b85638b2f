"""``ucm_sparse_config: {KVStar: {...}}``. Defaults follow the original UCM's
example config (``examples/offline_inference_kvstar.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from ucm.sparse.config import require_at_least, require_ratio


@dataclass
class KVStarConfig:
    """KVStar: multi-query voting over channel-pruned sub-block representatives."""

    sparse_ratio: float = 0.25
    """Share of the middle blocks kept: ``k = ceil(n * sparse_ratio)``."""
    retrieval_stride: int = 8
    """Queries per voting group, and decode steps between retrievals."""
    init_window_sz: int = 1
    local_window_sz: int = 2
    min_blocks: int = 4
    blk_repre_dim_prune_ratio: float = 0.25
    """Share of head-dim channels kept in representatives (largest mean |K|)."""
    blk_repre_inner_token_merge: int = 2
    """Tokens averaged into one sub-block representative."""
    async_retrieval: bool = True

    def __post_init__(self) -> None:
        require_ratio("sparse_ratio", self.sparse_ratio)
        require_at_least("retrieval_stride", self.retrieval_stride, 1)
        require_at_least("init_window_sz", self.init_window_sz, 0)
        require_at_least("local_window_sz", self.local_window_sz, 1)
        require_at_least("min_blocks", self.min_blocks, 1)
        require_ratio("blk_repre_dim_prune_ratio", self.blk_repre_dim_prune_ratio)
        require_at_least("blk_repre_inner_token_merge", self.blk_repre_inner_token_merge, 1)
