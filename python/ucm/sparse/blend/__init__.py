"""Cache Blend: non-prefix KV reuse for RAG (after CacheBlend, Yao et al., EuroSys 2025).

A RAG prompt concatenates retrieved chunks and a question. Prefix caching
reuses only the first chunk; CacheBlend reuses every chunk's KV wherever the
chunk sits, fixes the positions of the loaded keys, and recomputes the small
share of tokens whose KV the neighbouring chunks would have changed most.

Modules:

* :mod:`~ucm.sparse.blend.config` -- :class:`BlendConfig`
  (``blend_recompute_ratio``, ``blend_check_layers``, ``chunk_end_token_id``,
  ``min_blend_hit_blocks``);
* :mod:`~ucm.sparse.blend.chunks` -- chunk segmentation (end token /
  explicit spans), position-independent chunk block ids, the per-request
  :class:`BlendPlan` (BUILD_CHUNK_CACHE / BLEND / PREFIX);
* :mod:`~ucm.sparse.blend.select` -- HKVD selection and the step's row
  bookkeeping (:class:`BlendStep`);
* :mod:`~ucm.sparse.blend.method` -- :class:`Blend`, the hooks.

Its kernels -- delta-RoPE (NeoX and GPT-J, partial rotary, any KV layout
given by strides) and the fused L1 key deviation -- are
:mod:`ucm.sparse.kernels.keys`; the attention of the kept rows is
:mod:`ucm.sparse.kernels.attention`.

Test tooling (in the tests' ``support`` package, not product API):
``refmodel`` (a torch Llama with vLLM's CPU KV layout that runs the whole
flow) and ``vllm_child`` (one vLLM engine in a child process).

On vLLM (0.32-0.33, ``enforce_eager=True``), enabled by
``ucm_sparse_config: {Blend: {...}}`` in the UCM connector's config, the
method declares ``chunk_reuse``, ``loads_before_forward`` and
``row_cutting`` (:class:`~ucm.sparse.base.SparseNeeds`); the sparse bridge
sets up :mod:`ucm.integration.vllm.sparse.blend`, which describes the
planning, the loads, the delta-RoPE and the per-instance model patches. In
``python/tests/e2e/test_blend_vllm.py`` a blended prefill on vLLM gives the
reference stack's tokens (first-token log probability within 1e-3), and with
ratio 1.0 vLLM's own full-prefill tokens.

Limits: Llama/Qwen-style decoder layers (``self_attn`` with ``rotary_emb``
and ``attn``, ``post_attention_layernorm``); ``enforce_eager`` (the patches
and the changing row count are invisible to a compiled graph); no pipeline
parallelism; one KV cache group. vLLM's own prefix cache registers a
blended request's blocks under the prompt's chained hashes, so an identical
later prompt reuses the blended (approximate) KV from device memory.

What the original did differently: HKVD only at one layer, CUDA only,
no HBM prefix hits, bottom-right-causal attention for the kept rows
(approximate for rows that are not the prompt's tail).
"""

from ucm.sparse.blend.chunks import (
    BlendMode,
    BlendPlan,
    BlockLoad,
    ChunkBlocks,
    ChunkSpan,
    chunk_block_ids,
    find_chunks,
    is_build_request,
    parse_chunk_spans,
    plan_request,
    segment_by_end_token,
)
from ucm.sparse.blend.config import BUILD_PARAM, CHUNKS_PARAM, BlendConfig
from ucm.sparse.blend.method import Blend, build_step
from ucm.sparse.blend.select import BlendStep, select_hkvd

__all__ = [
    "BUILD_PARAM",
    "CHUNKS_PARAM",
    "Blend",
    "BlendConfig",
    "BlendMode",
    "BlendPlan",
    "BlendStep",
    "BlockLoad",
    "ChunkBlocks",
    "ChunkSpan",
    "build_step",
    "chunk_block_ids",
    "find_chunks",
    "is_build_request",
    "parse_chunk_spans",
    "plan_request",
    "segment_by_end_token",
    "select_hkvd",
]
