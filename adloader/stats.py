"""Loader instrumentation: monotonic counters kept on the hot path, turned into rates in one place.

Hot path (``DataLoader.__next__`` and result handling) only adds to plain float/int attributes of
``LoaderCounters``; a step costs two ``time.perf_counter()`` calls, a few additions and one comparison
with the loop's pace (``LoaderCounters.add_step``: a pause of the loop is not a step's compute). Rates are
computed on demand in ``RateWindow`` from snapshots of the counters (monotonic clock, negative deltas
clamped to 0), so readers (the agent client, autotune) never see raw counters they must difference.

Units: ``_s`` seconds (float), counts are ints. Every counter (``COUNTER_KEYS``) is monotonic since the
loader was created; the gauges (``GAUGE_KEYS``) say what holds now.
"""
from __future__ import annotations

import threading
import time
from collections import deque

#: Keys of ``DataLoader.stats()`` before its rates and memory (the BRIEF's interface; tests check the dict
#: has exactly these): counters, monotonic since the loader was created (``COUNTER_KEYS``: what a reader
#: differences), and gauges, what holds now (``GAUGE_KEYS``: the epoch, the worker counts, the batch size,
#: how long the loop has been away, the dataset's kind).
STATS_KEYS = (
    "steps", "samples", "batches", "epoch", "workers", "live_workers", "max_workers",
    "requested_workers", "batch_size", "data_wait_s", "compute_s", "worker_cpu_s", "worker_wall_s",
    "worker_runq_s", "worker_blocked_s", "resizes", "worker_restarts", "redispatched", "uptime_s",
    "main_cpu_s", "main_runq_s", "paused_s", "away_s", "dataset_kind",
)
GAUGE_KEYS = ("epoch", "workers", "live_workers", "max_workers", "requested_workers", "batch_size", "away_s",
              "dataset_kind")
COUNTER_KEYS = tuple(k for k in STATS_KEYS if k not in GAUGE_KEYS)
RATE_KEYS = (
    "window_s", "samples_per_s", "steps_per_s", "data_wait_frac", "compute_s_per_step",
    "data_wait_s_per_step", "cpu_s_per_batch", "wall_s_per_batch", "runq_s_per_batch",
    "blocked_s_per_batch", "worker_cpu_cores",
)

# counters that rates are computed from (snapshot order)
_SNAP_FIELDS = ("steps", "samples", "batches", "data_wait_s", "compute_s", "worker_cpu_s",
                "worker_wall_s", "worker_runq_s", "worker_blocked_s")


# A pause of the training loop between two next() calls (a validation pass or a checkpoint save every N
# steps, a debugger stop, a hung trainer): the loader sees one step of many times the loop's pace. Such a
# step's time beyond the pace is ``paused_s``, not ``compute_s`` (``LoaderCounters.add_step``): counted as
# compute, a 25 s checkpoint was one step of 25 s among 0.1 s ones, and the agent's and the tuner's
# curves read the job's GPU step as 10-40% slower (and its loader as needing that much less) for tens of
# seconds after every pause: a job validating every 30 s lost a worker after each pause.
PAUSE_FACTOR = 10.0     # a step this many times the loop's pace (the mean of its recent steps) ...
PAUSE_MIN_S = 1.0       # ... and at least this long holds a pause
PACE_STEPS = 8          # steps that set the pace before any step is taken for a pause
PACE_WEIGHT = 0.1       # the pace: an exponential mean of the steps, each new one weighing this


