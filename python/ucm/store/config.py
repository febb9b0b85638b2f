"""Config of the built-in stores.

A pipeline config is one flat mapping (the shape of the seed's YAML and of
the original UCM): ``store_pipeline`` names the stages top to bottom
(``"Posix"``, ``"Empty"``) and every other key belongs to one of them. The
whole mapping is validated up front: an unknown key or a bad value raises
:class:`~ucm.shared.config.ConfigError` naming the key and its source.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ucm.shared.config import ConfigError, build_dataclass, field_names, load_yaml

IO_ENGINES = ("auto", "uring", "psync")
GIB = 1 << 30


@dataclass
class PosixStoreConfig:
    """Keys of the ``Posix`` stage (one file per block on a file system)."""

    storage_backends: list[str] | str
    """Directories holding the blocks (a list, or one string of ':'-separated paths)."""
    block_size: int
    """Bytes of one whole block, all shards together."""
    shard_size: int | None = None
    """Bytes of one shard (defaults to ``block_size``: one shard per block)."""
    tensor_size: int | None = None
    """Bytes of each tensor of a shard, when they are all equal."""
    tensor_size_list: list[int] | None = None
    """Bytes of each tensor of a shard, in order (sums to ``shard_size``)."""
    io_direct: bool = False
    """Open files with O_DIRECT (bypass the page cache)."""
    io_engine: str = "auto"
    """``auto`` (io_uring, else psync), ``uring`` or ``psync``."""
    io_threads: int = 4
    """Worker threads (and psync I/O threads)."""
    timeout_ms: int = 30000
    """Task timeout, counted from submit; 0 disables it."""
    posix_capacity_gb: float = 0.0
    """Capacity above which least recently used blocks are evicted; 0 = unbounded."""
    device_id: int = 0
    """-1 makes a lookup-only store (the scheduler role): load/dump are refused."""
    posix_spare_files: int = 32
    """Temporary files kept created and allocated ahead of dumps, per directory
    (hides slow file creation, e.g. on NFS); 0 disables."""

    def __post_init__(self) -> None:
        if isinstance(self.storage_backends, str):
            self.storage_backends = [p for p in self.storage_backends.split(":") if p]
        if not self.storage_backends:
            raise ConfigError("storage_backends: at least one directory is required")
        if self.block_size <= 0:
            raise ConfigError(f"block_size: must be > 0, got {self.block_size}")
        if self.shard_size is None:
            self.shard_size = self.block_size
        if self.shard_size <= 0 or self.block_size % self.shard_size:
            raise ConfigError(
                f"shard_size: {self.shard_size} must be > 0 and divide block_size {self.block_size}"
            )
        if self.tensor_size_list is None:
            if self.tensor_size is not None:
                if self.tensor_size <= 0 or self.shard_size % self.tensor_size:
                    raise ConfigError(
                        f"tensor_size: {self.tensor_size} must be > 0 and divide "
                        f"shard_size {self.shard_size}"
                    )
                self.tensor_size_list = [self.tensor_size] * (self.shard_size // self.tensor_size)
            else:
                self.tensor_size_list = [self.shard_size]
        if sum(self.tensor_size_list) != self.shard_size or min(self.tensor_size_list) <= 0:
            raise ConfigError(
                f"tensor_size_list: {self.tensor_size_list} must be positive and sum to "
                f"shard_size {self.shard_size}"
            )
        if self.io_engine not in IO_ENGINES:
            raise ConfigError(
                f"io_engine: unknown value {self.io_engine!r}; "
                f"valid values: {', '.join(IO_ENGINES)}"
            )
        if self.io_threads <= 0:
            raise ConfigError(f"io_threads: must be > 0, got {self.io_threads}")
        if self.timeout_ms < 0:
            raise ConfigError(f"timeout_ms: must be >= 0, got {self.timeout_ms}")
        if self.posix_spare_files < 0:
            raise ConfigError(f"posix_spare_files: must be >= 0, got {self.posix_spare_files}")
        if self.posix_capacity_gb < 0:
            raise ConfigError(f"posix_capacity_gb: must be >= 0, got {self.posix_capacity_gb}")

    @property
    def shard_count(self) -> int:
        assert self.shard_size is not None
        return self.block_size // self.shard_size


@dataclass
class EmptyStoreConfig:
    """Keys of the ``Empty`` stage (keeps nothing)."""

    timeout_ms: int = 30000


STAGE_CONFIGS: dict[str, type] = {"Posix": PosixStoreConfig, "Empty": EmptyStoreConfig}
"""Built-in stage names and their config classes. Stages registered from
Python take their keys as a plain dict."""

PIPELINE_KEYS = ("store_pipeline",)


@dataclass
class PipelineStoreConfig:
    """A whole pipeline: the stage names and each stage's config."""

    store_pipeline: str
    stages: list[tuple[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(
        cls,
        values: Mapping[str, Any],
        source: str = "config",
        *,
        extra_stage_keys: Mapping[str, list[str]] | None = None,
    ) -> PipelineStoreConfig:
        """Validates a flat config mapping.

        ``extra_stage_keys`` maps stage names registered from Python to the
        keys they accept (their values are passed through untouched).
        """
        values = dict(values)
        pipeline = values.pop("store_pipeline", "Posix")
        if not isinstance(pipeline, str) or not pipeline.strip():
            raise ConfigError(f"store_pipeline ({source}): expected a name like 'Posix'")
        names = [s.strip() for s in pipeline.split("|")]
        extra_stage_keys = dict(extra_stage_keys or {})
        known: set[str] = set(PIPELINE_KEYS)
        for name in names:
            if name in STAGE_CONFIGS:
                known |= set(field_names(STAGE_CONFIGS[name]))
            elif name in extra_stage_keys:
                known |= set(extra_stage_keys[name])
            else:
                valid = sorted(set(STAGE_CONFIGS) | set(extra_stage_keys))
                raise ConfigError(
                    f"store_pipeline ({source}): unknown stage {name!r}; valid stages: "
                    f"{', '.join(valid)}"
                )
        unknown = sorted(k for k in values if k not in known)
        if unknown:
            raise ConfigError(
                f"unknown config key {unknown[0]!r} ({source}) for store_pipeline "
                f"{pipeline!r}; valid keys: {', '.join(sorted(known))}"
            )
        stages: list[tuple[str, Any]] = []
        for name in names:
            if name in STAGE_CONFIGS:
                stage_cls = STAGE_CONFIGS[name]
                mine = {k: v for k, v in values.items() if k in field_names(stage_cls)}
                try:
                    stages.append((name, build_dataclass(stage_cls, mine, source)))
                except ConfigError as e:
                    raise ConfigError(f"stage {name}: {e}") from None
            else:
                keys = set(extra_stage_keys[name])
                stages.append((name, {k: v for k, v in values.items() if k in keys}))
        return cls(store_pipeline=pipeline, stages=stages)

    @classmethod
    def from_yaml(cls, path: str | Path) -> PipelineStoreConfig:
        """Reads a flat store config from a YAML file."""
        return cls.from_dict(load_yaml(path), source=str(path))


__all__ = [
    "GIB",
    "IO_ENGINES",
    "STAGE_CONFIGS",
    "EmptyStoreConfig",
    "PipelineStoreConfig",
    "PosixStoreConfig",
]
