"""Scheduler side of the connector (runs in vLLM's engine-core process).

Per request it hashes the full blocks of the tokens (Rust hasher), asks the
store for the longest stored prefix beyond vLLM's own prefix-cache hit, and
then, step by step, tells the workers which blocks to load (once, in the
request's first step) and which newly computed full blocks to save.

A request's blocks fall into::

    [0, local)            vLLM's prefix cache has them (saved too if the store lacks them)
    [local, local+ext)    found in the store: loaded by the workers
    [local+ext, ...)      computed by vLLM: saved once full (prompt blocks)

Saves are asynchronous: :meth:`request_finished` keeps a request's blocks
alive (returns True) when saves were planned for it, until every worker
reports them done through ``get_finished``.

Prefill/decode disaggregation (:mod:`.handover`): a prefill engine also
saves a handover request's partial last block and answers with the blocks
it saved; a decode engine waits for those blocks before it reports its hit.
:class:`~.handover.Handovers` holds that state; this side asks it.

One class answers every scheduler-side call vLLM's connector interface
makes, in vLLM's order; what stands on its own (the handover, request
control, saves, stats, the store handle) is in modules of its own.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ucm.hashing import block_ids
from ucm.integration.vllm.config import ResolvedConfig
from ucm.integration.vllm.handover import Handovers
from ucm.integration.vllm.metadata import ReqTransfer, UCMConnectorMetadata
from ucm.integration.vllm.request_control import RequestControl
from ucm.integration.vllm.stats import StatsCollector, UCMKVConnectorStats
from ucm.integration.vllm.store_handle import StoreHandle, build_store_config
from ucm.shared.logging import get_logger

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = get_logger(__name__)


@dataclass
class KVGeometry:
    """What both sides agree on without seeing the tensors."""

    block_size: int  # tokens per block
    shard_bytes: int  # bytes of one block of one layer
    num_layers: int  # attention layers of the whole model (shards per store block)
    meta: str  # hash meta: model, dtype, TP size, KV layout, block size
    is_mla: bool
    tp_size: int

    @property
    def block_bytes(self) -> int:
        return self.shard_bytes * self.num_layers

    def scheduler_store_keys(self) -> dict[str, Any]:
        return {
            "block_size": self.block_bytes,
            "shard_size": self.shard_bytes,
            "tensor_size_list": [self.shard_bytes],
        }


def kv_geometry(vllm_config: Any, kv_cache_config: Any, cfg: ResolvedConfig) -> KVGeometry:
    """Derives the geometry and hash meta from vLLM's configs (both roles)."""
    from vllm.platforms import current_platform

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(
            f"UCMConnector supports models with one KV cache group; this one has {len(groups)}"
        )
    spec = groups[0].kv_cache_spec
    shard = int(getattr(spec, "unpadded_page_size_bytes", None) or spec.page_size_bytes)
    mc = vllm_config.model_config
    try:
        n_layers = int(mc.get_total_num_hidden_layers())
    except Exception:  # pragma: no cover - older configs
        n_layers = int(mc.hf_text_config.num_hidden_layers)
    n_layers = max(n_layers, len(groups[0].layer_names))
    is_mla = bool(getattr(mc, "use_mla", False))
    tp = int(vllm_config.parallel_config.tensor_parallel_size)
    layout = vllm_config.cache_config.kv_cache_layout or "default"
    heads = getattr(spec, "num_kv_heads", 0)
    head_size = getattr(spec, "head_size", 0)
    head_size_v = getattr(spec, "head_size_v", head_size)
    kv = (
        f"{current_platform.device_type}:{layout}:{type(spec).__name__}:"
        f"h{heads}:d{head_size}/{head_size_v}:p{shard}"
    )
    bs = int(vllm_config.cache_config.block_size)
    meta = (
        f"ucm-vllm-v1|model={mc.model}|dtype={mc.dtype}|tp={1 if is_mla else tp}|kv={kv}|block={bs}"
    )
    return KVGeometry(
        block_size=bs, shard_bytes=shard, num_layers=n_layers, meta=meta, is_mla=is_mla, tp_size=tp
    )


