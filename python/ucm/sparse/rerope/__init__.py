"""ReRoPE: context-window extrapolation by clamping relative positions (Jianlin Su, 2023).

A model trained on ``L`` tokens has never seen a relative position ``>= L``.
ReRoPE keeps every relative position inside a window ``W <= L`` exact and
maps every larger one to ``W``; with log-n query scaling
(``max(1, log(pos + 1) / log(L))``) it extrapolates far past ``L`` without
fine-tuning (Su's 512-trained model: 49.41 % -> 85.12 % token accuracy at
4096 with repeated text, ReRoPE-w256-log n, vs 24.17 % for RoPE). The price
is a second score per key beyond the window and the un-rotated keys.

Modules:

* :mod:`~ucm.sparse.rerope.config` -- :class:`ReRoPEConfig`
  (``rerope_window``, ``training_length``, ``log_n_scaling``, ``always_on``);
* :mod:`~ucm.sparse.rerope.reference` -- the definition (relative form) and
  :func:`rerope_prepare`;
* :mod:`~ucm.sparse.rerope.method` -- :class:`ReRoPE` (K2 cache, hooks);
* the vLLM 0.32 integration is :mod:`ucm.integration.vllm.sparse.rerope`:
  by hand (``install_rerope``) or through the UCM connector config
  (``ucm_sparse_config: {ReRoPE: {rerope_window, training_length}}``, with
  ``enforce_eager=True`` and ``hf_overrides`` raising
  ``max_position_embeddings``). Through the connector, block ids are in the
  ReRoPE parameters' namespace (:meth:`ReRoPE.kv_namespace`: ReRoPE KV
  never mixes with plain-RoPE KV) and K2 of blocks loaded from the store is
  derived from their K (:meth:`ReRoPE.rebuild_k2`); loads are whole-step.

The kernels are shared (:mod:`ucm.sparse.kernels`): the paged attention of
:mod:`ucm.sparse.kernels.attention` (Triton prefill with S1, S2 or both per
tile by the tile's distance range, split-K decode) with a ``window``, RoPE
in vLLM's conventions in :mod:`ucm.sparse.kernels.rope`.

KV storage and its cost
=======================

Beyond the window a score needs the *un-rotated* key (``S2 = q_w . k2``),
inside it the rotated one (``S1 = q . k``). vLLM's cache keeps K (rotated,
so vLLM's own attention, prefix caching and the UCM connector are
unchanged) and V; ReRoPE adds a K2 cache per layer, paged exactly like K
(same block ids and slots, logical ``[num_blocks, B, H_kv, D]``, KV dtype).
Cost: ``num_blocks * B * H_kv * D * elem`` per layer, **+50 % of the KV
bytes** (``ReRoPE.memory_report()``); vLLM doesn't count it, so give vLLM
2/3 of the memory meant for KV. The original UCM patch allocates the same
``(num_blocks, 3, B, H_kv, D)``.
An alternative with no extra memory would store only K2 and rotate keys on
the fly inside the kernel (one ``cos_sin_cache`` row per key, in registers);
it changes what the K cache holds, which breaks vLLM's own attention, Blend's
delta-RoPE and caches shared with non-ReRoPE deployments, so it is not done.
K2 of blocks loaded by the UCM connector (prefix hits from the store) is
not in the store: after the load, :meth:`ReRoPE.rebuild_k2` re-derives it as
``R(-p) k`` with the delta-RoPE kernel (exact up to rounding), so the store
and the connector stay unchanged. (Registering the K2 tensors with the
connector's layout would save and load them instead, at +50 % store bytes.)

vLLM integration
================

CPU and GPU alike (:mod:`ucm.integration.vllm.sparse.rerope`): a per-layer
``rotary_emb`` replacement produces ``q`` (scaled, rotated), ``q_w`` and the
un-rotated ``k2``; the attention ``impl.forward`` is wrapped per instance to
write K2 and run the ReRoPE kernels (torch reference on CPU, where vLLM has
no Triton backend) whenever a sequence of the step is longer than ``W``;
otherwise vLLM's backend runs (RoPE is then exact). The same two methods
(``attention_begin``, ``sparse_attention``) are what the generic attention
hook (:mod:`ucm.integration.vllm.sparse.hooks`) calls; the method declares
``unrotated_keys`` and ``loads_before_forward``, for which the sparse bridge
adds the model-side patch and the K2 of loaded blocks.
Compiled graphs are not supported (``enforce_eager=True``).
"""

from ucm.sparse.rerope.config import ReRoPEConfig
from ucm.sparse.rerope.method import ReRoPE

__all__ = ["ReRoPE", "ReRoPEConfig"]
