"""Unified Cache Manager: tiered KV-cache storage for LLM inference.

Subpackages:

* :mod:`ucm.store` -- the store API (``UcmKVStoreBase``), the factory and configs;
* :mod:`ucm.hashing` -- chained block ids;
* :mod:`ucm.shared` -- logging and shared helpers.
"""

from ucm.shared.logging import init_logging

init_logging()

__version__ = "0.1.0"
