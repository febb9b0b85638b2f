"""Building typed config dataclasses from loosely typed sources.

Config values arrive from YAML files, dicts passed by vLLM and environment
variables (strings). :func:`build_dataclass` turns such a mapping into a
dataclass, converting what can be converted losslessly and raising
:class:`ConfigError` that names the key, its source and the valid keys
otherwise.
"""

from __future__ import annotations

import dataclasses
import math
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
        number: float | None = None
        if isinstance(value, int | float):
            try:
                number = float(value)
            except OverflowError:
                number = math.inf
        elif isinstance(value, str):
            try:
                number = float(value.strip())
            except ValueError:
                pass
        if number is None:
            raise ConfigError(f"{key} ({source}): expected a number, got {value!r}")
        if not math.isfinite(number):
            raise ConfigError(f"{key} ({source}): expected a finite number, got {value!r}")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, Path):
            return str(value)
        raise ConfigError(f"{key} ({source}): expected a string, got {type(value).__name__}")
    raise ConfigError(f"{key} ({source}): unsupported config type {tp!r}")


def did_you_mean(name: str, valid: Any) -> str:
    """`` (did you mean 'x'?)`` when one of ``valid`` is close to ``name``."""
    import difflib

    close = difflib.get_close_matches(name, sorted(valid), n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


def ranged(default: Any, lo: float, hi: float) -> Any:
    """A dataclass field whose value must lie in ``lo..=hi``, checked by
    :func:`build_dataclass` (the range is declared with the key)."""
    return dataclasses.field(default=default, metadata={"range": (lo, hi)})


def _check_range(cls: type, key: str, value: Any, source: str) -> None:
    f = next((f for f in dataclasses.fields(cls) if f.name == key), None)
    bounds = f.metadata.get("range") if f is not None else None
    if bounds is None or value is None or isinstance(value, bool):
        return
    lo, hi = bounds
    if not lo <= value <= hi:
        raise ConfigError(f"{key} ({source}): {value!r} is out of range {lo}..={hi}")


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
    for k, v in kwargs.items():
        _check_range(cls, k, v, source)
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


def _strict_loader() -> type:
    """A safe YAML loader that refuses a key given twice in one mapping
    (PyYAML keeps the last one silently, hiding the typo or the stale line)."""
    import yaml

    class StrictLoader(yaml.SafeLoader):
        pass

    def mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key {key!r} is given more than once (lines {seen[key]} and {line})",
                    key_node.start_mark,
                )
            seen[key] = line
        return loader.construct_mapping(node, deep=deep)

    StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    return StrictLoader


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Reads a YAML mapping, with errors that name the file. A key given
    twice in one mapping is an error."""
    import yaml

    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config file {p}: {e}") from e
    try:
        data = yaml.load(text, Loader=_strict_loader()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {p} is not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must hold a mapping at top level")
    return data
