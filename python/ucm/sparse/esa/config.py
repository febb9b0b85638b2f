"""``ucm_sparse_config: {ESA: {...}}``. The windows, ratio and stride default
to the original UCM's example config (``examples/offline_inference_esa.py``);
``block_repre_tokens`` is this project's (see :mod:`ucm.sparse.esa.method`)."""

from __future__ import annotations

from dataclasses import dataclass

from ucm.sparse.config import at_least, ratio
from ucm.sparse.offload.config import OffloadConfig


@dataclass
class ESAConfig(OffloadConfig):
    """ESA: block retrieval over sub-block mean keys, with offload of unselected blocks.

    Every layer is sparse: the request's device KV is compressed for all
    layers at once (one block table), so no layer can stay dense.
    """

    sparse_ratio: float = ratio(0.3)
    """Share of the middle blocks kept in device KV: ``k = floor(R * sparse_ratio)``."""
    block_repre_tokens: int = at_least(1, default=4)
    """Consecutive keys averaged into one representative: a block has
    ``B / block_repre_tokens`` of them. Fewer tokens find single salient keys
    (a fact the answer copies) better; the representatives stay on the device
    and take ``1 / block_repre_tokens`` of the middle blocks' K bytes, an
    eighth of their KV at 4 (the block size: one mean key per block, the
    original ESA's)."""