class SchedulerExtension:
    """What a sparse method adds to the scheduler side's plan.

    The sparse bridge installs one (:attr:`UCMSchedulerSide.extension`) for
    a method that serves requests beyond prefix reuse or ships data with
    their transfers; this base adds nothing.
    """

    def match(self, request: Any, computed_tokens: int, store: Any, namespace: str) -> int | None:
        """Blocks at the start of the prompt to report as found (vLLM's and the
        store's), when the method serves the rest itself; None: the prefix
        lookup decides."""
        return None

    def after_alloc(self, request_id: str, num_external_tokens: int) -> bool:
        """vLLM allocated the request's blocks; True: the method serves the
        request itself and none of its blocks is saved."""
        return False

    def has_payload(self, request_id: str) -> bool:
        """Whether the request needs a transfer this step even without loads or saves."""
        return False

    def extend_transfer(
        self, transfer: ReqTransfer, load_start: int, vllm_blocks: list[int]
    ) -> None:
        """Adds the method's loads and its payload (``transfer.sparse``) to a
        request's transfer; ``load_start`` is the request's block index of
        the first prefix load."""

    def forget(self, request_id: str) -> None:
        """The request finished."""


@dataclass
class _ReqState:
    req_id: str
    keys: list[bytes]  # store keys of the full blocks
    local_blocks: int
    ext_blocks: int
    save_limit: int  # blocks that may be saved (full blocks of the known tokens)
    saved_upto: int  # next block index to save
    save_extra: list[int] = field(default_factory=list)  # local blocks the store lacks
    pending_load: tuple[int, int] | None = None
    last_load: tuple[int, int] | None = None


