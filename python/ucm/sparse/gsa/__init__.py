"""GSA: hash-aware top-k attention on device (:mod:`.method`)."""

from ucm.sparse.gsa.config import GSAConfig
from ucm.sparse.gsa.method import (
    GSA,
    SRPHashEncoder,
    gsa_select,
    gsa_shortened_len,
    gsa_topk_blocks,
)

__all__ = [
    "GSA",
    "GSAConfig",
    "SRPHashEncoder",
    "gsa_select",
    "gsa_shortened_len",
    "gsa_topk_blocks",
]
