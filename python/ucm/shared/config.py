"""Building typed config dataclasses from loosely typed sources.

Config values arrive from YAML files, dicts passed by vLLM and environment
variables (strings). :func:`build_dataclass` turns such a mapping into a
dataclass, converting what can be converted losslessly and raising
:class:`ConfigError` that names the key, its source and the valid keys
otherwise.

Every file a user names as config (``UCM_CONFIG_FILE``, ``ucm config check
FILE``, ``ucm store --config``, ``metrics_config_path``,
:meth:`~ucm.store.config.PipelineStoreConfig.from_yaml`) is read by
:func:`read_config_file` and parsed by :func:`load_yaml`: a regular file of
at most :data:`MAX_CONFIG_BYTES`, never a device, FIFO or directory.
"""

# Why not pydantic (which vLLM installs): ucm itself depends on numpy, pyyaml,
# click and tqdm only, and `ucm config check` must run where vLLM is not
# installed; pydantic with pydantic-core is about 10 MB more. Its lax mode
# also converts differently from what ucm's configs have always accepted:
# it refuses "0x10" for an int, turns True into 1 and "t" into True, and
# passes "inf" and "nan" as floats; here the first is 16 and the others are
# errors naming the key and its source. The store's keys (the stage classes
# of ucm.store.config, made from the core's declarations) are checked by the
# core itself (`_native.check_stage`), so a second validator could only
# disagree with it. What pydantic would replace is `_convert` and
# `build_dataclass`, about 135 lines.

from __future__ import annotations

import dataclasses
import math
import os
import stat
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from ucm.errors import InvalidParamError

T = TypeVar("T")

#: The largest config file read (1 MiB). A config is a few KiB; the limit
#: keeps a wrong path (a log, a disk image) from filling memory.
MAX_CONFIG_BYTES = 1 << 20
#: The most values (scalars and collections, each alias counted where it is
#: used) a config file may expand to, and how deeply they may nest: a small
#: file whose anchors refer to each other ("billion laughs") or thousands of
#: nested brackets would otherwise cost unbounded time and memory, or the
#: stack, in whatever walks the values next.
MAX_CONFIG_VALUES = 1 << 20
MAX_CONFIG_DEPTH = 64


class ConfigError(InvalidParamError):
    """A config key is unknown or has a value of the wrong type or range."""


def as_mapping(values: Any, source: str) -> dict[str, Any]:
    """``values`` as a dict, or a :class:`ConfigError` naming ``source`` when
    it is not a mapping of keys to values (a list, a string, None...)."""
    if not isinstance(values, Mapping):
        raise ConfigError(
            f"{source}: a config must be a mapping of keys to values, got {type(values).__name__}"
        )
    return dict(values)


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
    values = as_mapping(values, source)
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
            if not isinstance(key, typing.Hashable):
                continue  # construct_mapping below refuses it, naming the line
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


def _file_kind(mode: int) -> str:
    kinds = [
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ]
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def read_config_file(path: str | Path, what: str = "config file") -> str:
    """The text of the config file ``path``: a regular file of at most
    :data:`MAX_CONFIG_BYTES`, in UTF-8. Anything else (a device, a FIFO, a
    directory, a symlink to one of them, a larger file) is a
    :class:`ConfigError` naming the path, without blocking and without
    reading more than the limit."""
    p = Path(path)
    where = f"{what} {p}"
    # Non-blocking, so that opening a FIFO (or a device that waits for a
    # peer) returns at once instead of waiting for a writer; the type check
    # below refuses it.
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(p, flags)
    except OSError as e:
        raise ConfigError(f"cannot read {where}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            target = os.path.realpath(p)
            via = f" ({p} leads to {target})" if target != str(p.absolute()) else ""
            raise ConfigError(
                f"{where} is {_file_kind(st.st_mode)}{via}; a config file must be a regular file"
            )
        too_big = (
            f"{where} is larger than the {MAX_CONFIG_BYTES} bytes (1 MiB) a config file may have"
        )
        if st.st_size > MAX_CONFIG_BYTES:
            raise ConfigError(f"{too_big} ({st.st_size} bytes)")
        # A regular file: plain blocking reads from here on. The size may
        # change under us (or be unknown, as in /proc), so the read itself
        # stops one byte past the limit.
        os.set_blocking(fd, True)
        chunks: list[bytes] = []
        total = 0
        while total <= MAX_CONFIG_BYTES:
            chunk = os.read(fd, MAX_CONFIG_BYTES + 1 - total)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > MAX_CONFIG_BYTES:
            raise ConfigError(too_big)
    except OSError as e:
        raise ConfigError(f"cannot read {where}: {e.strerror or e}") from None
    finally:
        os.close(fd)
    try:
        return b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where} is not UTF-8 text (byte {e.start}: {e.reason})") from None


def _check_size(data: Any, where: str) -> None:
    """Refuses values that expand beyond :data:`MAX_CONFIG_VALUES` or nest
    deeper than :data:`MAX_CONFIG_DEPTH` (walked without recursion, and
    stopping at the limit, so a "billion laughs" costs nothing here)."""
    stack = [(data, 1)]
    count = 0
    while stack:
        value, depth = stack.pop()
        count += 1
        if count > MAX_CONFIG_VALUES:
            raise ConfigError(
                f"{where} expands to more than {MAX_CONFIG_VALUES} values "
                "(anchors and aliases count each time they are used)"
            )
        if depth > MAX_CONFIG_DEPTH:
            raise ConfigError(f"{where} nests values deeper than {MAX_CONFIG_DEPTH} levels")
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for kv in value.items() for v in kv)
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)


def load_yaml(path: str | Path, what: str = "config file") -> dict[str, Any]:
    """Reads a YAML (or JSON) mapping from a file a user named, through
    :func:`read_config_file`, with errors that name the file. A key given
    twice in one mapping is an error, and so are values that expand or nest
    beyond the limits."""
    import yaml

    p = Path(path)
    text = read_config_file(p, what)
    try:
        data = yaml.load(text, Loader=_strict_loader()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{what} {p} is not valid YAML: {e}") from None
    except RecursionError:
        # PyYAML composes nested collections recursively.
        raise ConfigError(
            f"{what} {p} nests values deeper than {MAX_CONFIG_DEPTH} levels"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"{what} {p} must hold a mapping of keys to values at top level, "
            f"got {type(data).__name__}"
        )
    _check_size(data, f"{what} {p}")
    return data
