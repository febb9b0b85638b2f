"""The connector's store, kept usable: opened lazily, retried with back-off.

Serving must never stop because the store did (directory gone, disk full,
read-only, server down). :class:`StoreHandle` turns every store failure into
"no caching for a while": :meth:`get` returns ``None`` until the back-off
expires, a warning is logged at most every ``warning_interval_s``, and the
first success after a failure logs that caching resumed. Config errors are
the exception: they are raised at start-up.

So is a store that can't be opened at start-up (:meth:`StoreHandle.open_at_start`):
a server that never had a cache is more likely misconfigured than unlucky,
so it refuses to start with the reason and the fix, unless the config says
``allow_degraded: true``; then it serves without a cache, retries as above and
reports itself degraded (``store_degraded`` in its stats) until the store opens.
"""

from __future__ import annotations

import hashlib
import threading
import time
from typing import Any

from ucm.integration.vllm.config import (
    ConfigError,
    ResolvedConfig,
    StoreSpec,
    explain_store_error,
    storage_dirs,
)
from ucm.shared.logging import get_logger
from ucm.store import UcmConnectorFactory, UcmKVStoreBase

logger = get_logger(__name__)


class StoreUnavailableError(RuntimeError):
    """The store can't be opened at start-up and degraded serving isn't allowed."""


# Store errors that concern one block, not the store's health.
BLOCK_LEVEL_ERRORS = ("CorruptBlockError", "BlockNotFoundError")


def is_block_level(err: BaseException) -> bool:
    return type(err).__name__ in BLOCK_LEVEL_ERRORS


def lookup_only(cfg: dict[str, Any]) -> dict[str, Any]:
    """The scheduler's view of a pipeline: its persistent stage alone. The
    scheduler only looks blocks up; a Cache stage of its own would hold
    memory (and log it) for nothing, since what the workers' caches hold is
    in their processes. Keys of the dropped stages are dropped with them."""
    from ucm.store.config import stage_schemas

    pipeline = str(cfg.get("store_pipeline", "Posix"))
    bottom = pipeline.split("|")[-1].strip()
    schemas = stage_schemas()
    if bottom == pipeline.strip() or bottom not in schemas:
        return cfg  # one stage already, or a store registered from Python
    keep = set(schemas[bottom].key_names()) | {"device_id"}
    out = {k: v for k, v in cfg.items() if k in keep}
    out["store_pipeline"] = bottom
    return out


def _on(value: Any) -> bool:
    return value is True or str(value).strip().lower() in ("1", "true", "yes", "on")


def shared_cache_id(cfg: dict[str, Any]) -> str:
    """A name for the shared Cache segment of this store and KV layout, the
    same after a restart: engines (and ranks) over the same directories and
    block shape meet in one segment, and a kept one is found again."""
    key = "|".join(
        str(cfg.get(k, ""))
        for k in ("store_pipeline", "storage_backends", "block_size", "shard_size")
    )
    # Hashes the store's config, not a block id: a name, never a store key.
    return "vllm-" + hashlib.blake2b(key.encode(), digest_size=8).hexdigest()


def build_store_config(
    spec: StoreSpec, layout_keys: dict[str, Any], device_id: int
) -> dict[str, Any]:
    """The user's store config plus the keys derived from the model, validated
    up front for the built-in pipeline store (errors name the key's source)."""
    cfg = dict(spec.config)
    cfg.update(layout_keys)
    cfg["device_id"] = device_id
    if _on(cfg.get("share_buffer_enable")) and not str(cfg.get("unique_id") or "").strip():
        cfg["unique_id"] = shared_cache_id(cfg)
    if spec.name == "UcmPipelineStore" and device_id < 0:
        cfg = lookup_only(cfg)
    if spec.name == "UcmPipelineStore":
        from ucm.store.config import PipelineStoreConfig

        # Keys of ours or of the defaults that a user-chosen pipeline doesn't
        # take are dropped (e.g. storage_backends under store_pipeline: Empty).
        for _ in range(len(cfg)):
            try:
                PipelineStoreConfig.from_dict(cfg, source="ucm store config")
                break
            except ConfigError as e:
                msg = str(e)
                dropped = False
                if msg.startswith("unknown config key"):
                    key = msg.split("'")[1]
                    ours = key in layout_keys or key == "device_id"
                    default = key in spec.config and spec.source_of(key) == "default"
                    if key in cfg and (ours or default):
                        del cfg[key]
                        dropped = True
                if not dropped:
                    raise explain_store_error(e, spec) from None
        if device_id < 0 and "posix_spare_files" not in cfg:
            # A lookup-only store never writes: no pre-allocated spare files.
            try:
                PipelineStoreConfig.from_dict({**cfg, "posix_spare_files": 0})
                cfg["posix_spare_files"] = 0
            except ConfigError:
                pass
    return cfg


def fix_hint(spec: StoreSpec) -> str:
    """What to check for a store that can't be opened, by its stages."""
    pipeline = str(spec.config.get("store_pipeline", ""))
    hints = []
    if "Mooncake" in pipeline:
        hints.append(
            "point mooncake_master (or the MOONCAKE_MASTER variable it names) at a running "
            "Mooncake master"
        )
    if "S3" in pipeline:
        hints.append("check s3_endpoint, the bucket and the credentials")
    if "NFS" in pipeline:
        hints.append("check that the NFS server in storage_backends is reachable")
    if not hints:
        dirs = ", ".join(str(d) for d in storage_dirs(spec)) or "storage_backends"
        hints.append(f"make {dirs} a directory this user can create and write")
    return "; ".join(hints)


