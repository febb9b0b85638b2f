"""Attention of the selecting methods inside vLLM (worker side).

:class:`SelectionDriver` is the attention driver of methods that select
blocks per decode step (:class:`~ucm.sparse.base.SparseNeeds` ``offload`` or
``key_codes``): the hooks (:mod:`.hooks`) call it around every attention
layer, it maps vLLM's batch rows to requests (:mod:`.steps`), builds the
offloading methods' representatives at the end of the prefill, asks the
method for each decode row's blocks, loads newly selected blocks from the
store into swap blocks (through :class:`~ucm.integration.vllm.transfer.KVTransfer`)
and attends.

**Attention.** In a batch of decode rows only, every row is computed here
with :func:`ucm.sparse.kernels.attention.paged_decode_attention` (Triton on
CUDA, the torch reference on the CPU build, which has no Triton backend):
sparse rows over their selected blocks, the others over all their blocks;
vLLM's kernel is skipped. In a mixed batch (prefill chunks with decodes)
vLLM's kernel runs and the sparse rows' outputs are then replaced.

**Swap loads** (offload). Each selected middle block is loaded from the
store, per layer, into a swap block (only blocks that changed on a
re-selection). The re-selection (scoring) runs asynchronously on the
method's thread; the delta loads it produces start in the layer's attention
hook and complete by the end of the step (their slots are read from the next
step on), so they overlap the rest of the forward; loads read in the same
step (first selection) are waited for at once. A failed load empties its
slot rather than let the attention read unknown KV.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ucm.integration.vllm.sparse.steps import SparseReqStep, SparseStepMeta
from ucm.integration.vllm.transfer import PendingLoad
from ucm.shared.logging import get_logger
from ucm.sparse.base import AttentionCall, UcmSparseBase, layer_index
from ucm.sparse.kernels import attention
from ucm.sparse.kernels.triton_utils import cdiv
from ucm.sparse.kernels.views import kv_views

if TYPE_CHECKING:
    from ucm.integration.vllm.worker import UCMWorkerSide

logger = get_logger(__name__)


@dataclass
class _Row:
    """One request's rows of a step's batch: queries ``q_start .. q_start + q_len``."""

    index: int
    q_start: int
    q_len: int
    seq_len: int
    info: SparseReqStep | None


@dataclass
class _SwapLoad:
    """Store blocks being loaded into swap blocks of one (request, layer)."""

    retrieval: Any
    slots: list[int]
    pending: PendingLoad | None = None


class SelectionDriver:
    """Drives a selecting method from the attention hooks (see the module doc)."""

    def __init__(self, agent: UcmSparseBase, worker: UCMWorkerSide, block_size: int) -> None:
        self.agent = agent
        self.needs = type(agent).needs
        self.worker = worker
        self.block_size = block_size
        self._kv: dict[str, torch.Tensor] = {}
        self._scales: dict[str, float] = {}
        self._layer: dict[str, int] = {}
        self._step: SparseStepMeta | None = None
        self._by_block: dict[int, SparseReqStep] = {}
        self._rows_key: Any = None
        self._rows: list[_Row] = []
        self._overwrite: dict[str, dict[int, tuple[list[int], int]]] = {}
        self._store_keys: dict[str, list[bytes]] = {}
        """This rank's store keys of each request's prompt blocks."""
        self._swap: dict[str, list[int]] = {}
        self._swap_ready: set[tuple[str, int]] = set()
        self._inflight: list[_SwapLoad] = []
        self._coded: dict[str, int] = {}
        """Key codes: tokens of each request whose codes are in the code caches."""
        self.stats: dict[str, int] = {
            "sparse_rows": 0,
            "attended_blocks": 0,
            "dense_blocks": 0,
            "blocks_loaded": 0,
            "load_failures": 0,
            "kernel_skipped": 0,
            "mixed_batches": 0,
            "loads_deferred": 0,
            "block_layers_coded_from_kv": 0,
        }

    def register(self, kv_caches: dict[str, torch.Tensor], layers: dict[str, Any]) -> None:
        """The KV caches and their attention layers (name -> vLLM ``Attention``)."""
        self._kv = dict(kv_caches)
        for name, layer in layers.items():
            self._layer[name] = layer_index(name)
            self._scales[name] = float(layer.impl.scale)

    def begin_step(self, step: SparseStepMeta | None) -> None:
        """Binds this step's request facts (before the forward)."""
        self._step = step
        self._rows_key = None
        self._overwrite.clear()
        if step is None:
            return
        self._by_block = {r.last_block: r for r in step.requests}
        for r in step.requests:
            if r.store_ids is not None:
                # Derived once here: the selected blocks are loaded again and
                # again, layer by layer and step by step.
                self._store_keys[r.req_id] = self.worker.rank_keys(r.store_ids)
            if r.swap_blocks is not None:
                self._swap[r.req_id] = r.swap_blocks

    def end_step(self) -> SparseStepMeta | None:
        """After the forward: waits for the step's swap loads; returns the step."""
        step, self._step = self._step, None
        # Delta loads overlap the forward; they finish within the step, before
        # the scheduler may free (or hand out) any block of the request.
        self.finish_inflight()
        if step is not None and self.needs.key_codes:
            for r in step.requests:
                self._coded[r.req_id] = r.end
        return step

    # -- the attention driver (see hooks.wrap_attention_impl) ------------------
    def attention_begin(self, call: AttentionCall) -> AttentionCall:
        md, name = call.attn_metadata, call.layer_name
        if self.needs.key_codes and self._step is not None and md is not None:
            # Every key gets its code, sparse step or not, so later steps can use it.
            n = int(md.num_actual_tokens)
            d = self._head_dim(name)
            self._code_cached_prefixes(name, md)
            self.agent.write_key_codes(
                self._layer[name], call.key[:n].view(n, -1, d), md.slot_mapping[:n]
            )
        return call

    def sparse_attention(self, call: AttentionCall) -> bool:
        md = call.attn_metadata
        if self._step is None or not hasattr(md, "query_start_loc"):
            return False
        rows = self._rows_of(md)
        decode = [r for r in rows if r.q_len == 1]
        for r in rows:
            if r.q_len > 1 and r.info is not None and r.info.req_id in self._swap:
                # vLLM's kernel would read the released blocks (speculative decoding).
                raise RuntimeError(
                    f"sparse {r.info.req_id}: {r.q_len} tokens in one decode step are not "
                    "supported with offloaded KV (disable speculative decoding)"
                )
        views = self._views(call.layer_name, decode, call.query, md)
        if not views:
            return False
        if len(decode) != len(rows) or any(r.q_start != r.index for r in rows):
            self._overwrite[call.layer_name] = views  # mixed batch: vLLM's kernel first
            self.stats["mixed_batches"] += 1
            return False
        self._attend(call, rows, views)
        self.stats["kernel_skipped"] += 1
        return True

    def attention_finished(self, call: AttentionCall) -> None:
        md, name = call.attn_metadata, call.layer_name
        if self._step is None or not hasattr(md, "query_start_loc"):
            return
        rows = self._rows_of(md)
        views = self._overwrite.pop(name, None)
        if views:
            sparse_rows = [r for r in rows if r.index in views]
            self._attend(call.replace(kv_cache=self._kv[name]), sparse_rows, views)
        if self.needs.offload:
            for r in rows:
                if r.info is not None and r.info.finishes_prefill:
                    self._prefill_finished(name, r, call.query, md)

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
            rows.append(_Row(i, a, b - a, int(seq[i]), self._by_block.get(blk)))
        self._rows_key, self._rows = md, rows
        return rows

    def drop(self, rid: str) -> None:
        """Forgets a finished or preempted request (its selection state too)."""
        self._coded.pop(rid, None)
        self._store_keys.pop(rid, None)
        self._swap.pop(rid, None)
        self._swap_ready = {k for k in self._swap_ready if k[0] != rid}
        self.agent.request_finished_in_worker(rid)

    def _code_cached_prefixes(self, layer_name: str, md: Any) -> None:
        """Writes the codes of keys this engine did not compute: blocks loaded
        from the store (or taken from another request's prefix) hold KV whose
        code-cache entries belong to whatever used those blocks before. Whole
        blocks are coded from the KV cache itself; the slots of this step's
        tokens are overwritten by their own codes right after."""
        k_view = None
        for r in self._rows_of(md):
            info = r.info
            if info is None or info.start <= self._coded.get(info.req_id, 0):
                continue
            if k_view is None:
                k_view, _ = kv_views(self._kv[layer_name])
            first = self._coded.get(info.req_id, 0) // self.block_size
            ids = md.block_table[r.index, first : cdiv(info.start, self.block_size)]
            ids = ids.to(device=k_view.device, dtype=torch.int64)
            keys = k_view[ids].reshape(-1, k_view.shape[2], k_view.shape[3])
            offsets = torch.arange(self.block_size, device=ids.device)
            slots = (ids.unsqueeze(1) * self.block_size + offsets).reshape(-1)
            self.agent.write_key_codes(self._layer[layer_name], keys, slots)
            self.stats["block_layers_coded_from_kv"] += int(ids.numel())

    def _prefill_finished(self, layer_name: str, r: _Row, query: torch.Tensor, md: Any) -> None:
        info = r.info
        assert info is not None
        k_view, _ = kv_views(self._kv[layer_name])
        n = cdiv(info.prompt_len, self.block_size)
        ids = md.block_table[r.index, :n].to(torch.int64).cpu()
        layer = self._layer[layer_name]
        q = query[r.q_start : r.q_start + r.q_len].reshape(r.q_len, -1, k_view.shape[-1])
        self.agent.on_prefill_finished(info.req_id, layer, k_view, ids, info.prompt_len, q)

    def _views(
        self, layer_name: str, rows: list[_Row], query: torch.Tensor, md: Any
    ) -> dict[int, tuple[list[int], int]]:
        """Selected (block ids, length) per sparse decode row, by row index."""
        if not rows:
            return {}
        if self.needs.key_codes:
            return self._batch_views(layer_name, rows, query, md)
        return self._request_views(layer_name, rows, query, md)

    def _batch_views(
        self, layer_name: str, rows: list[_Row], query: torch.Tensor, md: Any
    ) -> dict[int, tuple[list[int], int]]:
        """Key codes: one selection for the whole decode batch (``select``)."""
        layer = self._layer[layer_name]
        d = self._head_dim(layer_name)
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

    def _request_views(
        self, layer_name: str, rows: list[_Row], query: torch.Tensor, md: Any
    ) -> dict[int, tuple[list[int], int]]:
        """Offload: each request's own selection (``decode_step``), its swap blocks loaded."""
        layer = self._layer[layer_name]
        d = self._head_dim(layer_name)
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
        keys = self._store_keys.get(rid)
        if keys is None:
            raise RuntimeError(f"sparse {rid}: no store keys for its prompt blocks")
        load = _SwapLoad(retr, [s for s, _ in todo])
        self._submit_load(load, layer_name, [keys[b] for _, b in todo], [swap[s] for s, _ in todo])
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
        self, load: _SwapLoad, layer_name: str, keys: list[bytes], blocks: list[int]
    ) -> None:
        """Starts loading store blocks ``keys`` (this rank's) into device ``blocks``
        for one layer."""
        transfer = self.worker.transfer
        assert transfer is not None and self.worker.store is not None
        pos = transfer.layer_position(layer_name)
        assert pos is not None
        load.pending = transfer.load(self.worker.store.get(), [pos], keys, blocks)

    def _finish_load(self, load: _SwapLoad) -> None:
        """Waits for ``load``; a failed one empties its slots (never attend unknown KV)."""
        assert load.pending is not None and self.worker.transfer is not None
        err = load.pending.wait()
        if err is None:
            try:
                self.worker.transfer.finish_load(load.pending)
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

    def finish_inflight(self) -> None:
        """Waits for the swap loads that overlapped the forward."""
        loads, self._inflight = self._inflight, []
        for load in loads:
            self._finish_load(load)

    def _attend(
        self, call: AttentionCall, rows: list[_Row], views: dict[int, tuple[list[int], int]]
    ) -> None:
        """Decode attention of ``rows`` (one query each) into ``call.output``."""
        assert call.kv_cache is not None and call.output is not None
        md, query, output = call.attn_metadata, call.query, call.output
        k_view, v_view = kv_views(call.kv_cache)
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
            self._scales[call.layer_name],
        )
        out_v = output.view(output.shape[0], -1, d)
        out_v[pos] = out.to(output.dtype)


__all__ = ["SelectionDriver"]
