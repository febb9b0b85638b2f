"""``ReRoPE``: the attention side of ReRoPE as :class:`~ucm.sparse.base.UcmSparseBase` hooks.

ReRoPE is not a sparse method; it uses the framework's attention hooks:

* :meth:`ReRoPE.initialize_kv_cache_tensors` allocates one **K2 cache** per
  layer -- the un-rotated keys, a logical ``[num_blocks, B, H_kv, D]`` tensor
  paged exactly like vLLM's cache (same block ids and slots), in the KV
  dtype. Memory: one more K, i.e. **+50 % of the KV-cache bytes**
  (:meth:`ReRoPE.memory_report`); vLLM does not know about it, so size
  vLLM's KV cache to 2/3 of the memory meant for KV
  (``kv_cache_memory_bytes`` / ``VLLM_CPU_KVCACHE_SPACE`` /
  ``gpu_memory_utilization``).
* :meth:`ReRoPE.attention_begin` writes the step's un-rotated keys into the
  K2 cache at the layer's ``slot_mapping`` (every step, so later steps of a
  request that grows past the window find them);
* :meth:`ReRoPE.sparse_attention` computes the attention (prefill: tiled
  two-score kernel; decode: split-K kernel; torch reference where Triton
  can't run) when some sequence of the step is longer than the window, and
  declines otherwise (the backend's RoPE attention is then exact, as in the
  original's per-batch ``use_rerope``).

The model side -- producing the log-n scaled, rotated query, ``q_w`` and the
un-rotated key -- is on vLLM
:class:`ucm.integration.vllm.sparse.rerope.ReRoPERotary`,
which hands ``q_w`` and ``k2`` to this object through :meth:`stash`.
"""

from __future__ import annotations

from typing import Any

import torch

from ucm.sparse.base import (
    AttentionCall,
    SparseModelInfo,
    SparseNeeds,
    UcmSparseBase,
    UcmSparseRole,
)
from ucm.sparse.kernels import attention, keys
from ucm.sparse.kernels.dispatch import Impl
from ucm.sparse.kernels.views import kv_views
from ucm.sparse.rerope.config import ReRoPEConfig


