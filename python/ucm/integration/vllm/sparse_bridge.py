"""Glue between :class:`~ucm.integration.vllm.ucm_connector.UCMConnector` and :mod:`ucm.sparse`.

Only used when ``ucm_sparse_config`` names a method: :func:`create_bridge`
returns None otherwise, the connector then holds no bridge and nothing is
installed into vLLM. One bridge per connector instance:

* :class:`SparseSchedulerBridge` (scheduler role) creates the method's
  scheduler instance, calls ``request_begin`` (from
  ``get_num_new_matched_tokens``) and ``request_finished_in_scheduler``,
  sends each step's per-request facts to the workers with the connector
  metadata (:class:`SparseStepMeta`) and, for the offloading methods (ESA,
  KVStar), wraps ``KVCacheManager.allocate_slots`` to release the request's
  unselected prompt blocks once its prefill is done (see *Offload* below).
* :class:`SparseWorkerBridge` (worker role) creates the worker instance,
  wraps every attention layer's ``impl.forward`` (:mod:`ucm.sparse.vllm_hooks`)
  and drives the method from there: representatives at the end of the
  prefill, per-step selection, the loads of newly selected blocks from the
  UCM store, and the decode attention over the selected blocks.

**User methods** (registered with
:meth:`~ucm.sparse.factory.UcmSparseFactory.register_sparse_method`) get the
generic hooks: the agent itself is the attention driver (its hooks see each
layer's vLLM attention metadata), and its ``allocate_slots`` replaces the
dense allocation when it overrides ``estimate_num_slots_sparsed``.

**Rows to requests.** vLLM's attention metadata has no request ids. The
block that receives a row's last token this step is written by exactly one
request, so the scheduler sends that block id per request and the worker
matches it against ``slot_mapping`` of the row's last token.

**Attention.** In a batch of decode rows only, the bridge computes every
row itself with :func:`ucm.sparse.kernels.attention.paged_decode_attention` (Triton on
CUDA, the torch reference on the CPU build, which has no Triton backend):
sparse rows over their selected blocks, the others over all their blocks;
vLLM's kernel is skipped. In a mixed batch (prefill chunks with decodes)
vLLM's kernel runs and the sparse rows' outputs are then replaced.

**Offload** (ESA, KVStar; needs the connector to save, i.e. ``kv_role``
``kv_both`` or ``kv_producer``). Device KV of a sparsed request after its
prefill: ``init window | k swap blocks | local window | decode``. At the end
of the prefill step the worker builds the representatives and waits until
the prompt's blocks are saved to the store; at the next allocation the
scheduler keeps the first ``k`` middle blocks as *swap blocks* (dropping
them from the prefix cache, as their contents will change) and replaces the
other ``R - k`` middle blocks in the request's block list with vLLM's
``null_block`` -- the mechanism vLLM's sliding-window manager uses for
blocks that left the window -- which frees them. The block list keeps its
length, so positions, slot mapping and RoPE are unchanged and no
``BlockTable`` patch is needed. Each selected middle block is then loaded
from the store, per layer, into a swap block (only blocks that changed on a
re-selection); the attention reads ``init + active swap blocks + local +
decode``. The re-selection (scoring) runs asynchronously on the method's
thread; the delta loads it produces start in the layer's attention hook and
complete by the end of the step (their slots are read from the next step
on), so they overlap the rest of the forward; loads read in the same step
(first selection) are waited for at once. A failed load empties its slot
rather than let the attention read unknown KV.

Limits: speculative decoding (several tokens per decode step) is refused
for offloaded requests; a swap block shared with another request (prefix
hit) keeps that request's KV on the device; the CUDA path (Triton kernel,
host staging of the loads) is written for but not tested here.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from ucm.integration.vllm.transfer import PendingLoad, rank_keys
from ucm.shared.logging import get_logger
from ucm.sparse import state
from ucm.sparse.base import INVALID_SLOT, UcmSparseBase, UcmSparseRole
from ucm.sparse.config import SparseMethodSpec, parse_sparse_config
from ucm.sparse.factory import UcmSparseFactory
from ucm.sparse.gsa import GSA
from ucm.sparse.kernels import attention
from ucm.sparse.kernels.triton_utils import cdiv
from ucm.sparse.kernels.views import kv_views
from ucm.sparse.offload import OffloadSparseBase
from ucm.sparse.vllm_hooks import (
    HookHandle,
    check_vllm_version,
    install_scheduler_hooks,
    install_worker_hooks,
    wrap_allocate_slots,
)

logger = get_logger(__name__)

#: Longest wait for a sparsed request's prompt saves at the end of its prefill.
SAVE_WAIT_S = 300.0


@dataclass
class SparseReqStep:
    """One scheduled request in one step, as the workers need it (picklable)."""

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
    """What :class:`SparseSchedulerBridge` sends with one step's connector metadata."""

    requests: list[SparseReqStep] = field(default_factory=list)


