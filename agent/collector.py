"""The collector: client reports + NVML + PSI -> ``NodeSnapshot`` (rates, never counters).

In the agent, counters become rates here (STYLE 7), by the one window rule of
``predictor.observation`` (``counter_deltas``, ``blocked_s``; the autotuner and ``adloader profile`` use
the same through ``Observation.from_window``). Each rank's report carries the loader's monotonic
totals (``adloader.DataLoader.stats()``); ``RankRates.update`` takes the difference to the previous
report over the client's own ``uptime_s`` clock (the agent's receive time when that is missing):
- a counter that went down (a new loader in the same process) resets the baseline: no window;
- remaining negative deltas count 0, and so does a counter the client does not report;
- each figure is smoothed with an exponential moving average of time constant ``SMOOTH_TAU_S``;
  per-step figures update only in windows with steps, per-batch ones only with finished batches.

A job's figures aggregate its ranks (DESIGN "Measurement"): samples/s and worker cores summed, data
wait per step and wait fraction as the max over ranks (a stall on one rank stalls every rank of a
synchronous job), compute per step as the mean over ranks that have data.

A job of several ranks on this node (one training process per GPU, each with its own loader) is one
loader to the predictor and the policy: the ranks' loaders together, alike in a data-parallel job. Its
batch is one step's batches of every rank (``JobStats.batch_size``: the ranks' reported sizes summed),
its per-batch costs are that batch's (each rank's mean cost of a batch, over the ranks that have data,
times the ranks), and its workers, requested workers and ``max_workers`` are its ranks' summed (a
rank's ``max_workers`` is at most the ``memory_bound_workers`` its loader reports, the workers its own
memory limit holds, which it never grows past for a directive: ``_rank_bound``). So the
curve's ceiling (batch over step time) is the job's, as its summed samples/s are, and a plan's worker
count is the job's: the server splits it among the ranks (``agent.server.Server.send_directive``).
Counting one rank's batch and workers beside the ranks' summed samples/s made a 2-rank job's curve
reach its ceiling at half the cores the job needed. With one rank (the common case) nothing changes.

Batch size of a window (``JobStats.samples_per_step``, ``JobWindow.samples_per_step``): the samples the
ranks' loaders delivered in the window over the steps they took in it (``predictor.bank.window_batch_size``, which the per-job tuner uses too), not the
client's reported ``batch_size``: for a custom ``batch_sampler`` that is the mean over every batch since
the loader started, rounded (``adloader.DataLoader._stats_batch_size``), which after a real change
creeps toward the new size over many reports, and flips near x.5. Samples per *step* (a batch handed to
the training loop; ``samples`` counts what those held), not per worker ``batch``: that counter also
counts batches prefetched but not yet taken and batches made twice for a worker that died. With several
ranks a step is one rank's: the ranks' samples over their steps is one rank's batch, checked against the
ranks' mean reported size, and the job's figure is that times the ranks (as ``batch_size`` is); the
window's steps are per rank (``window_steps``), as the job steps in lockstep. A figure
that cannot be a window's batch size is not taken and says why (``samples_per_step_note``): the
reported size stands then (and where the window took no step).

Memory (gauges, not counters: the latest report's value is the figure): each rank's loader reports
its workers' USS, the number of workers measured and the batches in flight (``adloader.memory``),
and what the workers of the rank's other loaders hold (``other_loader_memory_bytes``: a validation
loader's, A-Dloader's or torch's own, which the agent does not size); a job's ``loader_memory_bytes``
sums all of them over its ranks, ``other_loader_memory_bytes`` the last, ``worker_memory_bytes`` is the
primary loaders' over their measured workers (one worker's cost), ``worker_growth_bytes`` the mean
growth. One worker's cost never falls below the most it was on any of the job's ranks since that
rank's loader started (a new loader in the process, its counters reset, starts afresh; the loader's
own ``worker_cost_peak_bytes`` counts
too): a worker's private memory grows over an epoch as it reads a dataset of Python objects
(copy-on-read, ``adloader.memory``), so workers just started (a new epoch's, or a resize's) cost less
now than they will by the epoch's end, and a plan at their early cost would hand out workers the node
cannot hold by then. The node's budget in
force comes from ``agent.memory.MemoryGuard`` (configured budget, lowered under memory pressure).

Remaining work: a loader told its job's remaining steps (``total_steps``) reports ``steps_left``; the
job's figure is the most over its ranks (the latest reports; None where no rank reports it). It is the
job's claim, and it must count down: an honest loader's ``steps_left + steps`` (its end mark) stays put
but when the job re-sets its count (``set_total_steps``: a new ``fit``, once in minutes). A rank whose
mark rose more than ``STEPS_LEFT_RESETS`` times within ``STEPS_LEFT_RESET_S`` (a count that does not fall
as the job steps: a constant or growing claim) says nothing until those rises age out (a warning in the
agent's log): the finish guard, which feeds the jobs with the most work left first, is not claimable by
a figure that never falls.

GPU idle: NVML's figure for the job's GPUs when the driver gives one (``gpu_idle_source="nvml"``);
otherwise the client's data-wait fraction stands in (``"client"``). Both stay visible in status.

The node's CPU (``NodeSnapshot.busy_cpu_cores``): the busy time of the node's CPUs (``psi.busy_cpu_s``)
over each snapshot's interval, smoothed like the jobs' figures (``SMOOTH_TAU_S``). A job's CPU
(``JobStats.cpu_cores``) is its training processes' CPU during their steps plus its loaders' workers', or,
where its clients count more (``job_cpu_s`` in their reports' stats, ``job_cpu_cores``: the CPU of the
training processes whatever they run, a validation pass or a checkpoint save, and of every process they
started, the workers of every loader among them, ``adloader.proctree``), that; a rank that another rank
of its job started (the other local ranks that Lightning's DDP launcher starts from rank 0) is in that
rank's count already, so its own is left out of the job's sum (``nested_ranks``). A client's count is
its claim: one that claims more than it used only hides other processes' load from the yield switch
below (the loaders then yield to them too) and keeps its own cores while it is away, as it would
without the release. What the node used beyond the jobs and the agent itself is
``foreign_cpu_cores`` (other tenants, daemons, jobs that do not report; never negative): the
policies let the loaders yield to the trainers only while it is small (``agent.policies.node_allocation``).
A job that left still counts as a job there while its CPU decays out of the smoothed busy figure, and
a job that just arrived counts its training processes' CPU from before their hello (imports, model
set-up: the processes' own CPU time) as it decays out of that figure.
``foreign_held_cpu_cores`` is the least of that figure over the last ``FOREIGN_HOLD_S``: a job starting
(its imports, before its hello) or exiting (after its bye) is a burst of a second or two of CPU that
no one reports, which the smoothed figure shows for a few seconds; a tenant or a hog stays. The policies
stop the loaders' yield on the held figure, so only what lasts stops it.
"""
from __future__ import annotations

