"""Prefill/decode (P/D) handover through vLLM's ``kv_transfer_params``.

A prefill engine (``kv_role: kv_producer``) and a decode engine
(``kv_role: kv_consumer``) share one store. A router (``ucm proxy``) sends
the prompt to the prefill engine with vLLM's P/D field::

    {"do_remote_decode": true}

The prefill engine saves the whole prompt (its last, partial block too,
under a key of its own: :func:`tail_key`), its workers wait for those saves
before the step ends, and so its response names only blocks that are
readable::

    {"do_remote_prefill": true, "do_remote_decode": false,
     "ucm_blocks": N,          # full blocks of the prompt in the store
     "ucm_tail_tokens": T,     # tokens of the partial last block saved too (0: none)
     "ucm_last_block": "hex"}  # id of the last of them (the tail's when T > 0)

The router passes these to the decode engine, whose scheduler waits until
the store shows those blocks (the store may lag behind the prefill engine's
write: a Cache tier writes back later, NFS caches attributes), bounded by
``handover_timeout_s``, and then loads all but the prompt's last token.

Block ids are chained, so the last id names the whole prefix: a decode
engine whose own id differs (another model, salt or block size) warns and
computes the prompt instead of waiting for blocks that never come. Bad
values are ignored with a warning, never fatal.

:class:`Handovers` holds all of a scheduler's handover state, for both
engines; the scheduler asks it at each step of vLLM's connector calls and
keeps none of its own.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ucm.shared.logging import get_logger

if TYPE_CHECKING:
    from ucm.integration.vllm.metadata import ReqTransfer
    from ucm.integration.vllm.stats import StatsCollector
    from ucm.integration.vllm.store_handle import StoreHandle
    from ucm.store import UcmKVStoreBase

logger = get_logger(__name__)

_TAIL_PERSON = b"ucm-pd-tail-v1"


def tail_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Store key of a prompt's partial last block: its tokens chained to the
    previous block's id (or, for a prompt shorter than a block, the hash
    namespace), in a keyspace of its own so prefix lookups never see it."""
    # A hash of its own, not a second hash of a block id: the block hasher
    # only ids full blocks, and this key must never equal one of theirs.
    h = hashlib.blake2b(digest_size=16, person=_TAIL_PERSON)
    h.update(len(parent).to_bytes(4, "little"))
    h.update(parent)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.digest()


def prompt_tail_key(
    ids: Sequence[bytes], tokens: Sequence[int], namespace: str, block_size: int, end: int
) -> bytes:
    """:func:`tail_key` of the partial block ending a prompt of ``end``
    tokens, chained to its last full block's id in ``ids``."""
    full = end // block_size
    parent = ids[full - 1] if full else namespace.encode()
    return tail_key(parent, tokens[full * block_size : end])


def wants_handover(request: Any) -> bool:
    """Whether the request asks this (prefill) engine to hand its KV over."""
    params = getattr(request, "kv_transfer_params", None)
    return isinstance(params, Mapping) and params.get("do_remote_decode") is True


