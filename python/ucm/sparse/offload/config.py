"""What every offloading method's config holds (``ucm_sparse_config.ESA``,
``ucm_sparse_config.KVStar``): its block windows, ratio and cadence."""

from __future__ import annotations

from dataclasses import dataclass

from ucm.sparse.config import require_at_least, require_ratio


@dataclass
class OffloadConfig:
    """The keys ESA and KVStar share; each sets its own defaults."""

    sparse_ratio: float = 0.3
    """Share of the middle blocks kept in device KV."""
    retrieval_stride: int = 5
    """Decode steps between two retrievals (re-selections)."""
    init_window_sz: int = 1
    """Leading prompt blocks always kept."""
    local_window_sz: int = 2
    """Trailing prompt blocks always kept (the partial tail counts as one)."""
    min_blocks: int = 4
    """Prompts shorter than ``min_blocks`` blocks stay dense."""
    async_retrieval: bool = True
    """Run re-selections on a background thread (False: inline, deterministic)."""

    def __post_init__(self) -> None:
        require_ratio("sparse_ratio", self.sparse_ratio)
        require_at_least("retrieval_stride", self.retrieval_stride, 1)
        require_at_least("init_window_sz", self.init_window_sz, 0)
        require_at_least("local_window_sz", self.local_window_sz, 1)
        require_at_least("min_blocks", self.min_blocks, 1)
