"""Config of the shared remote tiers: S3-compatible object storage and NFS.

Pipeline stage names (``store_pipeline``):

* ``S3`` (and ``Ds3fs`` / ``DS3FS``, the names the original UCM's examples
  use for the same thing): blocks as objects in a bucket, ``storage_backends:
  "s3://bucket/prefix"``;
* ``NFS``: blocks as files on an NFS export, ``storage_backends:
  "nfs://server/export/path"`` (a user-space NFSv3 client in the Rust core:
  no kernel mount, no root) or the path of a directory on an export the
  kernel already mounted.

Both are usually stacked under a host-memory cache (``Cache|S3``,
``Cache|NFS``) so that engines on several machines share KV blocks: what
one engine dumps, the others find with ``lookup`` and load. Credentials and
other values may name environment variables as ``${VAR}`` (or
``${VAR:-default}``), expanded by the core; with no ``s3_access_key`` at
all, the standard AWS variables (``AWS_ACCESS_KEY_ID``, ...) and credential
sources apply. Secrets never appear in a config's ``repr``, in logs or in
error messages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def _common_checks(cfg: Any) -> None:
    from ucm.shared.config import ConfigError
    from ucm.store.config import _resolve_sizes

    if isinstance(cfg.storage_backends, list):
        if len(cfg.storage_backends) != 1:
            raise ConfigError(
                f"storage_backends: the remote stores take one location, got "
                f"{len(cfg.storage_backends)}"
            )
        cfg.storage_backends = str(cfg.storage_backends[0])
    cfg.storage_backends = cfg.storage_backends.strip()
    if not cfg.storage_backends:
        raise ConfigError("storage_backends: a location is required")
    _resolve_sizes(cfg)
    if cfg.timeout_ms < 0:
        raise ConfigError(f"timeout_ms: must be >= 0, got {cfg.timeout_ms}")


def _positive(cfg: Any, *keys: str) -> None:
    from ucm.shared.config import ConfigError

    for key in keys:
        if getattr(cfg, key) <= 0:
            raise ConfigError(f"{key}: must be > 0, got {getattr(cfg, key)}")


def _non_negative(cfg: Any, *keys: str) -> None:
    from ucm.shared.config import ConfigError

    for key in keys:
        if getattr(cfg, key) < 0:
            raise ConfigError(f"{key}: must be >= 0, got {getattr(cfg, key)}")


@dataclass
class S3StoreConfig:
    """Keys of the ``S3`` / ``Ds3fs`` stage (one object per block)."""

    storage_backends: list[str] | str
    """``s3://bucket/prefix``: the bucket and the key prefix of the blocks."""
    block_size: int
    """Bytes of one whole block, all shards together."""
    shard_size: int | None = None
    """Bytes of one shard (defaults to ``block_size``)."""
    tensor_size: int | None = None
    """Bytes of each tensor of a shard, when they are all equal."""
    tensor_size_list: list[int] | None = None
    """Bytes of each tensor of a shard, in order (sums to ``shard_size``)."""
    s3_endpoint: str = ""
    """Endpoint of an S3-compatible service (``http://minio:9000``); empty: AWS
    (or ``AWS_ENDPOINT_URL``)."""
    s3_region: str = ""
    """Region; empty: ``AWS_REGION``/``AWS_DEFAULT_REGION``, else ``us-east-1``."""
    s3_access_key: str = field(default="", repr=False)
    """Access key id, e.g. ``"${AWS_ACCESS_KEY}"``; empty: the standard AWS
    environment variables and credential sources."""
    s3_secret_key: str = field(default="", repr=False)
    """Secret access key, e.g. ``"${AWS_SECRET_KEY}"``."""
    s3_session_token: str = field(default="", repr=False)
    """Session token of temporary credentials (optional)."""
    s3_virtual_hosted_style: bool = False
    """Virtual-hosted-style requests (``bucket.host``); path style by default,
    which is what most S3-compatible servers expect."""
    s3_max_concurrency: int = 32
    """Requests in flight at most."""
    s3_retries: int = 3
    """Retries of a failed request (5xx, connection errors, timeouts), with
    exponential backoff; each request with its retries stays within ``timeout_ms``."""
    s3_lookup_cache_ttl_ms: int = 30000
    """How long a "present" lookup result is reused (0 disables)."""
    s3_negative_cache_ttl_ms: int = 1000
    """How long an "absent" lookup result is reused (0 disables): blocks other
    engines write become visible at most this late."""
    s3_staging_buffer_gb: float = 1.0
    """Memory for blocks whose shards are still arriving (layer-wise dumps) and
    for uploads in flight."""
    s3_io_threads: int = 2
    """Threads of the store's I/O runtime."""
    timeout_ms: int = 30000
    """Task timeout, counted from submit; 0 disables it."""
    device_id: int = 0
    """-1 makes a lookup-only store (the scheduler role)."""

    def __post_init__(self) -> None:
        from ucm.shared.config import ConfigError

        _common_checks(self)
        if not self.storage_backends.startswith(("s3://", "s3a://", "${")):
            raise ConfigError(
                f"storage_backends: {self.storage_backends!r} is not an S3 location; "
                "expected s3://bucket/prefix"
            )
        _positive(self, "s3_max_concurrency", "s3_io_threads", "s3_staging_buffer_gb")
        _non_negative(self, "s3_retries", "s3_lookup_cache_ttl_ms", "s3_negative_cache_ttl_ms")