class LoaderCounters:
    """Monotonic totals for one loader. Written by the iterating thread (and result handling),
    read from any thread; single attribute updates are atomic under the GIL, which is all readers need
    (a snapshot may mix two adjacent steps, never a torn value)."""

    __slots__ = ("steps", "samples", "batches", "data_wait_s", "compute_s", "worker_cpu_s",
                 "worker_wall_s", "worker_runq_s", "worker_blocked_s", "resizes", "worker_restarts",
                 "redispatched", "created_mono", "step_cpu_s", "paused_s", "pace_s", "paced_steps", "left_t")

    def __init__(self) -> None:
        self.steps = 0
        self.samples = 0
        self.batches = 0
        self.data_wait_s = 0.0
        self.compute_s = 0.0
        self.worker_cpu_s = 0.0
        self.worker_wall_s = 0.0
        self.worker_runq_s = 0.0
        self.worker_blocked_s = 0.0
        self.resizes = 0
        self.worker_restarts = 0
        self.redispatched = 0
        self.created_mono = time.monotonic()
        self.step_cpu_s = 0.0       # the training process's CPU (all its threads) during its steps (ISSUE 11)
        self.paused_s = 0.0         # time between next() calls that was no step: pauses of the loop (add_step)
        self.pace_s = 0.0           # the loop's pace: the exponential mean of its steps (pauses left out)
        self.paced_steps = 0        # steps that set it
        self.left_t: float | None = None   # perf_counter when the loop last left next() (a batch returned, the
                                           # epoch's end, an error); None inside next() and before the first call

    def away_s(self, now: float) -> float:
        """How long the training loop has been away from this loader at ``now`` (``time.perf_counter``):
        since it last left ``next()``, 0 while a ``next()`` call is in progress (it waits for data) and
        before its first. Between two steps it is a part of one step; a validation pass, a checkpoint save,
        a debugger stop or the time between two epochs makes it long. Unlike ``paused_s``, it is known
        while the pause lasts (the agent hands a long-away job's cores to its neighbours meanwhile)."""
        t = self.left_t
        return max(0.0, now - t) if t is not None else 0.0

    def add_step(self, step_s: float, cpu_s: float) -> None:
        """One step's time between two next() calls and the training process's CPU over it. Once
        ``PACE_STEPS`` steps set the loop's pace, a step of ``PAUSE_FACTOR`` times it and at least
        ``PAUSE_MIN_S`` is a pace's worth of compute and the rest ``paused_s`` (its CPU scaled alike),
        and moves the pace as a step of ``PAUSE_FACTOR`` times it would: a pause barely moves it, and a
        lasting change of the step (a backbone unfrozen: 0.1 s -> 1.5 s) is compute again from its second
        step (from a 100x change, its fifth). Every other step is compute and moves the pace."""
        pace = self.pace_s
        if self.paced_steps >= PACE_STEPS and step_s >= max(PAUSE_MIN_S, PAUSE_FACTOR * pace):
            self.compute_s += pace
            self.paused_s += step_s - pace
            self.step_cpu_s += cpu_s * pace / step_s
            self.pace_s = pace + PACE_WEIGHT * (PAUSE_FACTOR * pace - pace)
            return
        self.compute_s += step_s
        self.step_cpu_s += cpu_s
        self.pace_s = step_s if self.paced_steps == 0 else pace + PACE_WEIGHT * (step_s - pace)
        self.paced_steps += 1

    def add_batch_timing(self, cpu_s: float, wall_s: float, runq_ns: int) -> None:
        """One batch finished by a worker (or in-process): blocked = wall - cpu - run-queue delay,
        clamped at 0 (the three clocks are read at slightly different instants)."""
        runq_s = runq_ns * 1e-9
        self.batches += 1
        self.worker_cpu_s += cpu_s
        self.worker_wall_s += wall_s
        self.worker_runq_s += runq_s
        blocked = wall_s - cpu_s - runq_s
        if blocked > 0.0:
            self.worker_blocked_s += blocked

    def snapshot(self) -> tuple:
        return tuple(getattr(self, f) for f in _SNAP_FIELDS)


class RateWindow:
    """Rolling rates over the last ``window_s`` seconds from counter snapshots.

    ``maybe_record(now)`` is called on the hot path (one float compare most of the time) and records a
    snapshot at most every ``every_s``; ``rates(now)`` differences the current counters against the
    oldest snapshot still inside the window. Negative deltas (never expected) are clamped to 0."""

    def __init__(self, counters: LoaderCounters, window_s: float = 5.0, every_s: float = 0.25) -> None:
        self.counters = counters
        self.window_s = window_s
        self.every_s = every_s
        self._snaps: deque = deque()
        self._next_record = 0.0
        self._lock = threading.Lock()

    def maybe_record(self, now: float) -> None:
        if now < self._next_record:
            return
        self._next_record = now + self.every_s
        snap = (now, self.counters.snapshot())
        with self._lock:
            self._snaps.append(snap)
            # keep one snapshot older than the window so the window is always covered
            while len(self._snaps) > 2 and now - self._snaps[1][0] > self.window_s:
                self._snaps.popleft()

    def rates(self, now: float) -> dict:
        self.maybe_record(now)
        cur = self.counters.snapshot()
        with self._lock:
            base = None
            for t, snap in self._snaps:
                if now - t <= self.window_s:
                    base = (t, snap)
                    break
            if base is None and self._snaps:
                base = self._snaps[-1]
        if base is None or now - base[0] <= 0:
            dt, d = 0.0, dict.fromkeys(_SNAP_FIELDS, 0)
        else:
            dt = now - base[0]
            d = {f: max(0, c - b) for f, c, b in zip(_SNAP_FIELDS, cur, base[1])}
        steps, batches = d["steps"], d["batches"]
        step_time = d["data_wait_s"] + d["compute_s"]
        return {
            "window_s": dt,
            "samples_per_s": d["samples"] / dt if dt > 0 else 0.0,
            "steps_per_s": steps / dt if dt > 0 else 0.0,
            "data_wait_frac": d["data_wait_s"] / step_time if step_time > 0 else 0.0,
            "compute_s_per_step": d["compute_s"] / steps if steps else 0.0,
            "data_wait_s_per_step": d["data_wait_s"] / steps if steps else 0.0,
            "cpu_s_per_batch": d["worker_cpu_s"] / batches if batches else 0.0,
            "wall_s_per_batch": d["worker_wall_s"] / batches if batches else 0.0,
            "runq_s_per_batch": d["worker_runq_s"] / batches if batches else 0.0,
            "blocked_s_per_batch": d["worker_blocked_s"] / batches if batches else 0.0,
            "worker_cpu_cores": d["worker_cpu_s"] / dt if dt > 0 else 0.0,
        }
