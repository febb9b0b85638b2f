"""ReRoPE inside vLLM 0.32 (CPU and GPU), without editing vLLM.

Two per-instance patches on a loaded model (nothing on classes, nothing in
vLLM's op registry), undone by :meth:`ReRoPEInstall.uninstall`:

1. **Model side.** Every Llama/Qwen-style attention module (an ``nn.Module``
   with ``qkv_proj``, ``rotary_emb`` and ``attn``; its forward calls
   ``q, k = self.rotary_emb(positions, q, k)`` right before
   ``self.attn(q, k, v)``: ``LlamaAttention``, ``Qwen2Attention``,
   ``Qwen3Attention`` (after its q/k norm), ``Qwen3MoeAttention``,
   ``MistralAttention``) gets its ``rotary_emb`` child replaced by a
   :class:`ReRoPERotary`. It scales q by ``max(1, log(pos+1)/log(L))``,
   rotates q and k with the model's own rotary module (so RoPE scaling
   variants apply unchanged), also rotates the scaled q to the constant
   position ``W`` (``q_w``), and keeps k un-rotated (``k2``). It returns
   ``(q, k)`` to the model as before and stashes ``(q_w, k2)`` with the
   :class:`~ucm.sparse.rerope.method.ReRoPE` agent under the layer's name.
   ``get_rope`` caches rotary modules, so several layers share one; the
   wrapper is per layer and never mutates the shared module.
2. **Attention side.** ``layer.attn.impl.forward`` is wrapped per instance
   with the generic hook (:func:`.hooks.wrap_attention_impl`): ``attention_begin`` writes K2 at
   the layer's ``slot_mapping`` -- vLLM has already written K and V with
   ``do_kv_cache_update`` -- then ``sparse_attention`` computes ReRoPE
   attention from the paged K, V and K2 caches into ``output``, or declines
   (no sequence longer than ``W``) and the backend runs unchanged.

The K2 caches are allocated from the layers' ``kv_cache`` tensors
(``+50 %`` KV bytes, see :mod:`ucm.sparse.rerope.method`). On CPU the
attention is the torch reference (vLLM's CPU build has no Triton backend);
on CUDA the Triton kernels. ``enforce_eager=True`` is required: the stash
passes tensors between two Python calls, which a compiled graph would not
replay.

Serving past the checkpoint's ``max_position_embeddings``: raise it with
``hf_overrides={"max_position_embeddings": N}`` (vLLM then builds the rotary
table and accepts ``max_model_len`` up to ``N``) and give ReRoPE the real
pre-training length as ``training_length`` -- the same recipe as the
original UCM patch. :func:`ensure_rotary_capacity` instead extends a plain
``RotaryEmbedding`` table in place (``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1``).

Entry points: :func:`install_rerope_on_model` (in the worker, given the
model); :func:`install_rerope_from_connector`, which the sparse bridge calls
from the connector's ``register_kv_caches`` for a method that declares
``unrotated_keys`` (it finds the model with
:func:`~ucm.integration.vllm.sparse.hooks.find_vllm_model`); and
:func:`install_rerope` (an offline ``vllm.LLM``; runs the first through
``LLM.apply_model``, in-process engines only).

Through the connector the install is also the worker's load observer: K2 of
blocks loaded from the store is derived from their K (the store holds K and
V only), which needs each loaded block's position: the scheduler side's
:class:`ReRoPEScheduler` sends the first loaded block's index as the
transfer's payload.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ucm.integration.vllm.compat import SPARSE_HOOKS, check_vllm
from ucm.integration.vllm.metadata import ReqTransfer
from ucm.integration.vllm.scheduler import SchedulerExtension
from ucm.integration.vllm.sparse.hooks import (
    HookHandle,
    find_vllm_model,
    is_wrapped,
    wrap_attention_impl,
)
from ucm.integration.vllm.worker import LoadsBeforeForward
from ucm.shared.logging import get_logger
from ucm.sparse.base import SparseModelInfo, UcmSparseRole
from ucm.sparse.rerope.config import ReRoPEConfig
from ucm.sparse.rerope.method import ReRoPE
from ucm.sparse.rerope.reference import log_n_scale

_LOG = get_logger("ucm.sparse.rerope")

#: Attention modules whose forward applies ``rotary_emb`` to q, k and then calls ``attn``.
SUPPORTED_ATTENTION = (
    "LlamaAttention",
    "Qwen2Attention",
    "Qwen3Attention",
    "Qwen3MoeAttention",
    "MistralAttention",
)


class ReRoPERotary(torch.nn.Module):
    """Stands in for one attention module's ``rotary_emb`` (see the module doc)."""

    def __init__(
        self, inner: torch.nn.Module, agent: ReRoPE, layer_name: str, head_size: int
    ) -> None:
        super().__init__()
        self.inner = inner
        self.agent = agent
        self.layer_name = layer_name
        self.head_size = head_size

    def _scale(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        base = self.agent.log_n_base
        if base is None:
            return torch.ones(positions.shape[0], 1, dtype=dtype, device=positions.device)
        return log_n_scale(positions.flatten(), base).to(positions.device, dtype).unsqueeze(-1)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if key is None:  # pragma: no cover - cross-layer KV sharing, not supported
            raise NotImplementedError("ReRoPE needs the layer's keys")
        t = query.shape[0]
        k2 = key.clone()  # the inner module may rotate in place (CUDA op)
        qs = (query.view(t, -1) * self._scale(positions, query.dtype)).view(query.shape)
        window = torch.full_like(positions, self.agent.window)
        q_w, _ = self.inner(window, qs.clone(), key.clone())
        q_rot, k_rot = self.inner(positions, qs, key)
        self.agent.stash(
            self.layer_name,
            q_w.reshape(t, -1, self.head_size),
            k2.reshape(t, -1, self.head_size),
        )
        return q_rot, k_rot


def ensure_rotary_capacity(rotary_emb: torch.nn.Module, max_pos: int) -> bool:
    """Extends a plain ``RotaryEmbedding``'s ``cos_sin_cache`` to ``max_pos`` rows in place.

    Returns True if it grew. Scaled variants (YaRN, Llama-3, ...) compute
    their tables differently and are left alone (use ``hf_overrides``).
    """
    cache = getattr(rotary_emb, "cos_sin_cache", None)
    if cache is None or cache.shape[0] >= max_pos:
        return False
    if type(rotary_emb).__name__ != "RotaryEmbedding":
        raise ValueError(
            f"{type(rotary_emb).__name__} has a {cache.shape[0]}-position table; raise "
            "max_position_embeddings with hf_overrides to serve longer prompts"
        )
    old = rotary_emb.max_position_embeddings
    rotary_emb.max_position_embeddings = max_pos
    try:
        new = rotary_emb._compute_cos_sin_cache().to(cache.device, cache.dtype)
    finally:
        rotary_emb.max_position_embeddings = old
    rotary_emb.cos_sin_cache = new
    return True


@dataclass
class ReRoPEInstall(LoadsBeforeForward):
    """What :func:`install_rerope_on_model` did; :meth:`uninstall` restores the model.

    As the worker's load observer, loads land whole before the forward, so K2
    of the loaded blocks is derived before any layer reads it.
    """

    agent: ReRoPE
    layers: list[str] = field(default_factory=list)
    handle: HookHandle = field(default_factory=lambda: HookHandle("rerope"))
    kv_caches: dict[str, torch.Tensor] = field(default_factory=dict)
    rebuilt_blocks: int = 0
    """Loaded blocks whose K2 :meth:`rebuild_loaded` derived."""
    block_size: int = 0
    """vLLM's block size (set when installed through the connector)."""
    _modules: list[tuple[torch.nn.Module, torch.nn.Module]] = field(default_factory=list)

    def blocks_loaded(self, transfers: list[ReqTransfer], failed: set[str]) -> None:
        # Blocks that failed are recomputed by vLLM, K2 included.
        self.rebuild_loaded([(t.load_into, t.sparse) for t in transfers], self.block_size)

    def rebuild_loaded(self, loads: list[tuple[list[int], int]], block_size: int) -> None:
        """K2 of blocks a connector loaded into the KV cache (the store holds K and V only).

        ``loads``: per request, the vLLM block ids and the request's block
        index of the first one (consecutive prefix blocks).
        """
        ids: list[int] = []
        first: list[int] = []
        for blocks, start in loads:
            ids += list(blocks)
            first += [(start + j) * block_size for j in range(len(blocks))]
        if not ids:
            return
        t_ids = torch.tensor(ids, dtype=torch.int64)
        t_first = torch.tensor(first, dtype=torch.int64)
        for name in self.layers:
            self.agent.rebuild_k2(name, self.kv_caches[name], t_ids, t_first)
        self.rebuilt_blocks += len(ids)

    def replace_rotary(self, mod: torch.nn.Module, new: torch.nn.Module) -> None:
        # nn.Module children live in ``_modules``, not ``__dict__``: restore by setattr.
        self._modules.append((mod, mod.rotary_emb))
        mod.rotary_emb = new

    def uninstall(self) -> None:
        """Restores every patched module and impl (idempotent); frees the K2 caches."""
        self.handle.uninstall()
        while self._modules:
            mod, old = self._modules.pop()
            mod.rotary_emb = old
        self.agent.k2_caches.clear()


def _attention_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    found = []
    for name, mod in model.named_modules():
        if not (hasattr(mod, "rotary_emb") and hasattr(mod, "attn") and hasattr(mod.attn, "impl")):
            continue
        if type(mod).__name__ not in SUPPORTED_ATTENTION:
            raise NotImplementedError(
                f"ReRoPE supports {', '.join(SUPPORTED_ATTENTION)}; {name} is {type(mod).__name__}"
            )
        found.append((name, mod))
    return found


def _layer_kv_cache(attn: Any) -> torch.Tensor | None:
    kv = getattr(attn, "kv_cache", None)
    if isinstance(kv, list | tuple):  # older vLLM: one per virtual engine
        kv = kv[0] if kv else None
    return kv if isinstance(kv, torch.Tensor) and kv.numel() else None


def install_rerope_on_model(
    model: torch.nn.Module,
    config: ReRoPEConfig,
    *,
    model_info: SparseModelInfo | None = None,
    max_positions: int | None = None,
    version: str | None = None,
    agent: ReRoPE | None = None,
) -> ReRoPEInstall:
    """Installs ReRoPE on a loaded vLLM model (call in the worker, after the KV cache exists).

    ``config.training_length`` must be set (the model config may carry an
    overridden ``max_position_embeddings``). ``max_positions``: extend plain
    rotary tables to this many positions (:func:`ensure_rotary_capacity`).
    ``agent``: the worker instance of ReRoPE to install (default: a new one).
    """
    check_vllm(SPARSE_HOOKS, version=version)
    if config.training_length is None:
        raise ValueError("install_rerope_on_model needs config.training_length")
    agent = agent or ReRoPE(model_info, UcmSparseRole.WORKER, config)
    inst = ReRoPEInstall(agent)
    kv_caches = {}
    for _, mod in _attention_modules(model):
        attn = mod.attn
        layer_name = attn.layer_name
        if max_positions:
            ensure_rotary_capacity(mod.rotary_emb, max_positions)
        kv = _layer_kv_cache(attn)
        if kv is None:
            raise RuntimeError(f"{layer_name} has no KV cache yet; install after engine start")
        kv_caches[layer_name] = kv
        agent.scales[layer_name] = float(attn.impl.scale)
        if agent.cos_sin_cache is None and hasattr(mod.rotary_emb, "cos_sin_cache"):
            agent.set_rotary(mod.rotary_emb.cos_sin_cache, mod.rotary_emb.is_neox_style)
        head = int(getattr(mod, "head_dim", attn.impl.head_size))
        inst.replace_rotary(mod, ReRoPERotary(mod.rotary_emb, agent, layer_name, head))
        if not is_wrapped(attn.impl.forward):
            inst.handle.patch_attr(
                attn.impl, "forward", wrap_attention_impl(layer_name, attn.impl.forward, agent)
            )
        inst.layers.append(layer_name)
    if not inst.layers:
        raise NotImplementedError("no supported attention module found in the model")
    agent.initialize_kv_cache_tensors(kv_caches)
    inst.kv_caches = kv_caches
    rep = agent.memory_report()
    _LOG.info(
        "ReRoPE on %d layers (W=%d, L=%d): K2 cache %.1f MiB, +%.0f%% of the KV cache",
        len(inst.layers),
        config.rerope_window,
        config.training_length,
        rep["k2_bytes"] / 2**20,
        100 * rep["overhead"],
    )
    return inst


def install_rerope_from_connector(
    vllm_config: Any, agent: ReRoPE, version: str | None = None
) -> ReRoPEInstall:
    """``ucm_sparse_config: {ReRoPE: {...}}`` in the UCM connector: installs
    the bridge's worker instance of ReRoPE on the worker's model (from
    ``register_kv_caches``, when the KV cache is bound to the layers).

    ``training_length`` defaults to the model config's
    ``max_position_embeddings`` (:class:`ReRoPE` resolves it); set it when
    ``hf_overrides`` raised that (the override is what vLLM's config holds).
    """
    if not vllm_config.model_config.enforce_eager:
        raise ValueError(
            "ucm_sparse_config.ReRoPE needs enforce_eager=True: the patched rotary and "
            "attention pass tensors between Python calls a compiled graph would not replay"
        )
    model = find_vllm_model(vllm_config.compilation_config.static_forward_context)
    inst = install_rerope_on_model(model, agent.config, version=version, agent=agent)
    inst.block_size = int(vllm_config.cache_config.block_size)
    return inst


class ReRoPEScheduler(SchedulerExtension):
    """The scheduler side's extension: a transfer with prefix loads carries
    the request's block index of the first one (where the loaded keys sit)."""

    def extend_transfer(
        self, transfer: ReqTransfer, load_start: int, vllm_blocks: list[int]
    ) -> None:
        if transfer.load_keys:
            transfer.sparse = load_start


#: Installs made through :func:`install_rerope`, by id (the worker runs in this process).
_INSTALLS: dict[int, ReRoPEInstall] = {}


def install_rerope(
    llm: Any, config: ReRoPEConfig, max_positions: int | None = None
) -> ReRoPEInstall:
    """Installs ReRoPE into an offline ``vllm.LLM`` whose worker runs in this process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one worker)."""

    def _install(model: torch.nn.Module) -> int:
        inst = install_rerope_on_model(model, config, max_positions=max_positions)
        _INSTALLS[id(inst)] = inst
        return id(inst)

    ids = llm.apply_model(_install)
    if len(ids) != 1 or ids[0] not in _INSTALLS:
        raise RuntimeError("install_rerope needs one in-process worker")
    return _INSTALLS.pop(ids[0])
