"""``UcmSparseBase``: the lifecycle hooks a sparse-attention method implements.

A method is built twice, once per process role, exactly like a vLLM KV
connector: the **scheduler** instance (in the EngineCore process) decides how
many KV slots each request gets; the **worker** instance (in the model-runner
process) selects blocks, moves KV and runs the sparse attention. The two never
share memory; what the worker needs from the scheduler (per-request step
facts, the swap blocks of an offloaded request) travels with the connector
metadata (:mod:`ucm.integration.vllm.sparse`).

Every hook has a pass-through default, so a method overrides only what it
needs (the original UCM's extension example overrides ``build_sparse_meta``,
``attention_begin`` and ``attention_finished``). What a method needs from the
engine beyond these hooks it declares as data, :attr:`UcmSparseBase.needs`
(:class:`SparseNeeds`); the engine integration acts on that. Hooks run in
this order (the "called from" column is the original UCM's; with the UCM
connector the vLLM call sites are listed in
:mod:`ucm.integration.vllm.sparse.hooks`):

======  =================================  =========  ==========================================
 #      hook                               role       called from
======  =================================  =========  ==========================================
 1      ``__init__(role=SCHEDULER)``       scheduler  ``Scheduler.__init__``
 2      :meth:`request_begin`              scheduler  ``Scheduler.add_request``
 3      :meth:`estimate_num_slots_sparsed` scheduler  ``Scheduler.schedule``, every request, step
 4      :meth:`allocate_slots`             scheduler  ``KVCacheManager.allocate_slots`` if 3 != -1
 5      :meth:`update_state_after_alloc`   scheduler  after 4
 6      :meth:`request_finished_in_scheduler` sched.  ``Scheduler._free_request``
 7      ``__init__(role=WORKER)``          worker     after the KV connector exists
 8      :meth:`initialize_kv_cache_tensors` worker    once, after the KV cache is allocated
 9      :meth:`update_states`, then
        :meth:`request_finished_in_worker` worker     ``ModelRunner._update_states``
 10     :meth:`build_sparse_meta`          worker     before the forward, every step
 11     :meth:`execute_begin`              worker     before the forward
 12     :meth:`layer_begin`                worker     each decoder layer
 13     :meth:`attention_begin`            worker     each attention layer, after the layer load
 14     :meth:`attention_finished`         worker     after the attention, before the layer save
 15     :meth:`ffn_begin` / :meth:`ffn_finished`  w.  around the MLP
 16     :meth:`layer_finished`             worker     end of each decoder layer
 17     :meth:`execute_finished`           worker     after the forward
======  =================================  =========  ==========================================
"""

from __future__ import annotations

import dataclasses
import enum
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import torch

#: Returned by :meth:`UcmSparseBase.estimate_num_slots_sparsed`: the request is
#: not sparsed this step, allocate its slots the dense way.
INVALID_SLOT = -1


_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)(?:\.|$)")


def layer_index(layer_name: str) -> int:
    """Decoder layer number in an attention layer name (``model.layers.3.self_attn.attn``)."""
    m = _LAYER_RE.search(layer_name)
    if m is None:
        raise ValueError(f"cannot find the layer index in {layer_name!r}")
    return int(m.group(1))


@dataclass(frozen=True)
class SparseNeeds:
    """What a method needs from the engine beyond the hooks, declared on its
    class (:attr:`UcmSparseBase.needs`). The engine integration acts on it;
    a method that declares nothing gets the generic hooks: its own
    ``attention_begin`` / ``sparse_attention`` / ``attention_finished`` see
    every attention layer, and its ``allocate_slots`` replaces the dense
    allocation whenever ``estimate_num_slots_sparsed`` gives a budget."""

    offload: bool = False
    """Unselected prompt blocks leave device KV after the prefill and the
    selected ones are loaded back from the store (when the connector saves);
    the method implements :class:`ucm.sparse.offload.OffloadSparseBase`
    (representatives at the prefill's end, a selection per decode step)."""
    key_codes: bool = False
    """A code is kept for every cached key, written at every step (and, for
    blocks loaded from the store or shared with another request, coded from
    the KV cache at the request's first step), and the blocks of a decode
    batch are selected from them (``write_key_codes``,
    ``begin_step``, ``select``, as :class:`ucm.sparse.gsa.GSA`)."""
    loads_before_forward: bool = False
    """The step's loads from the store are all in place before the forward
    (whole-step, even in layer-wise mode) when a request carries the
    method's payload, and the method's engine part sees them first."""
    row_cutting: bool = False
    """The method drops query rows at some layers (``attention_begin`` before
    the layer's KV write; ``layer_begin``, ``ffn_begin`` and
    ``execute_finished`` shrink and restore the rows), as
    :class:`ucm.sparse.blend.Blend`."""
    chunk_reuse: bool = False
    """Stored chunks are reused anywhere in the prompt, not only as its
    prefix: the method plans each request and adds the chunks' loads."""
    unrotated_keys: bool = False
    """The method gets each layer's un-rotated keys and the query rotated to a
    fixed position from the model's rotary embedding (``stash``), as
    :class:`ucm.sparse.rerope.ReRoPE`."""


