"""Configuration of the vLLM connector.

Three sources, merged key by key with this priority::

    environment (UCM_<KEY>)  >  kv_connector_extra_config  >  YAML file  >  defaults

* ``kv_connector_extra_config`` is the inline dict of ``--kv-transfer-config``.
* The YAML file is named by ``UCM_CONFIG_FILE`` (environment first, then the
  inline key of that name). Its shape is the original UCM's::

      ucm_connectors:
        - ucm_connector_name: UcmPipelineStore
          ucm_connector_config:
            store_pipeline: "Cache|Posix"
            storage_backends: /data/ucm_cache
      use_layerwise: true
      metrics_config_path: ./metrics_config.yaml
      ucm_sparse_config: {...}

* Store keys (``store_pipeline``, ``storage_backends``, ``io_direct``...) may
  also be given at the top level of any source, or as ``UCM_STORAGE_BACKENDS``
  etc.; they apply to the first (only) entry of ``ucm_connectors``.

Every value remembers where it came from, so a validation error says e.g.
``use_layerwise (environment UCM_USE_LAYERWISE): expected a boolean, got 'maybe'``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ucm.hashing import HASH_ALGOS
from ucm.shared.config import (
    ConfigError,
    as_mapping,
    build_dataclass,
    did_you_mean,
    load_yaml,
    ranged,
)
from ucm.shared.env_vars import KNOWN_ENV_VARS, closest_env_var, warn_once
from ucm.shared.logging import get_logger

logger = get_logger(__name__)

ENV_PREFIX = "UCM_"
CONFIG_FILE_KEY = "UCM_CONFIG_FILE"
DEFAULT_STORE_NAME = "UcmPipelineStore"
# Store keys the connector derives from the model; users must not set them.
CONNECTOR_OWNED_STORE_KEYS = ("block_size", "shard_size", "tensor_size", "tensor_size_list")
# Environment variables with the UCM_ prefix that are not config keys.
_NON_CONFIG_ENV = KNOWN_ENV_VARS | {CONFIG_FILE_KEY}


def default_storage_dir() -> str:
    """Where the embedded default store keeps its blocks."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ucm", "kv")


@dataclass
class UcmConnectorConfig:
    """Top-level keys (all optional)."""

    ucm_connectors: list[dict[str, Any]] = field(default_factory=list)
    """Stores: ``[{ucm_connector_name, ucm_connector_config, [ucm_connector_module_path]}]``;
    exactly one entry. Defaults to ``UcmPipelineStore`` with ``Cache|Posix`` (``Posix`` when
    the build has no Cache stage) under ``~/.cache/ucm/kv``."""
    use_layerwise: bool = False
    """Load layer l+1 while layer l computes, and save per layer (else whole-step). A step
    that computes less than one block loads whole-step: it has nothing to overlap with."""
    hash_algo: str = "blake3"
    """Block id algorithm: ``blake3``, ``xxh3_128`` or ``md5_ucm`` (original UCM ids)."""
    hash_salt: str = ""
    """Extra salt in every block id: deployments with different salts never share blocks."""
    metrics_config_path: str | None = None
    """YAML file of metrics options (``enabled``, ``duration_buckets_seconds``; the original
    ``duration_buckets_ms`` is still accepted)."""
    ucm_sparse_config: dict[str, Any] | None = None
    """Sparse attention: ``{METHOD: {...}}``, one of ESA, GSA, KVStar, Blend, ReRoPE or a
    registered method (see :mod:`ucm.sparse.config`).
    Parsed and validated by :mod:`ucm.integration.vllm.sparse.bridge` when the connector starts."""
    load_only_first_rank: bool = False
    """Accepted for compatibility; ignored (every rank loads its own heads)."""
    enable_event_sync: bool = True
    """GPU: order device-to-host copies after the compute stream with an event
    (else synchronize the device before each save)."""
    load_failure_policy: str = "recompute"
    """What vLLM does with blocks that fail to load: ``recompute`` (default) or ``fail``."""
    layerwise_lookahead: int = ranged(0, 0, 4096)
    """Layer-wise mode: how many layers' loads are in flight ahead of the compute; 0 (the
    default) submits every layer at once (in layer order), which keeps the store busiest.
    A small number bounds the host staging memory of GPU builds."""
    min_hit_tokens: int = ranged(0, 0, 1 << 30)
    """Ignore external hits shorter than this (tokens)."""
    prefetch: bool = True
    """Ask the store to start reading a request's hit blocks as soon as they are
    found (page-cache read-ahead of whole block files, or a Cache-tier fill),
    so layer-wise loads find them in memory."""
    allow_degraded: bool = False
    """Serve without a cache when the store can't be opened at start-up (a read-only
    directory, an unreachable server), retrying it in the background, and report it
    (``ucm_store_degraded`` = 1). By default such a start fails with the reason."""
    store_retry_interval_s: float = ranged(1.0, 0.0, 3600.0)
    """After a store failure, first wait before trying the store again (doubles per failure)."""
    store_retry_max_s: float = ranged(30.0, 0.0, 86400.0)
    """Longest wait between tries of an unusable store."""
    warning_interval_s: float = ranged(30.0, 0.0, 86400.0)
    """At most one warning per this many seconds about an unusable store."""
    handover_timeout_s: float = ranged(30.0, 0.0, 3600.0)
    """Prefill/decode disaggregation: how long a decode engine waits for the blocks a
    prefill engine handed over before it computes the missing part (with a warning and
    the ``ucm_handover_timeouts_total`` metric), and how long a prefill engine's
    workers wait for those blocks' saves before it answers anyway."""
    force_host_staging: bool = False
    """Move KV through host staging buffers even for CPU tensors (as GPU builds do); for tests."""

    def __post_init__(self) -> None:
        if self.hash_algo not in HASH_ALGOS:
            raise ConfigError(
                f"hash_algo: unknown value {self.hash_algo!r}; valid: {', '.join(HASH_ALGOS)}"
            )
        if self.load_failure_policy not in ("recompute", "fail"):
            raise ConfigError(
                f"load_failure_policy: expected 'recompute' or 'fail', got "
                f"{self.load_failure_policy!r}"
            )