@dataclass
class Footprint:
    """Device blocks one sparsed request holds (scheduler view), over its decode."""

    prompt_len: int
    dense_blocks: int = 0
    """Blocks the request would hold without sparsity (its block list's length)."""
    held_blocks: int = 0
    """Blocks it holds (not ``null_block``)."""
    max_decode_held: int = 0
    max_decode_dense: int = 0
    max_budget_blocks: int = 0
    """Blocks of the method's budget (``estimate_num_slots_sparsed``), for comparison."""
    compressed: bool = False


#: Footprints of finished requests of this process (newest last), for tests and benchmarks.
FINISHED_FOOTPRINTS: list[tuple[str, Footprint]] = []


def sparse_spec(ucm_config: Any) -> SparseMethodSpec | None:
    """The method configured in a resolved connector config, or None."""
    return parse_sparse_config(ucm_config.connector.ucm_sparse_config)


def create_bridge(
    vllm_config: Any,
    is_scheduler: bool,
    ucm_config: Any,
    side: Any,
    *,
    version: str | None = None,
) -> SparseSchedulerBridge | SparseWorkerBridge | None:
    """The bridge for this connector role, or None when no sparse method is configured.

    ``side`` is the connector's ``UCMSchedulerSide`` or ``UCMWorkerSide``.
    Raises :class:`~ucm.sparse.vllm_hooks.UnsupportedVllmError` on a vLLM the
    hooks do not support (at engine start, not at the first request).
    """
    spec = sparse_spec(ucm_config)
    if spec is None:
        return None
    # --- Blend / ReRoPE: driven by the connector halves themselves
    # (scheduler.py / worker.py call ucm.sparse.blend.vllm_integration and
    # ucm.sparse.rerope.vllm_patch), not by this bridge.
    if spec.name in ("Blend", "ReRoPE"):
        return None
    # --- end Blend / ReRoPE
    check_vllm_version(version)
    if is_scheduler:
        return SparseSchedulerBridge(vllm_config, spec, side, version=version)
    return SparseWorkerBridge(vllm_config, spec, side, version=version)


def _create_agent(vllm_config: Any, spec: SparseMethodSpec, role: UcmSparseRole) -> UcmSparseBase:
    return UcmSparseFactory.create_sparse_method(spec.name, vllm_config, role, spec.config)


def _is_generic(agent: UcmSparseBase) -> bool:
    """A method registered by the user: its own hooks see vLLM's objects directly.

    ESA, KVStar and GSA are driven by the bridges (engine-neutral methods);
    any other :class:`UcmSparseBase` gets the generic hooks: its
    ``attention_begin`` / ``sparse_attention`` / ``attention_finished`` receive
    each layer's vLLM attention metadata, and its ``allocate_slots`` replaces
    the dense allocation when ``estimate_num_slots_sparsed`` returns a budget.
    """
    return not isinstance(agent, OffloadSparseBase | GSA)


#: ``execute_finished`` gets no logits indices from the connector (it runs in
#: ``wait_for_save``, after the model runner has used them).
_NO_LOGITS = torch.empty(0, dtype=torch.long)


