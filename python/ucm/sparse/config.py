"""``ucm_sparse_config`` parsing into per-method config dataclasses.

The connector config selects one method with exactly one key::

    ucm_sparse_config:
      ESA: {sparse_ratio: 0.3, local_window_sz: 2, retrieval_stride: 5}

Every value is type-checked and range-checked; an error names the full key
(``ucm_sparse_config.ESA.sparse_ratio``) and, for an unknown key, lists the
valid ones. Defaults follow the original UCM's example configs
(``examples/offline_inference_{esa,kvstar}.py``) and GSAOnDevice's JSON
(``qwen3 4b``: ``T = 2048``, ``seq_len_threshold = 2048``, 4 concurrent
requests).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ucm.shared.config import ConfigError, build_dataclass

SPARSE_CONFIG_KEY = "ucm_sparse_config"


def _ratio(key: str, value: float, *, allow_zero: bool = False) -> None:
    lo_ok = value >= 0.0 if allow_zero else value > 0.0
    if not (lo_ok and value <= 1.0):
        interval = "[0, 1]" if allow_zero else "(0, 1]"
        raise ConfigError(f"{key}: must be in {interval}, got {value}")


def _at_least(key: str, value: int, lo: int) -> None:
    if value < lo:
        raise ConfigError(f"{key}: must be >= {lo}, got {value}")


@dataclass
class ESAConfig:
    """ESA: mean-key block retrieval with offload of unselected blocks.

    Every layer is sparse: the request's device KV is compressed for all
    layers at once (one block table), so no layer can stay dense.
    """

    sparse_ratio: float = 0.3
    """Share of the middle blocks kept in device KV: ``k = floor(R * sparse_ratio)``."""
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
        _ratio("sparse_ratio", self.sparse_ratio)
        _at_least("retrieval_stride", self.retrieval_stride, 1)
        _at_least("init_window_sz", self.init_window_sz, 0)
        _at_least("local_window_sz", self.local_window_sz, 1)
        _at_least("min_blocks", self.min_blocks, 1)


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
            _at_least("topk_tokens", self.topk_tokens, 1)
            if self.seq_len_threshold < self.topk_tokens:
                raise ConfigError(
                    f"seq_len_threshold: must be >= topk_tokens ({self.topk_tokens}), "
                    f"got {self.seq_len_threshold}"
                )
        if self.sparse_ratio is not None:
            _ratio("sparse_ratio", self.sparse_ratio)
        _at_least("seq_len_threshold", self.seq_len_threshold, 0)
        _at_least("concurrency_threshold", self.concurrency_threshold, 0)
        _at_least("sink_blocks", self.sink_blocks, 0)
        _at_least("recent_blocks", self.recent_blocks, 1)
        if self.hash_bits is not None and (
            self.hash_bits < 32 or self.hash_bits & (self.hash_bits - 1)
        ):
            raise ConfigError(f"hash_bits: must be a power of two >= 32, got {self.hash_bits}")
        for name in ("rollback_layers", "skip_layers"):
            for i, layer in enumerate(getattr(self, name)):
                _at_least(f"{name}[{i}]", layer, 0)
        both = sorted(set(self.rollback_layers) & set(self.skip_layers))
        if both:
            raise ConfigError(f"skip_layers: layer {both[0]} is also a rollback layer")
        if 0 in self.skip_layers:
            raise ConfigError("skip_layers: layer 0 has no previous layer to reuse")


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
        _ratio("sparse_ratio", self.sparse_ratio)
        _at_least("retrieval_stride", self.retrieval_stride, 1)
        _at_least("init_window_sz", self.init_window_sz, 0)
        _at_least("local_window_sz", self.local_window_sz, 1)
        _at_least("min_blocks", self.min_blocks, 1)
        _ratio("blk_repre_dim_prune_ratio", self.blk_repre_dim_prune_ratio)
        _at_least("blk_repre_inner_token_merge", self.blk_repre_inner_token_merge, 1)


@dataclass(frozen=True)
class SparseMethodSpec:
    """The method chosen by ``ucm_sparse_config``: canonical name and parsed config."""

    name: str
    config: Any


def build_method_config(name: str, values: Mapping[str, Any]) -> Any:
    """Parses one method's mapping with its ``config_class``; errors name the key."""
    from ucm.sparse.factory import UcmSparseFactory

    canonical = UcmSparseFactory.canonical_name(name)
    source = f"{SPARSE_CONFIG_KEY}.{name}"
    if values is None:
        values = {}
    if not isinstance(values, Mapping):
        raise ConfigError(f"{source}: expected a mapping, got {type(values).__name__}")
    config_cls = UcmSparseFactory.get_class(canonical).config_class
    if config_cls is None:
        return dict(values)
    try:
        return build_dataclass(config_cls, values, source)
    except ConfigError as e:
        msg = str(e)
        key = msg.split(":", 1)[0].split("[", 1)[0]
        if key in {f.name for f in dataclasses.fields(config_cls)} and f"({source})" not in msg:
            raise ConfigError(f"{source}.{msg}") from None
        raise


def parse_sparse_config(raw: Mapping[str, Any] | None) -> SparseMethodSpec | None:
    """Parses the value of ``ucm_sparse_config``; ``None``/empty means no method."""
    if not raw:
        return None
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{SPARSE_CONFIG_KEY}: expected a mapping, got {type(raw).__name__}")
    if len(raw) != 1:
        raise ConfigError(
            f"{SPARSE_CONFIG_KEY}: exactly one method must be configured, got {sorted(raw)}"
        )
    ((name, values),) = raw.items()
    from ucm.sparse.factory import UcmSparseFactory

    return SparseMethodSpec(
        UcmSparseFactory.canonical_name(name), build_method_config(name, values or {})
    )


def sparse_config_from_connector(extra_config: Mapping[str, Any] | None) -> SparseMethodSpec | None:
    """The method configured in a connector's ``kv_connector_extra_config``, if any."""
    if not extra_config:
        return None
    return parse_sparse_config(extra_config.get(SPARSE_CONFIG_KEY))
