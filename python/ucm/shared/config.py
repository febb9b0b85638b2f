"""Building typed config dataclasses from loosely typed sources.

Config values arrive from YAML files, dicts passed by vLLM and environment
variables (strings). :func:`build_dataclass` turns such a mapping into a
dataclass, converting what can be converted losslessly and raising
:class:`ConfigError` that names the key, its source and the valid keys
otherwise.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from ucm.errors import InvalidParamError

T = TypeVar("T")


class ConfigError(InvalidParamError):
    """A config key is unknown or has a value of the wrong type or range."""


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _convert(key: str, value: Any, tp: Any, source: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arm in args:
            if arm is type(None):
                continue
            try:
                return _convert(key, value, arm, source)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key} ({source}): invalid value {value!r}")
    if origin is list:
        (item_tp,) = args or (Any,)
        if isinstance(value, str):
            raise ConfigError(f"{key} ({source}): expected a list, got the string {value!r}")
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key} ({source}): expected a list, got {type(value).__name__}")
        return [_convert(f"{key}[{i}]", v, item_tp, source) for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key} ({source}): expected a mapping, got {type(value).__name__}")
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise ConfigError(f"{key} ({source}): expected a boolean, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key} ({source}): expected an integer, got the boolean {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.strip(), 0)
            except ValueError:
                pass
        raise ConfigError(f"{key} ({source}): expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key} ({source}): expected a number, got the boolean {value!r}")
        if isinstance(value, int | float):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value.strip())
            except ValueError:
                pass
        raise ConfigError(f"{key} ({source}): expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, Path):
            return str(value)
        raise ConfigError(f"{key} ({source}): expected a string, got {type(value).__name__}")
    raise ConfigError(f"{key} ({source}): unsupported config type {tp!r}")


def field_names(cls: type) -> list[str]:
    """The config keys a dataclass accepts."""
    return [f.name for f in dataclasses.fields(cls)]


def build_dataclass(
    cls: type[T],
    values: Mapping[str, Any],
    source: str = "config",
    *,
    allow_unknown: bool = False,
) -> T:
    """Builds ``cls`` from ``values``; unknown keys are errors unless allowed."""
    hints = typing.get_type_hints(cls)
    names = set(field_names(cls))
    unknown = sorted(k for k in values if k not in names)
    if unknown and not allow_unknown:
        raise ConfigError(
            f"unknown config key {unknown[0]!r} ({source}); valid keys: {', '.join(sorted(names))}"
        )
    kwargs = {k: _convert(k, v, hints[k], source) for k, v in values.items() if k in names}
    missing = [
        f.name
        for f in dataclasses.fields(cls)
        if f.name not in kwargs
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"missing required config key {missing[0]!r} ({source})")
    return cls(**kwargs)


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Reads a YAML mapping, with errors that name the file."""
    import yaml

    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config file {p}: {e}") from e
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {p} is not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must hold a mapping at top level")
    return data
