"""``ucm_sparse_config: {KVStar: {...}}``. Defaults follow the original UCM's
example config (``examples/offline_inference_kvstar.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from ucm.sparse.config import at_least, ratio
from ucm.sparse.offload.config import OffloadConfig


@dataclass
class KVStarConfig(OffloadConfig):
    """KVStar: multi-query voting over channel-pruned sub-block representatives."""

    sparse_ratio: float = ratio(0.25)
    """Share of the middle blocks kept: ``k = ceil(n * sparse_ratio)``."""
    retrieval_stride: int = at_least(1, default=8)
    """Queries per voting group, and decode steps between retrievals."""
    blk_repre_dim_prune_ratio: float = ratio(0.25)
    """Share of head-dim channels kept in representatives (largest mean |K|)."""
    blk_repre_inner_token_merge: int = at_least(1, default=2)
    """Tokens averaged into one sub-block representative."""
