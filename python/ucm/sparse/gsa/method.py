"""GSA: hash-aware top-k attention on device (after HATA, Findings of ACL 2025).

Gong et al., *HATA: Trainable and Hardware-Efficient Hash-Aware Top-k
Attention for Scalable Large Model Inference*, Findings of ACL 2025,
pp. 24856-24871. As in UCM's GSAOnDevice the hash is an *untrained*
sign-random-projection (a Haar-random rotation), not trained HATA weights.

* As KV is cached, every key of every sparse layer gets an ``nbits`` code
  ``sign(k @ W)`` written into a paged *code cache* that mirrors the KV
  cache's paging (``[num_blocks, B, H_kv, nbits/32]`` int32), whether or not
  the step is sparse, so later steps can use it.
* A decode query is averaged per GQA group and hashed the same way. Token
  distance = Hamming distance, min over kv heads; block score = min over its
  tokens. The first ``sink_blocks`` and last ``recent_blocks`` blocks are
  always kept; ``ceil(T / B)`` blocks are kept in all (T = ``topk_tokens``, or
  ``sparse_ratio`` of the blocks), in their original order, and the attention
  runs over them with the shortened length (the partial tail stays valid).
* A step is sparse only when at least ``concurrency_threshold`` requests are
  at least ``seq_len_threshold`` long. *Rollback* layers are always dense and
  keep no codes; *skip* layers reuse the previous layer's selection.

There is no offload: the full KV stays on the device.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ucm.sparse.base import (
    INVALID_SLOT,
    SparseModelInfo,
    SparseNeeds,
    UcmSparseBase,
    UcmSparseRole,
)
from ucm.sparse.gsa.config import GSAConfig
from ucm.sparse.kernels import selection
from ucm.sparse.kernels.dispatch import Impl
from ucm.sparse.kernels.triton_utils import cdiv

DENSE, SPARSE, REUSE = "dense", "sparse", "reuse"


class SRPHashEncoder:
    """Sign-random-projection codes of keys and queries (one projection per model)."""

    def __init__(
        self,
        head_dim: int,
        nbits: int | None = None,
        seed: int = 0,
        device: torch.device | str | None = None,
        impl: Impl = "auto",
    ) -> None:
        self.head_dim = head_dim
        self.nbits = nbits or max(32, head_dim)
        self.words = self.nbits // 32
        self.proj = selection.srp_projection(head_dim, self.nbits, seed, device)
        self.impl = impl

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., H, D] -> [..., H, W]`` int32 codes."""
        return selection.srp_encode(x, self.proj.to(x.device), impl=self.impl)

    def encode_query(self, q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
        """``[S, H_q, D] -> [S, H_kv, W]``: codes of the GQA-group-mean queries."""
        return self.encode(selection.group_mean_query(q, num_kv_heads))

    def write_keys(
        self, k: torch.Tensor, code_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Writes codes of new keys ``[T, H_kv, D]`` at ``slot_mapping`` (-1 skipped)."""
        selection.srp_encode_to_cache(
            k, self.proj.to(k.device), code_cache, slot_mapping, impl=self.impl
        )

    def new_code_cache(
        self, num_blocks: int, block_size: int, num_kv_heads: int, device: Any = None
    ) -> torch.Tensor:
        """A zeroed paged code cache ``[num_blocks, B, H_kv, W]`` int32."""
        shape = (num_blocks, block_size, num_kv_heads, self.words)
        return torch.zeros(shape, dtype=torch.int32, device=device)


def gsa_select(
    batch: selection.HammingBatch, keep_blocks: torch.Tensor, impl: Impl = "auto"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Selected blocks of a batch, in original order.

    Args:
        batch: the query codes, the key code cache, the dense batch
            (``block_table`` ``[S, max_blocks]``, ``seq_lens`` ``[S]``) and
            the forced sink and recent blocks.
        keep_blocks: ``[S]`` blocks to keep per sequence (raised to cover the
            forced blocks, capped at the sequence's blocks).

    Returns:
        ``(block_table', seq_lens', selected)``: the shortened table
        ``[S, max_blocks]`` (selected blocks first, rest padded with the
        original entries), the shortened lengths, and the logical indices of
        the selected blocks ``[S, max_blocks]`` (-1 padded).
    """
    block_table, seq_lens = batch.block_table, batch.seq_lens
    _s, max_blocks = block_table.shape
    b = batch.k_code_cache.shape[1]
    dev = block_table.device
    scores = selection.hamming_scores(batch, impl).to(dev)
    nb = (seq_lens.to(dev).long() + b - 1) // b
    forced = torch.clamp(torch.full_like(nb, batch.sink_blocks + batch.recent_blocks), max=nb)
    keep = torch.minimum(torch.maximum(keep_blocks.to(dev).long(), forced), nb)
    order = torch.sort(scores.long(), dim=1, stable=True).indices  # best first
    rank = torch.arange(max_blocks, device=dev).unsqueeze(0)
    chosen = torch.where(rank < keep.unsqueeze(1), order, torch.full_like(order, max_blocks))
    chosen = torch.sort(chosen, dim=1).values  # original order, padding last
    valid = chosen < max_blocks
    gather = torch.where(valid, chosen, torch.zeros_like(chosen))
    new_table = torch.where(valid, torch.gather(block_table.long(), 1, gather), block_table.long())
    new_lens = seq_lens.to(dev).long() - (nb - keep) * b
    selected = torch.where(valid, chosen, torch.full_like(chosen, -1))
    return new_table.to(block_table.dtype), new_lens.to(seq_lens.dtype), selected


def gsa_topk_blocks(
    seq_len: int, block_size: int, topk_tokens: int | None, sparse_ratio: float | None
) -> int:
    """Blocks GSA keeps for a sequence of ``seq_len`` tokens (all of them if fewer)."""
    nb = cdiv(seq_len, block_size)
    if topk_tokens is not None:
        k = cdiv(topk_tokens, block_size)
    else:
        k = math.ceil(nb * float(sparse_ratio or 1.0))
    return max(1, min(nb, k))


def gsa_shortened_len(seq_len: int, block_size: int, keep_blocks: int) -> int:
    """Sequence length over ``keep_blocks`` selected blocks, the partial tail kept.

    The tail block is always selected (it is recent), so the shortened length
    drops only whole blocks: ``seq_len - (nblocks - keep_blocks) * B``.
    """
    nb = cdiv(seq_len, block_size)
    return seq_len - max(0, nb - keep_blocks) * block_size


class GSA(UcmSparseBase):
    """The GSA method (registered as ``GSA``, alias ``GSAOnDevice``)."""

    config_class = GSAConfig
    needs = SparseNeeds(key_codes=True)

    def __init__(
        self, model: SparseModelInfo | None, role: UcmSparseRole, config: GSAConfig | None = None
    ):
        super().__init__(model, role, config or GSAConfig())
        self.impl: Impl = "auto"
        self.enabled = False
        self.code_caches: dict[int, torch.Tensor] = {}
        self._encoder: SRPHashEncoder | None = None
        self._last_selection: tuple[torch.Tensor, torch.Tensor] | None = None
        self.num_sparse_steps = 0

    # -- policy -------------------------------------------------------------

    def layer_policy(self, layer: int) -> str:
        """``"dense"`` (rollback), ``"reuse"`` (skip) or ``"sparse"``."""
        if layer in self.config.rollback_layers:
            return DENSE
        if layer in self.config.skip_layers:
            return REUSE
        return SPARSE

    def keep_blocks(self, seq_len: int) -> int:
        """Blocks kept for a sequence of ``seq_len`` tokens."""
        assert self.model_info is not None
        c = self.config
        return gsa_topk_blocks(seq_len, self.model_info.block_size, c.topk_tokens, c.sparse_ratio)

    def gate(self, seq_lens: list[int] | torch.Tensor) -> bool:
        """Whether a step with these sequence lengths is sparse."""
        lens = [int(x) for x in seq_lens]
        long_reqs = sum(1 for x in lens if x >= self.config.seq_len_threshold)
        return long_reqs >= max(1, self.config.concurrency_threshold)

    # -- scheduler side: no offload, dense allocation ---------------------

    def estimate_num_slots_sparsed(self, request: Any) -> int:
        return INVALID_SLOT

    # -- worker side ------------------------------------------------------

    @property
    def encoder(self) -> SRPHashEncoder:
        if self._encoder is None:
            assert self.model_info is not None
            mi = self.model_info
            self._encoder = SRPHashEncoder(
                mi.head_dim, self.config.hash_bits, self.config.seed, mi.device, self.impl
            )
        return self._encoder

    def allocate_code_caches(self, num_blocks: int, device: Any = None) -> None:
        """One code cache per layer that computes codes (not rollback or skip)."""
        assert self.model_info is not None
        mi = self.model_info
        for layer in range(mi.num_layers):
            if self.layer_policy(layer) == SPARSE:
                self.code_caches[layer] = self.encoder.new_code_cache(
                    num_blocks, mi.block_size, mi.num_kv_heads, device
                )

    def initialize_kv_cache_tensors(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Sizes the code caches like the KV cache (first dim = blocks)."""
        if not kv_caches:
            return
        first = next(iter(kv_caches.values()))
        num_blocks = first.shape[1] if first.dim() == 5 else first.shape[0]
        self.allocate_code_caches(num_blocks, first.device)

    def write_key_codes(self, layer: int, key: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Hashes this step's keys ``[T, H_kv, D]`` into the layer's code cache."""
        cache = self.code_caches.get(layer)
        if cache is not None:
            self.encoder.write_keys(key, cache, slot_mapping)

    def begin_step(self, seq_lens: list[int] | torch.Tensor) -> bool:
        """Per-step gate (call before the forward)."""
        self.enabled = self.gate(seq_lens)
        self._last_selection = None
        self.num_sparse_steps += int(self.enabled)
        return self.enabled

    def select(
        self,
        layer: int,
        query: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Shortened ``(block_table, seq_lens)`` of the decode batch for ``layer``.

        ``query`` ``[S, H_q, D]``; None means dense attention for this layer.
        """
        if not self.enabled:
            return None
        policy = self.layer_policy(layer)
        if policy == DENSE:
            return None
        if policy == REUSE:
            return self._last_selection
        cache = self.code_caches[layer]
        q_codes = self.encoder.encode_query(query, cache.shape[2])
        keep = torch.tensor([self.keep_blocks(int(x)) for x in seq_lens], dtype=torch.long)
        c = self.config
        batch = selection.HammingBatch(
            q_codes, cache, block_table, seq_lens, c.sink_blocks, c.recent_blocks
        )
        table, lens, _ = gsa_select(batch, keep, self.impl)
        self._last_selection = (table, lens)
        return self._last_selection


__all__ = ["GSA", "SRPHashEncoder", "gsa_select", "gsa_shortened_len", "gsa_topk_blocks"]
