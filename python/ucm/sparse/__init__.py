"""Sparse attention and KV reuse methods, engine-neutral: ESA, KVStar, GSA,
Cache Blend, ReRoPE and methods written by users.

* :mod:`ucm.sparse.base` -- :class:`UcmSparseBase`, the lifecycle hooks;
* :mod:`ucm.sparse.factory` -- :class:`UcmSparseFactory` (methods by name);
* :mod:`ucm.sparse.config` -- ``ucm_sparse_config``: which method, parsed;
* one package per method: :mod:`ucm.sparse.esa`, :mod:`ucm.sparse.kvstar`,
  :mod:`ucm.sparse.gsa`, :mod:`ucm.sparse.blend`, :mod:`ucm.sparse.rerope`;
  :mod:`ucm.sparse.offload` -- what the offloading methods (ESA, KVStar) share;
* :mod:`ucm.sparse.kernels` -- the Triton kernels with their torch
  references, shared by the methods.

Nothing here knows an inference engine; the vLLM glue is
:mod:`ucm.integration.vllm.sparse`. Triton is optional: without it (or on
CPU tensors without ``TRITON_INTERPRET=1``) every op runs its torch reference.
"""

from ucm.sparse.base import (
    INVALID_SLOT,
    AttentionCall,
    LayerRows,
    SparseModelInfo,
    SparseNeeds,
    UcmSparseBase,
    UcmSparseMetadata,
    UcmSparseRole,
)
from ucm.sparse.config import (
    SparseMethodSpec,
    parse_sparse_config,
    sparse_config_from_connector,
)
from ucm.sparse.esa.config import ESAConfig
from ucm.sparse.factory import UcmSparseFactory
from ucm.sparse.gsa.config import GSAConfig
from ucm.sparse.kernels.triton_utils import HAS_TRITON
from ucm.sparse.kvstar.config import KVStarConfig

__all__ = [
    "HAS_TRITON",
    "INVALID_SLOT",
    "AttentionCall",
    "ESAConfig",
    "GSAConfig",
    "KVStarConfig",
    "LayerRows",
    "SparseMethodSpec",
    "SparseModelInfo",
    "SparseNeeds",
    "UcmSparseBase",
    "UcmSparseFactory",
    "UcmSparseMetadata",
    "UcmSparseRole",
    "parse_sparse_config",
    "sparse_config_from_connector",
]
