"""Classes registered by name and imported on first use.

The base of the store factory (:class:`ucm.store.factory.UcmConnectorFactory`)
and of the sparse-method factory (:class:`ucm.sparse.factory.UcmSparseFactory`):
registering costs nothing until the class is asked for.
"""

from __future__ import annotations

import importlib
from typing import ClassVar, Generic, TypeVar

T = TypeVar("T")


class LazyRegistry(Generic[T]):
    """Subclasses of :attr:`base` by name, each given as ``(module path, class name)``.

    A registry sets :attr:`kind`, :attr:`base`, :attr:`error` and its own
    ``_entries`` (the built-in classes).
    """

    kind: ClassVar[str]
    """What the classes are, in messages (``"store"``)."""
    base: ClassVar[type]
    """The class every registered class must subclass."""
    error: ClassVar[type[Exception]]
    """Raised for an unknown name or a class that cannot be loaded."""
    _entries: ClassVar[dict[str, tuple[str, str]]]

    @classmethod
    def _register(cls, name: str, module_path: str, class_name: str) -> None:
        if name in cls._entries:
            raise ValueError(f"{cls.kind} {name!r} is already registered")
        cls._entries[name] = (module_path, class_name)

    @classmethod
    def _unregister(cls, name: str) -> None:
        cls._entries.pop(name, None)

    @classmethod
    def registered(cls) -> list[str]:
        """Names that can be created."""
        return sorted(cls._entries)

    @classmethod
    def get_class(cls, name: str) -> type[T]:
        """Imports and returns the class registered under ``name``."""
        try:
            module_path, class_name = cls._entries[name]
        except KeyError:
            raise cls.error(
                f"unknown {cls.kind} {name!r}; registered: {', '.join(cls.registered())}"
            ) from None
        found = getattr(importlib.import_module(module_path), class_name, None)
        where = f"{cls.kind} {name!r}: {module_path}"
        if found is None:
            raise cls.error(f"{where} has no class {class_name!r}")
        if not (isinstance(found, type) and issubclass(found, cls.base)):
            raise cls.error(f"{where}.{class_name} is not a {cls.base.__name__} subclass")
        return found