class ReRoPE(UcmSparseBase):
    """ReRoPE attention over vLLM's paged cache plus a K2 side cache."""

    config_class = ReRoPEConfig
    needs = SparseNeeds(loads_before_forward=True, unrotated_keys=True)

    @classmethod
    def kv_namespace(cls, config: ReRoPEConfig) -> str:
        """ReRoPE attention changes the KV of every layer after the first: its
        blocks never mix with plain-RoPE blocks (or those of another window)."""
        c = config
        return f"|rerope=w{c.rerope_window}:l{c.training_length}:log{int(c.log_n_scaling)}"

    def __init__(
        self, model: SparseModelInfo | None, role: UcmSparseRole, config: ReRoPEConfig | None = None
    ) -> None:
        super().__init__(model, role, config or ReRoPEConfig())
        cfg: ReRoPEConfig = self.config
        if cfg.training_length is None:
            mpe = model.max_position_embeddings if model is not None else None
            if mpe is None:
                from ucm.shared.config import ConfigError

                raise ConfigError(
                    "training_length: not set and the model's max_position_embeddings is unknown"
                )
            cfg = cfg.resolved(mpe)
        self.config: ReRoPEConfig = cfg
        self.k2_caches: dict[str, torch.Tensor] = {}
        self._kv_bytes = 0
        self._stash: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.impl: Impl = "auto"
        self.calls = {"rerope": 0, "native": 0}
        #: Softmax scale per layer (vLLM: ``layer.impl.scale``); default ``D ** -0.5``.
        self.scales: dict[str, float] = {}
        self.cos_sin_cache: torch.Tensor | None = None
        self.is_neox = True

    @property
    def window(self) -> int:
        return self.config.rerope_window

    @property
    def log_n_base(self) -> int | None:
        """``training_length`` if log-n scaling is on, else None."""
        return self.config.training_length if self.config.log_n_scaling else None

    # ------------------------------------------------------------------ memory

    def initialize_kv_cache_tensors(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for name, kv in kv_caches.items():
            k_view, _ = kv_views(kv)
            nb, b, h, d = k_view.shape
            self.k2_caches[name] = torch.zeros(nb, b, h, d, dtype=kv.dtype, device=kv.device)
            self._kv_bytes += kv.numel() * kv.element_size()

    def memory_report(self) -> dict[str, float]:
        """KV bytes vLLM allocated, K2 bytes added, and the ratio (0.5 for K, V, K2)."""
        k2 = sum(t.numel() * t.element_size() for t in self.k2_caches.values())
        return {
            "kv_bytes": float(self._kv_bytes),
            "k2_bytes": float(k2),
            "overhead": k2 / self._kv_bytes if self._kv_bytes else 0.0,
        }

    def set_rotary(self, cos_sin_cache: torch.Tensor, is_neox: bool = True) -> None:
        """The model's rotary table (vLLM: ``rotary_emb.cos_sin_cache``), for
        :meth:`rebuild_k2`."""
        self.cos_sin_cache = cos_sin_cache
        self.is_neox = bool(is_neox)

    def rebuild_k2(
        self,
        layer_name: str,
        kv_cache: torch.Tensor,
        block_ids: torch.Tensor,
        first_positions: torch.Tensor,
    ) -> None:
        """Derives K2 of blocks whose K was loaded from outside (e.g. by the UCM connector).

        K2 is not in the store; un-rotating the loaded keys recovers it:
        ``k2 = R(-p) k`` for the key at position ``p``. ``first_positions``
        ``[n]``: position of each block's token 0 (``block_index * B``).
        """
        if self.cos_sin_cache is None:
            raise RuntimeError("ReRoPE.set_rotary was not called")
        k_view, _ = kv_views(kv_cache)
        k2 = self.k2_caches[layer_name]
        n, b = int(block_ids.numel()), k2.shape[1]
        if n == 0:
            return
        ids = block_ids.to(device=k2.device, dtype=torch.long)
        k2[ids] = k_view[ids]
        pos = first_positions.to(device=k2.device, dtype=torch.long).view(n, 1) + torch.arange(
            b, device=k2.device
        )
        keys.delta_rope(
            k2, ids, -pos, self.cos_sin_cache, self.is_neox, impl=self.impl, validate=False
        )

    # ------------------------------------------------------------------ per layer

    def stash(self, layer_name: str, q_w: torch.Tensor, k2: torch.Tensor) -> None:
        """The model side hands over this layer's ``q_w`` and un-rotated keys."""
        self._stash[layer_name] = (q_w, k2)

    def _use_rerope(self, attn_metadata: Any) -> bool:
        if self.config.always_on:
            return True
        max_len = getattr(attn_metadata, "max_seq_len", None)
        if max_len is None:
            max_len = int(attn_metadata.seq_lens.max())
        return int(max_len) > self.window

    def attention_begin(self, call: AttentionCall) -> AttentionCall:
        """Writes the stashed un-rotated keys into the K2 cache (q/k/v unchanged)."""
        meta, name = call.attn_metadata, call.layer_name
        entry = self._stash.get(name)
        if meta is None or entry is None or name not in self.k2_caches:
            return call
        k2 = entry[1]
        n = int(getattr(meta, "num_actual_tokens", k2.shape[0]))
        slots = meta.slot_mapping[:n]
        attention.write_kv(self.k2_caches[name], k2[:n].view(n, -1, k2.shape[-1]), slots)
        return call

    def sparse_attention(self, call: AttentionCall) -> bool:
        """ReRoPE attention into ``call.output`` (True), or False when RoPE is exact this step."""
        md, name = call.attn_metadata, call.layer_name
        entry = self._stash.pop(name, None)
        if md is None or entry is None or not self._use_rerope(md):
            self.calls["native"] += 1
            return False
        assert call.kv_cache is not None and call.output is not None
        q_w = entry[0]
        n = int(getattr(md, "num_actual_tokens", call.query.shape[0]))
        k_view, v_view = kv_views(call.kv_cache)
        d = k_view.shape[-1]
        q = call.query[:n].view(n, -1, d)
        q_w = q_w[:n].view(n, -1, d)
        out = call.output[:n].view(n, -1, d)
        attention.paged_attention(
            q,
            k_view,
            v_view,
            md.block_table,
            md.seq_lens,
            md.query_start_loc,
            None,
            call.scale if call.scale is not None else self.scales.get(name),
            q_w=q_w,
            k2_cache=self.k2_caches[name],
            window=self.window,
            out=out,
            max_query_len=getattr(md, "max_query_len", None),
            impl=self.impl,
        )
        self.calls["rerope"] += 1
        return True