class UcmSparseRole(enum.Enum):
    """Which process an instance lives in."""

    SCHEDULER = "scheduler"
    WORKER = "worker"


@dataclass(frozen=True)
class SparseModelInfo:
    """What a method needs to know about the model and its paged KV cache.

    The engine integration describes its model with it (for vLLM:
    :func:`ucm.integration.vllm.sparse.model_info.sparse_model_info`); tests
    and benchmarks build it directly.
    """

    block_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_model_len: int = 1 << 20
    max_num_seqs: int = 256
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    max_position_embeddings: int | None = None
    """The context the model was trained for (``None``: unknown); ReRoPE's
    ``training_length`` defaults to it."""


class LayerRows(NamedTuple):
    """The token rows entering or leaving a decoder layer (the layer hooks'
    operands; a method that drops rows returns fewer of each)."""

    positions: torch.Tensor
    hidden_states: torch.Tensor
    residual: torch.Tensor | None


@dataclass(frozen=True)
class AttentionCall:
    """One attention layer's call, as the attention hooks see it.

    The engine integration builds it once per layer and step and hands it to
    :meth:`UcmSparseBase.attention_begin`, then to
    :meth:`~UcmSparseBase.sparse_attention` and
    :meth:`~UcmSparseBase.attention_finished`. A hook that replaces an
    operand returns a copy (:meth:`replace`).
    """

    layer_name: str
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attn_metadata: Any = None
    """The layer's attention metadata (the original UCM's ``forward_context``):
    ``slot_mapping``, ``query_start_loc``, ``seq_lens``, ``block_table``, ...;
    ``None`` where the caller has none."""
    output: torch.Tensor | None = None
    """Where the attention writes; in :meth:`~UcmSparseBase.attention_finished`,
    what it wrote."""
    kv_cache: torch.Tensor | None = None
    """The layer's paged KV cache (``None`` where the caller has none)."""
    scale: float | None = None
    """The softmax scale (``None``: the method's own, or ``D ** -0.5``)."""

    def replace(self, **changes: Any) -> AttentionCall:
        """A copy with ``changes`` (field name -> new value)."""
        return dataclasses.replace(self, **changes)


@dataclass
class UcmSparseMetadata:
    """Per-step worker metadata built by :meth:`UcmSparseBase.build_sparse_meta`.

    Methods subclass it; ``requests`` maps request id to the method's
    per-request view of the step.
    """

    step: int = 0
    requests: dict[str, Any] = field(default_factory=dict)


