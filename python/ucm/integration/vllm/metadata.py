"""What the scheduler side tells the workers each step (picklable, no tensors)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class ReqTransfer:
    """One request's transfers in one step: store block ``load_keys[i]`` is
    loaded into vLLM block ``load_into[i]``, vLLM block ``save_from[i]`` is
    saved as store block ``save_keys[i]``. Keys are the rank-0 store keys."""

    req_id: str
    load_keys: list[bytes] = field(default_factory=list)
    load_into: list[int] = field(default_factory=list)
    save_keys: list[bytes] = field(default_factory=list)
    save_from: list[int] = field(default_factory=list)
    sparse: Any = None
    """The sparse method's payload for this request (opaque to the
    connector; see :class:`~ucm.integration.vllm.scheduler.SchedulerExtension`)."""
    handover: bool = False
    """P/D prefill engine: the prompt is complete after this step; the workers
    wait for the request's saves before the step ends (see :mod:`.handover`)."""
    handover_load: bool = False
    """P/D decode engine: ``load_keys`` are blocks a prefill engine handed
    over (their bytes are counted as the handover's too)."""


@dataclass
class UCMConnectorMetadata(KVConnectorMetadata):
    """The step's plan: loads and saves per request, and the requests whose
    blocks vLLM freed this step (their pending saves must finish first)."""

    requests: list[ReqTransfer] = field(default_factory=list)
    preempted_req_ids: set[str] = field(default_factory=set)
    num_scheduled_tokens: int = 0
    sparse: Any = None
    """The sparse bridge's facts of this step (``ucm_sparse_config``)."""

    @property
    def has_loads(self) -> bool:
        return any(r.load_keys for r in self.requests)

    @property
    def has_saves(self) -> bool:
        return any(r.save_keys for r in self.requests)


__all__ = ["ReqTransfer", "UCMConnectorMetadata"]
