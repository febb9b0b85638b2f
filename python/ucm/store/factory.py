"""Opening stores: :func:`open` for the built-in pipeline store, and
``UcmConnectorFactory``, the registry of stores by name, built-in or
user-written.

Stores are imported lazily, so registering one costs nothing until it is
created. A store written in Python (a :class:`~ucm.store.base.UcmKVStoreBase`
subclass) registered here is created exactly like the built-in ones, and can
sit under a cache in a pipeline (``"Cache|<name>"``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from ucm.errors import InvalidParamError
from ucm.shared.config import as_mapping
from ucm.shared.registry import LazyRegistry
from ucm.store.base import UcmKVStoreBase

PIPELINE_STORE = "UcmPipelineStore"
"""The name the built-in pipeline store is registered under."""


class UcmConnectorFactory(LazyRegistry[UcmKVStoreBase]):
    """Registry of store classes by name."""

    _entries: ClassVar[dict[str, tuple[str, str]]] = {
        PIPELINE_STORE: ("ucm.store.pipeline", "UcmPipelineStore"),
    }
    kind = "store"
    base = UcmKVStoreBase
    error = InvalidParamError

    @classmethod
    def register_connector(cls, name: str, module_path: str, class_name: str) -> None:
        """Registers ``module_path.class_name`` under ``name``.

        Raises ``ValueError`` if the name is taken.
        """
        cls._register(name, module_path, class_name)

    @classmethod
    def unregister_connector(cls, name: str) -> None:
        """Removes a registration (mostly for tests)."""
        cls._unregister(name)

    @classmethod
    def stage_config_keys(cls, name: str) -> list[str] | None:
        """Config keys the store registered under ``name`` accepts as a
        pipeline stage: its ``config_keys`` class attribute, or ``None``
        (the whole flat config) when it declares none."""
        keys = getattr(cls.get_class(name), "config_keys", None)
        return None if keys is None else list(keys)

    @classmethod
    def create_connector(cls, name: str, config: Mapping[str, Any]) -> UcmKVStoreBase:
        """Creates the store registered under ``name`` with ``config`` (a
        mapping, else :class:`~ucm.shared.config.ConfigError`).

        Kept for code written against the original UCM API, whose name this
        is: ``create_connector("UcmPipelineStore", config)`` is
        :func:`ucm.store.open` ``(config)``, which new code calls. It creates
        stores, not vLLM connectors (vLLM's own connector factory has a
        method of the same name). Other names create the stores registered
        with :meth:`register_connector`."""
        if not isinstance(name, str):
            raise InvalidParamError(f"name: expected a store name, got {type(name).__name__}")
        store_class = cls.get_class(name)
        return store_class(as_mapping(config, f"config of store {name!r}"))


def open(config: Mapping[str, Any]) -> UcmKVStoreBase:
    """Opens the built-in pipeline store (:class:`~ucm.store.pipeline.UcmPipelineStore`)
    that ``config`` describes: one flat mapping, ``store_pipeline`` naming
    the stages and every other key belonging to one or more of them (see
    :class:`~ucm.store.config.PipelineStoreConfig`). A bad config raises
    :class:`~ucm.shared.config.ConfigError` naming the key.

    ``ucm.store.open(config)`` is what
    ``UcmConnectorFactory.create_connector("UcmPipelineStore", config)``
    does in the original UCM API."""
    return UcmConnectorFactory.create_connector(PIPELINE_STORE, config)
