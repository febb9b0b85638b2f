"""What the scheduler bridge tells the worker bridge about each step (picklable).

vLLM's attention metadata has no request ids. The block that receives a
row's last token this step is written by exactly one request, so the
scheduler sends that block id per request (:attr:`SparseReqStep.last_block`)
and the worker matches it against ``slot_mapping`` of the row's last token.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SparseReqStep:
    """One scheduled request in one step, as the workers need it."""

    req_id: str
    prompt_len: int
    start: int
    """Tokens computed before this step."""
    num_tokens: int
    """Tokens scheduled this step."""
    last_block: int
    """vLLM block id receiving this step's last token (identifies the row)."""
    store_ids: list[bytes] | None = None
    """Offload: store keys of the prompt's blocks, sent in the prefill's last step."""
    swap_blocks: list[int] | None = None
    """Offload: block ids of the swap slots, once the request is compressed."""

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def finishes_prefill(self) -> bool:
        return self.start < self.prompt_len <= self.end

    @property
    def decode_step(self) -> int:
        """1 for the first decode step, 0 during the prefill."""
        return self.start - self.prompt_len + 1 if self.start >= self.prompt_len else 0


@dataclass
class SparseStepMeta:
    """The requests of one step (``UCMConnectorMetadata.sparse``)."""

    requests: list[SparseReqStep] = field(default_factory=list)


__all__ = ["SparseReqStep", "SparseStepMeta"]
