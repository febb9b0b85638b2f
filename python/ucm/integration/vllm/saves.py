"""Saves in flight, per request (worker side).

Saves never block the forward pass: a reaper thread waits for them (and a
stager thread first waits for the device copy into a staging buffer, where
there is one). vLLM keeps a finished request's blocks until the connector
reports the request in ``get_finished``, so :class:`SaveTracker` reports a
request only once every save that reads its blocks is done, and lets the
worker wait for a preempted request's saves before vLLM hands its blocks on.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from ucm.integration.vllm.transfer import PendingSave


@dataclass
class SaveJob:
    """One request's save for some layers."""

    req_id: str
    blocks: int  # vLLM blocks completed by this save (0 for non-final layers)
    nbytes: int
    t0: float
    pending: PendingSave


class SaveTracker:
    """Waits for submitted saves and tells which requests are done saving.

    ``done(job, error)`` is called on the reaper thread for every finished
    save (error None on success), before the job stops counting as pending.
    """

    def __init__(self, done: Callable[[SaveJob, BaseException | None], None]) -> None:
        self._done = done
        self._cv = threading.Condition()
        self._pending: dict[str, int] = defaultdict(int)
        self._saving: set[str] = set()  # requests with saves planned
        self._finishing: set[str] = set()
        self._inflight = 0
        self._reap_q: queue.Queue[SaveJob | None] = queue.Queue()
        self._stage_q: queue.Queue[SaveJob | None] = queue.Queue()
        self._reaper = threading.Thread(target=self._reap_loop, name="ucm-save-reaper", daemon=True)
        self._reaper.start()
        self._stager: threading.Thread | None = None

    def expect(self, req_id: str) -> None:
        """The request has saves planned: it is reported finished only after them."""
        with self._cv:
            self._saving.add(req_id)

    def add(self, job: SaveJob) -> None:
        """A save whose dump was submitted, or is waiting for its device copy."""
        with self._cv:
            self._pending[job.req_id] += 1
            self._inflight += 1
        if job.pending.copy_done is not None:
            if self._stager is None:
                self._stager = threading.Thread(
                    target=self._stage_loop, name="ucm-save-stager", daemon=True
                )
                self._stager.start()
            self._stage_q.put(job)  # submitted once the device copy is done
        else:
            self._reap_q.put(job)

    def wait(self, req_ids: set[str] | None, timeout: float) -> bool:
        """Waits until the saves of these requests (None: all) are done; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                busy = (
                    self._inflight > 0
                    if req_ids is None
                    else any(self._pending.get(r, 0) > 0 for r in req_ids)
                )
                if not busy:
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)

    def finished(self, finished_req_ids: set[str], idle: bool) -> set[str] | None:
        """Of the requests vLLM finished (now or before), those whose saves are
        done, each reported once; ``idle``: nothing else to do this step."""
        with self._cv:
            for r in finished_req_ids:
                if r in self._saving:
                    self._finishing.add(r)
            if not self._finishing:
                return None
            done = {r for r in self._finishing if self._pending.get(r, 0) <= 0}
            if not done and idle:
                # Nothing else to do this step: wait a little rather than spin.
                self._cv.wait(0.005)
                done = {r for r in self._finishing if self._pending.get(r, 0) <= 0}
            for r in done:
                self._finishing.discard(r)
                self._saving.discard(r)
                self._pending.pop(r, None)
        return done or None

    def pending(self, req_id: str) -> int:
        """Saves of the request still in flight."""
        with self._cv:
            return self._pending.get(req_id, 0)

    def close(self) -> None:
        """Stops the threads (after :meth:`wait`)."""
        if self._stager is not None:
            self._stage_q.put(None)
            self._stager.join(timeout=5)
        self._reap_q.put(None)
        self._reaper.join(timeout=5)

    def _stage_loop(self) -> None:
        while True:
            job = self._stage_q.get()
            if job is None:
                return
            job.pending.submit()
            self._reap_q.put(job)

    def _reap_loop(self) -> None:
        while True:
            job = self._reap_q.get()
            if job is None:
                return
            self._done(job, job.pending.wait())
            with self._cv:
                self._pending[job.req_id] -= 1
                self._inflight -= 1
                self._cv.notify_all()


__all__ = ["SaveJob", "SaveTracker"]