TOP_LEVEL_KEYS = tuple(f.name for f in fields(UcmConnectorConfig))


@dataclass
class StoreSpec:
    """The store the connector uses: a factory name and its (user) config."""

    name: str
    config: dict[str, Any]
    module_path: str | None = None
    sources: dict[str, str] = field(default_factory=dict)
    """Where each key of ``config`` came from."""

    def source_of(self, key: str) -> str:
        return self.sources.get(key, "default")


@dataclass
class ResolvedConfig:
    """The merged config: top-level keys, the store, and each key's source."""

    connector: UcmConnectorConfig
    store: StoreSpec
    sources: dict[str, str]
    config_file: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)


def store_keys() -> set[str]:
    """Keys any built-in store stage accepts (plus ``store_pipeline``)."""
    from ucm.store.config import all_stage_keys

    return all_stage_keys()


def cache_stage_available() -> bool:
    """True when this build composes pipelines with a ``Cache`` stage."""
    from ucm.store.config import stage_schemas

    return "Cache" in stage_schemas()


def default_store_config() -> dict[str, Any]:
    return {
        "store_pipeline": "Cache|Posix" if cache_stage_available() else "Posix",
        "storage_backends": default_storage_dir(),
    }


class _Layer:
    """One source's values: top-level keys and store keys, with its name."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.top: dict[str, Any] = {}
        self.store_name: str | None = None
        self.store_name_source = name
        self.store_module: str | None = None
        self.store: dict[str, Any] = {}


def _split_source(values: Mapping[str, Any], source: str, skeys: set[str]) -> _Layer:
    layer = _Layer(source)
    for key, value in values.items():
        if key == CONFIG_FILE_KEY:
            continue
        if key == "ucm_connectors":
            if value is None:
                continue
            if not isinstance(value, list):
                raise ConfigError(
                    f"ucm_connectors ({source}): expected a list of "
                    f"{{ucm_connector_name, ucm_connector_config}}, got {type(value).__name__}"
                )
            if len(value) != 1:
                raise ConfigError(
                    f"ucm_connectors ({source}): exactly one store is supported, got {len(value)}"
                )
            entry = value[0]
            if not isinstance(entry, Mapping):
                raise ConfigError(f"ucm_connectors[0] ({source}): expected a mapping")
            unknown = set(entry) - {
                "ucm_connector_name",
                "ucm_connector_config",
                "ucm_connector_module_path",
            }
            if unknown:
                raise ConfigError(
                    f"unknown config key {sorted(unknown)[0]!r} in ucm_connectors[0] ({source}); "
                    "valid keys: ucm_connector_config, ucm_connector_module_path, "
                    "ucm_connector_name"
                )
            name = entry.get("ucm_connector_name")
            if name is not None and not isinstance(name, str):
                raise ConfigError(
                    f"ucm_connectors[0].ucm_connector_name ({source}): expected a string"
                )
            layer.store_name = name
            layer.store_module = entry.get("ucm_connector_module_path")
            cfg = entry.get("ucm_connector_config") or {}
            if not isinstance(cfg, Mapping):
                raise ConfigError(
                    f"ucm_connectors[0].ucm_connector_config ({source}): expected a mapping"
                )
            layer.store.update(cfg)
        elif key in TOP_LEVEL_KEYS:
            layer.top[key] = value
        elif key in skeys or key in CONNECTOR_OWNED_STORE_KEYS or key == "device_id":
            layer.store[key] = value
        else:
            # Keys the connector sets itself are valid store keys, but not
            # for a user: they are not offered.
            owned = {*CONNECTOR_OWNED_STORE_KEYS, "device_id"}
            valid = sorted((set(TOP_LEVEL_KEYS) | skeys) - owned)
            raise ConfigError(
                f"unknown config key {key!r} ({source}){did_you_mean(key, valid)}; "
                f"valid keys: {', '.join(valid)}"
            )
    for key in (*CONNECTOR_OWNED_STORE_KEYS, "device_id"):
        if key in layer.store:
            raise ConfigError(
                f"{key} ({source}): set by the connector from the model's KV cache layout; "
                "remove it from the config"
            )
    return layer


def _env_layer(env: Mapping[str, str], skeys: set[str]) -> _Layer:
    values: dict[str, Any] = {}
    names: dict[str, str] = {}
    skip = {"ucm_connectors", "ucm_sparse_config", "device_id", *CONNECTOR_OWNED_STORE_KEYS}
    wanted = {k.upper(): k for k in (*TOP_LEVEL_KEYS, *skeys) if k not in skip}
    for var, raw in env.items():
        if not var.startswith(ENV_PREFIX) or var in _NON_CONFIG_ENV:
            continue
        key = wanted.get(var[len(ENV_PREFIX) :])
        if key is None:
            meant = closest_env_var(var, [*(ENV_PREFIX + w for w in wanted), *KNOWN_ENV_VARS])
            warn_once(
                var,
                "environment variable %s matches no UCM config key and is ignored%s",
                var,
                f" (did you mean {meant!r}?)" if meant else "",
            )
            continue
        values[key] = raw
        names[key] = var
    layer = _split_source(values, "environment", skeys)
    layer.name = "environment"
    layer.env_names = names  # type: ignore[attr-defined]
    return layer


def _source_label(layer: _Layer, key: str) -> str:
    env_names = getattr(layer, "env_names", None)
    if env_names and key in env_names:
        return f"environment {env_names[key]}"
    return layer.name


def _metrics_path(value: str, sources: Mapping[str, str], config_file: str | None) -> Path:
    """``metrics_config_path`` as a path: relative to the YAML file that set
    it (as the seed's examples write it, ``./metrics_config.yaml``), else to
    the working directory."""
    path = Path(value).expanduser()
    if not path.is_absolute() and config_file and sources["metrics_config_path"].startswith("YAML"):
        path = Path(config_file).expanduser().resolve().parent / path
    return path.resolve()


def _check_store_name(name: str, module: str | None, source: str) -> None:
    """A store name the factory knows, or one whose module the config names
    (the connector registers it from there): anything else would only fail
    when the store is first opened, and then be retried forever."""
    from ucm.store.factory import UcmConnectorFactory

    if module is not None or name in UcmConnectorFactory.registered():
        return
    valid = UcmConnectorFactory.registered()
    raise ConfigError(
        f"ucm_connectors[0].ucm_connector_name ({source}): unknown store {name!r}"
        f"{did_you_mean(name, valid)}; registered stores: {', '.join(valid)} "
        "(a store of your own needs ucm_connector_module_path too)"
    )


def resolve_config(
    extra_config: Mapping[str, Any] | None,
    env: Mapping[str, str] | None = None,
) -> ResolvedConfig:
    """Merges the sources and validates every key (raises :class:`ConfigError`)."""
    env = dict(os.environ if env is None else env)
    extra = as_mapping(extra_config or {}, "kv_connector_extra_config")
    skeys = store_keys()

    config_file = env.get(CONFIG_FILE_KEY) or extra.get(CONFIG_FILE_KEY)
    layers: list[_Layer] = []  # lowest priority first
    if config_file:
        src = f"YAML {config_file}"
        data = load_yaml(config_file)
        layers.append(_split_source(data, src, skeys))
    layers.append(_split_source(extra, "kv_connector_extra_config", skeys))
    layers.append(_env_layer(env, skeys))

    # Top-level keys: the highest layer that sets a key wins.
    top: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for layer in layers:
        for k, v in layer.top.items():
            top[k] = v
            sources[k] = _source_label(layer, k)
    for k, v in top.items():
        # Validates each key on its own, so the error names its source.
        build_dataclass(UcmConnectorConfig, {k: v}, sources[k])
    connector = build_dataclass(UcmConnectorConfig, top, "config")

    # Store: name from the highest layer naming one; keys merged key by key,
    # restarting whenever a higher layer names a different store.
    name = DEFAULT_STORE_NAME
    name_src = "default"
    module: str | None = None
    store_cfg: dict[str, Any] = default_store_config()
    store_src: dict[str, str] = {}
    for layer in layers:
        if layer.store_name is not None and layer.store_name != name:
            name = layer.store_name
            name_src = layer.store_name_source
            store_cfg = {} if name != DEFAULT_STORE_NAME else default_store_config()
            store_src = {}
        if layer.store_module is not None:
            module = layer.store_module
        for k, v in layer.store.items():
            store_cfg[k] = v
            store_src[k] = _source_label(layer, k)
    _check_store_name(name, module, name_src)
    spec = StoreSpec(name=name, config=store_cfg, module_path=module, sources=store_src)

    metrics: dict[str, Any] = {}
    if connector.metrics_config_path:
        path = _metrics_path(connector.metrics_config_path, sources, config_file)
        try:
            is_file = path.is_file()
        except OSError:  # a name too long for the file system, ...
            is_file = False
        if not is_file:
            raise ConfigError(
                f"metrics_config_path ({sources['metrics_config_path']}): "
                f"{connector.metrics_config_path!r} resolves to {path}, which is not a file"
                + (
                    " (a relative path is taken from the YAML file's directory)"
                    if sources["metrics_config_path"].startswith("YAML")
                    else f" (a relative path is taken from the working directory {Path.cwd()})"
                )
            )
        metrics = load_yaml(path, "metrics config file")
        valid = {"enabled", "duration_buckets_seconds", "duration_buckets_ms"}
        unknown = sorted(set(metrics) - valid)
        if unknown:
            raise ConfigError(
                f"unknown config key {unknown[0]!r} (metrics config "
                f"{path}); valid keys: {', '.join(sorted(valid))}"
            )
    if connector.load_only_first_rank:
        logger.warning(
            "load_only_first_rank (%s) is ignored: every rank loads its own KV heads",
            sources.get("load_only_first_rank"),
        )
    return ResolvedConfig(
        connector=connector,
        store=spec,
        sources=sources,
        config_file=str(config_file) if config_file else None,
        metrics=metrics,
    )


_KEY_IN_MESSAGE = re.compile(
    r"^(?:stage \w+: )?(?:unknown config key |missing required config key )?"
    r"'?([A-Za-z_][\w\[\]]*)'?"
)


def explain_store_error(err: ConfigError, spec: StoreSpec) -> ConfigError:
    """Adds the source of the offending store key to a store config error."""
    msg = str(err)
    m = _KEY_IN_MESSAGE.match(msg)
    key = m.group(1).split("[")[0] if m else None
    if key and key in spec.config:
        where = spec.source_of(key)
        return ConfigError(f"{msg} [store key {key!r} from {where}]")
    return ConfigError(f"{msg} [store config of {spec.name}]")


def storage_dirs(spec: StoreSpec) -> list[Path]:
    """The storage directories named by the store config (for creating them):
    one text is one directory, several are a list."""
    raw = spec.config.get("storage_backends")
    if raw is None:
        return []
    parts = [raw] if isinstance(raw, str) else [str(p) for p in raw]
    return [Path(p).expanduser() for p in parts]


__all__ = [
    "CONFIG_FILE_KEY",
    "ResolvedConfig",
    "StoreSpec",
    "UcmConnectorConfig",
    "default_storage_dir",
    "explain_store_error",
    "resolve_config",
]
