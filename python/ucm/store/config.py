"""Config of the built-in stores.

A pipeline config is one flat mapping (the shape of the seed's YAML and of
the original UCM): ``store_pipeline`` names the stages top to bottom
(``"Cache|Posix"``, ``"Cache|S3"``, ``"Cache|Mooncake"``, ``"Posix"``, ``"Empty"``, or
``"Cache|<name>"`` for a store registered through
:class:`~ucm.store.factory.UcmConnectorFactory`) and every other key belongs
to one or more of them: the geometry keys (``block_size``, ``shard_size``,
``tensor_size``/``tensor_size_list``), ``device_id`` and ``timeout_ms`` are
shared by every stage that declares them.

The keys of the built-in stages are declared once, in the Rust core, with
their types, ranges, defaults and docs (:func:`stage_schemas` is this
side's view of them); the core also checks the values, exactly as it does
when it opens a stage. The whole mapping is validated up front: an unknown
key or a bad value raises :class:`~ucm.shared.config.ConfigError` naming the
stage, the key and its source.

A stage registered from Python declares the keys it accepts with a
``config_keys`` class attribute; one that does not receives the whole flat
config (as every stage did in the original UCM), and then unknown keys can't
be detected.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ucm import _native
from ucm.shared.config import ConfigError, as_mapping, did_you_mean, load_yaml

PIPELINE_KEYS = ("store_pipeline",)
GIB = 1 << 30


@dataclass(frozen=True)
class KeySpec:
    """One key of a built-in stage, as the core declares it."""

    name: str
    type: str
    """``bool``, ``int``, ``float``, ``text``, ``choice``, ``sizes``,
    ``paths`` or ``location``."""
    default: str | None
    """The default as config text; None when required or derived."""
    required: bool
    min: float | None
    max: float | None
    choices: tuple[str, ...]
    doc: str
    secret: bool
    shared: bool
    """The same in every stage that has it (the geometry, ``device_id``,
    ``timeout_ms``)."""


@dataclass(frozen=True)
class StageSchema:
    """A built-in stage and its keys, as the core's stage registry declares
    them."""

    name: str
    aliases: tuple[str, ...]
    doc: str
    keys: tuple[KeySpec, ...]
    place: str = "bottom"
    """``tier`` (sits over another stage, like ``Cache``) or ``bottom``."""
    client: str | None = None
    """The client of another system the stage is opened with (``mooncake``)."""
    maintainable: bool = False
    """Whether ``ucm store`` reaches the stage's contents."""

    def key_names(self) -> list[str]:
        return [k.name for k in self.keys]


@functools.cache
def stage_schemas() -> dict[str, StageSchema]:
    """Every built-in stage by name, aliases included (read once from the
    core; immutable)."""
    out: dict[str, StageSchema] = {}
    for s in _native.config_schema():
        schema = StageSchema(
            name=s["name"],
            aliases=tuple(s["aliases"]),
            doc=s["doc"],
            keys=tuple(KeySpec(**{**k, "choices": tuple(k["choices"])}) for k in s["keys"]),
            place=s["place"],
            client=s["client"],
            maintainable=s["maintainable"],
        )
        for name in (schema.name, *schema.aliases):
            out[name] = schema
    return out


@dataclass(frozen=True)
class StageConfig:
    """One built-in stage's checked keys: every key it declares, with the
    defaults filled in and the geometry resolved. Keys read as attributes
    (``cfg.block_size``); secret values never appear in ``repr``."""

    name: str
    values: Mapping[str, Any]
    secret: frozenset[str] = field(default_factory=frozenset)

    def __getattr__(self, key: str) -> Any:
        values = object.__getattribute__(self, "values")
        if key in values:
            return values[key]
        raise AttributeError(f"the {self.name} stage has no key {key!r}")

    def __repr__(self) -> str:
        shown = {k: ("<redacted>" if k in self.secret and v else v) for k, v in self.values.items()}
        return f"StageConfig({self.name!r}, {shown})"


def check_stage(name: str, values: Mapping[str, Any], source: str) -> StageConfig:
    """Checks one built-in stage's keys as the core does when it opens it."""
    schema = stage_schemas()[name]
    values = as_mapping(values, f"stage {name} ({source})")
    try:
        checked = _native.check_stage(name, values)
    except ConfigError as e:
        key = getattr(e, "key", None)
        reason = getattr(e, "reason", str(e))
        raise ConfigError(f"stage {name}: {key} ({source}): {reason}") from None
    return StageConfig(name, checked, frozenset(k.name for k in schema.keys if k.secret))


