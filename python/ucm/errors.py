"""Exceptions raised by UCM.

They live at the top level so that any module (and the native extension) can
import them without pulling in a subpackage.

Every store error derives from :class:`UcmStoreError` and carries ``.code``,
the numeric status code of the original UCM (``-1``, ``-50000 - i``). Where a
built-in exception means the same thing, the class derives from it too, so
``except ValueError`` or ``except TimeoutError`` keep working.
"""

from __future__ import annotations


class UcmStoreError(Exception):
    """Base class of every store error."""

    code: int = -1

    def __init__(self, message: str = "", code: int | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class TaskFailedError(UcmStoreError):
    """A load or dump task failed (code -1)."""

    code = -1


class InvalidParamError(UcmStoreError, ValueError):
    """A bad argument or config value (code -50000)."""

    code = -50000


class StoreOutOfMemoryError(UcmStoreError, MemoryError):
    """An allocation failed (code -50001)."""

    code = -50001


class OsApiError(UcmStoreError, OSError):
    """An operating-system call failed (code -50002)."""

    code = -50002


class DuplicateKeyError(UcmStoreError):
    """A key was registered twice (code -50003)."""

    code = -50003


class BlockNotFoundError(UcmStoreError, KeyError):
    """A block, task handle or path does not exist (code -50005)."""

    code = -50005

    def __str__(self) -> str:  # KeyError would repr() the message
        return Exception.__str__(self)


class UnsupportedError(UcmStoreError, NotImplementedError):
    """Not supported by this store or in this role (code -50008)."""

    code = -50008


class NoSpaceError(UcmStoreError, OSError):
    """The storage device is full (code -50009)."""

    code = -50009


class StoreTimeoutError(UcmStoreError, TimeoutError):
    """A task ran past its timeout, counted from submit (code -50010)."""

    code = -50010


class CorruptBlockError(UcmStoreError):
    """Stored bytes failed verification: magic, layout, id or checksum (code -50011)."""

    code = -50011


class StoreClosedError(UcmStoreError):
    """The store was closed (code -50012)."""

    code = -50012


_BY_CODE: dict[int, type[UcmStoreError]] = {
    cls.code: cls
    for cls in (
        TaskFailedError,
        InvalidParamError,
        StoreOutOfMemoryError,
        OsApiError,
        DuplicateKeyError,
        BlockNotFoundError,
        UnsupportedError,
        NoSpaceError,
        StoreTimeoutError,
        CorruptBlockError,
        StoreClosedError,
    )
}


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
