"""Properties of ``adloader._sequencer.Sequencer``: every batch delivered exactly once, in sampler order
when asked, whatever the interleaving of dispatches, resizes, worker deaths and re-dispatches.

The state machine drives a real ``Sequencer`` exactly as ``adloader.dataloader._MapIter`` does, around a
model of the worker pool that keeps the pool's guarantees and nothing more: one shared FIFO queue;
a worker takes a task (invisible to the main process until it publishes it as running, the window in
which a death makes a task look lost although it will still run), runs it and writes its result to its
own channel in order; the main process reads a channel whenever it likes, and before it hears of a
death it has read everything the dead worker wrote; ids below the target are replaced when they die;
ids at or above it finish their current task and leave.
"""
from __future__ import annotations

from collections import deque
from typing import NamedTuple

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from adloader._sequencer import Sequencer

pytestmark = pytest.mark.unit


class T(NamedTuple):
    seq: int


class _Worker:
    def __init__(self):
        self.task: T | None = None      # taken from the queue
        self.visible = False            # published in current_task (the main process can see it)
        self.written: deque = deque()   # results written, not read yet


class EpochMachine(RuleBasedStateMachine):
    """One map-style epoch of ``n`` batches; ``bound`` tasks in flight at most (prefetch x target)."""

    @initialize(n=st.integers(0, 24), in_order=st.booleans(), workers=st.integers(0, 3),
                per_worker=st.integers(1, 3), resumed=st.sets(st.integers(0, 23), max_size=6),
                resume_below=st.integers(0, 8))
    def start(self, n, in_order, workers, per_worker, resumed, resume_below):
        self.n = n
        self.seq = Sequencer(in_order)
        self.in_order = in_order
        self.per_worker = per_worker
        self.sampled = 0                # batches drawn from the "sampler"
        self.queue: deque[T] = deque()
        self.workers: dict[int, _Worker] = {}
        self.target = 0
        self.got: list[int] = []        # seqs handed to the caller, in order
        below = min(resume_below, n)
        self.before = set(range(below)) | {s for s in resumed if below <= s < n}
        if self.before:
            # a checkpoint: the sampler replays the delivered prefix without loading it
            self.sampled = below
            self.seq.resume_at(below, sorted(s for s in self.before if s >= below))
        self._resize(workers)
        self._fill()

    # ---- what _MapIter does --------------------------------------------------------------------
    def _next_task(self) -> T | None:
        while self.sampled < self.n:
            self.sampled += 1
            s = self.seq.issue()
            if s is None:
                continue
            task = T(s)
            self.seq.dispatch(s, task)
            return task
        return None

    def _fill(self):
        if self.target == 0:
            return
        while self.seq.in_flight < self.per_worker * self.target:
            task = self._next_task()
            if task is None:
                return
            self.queue.append(task)

    def _redispatch(self, tasks):
        for task in sorted(tasks, key=lambda t: t.seq):
            if self.target > 0:
                self.queue.append(task)
            else:
                self.seq.run_locally(task)

    def _resize(self, n):
        self.target = n
        for wid in range(n):
            self.workers.setdefault(wid, _Worker())
        if n > 0:
            self._redispatch(self.seq.reclaim_local())
            self._fill()
        else:
            while self.queue:
                self.seq.run_locally(self.queue.popleft())

    def _read(self, wid):
        w = self.workers[wid]
        while w.written:
            s = w.written.popleft()
            self.seq.receive(s, ("batch", s))

    def _deliver(self, s):
        self.got.append(s)

    # ---- the pool's side ----------------------------------------------------------------------
    def _idle(self):
        return sorted(w for w, wk in self.workers.items() if wk.task is None and w < self.target)

    @precondition(lambda self: self.queue and self._idle())
    @rule(data=st.data())
    def worker_takes_a_task(self, data):
        wid = data.draw(st.sampled_from(self._idle()))
        self.workers[wid].task = self.queue.popleft()

    def _taken_hidden(self):
        return sorted(w for w, wk in self.workers.items() if wk.task is not None and not wk.visible)

    @precondition(lambda self: self._taken_hidden())
    @rule(data=st.data())
    def worker_publishes_its_task(self, data):
        self.workers[data.draw(st.sampled_from(self._taken_hidden()))].visible = True

    def _running(self):
        return sorted(w for w, wk in self.workers.items() if wk.task is not None and wk.visible)

    @precondition(lambda self: self._running())
    @rule(data=st.data())
    def worker_finishes(self, data):
        wid = data.draw(st.sampled_from(self._running()))
        w = self.workers[wid]
        w.written.append(w.task.seq)
        w.task, w.visible = None, False
        if wid >= self.target and not w.written:
            del self.workers[wid]

    def _unread(self):
        return sorted(w for w, wk in self.workers.items() if wk.written)

    @precondition(lambda self: self._unread())
    @rule(data=st.data())
    def main_reads_results(self, data):
        wid = data.draw(st.sampled_from(self._unread()))
        self._read(wid)
        if wid >= self.target and self.workers[wid].task is None:
            del self.workers[wid]

    @precondition(lambda self: self.workers)
    @rule(data=st.data())
    def worker_dies(self, data):
        wid = data.draw(st.sampled_from(sorted(self.workers)))
        self._read(wid)                             # the pool reads what it wrote before reporting
        del self.workers[wid]
        if wid < self.target:
            self.workers[wid] = _Worker()           # the replacement
        # _MapIter._on_worker_death: running snapshot, then the queue, then every written result
        running = {wk.task.seq for wk in self.workers.values() if wk.task is not None and wk.visible}
        queued = {t.seq: t for t in self.queue if t.seq in self.seq.pending}
        self.queue.clear()
        for other in list(self.workers):
            self._read(other)
        lost = self.seq.lost(running, set(queued))
        # what really died with the worker: pending, held by no live worker, in no queue, not local
        held = {wk.task.seq for wk in self.workers.values() if wk.task is not None}
        dead = {s for s in self.seq.pending if s not in held and s not in queued and s not in self.seq.local}
        hidden = {wk.task.seq for wk in self.workers.values() if wk.task is not None and not wk.visible}
        assert dead <= {t.seq for t in lost} <= dead | hidden     # re-run only what may be lost
        self._redispatch(lost + [t for s, t in queued.items() if s in self.seq.pending])

    @rule(n=st.integers(0, 3))
    def resize(self, n):
        self._resize(n)
        for wid in [w for w, wk in self.workers.items() if w >= n and wk.task is None and not wk.written]:
            del self.workers[wid]

    # ---- the caller's side: one next() that does not block ---------------------------------------
    @rule()
    def caller_takes_a_batch(self):
        """_MapIter._next_batch up to the point where it would wait on the pool."""
        ready = self.seq.take_ready()
        if ready is not None:
            self._deliver(ready[1])
            self._fill()
            return
        task = self._take_local()
        if task is None and not self.seq.in_flight:
            self._fill()
            if not self.seq.in_flight:
                return                  # exhausted: the epoch ends
            task = self._take_local()
        if task is not None:
            assert self.seq.complete_local(task.seq)
            self._deliver(task.seq)
            self._fill()

    def _take_local(self):
        task = self.seq.take_local()
        if task is None and self.target == 0 and (not self.in_order or self.seq.caught_up):
            task = self._next_task()
        return task

    # ---- invariants -------------------------------------------------------------------------
    @invariant()
    def every_issued_seq_is_in_exactly_one_state(self):
        seq = self.seq
        delivered = set(range(seq.delivered_below)) | seq.ahead
        pending, ready = set(seq.pending), set(seq.ready)
        assert not (pending & ready) and not (pending & delivered) and not (ready & delivered)
        assert set(range(seq.issued)) == pending | ready | delivered
        assert set(seq.local) <= pending
        assert all(s >= seq.delivered_below for s in seq.ahead)
        assert all(s >= seq.issued for s in seq.skip)

    @invariant()
    def delivered_at_most_once_and_in_order(self):
        assert len(set(self.got)) == len(self.got)
        assert not set(self.got) & self.before
        if self.in_order:
            assert self.got == sorted(self.got)
            expected = [s for s in range(self.seq.delivered_below) if s not in self.before]
            assert self.got == expected

    def teardown(self):
        """Let everything finish with fair turns: every batch arrives exactly once."""
        if not hasattr(self, "seq"):
            return
        for _ in range(20 * (self.n + 5)):
            if len(self.got) + len(self.before) == self.n:
                break
            for wid, wk in list(self.workers.items()):
                if wk.task is None and self.queue and wid < self.target:
                    wk.task = self.queue.popleft()
                if wk.task is not None:
                    wk.written.append(wk.task.seq)
                    wk.task, wk.visible = None, False
                self._read(wid)
            self.caller_takes_a_batch()
        assert sorted(self.got) == sorted(set(range(self.n)) - self.before)
        if self.in_order:
            assert self.got == sorted(self.got)


EpochMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=60, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
test_sequencer_exactly_once_under_any_interleaving = EpochMachine.TestCase


def test_duplicate_result_after_redispatch_is_refused():
    seq = Sequencer()
    s = seq.issue()
    seq.dispatch(s, T(s))
    assert seq.lost(running=set(), queued=set()) == [T(0)]     # its worker died before publishing it
    assert seq.receive(0, "first")                              # ... yet it ran: the first copy wins
    assert not seq.receive(0, "second")
    assert seq.take_ready() == "first" and seq.take_ready() is None
    assert seq.caught_up


def test_void_and_out_of_order_delivery():
    seq = Sequencer(in_order=True)
    for _ in range(3):
        s = seq.issue()
        seq.dispatch(s, T(s))
    seq.receive(2, "two")
    assert seq.take_ready() is None             # 0 and 1 first
    assert seq.void(0) and not seq.void(0)
    assert seq.take_ready() is None
    seq.receive(1, "one")
    assert [seq.take_ready(), seq.take_ready()] == ["one", "two"]
    unordered = Sequencer(in_order=False)
    for _ in range(2):
        s = unordered.issue()
        unordered.dispatch(s, T(s))
    unordered.receive(1, "one")
    assert unordered.take_ready() == "one" and unordered.state() == (0, [1])


def test_resume_skips_what_was_delivered():
    seq = Sequencer(in_order=False)
    seq.resume_at(2, [4, 6, 1])
    issued = [seq.issue() for _ in range(6)]
    assert issued == [2, 3, None, 5, None, 7]
    assert seq.state() == (2, [4, 6])
    with pytest.raises(RuntimeError):
        seq.resume_at(0)
