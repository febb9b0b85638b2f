"""``ucm_sparse_config``: which method, with which parsed config.

The connector config selects one method with exactly one key::

    ucm_sparse_config:
      ESA: {sparse_ratio: 0.3, local_window_sz: 2, retrieval_stride: 5}

Every value is type-checked and range-checked by the method's config
dataclass (its ``config_class``, e.g. :class:`ucm.sparse.esa.ESAConfig`);
an error names the full key (``ucm_sparse_config.ESA.sparse_ratio``) and,
for an unknown key, lists the valid ones.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from ucm.shared.config import ConfigError
from ucm.sparse.factory import SPARSE_CONFIG_KEY, UcmSparseFactory, build_method_config


def require_ratio(key: str, value: float) -> None:
    """A config check: ``value`` in ``(0, 1]``, else :class:`ConfigError` naming ``key``."""
    if not (0.0 < value <= 1.0):
        raise ConfigError(f"{key}: must be in (0, 1], got {value}")


def require_at_least(key: str, value: int, lo: int) -> None:
    """A config check: ``value >= lo``, else :class:`ConfigError` naming ``key``."""
    if value < lo:
        raise ConfigError(f"{key}: must be >= {lo}, got {value}")


def ratio(default: float) -> Any:
    """A config dataclass field whose value must be in ``(0, 1]`` (:func:`check_fields`).
    A subclass that changes the default declares the field the same way."""
    return field(default=default, metadata={"check": require_ratio})


def at_least(lo: int, *, default: int) -> Any:
    """A config dataclass field whose value must be ``>= lo`` (:func:`check_fields`).
    A subclass that changes the default declares the field the same way."""
    return field(default=default, metadata={"check": functools.partial(require_at_least, lo=lo)})


def check_fields(config: Any) -> None:
    """Runs the checks a config dataclass's fields declare (:func:`ratio`,
    :func:`at_least`), in field order; call it from ``__post_init__``."""
    for f in fields(config):
        check = f.metadata.get("check")
        if check is not None:
            check(f.name, getattr(config, f.name))


@dataclass(frozen=True)
class SparseMethodSpec:
    """The method chosen by ``ucm_sparse_config``: canonical name and parsed config."""

    name: str
    config: Any


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
    return SparseMethodSpec(
        UcmSparseFactory.canonical_name(name),
        build_method_config(name, values or {}),
    )


def method_kv_namespace(raw: Mapping[str, Any] | None) -> str:
    """What the method chosen by ``ucm_sparse_config`` adds to the block-id
    namespace (:meth:`~ucm.sparse.base.UcmSparseBase.kv_namespace`; "" for none)."""
    spec = parse_sparse_config(raw)
    if spec is None:
        return ""
    return UcmSparseFactory.get_class(spec.name).kv_namespace(spec.config)


def sparse_config_from_connector(extra_config: Mapping[str, Any] | None) -> SparseMethodSpec | None:
    """The method configured in a connector's ``kv_connector_extra_config``, if any."""
    if not extra_config:
        return None
    return parse_sparse_config(extra_config.get(SPARSE_CONFIG_KEY))