class StoreHandle:
    """Opens ``spec`` on first use and tracks whether the store is usable."""

    def __init__(self, cfg: ResolvedConfig, store_config: dict[str, Any], *, role: str) -> None:
        """``cfg.store`` names the store; ``cfg.connector`` says how often to
        retry it and to warn while it is unusable. ``store_config`` is what
        the store is opened with, for this ``role`` (scheduler or a rank)."""
        c = cfg.connector
        self.spec = cfg.store
        self.store_config = store_config
        self.role = role
        self.retry_interval_s = c.store_retry_interval_s
        self.retry_max_s = max(c.store_retry_max_s, c.store_retry_interval_s)
        self.warning_interval_s = c.warning_interval_s
        self._lock = threading.Lock()
        self._store: UcmKVStoreBase | None = None
        self._healthy = True
        self._next_try = 0.0
        self._backoff = self.retry_interval_s
        self._last_warning = -1e18
        self._suppressed = 0
        self.errors = 0
        self.failures_since_ok = 0
        self.allow_degraded = c.allow_degraded
        self.degraded = False
        """Started without the store (``allow_degraded``) and not yet opened it."""
        if self.spec.module_path:
            try:
                UcmConnectorFactory.register_connector(
                    self.spec.name, self.spec.module_path, self.spec.name
                )
            except ValueError:
                pass  # already registered

    # -- state ---------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        return self._healthy

    @property
    def opened(self) -> UcmKVStoreBase | None:
        """The open store, whatever its health (for waiting on submitted tasks)."""
        return self._store

    def get(self) -> UcmKVStoreBase | None:
        """The store, or ``None`` while it is unusable (back-off not expired)."""
        if self._healthy and self._store is not None:
            return self._store
        now = time.monotonic()
        with self._lock:
            if not self._healthy and now < self._next_try:
                return None
            if self._store is None:
                try:
                    self._store = self._open()
                except Exception as e:  # any failure to open: retry later
                    self._fail_locked(e, "open")
                    return None
                if self.degraded:
                    logger.warning(
                        "UCM store %s (%s) opened; no longer degraded", self.spec.name, self.role
                    )
                    self.degraded = False
            return self._store

    def open_at_start(self) -> None:
        """Opens the store now; raises :class:`StoreUnavailableError` with the
        reason and the fix when it can't, unless degraded serving is allowed."""
        with self._lock:
            try:
                self._store = self._open()
                return
            except Exception as e:
                if not self.allow_degraded:
                    raise StoreUnavailableError(self._refusal(e)) from e
                self.degraded = True
                self._fail_locked(e, "open")

    def _refusal(self, err: BaseException) -> str:
        return (
            f"UCM store {self.spec.name} ({self.role}) can't be opened: {err}. "
            f"Fix: {fix_hint(self.spec)}; or set allow_degraded: true in the connector "
            "config to serve without a cache (retrying the store, ucm_store_degraded = 1) "
            "until it can be opened"
        )

    def _open(self) -> UcmKVStoreBase:
        for d in storage_dirs(self.spec):
            d.mkdir(parents=True, exist_ok=True)
        return UcmConnectorFactory.create_connector(self.spec.name, self.store_config)

    # -- reports -------------------------------------------------------------
    def report_failure(self, err: BaseException, what: str) -> None:
        with self._lock:
            self._fail_locked(err, what)

    def _fail_locked(self, err: BaseException, what: str) -> None:
        self.errors += 1
        self.failures_since_ok += 1
        now = time.monotonic()
        if self._healthy:
            self._backoff = self.retry_interval_s
        else:
            self._backoff = min(self._backoff * 2, self.retry_max_s)
        self._healthy = False
        self._next_try = now + self._backoff
        if now - self._last_warning >= self.warning_interval_s:
            extra = f" ({self._suppressed} similar failures not shown)" if self._suppressed else ""
            logger.warning(
                "UCM store %s (%s) failed during %s: %s; serving continues without "
                "caching, next try in %.1fs%s",
                self.spec.name,
                self.role,
                what,
                err,
                self._backoff,
                extra,
            )
            self._last_warning = now
            self._suppressed = 0
        else:
            self._suppressed += 1

    def report_success(self) -> None:
        if self._healthy and self.failures_since_ok == 0:
            return
        with self._lock:
            if not self._healthy:
                logger.warning(
                    "UCM store %s (%s) is usable again; caching resumed", self.spec.name, self.role
                )
            self._healthy = True
            self.failures_since_ok = 0
            self._backoff = self.retry_interval_s

    def close(self) -> None:
        with self._lock:
            store, self._store = self._store, None
        if store is not None:
            try:
                store.close()
            except Exception as e:  # pragma: no cover - best effort at shutdown
                logger.debug("closing the UCM store failed: %s", e)


__all__ = [
    "StoreHandle",
    "StoreUnavailableError",
    "build_store_config",
    "fix_hint",
    "is_block_level",
]
