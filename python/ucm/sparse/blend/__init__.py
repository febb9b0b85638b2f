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
* :mod:`~ucm.sparse.blend.ops` (kernels, launchers, reference) -- the
  delta-RoPE kernel (NeoX and GPT-J, partial rotary, any KV layout given by
  strides) and the fused L1 key-deviation kernel;
* :mod:`~ucm.sparse.blend.select` -- HKVD selection and the step's row
  bookkeeping (:class:`BlendStep`);
* :mod:`~ucm.sparse.blend.method` -- :class:`Blend`, the hooks;
* :mod:`~ucm.sparse.blend.refmodel` -- a torch Llama with vLLM's CPU KV
  layout that runs the whole flow (tests, ``benches/blend_ttft.py``).

vLLM integration (design; the connector side lands with
``ucm/integration/vllm``, the layer patches with the sparse wiring)
===================================================================

Scheduler (connector, ``get_num_new_matched_tokens``)
    ``Blend.plan(request.prompt_token_ids, store, meta, request.kv_transfer_params,
    num_computed_tokens=...)``. BUILD_CHUNK_CACHE and PREFIX plans behave
    exactly like the plain connector (report ``prefix_hit_blocks * B``
    external tokens, dump ``dump_block_indices``). A BLEND plan reports only
    its exact prefix (``plan.prefix_tokens``) as external tokens -- vLLM
    must still schedule every other token, because every one of them runs
    at least the layers before the check layer -- and records the chunk
    loads. Chunked prefill must be off for blended requests (the selection
    needs all the request's rows in one step; ``build_step`` raises
    otherwise): the connector answers ``None`` ("ask later") or falls back
    to PREFIX when the budget is too small. HBM prefix hits are supported
    (``num_computed_tokens``), unlike the original.

Connector metadata (``build_connector_meta``)
    Per blended request: the store ids and the vLLM block ids of every load
    (``block_ids[0][ld.block_index]``), the per-block ``delta``
    (``ld.new_start - ld.cached_start``) for chunk loads, and the
    ``reused``/``forced`` row masks (``plan.reused_mask()``,
    ``plan.forced_mask()`` from ``plan.prefix_tokens`` on). Nothing is
    dumped for a BLEND plan.

Worker: loads and delta-RoPE (``start_load_kv`` / ``wait_for_layer_load``)
    Loads go into the request's own blocks. Layers before the first check
    layer overwrite them with fresh KV anyway, so a layer-wise connector can
    skip those layers' loads. In ``wait_for_layer_load(layer)`` (or once per
    layer after a direct load) call ``Blend.rotate_loaded_blocks(layer,
    vllm_block_ids, deltas)``; the model's table comes from
    ``Blend.set_rotary(rotary_emb.cos_sin_cache, rotary_emb.is_neox_style)``,
    found on any attention module of the model (``setup_model``).

Worker: step metadata (``build_sparse_meta`` / ``execute_begin``)
    ``Blend.bind_step(build_step([(req_id, plan_or_None, first_row, num_rows),
    ...], slot_mapping, positions))`` for the batch in row order (decode
    requests at the front are all forced rows); ``None`` when no request of
    the step blends, which makes every hook a pass-through.

Worker: the check layer(s) -- ``attention_begin`` *before the KV write*
    vLLM 0.32 writes a layer's K/V in ``unified_kv_cache_update``
    (``impl.do_kv_cache_update``) *before* ``impl.forward``, but the
    selection must compare the fresh keys with the loaded ones still in the
    cache, and then write only the kept rows. So at check layers the hook
    goes around ``do_kv_cache_update`` (wrapped per instance like
    ``impl.forward``): run ``Blend.attention_begin(q, k, v, layer, meta)``
    there -- it computes the fused deviation over the reused rows, keeps per
    request the forced rows and the top ``floor(share * n_reused)``, and cuts
    q/k/v and rewrites ``slot_mapping``, ``query_start_loc``,
    ``num_actual_tokens`` and ``max_query_len`` -- then write the kept rows
    only. The query/output tensors that ``impl.forward`` receives must be
    cut the same way (the wrapper keeps the kept indices from the first
    call). In 0.32 ``slot_mapping`` also lives in
    ``forward_context.slot_mapping[layer_name]`` -- rewrite that entry for the
    check layer and every later layer.

Worker: attention of the kept rows -- ``sparse_attention``
    After the first check layer the rows are a non-contiguous subset of the
    prompt; vLLM's kernels (CPU and flash) place query ``i`` at position
    ``seq_len - q_len + i``, which would be wrong, so ``Blend.sparse_attention``
    attends each kept row to keys ``0..position`` with the position-causal
    paged kernel (:func:`ucm.sparse.rerope.ops.paged_attention`, Triton on
    GPU, torch on CPU). Decode steps never shrink and use the backend.

Worker: the residual stream -- ``layer_begin`` / ``ffn_begin``
    The decoder layers are patched per instance (``LlamaDecoderLayer``,
    ``Qwen2DecoderLayer``, ...): ``layer_begin`` at the start of each layer
    cuts ``positions`` (the model passes the full tensor to every layer) and
    ``hidden_states``/``residual`` when they still have the old row count;
    ``ffn_begin`` runs *before* ``post_attention_layernorm`` (the fused
    residual add), cutting ``residual`` to the rows the attention output
    has. ``ucm.sparse.vllm_hooks.install_worker_hooks`` refuses methods that
    override these hooks until those patches exist.

Worker: logits -- ``execute_finished``
    Maps the runner's ``logits_indices`` (each request's last row, which is
    always forced) into the shrunk rows. In 0.32 the index is computed in
    ``GPUModelRunner._prepare_inputs`` and consumed after the forward, so the
    hook must run between the model's forward and ``compute_logits``
    (wrapping ``model.compute_logits``, whose ``hidden_states`` then has the
    shrunk row count, or the runner's sampling of ``hidden_states[logits_indices]``).

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