import logging
import math
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

from agent import psi
from agent.memory import MemoryGuard, MemoryState
from agent.model import JobStats, NodeSnapshot, Report
from agent.registry import Job, Registry
from predictor.bank import BATCH_SIZE_DISAGREE, window_batch_size  # noqa: F401 (BATCH_SIZE_DISAGREE re-exported)
from predictor.observation import blocked_s, counter_deltas

log = logging.getLogger(__name__)

SMOOTH_TAU_S = 3.0
STEPS_LEFT_RESETS = 2      # a rank's end mark (steps_left + steps) may rise this often ...
STEPS_LEFT_RESET_S = 300.0  # ... within this long; more: its steps_left is not taken (see above)
ARRIVAL_WINDOW_S = 60.0    # a training process younger than this when its job is first seen: its CPU so far is start-up
FOREIGN_HOLD_S = 3.0       # foreign_held_cpu_cores: the least foreign figure over this long
MIN_WINDOW_S = 0.05
AWAY_SPAN_MIN_S = 0.5      # JobStats.away_cpu_cores: the least span of reports inside a pause it is measured over,
AWAY_RATE_S = 3.0          # ... and the span of each rate whose most it is
PLACEMENT_REFRESH_S = 10.0  # a rank's allowed CPUs and cgroup owner are read again after this long (they can
                            # change while it runs: a taskset, a moved cpuset, a Kubernetes CPU manager)
HISTORY_S = 30.0           # each rank's reports kept for the predictor's windows (settled_window)
HISTORY_REPORTS = 64       # ... and at most this many of them
COUNTERS = ("steps", "samples", "batches", "data_wait_s", "compute_s", "worker_cpu_s", "worker_wall_s",
            "worker_runq_s", "worker_blocked_s", "main_cpu_s", "main_runq_s", "paused_s", "job_cpu_s")
GAUGES = ("worker_uss_bytes", "memory_workers", "shm_inflight_bytes", "worker_growth_bytes",
          "other_loader_memory_bytes")
RATES = ("samples_per_s", "data_wait_s_per_step", "compute_s_per_step", "data_wait_frac", "cpu_s_per_batch",
         "wall_s_per_batch", "runq_s_per_batch", "blocked_s_per_batch", "worker_cpu_cores", "trainer_cpu_cores",
         "trainer_cpu_s_per_step", "trainer_runq_s_per_step", "job_cpu_cores")




MAX_FIGURE = float(2 ** 53)   # a report's figure above this is no count, time or size (float counters stop
                              # counting by one there); taken as not reported, so no rate overflows to inf


