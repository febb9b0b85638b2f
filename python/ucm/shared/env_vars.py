"""ucm's environment variables other than config keys, and a one-time
warning for a variable that looks like one of them but isn't.

A misspelled variable is otherwise silently ignored: ``UCM_LOG_LEVEL=DEBUG``
leaves the level at INFO, since the variable is ``UNIFIED_CACHE_LOG_LEVEL``
(the original UCM's name). ``UCM_<KEY>`` variables that set config keys are
checked where the config is merged
(:func:`ucm.integration.vllm.config.resolve_config`), with this module's
suggestions.
"""

from __future__ import annotations

import difflib
import logging
import threading
from collections.abc import Iterable, Mapping

PREFIXES = ("UCM_", "UNIFIED_CACHE_")

#: Every variable ucm reads that is not a ``UCM_<config key>``.
KNOWN_ENV_VARS = frozenset(
    {
        "UNIFIED_CACHE_LOG_LEVEL",
        "UCM_CONFIG_FILE",
        "UCM_LOG_PATH",
        "UCM_LOG_MAX_FILES",
        "UCM_LOG_MAX_SIZE",
        "UCM_ALLOW_UNSUPPORTED_VLLM",
        "UCM_SKIP_VLLM",
        "UCM_SKIP_APT",
        "UCM_MODEL_DIR",
        "UCM_SKIP_MODEL",
    }
)

_warned: set[str] = set()
_lock = threading.Lock()


def closest_env_var(var: str, known: Iterable[str]) -> str | None:
    """The variable ``var`` was probably meant to be: the same name under
    ucm's other prefix (``UCM_LOG_LEVEL`` for ``UNIFIED_CACHE_LOG_LEVEL``),
    else the closest spelling; ``None`` when nothing is close."""
    names = sorted(set(known))
    for prefix in PREFIXES:
        if var.startswith(prefix):
            rest = var[len(prefix) :]
            for other in PREFIXES:
                if other != prefix and other + rest in names:
                    return other + rest
    close = difflib.get_close_matches(var, names, n=1, cutoff=0.8)
    return close[0] if close else None


def warn_once(var: str, message: str, *args: object) -> None:
    """Logs ``message`` about ``var`` on the ``ucm`` logger, once per process."""
    with _lock:
        if var in _warned:
            return
        _warned.add(var)
    logging.getLogger("ucm").warning(message, *args)


def warn_near_misses(env: Mapping[str, str]) -> None:
    """Warns (once each) about variables with one of ucm's prefixes that
    ucm doesn't read but that are close to one it does."""
    for var in sorted(env):
        if var in KNOWN_ENV_VARS or not var.startswith(PREFIXES):
            continue
        meant = closest_env_var(var, KNOWN_ENV_VARS)
        if meant is not None:
            warn_once(
                var, "environment variable %s is not read by ucm; did you mean %s?", var, meant
            )


__all__ = ["KNOWN_ENV_VARS", "PREFIXES", "closest_env_var", "warn_near_misses", "warn_once"]
