"""What ESA and KVStar share: offloading the unselected prompt blocks.

* :mod:`.plan` -- :class:`OffloadPlan`, the block split of an offloaded request;
* :mod:`.retrieval` -- the asynchronous re-selection and delta-load state machine;
* :mod:`.method` -- :class:`OffloadSparseBase` (the slot budget, per-request
  selectors) and :func:`topk_sorted`.
"""

from ucm.sparse.offload.method import OffloadSelectorBase, OffloadSparseBase, topk_sorted
from ucm.sparse.offload.plan import OffloadPlan, make_offload_plan
from ucm.sparse.offload.retrieval import (
    Executor,
    InlineExecutor,
    LoadOp,
    OffloadRetrieval,
    RetrievalCadence,
    StepActions,
    SwapSlots,
    ThreadExecutor,
)

__all__ = [
    "Executor",
    "InlineExecutor",
    "LoadOp",
    "OffloadPlan",
    "OffloadRetrieval",
    "OffloadSelectorBase",
    "OffloadSparseBase",
    "RetrievalCadence",
    "StepActions",
    "SwapSlots",
    "ThreadExecutor",
    "make_offload_plan",
    "topk_sorted",
]
