"""Worker side of the connector (runs where the KV cache lives).

Loads go straight from the store into vLLM's paged KV cache and saves
straight out of it (zero-copy: the store reads and writes the cache's
memory). On a GPU the KV cache is device memory, which the store can't
address, so transfers go through host staging buffers (:class:`HostStaging`).

Modes:

* whole-step (``use_layerwise: false``): ``start_load_kv`` loads every layer
  of the step's hits and waits; ``wait_for_save`` submits the step's saves.
* layer-wise: ``start_load_kv`` submits the first ``layerwise_lookahead``
  layers; ``wait_for_layer_load(l)`` waits for layer l and submits layer
  l + lookahead, so loading overlaps the compute of earlier layers;
  ``save_kv_layer(l)`` submits layer l's saves right after its attention.
  A step that computes less than one block has nothing to overlap with and
  loads whole-step.

Either way one store block holds one shard per layer, so the two modes read
each other's blocks. The steps of a transfer are :mod:`.transfer`'s; saves
never block the forward pass and a request is reported finished only once
they are done (:mod:`.saves`).
"""

from __future__ import annotations

import atexit
import json
import logging
import queue
import threading
import time
import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from ucm.integration.vllm.config import ResolvedConfig
from ucm.integration.vllm.layout import KVLayout, build_layout
from ucm.integration.vllm.metadata import ReqTransfer, UCMConnectorMetadata
from ucm.integration.vllm.rank_keys import RankKeys
from ucm.integration.vllm.saves import SaveJob, SaveTracker
from ucm.integration.vllm.scheduler import KVGeometry
from ucm.integration.vllm.stats import StatsCollector, UCMKVConnectorStats
from ucm.integration.vllm.store_handle import StoreHandle, build_store_config, is_block_level
from ucm.integration.vllm.transfer import (
    HostStaging,
    KVTransfer,
    PendingLoad,
    StoreUnusable,
)
from ucm.shared.logging import get_logger

logger = get_logger(__name__)


def _layer_index(name: str) -> int:
    try:
        from vllm.model_executor.models.utils import extract_layer_index

        return int(extract_layer_index(name))
    except Exception:
        digits = [int(p) for p in name.split(".") if p.isdigit()]
        if len(digits) != 1:
            raise ValueError(f"can't tell the layer index of KV cache {name!r}") from None
        return digits[0]


@dataclass
class _Load:
    """One request's load for some layers."""

    req_idx: int
    part: slice  # which of the request's blocks
    pending: PendingLoad
    done: threading.Event = field(default_factory=threading.Event)
    t0: float = 0.0


class LoadObserver:
    """A sparse method that rewrites KV loaded from the store (set by the
    sparse bridge as :attr:`UCMWorkerSide.load_observer`); this base does
    nothing."""

    def prepare_loads(self, meta: UCMConnectorMetadata) -> bool:
        """A step's metadata is bound, its loads not started; True: they must
        all be in place before the forward (whole-step, started at once)."""
        return False

    def blocks_loaded(self, transfers: list[ReqTransfer], failed: set[str]) -> None:
        """The whole-step loads of ``transfers`` are in the KV cache (not those
        of the requests in ``failed``; vLLM recomputes their blocks)."""


class LoadsBeforeForward(LoadObserver):
    """Every step's loads land before the forward (the method's hooks read them)."""

    def prepare_loads(self, meta: UCMConnectorMetadata) -> bool:
        return any(t.load_keys for t in meta.requests)