class UCMSchedulerSide:
    """Lookups and the per-step transfer plan."""

    def __init__(
        self,
        vllm_config: Any,
        kv_cache_config: Any,
        cfg: ResolvedConfig,
        geom: KVGeometry,
        *,
        load: bool = True,
        save: bool = True,
    ) -> None:
        # kv_role: kv_both loads and saves; kv_consumer only loads; kv_producer only saves.
        self.load_enabled = load
        self.save_enabled = save
        self.cfg = cfg
        self.geom = geom
        self.block_size = geom.block_size
        store_cfg = build_store_config(cfg.store, geom.scheduler_store_keys(), device_id=-1)
        self.store = StoreHandle(cfg, store_cfg, role="scheduler")
        self.stats = StatsCollector()
        self._reqs: dict[str, _ReqState] = {}
        self._hashes: dict[str, tuple[int, list[bytes]]] = {}
        self._lookups: dict[str, tuple[int, int]] = {}  # req -> (local_blocks, ext_blocks)
        self.handovers = Handovers(geom.block_size, cfg.connector.handover_timeout_s, self.stats)
        self._reqs_with_saves: set[str] = set()
        self._kv_cache_manager: Any = None
        self._errors_reported = 0
        self._saving = RecentSaves()
        """Keys whose saves this scheduler planned: found by lookups even
        before they reach the store the scheduler reads (a worker's Cache
        tier writes them back later)."""
        self.extension = SchedulerExtension()
        """Set by the sparse bridge (``ucm_sparse_config``)."""
        self.kv_namespace = ""
        """Added to every request's hash namespace by a sparse method that
        changes the KV (set by the sparse bridge)."""
        # Open now, before any worker in this process writes: the Posix
        # store's start-up scan treats temporaries of its own PID as stale.
        self.store.open_at_start()

    # -- hashing & lookup ------------------------------------------------------
    def hash_namespace(self, request: Request) -> str | None:
        """What a request's block ids are chained under (model, deployment,
        salts), or None when its KV can't be keyed by tokens."""
        if (
            getattr(request, "mm_features", None)
            or getattr(request, "prompt_embeds", None) is not None
        ):
            return None
        meta = self.geom.meta + self.kv_namespace
        if self.cfg.connector.hash_salt:
            meta += f"|salt={self.cfg.connector.hash_salt}"
        lora = getattr(request, "lora_request", None)
        if lora is not None:
            meta += f"|lora={getattr(lora, 'lora_name', lora)}"
        salt = getattr(request, "cache_salt", None)
        if salt:
            meta += f"|cache_salt={salt}"
        return meta

    def store_keys(self, request: Request) -> list[bytes] | None:
        """The store keys (block ids) of the request's full blocks, or None."""
        n = request.num_tokens
        memo = self._hashes.get(request.request_id)
        if memo is not None and memo[0] == n:
            return memo[1]
        meta = self.hash_namespace(request)
        if meta is None:
            return None
        tokens = np.fromiter(request.all_token_ids, dtype=np.int64, count=n)
        ids = block_ids(tokens, self.block_size, meta, self.cfg.connector.hash_algo)
        self._hashes[request.request_id] = (n, ids)
        return ids

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        B = self.block_size
        local = num_computed_tokens // B
        self._lookups[request.request_id] = (local, 0)
        self.handovers.set_tail_load(request.request_id, None)  # a new lookup decides anew
        ids = self.store_keys(request)
        control = RequestControl.of(request)
        if ids is None or not self.load_enabled or control.skip_load:
            return 0, False
        handed = self.handovers.expected_keys(request, ids, self.hash_namespace(request) or "")
        if local >= len(ids) and (handed is None or len(handed) == len(ids)):
            return 0, False
        store = self.store.get()
        if store is None:
            return 0, False
        namespace = self.hash_namespace(request)
        try:
            found = self.extension.match(request, local * B, store, namespace or "")
        except Exception as e:
            self.store.report_failure(e, "lookup")
            return 0, False
        if found is not None and namespace is not None:
            ext = found - local
            self._lookups[request.request_id] = (local, ext)
            return ext * B, False
        try:
            ext = store.lookup_on_prefix(ids[local:]) + 1 if local < len(ids) else 0
            tail = self.handovers.stored_tail(handed, ids, local + ext, store)
        except Exception as e:
            self.store.report_failure(e, "lookup")
            return 0, False
        self.store.report_success()
        ext += self._saving.prefix(ids, local + ext)
        if handed is not None and self.handovers.keep_waiting(
            request.request_id, handed, ids, local + ext, tail
        ):
            # The prefill engine's blocks are on their way: ask again next
            # step rather than compute the prompt.
            return None, False
        ext_tokens = ext * B
        if tail is not None:
            ext_tokens = request.num_prompt_tokens - local * B
        if local * B + ext_tokens >= request.num_tokens:
            # vLLM must compute at least one token: recompute the last one.
            ext_tokens = request.num_tokens - 1 - local * B
        ext_tokens = control.cap_load(ext_tokens, B)
        if ext_tokens <= 0 or ext_tokens < self.cfg.connector.min_hit_tokens:
            ext, ext_tokens = 0, 0
        ext = min(ext + (tail is not None), -(-ext_tokens // B))
        # Capped to the full blocks or fewer: the tail stays out.
        self.handovers.set_tail_load(request.request_id, tail if local + ext > len(ids) else None)
        self._lookups[request.request_id] = (local, ext)
        if ext_tokens:
            logger.debug(
                "UCM lookup of request %s: %d local block(s), %d in the store (%d tokens)",
                request.request_id,
                local,
                ext,
                ext_tokens,
            )
        return ext_tokens, False

    def update_state_after_alloc(
        self, request: Request, blocks: Any, num_external_tokens: int
    ) -> None:
        B = self.block_size
        req_id = request.request_id
        ids = self.store_keys(request)
        lookup = self._lookups.pop(req_id, None)
        if ids is None:
            return
        if lookup is not None:
            local_blocks = lookup[0]
        else:  # not looked up (e.g. a resumed request): trust vLLM's count
            local_blocks = max(0, request.num_computed_tokens - num_external_tokens) // B
        ext_blocks = -(-num_external_tokens // B) if num_external_tokens > 0 else 0
        save = self.save_enabled and not RequestControl.of(request).skip_save
        st = _ReqState(
            req_id=req_id,
            keys=ids,
            local_blocks=local_blocks,
            ext_blocks=ext_blocks,
            save_limit=len(ids) if save else 0,
            saved_upto=local_blocks + ext_blocks,
        )
        st.keys = self.handovers.with_tail(req_id, ids, local_blocks + ext_blocks)
        self.handovers.plan(request, st.keys, self.hash_namespace(request) or "", save)
        if ext_blocks:
            st.pending_load = (local_blocks, local_blocks + ext_blocks)
            if self.cfg.connector.prefetch:
                store = self.store.get()
                try:
                    if store is not None:
                        store.prefetch(ids[local_blocks : local_blocks + ext_blocks])
                except Exception as e:  # only a hint
                    logger.debug("UCM prefetch failed: %s", e)
        # Blocks vLLM holds but the store lacks (a store that was unusable, wiped
        # or evicted): save them too, so another engine finds the whole prefix.
        if local_blocks and save:
            store = self.store.get()
            if store is not None:
                try:
                    present = store.lookup(ids[:local_blocks])
                    st.save_extra = [i for i, p in enumerate(present) if not p]
                except Exception as e:
                    self.store.report_failure(e, "lookup")
        if self.extension.after_alloc(req_id, num_external_tokens):
            st.save_limit, st.saved_upto, st.save_extra = 0, 0, []
            self.handovers.cancel(req_id)
        self._reqs[req_id] = st
        looked = request.num_tokens - local_blocks * B
        if looked > 0:
            self.stats.add(lookup_tokens=looked, lookup_hit_tokens=num_external_tokens)

    # -- per-step plan -----------------------------------------------------------
    def bind_kv_cache_manager(self, manager: Any) -> None:
        """vLLM's ``KVCacheManager``: where the requests' block ids are read."""
        self._kv_cache_manager = manager

    def _vllm_blocks(self, req_id: str, fallback: list[int] | None) -> list[int] | None:
        if self._kv_cache_manager is not None:
            try:
                return list(self._kv_cache_manager.get_block_ids(req_id)[0])
            except Exception:  # pragma: no cover - request not known to the manager
                pass
        return fallback

    def _plan(
        self, req_id: str, computed: int, scheduled: int, fallback: list[int] | None
    ) -> ReqTransfer | None:
        st = self._reqs.get(req_id)
        if st is None:
            return None
        B = self.block_size
        load = st.pending_load
        upto = min((computed + scheduled) // B, st.save_limit)
        save_idx = list(st.save_extra)
        if upto > st.saved_upto:
            save_idx.extend(range(st.saved_upto, upto))
        payload = self.extension.has_payload(req_id)
        handover = self.handovers.due(req_id, computed + scheduled)
        if load is None and not save_idx and not payload and not handover:
            return None
        vblocks = self._vllm_blocks(req_id, fallback)
        if vblocks is None:
            return None
        t = ReqTransfer(req_id=req_id)
        load_start = 0
        if load is not None:
            load_start, b = load
            b = min(b, len(vblocks))
            t.load_keys = st.keys[load_start:b]
            t.load_into = vblocks[load_start:b]
            st.pending_load = None
            st.last_load = (load_start, b)
            t.handover_load = self.handovers.loads_handover(req_id)
        self.extension.extend_transfer(t, load_start, vblocks)
        save_idx = [i for i in save_idx if i < len(vblocks)]
        if save_idx:
            t.save_keys = [st.keys[i] for i in save_idx]
            t.save_from = [vblocks[i] for i in save_idx]
            self._reqs_with_saves.add(req_id)
            self._saving.add(t.save_keys)
        if handover and self.handovers.add_to_step(t, vblocks):
            self._reqs_with_saves.add(req_id)
        st.save_extra = []
        st.saved_upto = max(st.saved_upto, upto)
        return t

    def build_connector_meta(self, so: SchedulerOutput) -> UCMConnectorMetadata:
        meta = UCMConnectorMetadata(num_scheduled_tokens=so.total_num_scheduled_tokens)
        for st in self._reqs.values():
            st.last_load = None
        for new in so.scheduled_new_reqs:
            t = self._plan(
                new.req_id,
                new.num_computed_tokens,
                so.num_scheduled_tokens.get(new.req_id, 0),
                list(new.block_ids[0]) if new.block_ids else None,
            )
            if t is not None:
                meta.requests.append(t)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            t = self._plan(
                req_id,
                cached.num_computed_tokens[i],
                so.num_scheduled_tokens.get(req_id, 0),
                None,
            )
            if t is not None:
                meta.requests.append(t)
        preempted = set(so.preempted_req_ids or ())
        if preempted:
            meta.preempted_req_ids = preempted
            scheduled = {r.req_id for r in so.scheduled_new_reqs} | set(cached.req_ids)
            for req_id in preempted - scheduled:
                # Rebuilt by the lookup when the request is scheduled again.
                self._reqs.pop(req_id, None)
                self._hashes.pop(req_id, None)
                self.handovers.cancel(req_id)
        for req_id in so.finished_req_ids:
            self._reqs.pop(req_id, None)
            self._hashes.pop(req_id, None)
            self._lookups.pop(req_id, None)
            self.handovers.forget(req_id)
        return meta

    def update_connector_output(self, output: Any) -> None:
        stats = getattr(output, "kv_connector_stats", None)
        data = getattr(stats, "data", None) or {}
        if data.get("load_store_errors"):
            # The workers can't read the store (not just one bad block): stop
            # promising hits until the back-off expires.
            self.store.report_failure(
                RuntimeError("the workers could not load from the store"), "load"
            )
        invalid = set(getattr(output, "invalid_block_ids", None) or ())
        if not invalid:
            return
        # Blocks that failed to load are recomputed by vLLM: save them again.
        for st in self._reqs.values():
            if st.last_load is None:
                continue
            vblocks = self._vllm_blocks(st.req_id, None) or []
            a, b = st.last_load
            for i in range(a, min(b, len(vblocks))):
                if vblocks[i] in invalid:
                    st.saved_upto = min(st.saved_upto, i)
                    # Not in the store after all (a save that failed).
                    self._saving.forget(st.keys[i:b])
                    break

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, Any]:
        req_id = request.request_id
        self.extension.forget(req_id)
        st = self._reqs.pop(req_id, None)
        self._hashes.pop(req_id, None)
        self._lookups.pop(req_id, None)
        params = None
        if st is not None:
            params = self.handovers.answer(req_id, st.keys, self.store)
        self.handovers.forget(req_id)
        if req_id in self._reqs_with_saves:
            self._reqs_with_saves.discard(req_id)
            # Saves may still be reading these blocks: free them when every
            # worker reports the request in get_finished().
            return True, params
        return False, params

    def get_kv_connector_stats(self) -> UCMKVConnectorStats | None:
        data = self.stats.take()
        errors = self.store.errors - self._errors_reported
        if errors:
            data["store_errors"] = errors
            self._errors_reported = self.store.errors
        if data or not self.store.healthy:
            data["store_healthy"] = int(self.store.healthy)
            data["store_degraded"] = int(self.store.degraded)
        return UCMKVConnectorStats(data=data) if data else None

    def shutdown(self) -> None:
        self.store.close()


class RecentSaves:
    """The keys of the saves a scheduler planned, most recent last, bounded:
    a block a worker's Cache tier holds but has not written back yet is
    still a hit. A save that turns out to have failed is a load failure,
    which vLLM recomputes and which :meth:`forget` takes back."""

    MAX = 1 << 17

    def __init__(self) -> None:
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def add(self, keys: list[bytes]) -> None:
        for k in keys:
            self._keys[k] = None
            self._keys.move_to_end(k)
        while len(self._keys) > self.MAX:
            self._keys.popitem(last=False)

    def forget(self, keys: list[bytes]) -> None:
        for k in keys:
            self._keys.pop(k, None)

    def prefix(self, ids: list[bytes], start: int) -> int:
        """How many of ``ids[start:]``, in a row, have a save planned."""
        n = 0
        while start + n < len(ids) and ids[start + n] in self._keys:
            n += 1
        return n


__all__ = [
    "KVGeometry",
    "RecentSaves",
    "SchedulerExtension",
    "UCMSchedulerSide",
    "kv_geometry",
]
