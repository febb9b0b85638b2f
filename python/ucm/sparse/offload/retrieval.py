"""Retrieval state machine shared by the offloading methods (ESA, KVStar).

One :class:`OffloadRetrieval` drives one (request, layer). Its device KV has
``k`` *swap slots* (see :mod:`ucm.sparse.offload.plan`), each holding one middle
block loaded from the UCM store. Every decode step the driver (the vLLM hook
layer, a test or a benchmark) calls :meth:`OffloadRetrieval.begin_step` with
the layer's query, before the layer's attention, and carries out the returned
:class:`StepActions`:

1. ``wait_loads``: loads issued in the previous step; wait for them now (they
   become readable this step);
2. ``loads``: ``(slot, logical block)`` loads to issue now. When ``sync`` is
   set (first decode step) they must complete before the attention; otherwise
   they run during this step and their slots are left out of
   ``active_slots``, so attention never reads a slot being overwritten;
3. ``active_slots``: swap slots the attention reads this step.

Re-selection follows a :class:`RetrievalCadence`: a selection is *submitted*
(to an executor, so scoring overlaps decoding) on some steps and *collected*
``collect_delay`` steps later, when only the **delta** is loaded: blocks that
stay selected keep their slots, new ones take the slots of dropped ones.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


class Executor(Protocol):
    def submit(self, fn: Callable[..., Any], /, *args: Any) -> Future: ...

    def shutdown(self, wait: bool = True) -> None: ...


class InlineExecutor:
    """Runs each submission at once (deterministic; the default in tests).

    On a GPU the scoring kernels are asynchronous anyway, so inline
    submission still overlaps with the host.
    """

    def submit(self, fn: Callable[..., Any], /, *args: Any) -> Future:
        fut: Future = Future()
        try:
            fut.set_result(fn(*args))
        except BaseException as e:
            fut.set_exception(e)
        return fut

    def shutdown(self, wait: bool = True) -> None:
        pass


class ThreadExecutor:
    """Runs submissions on one background thread (scoring overlaps decoding)."""

    def __init__(self, name: str = "ucm-sparse-retrieval") -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], /, *args: Any) -> Future:
        with self._lock:
            return self._pool.submit(fn, *args)

    def shutdown(self, wait: bool = True) -> None:
        self._pool.shutdown(wait=wait)


@dataclass(frozen=True)
class RetrievalCadence:
    """When re-selections are submitted and collected (decode steps count from 1).

    Step 1 always selects synchronously. After that a selection is submitted
    at steps ``first_submit + i * stride`` and collected ``collect_delay``
    steps later; its delta loads are waited for one step after that.
    """

    stride: int
    first_submit: int
    collect_delay: int

    def __post_init__(self) -> None:
        if self.stride < 1 or self.first_submit < 2 or self.collect_delay < 1:
            raise ValueError(f"invalid cadence {self}")

    @classmethod
    def esa(cls, stride: int) -> RetrievalCadence:
        """Original ESA: submit at ``s = 2 (mod S)``, collect at ``s = 0 (mod S)``."""
        return cls(stride=stride, first_submit=2, collect_delay=max(1, stride - 2))

    @classmethod
    def kvstar(cls, stride: int) -> RetrievalCadence:
        """Original KVStar: submit every ``S`` steps with the last ``S`` queries,
        load the result one stride later (delayed delta loads)."""
        return cls(stride=stride, first_submit=max(2, stride), collect_delay=stride)

    def submits_at(self, step: int) -> bool:
        return step >= self.first_submit and (step - self.first_submit) % self.stride == 0


@dataclass(frozen=True)
class LoadOp:
    """Load logical prompt block ``block`` into swap slot ``slot``."""

    slot: int
    block: int


@dataclass
class StepActions:
    """What the driver does for one (request, layer, step); see the module doc."""

    wait_loads: list[LoadOp] = field(default_factory=list)
    loads: list[LoadOp] = field(default_factory=list)
    sync: bool = False
    active_slots: list[int] = field(default_factory=list)
    submitted: bool = False
    collected: bool = False


class SwapSlots:
    """Which logical block each swap slot holds, and which are being loaded."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.resident: list[int] = [-1] * num_slots
        self.pending: dict[int, int] = {}

    def contents(self) -> list[int]:
        """Block each slot holds once pending loads finish (-1: empty)."""
        out = list(self.resident)
        for slot, block in self.pending.items():
            out[slot] = block
        return out

    def plan(self, selected: Sequence[int]) -> list[LoadOp]:
        """Delta loads that make the slots hold ``selected`` (kept blocks stay put)."""
        want = sorted(set(int(b) for b in selected))
        if len(want) > self.num_slots:
            raise ValueError(f"{len(want)} blocks selected for {self.num_slots} slots")
        contents = self.contents()
        kept = {b for b in contents if b in set(want)}
        free = [s for s, b in enumerate(contents) if b not in kept or b < 0]
        new = [b for b in want if b not in kept]
        return [LoadOp(slot, block) for slot, block in zip(free, new, strict=False)]

    def begin(self, ops: Sequence[LoadOp]) -> None:
        for op in ops:
            self.pending[op.slot] = op.block
            self.resident[op.slot] = -1

    def complete(self) -> list[LoadOp]:
        done = [LoadOp(s, b) for s, b in sorted(self.pending.items())]
        for s, b in self.pending.items():
            self.resident[s] = b
        self.pending.clear()
        return done

    def active_slots(self) -> list[int]:
        return [s for s, b in enumerate(self.resident) if b >= 0]