@dataclass(frozen=True)
class Handover:
    """The blocks a prefill engine handed over for one request."""

    blocks: int
    tail_tokens: int
    last_block: bytes

    def params(self) -> dict[str, Any]:
        """The prefill engine's ``kv_transfer_params``."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "ucm_blocks": self.blocks,
            "ucm_tail_tokens": self.tail_tokens,
            "ucm_last_block": self.last_block.hex(),
        }

    @classmethod
    def of(cls, request: Any, block_size: int) -> Handover | None:
        """The handover a decode request carries, or None (none, or a bad
        one: ignored with a warning)."""
        params = getattr(request, "kv_transfer_params", None)
        if not isinstance(params, Mapping) or params.get("do_remote_prefill") is not True:
            return None
        if "ucm_blocks" not in params:
            return None  # another connector's handover
        rid = getattr(request, "request_id", "?")
        blocks = params.get("ucm_blocks")
        tail = params.get("ucm_tail_tokens", 0)
        last = params.get("ucm_last_block")
        n_tokens = int(getattr(request, "num_prompt_tokens", 0) or 0)
        problem = None
        last_b = b""
        if not _is_int(blocks) or not _is_int(tail):
            problem = "ucm_blocks and ucm_tail_tokens must be integers"
        elif blocks < 0 or not 0 <= tail < block_size:
            problem = f"ucm_blocks must be >= 0 and ucm_tail_tokens in [0, {block_size})"
        elif blocks * block_size + tail > n_tokens:
            problem = f"they cover more than the prompt's {n_tokens} tokens"
        elif not isinstance(last, str) or len(last) != 32:
            problem = "ucm_last_block must be a 32-digit hex string"
        else:
            try:
                last_b = bytes.fromhex(last)
            except ValueError:
                problem = "ucm_last_block must be a 32-digit hex string"
        if problem is not None:
            logger.warning(
                "request %s: kv_transfer_params of the P/D handover ignored (%s); "
                "the prompt is computed here",
                rid,
                problem,
            )
            return None
        if blocks == 0 and tail == 0:
            return None
        return cls(blocks=blocks, tail_tokens=tail, last_block=last_b)

    def expected_keys(
        self, ids: list[bytes], tokens: Sequence[int], namespace: str, block_size: int
    ) -> list[bytes] | None:
        """This engine's keys of the handed-over blocks (the tail's last), or
        None when they are not the ones the prefill engine saved."""
        keys = list(ids[: self.blocks])
        if len(keys) < self.blocks:
            return None
        if self.tail_tokens:
            end = self.blocks * block_size + self.tail_tokens
            keys.append(prompt_tail_key(keys, tokens, namespace, block_size, end))
        return keys if keys and keys[-1] == self.last_block else None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class HandoverWaits:
    """Decode engine: since when each request waits for handed-over blocks,
    which requests waited in vain (they compute what is missing), and how
    long each wait took."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._since: dict[str, float] = {}
        self._gave_up: set[str] = set()
        self._ended: set[str] = set()

    def wait(self, req_id: str) -> bool | None:
        """True: wait on (ask again later); False: the wait timed out now;
        None: it timed out before."""
        if req_id in self._gave_up:
            return None
        now = time.monotonic()
        since = self._since.setdefault(req_id, now)
        if now - since < self.timeout_s:
            return True
        self._gave_up.add(req_id)
        return False

    def ended(self, req_id: str) -> float | None:
        """Seconds the request waited, when its wait ends now (0.0: the
        blocks were there at once); None when it ended before, so a request
        looked up again (preempted) is measured once."""
        if req_id in self._ended:
            return None
        self._ended.add(req_id)
        since = self._since.get(req_id)
        return 0.0 if since is None else time.monotonic() - since

    def forget(self, req_id: str) -> None:
        self._since.pop(req_id, None)
        self._gave_up.discard(req_id)
        self._ended.discard(req_id)


@dataclass
class _PrefillPlan:
    """Prefill engine: one request's handover."""

    prompt_tokens: int  # tokens handed over: the whole prompt
    tail: bytes | None  # key of the prompt's partial last block (None: no partial block)
    planned: bool = False  # the step that completes the prompt is planned


