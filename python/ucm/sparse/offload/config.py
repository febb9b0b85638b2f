"""What every offloading method's config holds (``ucm_sparse_config.ESA``,
``ucm_sparse_config.KVStar``): its block windows, ratio and cadence."""

from __future__ import annotations

from dataclasses import dataclass

from ucm.sparse.config import at_least, check_fields, ratio


@dataclass
class OffloadConfig:
    """The keys ESA and KVStar share; each sets its own defaults."""

    sparse_ratio: float = ratio(0.3)
    """Share of the middle blocks kept in device KV."""
    retrieval_stride: int = at_least(1, default=5)
    """Decode steps between two retrievals (re-selections)."""
    init_window_sz: int = at_least(0, default=1)
    """Leading prompt blocks always kept."""
    local_window_sz: int = at_least(1, default=2)
    """Trailing prompt blocks always kept (the partial tail counts as one)."""
    min_blocks: int = at_least(1, default=4)
    """Prompts shorter than ``min_blocks`` blocks stay dense."""
    async_retrieval: bool = True
    """Run re-selections on a background thread (False: inline, deterministic)."""

    def __post_init__(self) -> None:
        check_fields(self)
