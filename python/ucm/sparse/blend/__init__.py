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
* :mod:`~ucm.sparse.blend.method` -- :class:`Blend`, the hooks;
* :mod:`~ucm.sparse.blend.vllm_integration` -- Blend on vLLM 0.32 through
  the UCM connector (below).

Its kernels -- delta-RoPE (NeoX and GPT-J, partial rotary, any KV layout
given by strides) and the fused L1 key deviation -- are
:mod:`ucm.sparse.kernels.keys`; the attention of the kept rows is
:mod:`ucm.sparse.kernels.attention`.

Test tooling: :mod:`ucm.testing.refmodel` (a torch Llama with vLLM's CPU KV
layout that runs the whole flow) and :mod:`ucm.testing.vllm_child` (one vLLM
engine in a child process).

vLLM integration (implemented; vLLM 0.32-0.33, ``enforce_eager=True``)
=====================================================================

Enabled by ``ucm_sparse_config: {Blend: {...}}`` in the UCM connector's
``kv_connector_extra_config``. The connector halves call
:class:`~ucm.sparse.blend.vllm_integration.BlendScheduler` and
:class:`~ucm.sparse.blend.vllm_integration.BlendWorker` from a few
delimited call sites in ``ucm/integration/vllm/{scheduler,worker}.py``
(``sparse_bridge`` leaves Blend to them).

Scheduler (``get_num_new_matched_tokens`` / ``update_state_after_alloc`` / ``build_connector_meta``)
    Every new request is planned with :meth:`Blend.plan` (its
    ``kv_transfer_params`` may carry ``ucm_blend_chunks`` / ``ucm_blend_build``;
    vLLM's device prefix hit is ``num_computed_tokens``). BUILD_CHUNK_CACHE
    and PREFIX plans take the plain connector path (prefix reuse, dump). A
    BLEND plan reports only its exact prefix as external tokens -- every
    other token is scheduled, since each runs at least the layers before the
    check layer -- and falls back to PREFIX when its uncached tokens exceed
    ``max_num_batched_tokens`` (the selection needs all rows in one step).
    Its chunk blocks are appended to the request's loads (store id ->
    ``block_ids[0][block_index]``) and the plan travels with the request's
    block ids in ``ReqTransfer.blend``; nothing of it is saved.

Worker: loads and delta-RoPE
    A step with a blended request loads whole-step even in layer-wise mode,
    and already when the step's metadata is bound: vLLM calls
    ``wait_for_layer_load`` after the layer's KV write (loaded KV would land
    over the fresh KV of the layers before the check layer), and it calls
    ``start_load_kv`` only *after* the forward when no request of the step
    reports external tokens (a blend whose exact prefix is all in vLLM's
    prefix cache). After the loads :meth:`Blend.rotate_loaded_blocks` moves every
    loaded chunk block's keys by ``new_start - cached_start`` on the layers
    from the first check layer on (earlier layers are recomputed), with the
    model's ``rotary_emb.cos_sin_cache``. A request whose load failed is not
    blended (all its rows are recomputed).

Worker: per-instance patches (``BlendWorker.install``; undone at shutdown)
    The model is found from ``static_forward_context`` (the outermost live
    module with ``compute_logits`` that holds the attention layers).

    * ``Attention.forward`` from the first check layer on. At the first
      check layer the step is bound from the forward context
      (:func:`build_step`: rows, ``slot_mapping`` and positions of every
      request from ``query_start_loc``/``seq_lens``; a blended request is the
      one whose first query row has the slot of its first non-prefix token
      and whose rows are its whole remainder -- otherwise, e.g. a split
      prefill, it is simply not blended, which gives the full-prefill
      result). At each check layer, *before* vLLM's KV write
      (``unified_kv_cache_update`` runs inside ``Attention.forward``),
      :meth:`Blend.attention_begin` compares the fresh keys with the loaded
      ones still in the cache, keeps the forced rows and the top share of the
      reused ones, and cuts q/k/v; ``forward_context.slot_mapping`` of this
      and every later layer becomes the kept rows' slots, so vLLM writes only
      their KV and the others keep the loaded KV.
    * ``impl.forward`` from the first check layer on: once rows were dropped,
      :meth:`Blend.sparse_attention` (position-causal paged attention over the
      cache) replaces the backend, whose kernels would place a query at
      ``seq_len - q_len + i``.
    * decoder layers' ``forward`` (``layer_begin``: the model passes the full
      ``positions`` to every layer) and ``post_attention_layernorm``
      (``ffn_begin``: the residual still has the rows of before the cut).
    * the model's ``forward``: scatters the kept rows back into the step's
      row count, so the runner's ``hidden_states[logits_indices]`` (each
      request's last row, always kept) is unchanged. Dropped rows are zero:
      prompt logprobs of a blended request are not meaningful.

    Decode steps and steps without a blended request pass through. In
    ``python/tests/blend/test_blend_vllm.py`` a blended prefill on vLLM gives
    the reference stack's tokens (first-token log probability within 1e-3),
    and with ratio 1.0 vLLM's own full-prefill tokens.

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
from ucm.sparse.blend.method import Blend, build_step, layer_index
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
    "layer_index",
    "parse_chunk_spans",
    "plan_request",
    "segment_by_end_token",
    "select_hkvd",
]