SelectFn = Callable[[torch.Tensor], list[int]]


class OffloadRetrieval:
    """Selection state of one (request, layer); see the module doc.

    Args:
        num_slots: ``k``, swap slots (blocks kept from the middle).
        cadence: when re-selections happen.
        select_fn: maps a query context to exactly ``num_slots`` logical
            middle-block indices (called on the executor's thread for
            asynchronous re-selections).
        executor: runs asynchronous re-selections.
        group_size: queries per query context: 1 (ESA: the current query) or
            ``retrieval_stride`` (KVStar: the last queries, stacked ``[X, ...]``).
        initial_queries: query context of the synchronous first selection
            (KVStar: the last prefill queries); default: the step-1 context.
    """

    def __init__(
        self,
        num_slots: int,
        cadence: RetrievalCadence,
        select_fn: SelectFn,
        executor: Executor | None = None,
        group_size: int = 1,
        initial_queries: torch.Tensor | None = None,
    ) -> None:
        self.swap = SwapSlots(num_slots)
        self.cadence = cadence
        self.select_fn = select_fn
        self.executor = executor or InlineExecutor()
        self.group_size = group_size
        self.initial_queries = initial_queries
        self._history: collections.deque[torch.Tensor] = collections.deque(maxlen=group_size)
        self._future: Future | None = None
        self._collect_step = 0
        self._started = False
        self.num_selections = 0
        self.num_blocks_loaded = 0

    def _context(self) -> torch.Tensor:
        return torch.stack(list(self._history)) if self.group_size > 1 else self._history[-1]

    def begin_step(self, step: int, query: torch.Tensor) -> StepActions:
        """Advances to decode ``step`` (1-based) with this layer's ``query``."""
        actions = StepActions()
        if self.swap.pending:
            actions.wait_loads = self.swap.complete()
        self._history.append(query.detach().clone())
        if not self._started:
            ctx = self.initial_queries if self.initial_queries is not None else self._context()
            ops = self.swap.plan(self.select_fn(ctx))
            self.swap.begin(ops)
            self.swap.complete()
            actions.loads, actions.sync = ops, True
            self._started = True
            self.num_selections += 1
            self.num_blocks_loaded += len(ops)
        else:
            if self._future is not None and step >= self._collect_step:
                selected = self._future.result()
                self._future = None
                ops = self.swap.plan(selected)
                self.swap.begin(ops)
                actions.loads, actions.collected = ops, True
                self.num_selections += 1
                self.num_blocks_loaded += len(ops)
            if self._future is None and self.cadence.submits_at(step):
                self._future = self.executor.submit(self.select_fn, self._context())
                self._collect_step = step + self.cadence.collect_delay
                actions.submitted = True
        actions.active_slots = self.swap.active_slots()
        return actions

    def cancel(self) -> None:
        """Drops a pending selection (request finished or preempted)."""
        if self._future is not None:
            self._future.cancel()
            self._future = None
