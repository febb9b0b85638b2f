"""The one route of a sparse method into vLLM: the connector holds a bridge.

Only used when ``ucm_sparse_config`` names a method: :func:`create_bridge`
returns None otherwise, the connector then holds no bridge and nothing is
installed into vLLM. One bridge per connector instance creates the method
for its role (:class:`~ucm.sparse.factory.UcmSparseFactory`), calls its
lifecycle hooks from the connector's methods, and sets up what the method
declares it needs (:class:`~ucm.sparse.base.SparseNeeds`); it never asks
which method it holds.

* no need declared: the method's ``allocate_slots`` replaces the dense
  allocation when it gives a budget (:func:`~.hooks.wrap_allocate_slots`);
  its own attention hooks see every layer;
* ``offload``: unselected prompt blocks are released after vLLM's allocation
  (:class:`~.offload.OffloadAllocator`, when the connector saves); the
  worker's :class:`~.selection.SelectionDriver` loads selected blocks into
  swap blocks and attends;
* ``key_codes``: the ``SelectionDriver`` writes the key codes and attends
  over the batch's selected blocks;
* ``loads_before_forward``: the method's model patch (or a plain
  :class:`~ucm.integration.vllm.worker.LoadsBeforeForward`) is the worker's
  load observer;
* ``chunk_reuse``: :class:`~.blend.BlendScheduler` plans the requests;
* ``row_cutting``: :class:`~.blend_worker.BlendWorker` patches the model;
* ``unrotated_keys``: :mod:`.rerope` patches the model and
  :class:`~.rerope.ReRoPEScheduler` sends the loaded blocks' positions.

Every step the scheduler bridge sends per-request facts (:mod:`.steps`) in
the connector metadata; a method's per-request data travels as the
transfer's payload (``ReqTransfer.sparse``). The connector's two halves are
configured through their public extension points:
:attr:`UCMSchedulerSide.extension` and ``kv_namespace``,
:attr:`UCMWorkerSide.load_observer`.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ucm.integration.vllm.compat import SPARSE_HOOKS, check_vllm
from ucm.integration.vllm.sparse import state
from ucm.integration.vllm.sparse.hooks import (
    HookHandle,
    install_scheduler_hooks,
    install_worker_hooks,
    wrap_allocate_slots,
)
from ucm.integration.vllm.sparse.model_info import sparse_model_info
from ucm.integration.vllm.sparse.offload import OffloadAllocator
from ucm.integration.vllm.sparse.selection import SelectionDriver
from ucm.integration.vllm.sparse.steps import SparseReqStep, SparseStepMeta
from ucm.integration.vllm.worker import LoadsBeforeForward
from ucm.shared.logging import get_logger
from ucm.sparse.base import UcmSparseBase, UcmSparseRole
from ucm.sparse.config import SparseMethodSpec, method_kv_namespace, parse_sparse_config
from ucm.sparse.factory import UcmSparseFactory

if TYPE_CHECKING:
    from ucm.integration.vllm.scheduler import SchedulerExtension, UCMSchedulerSide
    from ucm.integration.vllm.worker import UCMWorkerSide

logger = get_logger(__name__)

#: Longest wait for a sparsed request's prompt saves at the end of its prefill.
SAVE_WAIT_S = 300.0

#: ``execute_finished`` gets no logits indices from the connector (it runs in
#: ``wait_for_save``, after the model runner has used them).
_NO_LOGITS = torch.empty(0, dtype=torch.long)


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
    Raises :class:`~ucm.integration.vllm.compat.UnsupportedVllmError`
    on a vLLM the hooks do not support (at engine start, not at the first
    request).
    """
    spec = sparse_spec(ucm_config)
    if spec is None:
        return None
    check_vllm(SPARSE_HOOKS, version=version)
    half = SparseSchedulerBridge if is_scheduler else SparseWorkerBridge
    return half(vllm_config, spec, side, ucm_config, version=version)


def _overrides(agent: UcmSparseBase, hook: str) -> bool:
    return getattr(type(agent), hook) is not getattr(UcmSparseBase, hook)