def _num(v) -> Optional[float]:
    """A report's figure as a float, or None where it is not one: not a number, negative, not finite,
    or above ``MAX_FIGURE`` (a difference of two such over the shortest window, ``MIN_WINDOW_S``, is
    beyond a float's range: an inf rate, then NaN once smoothed, for every report after)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) and 0 <= v <= MAX_FIGURE else None


@dataclass
class RankRates:
    """Smoothed rates of one rank (one training process) from successive report totals."""
    prev: Optional[dict] = None
    prev_t: float = 0.0
    rates: dict = field(default_factory=dict)
    observed_s: float = 0.0
    window_s: float = 0.0
    windows: int = 0
    gauges: dict = field(default_factory=dict)     # memory figures of the latest report
    cost_peak: float = 0.0                         # the most one worker cost since this rank's loader started
                                                   # (``worker_cost``; module docstring, "Memory")
    steps_left: Optional[float] = None             # the latest report's ``steps_left`` (None: not reported,
                                                   # or not counting down: ``_check_steps_left``)
    end_mark: Optional[tuple[float, float]] = None     # (steps_left + steps, steps) at the last report with
                                                       # steps left
    mark_rises: deque = field(default_factory=deque)   # when the end mark rose (the last STEPS_LEFT_RESET_S)
    steps_left_refused: bool = False               # the last report's steps_left was refused (not counting down)
    window_steps: float = 0.0                      # the last window's steps and samples (counter deltas):
    window_samples: float = 0.0                    # its batch size (``window_batch_size``)
    history: deque = field(default_factory=lambda: deque(maxlen=HISTORY_REPORTS))   # Report, oldest first
    away_s: float = 0.0                            # the latest report's ``away_s``: how long its training loop
                                                   # had been out of next() (0: in it, or not reported)

    def update(self, stats: Mapping, recv_t: float) -> bool:
        """Fold one report in. True if it closed a window (rates changed)."""
        self.away_s = _num(stats.get("away_s")) or 0.0
        for k in GAUGES:
            v = _num(stats.get(k))
            if v is not None:
                self.gauges[k] = v
        cost = self.worker_cost(stats)
        t = _num(stats.get("uptime_s"))
        if t is None:
            t = recv_t
        totals = {k: _num(stats.get(k)) for k in COUNTERS}
        self.steps_left = self._check_steps_left(_num(stats.get("steps_left")), totals["steps"], recv_t)
        self._remember(totals, t, stats, recv_t)
        if self.prev is None:
            self.prev, self.prev_t = totals, t
            self.cost_peak = cost
            return False
        dt = t - self.prev_t
        reset = dt < 0 or any(v is not None and p is not None and v < p - 1e-9
                              for k, (v, p) in ((k, (totals[k], self.prev[k])) for k in ("steps", "samples", "batches")))
        self.cost_peak = cost if reset else max(self.cost_peak, cost)    # (a new loader: its own workers)
        if reset:
            self.prev, self.prev_t = totals, t
            self.history.clear()
            self._remember(totals, t, stats, recv_t)
            return False
        if dt < MIN_WINDOW_S:
            return False
        d = counter_deltas(self.prev, totals, COUNTERS)     # the one window rule (predictor.observation)
        self.prev, self.prev_t = totals, t
        new: dict[str, float] = {"samples_per_s": d["samples"] / dt, "worker_cpu_cores": d["worker_cpu_s"] / dt}
        if totals["main_cpu_s"] is not None:       # (a client that does not report it: no figure)
            new["trainer_cpu_cores"] = d["main_cpu_s"] / dt
        if totals["job_cpu_s"] is not None:        # (the same)
            new["job_cpu_cores"] = d["job_cpu_s"] / dt
        if d["steps"] > 0:
            new["data_wait_s_per_step"] = d["data_wait_s"] / d["steps"]
            new["compute_s_per_step"] = d["compute_s"] / d["steps"]
            if totals["main_cpu_s"] is not None:
                new["trainer_cpu_s_per_step"] = d["main_cpu_s"] / d["steps"]
            if totals["main_runq_s"] is not None:
                new["trainer_runq_s_per_step"] = d["main_runq_s"] / d["steps"]
        busy = d["data_wait_s"] + d["compute_s"]
        if busy > 0:
            new["data_wait_frac"] = d["data_wait_s"] / busy
        if d["batches"] > 0:
            new["cpu_s_per_batch"] = d["worker_cpu_s"] / d["batches"]
            new["wall_s_per_batch"] = d["worker_wall_s"] / d["batches"]
            new["runq_s_per_batch"] = d["worker_runq_s"] / d["batches"]
            new["blocked_s_per_batch"] = blocked_s(d, totals["worker_blocked_s"] is not None) / d["batches"]
        alpha = 1.0 - math.exp(-dt / SMOOTH_TAU_S)
        for k, v in new.items():
            old = self.rates.get(k)
            self.rates[k] = v if old is None else old + alpha * (v - old)
        self.observed_s += dt
        self.window_s = dt
        self.window_steps, self.window_samples = d["steps"], d["samples"]
        self.windows += 1
        return True

    def job_cpu_over(self, span_s: float) -> Optional[float]:
        """The rank's CPU (its client's ``job_cpu_s``) in the last ``span_s`` of its reports (a pause), from
        their raw totals: the most it used over any ``AWAY_RATE_S`` of them (over all of them where they span
        less), not the smoothed figure, which still carries what it used before. The most, because what it
        uses once its neighbours have been lent its idle cores is what they leave it, not what it needs: an
        average would fall as it is squeezed, and lend them more. None where under ``AWAY_SPAN_MIN_S`` of
        reports lie in the span, or the client does not count it."""
        if not self.history:
            return None
        last = self.history[-1]
        inside = [(r.uptime_s, r.totals.get("job_cpu_s")) for r in self.history
                  if last.uptime_s - r.uptime_s <= span_s + 1e-9]
        if any(c is None for _, c in inside) or inside[-1][0] - inside[0][0] < AWAY_SPAN_MIN_S:
            return None
        if inside[-1][0] - inside[0][0] < AWAY_RATE_S:
            return max(0.0, inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])
        most, j = 0.0, 0
        for t, c in inside:
            while j + 1 < len(inside) and t - inside[j + 1][0] >= AWAY_RATE_S - 1e-9:
                j += 1
            t0, c0 = inside[j]
            if t - t0 >= AWAY_RATE_S - 1e-9:
                most = max(most, max(0.0, c - c0) / (t - t0))
        return most

    def worker_cost(self, stats: Mapping) -> float:
        """One worker's cost by the latest report (its mean USS plus its part of the batches in flight, as
        ``adloader.autotune.worker_cost`` counts it; the loader's own ``worker_cost_peak_bytes`` where it
        reports one); 0 where no worker was measured."""
        g = self.gauges
        n = g.get("memory_workers", 0.0)
        now = (g.get("worker_uss_bytes", 0.0) + g.get("shm_inflight_bytes", 0.0)) / n if n > 0 else 0.0
        return max(now, _num(stats.get("worker_cost_peak_bytes")) or 0.0)

    def _check_steps_left(self, left: Optional[float], steps: Optional[float], recv_t: float) -> Optional[float]:
        """The report's ``steps_left``, or None while this rank's count does not fall as it steps (its
        end mark ``steps_left + steps`` rose more than ``STEPS_LEFT_RESETS`` times in the last
        ``STEPS_LEFT_RESET_S``). A count at 0 (the job past its hint) claims nothing and leaves the mark,
        and so does a report without one (the hint withdrawn: a claim that comes back above the mark is
        a rise, so withdrawing between claims does not start afresh); a loader whose step counter went
        back (a new one in the rank) starts a new mark."""
        while self.mark_rises and self.mark_rises[0] < recv_t - STEPS_LEFT_RESET_S:
            self.mark_rises.popleft()
        if steps is not None and self.end_mark is not None and steps < self.end_mark[1]:
            self.end_mark = None
        if left is not None and steps is not None and left > 0:
            mark = left + steps
            if self.end_mark is not None and steps >= self.end_mark[1] and mark > self.end_mark[0] + 0.5:
                self.mark_rises.append(recv_t)
            self.end_mark = (mark, steps)
        self.steps_left_refused = left is not None and len(self.mark_rises) > STEPS_LEFT_RESETS
        return None if self.steps_left_refused else left

    def _remember(self, totals: dict, t: float, stats: Mapping, recv_t: float) -> None:
        """Keep the report's totals for the predictor's windows (the last ``HISTORY_S`` of them)."""
        workers, live, epoch = _num(stats.get("workers")), _num(stats.get("live_workers")), _num(stats.get("epoch"))
        self.history.append(Report(recv_t=recv_t, uptime_s=t, totals=totals,
                                   workers=int(workers) if workers is not None else 0,
                                   live_workers=int(live) if live is not None else None,
                                   epoch=int(epoch) if epoch is not None else None))
        while self.history and self.history[0].recv_t < recv_t - HISTORY_S:
            self.history.popleft()


@dataclass(frozen=True)
class JobWindow:
    """A job's window between two reports of each of its ranks, from the raw totals (no smoothing):
    what the predictor is fed (``agent.controller.observation_from_stats``). Aggregated over ranks as
    ``JobStats`` is: samples/s, worker cores and workers summed, data wait per step the max, compute per
    step and the trainer's run-queue wait per step the mean, per-batch costs pooled over the ranks'
    batches and times the ranks (the job's batch is one of each rank's: module docstring)."""
    start_t: float                  # the agent's clock at the earliest rank's first report
    end_t: float                    # ... at the latest rank's last report
    duration_s: float               # mean over ranks (their own clocks)
    workers: int                    # the worker count throughout (summed over ranks)
    steps: int                      # steps per rank (mean, rounded; >= 1)
    samples: float                  # samples delivered in the window, summed over ranks
    total_steps: float              # steps in the window, summed over ranks (``ranks`` of them)
    ranks: int
    samples_per_s: float
    compute_s_per_step: float
    data_wait_s_per_step: float
    trainer_runq_s_per_step: float
    cpu_s_per_batch: float
    wall_s_per_batch: float
    runq_s_per_batch: float
    blocked_s_per_batch: float
    worker_cpu_cores: float

    def stats_fields(self, batch_size: float) -> dict:
        """The ``JobStats`` fields this window replaces (``dataclasses.replace(job, **w.stats_fields(
        job.batch_size))``). ``batch_size``: the job's reported one, what the window's own samples per
        step are checked against and what stands where they are not taken (``window_batch_size``)."""
        wait, step = self.data_wait_s_per_step, self.data_wait_s_per_step + self.compute_s_per_step
        n = max(1, self.ranks)
        per_step, steps_stand, note = window_batch_size(self.samples, self.total_steps, n, batch_size / n)
        return dict(workers=self.workers, samples_per_s=self.samples_per_s,
                    samples_per_step=per_step * n if per_step is not None else None, samples_per_step_note=note,
                    window_steps=float(self.steps) if steps_stand else None,
                    compute_s_per_step=self.compute_s_per_step, data_wait_s_per_step=wait,
                    data_wait_frac=wait / step if step > 0 else 0.0,
                    trainer_runq_s_per_step=self.trainer_runq_s_per_step,
                    cpu_s_per_batch=self.cpu_s_per_batch, wall_s_per_batch=self.wall_s_per_batch,
                    runq_s_per_batch=self.runq_s_per_batch, blocked_s_per_batch=self.blocked_s_per_batch,
                    worker_cpu_cores=self.worker_cpu_cores, window_s=self.duration_s)


MIN_WINDOW_STEPS = 2       # a predictor window holds at least this many steps per rank


def settled_window(history, since: float, span_s: float, min_s: float,
                   min_steps: int = MIN_WINDOW_STEPS) -> Optional[JobWindow]:
    """The job's latest window in one configuration, cut from its ranks' reports (``JobStats.history``).

    Per rank: from a report at or after ``since`` (the agent's clock: the job's last allocation change,
    or the end of its last window) to its latest report (with a step in it: below), over which the
    loader's worker count did not change and all its workers were live (a resize the client has not finished is not the new
    configuration yet), and which starts after the loop's first step (the wait for the first batch is
    workers starting and the dataset opening, not the loader's pace). The window is ``span_s`` long
    where the reports allow, longer (back to the same bounds) until it holds ``min_steps`` steps.

    It ends at the rank's latest report that holds a step, and it never reaches back past a report after
    which the loop resumed from a pause (the loader's ``paused_s`` rose: a validation pass, a checkpoint
    save, a debugger stop). A window over a pause counted its seconds but none of its steps: a 3 s window
    of which 2 s were the pause said the job delivered a third of its pace at its configuration (a live
    loop pausing 6 s every 150 steps: 5 of its 18 windows at 19-64 samples/s beside 152).

    Smoothed rates are not fit for this: an exponential average (``SMOOTH_TAU_S``) a second after a
    change still holds most of the previous configuration, and at a job's start it holds the start-up;
    fed to the predictor, both made a loader look slower per core than it was (BENCHMARKS.md, issue 11,
    tenth pass). (They are also a mean of per-report step times, not total time over total steps.)

    None when a rank has no such window at least ``min_s`` long with ``min_steps`` steps."""
    per: list[tuple[Report, Report, dict, float]] = []
    for reports in history:
        if len(reports) < 2:
            return None
        last = reports[-1]
        if last.live_workers is not None and last.live_workers != last.workers:
            return None
        end = len(reports) - 1      # the window ends at the rank's last report with a new step in it
        while end > 0 and (reports[end].totals.get("steps") or 0.0) <= (reports[end - 1].totals.get("steps") or 0.0):
            end -= 1
        reports, last = reports[:end + 1], reports[end]
        start = None        # (report, duration, steps) of the earliest start found so far
        later = last        # the report after ``rep``
        for rep in reversed(reports[:-1]):
            if (later.totals.get("paused_s") or 0.0) > (rep.totals.get("paused_s") or 0.0):
                break       # the loop resumed from a pause between them: its time is no step of the loader's pace
            later = rep
            if (rep.recv_t < since or rep.workers != last.workers
                    or (rep.live_workers is not None and rep.live_workers != rep.workers)
                    or (rep.totals.get("steps") or 0.0) < 1):
                break
            if start is not None and last.recv_t - rep.recv_t > span_s and start[2] >= min_steps:
                break
            start = (rep, last.uptime_s - rep.uptime_s,
                     (last.totals.get("steps") or 0.0) - (rep.totals.get("steps") or 0.0))
        if start is None:
            return None
        rep, dur, steps = start
        if dur < min_s or steps < min_steps:
            return None
        per.append((rep, last, counter_deltas(rep.totals, last.totals, COUNTERS), dur))
    if not per:
        return None
    n = len(per)
    batches = sum(d["batches"] for _, _, d, _ in per)

    def per_batch(k):
        return sum(d[k] for _, _, d, _ in per) / batches if batches > 0 else 0.0

    blocked = sum(blocked_s(d, last.totals.get("worker_blocked_s") is not None) for _, last, d, _ in per)
    return JobWindow(
        start_t=min(rep.recv_t for rep, _, _, _ in per), end_t=max(last.recv_t for _, last, _, _ in per),
        duration_s=sum(dur for *_, dur in per) / n,
        workers=sum(last.workers for _, last, _, _ in per),
        steps=max(1, int(round(sum(d["steps"] for _, _, d, _ in per) / n))),
        samples=sum(d["samples"] for _, _, d, _ in per), total_steps=sum(d["steps"] for _, _, d, _ in per), ranks=n,
        samples_per_s=sum(d["samples"] / dur for _, _, d, dur in per),
        compute_s_per_step=sum(d["compute_s"] / d["steps"] for _, _, d, _ in per) / n,
        data_wait_s_per_step=max(d["data_wait_s"] / d["steps"] for _, _, d, _ in per),
        trainer_runq_s_per_step=sum(d["main_runq_s"] / d["steps"] for _, _, d, _ in per) / n,
        cpu_s_per_batch=n * per_batch("worker_cpu_s"), wall_s_per_batch=n * per_batch("worker_wall_s"),
        runq_s_per_batch=n * per_batch("worker_runq_s"),
        blocked_s_per_batch=n * blocked / batches if batches > 0 else 0.0,
        worker_cpu_cores=sum(d["worker_cpu_s"] / dur for _, _, d, dur in per))


def stepped_since(history, since: float) -> bool:
    """Whether a rank's training loop took a step after ``since`` (the agent's clock): its step counter
    rose from its last report at or before ``since`` (its earliest kept, where none is) to its latest.
    False for a loop that stopped iterating while still connected (a debugger, a hung trainer, a long
    validation pass or checkpoint save): its reports keep coming, its totals stand still."""
    for reports in history:
        if len(reports) < 2:
            continue
        base = reports[0]
        for rep in reports:
            if rep.recv_t > since:
                break
            base = rep
        if (reports[-1].totals.get("steps") or 0.0) > (base.totals.get("steps") or 0.0):
            return True
    return False


class Collector:
    """Builds the ``NodeSnapshot`` the controller reads each tick: measurements only. What is applied
    is the controller's own state; it adds it to the snapshot itself (``NodeSnapshot.applied``)."""

    def __init__(self, registry: Registry, *, loader_cpus: float, cpu_ids: tuple[int, ...], max_jobs: int = 0,
                 gpu_sampler=None, proc_root: str = "/proc",
                 memory_guard: Optional[MemoryGuard] = None,
                 own_cpu_s: Callable[[], float] = time.process_time, loader_cpus_auto: bool = False):
        self.registry = registry
        self.loader_cpus = loader_cpus
        self.loader_cpus_auto = loader_cpus_auto     # loader_cpus is the "auto" default (NodeSnapshot)
        self.cpu_ids = tuple(cpu_ids)
        self.max_jobs = max_jobs
        self.gpu = gpu_sampler
        self.proc_root = proc_root
        self.rank_rates: dict[tuple[str, int, int], RankRates] = {}
        self.pressure = psi.Pressure(None, None)
        self._allowed_cache: dict[int, tuple[float, tuple[int, ...], bool, str]] = {}   # pid -> (read at, ...)
        self.last: Optional[NodeSnapshot] = None
        self.memory_guard = memory_guard
        self.memory_state: Optional[MemoryState] = None
        self._own_cpu_s = own_cpu_s
        self._cpu_prev: Optional[tuple[float, float, float]] = None   # (now, node busy s, agent CPU s)
        self.busy_cpu_cores: Optional[float] = None    # smoothed rates (see the module docstring)
        self._own_cores: float = 0.0
        self._jobs_cpu: tuple[float, dict[str, float]] = (0.0, {})   # (when, each job's CPU) at the last snapshot
        self._unreported: list[tuple[float, float]] = []   # (cores in the busy figure, when): departed jobs'
                                                           # last CPU, arrivals' start-up (_unreported_cores)
        self._foreign: list[tuple[float, float]] = []    # (when, foreign cores) over the last FOREIGN_HOLD_S
        self._seen_jobs: set[str] = set()                # jobs whose start-up CPU is taken (_note_arrived)
        self._nested: dict[str, tuple[tuple[int, ...], dict[int, int]]] = {}   # job -> (its ranks' pids, nested_ranks)

    def on_report(self, job: str, rank: int, pid: int, stats: Mapping, recv_t: float) -> None:
        rr = self.rank_rates.get((job, rank, pid))
        if rr is None:
            rr = self.rank_rates[(job, rank, pid)] = RankRates()
        was = rr.steps_left_refused
        rr.update(stats, recv_t)
        if rr.steps_left_refused and not was:
            log.warning("job %s rank %d: its steps_left does not count down as it steps (steps_left + steps "
                        "rose %d times in %.0f s): not taken until that ages out", job, rank,
                        len(rr.mark_rises), STEPS_LEFT_RESET_S)

    def forget(self, job: str) -> None:
        for k in [k for k in self.rank_rates if k[0] == job]:
            del self.rank_rates[k]

    def _drop_replaced_ranks(self) -> None:
        """Forget the rates of each process that no longer holds its rank (another process holds it, or
        its job left): they are keyed by pid, so a job that outlives its processes (a Slurm allocation
        running one step after another, a rank restarted by torchrun) kept one ``RankRates`` (with its
        reports) for every process it ever had, until the job itself left. A rank that is only away
        (dropped, not yet replaced) keeps its rates for its return."""
        jobs = self.registry.jobs
        stale = []
        for key in self.rank_rates:
            job = jobs.get(key[0])
            r = job.ranks.get(key[1]) if job is not None else None
            if job is None or (r is not None and r.pid != key[2]):
                stale.append(key)
        for key in stale:
            del self.rank_rates[key]

    def _placement(self, pid: int, now: float) -> tuple[tuple[int, ...], bool, str]:
        """(allowed CPUs if narrower than the agent's, whether another manager owns its cgroup, its
        ``/proc/<pid>/cgroup`` text: which group it is in, as the agent sees it), read at most every
        ``PLACEMENT_REFRESH_S`` per process (before, once for its life: a rank whose CPUs an operator's
        taskset narrowed kept its old placement in every plan)."""
        got = self._allowed_cache.get(pid)
        if got is not None and 0.0 <= now - got[0] < PLACEMENT_REFRESH_S:
            return got[1], got[2], got[3]
        allowed: tuple[int, ...] = ()
        try:
            aff = tuple(sorted(os.sched_getaffinity(pid)))
            if set(aff) < set(self.cpu_ids):
                allowed = aff
        except (OSError, AttributeError):
            pass
        cgroup = ""
        try:
            with open(os.path.join(self.proc_root, str(pid), "cgroup")) as f:
                cgroup = f.read()
        except OSError:
            pass
        cooperative = any("/slurm" in line or "/job_" in line for line in cgroup.splitlines())
        if len(self._allowed_cache) > 4096:
            self._allowed_cache.clear()
        self._allowed_cache[pid] = (now, allowed, cooperative, cgroup)
        return allowed, cooperative, cgroup

    def _cpu_quota(self, ranks, now: float) -> Optional[float]:
        """Cores the job's CPU quotas allow its ranks together (a container's CPU limit without exclusive
        cores: Kubernetes' ``limits.cpu``, ``docker --cpus``), None when a rank has none. Each rank says its
        own (``Rank.cpu_quota``: it reads its cgroup from inside its container, where the agent cannot
        resolve the path); ranks in one group (torchrun's ranks in one pod) share one quota, counted once."""
        groups: dict[str, float] = {}
        for r in ranks:
            if r.cpu_quota is None:
                return None
            key = self._placement(r.pid, now)[2] or f"pid {r.pid}"
            groups[key] = r.cpu_quota
        return sum(groups.values()) if groups else None

    def job_stats(self, job: Job, now: float) -> JobStats:
        ranks = list(job.ranks.values())
        per = [self.rank_rates.get((job.job, r.rank, r.pid)) for r in ranks]
        rates = [rr.rates for rr in per if rr is not None and rr.windows > 0]
        if len(rates) == 1:                    # one rank (the common case): its rates are the job's
            only = rates[0]

            def total(k):
                return only.get(k, 0.0)

            top = mean = total
        else:
            agg: dict[str, list] = {}          # key -> [sum, max, count] over ranks with data
            for r in rates:
                for k, v in r.items():
                    a = agg.get(k)
                    if a is None:
                        agg[k] = [v, v, 1]
                    else:
                        a[0] += v
                        a[1] = v if v > a[1] else a[1]
                        a[2] += 1

            def total(k):
                a = agg.get(k)
                return a[0] if a else 0.0

            def top(k):
                a = agg.get(k)
                return a[1] if a else 0.0

            def mean(k):
                a = agg.get(k)
                return a[0] / a[2] if a else 0.0

        data_wait_frac = top("data_wait_frac")
        gpu_idle, source = None, "client"
        gpus = job.gpus
        if self.gpu is not None and gpus and self.gpu.available:
            gpu_idle = self.gpu.job_idle_frac(gpus, job.pids())
            if gpu_idle is not None:
                source = "nvml"
        if gpu_idle is None and rates:
            gpu_idle = data_wait_frac
        allowed, cooperative, _ = self._placement(ranks[0].pid, now) if ranks else ((), False, "")
        # The job's loader is its ranks' loaders together (one per rank, alike in a data-parallel job): its
        # batch is one step's batches of every rank, its workers all of theirs (module docstring)
        n = len(ranks)
        batch_size = sum(r.batch_size for r in ranks) if ranks else 1
        workers = sum(r.workers for r in ranks)
        requested = sum(r.requested_workers for r in ranks)
        max_workers = (None if not ranks or any(_rank_bound(r) is None for r in ranks)
                       else sum(_rank_bound(r) for r in ranks))
        observed_s = window_s = 0.0
        w_steps = w_samples = 0.0           # the ranks' last windows: their batch size (window_batch_size)
        w_ranks = 0
        uss = shm = mworkers = growth = cost_peak = other_mem = 0.0
        steps_left: Optional[float] = None
        refused = False
        # away: every rank's loop out of next() at its latest report (ranks step in lockstep: one that steps
        # keeps the job stepping); the least of them, 0 where a rank has not reported
        away = min((rr.away_s if rr is not None else 0.0 for rr in per), default=0.0)
        # the job's CPU as its clients count it, less the ranks already in another rank's count
        counted = self._counting_ranks(job, ranks, per)
        job_cpu = sum(rr.rates.get("job_cpu_cores", 0.0) for rr in counted if rr is not None and rr.windows > 0)
        # what it used while away, from the reports inside the pause, at its most (None: not away, or not known)
        away_cpu = None
        if away > 0:
            inside = [rr.job_cpu_over(away) if rr is not None else None for rr in counted]
            away_cpu = sum(inside) if inside and None not in inside else None
        for rr in per:
            if rr is not None:
                refused = refused or rr.steps_left_refused
                if rr.steps_left is not None:       # the rank furthest from its end sets the job's
                    steps_left = rr.steps_left if steps_left is None else max(steps_left, rr.steps_left)
                g = rr.gauges
                if g:
                    uss += g.get("worker_uss_bytes", 0.0)
                    shm += g.get("shm_inflight_bytes", 0.0)
                    mworkers += g.get("memory_workers", 0.0)
                    growth = max(growth, g.get("worker_growth_bytes", 0.0))
                    other_mem += g.get("other_loader_memory_bytes", 0.0)
                cost_peak = max(cost_peak, rr.cost_peak)
                observed_s = max(observed_s, rr.observed_s)
                if rr.windows:
                    window_s = max(window_s, rr.window_s)
                    w_steps += rr.window_steps
                    w_samples += rr.window_samples
                    w_ranks += 1
        per_step, steps_stand, per_step_note = (window_batch_size(w_samples, w_steps, w_ranks, batch_size / n)
                                                if w_ranks else (None, False, ""))
        # GPUs (the job's weight): what the job registered (Slurm), else for a one-process job the GPUs it
        # reported in its hello (one process may drive several; counting ranks alone gave such a 2-GPU
        # job the weight of a 1-GPU one), else one per rank (ranks of a multi-process job often each see
        # every GPU of the node, so their union would overcount).
        if job.reg_gpus:
            n_gpus = len(job.reg_gpus)
        elif len(ranks) == 1:
            n_gpus = len(ranks[0].gpus)
        else:
            n_gpus = len(ranks)
        return JobStats(
            job=job.job, uid=job.uid, ranks=len(ranks), gpus=max(1, len(ranks), n_gpus),
            batch_size=batch_size, workers=workers, requested_workers=requested, max_workers=max_workers,
            samples_per_step=per_step * n if per_step is not None else None, samples_per_step_note=per_step_note,
            window_steps=w_steps / w_ranks if steps_stand else None,
            samples_per_s=total("samples_per_s"),
            compute_s_per_step=mean("compute_s_per_step"),
            data_wait_s_per_step=top("data_wait_s_per_step"),
            data_wait_frac=data_wait_frac,
            cpu_s_per_batch=n * mean("cpu_s_per_batch"), wall_s_per_batch=n * mean("wall_s_per_batch"),
            runq_s_per_batch=n * mean("runq_s_per_batch"), blocked_s_per_batch=n * mean("blocked_s_per_batch"),
            worker_cpu_cores=total("worker_cpu_cores"),
            trainer_cpu_cores=total("trainer_cpu_cores"), trainer_cpu_s_per_step=total("trainer_cpu_s_per_step"),
            job_cpu_cores=job_cpu,
            trainer_runq_s_per_step=mean("trainer_runq_s_per_step"),
            gpu_idle_frac=gpu_idle, gpu_idle_source=source,
            allowed_cpus=allowed, cooperative=cooperative, cpu_quota_cores=self._cpu_quota(ranks, now),
            age_s=max(0.0, now - job.arrived_at),
            observed_s=observed_s, window_s=window_s,
            requested_cpus=float(job.reg_cpus) if job.reg_cpus else None,
            pids=job.pids(), worker_pids=job.worker_pids(), worker_starts=job.worker_starts(),
            worker_memory_bytes=max((uss + shm) / mworkers if mworkers > 0 else 0.0, cost_peak),
            loader_memory_bytes=uss + shm + other_mem, other_loader_memory_bytes=other_mem,
            worker_growth_bytes=growth, steps_left=steps_left,
            steps_left_refused=refused,
            epoch_fixed=bool(ranks) and all(r.dataset_kind == "iterable" for r in ranks),
            away_s=away, away_cpu_cores=away_cpu,
            history=tuple(tuple(rr.history) for rr in per if rr is not None),
        )

    def _counting_ranks(self, job: Job, ranks: list, per: list) -> list:
        """``per`` (the ranks' rates) less the ranks whose CPU another rank's client counts already: a rank
        that descends from another rank of the job whose client counts ``job_cpu_s`` (its tree,
        ``adloader.proctree``). The descent is read from /proc once for each set of the job's pids."""
        pids = tuple(r.pid for r in ranks)
        if len(set(pids)) < 2:
            return per
        got = self._nested.get(job.job)
        if got is None or got[0] != pids:
            if len(self._nested) > 4096:
                self._nested.clear()
            got = self._nested[job.job] = (pids, nested_ranks(pids, self.proc_root))
        if not got[1]:
            return per
        by_pid = {r.pid: rr for r, rr in zip(ranks, per)}
        def counted_by_ancestor(r) -> bool:
            a = by_pid.get(got[1].get(r.pid))
            return a is not None and "job_cpu_cores" in a.rates

        return [rr for r, rr in zip(ranks, per) if not counted_by_ancestor(r)]

    def snapshot(self, now: float) -> NodeSnapshot:
        """The controller's ``snapshot_source``: one consistent view of the node for this tick."""
        if self.gpu is not None:
            self.gpu.sample(now)
        self.pressure = psi.read(self.proc_root)
        self._drop_replaced_ranks()
        # only jobs with a connected rank: a registered job none of whose ranks has said hello (yet, or
        # any more) has no loader to give a share to, and must cost its neighbours nothing
        jobs = {j.job: self.job_stats(j, now) for j in self.registry.jobs.values() if j.ranks}
        mem = None
        if self.memory_guard is not None:
            mem = self.memory_state = self.memory_guard.update(
                now, sum(j.loader_memory_bytes for j in jobs.values()))
        busy = self._node_cpu(now)
        cpu = {j: s.cpu_cores for j, s in jobs.items()}
        foreign = None
        if busy is not None:
            self._note_departed(cpu)
            self._note_arrived(jobs, now)
            foreign = max(0.0, busy - sum(cpu.values()) - self._unreported_cores(now) - self._own_cores)
        self._jobs_cpu = (now, cpu)
        held = self._held_foreign(now, foreign)
        snap = NodeSnapshot(now=now, loader_cpus=self.loader_cpus, loader_cpus_auto=self.loader_cpus_auto,
                            cpu_ids=self.cpu_ids, jobs=jobs,
                            busy_cpu_cores=busy, foreign_cpu_cores=foreign, foreign_held_cpu_cores=held,
                            max_jobs=self.max_jobs, cpu_pressure=self.pressure.cpu_some_avg10,
                            io_pressure=self.pressure.io_some_avg10,
                            loader_memory_bytes=mem.budget if mem else None,
                            memory_pressure=mem.pressure_pct if mem else None,
                            memory_available_bytes=mem.available if mem else None,
                            memory_note=mem.note if mem else "")
        self.last = snap
        return snap

    def _held_foreign(self, now: float, foreign: Optional[float]) -> Optional[float]:
        """The least foreign figure of the snapshots within the last ``FOREIGN_HOLD_S`` (None until they
        span that long, or when the figure is unknown)."""
        if foreign is None:
            self._foreign = []
            return None
        self._foreign.append((now, foreign))
        while len(self._foreign) > 1 and self._foreign[1][0] <= now - FOREIGN_HOLD_S:
            self._foreign.pop(0)             # keep one reading at or before the start of the span
        if self._foreign[0][0] > now - FOREIGN_HOLD_S:
            return None
        return min(f for _, f in self._foreign)

    def _note_arrived(self, jobs: Mapping[str, JobStats], now: float) -> None:
        """What the jobs' training processes used before their hello (imports, model set-up), as it weighs
        in the smoothed node CPU now. Taken once, when the job is first seen: each process's CPU time so
        far (``/proc/<pid>/stat``), spread over its age, is what the busy figure's moving average has
        absorbed of it (``rate * (1 - exp(-age / SMOOTH_TAU_S))``). A process older than
        ``ARRIVAL_WINDOW_S`` (a loader made late in a long-running script) adds nothing: its CPU so far is
        not a recent burst. (From the hello to the first report with rates the job's CPU is still
        nobody's, but then its rates count in full at once while the busy figure rises slowly, which makes
        up for it.)"""
        for j, stats in jobs.items():
            if j in self._seen_jobs:
                continue
            self._seen_jobs.add(j)
            for pid in stats.pids:
                used = _process_cpu(pid, self.proc_root)
                if used is not None and used[0] > 0.0 and 0.0 < used[1] <= ARRIVAL_WINDOW_S:
                    cpu_s, age = used
                    self._unreported.append((cpu_s / age * (1.0 - math.exp(-age / SMOOTH_TAU_S)), now))
        self._seen_jobs &= set(jobs)

    def _note_departed(self, cpu: Mapping[str, float]) -> None:
        """The jobs that left since the last snapshot: their last CPU, as of that snapshot.

        A job's CPU leaves the jobs' sum at once when it departs, but the node's busy figure is smoothed
        (``SMOOTH_TAU_S``), so without this every departure would read as other processes' CPU for a few
        seconds and stop the loaders' yield (``agent.policies.node_allocation``) until it decayed."""
        seen_at, before = self._jobs_cpu             # a job gone now last ran at the last snapshot
        self._unreported += [(c, seen_at) for j, c in before.items() if j not in cpu and c > 0.0]

    def _unreported_cores(self, now: float) -> float:
        """What departed jobs' last CPU and arrivals' start-up still weigh in the smoothed node CPU: each
        decays here exactly as it does in the busy figure (forgotten under 0.005 cores)."""
        left = [(c * math.exp(-(now - t) / SMOOTH_TAU_S), c, t) for c, t in self._unreported]
        self._unreported = [(c, t) for w, c, t in left if w >= 0.005]
        return sum(w for w, _, _ in left)

    def _node_cpu(self, now: float) -> Optional[float]:
        """The node's busy cores since the last snapshot, smoothed (None until two readings)."""
        busy_s = psi.busy_cpu_s(self.proc_root, self.cpu_ids)
        own_s = self._own_cpu_s()
        prev, self._cpu_prev = self._cpu_prev, (now, busy_s, own_s) if busy_s is not None else None
        if busy_s is None or prev is None or now - prev[0] < MIN_WINDOW_S:
            if busy_s is not None and prev is not None:
                self._cpu_prev = prev            # too short a gap: keep the older baseline
            return self.busy_cpu_cores if busy_s is not None else None
        dt = now - prev[0]
        busy = max(0.0, busy_s - prev[1]) / dt
        own = max(0.0, own_s - prev[2]) / dt
        alpha = 1.0 - math.exp(-dt / SMOOTH_TAU_S)
        if self.busy_cpu_cores is None:
            self.busy_cpu_cores, self._own_cores = busy, own
        else:
            self.busy_cpu_cores += alpha * (busy - self.busy_cpu_cores)
            self._own_cores += alpha * (own - self._own_cores)
        return self.busy_cpu_cores


