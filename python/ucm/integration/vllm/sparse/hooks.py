"""Installing the sparse hooks into vLLM 0.32-0.33.

Nothing here runs unless a sparse method is configured
(``ucm_sparse_config`` in the connector config): the connector calls
:func:`install_scheduler_hooks` / :func:`install_worker_hooks` only then, and
every installed hook checks for its driver (or the process's agent) first. Each install
returns a :class:`HookHandle` whose :meth:`~HookHandle.uninstall` restores
exactly what was replaced. Each install first checks the installed vLLM
(:func:`~ucm.integration.vllm.compat.check_vllm` with
:data:`~ucm.integration.vllm.compat.SPARSE_HOOKS`: the supported versions and
the internals listed below), which raises
:class:`~ucm.integration.vllm.compat.UnsupportedVllmError` naming the
installed and the supported versions.

Patch surface (vLLM 0.32, paths under ``vllm/``), smallest first. Most hooks
need **no monkey patch**: they are reached through the KV-connector API the
UCM connector already implements, or through *instance* attributes of objects
the connector is handed. The glue is :mod:`ucm.integration.vllm.sparse.bridge`;
the connector calls it from its KV connector methods.

======================================  ======================================  ==============
hook(s)                                 where they are called from              patch
======================================  ======================================  ==============
``request_begin``                       connector ``get_num_new_matched_tokens``  none
                                        (first call per request)
``request_finished_in_scheduler``       connector ``request_finished``          none
``request_finished_in_worker``          connector ``get_finished`` (finished    none
                                        ids) and ``bind_connector_metadata``
                                        (preempted ids)
``estimate_num_slots_sparsed`` and the  wrapper around the instance attribute   instance attr
release of offloaded blocks             ``kv_cache_manager.allocate_slots``
                                        (the connector gets the manager via
                                        ``bind_kv_cache_manager``)
scheduler -> worker step facts          the connector's own metadata            none
                                        (``build_connector_meta``), not a
                                        ``SchedulerOutput`` field
``initialize_kv_cache_tensors``         connector ``register_kv_caches``        none
``build_sparse_meta``, ``execute_begin``  connector ``bind_connector_metadata``  none
                                        (before the forward; vLLM 0.32 calls
                                        ``start_load_kv`` *after* it when no
                                        load is synchronous)
``execute_finished``                    connector ``wait_for_save``             none
``attention_begin`` / ``_finished`` /   wrapper around each layer's             instance attr
``sparse_attention``                    ``layer.impl.forward`` (layers from
                                        ``compilation_config.
                                        static_forward_context``)
======================================  ======================================  ==============

Why the public interfaces do not suffice:

* **Attention.** ``KVConnectorBase_V1`` sees each layer only *around* the
  attention op (``wait_for_layer_load`` / ``save_kv_layer`` in
  ``maybe_transfer_kv_layer``); it cannot change the keys attended to nor
  replace the output. Wrapping ``impl.forward`` on each layer *instance*
  (rather than ``unified_attention_with_output``, a registered custom op, or
  the backend class) keeps the patch local to this engine's layers, works
  for the direct-call path vLLM uses on CPU and for the custom-op path, and
  leaves ``torch.compile``'s op registry untouched.
* **Allocation.** The scheduler allocates ``num_computed + num_new`` dense
  slots and a running request only ever grows; there is no hook to give
  blocks back. ``KVCacheManager`` is handed to the connector
  (``bind_kv_cache_manager``), so wrapping its ``allocate_slots`` instance
  attribute is enough: after the dense allocation, the request's unselected
  prompt blocks are replaced by ``block_pool.null_block`` in its block list
  and freed -- exactly what vLLM's own sliding-window manager does with
  blocks that left the window.
* **Slot mapping: no patch.** Because the block list keeps its length (null
  blocks in place of the freed ones), every token keeps its true position
  and block index, so ``BlockTable.compute_slot_mapping`` and RoPE need no
  change. (An earlier plan compressed the positions and patched that class
  method; the null-block layout makes it unnecessary.)
* **Layer and FFN hooks** (``layer_begin``/``ffn_*``) need the model's
  decoder layers patched; only a method that declares ``row_cutting`` gets
  them (:mod:`.blend`). For any other method that overrides them
  :func:`install_worker_hooks` raises a clear error.

The model itself is found from the attention layers (:func:`find_vllm_model`)
by the parts that patch it (:mod:`.blend`, :mod:`.rerope`). Everything is
uninstalled on connector ``shutdown``. The offloading methods' own
``allocate_slots`` hook is not used by the connector (the bridge releases
blocks after vLLM's dense allocation instead, :mod:`.offload`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ucm.integration.vllm.compat import SPARSE_HOOKS, check_vllm
from ucm.integration.vllm.sparse import state
from ucm.shared.logging import get_logger
from ucm.sparse.base import INVALID_SLOT, AttentionCall, UcmSparseBase

_LOG = get_logger(__name__)

_MARK = "__ucm_sparse_original__"


@dataclass
class HookHandle:
    """What one install replaced; :meth:`uninstall` puts it back (idempotent)."""

    name: str
    _undo: list[Callable[[], None]] = field(default_factory=list)
    installed: bool = True

    def patch_attr(self, obj: Any, attr: str, new: Any) -> None:
        """Sets ``obj.attr = new``, remembering how to restore it.

        Instance attributes that shadowed a class attribute are deleted on
        undo, so the object falls back to the class's value exactly as before.
        """
        had_own = attr in getattr(obj, "__dict__", {})
        old = obj.__dict__[attr] if had_own else getattr(obj, attr)
        if callable(new) and not isinstance(new, type):
            setattr(new, _MARK, old)
        setattr(obj, attr, new)

        def undo() -> None:
            if had_own:
                setattr(obj, attr, old)
            else:
                try:
                    delattr(obj, attr)
                except AttributeError:
                    setattr(obj, attr, old)

        self._undo.append(undo)

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()
        if self.installed:
            _LOG.info("sparse hooks %s uninstalled", self.name)
        self.installed = False


def is_wrapped(fn: Any) -> bool:
    """Whether ``fn`` is one of our wrappers."""
    return hasattr(fn, _MARK)


def _agent() -> UcmSparseBase | None:
    return state.get_ucm_sparse() if state.has_ucm_sparse() else None


# ---------------------------------------------------------------------------- worker side


def wrap_attention_impl(
    layer_name: str, impl_forward: Callable[..., Any], driver: Any = None
) -> Callable[..., Any]:
    """Wraps one layer's ``impl.forward(layer, q, k, v, kv_cache, attn_metadata, output, ...)``.

    Order: ``attention_begin`` (may replace q/k/v/output) -> the agent's
    :meth:`~UcmSparseBase.sparse_attention` (True: it filled ``output``, the
    backend is skipped) or the backend -> ``attention_finished``, each given
    the layer's :class:`~ucm.sparse.base.AttentionCall`. Without an
    agent, or without metadata (profile and dummy runs), it is the backend.

    ``driver``: the object whose ``attention_begin`` / ``sparse_attention`` /
    ``attention_finished`` are called (the connector's worker bridge, which
    maps vLLM's batch rows to requests); default: the process's agent.
    """

    @functools.wraps(impl_forward)
    def forward(layer, query, key, value, kv_cache, attn_metadata, output=None, *args, **kwargs):
        agent = driver if driver is not None else _agent()
        if agent is None or attn_metadata is None:
            return impl_forward(
                layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs
            )
        call = agent.attention_begin(
            AttentionCall(layer_name, query, key, value, attn_metadata, output, kv_cache=kv_cache)
        )
        if call.output is not None and agent.sparse_attention(call):
            result = call.output
        else:
            q, k, v, out = call.query, call.key, call.value, call.output
            result = impl_forward(layer, q, k, v, kv_cache, attn_metadata, out, *args, **kwargs)
        # This runs per layer and step: copy the call only when the backend
        # wrote somewhere else than the call's output.
        agent.attention_finished(call if result is call.output else call.replace(output=result))
        return result

    return forward


def install_worker_hooks(
    static_forward_context: dict[str, Any],
    agent: UcmSparseBase,
    *,
    version: str | None = None,
    driver: Any = None,
) -> HookHandle:
    """Wraps ``impl.forward`` of every attention layer in ``static_forward_context``.

    ``static_forward_context`` is ``vllm_config.compilation_config.
    static_forward_context`` (layer name -> ``Attention``), available to the
    connector in ``register_kv_caches``. Layers are wrapped per instance.
    ``driver``: see :func:`wrap_attention_impl`.
    """
    check_vllm(SPARSE_HOOKS, version=version)
    for hook in ("layer_begin", "layer_finished", "ffn_begin", "ffn_finished"):
        if getattr(type(agent), hook) is not getattr(UcmSparseBase, hook):
            raise NotImplementedError(
                f"{type(agent).__name__} overrides {hook}, which needs decoder-layer patches: "
                "declare needs = SparseNeeds(row_cutting=True) (see ucm.sparse.base)"
            )
    handle = HookHandle("worker")
    for name, layer in static_forward_context.items():
        impl = getattr(layer, "impl", None)
        if impl is None or not hasattr(impl, "forward") or is_wrapped(impl.forward):
            continue
        handle.patch_attr(impl, "forward", wrap_attention_impl(name, impl.forward, driver))
    _LOG.info("sparse attention hooks installed on %d layers", len(handle._undo))
    return handle


# ---------------------------------------------------------------------------- scheduler side


def wrap_allocate_slots(
    allocate_slots: Callable[..., Any], agent: UcmSparseBase | None = None
) -> Callable[..., Any]:
    """Wraps ``KVCacheManager.allocate_slots(request, num_new_tokens, ...)``.

    When the agent's :meth:`~UcmSparseBase.estimate_num_slots_sparsed` gives
    a budget, its :meth:`~UcmSparseBase.allocate_slots` allocates instead;
    otherwise (or with no agent) the dense allocation runs unchanged.
    ``agent``: default, the process's agent.
    """
    bound = agent

    @functools.wraps(allocate_slots)
    def wrapped(request, num_new_tokens, *args, **kwargs):
        agent = bound if bound is not None else _agent()
        if agent is not None:
            n = agent.estimate_num_slots_sparsed(request)
            if n != INVALID_SLOT:
                manager = getattr(allocate_slots, "__self__", None)
                return agent.allocate_slots(manager, request, n)
        return allocate_slots(request, num_new_tokens, *args, **kwargs)

    return wrapped


def install_scheduler_hooks(
    kv_cache_manager: Any,
    *,
    version: str | None = None,
    wrapper: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None,
) -> HookHandle:
    """Wraps ``allocate_slots`` of the engine's ``KVCacheManager`` instance.

    ``wrapper`` builds the replacement from the original bound method
    (default :func:`wrap_allocate_slots`; the connector's bridge passes its
    own, which releases offloaded blocks after the dense allocation).
    """
    check_vllm(SPARSE_HOOKS, version=version)
    handle = HookHandle("scheduler")
    if not is_wrapped(kv_cache_manager.allocate_slots):
        make = wrapper or wrap_allocate_slots
        handle.patch_attr(kv_cache_manager, "allocate_slots", make(kv_cache_manager.allocate_slots))
    return handle


def find_vllm_model(static_forward_context: dict[str, Any]) -> torch.nn.Module:
    """The loaded model that owns the attention layers of ``static_forward_context``.

    The connector sees the layers (``vllm_config.compilation_config.
    static_forward_context``, layer name -> ``Attention``) but not the model
    runner, and ``nn.Module`` keeps no parent links. The model is the
    outermost live ``nn.Module`` with ``compute_logits`` (every vLLM
    generative model has it) that contains one of those layers; the garbage
    collector lists the live modules. Runs once per engine (well under a
    second with a loaded vLLM).
    """
    import gc

    layers = [m for m in static_forward_context.values() if hasattr(m, "impl")]
    if not layers:
        raise RuntimeError("no attention layer in static_forward_context")
    target = layers[0]
    found = [
        obj
        for obj in gc.get_objects()
        if isinstance(obj, torch.nn.Module)
        and callable(getattr(obj, "compute_logits", None))
        and any(m is target for m in obj.modules())
    ]
    # Keep the outermost (a wrapper, e.g. LoRA, contains the model).
    outer = [m for m in found if not any(o is not m and m in list(o.modules()) for o in found)]
    if len(outer) != 1:
        raise RuntimeError(f"cannot tell the model of the attention layers ({len(outer)} found)")
    return outer[0]


def uninstall_all(handles: Iterable[HookHandle]) -> None:
    """Uninstalls handles in reverse order of installation."""
    for h in reversed(list(handles)):
        h.uninstall()