class _BridgeHalf:
    """What both halves hold: the method created for the half's role, what it
    needs, the connector's half (``side``) and the hooks installed."""

    role: ClassVar[UcmSparseRole]

    def __init__(
        self,
        vllm_config: Any,
        spec: SparseMethodSpec,
        side: Any,
        ucm_config: Any,
        *,
        version: str | None = None,
    ) -> None:
        self.vllm_config = vllm_config
        self.spec = spec
        self.side = side
        self.version = version
        self.model_info = sparse_model_info(vllm_config)
        self.agent = UcmSparseFactory.create_sparse_method(
            spec.name, self.model_info, self.role, spec.config
        )
        self.needs = type(self.agent).needs
        self.block_size = int(vllm_config.cache_config.block_size)
        self._handle: HookHandle | None = None
        self._set_up(ucm_config)

    def _set_up(self, ucm_config: Any) -> None:
        """The half's own state (``ucm_config``: the resolved connector config)."""
        raise NotImplementedError


# ============================================================================ scheduler


class SparseSchedulerBridge(_BridgeHalf):
    """Scheduler half: request bookkeeping, step facts, allocation, planning."""

    role = UcmSparseRole.SCHEDULER
    side: UCMSchedulerSide

    def _set_up(self, ucm_config: Any) -> None:
        side, spec = self.side, self.spec
        self.offload: OffloadAllocator | None = None
        if self.needs.offload:
            # Offload needs the prompt's blocks in the store: only when the connector saves.
            if side.save_enabled:
                self.offload = OffloadAllocator(self.agent, self.block_size)
            else:
                logger.warning(
                    "%s: the connector does not save KV (kv_role), so unselected blocks stay "
                    "on the device; only the attention is sparse",
                    spec.name,
                )
        side.kv_namespace = method_kv_namespace(ucm_config.connector.ucm_sparse_config)
        extension = self._extension(ucm_config)
        if extension is not None:
            side.extension = extension
        self._requests: dict[str, Any] = {}
        self._manager: Any = None
        logger.info("UCM sparse %s (scheduler): offload %s", spec.name, self.offload is not None)

    def _extension(self, ucm_config: Any) -> SchedulerExtension | None:
        if self.needs.chunk_reuse:
            from ucm.integration.vllm.sparse.blend import BlendScheduler

            return BlendScheduler(
                self.model_info,
                self.spec.config,
                int(self.vllm_config.scheduler_config.max_num_batched_tokens),
                agent=self.agent,
                hash_algo=ucm_config.connector.hash_algo,
            )
        if self.needs.unrotated_keys:
            from ucm.integration.vllm.sparse.rerope import ReRoPEScheduler

            return ReRoPEScheduler()
        return None

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
        if self.offload is not None:
            self.offload.bind(manager)
            self._handle = install_scheduler_hooks(
                manager, version=self.version, wrapper=self.offload.wrap_allocate_slots
            )
        elif not (self.needs.offload or self.needs.key_codes) and _overrides(
            self.agent, "estimate_num_slots_sparsed"
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
        if self.offload is not None:
            self.offload.finished(rid)

    def attach(self, meta: Any, so: Any) -> None:
        """Adds this step's :class:`SparseStepMeta` to the connector metadata ``meta``."""
        if self.offload is not None:
            for rid in getattr(so, "preempted_req_ids", None) or ():
                self.offload.preempted(rid)
        step = SparseStepMeta()
        for new in so.scheduled_new_reqs:
            self._add(step, new.req_id, new.num_computed_tokens, so)
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            self._add(step, rid, cached.num_computed_tokens[i], so)
        meta.sparse = step

    def shutdown(self) -> None:
        if self._handle is not None:
            self._handle.uninstall()
            self._handle = None
        self.agent.shutdown()

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
        if self.offload is not None:
            self.offload.add_facts(r, request, self.side.store_keys)
        step.requests.append(r)


# ============================================================================ worker


class SparseWorkerBridge(_BridgeHalf):
    """Worker half: installs the method's hooks and drives it (see the module doc)."""

    role = UcmSparseRole.WORKER
    side: UCMWorkerSide

    def _set_up(self, ucm_config: Any) -> None:
        self.selection: SelectionDriver | None = None
        if self.needs.offload or self.needs.key_codes:
            self.selection = SelectionDriver(self.agent, self.side, self.block_size)
        self.patch: Any = None
        """The model patch of a ``row_cutting`` or ``unrotated_keys`` method."""
        self._step: SparseStepMeta | None = None
        state.set_ucm_sparse(self.agent)

    @property
    def stats(self) -> dict[str, int]:
        """What the selection driver counted (empty for other methods)."""
        return self.selection.stats if self.selection is not None else {}

    # -- hooks called by the connector -----------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Installs the hooks the method needs (``initialize_kv_cache_tensors`` too)."""
        ctx = self.vllm_config.compilation_config.static_forward_context
        layers = {n: ctx[n] for n in kv_caches if n in ctx}
        if self.needs.row_cutting:
            from ucm.integration.vllm.sparse.blend_worker import BlendWorker

            self.patch = BlendWorker(self.vllm_config, self.spec.config, agent=self.agent)
            self.patch.register_kv_caches(kv_caches)
        elif self.needs.unrotated_keys:
            from ucm.integration.vllm.sparse.rerope import install_rerope_from_connector

            self.patch = install_rerope_from_connector(
                self.vllm_config,
                self.agent,
                self.version,
            )
        else:
            self.agent.initialize_kv_cache_tensors(kv_caches)
            driver: Any = self.agent
            if self.selection is not None:
                self.selection.register(kv_caches, layers)
                driver = self.selection
            self._handle = install_worker_hooks(
                layers, self.agent, version=self.version, driver=driver
            )
        if self.needs.loads_before_forward:
            self.side.load_observer = self.patch or LoadsBeforeForward()

    def start_step(self, meta: Any) -> None:
        """``build_sparse_meta`` + ``execute_begin``, when the step's metadata is bound
        (not in ``start_load_kv``: vLLM 0.32 calls it after the forward when no
        load is synchronous)."""
        for rid in getattr(meta, "preempted_req_ids", None) or ():
            self._drop(rid)
        step = getattr(meta, "sparse", None)
        self._step = step
        if self.selection is not None:
            self.selection.begin_step(step)
        if step is None:
            return
        if self.needs.key_codes:
            self.agent.begin_step([r.end for r in step.requests])
        self.agent.build_sparse_meta(step)
        self.agent.execute_begin(step)

    def execute_finished(self) -> None:
        """After the forward (from ``wait_for_save``): prompts must be in the store
        before the scheduler releases their blocks at the next allocation."""
        step, self._step = self._step, None
        if self.selection is not None:
            self.selection.end_step()
        self.agent.execute_finished(_NO_LOGITS)
        self.agent.clear_sparse_metadata()
        if step is None or not self.needs.offload:
            return
        selectors = self.agent.selectors
        for r in step.requests:
            if r.store_ids is None or r.req_id not in selectors:
                continue
            if not self.side.wait_for_saves({r.req_id}, SAVE_WAIT_S):
                logger.error(
                    "sparse %s: prompt saves still pending after %ss", r.req_id, SAVE_WAIT_S
                )

    def requests_finished(self, req_ids: set[str]) -> None:
        for rid in req_ids:
            self._drop(rid)

    def shutdown(self) -> None:
        if self.selection is not None:
            self.selection.finish_inflight()
        if self._handle is not None:
            self._handle.uninstall()
            self._handle = None
        if self.patch is not None:
            self.patch.uninstall()
        self.agent.shutdown()
        if state.has_ucm_sparse() and state.get_ucm_sparse() is self.agent:
            state.set_ucm_sparse(None)

    def _drop(self, rid: str) -> None:
        if self.selection is not None:
            self.selection.drop(rid)
        else:
            self.agent.request_finished_in_worker(rid)


__all__ = [
    "SparseSchedulerBridge",
    "SparseWorkerBridge",
    "create_bridge",
    "sparse_spec",
]
