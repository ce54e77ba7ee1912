"""Exactly-once, in-order bookkeeping of one epoch's batches (pure: no processes, no clock, no locks)."""
from __future__ import annotations

from typing import Any, Iterable

_ABSENT = object()

class Sequencer:
    """Which batch of one epoch is where, by sequence number ``seq`` (the batch's position in the
    sampler's order, from 0). The iterator that owns it holds its lock around every call.

    Invariant: every seq below ``issued`` is in exactly one of three states, and a seq only moves
    forward through them:

    - pending: handed out (to the worker pool, or to be run in this process: the ``local`` subset of
      ``pending``), no result taken yet;
    - ready: its result arrived and waits in ``ready`` for its turn;
    - delivered: handed to the caller, or known to carry no batch (``void``: an IterableDataset shard
      that ended), or delivered before the checkpoint this epoch resumed from (``skip``). Stored as a
      watermark, ``delivered_below`` (every seq under it is delivered), plus ``ahead``, the delivered
      seqs above it.

    Seqs at or above ``issued`` are not issued yet, except those in ``skip`` (delivered before a
    checkpoint; ``issue`` passes over them).

    Transitions, and nothing else:

    - ``issue``: not issued -> pending (a seq in ``skip`` -> delivered instead);
    - ``receive``: pending -> ready. A result for a seq that is not pending is a duplicate (a batch
      re-dispatched after its worker died while the first copy still ran) and is refused, so a batch
      is never delivered twice;
    - ``take_ready``: ready -> delivered; with ``in_order`` only the seq at the watermark, so batches
      reach the caller in sampler order whatever order they finish in; otherwise the oldest arrival;
    - ``complete_local``: pending -> delivered (run in this process and handed over at once);
    - ``void``: pending -> delivered, with no batch.

    Re-dispatch after a worker died never touches the states: a lost task stays pending and runs
    again (``lost`` finds them); whichever copy's result comes first is taken, later ones refused.
    """

    __slots__ = ("in_order", "issued", "delivered_below", "ahead", "skip", "pending", "local", "ready")

    def __init__(self, in_order: bool = True) -> None:
        self.in_order = in_order
        self.issued = 0                             # next seq to hand out
        self.delivered_below = 0                    # every seq below this was delivered
        self.ahead: set[int] = set()                # delivered seqs >= delivered_below
        self.skip: set[int] = set()                 # delivered before a checkpoint, not issued yet
        self.pending: dict[int, Any] = {}           # seq -> task: handed out, no result yet
        self.local: dict[int, Any] = {}             # seq -> task: pending, to run in this process
        self.ready: dict[int, Any] = {}             # seq -> result, in arrival order

    # ---- resume ------------------------------------------------------------------------------
    def resume_at(self, delivered_below: int, delivered_ahead: Iterable[int] = ()) -> None:
        """Start from a checkpoint: seqs below ``delivered_below`` and those in ``delivered_ahead``
        were delivered (before any seq is issued)."""
        if self.issued or self.pending or self.ready:
            raise RuntimeError("resume_at() on a sequencer that already issued seqs")
        self.issued = self.delivered_below = int(delivered_below)
        self.skip = {int(s) for s in delivered_ahead if int(s) >= self.delivered_below}

    def state(self) -> tuple[int, list[int]]:
        """(``delivered_below``, sorted delivered seqs above it) for a checkpoint."""
        return self.delivered_below, sorted(self.ahead | self.skip)

    # ---- transitions -------------------------------------------------------------------------
    def issue(self) -> int | None:
        """The next seq, now pending once the caller ``dispatch``es its task; None when that seq was
        delivered before the checkpoint (it is delivered now; the caller drops its indices)."""
        seq = self.issued
        self.issued = seq + 1
        if seq in self.skip:
            self.skip.discard(seq)
            self._delivered(seq)
            return None
        return seq

    def dispatch(self, seq: int, task) -> None:
        """Record the task of an issued seq as pending."""
        self.pending[seq] = task

    def receive(self, seq: int, result) -> bool:
        """A result for ``seq``; False (and nothing changes) unless ``seq`` was pending."""
        if self.pending.pop(seq, _ABSENT) is _ABSENT:
            return False
        self.local.pop(seq, None)
        self.ready[seq] = result
        return True

    def take_ready(self):
        """The next result the caller gets (delivered now), or None if it has not arrived yet
        (results are never None)."""
        if self.in_order:
            seq = self.delivered_below
            result = self.ready.pop(seq, _ABSENT)
            if result is _ABSENT:
                return None
        else:
            if not self.ready:
                return None
            seq = next(iter(self.ready))
            result = self.ready.pop(seq)
        self._delivered(seq)
        return result

    def complete_local(self, seq: int) -> bool:
        """A task run in this process is handed over: True (now delivered) if ``seq`` was still
        pending; False if a worker's result for it was received meanwhile (take that one)."""
        if self.pending.pop(seq, _ABSENT) is _ABSENT:
            return False
        self.local.pop(seq, None)
        self._delivered(seq)
        return True

    def void(self, seq: int) -> bool:
        """A pending seq turned out to have no batch; False if it was not pending."""
        if self.pending.pop(seq, _ABSENT) is _ABSENT:
            return False
        self.local.pop(seq, None)
        self._delivered(seq)
        return True

    def _delivered(self, seq: int) -> None:
        if seq == self.delivered_below:
            seq += 1
            ahead = self.ahead
            while seq in ahead:
                ahead.discard(seq)
                seq += 1
            self.delivered_below = seq
        else:
            self.ahead.add(seq)

    # ---- work to run in this process -----------------------------------------------------------
    def run_locally(self, task) -> None:
        """Mark a pending task to be run in this process (the pool was shrunk to 0 or is gone)."""
        if task.seq in self.pending:
            self.local[task.seq] = task

    def take_local(self):
        """The local task to run now (in order: only the one at the watermark), or None."""
        if not self.local:
            return None
        seq = self.delivered_below if self.in_order else min(self.local)
        return self.local.pop(seq, None)

    def reclaim_local(self) -> list:
        """Every local task, handed back to the pool (they stay pending), in seq order."""
        tasks = [self.local[s] for s in sorted(self.local)]
        self.local.clear()
        return tasks

    # ---- queries -----------------------------------------------------------------------------
    def lost(self, running: set[int], queued: set[int]) -> list:
        """Pending tasks that are not running in a live worker, not waiting in the pool's queue and not
        to be run here: after a worker died, the ones that died with it. In seq order."""
        return [t for s, t in sorted(self.pending.items())
                if s not in running and s not in queued and s not in self.local]

    @property
    def in_flight(self) -> int:
        """Pending seqs: handed out, result not taken."""
        return len(self.pending)

    @property
    def caught_up(self) -> bool:
        """Every issued seq below the watermark is delivered and nothing is ahead of it."""
        return self.delivered_below == self.issued

    def clear(self) -> None:
        """The epoch ended: forget every task and result (states no longer matter)."""
        self.pending.clear()
        self.local.clear()
        self.ready.clear()
