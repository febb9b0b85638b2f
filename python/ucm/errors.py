"""Exceptions raised by UCM: their one home.

They live at the top level so that any module can import them without
pulling in a subpackage, and because the native extension looks
:func:`error_from_code` up here by name. :mod:`ucm.store` re-exports the
classes as part of the store API; there is no other module of errors.

Every store error derives from :class:`UcmStoreError` and carries ``.code``,
the numeric status code of the original UCM (``-1``, ``-50000 - i``). Where a
built-in exception means the same thing, the class derives from it too, so
``except ValueError`` or ``except TimeoutError`` keep working.
"""

from __future__ import annotations

_BY_CODE: dict[int, type[UcmStoreError]] = {}


class UcmStoreError(Exception):
    """Base class of every store error."""

    code: int = -1

    def __init__(self, message: str = "", code: int | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code

    def __init_subclass__(cls, code: int | None = None, **kwargs: object) -> None:
        # Each subclass names its code once; the registry the native module's
        # error_from_code reads is filled from those declarations.
        super().__init_subclass__(**kwargs)
        if code is not None:
            cls.code = code
            _BY_CODE[code] = cls


class TaskFailedError(UcmStoreError, code=-1):
    """A load or dump task failed (code -1)."""


class InvalidParamError(UcmStoreError, ValueError, code=-50000):
    """A bad argument or config value (code -50000)."""


class StoreOutOfMemoryError(UcmStoreError, MemoryError, code=-50001):
    """An allocation failed (code -50001)."""


class OsApiError(UcmStoreError, OSError, code=-50002):
    """An operating-system call failed (code -50002)."""


class DuplicateKeyError(UcmStoreError, code=-50003):
    """A key was registered twice (code -50003)."""


class BlockNotFoundError(UcmStoreError, KeyError, code=-50005):
    """A block, task handle or path does not exist (code -50005)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return Exception.__str__(self)


class UnsupportedError(UcmStoreError, NotImplementedError, code=-50008):
    """Not supported by this store or in this role (code -50008)."""


class NoSpaceError(UcmStoreError, OSError, code=-50009):
    """The storage device is full (code -50009)."""


class StoreTimeoutError(UcmStoreError, TimeoutError, code=-50010):
    """A task ran past its timeout, counted from submit (code -50010)."""


class CorruptBlockError(UcmStoreError, code=-50011):
    """Stored bytes failed verification: magic, layout, id or checksum (code -50011)."""


class StoreClosedError(UcmStoreError, code=-50012):
    """The store was closed (code -50012)."""


def error_from_code(code: int, message: str) -> UcmStoreError:
    """Builds the exception for a numeric code (used by the native module)."""
    cls = _BY_CODE.get(code, UcmStoreError)
    return cls(message, code)


__all__ = [
    "BlockNotFoundError",
    "CorruptBlockError",
    "DuplicateKeyError",
    "InvalidParamError",
    "NoSpaceError",
    "OsApiError",
    "StoreClosedError",
    "StoreOutOfMemoryError",
    "StoreTimeoutError",
    "TaskFailedError",
    "UcmStoreError",
    "UnsupportedError",
    "error_from_code",
]
