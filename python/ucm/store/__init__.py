"""The UCM store API: the abstract store, the factory, configs and errors.

>>> from ucm.store import UcmConnectorFactory
>>> store = UcmConnectorFactory.create_connector(
...     "UcmPipelineStore",
...     {"store_pipeline": "Posix", "storage_backends": "/tmp/kv", "block_size": 1 << 20},
... )  # doctest: +SKIP
"""

from ucm.store.base import Task, UcmKVStoreBase
from ucm.store.config import PipelineStoreConfig, StageConfig
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
from ucm.store.factory import UcmConnectorFactory
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
]
