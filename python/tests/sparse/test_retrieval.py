"""The re-selection cadence, delta planning and the per-layer state machine."""

from __future__ import annotations

import threading

import pytest
import torch

from ucm.sparse.offload.retrieval import (
    InlineExecutor,
    LoadOp,
    OffloadRetrieval,
    RetrievalCadence,
    SwapSlots,
    ThreadExecutor,
)


def test_esa_cadence_matches_original_residues() -> None:
    c = RetrievalCadence.esa(5)
    submits = [s for s in range(1, 20) if c.submits_at(s)]
    assert submits == [2, 7, 12, 17]  # s = 2 (mod 5)
    assert [s + c.collect_delay for s in submits] == [5, 10, 15, 20]  # s = 0 (mod 5)
    assert RetrievalCadence.esa(1).collect_delay == 1
    assert [s for s in range(1, 6) if RetrievalCadence.esa(1).submits_at(s)] == [2, 3, 4, 5]


def test_kvstar_cadence_is_delayed_by_one_stride() -> None:
    c = RetrievalCadence.kvstar(4)
    submits = [s for s in range(1, 17) if c.submits_at(s)]
    assert submits == [4, 8, 12, 16]
    assert c.collect_delay == 4  # first delta load at step 8 = 2 strides
    with pytest.raises(ValueError):
        RetrievalCadence(stride=0, first_submit=2, collect_delay=1)


def test_swap_slots_plan_keeps_resident_blocks() -> None:
    s = SwapSlots(3)
    ops = s.plan([10, 4, 7])
    assert ops == [LoadOp(0, 4), LoadOp(1, 7), LoadOp(2, 10)]
    s.begin(ops)
    assert s.active_slots() == []
    assert s.complete() == ops
    assert s.active_slots() == [0, 1, 2]
    ops = s.plan([4, 10, 12])  # 7 dropped, 12 takes its slot
    assert ops == [LoadOp(1, 12)]
    s.begin(ops)
    assert s.active_slots() == [0, 2] and s.contents() == [4, 12, 10]
    assert s.plan([4, 10, 12]) == []  # pending loads count as resident
    with pytest.raises(ValueError):
        s.plan([1, 2, 3, 4])


def _scripted(selections: dict[int, list[int]]):
    """A select_fn that returns the selection keyed by the query's value."""

    def select(q: torch.Tensor) -> list[int]:
        key = int(q.reshape(-1)[-1].item())
        return selections[key]

    return select


def test_offload_retrieval_step_actions_esa() -> None:
    # the query of step s is filled with s; selections change at steps 2 and 7
    sel = {s: [1, 2] for s in range(1, 30)}
    sel[2] = [2, 3]
    sel[7] = [5, 3]
    r = OffloadRetrieval(2, RetrievalCadence.esa(5), _scripted(sel), InlineExecutor())
    q = lambda s: torch.full((4, 8), float(s))  # noqa: E731
    a = r.begin_step(1, q(1))
    assert a.sync and a.loads == [LoadOp(0, 1), LoadOp(1, 2)] and a.active_slots == [0, 1]
    for s in (2, 3, 4):
        a = r.begin_step(s, q(s))
        assert a.loads == [] and a.active_slots == [0, 1]
        assert a.submitted == (s == 2)
    a = r.begin_step(5, q(5))  # collect the step-2 selection: 1 -> 3 in slot 0
    assert a.collected and a.loads == [LoadOp(0, 3)] and not a.sync
    assert a.active_slots == [1]  # slot 0 is being loaded
    a = r.begin_step(6, q(6))
    assert a.wait_loads == [LoadOp(0, 3)] and a.active_slots == [0, 1]
    a = r.begin_step(7, q(7))
    assert a.submitted
    a = r.begin_step(10, q(10))
    assert a.loads == [LoadOp(1, 5)]  # 2 -> 5; 3 stays in slot 0
    assert r.swap.contents() == [3, 5]
    assert (r.num_selections, r.num_blocks_loaded) == (3, 4)


def test_offload_retrieval_kvstar_groups_and_initial_queries() -> None:
    seen: list[tuple[int, ...]] = []

    def select(qs: torch.Tensor) -> list[int]:
        seen.append(tuple(int(x) for x in qs[:, 0, 0].tolist()))
        return [0]

    init = torch.full((3, 2, 4), -1.0)
    r = OffloadRetrieval(1, RetrievalCadence.kvstar(3), select, group_size=3, initial_queries=init)
    for s in range(1, 10):
        r.begin_step(s, torch.full((2, 4), float(s)))
    # step 1: prefill group; then groups of the last 3 decode queries at steps 3, 6, 9
    assert seen == [(-1, -1, -1), (1, 2, 3), (4, 5, 6), (7, 8, 9)]


def test_thread_executor_runs_selection_off_thread() -> None:
    main = threading.get_ident()
    threads: list[int] = []

    def select(q: torch.Tensor) -> list[int]:
        threads.append(threading.get_ident())
        return [int(q.sum().item()) % 4]

    ex = ThreadExecutor()
    try:
        r = OffloadRetrieval(1, RetrievalCadence.esa(2), select, ex)
        for s in range(1, 8):
            r.begin_step(s, torch.tensor([float(s)]))
    finally:
        ex.shutdown()
    assert threads[0] == main  # the synchronous first selection
    assert threads[1:] and all(t != main for t in threads[1:])


def test_cancel_drops_pending_selection() -> None:
    r = OffloadRetrieval(1, RetrievalCadence.esa(5), lambda q: [0])
    r.begin_step(1, torch.zeros(1))
    r.begin_step(2, torch.zeros(1))
    r.cancel()
    assert not r.begin_step(5, torch.zeros(1)).collected
