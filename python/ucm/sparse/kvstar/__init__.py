"""KVStar: multi-query voting over channel-pruned sub-block representatives (:mod:`.method`)."""

from ucm.sparse.kvstar.config import KVStarConfig
from ucm.sparse.kvstar.method import (
    KVStar,
    KVStarSelector,
    kvstar_channels,
    kvstar_representatives,
    kvstar_scores,
)

__all__ = [
    "KVStar",
    "KVStarConfig",
    "KVStarSelector",
    "kvstar_channels",
    "kvstar_representatives",
    "kvstar_scores",
]