class UCMWorkerSide:
    """Loads and saves one worker's KV cache."""

    def __init__(
        self, vllm_config: Any, kv_cache_config: Any, cfg: ResolvedConfig, geom: KVGeometry
    ) -> None:
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.cfg = cfg
        self.geom = geom
        self.layerwise = cfg.connector.use_layerwise
        self.lookahead = cfg.connector.layerwise_lookahead or 1 << 30
        try:
            from vllm.distributed.parallel_state import (
                get_tensor_model_parallel_rank,
                get_tensor_model_parallel_world_size,
            )

            self.tp_rank = get_tensor_model_parallel_rank()
            self.tp_size = get_tensor_model_parallel_world_size()
        except Exception:
            self.tp_rank, self.tp_size = 0, 1
        # MLA: every rank holds the same latent KV: all load rank 0's keys,
        # only rank 0 writes them.
        self.rank_keys = RankKeys(0 if geom.is_mla else self.tp_rank)
        """This rank's store keys of the scheduler's block ids."""
        self.is_writer = not geom.is_mla or self.tp_rank == 0
        self.layout: KVLayout | None = None
        self.store: StoreHandle | None = None
        self.transfer: KVTransfer | None = None
        self.stats = StatsCollector()
        self._meta: UCMConnectorMetadata | None = None
        # Load state of the current step.
        self._load_reqs: list[tuple[str, list[bytes], list[int]]] = []
        self._loads_by_layer: dict[int, list[_Load]] = defaultdict(list)
        self._loads_pending = 0
        self._load_next = 0
        self._load_errors: set[int] = set()
        self._load_part = slice(None)  # the blocks of each request _submit_loads loads
        self._load_failed_reqs: set[int] = set()
        self._handover_loads: set[str] = set()  # requests loading handed-over blocks
        # Save state.
        self._save_plan: list[tuple[str, list[bytes], list[int]]] = []
        self._handover_reqs: set[str] = set()
        self.saves = SaveTracker(self._save_done)
        self._io_lock = threading.Lock()
        self._io_inflight: dict[str, int] = {"load": 0, "save": 0}
        self._io_since: dict[str, float] = {"load": 0.0, "save": 0.0}
        self._load_q: queue.Queue[_Load | None] = queue.Queue()
        self._load_waiter: threading.Thread | None = None
        self._closed = False
        self._errors_reported = 0
        self._step_t0 = 0.0
        self.load_observer = LoadObserver()
        """Set by the sparse bridge for a method that rewrites loaded KV."""
        self._loads_first = False  # this step's loads all land before the forward

    # -- registration ----------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        c = self.cfg.connector
        lay = build_layout(
            kv_caches,
            self.kv_cache_config.num_blocks,
            _layer_index,
            self.geom.num_layers,
            with_views=True,
        )
        if lay.shard_bytes != self.geom.shard_bytes:
            raise ValueError(
                f"KV cache layout mismatch: {lay.runs} runs of {lay.run_bytes} bytes per block "
                f"per layer, but the KV cache spec says {self.geom.shard_bytes} bytes"
            )
        self.layout = lay
        staging = None
        if lay.device_type != "cpu" or c.force_host_staging:
            staging = HostStaging(lay, c.enable_event_sync)
        self.transfer = KVTransfer(lay, staging)
        store_cfg = build_store_config(
            self.cfg.store,
            {
                "block_size": lay.block_bytes,
                "shard_size": lay.shard_bytes,
                "tensor_size_list": lay.tensor_size_list,
            },
            device_id=max(self.tp_rank, 0),
        )
        self.store = StoreHandle(self.cfg, store_cfg, role=f"worker rank {self.tp_rank}")
        self.store.open_at_start()
        self._load_waiter = threading.Thread(
            target=self._load_wait_loop, name="ucm-load-waiter", daemon=True
        )
        self._load_waiter.start()
        ref = weakref.ref(self)
        atexit.register(lambda: (w := ref()) is not None and w.shutdown())
        logger.info(
            "UCM worker rank %d: %d layers, %d run(s) of %d bytes per block per layer, "
            "%s mode, store %s %s",
            self.tp_rank,
            len(lay.layers),
            lay.runs,
            lay.run_bytes,
            "layer-wise" if self.layerwise else "whole-step",
            self.cfg.store.name,
            self.cfg.store.config.get("store_pipeline", ""),
        )

    # -- metadata --------------------------------------------------------------
    def bind(self, meta: UCMConnectorMetadata) -> None:
        self._meta = meta
        self._save_plan = []
        self._load_reqs = []
        self._handover_reqs = {t.req_id for t in meta.requests if t.handover}
        self._handover_loads = {t.req_id for t in meta.requests if t.handover_load}
        for t in meta.requests:
            if t.save_keys:
                self.saves.expect(t.req_id)
                self._save_plan.append((t.req_id, self.rank_keys(t.save_keys), t.save_from))
            if t.load_keys:
                self._load_reqs.append((t.req_id, self.rank_keys(t.load_keys), t.load_into))
        self._loads_first = self.load_observer.prepare_loads(meta)
        if self._loads_first:
            # vLLM calls start_load_kv after the forward when no request
            # reports external tokens (e.g. a Blend request whose prefix is
            # all in vLLM's prefix cache): load now, before the forward.
            self.start_load_kv()

    def clear(self) -> None:
        self._meta = None

    # -- loads -------------------------------------------------------------------
    def start_load_kv(self) -> None:
        self._load_part = slice(None)
        self._loads_by_layer.clear()
        self._loads_pending = 0
        self._load_failed_reqs = set()
        if not self._load_reqs or self.layout is None:
            return
        self._step_t0 = time.perf_counter()
        # A method that rewrites loaded KV needs all of it in place before the
        # first layer writes (vLLM waits for a layer's load only after that
        # layer's KV write): whole-step.
        if self.layerwise and not self._loads_first and self._has_compute_to_overlap():
            self._load_next = 0
            if self.cfg.connector.prefetch and self.store is not None:
                # Whole block files start streaming in while the first layers load.
                store = self.store.get()
                try:
                    if store is not None:
                        store.prefetch([i for _, ids, _ in self._load_reqs for i in ids])
                except Exception as e:  # only a hint
                    logger.debug("UCM prefetch failed: %s", e)
            # vLLM writes a layer's new KV before it waits for that layer's
            # load, and the last loaded block of a request holds the first
            # token vLLM computes when the prompt is all hits: load those
            # blocks (all layers) before the forward starts, so no load
            # races with that write; the rest goes layer by layer.
            self._load_part = slice(-1, None)
            self._submit_loads(list(range(len(self.layout.layers))), key=-1)
            self._wait_loads(-1)
            self._load_part = slice(None, -1)
            for _ in range(min(self.lookahead, len(self.layout.layers))):
                self._submit_load_layer()
            if not self._loads_pending:  # one-block hits: all loaded already
                self._load_next = len(self.layout.layers)
                self._finish_load_step()
        else:
            self._submit_loads(list(range(len(self.layout.layers))), key=-1)
            self._wait_loads(-1)
            if self._meta is not None:
                failed = {self._load_reqs[i][0] for i in self._load_failed_reqs}
                loaded = [t for t in self._meta.requests if t.load_keys]
                self.load_observer.blocks_loaded(loaded, failed)
            self._finish_load_step()

    def _has_compute_to_overlap(self) -> bool:
        """Layer-wise loading hides loads behind the forward's compute. A
        step that computes less than one block (prompts that are all hits but
        their last tokens, and nothing else scheduled) has no compute to hide
        them behind, and there per-layer submits and waits only add their
        cost: such a step loads whole-step, as fast as that mode."""
        return self._meta is None or self._meta.num_scheduled_tokens >= self.geom.block_size

    def _submit_load_layer(self) -> None:
        assert self.layout is not None
        pos = self._load_next
        if pos >= len(self.layout.layers):
            return
        self._load_next += 1
        self._submit_loads([pos], key=pos)

    def _submit_loads(self, layer_pos: list[int], key: int) -> None:
        assert self.transfer is not None and self.store is not None
        store = self.store.get()
        part = self._load_part
        for ri, (_req_id, all_ids, all_blocks) in enumerate(self._load_reqs):
            if ri in self._load_failed_reqs:
                # Blocks this request no longer loads for these layers must
                # be recomputed too, not only those that failed.
                self._mark_failed(all_blocks)
                continue
            ids, blocks = all_ids[part], all_blocks[part]
            if not ids:
                continue
            if store is not None:
                self._io_begin("load")
            t0 = time.perf_counter()
            ld = _Load(ri, part, self.transfer.load(store, layer_pos, ids, blocks), t0=t0)
            self._loads_by_layer[key].append(ld)
            self._loads_pending += 1
            if ld.pending.error is None:
                self._load_q.put(ld)
                continue
            if store is not None:
                self._io_end("load")
            ld.done.set()

    def _wait_loads(self, key: int) -> None:
        assert self.transfer is not None
        loads = self._loads_by_layer.pop(key, [])
        for ld in loads:
            self._loads_pending -= 1
            ld.done.wait()
            if ld.pending.error is None:
                self.transfer.finish_load(ld.pending)
                continue
            self._load_failed(ld)

    def _load_wait_loop(self) -> None:
        while True:
            ld = self._load_q.get()
            if ld is None:
                return
            if ld.pending.wait() is None:
                self.stats.add(load_durations_ms=[(time.perf_counter() - ld.t0) * 1e3])
            self._io_end("load")
            ld.done.set()

    def _io_begin(self, kind: str) -> None:
        with self._io_lock:
            if self._io_inflight[kind] == 0:
                self._io_since[kind] = time.perf_counter()
            self._io_inflight[kind] += 1

    def _io_end(self, kind: str) -> None:
        """One transfer finished; while none is in flight the clock stops (GB/s
        are bytes over the time transfers were in flight)."""
        with self._io_lock:
            self._io_inflight[kind] -= 1
            if self._io_inflight[kind] == 0:
                busy = (time.perf_counter() - self._io_since[kind]) * 1e3
                self.stats.add(**{f"{kind}_busy_ms": busy})

    def _load_failed(self, ld: _Load) -> None:
        """Marks the blocks of a failed load so vLLM recomputes them."""
        req_id, ids, blocks = self._load_reqs[ld.req_idx]
        first = ld.req_idx not in self._load_failed_reqs
        self._load_failed_reqs.add(ld.req_idx)
        err = ld.pending.error
        assert err is not None
        bad = list(range(len(ids)))
        if is_block_level(err) and ld.pending.store is not None:
            # Corrupt blocks are removed by the store: find which are gone.
            try:
                present = ld.pending.store.lookup(ids)
                missing = [i for i, p in enumerate(present) if not p]
                if missing:
                    bad = list(range(missing[0], len(ids)))
            except Exception:
                pass
        else:
            if self.store is not None and not isinstance(err, StoreUnusable):
                self.store.report_failure(err, "load")
            # Tells the scheduler side to stop reporting hits for a while.
            self.stats.add(load_store_errors=1)
        self._mark_failed([blocks[i] for i in bad])
        if first:
            logger.warning(
                "UCM load of %d block(s) of request %s failed (%s); vLLM recomputes them",
                len(bad),
                req_id,
                err,
            )

    def _mark_failed(self, blocks: list[int]) -> None:
        """Reports these KV blocks to vLLM as not loaded (it recomputes them)."""
        new = set(blocks) - self._load_errors
        self._load_errors |= new
        self.stats.add(load_failed_blocks=len(new))

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self.layerwise or not self._loads_pending:
            return
        assert self.transfer is not None
        pos = self.transfer.layer_position(layer_name)
        if pos is None:
            return
        n_layers = self.transfer.num_layers
        # Wait for this layer (and any earlier one still pending), then keep
        # `lookahead` layers in flight.
        for key in sorted(k for k in self._loads_by_layer if k <= pos):
            self._wait_loads(key)
        while self._load_next <= pos + self.lookahead and self._load_next < n_layers:
            self._submit_load_layer()
        if not self._loads_pending and self._load_next >= n_layers:
            self._finish_load_step()

    def _drain_loads(self) -> None:
        if self.layout is None:
            return
        while self._load_next < len(self.layout.layers) and self.layerwise and self._load_reqs:
            self._submit_load_layer()
        had = bool(self._loads_by_layer)
        for key in sorted(self._loads_by_layer):
            self._wait_loads(key)
        if had:
            self._finish_load_step()

    def _finish_load_step(self) -> None:
        assert self.layout is not None
        ok = [r for i, r in enumerate(self._load_reqs) if i not in self._load_failed_reqs]
        blocks = sum(len(r[1]) for r in ok)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "UCM loaded %d block(s) of %d request(s) in %.1f ms (%s)",
                blocks,
                len(ok),
                (time.perf_counter() - self._step_t0) * 1e3,
                "layer-wise" if self.layerwise else "whole-step",
            )
        if blocks:
            block_bytes = len(self.layout.layers) * self.layout.shard_bytes
            handed = sum(len(r[1]) for r in ok if r[0] in self._handover_loads)
            self.stats.add(load_blocks=blocks, load_bytes=blocks * block_bytes)
            if handed:
                self.stats.add(handover_load_bytes=handed * block_bytes)
            if self.store is not None:
                self.store.report_success()
        self._load_reqs = []

    def get_block_ids_with_load_errors(self) -> set[int]:
        errs, self._load_errors = self._load_errors, set()
        return errs

    # -- saves -------------------------------------------------------------------
    def save_kv_layer(self, layer_name: str) -> None:
        if not self.layerwise or not self._save_plan or self.transfer is None:
            return
        pos = self.transfer.layer_position(layer_name)
        if pos is None:
            return
        last = pos == self.transfer.num_layers - 1
        self._submit_saves([pos], final=last)

    def wait_for_save(self) -> None:
        # Loads the forward didn't wait for (no attention metadata) must not
        # land in memory later.
        if self._loads_by_layer or (self.layerwise and self._load_reqs):
            self._drain_loads()
        if not self.layerwise and self._save_plan and self.layout is not None:
            self._submit_saves(list(range(len(self.layout.layers))), final=True)
        if self._handover_reqs:
            # P/D prefill engine: vLLM answers these requests right after this
            # step, and the answer tells the decode engine the blocks are there.
            timeout = self.cfg.connector.handover_timeout_s
            if not self.wait_for_saves(self._handover_reqs, timeout):
                logger.warning(
                    "UCM: the saves of %d handed-over request(s) took over %.1f s; "
                    "answering anyway (the decode engine waits for them too)",
                    len(self._handover_reqs),
                    timeout,
                )
            self._handover_reqs = set()

    def _submit_saves(self, layer_pos: list[int], final: bool) -> None:
        assert self.transfer is not None and self.layout is not None and self.store is not None
        if not self.is_writer:
            return
        store = self.store.get()
        if store is None:
            if final:
                self.stats.add(save_skipped_blocks=sum(len(p[1]) for p in self._save_plan))
            return
        for req_id, ids, blocks in self._save_plan:
            n = len(ids)
            t0 = time.perf_counter()
            self._io_begin("save")
            job = SaveJob(
                req_id=req_id,
                blocks=n if final else 0,
                nbytes=n * len(layer_pos) * self.layout.shard_bytes,
                t0=t0,
                pending=self.transfer.save(store, layer_pos, ids, blocks),
            )
            self.saves.add(job)

    def _save_failed(self, err: BaseException, blocks: int) -> None:
        self.stats.add(save_failed_blocks=blocks)
        if self.store is not None and not is_block_level(err):
            self.store.report_failure(err, "save")

    def _save_done(self, job: SaveJob, err: BaseException | None) -> None:
        ms = (time.perf_counter() - job.t0) * 1e3
        if err is None:
            self.stats.add(save_blocks=job.blocks, save_bytes=job.nbytes, save_durations_ms=[ms])
            if self.store is not None:
                self.store.report_success()
        else:
            self._save_failed(err, job.blocks)
        self._io_end("save")

    def wait_for_saves(self, req_ids: set[str] | None, timeout: float) -> bool:
        """Waits until the saves of these requests (None: all) are done; False on timeout."""
        return self.saves.wait(req_ids, timeout)

    def handle_preemptions(self, meta: UCMConnectorMetadata) -> None:
        # vLLM may hand a preempted request's blocks to another request in this
        # very step: its saves must have read them first.
        if meta.preempted_req_ids:
            self.wait_for_saves(set(meta.preempted_req_ids), timeout=300)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, None]:
        idle = self._meta is not None and self._meta.num_scheduled_tokens == 0
        return self.saves.finished(finished_req_ids, idle), None

    # -- stats & shutdown ------------------------------------------------------
    def get_kv_connector_stats(self) -> UCMKVConnectorStats | None:
        data = self.stats.take()
        if self.store is not None and self.store.errors != self._errors_reported:
            data["store_errors"] = self.store.errors - self._errors_reported
            self._errors_reported = self.store.errors
        if self.store is not None and (data or not self.store.healthy):
            data["store_healthy"] = int(self.store.healthy)
            data["store_degraded"] = int(self.store.degraded)
        return UCMKVConnectorStats(data=data) if data else None

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self.wait_for_saves(None, timeout=120):
            logger.warning("UCM: saves still in flight at shutdown; closing anyway")
        self.saves.close()
        if self._load_waiter is not None:
            self._load_q.put(None)
        if self.store is not None:
            self._log_store_figures()
            self.store.close()

    def _log_store_figures(self) -> None:
        """Logs the store's own figures (Cache-tier hits, evictions, bytes per
        tier...), which live in this process only: the one place an operator
        or a benchmark reading the server's log finds them."""
        store = self.store.opened if self.store is not None else None
        if store is None:
            return
        try:
            figures = {k: v for k, v in store.get_stats().items() if isinstance(v, int | float)}
        except Exception as e:  # a store without figures, or one already failing
            logger.debug("UCM store figures unavailable: %s", e)
            return
        if figures:
            logger.info(
                "UCM store figures (worker rank %d): %s",
                self.tp_rank,
                json.dumps(figures, sort_keys=True),
            )


__all__ = ["LoadObserver", "LoadsBeforeForward", "UCMWorkerSide"]
