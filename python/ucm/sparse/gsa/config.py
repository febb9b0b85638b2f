"""``ucm_sparse_config: {GSA: {...}}``. Defaults follow GSAOnDevice's JSON
(``qwen3 4b``: ``T = 2048``, ``seq_len_threshold = 2048``, 4 concurrent
requests)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ucm.shared.config import ConfigError
from ucm.sparse.config import require_at_least, require_ratio


@dataclass
class GSAConfig:
    """GSA (HATA-style hash-aware top-k on device, no offload)."""

    topk_tokens: int | None = None
    """``T``: tokens' worth of blocks kept per request (multiple of the block size)."""
    sparse_ratio: float | None = None
    """Instead of ``topk_tokens``: keep ``ceil(sparse_ratio * blocks)`` blocks."""
    seq_len_threshold: int = 2048
    """Only requests at least this long count towards the concurrency gate."""
    concurrency_threshold: int = 4
    """Sparse only in steps with at least this many long requests."""
    rollback_layers: list[int] = field(default_factory=list)
    """Layers with full attention and no key codes."""
    skip_layers: list[int] = field(default_factory=list)
    """Layers that reuse the previous layer's selection (no codes computed)."""
    hash_bits: int | None = None
    """Bits per key code (power of two >= 32); default: the head dim."""
    sink_blocks: int = 1
    """Leading blocks always kept."""
    recent_blocks: int = 4
    """Trailing blocks always kept."""
    seed: int = 0
    """Seed of the random projection (must agree across workers)."""

    def __post_init__(self) -> None:
        if self.topk_tokens is not None and self.sparse_ratio is not None:
            raise ConfigError("topk_tokens: give either topk_tokens or sparse_ratio, not both")
        if self.topk_tokens is None and self.sparse_ratio is None:
            self.topk_tokens = 2048
        if self.topk_tokens is not None:
            require_at_least("topk_tokens", self.topk_tokens, 1)
            if self.seq_len_threshold < self.topk_tokens:
                raise ConfigError(
                    f"seq_len_threshold: must be >= topk_tokens ({self.topk_tokens}), "
                    f"got {self.seq_len_threshold}"
                )
        if self.sparse_ratio is not None:
            require_ratio("sparse_ratio", self.sparse_ratio)
        require_at_least("seq_len_threshold", self.seq_len_threshold, 0)
        require_at_least("concurrency_threshold", self.concurrency_threshold, 0)
        require_at_least("sink_blocks", self.sink_blocks, 0)
        require_at_least("recent_blocks", self.recent_blocks, 1)
        if self.hash_bits is not None and (
            self.hash_bits < 32 or self.hash_bits & (self.hash_bits - 1)
        ):
            raise ConfigError(f"hash_bits: must be a power of two >= 32, got {self.hash_bits}")
        for name in ("rollback_layers", "skip_layers"):
            for i, layer in enumerate(getattr(self, name)):
                require_at_least(f"{name}[{i}]", layer, 0)
        both = sorted(set(self.rollback_layers) & set(self.skip_layers))
        if both:
            raise ConfigError(f"skip_layers: layer {both[0]} is also a rollback layer")
        if 0 in self.skip_layers:
            raise ConfigError("skip_layers: layer 0 has no previous layer to reuse")
