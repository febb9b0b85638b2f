"""Config of the built-in stores.

A pipeline config is one flat mapping (the shape of the seed's YAML and of
the original UCM): ``store_pipeline`` names the stages top to bottom
(``"Cache|Posix"``, ``"Cache|Empty"``, ``"Posix"``, ``"Empty"``, or
``"Cache|<name>"`` for a store registered through
:class:`~ucm.store.factory.UcmConnectorFactory`) and every other key belongs
to one or more of them: the geometry keys (``block_size``, ``shard_size``,
``tensor_size``/``tensor_size_list``), ``device_id`` and ``timeout_ms`` are
shared by every stage that declares them. The whole mapping is validated up
front: an unknown key or a bad value raises
:class:`~ucm.shared.config.ConfigError` naming the stage, the key and its
source.

A stage registered from Python declares the keys it accepts with a
``config_keys`` class attribute; one that does not receives the whole flat
config (as every stage did in the original UCM), and then unknown keys can't
be detected.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ucm.shared.config import ConfigError, build_dataclass, field_names, load_yaml

IO_ENGINES = ("auto", "uring", "psync")
EVICTION_POLICIES = ("s3fifo", "lru", "sieve", "fifo")
FILL_POLICIES = ("read_allocate", "write_allocate", "no_allocate")
WRITE_BACK_POLICIES = ("sync", "async", "lazy")
GIB = 1 << 30


def _resolve_sizes(cfg: Any) -> None:
    """Defaults ``shard_size`` and ``tensor_size_list`` and checks the geometry."""
    if cfg.block_size <= 0:
        raise ConfigError(f"block_size: must be > 0, got {cfg.block_size}")
    if cfg.shard_size is None:
        cfg.shard_size = cfg.block_size
    if cfg.shard_size <= 0 or cfg.block_size % cfg.shard_size:
        raise ConfigError(
            f"shard_size: {cfg.shard_size} must be > 0 and divide block_size {cfg.block_size}"
        )
    if cfg.tensor_size_list is None:
        if cfg.tensor_size is not None:
            if cfg.tensor_size <= 0 or cfg.shard_size % cfg.tensor_size:
                raise ConfigError(
                    f"tensor_size: {cfg.tensor_size} must be > 0 and divide "
                    f"shard_size {cfg.shard_size}"
                )
            cfg.tensor_size_list = [cfg.tensor_size] * (cfg.shard_size // cfg.tensor_size)
        else:
            cfg.tensor_size_list = [cfg.shard_size]
    if sum(cfg.tensor_size_list) != cfg.shard_size or min(cfg.tensor_size_list) <= 0:
        raise ConfigError(
            f"tensor_size_list: {cfg.tensor_size_list} must be positive and sum to "
            f"shard_size {cfg.shard_size}"
        )


def _one_of(key: str, value: str, valid: tuple[str, ...]) -> str:
    v = value.strip().lower()
    if v not in valid:
        raise ConfigError(f"{key}: unknown value {value!r}; valid values: {', '.join(valid)}")
    return v


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
    posix_spare_files: int = 64
    """Temporary files kept created and allocated ahead of dumps, per directory
    (hides slow file creation, e.g. on NFS); 0 disables."""
    durability: str = "none"
    """What a successful dump guarantees: ``none`` (published in the page
    cache: survives a killed process), ``data`` (data synced before the
    rename) or ``full`` (and the directory synced: survives a power cut)."""
    posix_strict: bool = False
    """Refuse storage directories other users can write to, and block files
    other users own, instead of warning."""

    def __post_init__(self) -> None:
        if isinstance(self.storage_backends, str):
            self.storage_backends = [p for p in self.storage_backends.split(":") if p]
        if not self.storage_backends:
            raise ConfigError("storage_backends: at least one directory is required")
        _resolve_sizes(self)
        if self.io_engine not in IO_ENGINES:
            raise ConfigError(
                f"io_engine: unknown value {self.io_engine!r}; "
                f"valid values: {', '.join(IO_ENGINES)}"
            )
        if self.io_threads <= 0:
            raise ConfigError(f"io_threads: must be > 0, got {self.io_threads}")
        self.durability = _one_of("durability", self.durability, ("none", "data", "full"))
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


@dataclass
class CacheStoreConfig:
    """Keys of the ``Cache`` stage: a host-memory tier over the next stage."""

    block_size: int
    """Bytes of one whole block, all shards together (shared with the backend)."""
    shard_size: int | None = None
    """Bytes of one shard; one cache slot holds one shard (defaults to ``block_size``)."""
    tensor_size: int | None = None
    """Bytes of each tensor of a shard, when they are all equal."""
    tensor_size_list: list[int] | None = None
    """Bytes of each tensor of a shard, in order (sums to ``shard_size``)."""
    cache_buffer_capacity_gb: float = 4.0
    """Slot memory in GiB. Committed as it is first used (the original UCM
    defaulted to 32 GiB private / 256 GiB shared; pick what the host can spare)."""
    eviction_policy: str = "s3fifo"
    """``s3fifo`` (default, chosen by measurement), ``lru``, ``sieve`` or ``fifo``."""
    fill_policy: str = "read_allocate"
    """What stays cached: ``read_allocate`` (load misses and dumps), ``write_allocate``
    (dumps only) or ``no_allocate`` (nothing once the backend has it)."""
    write_back_policy: str = "async"
    """``sync`` (dump waits for the backend), ``async`` (queued and batched) or
    ``lazy`` (written when evicted, or on flush/close)."""
    write_back_batch_size: int = 32
    """Blocks per backend write; this many waiting blocks start one (async)."""
    write_back_interval: float = 1.0
    """Seconds a dirty block waits at most for its batch (async)."""
    write_back_max_backoff: float = 10.0
    """Seconds: cap of the retry delay after failed backend writes."""
    cache_stream_number: int = 4
    """CUDA copy streams (1..32) for device memory."""
    cache_copy_threads: int = 4
    """Threads copying between slots and caller memory."""
    cache_backend_threads: int = 8
    """Threads waiting on backend transfers (fills, bypasses, sync writes)."""
    share_buffer_enable: bool = False
    """Put the cache in ``/dev/shm``, shared by every process with the same ``unique_id``."""
    unique_id: str = ""
    """Names the shared segment (required with ``share_buffer_enable``)."""
    device_id: int = 0
    """-1: lookup-only role (load/dump refused); >= 0: transfers on, CUDA device."""
    device_memory: bool | None = None
    """Whether transfer addresses are device memory; ``None`` asks CUDA per transfer."""
    timeout_ms: int = 30000
    """Task timeout, counted from submit; 0 disables it."""

    def __post_init__(self) -> None:
        _resolve_sizes(self)
        self.eviction_policy = _one_of("eviction_policy", self.eviction_policy, EVICTION_POLICIES)
        self.fill_policy = _one_of("fill_policy", self.fill_policy, FILL_POLICIES)
        self.write_back_policy = _one_of(
            "write_back_policy", self.write_back_policy, WRITE_BACK_POLICIES
        )
        if self.cache_buffer_capacity_gb <= 0:
            raise ConfigError(
                f"cache_buffer_capacity_gb: must be > 0, got {self.cache_buffer_capacity_gb}"
            )
        assert self.shard_size is not None
        stride = -(-self.shard_size // 4096) * 4096
        slots = int(self.cache_buffer_capacity_gb * GIB) // stride
        need = max(2, self.block_size // self.shard_size)
        if slots < need:
            raise ConfigError(
                f"cache_buffer_capacity_gb: {self.cache_buffer_capacity_gb} GiB holds {slots} "
                f"slot(s) of {stride} bytes; at least {need} (one whole block) are needed"
            )
        if self.write_back_batch_size <= 0:
            raise ConfigError(
                f"write_back_batch_size: must be > 0, got {self.write_back_batch_size}"
            )
        if self.write_back_interval < 0:
            raise ConfigError(f"write_back_interval: must be >= 0, got {self.write_back_interval}")
        if self.write_back_max_backoff <= 0:
            raise ConfigError(
                f"write_back_max_backoff: must be > 0, got {self.write_back_max_backoff}"
            )
        if not 1 <= self.cache_stream_number <= 32:
            raise ConfigError(
                f"cache_stream_number: {self.cache_stream_number} is out of range 1..32"
            )
        for key in ("cache_copy_threads", "cache_backend_threads"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"{key}: must be > 0, got {getattr(self, key)}")
        if self.share_buffer_enable and not self.unique_id.strip():
            raise ConfigError("unique_id: required (non-empty) when share_buffer_enable is true")
        if self.timeout_ms < 0:
            raise ConfigError(f"timeout_ms: must be >= 0, got {self.timeout_ms}")

    @property
    def capacity_bytes(self) -> int:
        return int(self.cache_buffer_capacity_gb * GIB)


STAGE_CONFIGS: dict[str, type] = {
    "Cache": CacheStoreConfig,
    "Posix": PosixStoreConfig,
    "Empty": EmptyStoreConfig,
}
"""Built-in stage names and their config classes. Stages registered from
Python take their keys as a plain dict."""

# The shared remote tiers (S3 / Ds3fs, NFS): ucm.store.remote_config.
from ucm.store.remote_config import REMOTE_STAGE_CONFIGS  # noqa: E402

STAGE_CONFIGS.update(REMOTE_STAGE_CONFIGS)

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
        extra_stage_keys: Mapping[str, list[str] | None] | None = None,
    ) -> PipelineStoreConfig:
        """Validates a flat config mapping.

        ``extra_stage_keys`` maps stage names registered from Python to the
        keys they accept (their values are passed through untouched), or to
        ``None`` for a stage that takes the whole config. Stage names that are
        neither built in nor listed are looked up in
        :class:`~ucm.store.factory.UcmConnectorFactory`.
        """
        values = dict(values)
        pipeline = values.pop("store_pipeline", "Posix")
        if not isinstance(pipeline, str) or not pipeline.strip():
            raise ConfigError(f"store_pipeline ({source}): expected a name like 'Cache|Posix'")
        names = [s.strip() for s in pipeline.split("|")]
        extra_stage_keys = dict(extra_stage_keys or {})
        for name in names:
            if name not in STAGE_CONFIGS and name not in extra_stage_keys:
                keys = _registered_stage_keys(name)
                if keys is not False:
                    extra_stage_keys[name] = keys
        known: set[str] = set(PIPELINE_KEYS)
        open_ended = False
        for name in names:
            if name in STAGE_CONFIGS:
                known |= set(field_names(STAGE_CONFIGS[name]))
            elif name in extra_stage_keys:
                keys = extra_stage_keys[name]
                if keys is None:
                    open_ended = True
                else:
                    known |= set(keys)
            else:
                valid = sorted(set(STAGE_CONFIGS) | set(extra_stage_keys))
                raise ConfigError(
                    f"store_pipeline ({source}): unknown stage {name!r}; valid stages: "
                    f"{', '.join(valid)} or a store registered with UcmConnectorFactory"
                )
        for i, name in enumerate(names):
            if name == "" or (i < len(names) - 1 and name != "Cache"):
                raise ConfigError(
                    f"store_pipeline ({source}): stage {i + 1} ({name!r}) of {pipeline!r} sits "
                    "above another stage, but only 'Cache' can"
                )
        if names[-1] == "Cache":
            raise ConfigError(
                f"store_pipeline ({source}): 'Cache' needs a stage below it, "
                "e.g. 'Cache|Posix' or 'Cache|Empty'"
            )
        unknown = sorted(k for k in values if k not in known)
        if unknown and not open_ended:
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
                keys = extra_stage_keys[name]
                if keys is None:
                    stages.append((name, dict(values)))
                else:
                    stages.append((name, {k: v for k, v in values.items() if k in set(keys)}))
        return cls(store_pipeline=pipeline, stages=stages)

    @classmethod
    def from_yaml(cls, path: str | Path) -> PipelineStoreConfig:
        """Reads a flat store config from a YAML file."""
        return cls.from_dict(load_yaml(path), source=str(path))


def _registered_stage_keys(name: str) -> list[str] | bool | None:
    """Keys of a store registered with the factory (``None``: any key), or
    ``False`` when ``name`` is not registered."""
    from ucm.store.factory import UcmConnectorFactory

    if name == "UcmPipelineStore" or name not in UcmConnectorFactory.registered():
        return False
    return UcmConnectorFactory.stage_config_keys(name)


__all__ = [
    "EVICTION_POLICIES",
    "FILL_POLICIES",
    "GIB",
    "IO_ENGINES",
    "STAGE_CONFIGS",
    "WRITE_BACK_POLICIES",
    "CacheStoreConfig",
    "EmptyStoreConfig",
    "PipelineStoreConfig",
    "PosixStoreConfig",
]
