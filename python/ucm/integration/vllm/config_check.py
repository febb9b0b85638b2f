"""Everything the connector checks of its config, in one call: the merged
sources (:func:`~ucm.integration.vllm.config.resolve_config`), the store's
stages, the sparse method and the metrics options.

The connector's scheduler half calls it when vLLM constructs it, before any
weights load, so a bad key fails the server's start at once; ``ucm config
check`` calls it too, with the same messages.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ucm.integration.vllm.config import ConfigError, ResolvedConfig, resolve_config
from ucm.integration.vllm.store_handle import build_store_config

#: A block geometry to check store keys against when the model's isn't
#: known yet (``ucm config check``): any valid one shows the same key errors.
PLACEHOLDER_LAYOUT = {"block_size": 1 << 16, "shard_size": 1 << 16, "tensor_size_list": [1 << 16]}


def check_resolved(cfg: ResolvedConfig, layout_keys: Mapping[str, Any] | None = None) -> None:
    """Checks the store and sparse parts of an already merged config; raises
    :class:`ConfigError` naming the key and its source."""
    build_store_config(cfg.store, dict(layout_keys or PLACEHOLDER_LAYOUT), device_id=0)
    if not cfg.connector.ucm_sparse_config:
        # The sparse methods need torch; a config without one is checked
        # without importing them, so ``ucm config check`` runs anywhere.
        return
    source = cfg.sources.get("ucm_sparse_config", "config")
    try:
        from ucm.sparse.config import parse_sparse_config
    except ImportError as e:
        raise ConfigError(
            f"ucm_sparse_config ({source}): checking a sparse method needs {e.name or 'torch'}, "
            "which this Python can't import; install it or check the config where vLLM runs"
        ) from None
    try:
        parse_sparse_config(cfg.connector.ucm_sparse_config)
    except ConfigError as e:
        raise ConfigError(f"ucm_sparse_config ({source}): {e}") from None


def check_config(
    extra_config: Mapping[str, Any] | None, env: Mapping[str, str] | None = None
) -> ResolvedConfig:
    """Merges and checks everything; returns the merged config."""
    cfg = resolve_config(extra_config, env)
    check_resolved(cfg)
    return cfg


def describe(cfg: ResolvedConfig) -> list[tuple[str, Any, str]]:
    """(key, value, source) of every key of the merged config, top-level
    keys first, then the store's."""
    rows: list[tuple[str, Any, str]] = []
    for key, value in vars(cfg.connector).items():
        rows.append((key, value, cfg.sources.get(key, "default")))
    rows.append(("store", cfg.store.name, "default" if not cfg.store.sources else "config"))
    for key, value in cfg.store.config.items():
        shown = "<redacted>" if _secret(key) and value else value
        rows.append((f"store.{key}", shown, cfg.store.source_of(key)))
    return rows


def _secret(key: str) -> bool:
    from ucm.store.config import iter_keys

    return any(k.secret for _, k in iter_keys() if k.name == key)


__all__ = ["PLACEHOLDER_LAYOUT", "check_config", "check_resolved", "describe"]
