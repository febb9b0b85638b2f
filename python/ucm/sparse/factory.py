"""``UcmSparseFactory``: sparse-attention methods by name, imported lazily.

>>> UcmSparseFactory.register_sparse_method("MySparse", "my_module.sparse", "MySparse")
... # doctest: +SKIP

Built-in names: ``ESA``, ``GSA`` (alias ``GSAOnDevice``) and ``KVStar`` (alias
``KVStarMultiStep``), the aliases being the original UCM's names; ``Blend``
(alias ``CacheBlend``) and ``ReRoPE``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from ucm.shared.config import ConfigError, build_dataclass
from ucm.shared.registry import LazyRegistry
from ucm.sparse.base import SparseModelInfo, UcmSparseBase, UcmSparseRole

#: The connector config key that selects a method (``{NAME: {...}}``).
SPARSE_CONFIG_KEY = "ucm_sparse_config"


class UcmSparseFactory(LazyRegistry[UcmSparseBase]):
    """Registry of :class:`UcmSparseBase` subclasses by name."""

    _entries: ClassVar[dict[str, tuple[str, str]]] = {
        "ESA": ("ucm.sparse.esa", "ESA"),
        "GSA": ("ucm.sparse.gsa", "GSA"),
        "KVStar": ("ucm.sparse.kvstar", "KVStar"),
        "Blend": ("ucm.sparse.blend", "Blend"),
        "ReRoPE": ("ucm.sparse.rerope", "ReRoPE"),
    }
    kind = "sparse method"
    base = UcmSparseBase
    error = ConfigError
    _aliases: ClassVar[dict[str, str]] = {
        "GSAOnDevice": "GSA",
        "KVStarMultiStep": "KVStar",
        "CacheBlend": "Blend",
    }

    @classmethod
    def register_sparse_method(cls, name: str, module_path: str, class_name: str) -> None:
        """Registers ``module_path.class_name`` under ``name`` (imported on first use).

        Raises ``ValueError`` if the name (or an alias) is taken.
        """
        if name in cls._aliases:
            raise ValueError(f"sparse method {name!r} is already registered")
        cls._register(name, module_path, class_name)

    @classmethod
    def unregister_sparse_method(cls, name: str) -> None:
        """Removes a registration (mostly for tests)."""
        cls._unregister(name)

    @classmethod
    def canonical_name(cls, name: str) -> str:
        """``name`` with aliases resolved; :class:`ConfigError` if unknown."""
        name = cls._aliases.get(name, name)
        if name not in cls._entries:
            raise ConfigError(
                f"unknown sparse method {name!r} in ucm_sparse_config; "
                f"registered: {', '.join(cls.registered())}"
            )
        return name

    @classmethod
    def get_class(cls, name: str) -> type[UcmSparseBase]:
        """Imports and returns the class registered under ``name`` (or an alias)."""
        return super().get_class(cls.canonical_name(name))

    @classmethod
    def create_sparse_method(
        cls,
        name: str,
        model: SparseModelInfo | None,
        role: UcmSparseRole,
        config: Any = None,
    ) -> UcmSparseBase:
        """Builds the method ``name`` for ``role`` on ``model`` (the model and its KV layout).

        ``config`` is the method's parsed config dataclass or its raw mapping
        (parsed here with the method's ``config_class``).
        """
        method_cls = cls.get_class(name)
        if config is None or isinstance(config, dict):
            config = build_method_config(cls.canonical_name(name), config or {})
        return method_cls(model, role, config)


def build_method_config(name: str, values: Mapping[str, Any]) -> Any:
    """Parses one method's mapping with its ``config_class``; errors name the key."""
    canonical = UcmSparseFactory.canonical_name(name)
    source = f"{SPARSE_CONFIG_KEY}.{name}"
    if values is None:
        values = {}
    if not isinstance(values, Mapping):
        raise ConfigError(f"{source}: expected a mapping, got {type(values).__name__}")
    config_cls = UcmSparseFactory.get_class(canonical).config_class
    if config_cls is None:
        return dict(values)
    try:
        return build_dataclass(config_cls, values, source)
    except ConfigError as e:
        msg = str(e)
        key = msg.split(":", 1)[0].split("[", 1)[0]
        if key in {f.name for f in dataclasses.fields(config_cls)} and f"({source})" not in msg:
            raise ConfigError(f"{source}.{msg}") from None
        raise
