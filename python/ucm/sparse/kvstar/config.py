"""``ucm_sparse_config: {KVStar: {...}}``. Defaults follow the original UCM's
example config (``examples/offline_inference_kvstar.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from ucm.sparse.config import require_at_least, require_ratio
from ucm.sparse.offload.config import OffloadConfig


@dataclass
class KVStarConfig(OffloadConfig):
    """KVStar: multi-query voting over channel-pruned sub-block representatives."""

    sparse_ratio: float = 0.25
    """Share of the middle blocks kept: ``k = ceil(n * sparse_ratio)``."""
    retrieval_stride: int = 8
    """Queries per voting group, and decode steps between retrievals."""
    blk_repre_dim_prune_ratio: float = 0.25
    """Share of head-dim channels kept in representatives (largest mean |K|)."""
    blk_repre_inner_token_merge: int = 2
    """Tokens averaged into one sub-block representative."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require_ratio("blk_repre_dim_prune_ratio", self.blk_repre_dim_prune_ratio)
        require_at_least("blk_repre_inner_token_merge", self.blk_repre_inner_token_merge, 1)