class Handovers:
    """Every P/D handover of one scheduler, in flight: what a prefill engine
    hands over and has planned, what a decode engine waits for and loads."""

    def __init__(self, block_size: int, timeout_s: float, stats: StatsCollector) -> None:
        self.block_size = block_size
        self.timeout_s = timeout_s
        self.stats = stats
        self._plans: dict[str, _PrefillPlan] = {}
        self._tail_loads: dict[str, bytes] = {}  # req -> key of the handed-over tail block
        self._waits = HandoverWaits(timeout_s)
        # req -> whether the blocks a prefill engine handed over are this engine's
        self._received: dict[str, bool] = {}

    # -- decode engine ---------------------------------------------------------
    def expected_keys(self, request: Any, ids: list[bytes], namespace: str) -> list[bytes] | None:
        """This engine's keys of the blocks a prefill engine handed over for
        the request (a partial last block's key last), or None."""
        handover = Handover.of(request, self.block_size)
        if handover is None:
            return None
        keys = handover.expected_keys(
            ids, request.prompt_token_ids or [], namespace, self.block_size
        )
        if request.request_id not in self._received:
            self.stats.add(handover_received=1)
        self._received[request.request_id] = keys is not None
        if keys is None:
            logger.warning(
                "request %s: the prefill engine's blocks are not this engine's (another "
                "model, hash_salt, hash_algo or block size?); computing the prompt here",
                request.request_id,
            )
            self.stats.add(handover_mismatches=1)
        return keys

    def loads_handover(self, req_id: str) -> bool:
        """Whether the request's loads are of blocks a prefill engine handed
        over (counted as such by the workers)."""
        return self._received.get(req_id, False)

    @staticmethod
    def stored_tail(
        expected: list[bytes] | None, ids: list[bytes], found: int, store: UcmKVStoreBase
    ) -> bytes | None:
        """The handed-over tail's key when the store has it and every full
        block before it was ``found``; store errors are the caller's."""
        if expected is None or len(expected) <= len(ids) or found != len(ids):
            return None
        return expected[-1] if store.lookup([expected[-1]])[0] else None

    def keep_waiting(
        self,
        req_id: str,
        expected: list[bytes],
        ids: list[bytes],
        found: int,
        tail: bytes | None,
    ) -> bool:
        """Whether the lookup of a request that found ``found`` of its
        ``expected`` blocks (and ``tail``) asks again later instead of
        computing the rest: until the blocks are all there or the wait
        times out (logged and counted once). The wait's length is recorded
        once, when it ends."""
        # A prefill answer may name fewer blocks than the prompt has
        # (saves that failed are left out); a tail comes only after all.
        has_tail = len(expected) > len(ids)
        complete = found >= min(len(expected), len(ids)) and (not has_tail or tail is not None)
        waiting = None if complete else self._waits.wait(req_id)
        if waiting:
            return True
        waited = self._waits.ended(req_id)
        if waited is not None:
            self.stats.add(handover_waits_ms=[waited * 1e3])
        if waiting is False:
            logger.warning(
                "request %s: the prefill engine's %d block(s) were not all in the store "
                "after %.1f s (found %d); computing the rest here",
                req_id,
                len(expected),
                self.timeout_s,
                found + (tail is not None),
            )
            self.stats.add(handover_timeouts=1)
        return False

    def set_tail_load(self, req_id: str, tail: bytes | None) -> None:
        """The handed-over tail block the request's lookup reports as found,
        loaded once vLLM allocates a block for it (None: none)."""
        if tail is None:
            self._tail_loads.pop(req_id, None)
        else:
            self._tail_loads[req_id] = tail

    def with_tail(self, req_id: str, ids: list[bytes], blocks: int) -> list[bytes]:
        """The request's keys once vLLM allocated ``blocks`` for what it
        found: the tail's key appended when it is among them."""
        tail = self._tail_loads.pop(req_id, None)
        if tail is not None and blocks == len(ids) + 1:
            return [*ids, tail]
        return ids

    # -- prefill engine --------------------------------------------------------
    def plan(self, request: Any, keys: list[bytes], namespace: str, save: bool) -> None:
        """After vLLM allocated the request's blocks: a request that asks for
        a handover (and may save) hands its whole prompt over, its partial
        last block under a key of its own."""
        self._plans.pop(request.request_id, None)
        if not save or not wants_handover(request):
            return
        B = self.block_size
        prompt = request.num_prompt_tokens
        if prompt // B > len(keys):
            return
        tail = None
        if prompt % B:
            tokens = request.prompt_token_ids or []
            tail = prompt_tail_key(keys, tokens, namespace, B, prompt)
        self._plans[request.request_id] = _PrefillPlan(prompt, tail)

    def cancel(self, req_id: str) -> None:
        """The request's handover is off (served by a sparse method, or
        preempted: planned again when it is allocated again)."""
        self._plans.pop(req_id, None)

    def due(self, req_id: str, tokens: int) -> bool:
        """Whether the step that brings the request to ``tokens`` completes
        the prompt to hand over (once per request)."""
        plan = self._plans.get(req_id)
        return plan is not None and 0 < plan.prompt_tokens <= tokens and not plan.planned

    def add_to_step(self, transfer: ReqTransfer, vllm_blocks: list[int]) -> bool:
        """Marks the step that completes the prompt (its workers wait for the
        request's saves, so the answer names readable blocks) and adds the
        tail's save; True when it did."""
        plan = self._plans[transfer.req_id]
        transfer.handover = True
        plan.planned = True
        tail_block = plan.prompt_tokens // self.block_size
        if plan.tail is None or tail_block >= len(vllm_blocks):
            return False
        transfer.save_keys.append(plan.tail)
        transfer.save_from.append(vllm_blocks[tail_block])
        return True

    def answer(self, req_id: str, keys: list[bytes], store: StoreHandle) -> dict[str, Any] | None:
        """The ``kv_transfer_params`` of a finished prefill request whose
        handover step was planned: the handed-over blocks the store shows
        (the step waited for their saves). A save that failed is left out,
        so the decode engine computes that part at once instead of waiting
        for blocks that never come."""
        plan = self._plans.get(req_id)
        if plan is None or not plan.planned:
            return None
        B = self.block_size
        full = plan.prompt_tokens // B
        keys = keys[:full]
        opened = store.get()
        found, tail = 0, None
        if opened is not None:
            try:
                found = opened.lookup_on_prefix(keys) + 1 if keys else 0
                if found == full and plan.tail is not None and opened.lookup([plan.tail])[0]:
                    tail = plan.tail
            except Exception as e:
                store.report_failure(e, "lookup")
                found, tail = 0, None
        missing = full - found + (plan.tail is not None and tail is None)
        if missing:
            logger.warning(
                "request %s: %d of the prompt's handed-over block(s) are not in the store (a "
                "save failed); the decode engine computes them",
                req_id,
                missing,
            )
            self.stats.add(handover_save_failures=1)
        if tail is not None:
            handover = Handover(full, plan.prompt_tokens % B, tail)
        elif found:
            handover = Handover(found, 0, keys[found - 1])
        else:
            return None
        self.stats.add(handover_answered=1)
        return handover.params()

    # -- both ------------------------------------------------------------------
    def forget(self, req_id: str) -> None:
        """The request finished."""
        self._plans.pop(req_id, None)
        self._tail_loads.pop(req_id, None)
        self._waits.forget(req_id)
        self._received.pop(req_id, None)


__all__ = [
    "Handover",
    "HandoverWaits",
    "Handovers",
    "prompt_tail_key",
    "tail_key",
    "wants_handover",
]