# ============================================================================ scheduler


class SparseSchedulerBridge:
    """Scheduler half: request bookkeeping, step facts, offload allocation."""

    def __init__(
        self, vllm_config: Any, spec: SparseMethodSpec, side: Any, *, version: str | None = None
    ) -> None:
        self.spec = spec
        self.agent = _create_agent(vllm_config, spec, UcmSparseRole.SCHEDULER)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.side = side
        self.version = version
        # Offload needs the prompt's blocks in the store: only when the connector saves.
        self.offload = isinstance(self.agent, OffloadSparseBase) and bool(
            getattr(side, "save_enabled", False)
        )
        if isinstance(self.agent, OffloadSparseBase) and not self.offload:
            logger.warning(
                "%s: the connector does not save KV (kv_role), so unselected blocks stay on "
                "the device; only the attention is sparse",
                spec.name,
            )
        self._requests: dict[str, Any] = {}
        self._swap: dict[str, list[int] | None] = {}
        # Requests whose prefill end (representatives, store keys) the workers
        # saw since their last preemption: only these may be compressed.
        self._prefilled: set[str] = set()
        self.footprints: dict[str, Footprint] = {}
        self._manager: Any = None
        self._handle: HookHandle | None = None
        logger.info("UCM sparse %s (scheduler): offload %s", spec.name, self.offload)

    # -- hooks called by the connector -----------------------------------------
    def request_begin(self, request: Any) -> None:
        rid = request.request_id
        if rid not in self._requests:
            self._requests[rid] = request
            self.agent.request_begin(rid, list(request.prompt_token_ids or ()))

    def bind_kv_cache_manager(self, manager: Any) -> None:
        self._manager = manager
        if self._handle is not None:
            return
        if self.offload:
            self._handle = install_scheduler_hooks(
                manager, version=self.version, wrapper=self._wrap_allocate_slots
            )
        elif _is_generic(self.agent) and (
            type(self.agent).estimate_num_slots_sparsed
            is not UcmSparseBase.estimate_num_slots_sparsed
        ):
            self._handle = install_scheduler_hooks(
                manager,
                version=self.version,
                wrapper=functools.partial(wrap_allocate_slots, agent=self.agent),
            )

    def request_finished(self, request: Any) -> None:
        rid = request.request_id
        self.agent.request_finished_in_scheduler(rid)
        self._requests.pop(rid, None)
        self._swap.pop(rid, None)
        self._prefilled.discard(rid)
        fp = self.footprints.pop(rid, None)
        if fp is not None:
            FINISHED_FOOTPRINTS.append((rid, fp))
            del FINISHED_FOOTPRINTS[:-64]

    def attach(self, meta: Any, so: Any) -> None:
        """Adds this step's :class:`SparseStepMeta` to the connector metadata ``meta``."""
        for rid in getattr(so, "preempted_req_ids", None) or ():
            # vLLM freed all its blocks; the resumed prefill starts uncompressed.
            self._swap.pop(rid, None)
            self._prefilled.discard(rid)
        step = SparseStepMeta()
        for new in so.scheduled_new_reqs:
            self._add(step, new.req_id, new.num_computed_tokens, so)
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            self._add(step, rid, cached.num_computed_tokens[i], so)
        meta.ucm_sparse = step

    def shutdown(self) -> None:
        if self._handle is not None:
            self._handle.uninstall()
            self._handle = None
        self.agent.shutdown()

    # -- internals ---------------------------------------------------------------
    def _block_list(self, rid: str) -> list[Any] | None:
        try:
            return self._manager.coordinator.single_type_managers[0].req_to_blocks[rid]
        except (AttributeError, IndexError, KeyError):
            return None

    def _add(self, step: SparseStepMeta, rid: str, start: int, so: Any) -> None:
        request = self._requests.get(rid)
        n = int(so.num_scheduled_tokens.get(rid, 0))
        if request is None or n <= 0 or self._manager is None:
            return
        blocks = self._manager.get_block_ids(rid)[0]
        last = (start + n - 1) // self.block_size
        if last >= len(blocks):
            return
        r = SparseReqStep(rid, int(request.num_prompt_tokens), int(start), n, int(blocks[last]))
        if self.offload:
            plan = self.agent.offload_plan(r.prompt_len)
            if plan is not None:
                if r.finishes_prefill:
                    ids = self.side._ids(request)
                    if ids is not None and len(ids) >= plan.middle_end:
                        r.store_ids = list(ids[: plan.middle_end])
                        self._prefilled.add(rid)
                r.swap_blocks = self._swap.get(rid)
        step.requests.append(r)

    def _wrap_allocate_slots(self, allocate_slots: Any) -> Any:
        @functools.wraps(allocate_slots)
        def wrapped(request: Any, num_new_tokens: int, *args: Any, **kwargs: Any) -> Any:
            out = allocate_slots(request, num_new_tokens, *args, **kwargs)
            if out is not None:
                self._after_alloc(request, num_new_tokens)
            return out

        return wrapped

    def _after_alloc(self, request: Any, num_new_tokens: int) -> None:
        rid = request.request_id
        plan = self.agent.offload_plan(int(request.num_prompt_tokens))
        blocks = self._block_list(rid)
        if plan is None or blocks is None:
            return
        fp = self.footprints.setdefault(rid, Footprint(plan.prompt_len))
        # The method's slot budget: -1 during the prefill, else the compressed
        # KV length after this step.
        budget = self.agent.estimate_num_slots_sparsed(request)
        # Decoding: one new token (not a prompt chunk, nor a resumed prefill
        # that recomputes earlier outputs after a preemption).
        decoding = budget != INVALID_SLOT and (
            request.num_computed_tokens >= max(plan.prompt_len, request.num_tokens - 1)
        )
        # The prefill step built the representatives and waited for the
        # prompt's saves (worker, wait_for_save) before this allocation.
        if decoding and rid not in self._swap and rid in self._prefilled:
            self._swap[rid] = self._compress(rid, plan, blocks)
            fp.compressed = self._swap[rid] is not None
        fp.dense_blocks = len(blocks)
        fp.held_blocks = sum(1 for b in blocks if not b.is_null)
        if decoding:
            fp.max_decode_held = max(fp.max_decode_held, fp.held_blocks)
            fp.max_decode_dense = max(fp.max_decode_dense, fp.dense_blocks)
            fp.max_budget_blocks = max(fp.max_budget_blocks, cdiv(budget, self.block_size))

    def _compress(self, rid: str, plan: Any, blocks: list[Any]) -> list[int] | None:
        lo, hi, k = plan.middle_start, plan.middle_end, plan.num_selected
        if len(blocks) < hi:
            return None
        swap = blocks[lo : lo + k]
        if any(b.is_null or b.ref_cnt != 1 for b in swap):
            # Shared with another request (prefix hit): overwriting would
            # corrupt it. Keep this request's KV on the device.
            logger.info("sparse %s: swap blocks are shared; the request keeps its KV", rid)
            return None
        pool = self._manager.block_pool
        for b in swap:
            pool._maybe_evict_cached_block(b)  # its contents are about to change
        drop = [b for b in blocks[lo + k : hi] if not b.is_null]
        for i in range(lo + k, hi):
            blocks[i] = pool.null_block
        pool.free_blocks(drop)
        logger.debug("sparse %s: %d middle blocks released, %d swap blocks", rid, len(drop), k)
        return [b.block_id for b in swap]


