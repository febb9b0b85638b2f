"""Logging setup.

All of ucm logs under the ``ucm`` logger; the Rust core's records arrive
there too (``ucm_core::store::posix`` becomes ``ucm_core.store.posix`` and is
re-parented under ``ucm`` by :func:`init_logging`). ``UNIFIED_CACHE_LOG_LEVEL``
(``DEBUG``, ``INFO``, ``WARNING``, ``ERROR``) sets the level. A variable
close to one of ucm's (``UCM_LOG_LEVEL``) is named in a warning, once
(:mod:`ucm.shared.env_vars`).
"""

from __future__ import annotations

import logging
import os

LOG_LEVEL_ENV = "UNIFIED_CACHE_LOG_LEVEL"
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_HANDLER_FLAG = "_ucm_handler"


def _level_from_env() -> int:
    raw = os.environ.get(LOG_LEVEL_ENV, "INFO").strip().upper()
    if raw not in _LEVELS:
        logging.getLogger("ucm").warning(
            "%s=%r is not one of %s; using INFO", LOG_LEVEL_ENV, raw, ", ".join(_LEVELS)
        )
        raw = "INFO"
    return getattr(logging, raw)


def init_logging() -> logging.Logger:
    """Configures the ``ucm`` logger (idempotent) and returns it.

    The Rust core logs through the ``ucm_core`` logger; it propagates into
    ``ucm``'s handler so one level and one format cover both.
    """
    level = _level_from_env()
    root = logging.getLogger("ucm")
    root.setLevel(level)
    core = logging.getLogger("ucm_core")
    core.setLevel(level)
    if not any(getattr(h, _HANDLER_FLAG, False) for h in root.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(asctime)s] %(levelname)s %(name)s: %(message)s"))
        setattr(handler, _HANDLER_FLAG, True)
        root.addHandler(handler)
        core.addHandler(handler)
        core.propagate = False
    else:
        for h in root.handlers:
            if getattr(h, _HANDLER_FLAG, False) and h not in core.handlers:
                core.addHandler(h)
    from ucm.shared.env_vars import warn_near_misses

    warn_near_misses(os.environ)
    return root


def get_logger(name: str) -> logging.Logger:
    """A child of the ``ucm`` logger."""
    return logging.getLogger(name if name.startswith("ucm") else f"ucm.{name}")
