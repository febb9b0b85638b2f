"""Sparse attention for long-context decoding: ESA, GSA and KVStar.

* :mod:`ucm.sparse.base` -- :class:`UcmSparseBase`, the lifecycle hooks;
* :mod:`ucm.sparse.factory` -- :class:`UcmSparseFactory` (methods by name);
* :mod:`ucm.sparse.config` -- ``ucm_sparse_config`` parsing and validation;
* :mod:`ucm.sparse.kernels` -- Triton kernels with torch fallbacks (block
  representatives, dot and Hamming block scores, KVStar votes, SRP codes,
  paged decode attention over selected blocks);
* :mod:`ucm.sparse.esa`, :mod:`ucm.sparse.gsa`, :mod:`ucm.sparse.kvstar` --
  the methods and their selectors; :mod:`ucm.sparse.retrieval` -- the
  asynchronous re-selection and delta-load state machine;
* :mod:`ucm.sparse.vllm_hooks` -- installing the hooks into vLLM.

Triton is optional: without it (or on CPU tensors without
``TRITON_INTERPRET=1``) every op runs its torch reference.
"""

from ucm.sparse.base import (
    INVALID_SLOT,
    SparseModelInfo,
    UcmSparseBase,
    UcmSparseMetadata,
    UcmSparseRole,
)
from ucm.sparse.config import (
    ESAConfig,
    GSAConfig,
    KVStarConfig,
    SparseMethodSpec,
    parse_sparse_config,
    sparse_config_from_connector,
)
from ucm.sparse.factory import UcmSparseFactory
from ucm.sparse.kernels.triton_utils import HAS_TRITON

__all__ = [
    "HAS_TRITON",
    "INVALID_SLOT",
    "ESAConfig",
    "GSAConfig",
    "KVStarConfig",
    "SparseMethodSpec",
    "SparseModelInfo",
    "UcmSparseBase",
    "UcmSparseFactory",
    "UcmSparseMetadata",
    "UcmSparseRole",
    "parse_sparse_config",
    "sparse_config_from_connector",
]
