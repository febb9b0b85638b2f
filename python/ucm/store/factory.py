"""``UcmConnectorFactory``: creates stores by name, built-in or user-written.

Stores are imported lazily, so registering one costs nothing until it is
created. A store written in Python (a :class:`~ucm.store.base.UcmKVStoreBase`
subclass) registered here is created exactly like the built-in ones.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any, ClassVar

from ucm.store.base import UcmKVStoreBase
from ucm.store.errors import InvalidParamError


class UcmConnectorFactory:
    """Registry of store classes by name."""

    _registry: ClassVar[dict[str, tuple[str, str]]] = {
        "UcmPipelineStore": ("ucm.store.pipeline", "UcmPipelineStore"),
    }

    @classmethod
    def register_connector(cls, name: str, module_path: str, class_name: str) -> None:
        """Registers ``module_path.class_name`` under ``name``.

        Raises ``ValueError`` if the name is taken.
        """
        if name in cls._registry:
            raise ValueError(f"store {name!r} is already registered")
        cls._registry[name] = (module_path, class_name)

    @classmethod
    def unregister_connector(cls, name: str) -> None:
        """Removes a registration (mostly for tests)."""
        cls._registry.pop(name, None)

    @classmethod
    def registered(cls) -> list[str]:
        """Names that can be created."""
        return sorted(cls._registry)

    @classmethod
    def get_class(cls, name: str) -> type[UcmKVStoreBase]:
        """Imports and returns the class registered under ``name``."""
        try:
            module_path, class_name = cls._registry[name]
        except KeyError:
            raise InvalidParamError(
                f"unknown store {name!r}; registered: {', '.join(cls.registered())}"
            ) from None
        module = importlib.import_module(module_path)
        store_cls = getattr(module, class_name, None)
        if store_cls is None:
            raise InvalidParamError(f"store {name!r}: {module_path} has no class {class_name!r}")
        if not (isinstance(store_cls, type) and issubclass(store_cls, UcmKVStoreBase)):
            raise InvalidParamError(
                f"store {name!r}: {module_path}.{class_name} is not a UcmKVStoreBase subclass"
            )
        return store_cls

    @classmethod
    def stage_config_keys(cls, name: str) -> list[str] | None:
        """Config keys the store registered under ``name`` accepts as a
        pipeline stage: its ``config_keys`` class attribute, or ``None``
        (the whole flat config) when it declares none."""
        keys = getattr(cls.get_class(name), "config_keys", None)
        return None if keys is None else list(keys)

    @classmethod
    def create_connector(cls, name: str, config: Mapping[str, Any]) -> UcmKVStoreBase:
        """Creates the store registered under ``name`` with ``config``."""
        return cls.get_class(name)(dict(config))
