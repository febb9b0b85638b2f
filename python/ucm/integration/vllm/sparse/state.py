"""The process-global sparse agent.

Each process (scheduler or worker) holds at most one sparse method instance.
It is global because vLLM's model code gives a patched layer no handle to
pass it through (the original UCM's patches looked it up the same way). It
is created by :func:`ensure_ucm_sparse_initialized` (or set by the bridge)
only when a method is configured; every hook wrapper in :mod:`.hooks` that
is given no driver checks :func:`has_ucm_sparse` first, so an engine without
``ucm_sparse_config`` pays one function call per hook.
"""

from __future__ import annotations

import threading

from ucm.shared.logging import get_logger
from ucm.sparse.base import SparseModelInfo, UcmSparseBase, UcmSparseRole
from ucm.sparse.config import SparseMethodSpec

_LOG = get_logger("ucm.sparse")
_LOCK = threading.Lock()
_AGENT: UcmSparseBase | None = None


def ensure_ucm_sparse_initialized(
    model: SparseModelInfo | None, role: UcmSparseRole, spec: SparseMethodSpec | None
) -> UcmSparseBase | None:
    """Creates this process's agent for ``model`` once (no-op when ``spec`` is None)."""
    global _AGENT
    if spec is None:
        return None
    with _LOCK:
        if _AGENT is None:
            from ucm.sparse.factory import UcmSparseFactory

            _AGENT = UcmSparseFactory.create_sparse_method(spec.name, model, role, spec.config)
            _LOG.info("sparse method %s initialized (%s)", spec.name, role.value)
        return _AGENT


def has_ucm_sparse() -> bool:
    """Whether this process has a sparse agent."""
    return _AGENT is not None


def get_ucm_sparse() -> UcmSparseBase:
    """This process's agent; ``RuntimeError`` if there is none."""
    if _AGENT is None:
        raise RuntimeError("no UCM sparse method is initialized in this process")
    return _AGENT


def set_ucm_sparse(agent: UcmSparseBase | None) -> None:
    """Replaces the agent (tests, and :func:`shutdown_ucm_sparse`)."""
    global _AGENT
    with _LOCK:
        _AGENT = agent


def shutdown_ucm_sparse() -> None:
    """Shuts the agent down and forgets it."""
    global _AGENT
    with _LOCK:
        agent, _AGENT = _AGENT, None
    if agent is not None:
        agent.shutdown()