def nested_ranks(pids, proc_root: str = "/proc", max_depth: int = 64) -> dict[int, int]:
    """Each of ``pids`` that descends from another of them -> that ancestor (the nearest): a rank that
    another rank started as its child or grandchild (Lightning's DDP launcher starts the other local ranks
    from rank 0; the bench's rank 0 starts its job's other ranks). From each pid's parent chain
    (``/proc/<pid>/stat``), up to pid 1 or ``max_depth`` steps; a pid gone or unreadable descends from none."""
    ps, out = set(pids), {}
    for pid in ps:
        p = pid
        for _ in range(max_depth):
            st = psi.pid_stat(p, proc_root)
            try:
                p = int(st[1]) if st is not None else 0
            except (ValueError, IndexError):
                p = 0
            if p <= 1:
                break
            if p in ps:
                out[pid] = p
                break
    return out


def _process_cpu(pid: int, proc_root: str = "/proc") -> Optional[tuple[float, float]]:
    """(CPU seconds the process has used, its age in seconds) from ``/proc/<pid>/stat`` and
    ``/proc/uptime``; None if either is unreadable."""
    rest = psi.pid_stat(pid, proc_root)
    if rest is None:
        return None
    try:
        with open(os.path.join(proc_root, "uptime")) as f:
            uptime = float(f.read().split()[0])
        tick = psi.CLK_TCK
        return (int(rest[11]) + int(rest[12])) / tick, uptime - int(rest[19]) / tick
    except (OSError, ValueError, IndexError):
        return None


def _rank_bound(rank) -> Optional[int]:
    """The most workers a rank's loader takes: its ``max_workers``, and at most the
    ``memory_bound_workers`` of its latest report (what its process's memory holds, by its own cgroup
    limit, which the agent cannot read: ``adloader.DataLoader.memory_bound_workers``; at least 1).
    None where neither is known."""
    bound = rank.max_workers
    mem = (rank.stats or {}).get("memory_bound_workers")
    if isinstance(mem, int) and not isinstance(mem, bool) and 1 <= mem <= 1_000_000:
        bound = mem if bound is None else min(bound, mem)
    return bound
