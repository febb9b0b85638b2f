"""The UCM store API: :func:`open`, the abstract store, the factory of stores
by name, configs and errors (whose home is :mod:`ucm.errors`).

>>> import ucm.store
>>> store = ucm.store.open(
...     {"store_pipeline": "Posix", "storage_backends": "/tmp/kv", "block_size": 1 << 20},
... )  # doctest: +SKIP
"""

from ucm.errors import (
    BlockNotFoundError,
    CorruptBlockError,
    InvalidParamError,
    NoSpaceError,
    OsApiError,
    StoreClosedError,
    StoreTimeoutError,
    TaskFailedError,
    UcmStoreError,
    UnsupportedError,
)
from ucm.store.base import Task, UcmKVStoreBase
from ucm.store.config import PipelineStoreConfig, StageConfig
from ucm.store.factory import UcmConnectorFactory, open
from ucm.store.memory import Regions

__all__ = [
    "BlockNotFoundError",
    "CorruptBlockError",
    "InvalidParamError",
    "NoSpaceError",
    "OsApiError",
    "PipelineStoreConfig",
    "Regions",
    "StageConfig",
    "StoreClosedError",
    "StoreTimeoutError",
    "Task",
    "TaskFailedError",
    "UcmConnectorFactory",
    "UcmKVStoreBase",
    "UcmStoreError",
    "UnsupportedError",
    "open",
]