@dataclass
class NfsStoreConfig:
    """Keys of the ``NFS`` stage (one file per block on an NFS export)."""

    storage_backends: list[str] | str
    """``nfs://server[:port]/export/path[?options]`` for the built-in NFSv3
    client, or a directory on a kernel-mounted export."""
    block_size: int
    """Bytes of one whole block, all shards together."""
    shard_size: int | None = None
    """Bytes of one shard (defaults to ``block_size``)."""
    tensor_size: int | None = None
    """Bytes of each tensor of a shard, when they are all equal."""
    tensor_size_list: list[int] | None = None
    """Bytes of each tensor of a shard, in order (sums to ``shard_size``)."""
    nfs_mount_options: str = ""
    """``mount -o`` style options the built-in client honours: ``vers=3``,
    ``port=``, ``mountport=``, ``timeo=`` (tenths of a second per request),
    ``retrans=``, ``rsize=``, ``wsize=``, ``sync``, ``ro``, ``resvport``,
    ``uid=``, ``gid=``, ``lookupcache=none``; others (``rw``, ``hard``,
    ``nolock``...) are ignored with a log line."""
    nfs_max_concurrency: int = 8
    """Requests in flight at most (= connections of the built-in client)."""
    nfs_lookup_cache_ttl_ms: int = 30000
    """How long a "present" lookup result is reused (0 disables); "absent"
    results never are."""
    nfs_io_threads: int = 2
    """Threads of the store's I/O runtime."""
    io_direct: bool = False
    """O_DIRECT on a kernel-mounted export (off unless asked)."""
    timeout_ms: int = 30000
    """Task timeout, counted from submit; 0 disables it."""
    device_id: int = 0
    """-1 makes a lookup-only store (the scheduler role)."""

    def __post_init__(self) -> None:
        _common_checks(self)
        _positive(self, "nfs_max_concurrency", "nfs_io_threads")
        _non_negative(self, "nfs_lookup_cache_ttl_ms")


REMOTE_STAGE_CONFIGS: dict[str, type] = {
    "S3": S3StoreConfig,
    "Ds3fs": S3StoreConfig,
    "DS3FS": S3StoreConfig,  # the seed spells it both ways
    "NFS": NfsStoreConfig,
}
"""Stage names of the remote tiers and their config classes."""


def open_remote_store(cfg: S3StoreConfig | NfsStoreConfig) -> Any:
    """Opens the native store of a remote stage config (a ``NativeStore``)."""
    from ucm import _native

    if isinstance(cfg, S3StoreConfig):
        return _native.open_s3_store(
            url=cfg.storage_backends,
            block_size=cfg.block_size,
            shard_size=cfg.shard_size,
            tensor_size_list=list(cfg.tensor_size_list or []),
            endpoint=cfg.s3_endpoint,
            region=cfg.s3_region,
            access_key=cfg.s3_access_key,
            secret_key=cfg.s3_secret_key,
            session_token=cfg.s3_session_token,
            virtual_hosted_style=cfg.s3_virtual_hosted_style,
            max_concurrency=cfg.s3_max_concurrency,
            retries=cfg.s3_retries,
            timeout_ms=cfg.timeout_ms,
            lookup_cache_ttl_ms=cfg.s3_lookup_cache_ttl_ms,
            negative_cache_ttl_ms=cfg.s3_negative_cache_ttl_ms,
            staging_bytes=int(cfg.s3_staging_buffer_gb * (1 << 30)),
            io_threads=cfg.s3_io_threads,
            device_id=cfg.device_id,
        )
    return _native.open_nfs_store(
        target=cfg.storage_backends,
        block_size=cfg.block_size,
        shard_size=cfg.shard_size,
        tensor_size_list=list(cfg.tensor_size_list or []),
        mount_options=cfg.nfs_mount_options,
        max_concurrency=cfg.nfs_max_concurrency,
        timeout_ms=cfg.timeout_ms,
        lookup_cache_ttl_ms=cfg.nfs_lookup_cache_ttl_ms,
        io_direct=cfg.io_direct,
        io_threads=cfg.nfs_io_threads,
        device_id=cfg.device_id,
    )


__all__ = [
    "REMOTE_STAGE_CONFIGS",
    "NfsStoreConfig",
    "S3StoreConfig",
    "open_remote_store",
]