@dataclass
class PipelineStoreConfig:
    """A whole pipeline: the stage names and each stage's config (a
    :class:`StageConfig` for a built-in stage, a dict for one registered
    from Python)."""

    store_pipeline: str
    stages: list[tuple[str, Any]] = field(default_factory=list)

    @classmethod
    def from_dict(
        cls,
        values: Mapping[str, Any],
        source: str = "config",
        *,
        extra_stage_keys: Mapping[str, list[str] | None] | None = None,
    ) -> PipelineStoreConfig:
        """Validates a flat config mapping.

        ``extra_stage_keys`` maps stage names registered from Python to the
        keys they accept (their values are passed through untouched), or to
        ``None`` for a stage that takes the whole config. Stage names that are
        neither built in nor listed are looked up in
        :class:`~ucm.store.factory.UcmConnectorFactory`.
        """
        values = as_mapping(values, source)
        pipeline = values.pop("store_pipeline", "Posix")
        if not isinstance(pipeline, str) or not pipeline.strip():
            raise ConfigError(f"store_pipeline ({source}): expected a name like 'Cache|Posix'")
        names = pipeline_stages(pipeline, source)
        builtin = stage_schemas()
        extra = dict(extra_stage_keys or {})
        for name in names:
            if name not in builtin and name not in extra:
                keys = _registered_stage_keys(name)
                if keys is not False:
                    extra[name] = keys
        known, open_ended = set(PIPELINE_KEYS), False
        for name in names:
            if name in builtin:
                known |= set(builtin[name].key_names())
            elif name in extra:
                keys = extra[name]
                open_ended |= keys is None
                known |= set(keys or ())
            else:
                valid = sorted({s.name for s in builtin.values()} | set(extra))
                raise ConfigError(
                    f"store_pipeline ({source}): unknown stage {name!r}{did_you_mean(name, valid)}"
                    f"; valid stages: {', '.join(valid)} or a store registered with "
                    "UcmConnectorFactory"
                )
        unknown = sorted(k for k in values if k not in known)
        if unknown and not open_ended:
            raise ConfigError(
                f"unknown config key {unknown[0]!r} ({source}) for store_pipeline "
                f"{pipeline!r}{did_you_mean(unknown[0], known)}; valid keys: "
                f"{', '.join(sorted(known))}"
            )
        stages: list[tuple[str, Any]] = []
        for name in names:
            if name in builtin:
                mine = {k: v for k, v in values.items() if k in builtin[name].key_names()}
                stages.append((name, check_stage(name, mine, source)))
            elif extra[name] is None:
                stages.append((name, dict(values)))
            else:
                wanted = set(extra[name] or ())
                stages.append((name, {k: v for k, v in values.items() if k in wanted}))
        return cls(store_pipeline=pipeline, stages=stages)

    @classmethod
    def from_yaml(cls, path: str | Path) -> PipelineStoreConfig:
        """Reads a flat store config from a YAML file (see
        :func:`~ucm.shared.config.load_yaml` for what a config file may be)."""
        return cls.from_dict(load_yaml(path, "store config file"), source=str(path))


def pipeline_stages(pipeline: str, source: str = "config") -> list[str]:
    """The stage names of ``pipeline``, top first, once the core found their
    order right: only a tier (``Cache``) sits above another stage, and the
    bottom one is not a tier."""
    try:
        return list(_native.pipeline_stages(pipeline))
    except ConfigError as e:
        reason = getattr(e, "reason", str(e))
        raise ConfigError(f"store_pipeline ({source}): {reason}") from None


def all_stage_keys() -> set[str]:
    """Every key any built-in stage accepts, plus ``store_pipeline``."""
    keys = set(PIPELINE_KEYS)
    for schema in stage_schemas().values():
        keys |= set(schema.key_names())
    return keys


def iter_keys() -> Iterator[tuple[StageSchema, KeySpec]]:
    """Each built-in stage (once, not per alias) with each of its keys."""
    seen: set[str] = set()
    for schema in stage_schemas().values():
        if schema.name in seen:
            continue
        seen.add(schema.name)
        for key in schema.keys:
            yield schema, key


def _registered_stage_keys(name: str) -> list[str] | bool | None:
    """Keys of a store registered with the factory (``None``: any key), or
    ``False`` when ``name`` is not registered."""
    from ucm.store.factory import UcmConnectorFactory

    if name == "UcmPipelineStore" or name not in UcmConnectorFactory.registered():
        return False
    return UcmConnectorFactory.stage_config_keys(name)


__all__ = [
    "GIB",
    "PIPELINE_KEYS",
    "KeySpec",
    "PipelineStoreConfig",
    "StageConfig",
    "StageSchema",
    "all_stage_keys",
    "check_stage",
    "iter_keys",
    "pipeline_stages",
    "stage_schemas",
]