# ============================================================================ worker


@dataclass
class _Row:
    index: int
    q_start: int
    q_end: int
    seq_len: int
    info: SparseReqStep | None

    @property
    def q_len(self) -> int:
        return self.q_end - self.q_start


@dataclass
class _SwapLoad:
    """Store blocks being loaded into swap blocks of one (request, layer)."""

    retrieval: Any
    slots: list[int]
    pending: PendingLoad | None = None


_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")


def layer_index(name: str) -> int:
    """Decoder-layer index in a vLLM attention layer name (``model.layers.3.self_attn.attn``)."""
    m = _LAYER_RE.search(name)
    if m is None:
        raise ValueError(f"cannot find the layer index in {name!r}")
    return int(m.group(1))


class SparseWorkerBridge:
    """Worker half: drives the method from the attention hooks (see the module doc)."""

    def __init__(
        self, vllm_config: Any, spec: SparseMethodSpec, side: Any, *, version: str | None = None
    ) -> None:
        self.spec = spec
        self.vllm_config = vllm_config
        self.agent = _create_agent(vllm_config, spec, UcmSparseRole.WORKER)
        self.side = side
        self.version = version
        self.block_size = int(vllm_config.cache_config.block_size)
        self.is_gsa = isinstance(self.agent, GSA)
        self._handle: HookHandle | None = None
        self._kv: dict[str, torch.Tensor] = {}
        self._scales: dict[str, float] = {}
        self._layer: dict[str, int] = {}
        self._step: SparseStepMeta | None = None
        self._by_block: dict[int, SparseReqStep] = {}
        self._rows_key: Any = None
        self._rows: list[_Row] = []
        self._overwrite: dict[str, dict[int, tuple[list[int], int]]] = {}
        self._store_ids: dict[str, list[bytes]] = {}
        self._swap: dict[str, list[int]] = {}
        self._swap_ready: set[tuple[str, int]] = set()
        self._inflight: list[_SwapLoad] = []
        self.stats: dict[str, int] = {
            "sparse_rows": 0,
            "attended_blocks": 0,
            "dense_blocks": 0,
            "blocks_loaded": 0,
            "load_failures": 0,
            "kernel_skipped": 0,
            "mixed_batches": 0,
            "loads_deferred": 0,
        }
        state.set_ucm_sparse(self.agent)

    # -- hooks called by the connector -----------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Installs the attention hooks (``initialize_kv_cache_tensors`` too)."""
        ctx = self.vllm_config.compilation_config.static_forward_context
        layers = {n: ctx[n] for n in kv_caches if n in ctx}
        self._kv = dict(kv_caches)
        for name, layer in layers.items():
            self._layer[name] = layer_index(name)
            self._scales[name] = float(layer.impl.scale)
        self.agent.initialize_kv_cache_tensors(kv_caches)
        driver = self.agent if _is_generic(self.agent) else self
        self._handle = install_worker_hooks(layers, self.agent, version=self.version, driver=driver)

    def start_step(self, meta: Any) -> None:
        """``build_sparse_meta`` + ``execute_begin`` (from ``start_load_kv``)."""
        for rid in getattr(meta, "preempted_req_ids", None) or ():
            self._drop(rid)
        step = getattr(meta, "ucm_sparse", None)
        self._step = step
        self._rows_key = None
        self._overwrite.clear()
        if step is None:
            return
        self._by_block = {r.last_block: r for r in step.requests}
        for r in step.requests:
            if r.store_ids is not None:
                self._store_ids[r.req_id] = r.store_ids
            if r.swap_blocks is not None:
                self._swap[r.req_id] = r.swap_blocks
        if self.is_gsa:
            self.agent.begin_step([r.end for r in step.requests])
        self.agent.build_sparse_meta(step)
        self.agent.execute_begin(step)

    def execute_finished(self) -> None:
        """After the forward (from ``wait_for_save``): prompts must be in the store
        before the scheduler releases their blocks at the next allocation."""
        step, self._step = self._step, None
        # Delta loads overlap the forward; they finish within the step, before
        # the scheduler may free (or hand out) any block of the request.
        self._finish_inflight()
        self.agent.execute_finished(_NO_LOGITS)
        self.agent.clear_sparse_metadata()
        if step is None or not isinstance(self.agent, OffloadSparseBase):
            return
        for r in step.requests:
            if r.store_ids is None or r.req_id not in self.agent.selectors:
                continue
            if not self.side.wait_for_saves({r.req_id}, SAVE_WAIT_S):
                logger.error(
                    "sparse %s: prompt saves still pending after %ss", r.req_id, SAVE_WAIT_S
                )

    def requests_finished(self, req_ids: set[str]) -> None:
        for rid in req_ids:
            self._drop(rid)

    def shutdown(self) -> None:
        self._finish_inflight()
        if self._handle is not None:
            self._handle.uninstall()
            self._handle = None
        self.agent.shutdown()
        if state.has_ucm_sparse() and state.get_ucm_sparse() is self.agent:
            state.set_ucm_sparse(None)

    # -- driver interface of ucm.sparse.vllm_hooks.wrap_attention_impl ----------
    def attention_begin(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        layer_name: str,
        attn_metadata: Any = None,
        output: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if self.is_gsa and self._step is not None and attn_metadata is not None:
            # Every key gets its code, sparse step or not, so later steps can use it.
            n = int(attn_metadata.num_actual_tokens)
            d = self._head_dim(layer_name)
            self.agent.write_key_codes(
                self._layer[layer_name], key[:n].view(n, -1, d), attn_metadata.slot_mapping[:n]
            )
        return query, key, value, output

    def sparse_attention(
        self,
        layer_name: str,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
        output: torch.Tensor,
    ) -> bool:
        if self._step is None or not hasattr(attn_metadata, "query_start_loc"):
            return False
        rows = self._rows_of(attn_metadata)
        decode = [r for r in rows if r.q_len == 1]
        for r in rows:
            if r.q_len > 1 and r.info is not None and r.info.req_id in self._swap:
                # vLLM's kernel would read the released blocks (speculative decoding).
                raise RuntimeError(
                    f"sparse {r.info.req_id}: {r.q_len} tokens in one decode step are not "
                    "supported with offloaded KV (disable speculative decoding)"
                )
        views = self._views(layer_name, decode, query, attn_metadata)
        if not views:
            return False
        if len(decode) != len(rows) or any(r.q_start != r.index for r in rows):
            self._overwrite[layer_name] = views  # mixed batch: vLLM's kernel first
            self.stats["mixed_batches"] += 1
            return False
        self._attend(layer_name, rows, views, query, kv_cache, attn_metadata, output)
        self.stats["kernel_skipped"] += 1
        return True

    def attention_finished(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_output: torch.Tensor,
        layer_name: str,
        attn_metadata: Any = None,
    ) -> None:
        if self._step is None or not hasattr(attn_metadata, "query_start_loc"):
            return
        rows = self._rows_of(attn_metadata)
        views = self._overwrite.pop(layer_name, None)
        if views:
            sparse_rows = [r for r in rows if r.index in views]
            self._attend(
                layer_name,
                sparse_rows,
                views,
                query,
                self._kv[layer_name],
                attn_metadata,
                attn_output,
            )
        if not self.is_gsa:
            for r in rows:
                if r.info is not None and r.info.finishes_prefill:
                    self._prefill_finished(layer_name, r, query, attn_metadata)

    # -- internals ---------------------------------------------------------------
    def _head_dim(self, layer_name: str) -> int:
        return (
            int(self._kv[layer_name].shape[-1]) // 2
            if self._kv[layer_name].dim() == 4
            else int(self._kv[layer_name].shape[-1])
        )

    def _rows_of(self, md: Any) -> list[_Row]:
        if self._rows_key is md:
            return self._rows
        qsl = md.query_start_loc.tolist()
        seq = md.seq_lens.tolist()
        slots = md.slot_mapping
        rows = []
        for i in range(len(qsl) - 1):
            a, b = int(qsl[i]), int(qsl[i + 1])
            if b <= a:
                continue
            blk = int(slots[b - 1]) // self.block_size
            rows.append(_Row(i, a, b, int(seq[i]), self._by_block.get(blk)))
        self._rows_key, self._rows = md, rows
        return rows

    def _drop(self, rid: str) -> None:
        self._store_ids.pop(rid, None)
        self._swap.pop(rid, None)
        self._swap_ready = {k for k in self._swap_ready if k[0] != rid}
        self.agent.request_finished_in_worker(rid)

    def _prefill_finished(self, layer_name: str, r: _Row, query: torch.Tensor, md: Any) -> None:
        info = r.info
        assert info is not None
        k_view, _ = kv_views(self._kv[layer_name])
        n = cdiv(info.prompt_len, self.block_size)
        ids = md.block_table[r.index, :n].to(torch.int64).cpu()
        layer = self._layer[layer_name]
        if self.spec.name == "KVStar":
            d = k_view.shape[-1]
            x = min(self.agent.config.retrieval_stride, r.q_len)
            q = query[r.q_end - x : r.q_end].reshape(x, -1, d)
            self.agent.on_prefill_finished(info.req_id, layer, k_view, ids, info.prompt_len, q)
        else:
            self.agent.on_prefill_finished(info.req_id, layer, k_view, ids, info.prompt_len)

    def _views(
        self, layer_name: str, rows: list[_Row], query: torch.Tensor, md: Any
    ) -> dict[int, tuple[list[int], int]]:
        """Selected (block ids, length) per sparse decode row, by row index."""
        if not rows:
            return {}
        layer = self._layer[layer_name]
        d = self._head_dim(layer_name)
        if self.is_gsa:
            if not self.agent.enabled:
                return {}
            idx = torch.tensor([r.index for r in rows])
            q = query[torch.tensor([r.q_start for r in rows])].reshape(len(rows), -1, d)
            sel = self.agent.select(layer, q, md.block_table[idx], md.seq_lens[idx])
            if sel is None:
                return {}
            table, lens = sel
            out = {}
            for j, r in enumerate(rows):
                nb = cdiv(int(lens[j]), self.block_size)
                out[r.index] = (table[j, :nb].tolist(), int(lens[j]))
                self._count(r, nb)
            return out
        out = {}
        for r in rows:
            info = r.info
            if info is None or info.decode_step < 1:
                continue
            sel = self.agent.selectors.get(info.req_id)
            if sel is None or layer not in sel.layers:
                if info.req_id in self._swap:  # its middle blocks are gone: never read them
                    raise RuntimeError(f"sparse {info.req_id}: offloaded but has no selection")
                continue
            q = query[r.q_start].reshape(-1, d)
            actions = self.agent.decode_step(info.req_id, layer, info.decode_step, q)
            plan, retr = sel.plan, sel.layers[layer]
            row_blocks = md.block_table[r.index]
            swap = self._swap.get(info.req_id)
            if swap is None:  # not compressed (yet): selected blocks are read in place
                mids = [int(row_blocks[retr.swap.resident[s]]) for s in actions.active_slots]
            else:
                self._load(layer_name, info.req_id, plan, retr, actions, swap)
                # A slot whose load failed was emptied: attend without it.
                mids = [swap[s] for s in actions.active_slots if retr.swap.resident[s] >= 0]
            nb = cdiv(r.seq_len, self.block_size)
            head = row_blocks[: plan.n_init].tolist()
            tail = row_blocks[plan.middle_end : nb].tolist()
            length = (plan.n_init + len(mids)) * self.block_size + r.seq_len
            length -= plan.middle_end * self.block_size
            out[r.index] = (head + mids + tail, length)
            self._count(r, len(head) + len(mids) + len(tail))
        return out

    def _count(self, r: _Row, attended: int) -> None:
        self.stats["sparse_rows"] += 1
        self.stats["attended_blocks"] += attended
        self.stats["dense_blocks"] += cdiv(r.seq_len, self.block_size)

    def _load(
        self, layer_name: str, rid: str, plan: Any, retr: Any, actions: Any, swap: list[int]
    ) -> None:
        """Loads this layer's newly selected blocks from the store into their swap blocks."""
        key = (rid, self._layer[layer_name])
        if key not in self._swap_ready:
            # First step after compression: every selected block not already
            # in its slot (swap block s started out holding block n_init + s).
            todo = [
                (s, b)
                for s, b in enumerate(retr.swap.contents())
                if b >= 0 and b != plan.n_init + s
            ]
            self._swap_ready.add(key)
        else:
            todo = [(op.slot, op.block) for op in actions.loads]
        if not todo:
            return
        ids = self._store_ids.get(rid)
        if ids is None:
            raise RuntimeError(f"sparse {rid}: no store keys for its prompt blocks")
        load = _SwapLoad(retr, [s for s, _ in todo])
        self._submit_load(load, layer_name, [ids[b] for _, b in todo], [swap[s] for s, _ in todo])
        if set(load.slots) & set(actions.active_slots):
            # Read this step (first selection, or blocks already selected when
            # the request was compressed): wait now.
            self._finish_load(load)
        else:
            # A re-selection's delta: its slots stay inactive until the next
            # step, so the load overlaps the rest of this step's forward.
            self._inflight.append(load)
            self.stats["loads_deferred"] += len(load.slots)

    def _submit_load(
        self, load: _SwapLoad, layer_name: str, ids: list[bytes], blocks: list[int]
    ) -> None:
        """Starts loading store blocks ``ids`` into device ``blocks`` for one layer."""
        w = self.side
        assert w.transfer is not None
        pos = w.transfer.layer_position(layer_name)
        assert pos is not None
        store = w.store.get() if w.store is not None else None
        load.pending = w.transfer.load(store, [pos], rank_keys(ids, w.key_rank), blocks)

    def _finish_load(self, load: _SwapLoad) -> None:
        """Waits for ``load``; a failed one empties its slots (never attend unknown KV)."""
        assert load.pending is not None and self.side.transfer is not None
        err = load.pending.wait()
        if err is None:
            try:
                self.side.transfer.finish_load(load.pending)
            except Exception as e:
                err = e
        if err is None:
            self.stats["blocks_loaded"] += len(load.slots)
            return
        self.stats["load_failures"] += len(load.slots)
        logger.error("sparse: loading %d selected blocks failed: %s", len(load.slots), err)
        for s in load.slots:
            load.retrieval.swap.pending.pop(s, None)
            load.retrieval.swap.resident[s] = -1

    def _finish_inflight(self) -> None:
        loads, self._inflight = self._inflight, []
        for load in loads:
            self._finish_load(load)

    def _attend(
        self,
        layer_name: str,
        rows: list[_Row],
        views: dict[int, tuple[list[int], int]],
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        md: Any,
        output: torch.Tensor,
    ) -> None:
        """Decode attention of ``rows`` (one query each) into ``output``."""
        k_view, v_view = kv_views(kv_cache)
        d = k_view.shape[-1]
        tables, lens = [], []
        for r in rows:
            if r.index in views:
                t, n = views[r.index]
            else:
                nb = cdiv(r.seq_len, self.block_size)
                t, n = md.block_table[r.index, :nb].tolist(), r.seq_len
            tables.append(t)
            lens.append(n)
        width = max(1, max(len(t) for t in tables))
        dev = query.device
        table = torch.zeros(len(rows), width, dtype=torch.int32)
        for i, t in enumerate(tables):
            table[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        pos = torch.tensor([r.q_start for r in rows], device=dev)
        q = query[pos].reshape(len(rows), -1, d)
        out = attention.paged_decode_attention(
            q,
            k_view,
            v_view,
            table.to(dev),
            torch.tensor(lens, dtype=torch.int32, device=dev),
            self._scales[layer_name],
        )
        out_v = output.view(output.shape[0], -1, d)
        out_v[pos] = out.to(output.dtype)


__all__ = [
    "FINISHED_FOOTPRINTS",
    "Footprint",
    "SparseReqStep",
    "SparseSchedulerBridge",
    "SparseStepMeta",
    "SparseWorkerBridge",
    "create_bridge",
    "kv_views",
    "layer_index",
    "sparse_spec",
]
