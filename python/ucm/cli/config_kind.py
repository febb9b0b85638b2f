"""Which kind of config a file holds: a connector config (what vLLM's
``kv_connector_extra_config`` or ``UCM_CONFIG_FILE`` takes) or a store config
(what :meth:`ucm.store.PipelineStoreConfig.from_yaml` and ``ucm.store.open``
take). The two share the store keys, but only a store config sets the block
geometry (``block_size``...), and only a connector config has the
connector's own keys (``ucm_connectors``, ``use_layerwise``...)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ucm.integration.vllm.config import CONNECTOR_OWNED_STORE_KEYS, TOP_LEVEL_KEYS

KINDS = ("auto", "connector", "store")


def detect_kind(data: Mapping[str, Any]) -> str:
    """``"store"`` for a mapping with the block geometry or ``store_pipeline``
    and none of the connector's own keys; ``"connector"`` otherwise."""
    if any(k in TOP_LEVEL_KEYS for k in data):
        return "connector"
    store_only = ("store_pipeline", *CONNECTOR_OWNED_STORE_KEYS)
    return "store" if any(k in data for k in store_only) else "connector"


__all__ = ["KINDS", "detect_kind"]
