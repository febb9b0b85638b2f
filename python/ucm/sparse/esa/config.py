"""``ucm_sparse_config: {ESA: {...}}``. Defaults follow the original UCM's
example config (``examples/offline_inference_esa.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from ucm.sparse.offload.config import OffloadConfig


@dataclass
class ESAConfig(OffloadConfig):
    """ESA: mean-key block retrieval with offload of unselected blocks.

    Every layer is sparse: the request's device KV is compressed for all
    layers at once (one block table), so no layer can stay dense.
    """

    sparse_ratio: float = 0.3
    """Share of the middle blocks kept in device KV: ``k = floor(R * sparse_ratio)``."""
