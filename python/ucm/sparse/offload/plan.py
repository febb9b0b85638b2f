"""Block arithmetic of offloaded requests (ESA, KVStar).

**Offload layout**. A prompt of ``P`` tokens covers
``N = ceil(P / B)`` logical blocks, split into

* the *init window*: blocks ``[0, n_init)``;
* the *middle*: ``R = N - n_init - n_local`` full blocks, of which ``k`` are
  kept in device KV at a time (the others live only in the UCM store);
* the *local window*: the last ``n_local`` blocks (the partial tail, if any,
  is one of them), followed by every decode token.

The request's device KV is *compressed*: ``[init | k swap slots | local |
decode]``, so its device length is
``n_init*B + k*B + local_tokens + num_output_tokens`` where ``local_tokens`` is
``n_local*B`` if ``P % B == 0`` and ``P % B + (n_local - 1)*B`` otherwise
(the original ESA budget). Every device block except the last is full, which
is what the paged decode kernel needs. RoPE positions stay the true ones.

On vLLM (:mod:`ucm.integration.vllm.sparse`) the request's block list
keeps its dense length: the first ``k`` middle blocks serve as the swap slots
and the other ``R - k`` are replaced by vLLM's ``null_block`` and freed, so
the request holds exactly :meth:`OffloadPlan.device_blocks` blocks while
every token keeps its true slot.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ucm.sparse.kernels.triton_utils import cdiv


@dataclass(frozen=True)
class OffloadPlan:
    """Block split of one sparsed request (see the module doc)."""

    prompt_len: int
    block_size: int
    n_init: int
    n_local: int
    num_selected: int

    @property
    def num_prompt_blocks(self) -> int:
        return cdiv(self.prompt_len, self.block_size)

    @property
    def num_middle(self) -> int:
        """``R``: candidate blocks for selection."""
        return self.num_prompt_blocks - self.n_init - self.n_local

    @property
    def middle_start(self) -> int:
        """Logical index of the first middle block."""
        return self.n_init

    @property
    def middle_end(self) -> int:
        """Logical index one past the last middle block."""
        return self.num_prompt_blocks - self.n_local

    @property
    def local_tokens(self) -> int:
        rem = self.prompt_len % self.block_size
        if rem == 0:
            return self.n_local * self.block_size
        return rem + (self.n_local - 1) * self.block_size

    @property
    def device_prompt_tokens(self) -> int:
        """Prompt tokens held in device KV once the request is compressed."""
        return (self.n_init + self.num_selected) * self.block_size + self.local_tokens

    def compressed_len(self, num_output_tokens: int) -> int:
        """Device KV length with ``num_output_tokens`` decode tokens appended."""
        return self.device_prompt_tokens + num_output_tokens

    def device_blocks(self, num_output_tokens: int) -> int:
        """Device blocks the compressed request holds."""
        return cdiv(self.compressed_len(num_output_tokens), self.block_size)

    def dense_blocks(self, num_output_tokens: int) -> int:
        """Device blocks the request would hold without sparsity."""
        return cdiv(self.prompt_len + num_output_tokens, self.block_size)

    @property
    def swap_slot_start(self) -> int:
        """Compressed block index of swap slot 0 (right after the init window)."""
        return self.n_init

    @property
    def local_start(self) -> int:
        """Compressed block index of the first local-window block."""
        return self.n_init + self.num_selected

    def attention_view(
        self, device_blocks: list[int], active_slots: list[int], num_output_tokens: int
    ) -> tuple[list[int], int]:
        """Block ids and length the attention reads this step.

        ``device_blocks`` is the request's compressed block-table row; swap
        slots not in ``active_slots`` (empty, or being loaded) are left out,
        which keeps every block but the last one full.
        """
        nb = self.device_blocks(num_output_tokens)
        if len(device_blocks) < nb:
            raise ValueError(f"block table row has {len(device_blocks)} blocks, need {nb}")
        k0 = self.swap_slot_start
        blocks = list(device_blocks[:k0])
        blocks += [device_blocks[k0 + s] for s in sorted(active_slots)]
        blocks += list(device_blocks[self.local_start : nb])
        dropped = self.num_selected - len(active_slots)
        return blocks, self.compressed_len(num_output_tokens) - dropped * self.block_size

    def compressed_block_of_logical(self, logical: int) -> int | None:
        """Compressed index of a logical prompt block in a fixed window (None: middle)."""
        if logical < self.n_init:
            return logical
        if logical >= self.middle_end:
            return self.local_start + (logical - self.middle_end)
        return None


def make_offload_plan(
    prompt_len: int,
    block_size: int,
    n_init: int,
    n_local: int,
    sparse_ratio: float,
    min_blocks: int,
    rounding: str = "floor",
) -> OffloadPlan | None:
    """The plan of a request, or None when it stays dense.

    A request stays dense when it is shorter than ``min_blocks`` blocks, has no
    middle blocks, or would keep all of them (``sparse_ratio`` 1.0): sparsity
    is then skipped entirely, so the output is exactly the dense one.
    ``rounding`` is ``"floor"`` (ESA) or ``"ceil"`` (KVStar).
    """
    n = cdiv(prompt_len, block_size)
    if prompt_len <= 0 or n < min_blocks:
        return None
    r = n - n_init - n_local
    if r <= 0:
        return None
    k = math.floor(r * sparse_ratio) if rounding == "floor" else math.ceil(r * sparse_ratio)
    k = max(0, min(r, k))
    if k >= r:
        return None
    return OffloadPlan(prompt_len, block_size, n_init, n_local, k)