class UcmSparseBase:
    """Base class of sparse-attention methods (ESA, GSA, KVStar, user methods).

    Subclasses are registered with
    :meth:`ucm.sparse.factory.UcmSparseFactory.register_sparse_method` and
    selected by ``ucm_sparse_config: {NAME: {...}}`` in the connector config.
    ``config_class`` names the method's config dataclass (``None``: the
    method takes the raw mapping).

    Contracts shared by all hooks:

    * Scheduler hooks run on the scheduler's thread and must not touch
      tensors; worker hooks may launch device work but must not block on the
      store except where the hook says so.
    * A hook that returns tensors returns the ones it was given when it does
      nothing (the defaults do exactly that).
    * Hooks must tolerate requests they have never seen (e.g. after a
      restart of the other role) by treating them as dense.
    """

    config_class: type | None = None
    needs: ClassVar[SparseNeeds] = SparseNeeds()

    @classmethod
    def kv_namespace(cls, config: Any) -> str:
        """Added to the block-id namespace by a method that changes the KV it
        computes, so its blocks never mix with plain ones ("": it doesn't)."""
        return ""

    def __init__(
        self,
        model: SparseModelInfo | None,
        role: UcmSparseRole,
        config: Any = None,
    ) -> None:
        """``model``: the model and its KV layout (``None``: unknown; a method
        that needs it raises when it is used)."""
        self.model_info = model
        self.role = role
        self.config = config
        self._sparse_metadata: UcmSparseMetadata | None = None

    # ------------------------------------------------------------------
    # Scheduler-side hooks
    # ------------------------------------------------------------------

    def request_begin(self, request_id: str, prompt_token_ids: list[int]) -> None:
        """A request entered the scheduler (``Scheduler.add_request``).

        Called once per request, before it is first scheduled. Use it for
        per-request bookkeeping keyed by ``request_id``.
        """

    def estimate_num_slots_sparsed(self, request: Any) -> int:
        """KV token slots ``request`` needs this step, or :data:`INVALID_SLOT`.

        Called by ``Scheduler.schedule`` for each running and waiting request,
        every step, before allocation. ``request`` has at least
        ``request_id``, ``num_prompt_tokens``, ``num_output_tokens`` and
        ``num_computed_tokens``. A value ``n >= 0`` is the *compressed*
        length the request's device KV must hold after this step (the worker
        writes the new token at compressed position ``n - 1``; RoPE positions
        stay the true ones). Must be side-effect free: the scheduler may ask
        again (e.g. after preemption).
        """
        return INVALID_SLOT

    def allocate_slots(self, kv_cache_manager: Any, request: Any, num_slots_sparsed: int) -> Any:
        """Allocates device blocks for ``num_slots_sparsed`` compressed slots.

        Called instead of the dense allocation when
        :meth:`estimate_num_slots_sparsed` returned ``n != INVALID_SLOT``.
        Returns what ``KVCacheManager.allocate_slots`` returns (the new
        blocks), or ``None`` when there is not enough free memory, in which
        case the scheduler preempts as for a dense request. It may free blocks
        (the request's prompt blocks that now live only in the store).
        """
        return None

    def update_state_after_alloc(self, request: Any, num_blocks: int) -> None:
        """The request now holds ``num_blocks`` device blocks (informational)."""

    def request_finished_in_scheduler(self, request_id: str) -> None:
        """The request finished or was aborted; drop scheduler-side state."""

    # ------------------------------------------------------------------
    # Worker-side hooks
    # ------------------------------------------------------------------

    def initialize_kv_cache_tensors(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Called once with every layer's paged KV tensor, after allocation.

        Methods that keep side caches of the same paging (GSA's key codes)
        allocate them here.
        """

    def update_states(self, scheduler_output: Any) -> None:
        """Per step, before :meth:`build_sparse_meta`: new, resumed and preempted
        requests. A preempted request's selection state must be reset (its
        device KV is gone)."""

    def request_finished_in_worker(self, request_id: str) -> None:
        """The request finished; drop worker-side state (representatives,
        selections, pending retrievals)."""

    def build_sparse_meta(
        self,
        scheduler_output: Any,
        requests: Any = None,
        input_batch: Any = None,
        attn_metadata: Any = None,
    ) -> UcmSparseMetadata:
        """Builds this step's metadata and binds it (:meth:`bind_sparse_metadata`).

        Runs before the forward on the worker. The default binds an empty
        :class:`UcmSparseMetadata`.
        """
        meta = UcmSparseMetadata()
        self.bind_sparse_metadata(meta)
        return meta

    def bind_sparse_metadata(self, meta: UcmSparseMetadata) -> None:
        """Makes ``meta`` current for this step's layer hooks."""
        self._sparse_metadata = meta

    def clear_sparse_metadata(self) -> None:
        """Drops the current metadata (after :meth:`execute_finished`)."""
        self._sparse_metadata = None

    def has_sparse_metadata(self) -> bool:
        return self._sparse_metadata is not None

    @property
    def sparse_metadata(self) -> UcmSparseMetadata | None:
        return self._sparse_metadata

    def execute_begin(self, scheduler_output: Any) -> None:
        """Before the forward: start asynchronous work for the step (e.g. wait
        for retrievals submitted in earlier steps, issue loads)."""

    def execute_finished(self, logits_indices: torch.Tensor) -> torch.Tensor:
        """After the forward: finish the step's work. Returns the logits
        indices (a method that drops tokens remaps them)."""
        return logits_indices

    def layer_begin(self, layer_idx: int, rows: LayerRows) -> LayerRows:
        """Start of a decoder layer; may shrink the token set (Blend-style)."""
        return rows

    def layer_finished(self, layer_idx: int, rows: LayerRows) -> LayerRows:
        """End of a decoder layer."""
        return rows

    def ffn_begin(
        self, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Before the MLP of a decoder layer."""
        return hidden_states, residual

    def ffn_finished(
        self, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """After the MLP of a decoder layer."""
        return hidden_states, residual

    def attention_begin(self, call: AttentionCall) -> AttentionCall:
        """Before one attention layer's kernel (after its KV layer load).

        May wait for block loads into this layer, swap the layer's block table
        and sequence lengths for the selected ones, or replace q/k/v/output
        (``call.replace(query=...)``). Returns the call the layer goes on with.
        """
        return call

    def sparse_attention(self, call: AttentionCall) -> bool:
        """Optionally computes a layer's decode attention itself.

        Returns True when ``call.output`` was filled (the hook layer then
        skips the backend's attention for those tokens; the new K/V were
        already written to ``call.kv_cache``). The default declines.
        """
        return False

    def attention_finished(self, call: AttentionCall) -> None:
        """After one attention layer's kernel (``call.output`` holds its
        result), before its KV layer save.

        Build representatives (end of prefill), start retrievals, restore the
        metadata swapped in :meth:`attention_begin`.
        """

    def shutdown(self) -> None:
        """Releases threads and buffers (engine shutdown)."""
