"""``num_workers="auto"`` without an agent: the loader tunes its own worker count in-process.

The loader calls (BRIEF, "Loader -> everyone"):
    initial_workers(loader) -> int   at construction: a safe start, the CPUs we may use (on a node
                                     nobody partitioned, the job's GPUs' part of them) over the job's
                                     processes on this node
    attach(loader)                   at first ``__iter__``: starts a daemon thread (idempotent)
    detach(loader)                   from ``close()``, or from the agent client before its first directive

A new auto loader over the same data as an earlier one of the process (``loader_signature``: the
dataset's type and length, batch size, collate and worker-init functions; a script that builds its
loader every epoch) starts from a copy of what the latest such tuner learned, its curve, measured
counts and count, if it tuned on the same CPUs (``carried_tuner``): ``initial_workers`` returns that
count (``carried_count``) and ``attach`` tunes on from that state, not from an empty curve.

The thread reads ``loader.stats()`` totals every ``WINDOW_S`` seconds, turns two successive totals into
an ``Observation`` (``observation_from_totals``), feeds a ``PredictorBank`` and asks ``AutoTuner`` for a
decision. ``AutoTuner`` is pure (no clock, no thread): tests drive it window by window.

CPUs we may use = min(affinity, cgroup CPU quota) (``usable_cpus``; the affinity of the process's main
thread, which the workers the tuner's resizes start run on too: ``adloader._affinity``): cgroup
v1 cpu.cfs_quota_us / cpu.cfs_period_us of this process's cpu cgroup and its ancestors, or v2 cpu.max,
found through /proc/self/cgroup (never ``os.cpu_count()``, which ignores both); read again every window, and a
change (an in-place resize, a moved cpuset) moves the tuner's CPUs and cap (``AutoTuner.cpus_changed``).
The training process shares them: its own CPU per step (``main_cpu_s`` of the loader's stats,
measured) is fed to the tuner, which takes the worker count that is best when the trainer and the
workers share those CPUs (``predictor.curve.shared_cpu_throughput``, never above the curve itself:
``AutoTuner.predict``), not the count that would keep the queue full if the loader had them alone: a
worker that only takes the trainer's CPU is not grown (ISSUE 11). Nor is one when the
job's processes (trainer and workers, every thread, measured from /proc) already used at least
``SATURATED_FRAC`` of those CPUs in the window: another worker could only share them. On one CPU the
time the CPU was taken from a worker by interrupts, the hypervisor or the kernel's own work is neither
its CPU nor run-queue time and so reads as blocked (IO) time, which the curve says a second worker
would fill; the job's measured CPU use says there is nothing left to fill it with.

Memory: the workers this loader may have are also bounded by memory (``memory_cap``): what its
workers hold now plus the room left (``adloader.memory.memory_room``: the least of MemAvailable and
this process's cgroup memory limit minus its usage, read only), less a reserve of
``MEMORY_RESERVE_FRAC`` of the limit (at least ``MEMORY_RESERVE_MIN``), over one worker's measured cost
(its unique memory plus its share of the batches in flight). A count above the cap is shed at the next
window whatever the hysteresis; the tuner never grows past it. The cap holds through the page cache's
moves of MemAvailable (a band of ``MEMORY_BOUND_MARGIN`` of the reserve: ``memory_cap``'s ``previous``).
Before a worker has been measured there is no cap (a worker's cost is not known until it runs).

Invariants: the tuner never asks for fewer than 1 or more than ``max_workers`` workers; it moves only
after ``SETTLE_WINDOWS`` clean windows at the current count (a window that straddles a resize is
dropped), only for a predicted gain of at least ``HYSTERESIS`` (or to shed workers that the curve says
add less than that), and it never returns to a count it left within ``TABU_WINDOWS`` windows unless the
measured throughput there was better, nor to a count that measured worse than the current one; and
each time it turns back between two counts, the predicted gain that justifies another move between
them doubles (and the loss it accepts to shed a worker halves): it settles instead of oscillating,
even where noise moves the curve's knee back and forth. What it measured is evidence only about the
job it measured: a new phase of the bank (CPU per sample, compute per step), or, at the count it is at,
two windows running whose loader time per batch (IO latency included) or step time is
``CHANGE_RATIO_HERE`` off the count's earlier windows the same way, makes it forget the throughputs,
tabu and turns (``_changed_here``); it decides nothing on a window off them until the next one says
whether it was noise.
Never raises into training.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from adloader._affinity import training_cpu_mask

log = logging.getLogger("adloader.autotune")

WINDOW_S = 2.0          # one observation window
SETTLE_WINDOWS = 2      # clean windows at a count before deciding again
HYSTERESIS = 0.03       # least predicted relative gain worth a move
TABU_WINDOWS = 12       # a count we left is not revisited for this many windows unless it measured better
CHANGE_RATIO_HERE = 2.0  # a count's loader time per batch or step time this far off its earlier windows there,
                         # the same way two windows running: the job changed (``AutoTuner._changed_here``)
WORKERS_PER_CPU_CAP = 4  # blocked (IO) time justifies workers beyond cores, within reason
TRAINER_BUSY_MIN = 0.05  # a training process busy less than this share of its step is not modelled as a CPU user
SATURATED_FRAC = 0.95    # a job whose processes used this share of its CPUs in a window has none for one more worker
MEMORY_RESERVE_FRAC = 0.10   # of the memory limit (cgroup, else MemTotal) kept free of loader workers
MEMORY_RESERVE_MIN = 256 << 20
MEMORY_BOUND_MARGIN = 0.5    # of the reserve: the band a memory bound holds through (``memory_cap``'s ``previous``)

# -- CPUs this process may use ------------------------------------------------------------------


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def cgroup_cpu_quota(proc_cgroup: str = "/proc/self/cgroup", cgroup_root: str = "/sys/fs/cgroup") -> float | None:
    """CPU cores allowed by the cgroup CPU quota of this process (and its ancestors), None if unlimited.

    v1: the line whose controller list holds ``cpu`` ("4:cpu,cpuacct:/a/b") -> <root>/<mount>/a/b with
    cpu.cfs_quota_us (-1 = none) / cpu.cfs_period_us; mount dir "cpu", "cpu,cpuacct" or "cpuacct,cpu".
    v2: the "0::/a/b" line -> <root>/a/b/cpu.max "max 100000" or "QUOTA PERIOD". The tightest level wins.
    """
    text = _read(Path(proc_cgroup))
    if not text:
        return None
    root = Path(cgroup_root)
    best: float | None = None

    def consider(v: float | None) -> None:
        nonlocal best
        if v is not None and v > 0 and (best is None or v < best):
            best = v

    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _hid, ctrls, rel = parts
        rel_parts = [p for p in rel.split("/") if p]
        if ctrls == "":  # v2 unified
            base = root if (root / "cgroup.controllers").exists() else root / "unified"
            for i in range(len(rel_parts), -1, -1):
                raw = _read(base.joinpath(*rel_parts[:i]) / "cpu.max")
                if raw:
                    q, _, per = raw.partition(" ")
                    if q != "max":
                        try:
                            consider(int(q) / int(per or 100000))
                        except ValueError:
                            pass
        elif "cpu" in ctrls.split(","):
            mounts = [root / ctrls, root / "cpu", root / "cpu,cpuacct", root / "cpuacct,cpu"]
            mount = next((m for m in mounts if (m / "cpu.cfs_quota_us").exists()), None)
            if mount is None:
                continue
            for i in range(len(rel_parts), -1, -1):
                d = mount.joinpath(*rel_parts[:i])
                q, per = _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
                try:
                    if q is not None and per and int(q) > 0:
                        consider(int(q) / int(per))
                except ValueError:
                    pass
    return best


def usable_cpus(proc_cgroup: str = "/proc/self/cgroup", cgroup_root: str = "/sys/fs/cgroup") -> float:
    """CPU cores this process may use: min(affinity CPU count, cgroup quota). Always > 0. The affinity
    is the process's main thread's, ``training_cpu_mask`` (``os.sched_getaffinity(0)`` in the tuner's
    thread is that thread's own, which ``os.sched_setaffinity(0, ...)`` in the training script, once the
    tuner runs, does not change); the loader's default ``max_workers`` counts the same mask."""
    mask = training_cpu_mask()
    affinity = float(len(mask) if mask else (os.cpu_count() or 1))
    quota = cgroup_cpu_quota(proc_cgroup, cgroup_root)
    return max(0.01, min(affinity, quota) if quota is not None else affinity)


def worker_cap(cpus: float, max_workers: int | None) -> int:
    cap = max(2, WORKERS_PER_CPU_CAP * math.ceil(cpus))
    return max(1, min(cap, max_workers)) if max_workers else cap


def memory_cap(stats: dict, room: float | None, limit: float | None, previous: int | None = None) -> int | None:
    """Most workers whose memory fits: (workers' memory now + ``room`` - reserve) / one worker's cost.

    ``stats``: ``loader.stats()``; ``room``: bytes more the process may take (None = unknown: no cap);
    ``limit``: the cgroup limit, else MemTotal, for the reserve. None when no worker was measured.

    ``previous``: the cap this caller last took (None: none yet). The room is MemAvailable, which moves
    with the page cache by a few percent from one second to the next: without a band, a cap near the
    workers' count went up and down with it (measured: 43 re-plans of a job's workers in 80 agent ticks
    at +-3%, tests/test_memory.py). So the cap keeps ``previous`` unless the figure moved past a margin of
    ``MEMORY_BOUND_MARGIN`` of the reserve: it tightens (to the figure now) only on a real shortage, when
    ``previous`` workers would eat into more than that margin of the reserve, and loosens only when one
    more worker fits with the margin to spare. Held through noise, the workers still leave half the
    reserve free."""
    if room is None:
        return None
    per = worker_cost(stats)
    if per is None or per <= 0:
        return None
    held = float(stats.get("worker_uss_bytes") or 0) + float(stats.get("shm_inflight_bytes") or 0)
    reserve = max(MEMORY_RESERVE_MIN, MEMORY_RESERVE_FRAC * limit) if limit else MEMORY_RESERVE_MIN
    fit = held + room - reserve
    cap = max(1, int(fit // per))
    if previous is None or cap == previous:
        return cap
    margin = MEMORY_BOUND_MARGIN * reserve
    if cap < previous:
        return cap if fit + margin < previous * per else previous
    return max(previous, int((fit - margin) // per))


def worker_cost(stats: dict) -> float | None:
    """One worker's measured memory, as ``memory_cap`` counts it: its mean USS plus its part of the
    batches in flight, and never less than the most one worker was measured to cost since the loader's
    workers first ran (``worker_cost_peak_bytes`` of ``adloader.DataLoader.stats()``, where the stats
    carry it). A worker's USS grows as it reads a dataset of Python objects (copy-on-read,
    ``adloader.memory``): measured right after workers start (a new epoch's, or one started by a
    resize), the mean understates what they will hold by the end of the epoch. None when no worker was
    measured."""
    n = stats.get("memory_workers") or 0
    if n <= 0:
        return None
    uss, shm = float(stats.get("worker_uss_bytes") or 0), float(stats.get("shm_inflight_bytes") or 0)
    now = uss / n + shm / max(1, int(stats.get("workers") or 0) or n)
    return max(now, float(stats.get("worker_cost_peak_bytes") or 0))


def memory_limits() -> tuple[float | None, float | None]:
    """(room, limit) for ``memory_cap``, from this process's cgroup and the node (read only)."""
    from adloader import memory

    cg = memory.cgroup_memory()
    total, available = memory.meminfo()      # (each file read once a call)
    return memory.room_of(available, cg), (cg.limit if cg.limit is not None else total)


# -- stats totals -> Observation ------------------------------------------------------------------

def observation_from_totals(prev: dict, cur: dict, cores: float, strict: bool = True, unstarved: bool = True):
    """One window from two ``loader.stats()`` totals (``Observation.from_window``: negative deltas
    count 0, one rule for blocked time); None if the window is unusable (no steps; figures the
    observation limits refuse, ``BadObservation``: that window is skipped, the next one is used; and
    when ``strict``, a resize in between, workers not yet at their target, or a pause of the training
    loop in it: the loader's ``paused_s`` rose, and the window's time holds the pause's seconds but
    none of its steps). ``unstarved``: the
    compute time less the trainer's run-queue wait (what the predictor's ``g`` means); False keeps the
    compute time as measured (what a report shows the user)."""
    from predictor.bank import window_batch_size
    from predictor.observation import BadObservation, Observation, as_batch_size, counter_deltas

    if strict and (cur.get("resizes", 0) != prev.get("resizes", 0) or cur.get("workers") != prev.get("workers")):
        return None
    if strict and cur.get("live_workers", cur.get("workers")) != cur.get("workers"):
        return None
    if strict and (cur.get("paused_s") or 0.0) > (prev.get("paused_s") or 0.0):
        return None     # the loop paused in it (a validation pass, a checkpoint): its time is no step's
    d = counter_deltas(prev, cur, ("compute_s", "samples", "steps"))
    compute = d["compute_s"]
    # the window's own batch size (samples over steps), as the agent takes it: the reported one is a batch
    # sampler's rounded mean since the loader started, which lags a change (``predictor.bank.window_batch_size``)
    reported = float(cur.get("batch_size") or 0)        # 0: not known yet (a batch sampler before its first batch)
    own, _, _ = window_batch_size(d["samples"], d["steps"], 1, reported)
    try:
        return Observation.from_window(prev, cur, workers=int(cur.get("workers") or 0), cores=float(cores),
                                       batch_size=as_batch_size(own if own is not None else (reported or 1)),
                                       compute_s=_unstarved_compute(compute, prev, cur) if unstarved else compute)
    except BadObservation as e:     # skipped: raised here, it would stop the tuner's thread for good
        log.debug("autotune: window skipped: %s", e)
        return None


def _unstarved_compute(compute_s: float, prev: dict, cur: dict) -> float:
    """The window's compute time less what the training process's main thread spent waiting for a CPU
    (``main_runq_s``; at least half of it is kept): the step with data ready and the trainer not starved,
    which is what the curve's ``g`` means (the agent's controller takes the same out)."""
    try:
        runq = max(0.0, float(cur["main_runq_s"]) - float(prev["main_runq_s"]))
    except (KeyError, TypeError, ValueError):
        return compute_s
    return max(0.5 * compute_s, compute_s - runq)


# -- the decision (pure) --------------------------------------------------------------------------


@dataclass
class AutoTuner:
    """Pure decision state for one loader. ``window(obs)`` -> new worker count or None (stay)."""
    cpus: float
    cap: int
    current: int
    bank: object = None
    job: str = "self"
    windows_here: int = 0
    n_windows: int = 0
    left_at: dict = field(default_factory=dict)      # count -> window index when we left it
    measured: dict = field(default_factory=dict)     # count -> best measured samples/s there
    history: list = field(default_factory=list)      # (window index, count) for every move
    came_from: int | None = None                     # the count before the last move
    reversals: dict = field(default_factory=dict)    # (low, high) -> times the tuner turned back between them
    trainer_cpu_s_per_step: float = 0.0              # the training process's own CPU per step (measured)
    cpu_used: float | None = None                    # CPUs the job's processes used last window (None = unknown)
    phase: int = 0                                   # the bank's new-phase count the evidence above is from
    here_sum: tuple = (0.0, 0.0)                     # (loader s per batch, step s) summed over the current
    here_n: int = 0                                  # ... count's windows since the job last changed
    off_here: tuple = ()                             # the last window's direction off them, per figure

    def __post_init__(self):
        if self.bank is None:
            from predictor.bank import PredictorBank
            self.bank = PredictorBank(prior="default")

    memory_cap: int | None = None                     # most workers memory allows (None = no bound known)

    def window(self, obs, memory_cap: int | None = None) -> int | None:
        self.n_windows += 1
        if memory_cap is not None:
            self.memory_cap = memory_cap
        if self.memory_cap is not None and self.current > max(1, self.memory_cap):
            return self._move(max(1, self.memory_cap))   # memory first: shed now, whatever the hysteresis
        if obs is None or obs.workers != self.current:
            return None
        self.bank.observe(self.job, obs)
        phase = self.bank.phase_changes(self.job)
        if phase != self.phase:
            self._forget_old_phase(phase)
        if self._changed_here(obs):
            self._forget()
            self._changed_here(obs)         # (the new job's first window at this count)
            self.windows_here = 0           # settle on the new job before deciding
        self.windows_here += 1
        prev = self.measured.get(self.current, 0.0)
        self.measured[self.current] = max(prev, obs.samples_per_s) if self.windows_here > 1 else obs.samples_per_s
        if self.windows_here < SETTLE_WINDOWS or any(self.off_here):
            return None     # (a window off the count's earlier ones: the next tells noise from a change)
        curve = self.bank.curve(self.job)
        if curve is None:
            return None
        want = max(1, min(self.cap, self.useful_workers(curve)))
        if self.memory_cap is not None:
            want = min(want, max(1, self.memory_cap))
        if want == self.current:
            return None
        if want > self.current:
            # at most double per move: the curve is refined at each count on the way
            want = min(want, max(self.current + 1, 2 * self.current))
            if self.cpu_used is not None and self.cpu_used >= SATURATED_FRAC * self.cpus:
                # the trainer and the workers already used every CPU the job may use: another worker
                # would only share them, whatever blocked time the curve counts (see the module doc)
                return None
        now_pred = self.predict(curve, self.current)
        want_pred = self.predict(curve, want)
        # every time the tuner has turned back between these two counts, the predicted difference
        # that justifies another move between them doubles (growing) or halves (shedding): measurement
        # noise on a flat stretch of the curve cannot keep it hopping; a real change of phase can
        h = HYSTERESIS * 2.0 ** min(self.reversals.get(_pair(self.current, want), 0), 10)
        if want > self.current:
            if now_pred > 0 and want_pred < now_pred * (1 + h):
                return None
            if curve.observed_configs < 2 and curve.core_correction is not None:
                # from one configuration the job's windows cannot tell the worker term's correction
                # from the core term's (on one CPU both are the same CPU): a gain that exists only in
                # the prior's ratio between the two is not the job's evidence. Grow on the gain its own
                # costs promise with one correction for both terms.
                same = dataclasses.replace(curve, core_correction=None)
                now_same = self.predict(same, self.current)
                if now_same > 0 and self.predict(same, want) < now_same * (1 + h):
                    return None
        else:
            if want_pred < now_pred * (1 - HYSTERESIS * HYSTERESIS / h):
                return None
        here = self.measured.get(self.current, 0.0)
        if want in self.measured and self.measured[want] < here * (1 - HYSTERESIS):
            return None  # measured worse there: evidence beats the model
        left = self.left_at.get(want)
        if left is not None and self.n_windows - left < TABU_WINDOWS:
            # we were there recently: go back only if it measured better than here
            if self.measured.get(want, 0.0) <= self.measured.get(self.current, 0.0) * (1 + HYSTERESIS):
                return None
        if want == self.came_from:
            key = _pair(self.current, want)
            self.reversals[key] = self.reversals.get(key, 0) + 1
        return self._move(want)

    def _move(self, want: int) -> int:
        """Go to ``want`` workers: the count left is remembered (tabu, turns), the move recorded."""
        self.came_from, self.left_at[self.current] = self.current, self.n_windows
        self.history.append((self.n_windows, want))
        self.current, self.windows_here = want, 0
        self.here_n, self.off_here = 0, ()
        return want

    def _forget_old_phase(self, phase: int) -> None:
        """The bank found a new phase of the job (``predictor.bank``: its pipeline or model changed) and
        dropped the windows before it. What the tuner measured before it is as stale: the throughput
        each count gave (a light phase's 1 worker measured 3x a heavy phase's, and "measured worse
        there" held the heavy phase's 3 workers through a light phase for good), the counts it left
        (tabu) and its turns between two counts (a phase that moves the knee is not noise)."""
        self.phase = phase
        self._forget()

    def _changed_here(self, obs) -> bool:
        """Whether the job changed under the current count: two windows running whose loader time per
        batch (its workers' CPU and blocked time) or step time (compute and data wait, so not pauses
        outside the training loop) is ``CHANGE_RATIO_HERE`` off the mean of the count's earlier windows,
        the same way. The bank starts a new phase on CPU per sample or compute per step only (blocked
        time is too noisy for its finer ratios); a change in IO latency (a page cache warmed, storage
        busy, a shard elsewhere) moved neither, and what the tuner measured before it held the job: 1
        worker's 800 samples/s from fast fetches kept it at 1 worker through slow ones for good (200,
        where 4 workers gave 800). At one count, our own worker count does not move these figures."""
        x = (obs.cpu_s_per_batch + obs.blocked_s_per_batch, obs.step_s)
        if self.here_n <= 0:
            self.here_sum, self.here_n, self.off_here = x, 1, ()
            return False
        off = tuple(_off(v, t / self.here_n) for v, t in zip(x, self.here_sum))
        if any(d and d == p for d, p in zip(off, self.off_here)):
            return True
        self.off_here = off
        if not any(off):
            self.here_sum = tuple(t + v for t, v in zip(self.here_sum, x))
            self.here_n += 1
        return False

    def _forget(self) -> None:
        self.measured.clear()
        self.left_at.clear()
        self.reversals.clear()
        self.came_from = None
        self.here_n, self.off_here = 0, ()

    def cpus_changed(self, cpus: float, cap: int) -> int | None:
        """The CPUs this process may use changed while it runs (its affinity or its cgroup's CPU quota:
        a Kubernetes in-place resize, a batch scheduler's cpuset moved, an operator's taskset): the
        knee and the cap follow them, and what the tuner measured on the old CPUs is no evidence on
        the new (forgotten, as a phase's is; the bank keeps its windows: each says its cores). A count
        above the new cap is shed at once, whatever the hysteresis: returned; else None."""
        self.cpus, self.cap = float(cpus), max(1, int(cap))
        self._forget()
        self.windows_here = 0
        return self._move(self.cap) if self.current > self.cap else None

    def _trainer_busy(self, curve) -> bool:
        """The training process needs CPU worth modelling: at least TRAINER_BUSY_MIN of its step."""
        # (under a CPU quota below one core the per-thread sharing model does not hold: the quota
        # throttles the whole group, trainer and workers alike; there the plain curve decides)
        return self.cpus >= 1.0 and \
            self.trainer_cpu_s_per_step >= TRAINER_BUSY_MIN * max(curve.compute_s_per_step, 1e-9)

    def useful_workers(self, curve) -> int:
        """Max useful workers on our CPUs: with a training process that needs CPU, the least count within
        KNEE_TOLERANCE of the best ``predict`` over 1..cap, its trainer sharing the CPUs with the workers
        (can be below the count that keeps the queue full; ``shared_cpu_knee`` over ``predict``)."""
        if not self._trainer_busy(curve):
            return curve.knee_workers(self.cpus)
        from predictor.curve import least_near_best

        return least_near_best([self.predict(curve, w) for w in range(1, max(1, self.cap) + 1)])

    def predict(self, curve, workers: int) -> float:
        """Predicted samples/s at ``workers`` on our CPUs. With a busy trainer, the shared-CPU model,
        bounded by the curve itself: that model has no core-bound term (the CPUs appear only as the
        workers' share of them), so a correction below 1 that the job's own windows put on both terms
        (the CPUs deliver less than first principles: neighbours on them, SMT siblings) read there as
        slow workers on idle CPUs, and more of them as the cure (7 workers for a CPU-bound job whose
        curve tops out at 2 on 2 CPUs). Sharing the CPUs with the trainer can only cost throughput."""
        plain = curve.throughput(workers, self.cpus)
        if self._trainer_busy(curve):
            from predictor.curve import shared_cpu_throughput

            return min(plain, shared_cpu_throughput(curve, workers, self.cpus, self.trainer_cpu_s_per_step))
        return plain


def trainer_cpu_s_per_step(prev: dict, cur: dict) -> float | None:
    """The training process's own CPU seconds per step between two ``loader.stats()`` totals (None
    without steps or without the ``main_cpu_s`` total)."""
    if "main_cpu_s" not in cur or "main_cpu_s" not in prev:
        return None
    steps = float(cur.get("steps", 0) or 0) - float(prev.get("steps", 0) or 0)
    if steps <= 0:
        return None
    return max(0.0, float(cur["main_cpu_s"]) - float(prev["main_cpu_s"])) / steps


def _pair(a: int, b: int) -> tuple[int, int]:
    return (a, b) if a < b else (b, a)


def _off(value: float, ref: float) -> int:
    """+1 / -1 when ``value`` is CHANGE_RATIO_HERE times ``ref`` or more / or less, else 0 (0 also
    when either is not positive: nothing to compare)."""
    if value <= 0 or ref <= 0:
        return 0
    r = value / ref
    return 1 if r >= CHANGE_RATIO_HERE else -1 if r <= 1.0 / CHANGE_RATIO_HERE else 0


# -- the thread -----------------------------------------------------------------------------------

_lock = threading.Lock()
_tuners: dict[int, "_Thread"] = {}


class _Thread(threading.Thread):
    def __init__(self, loader, cpus: float, window_s: float):
        super().__init__(name="adloader-autotune", daemon=True)
        self.loader_ref = weakref.ref(loader)   # weak: a loader the script drops is collected, and we stop
        self.key = id(loader)
        self.stop_event = threading.Event()
        self.window_s = window_s
        self.state_lock = threading.Lock()      # the tuner's state, between a window and a copy of it
        self.signature = loader_signature(loader)
        cap = worker_cap(cpus, getattr(loader, "max_workers", None))
        carried = carried_tuner(self.signature, cpus)
        if carried is not None:     # what the last loader over this data learned (see ``loader_signature``)
            carried.cap, carried.current = cap, int(loader.num_workers)
            carried.windows_here, carried.here_n, carried.off_here, carried.cpu_used = 0, 0, (), None
            log.info("autotune: starting from what the last loader over this dataset learned (%d workers, "
                     "%d counts measured)", carried.current, len(carried.measured))
        self.tuner = carried if carried is not None else AutoTuner(cpus=cpus, cap=cap, current=int(loader.num_workers))
        self.cpu_meter = ProcessesCpu()
        _publish(self)

    def run(self) -> None:
        try:
            loader = self.loader_ref()
            prev = loader.stats() if loader is not None else None
            pids = self._pids(loader) if loader is not None else []
            loader = None       # (held only while read: a loader the script drops is collected)
            self.cpu_meter.read(pids)
            while prev is not None and not self.stop_event.wait(self.window_s):
                loader = self.loader_ref()
                if loader is None:
                    break
                cur = loader.stats()
                obs = observation_from_totals(prev, cur, self.tuner.cpus)
                t = trainer_cpu_s_per_step(prev, cur)
                if t is not None:   # smoothed: one window's figure moves it a third of the way
                    old = self.tuner.trainer_cpu_s_per_step
                    self.tuner.trainer_cpu_s_per_step = t if old <= 0 else old + (t - old) / 3.0
                prev = cur
                self.tuner.cpu_used = self.cpu_meter.read(self._pids(loader))
                self.tuner.current = int(cur.get("workers", self.tuner.current))
                cpus = usable_cpus()
                if abs(cpus - self.tuner.cpus) > 1e-6:
                    log.info("autotune: the CPUs this process may use changed from %.2f to %.2f",
                             self.tuner.cpus, cpus)
                    obs = None      # (a window across the change is measured on neither)
                    with self.state_lock:
                        shed = self.tuner.cpus_changed(cpus, worker_cap(cpus, getattr(loader, "max_workers", None)))
                    if shed is not None and not self.stop_event.is_set():
                        _resize(loader, shed)
                try:
                    mcap = memory_cap(cur, *memory_limits(), previous=self.tuner.memory_cap)
                except Exception:   # noqa: BLE001 — unreadable memory figures: no memory bound
                    mcap = None
                with self.state_lock:
                    want = self.tuner.window(obs, mcap)
                if want is not None and not self.stop_event.is_set():
                    log.debug("autotune: %s -> %s workers", cur.get("workers"), want)
                    _resize(loader, want)
                loader = None
        except Exception as e:  # never into training: the loader keeps its current count
            log.warning("adloader autotune stopped: %s", e)
        finally:
            with _lock:
                if _tuners.get(self.key) is self:
                    del _tuners[self.key]

    @staticmethod
    def _pids(loader) -> list[int]:
        try:
            return [os.getpid(), *loader.worker_pids()]
        except Exception:   # noqa: BLE001 — a loader without worker pids: its use is not measured
            return []


def _resize(loader, n: int) -> None:
    """``loader.resize(n)``, through a warning that the filters made an exception (``python -W error``,
    ``warnings.simplefilter("error")``): the loader warns after the resize is done (an IterableDataset
    resizes at the next epoch, and says so), and the tuner, which the training script did not ask for
    that resize, goes on."""
    try:
        loader.resize(n)
    except Warning as w:
        log.debug("autotune: resize(%d) warned: %s", n, w)


# -- what one auto loader learned, for the next one over the same data ---------------------------

CARRY_MAX = 8       # signatures remembered per process (the most recent)
_carry: dict[tuple, "_Thread"] = {}     # signature -> the latest tuner thread for it (guarded by _carry_lock)
_carry_lock = threading.Lock()          # (not _lock: attach() builds a thread, which reads this, under _lock)


def loader_signature(loader) -> tuple | None:
    """What makes two loaders of one process "the same input pipeline" for the tuner: the dataset's type
    and length, the batch size, and the collate and worker-init functions (by module and name). A script
    that builds a new ``num_workers="auto"`` loader every epoch (over the same dataset, or a new one of
    the same kind) would otherwise start every epoch from ``initial_workers`` and an empty curve, and an
    epoch shorter than the tuner's settling never reached its count. Two loaders with the same signature
    that are not the same pipeline (a train and a validation set of one class, length and batch size)
    share a start: the tuner forgets what it measured when the job's windows change under it
    (``AutoTuner._changed_here``, the bank's phases), as it does for a job that changes. None where the
    loader cannot be read (nothing carried)."""
    def name(fn):
        if fn is None:
            return None
        f = getattr(fn, "func", fn)     # functools.partial: its function
        return (getattr(f, "__module__", None), getattr(f, "__qualname__", type(f).__qualname__))

    try:
        ds = loader.dataset
        try:
            n = len(ds)
        except Exception:   # noqa: BLE001 — an IterableDataset without __len__
            n = None
        return (type(ds).__module__, type(ds).__qualname__, n, getattr(loader, "batch_size", None),
                name(getattr(loader, "collate_fn", None)), name(getattr(loader, "worker_init_fn", None)))
    except Exception:       # noqa: BLE001
        return None


def _publish(thread: "_Thread") -> None:
    """Make ``thread`` the latest tuner for its signature (at most ``CARRY_MAX`` kept, oldest dropped)."""
    if thread.signature is None:
        return
    with _carry_lock:
        _carry.pop(thread.signature, None)
        _carry[thread.signature] = thread
        while len(_carry) > CARRY_MAX:
            del _carry[next(iter(_carry))]


def _carried(signature, cpus: float, take):
    """``take(tuner)`` of the latest tuner with ``signature``, under its state lock, if it tuned on the
    same CPUs and has seen at least one window; else None. The one lookup behind ``carried_tuner`` and
    ``carried_count``."""
    if signature is None:
        return None
    with _carry_lock:
        thread = _carry.get(signature)
    if thread is None:
        return None
    with thread.state_lock:
        if abs(thread.tuner.cpus - cpus) > 1e-6 or thread.tuner.n_windows == 0:
            return None
        return take(thread.tuner)


def carried_tuner(signature, cpus: float) -> AutoTuner | None:
    """A copy of what the latest tuner with ``signature`` learned (its curve, its measured counts, the
    count it was at), if it tuned on the same CPUs; else None. The copy is the new loader's own: the
    earlier loader, if it is still running, goes on with its own."""
    import copy

    return _carried(signature, cpus, copy.deepcopy)


def carried_count(signature, cpus: float) -> int | None:
    """Only the count the latest tuner with ``signature`` was at, on the same terms as ``carried_tuner``
    (``initial_workers``: no copy of the curve for one number); else None."""
    return _carried(signature, cpus, lambda tuner: tuner.current)


class ProcessesCpu:
    """CPUs a set of processes used between two reads (every thread; from /proc through psutil). A
    process that appears or ends between the reads is left out of that window's figure; None when no
    process was read at both ends or no time passed."""

    def __init__(self, clock=None):
        self.clock = clock or time.monotonic
        self.last: tuple[float, dict[int, float]] | None = None

    def read(self, pids) -> float | None:
        import psutil

        now, times = self.clock(), {}
        for pid in pids:
            try:
                t = psutil.Process(pid).cpu_times()
                times[pid] = t.user + t.system
            except (psutil.Error, OSError):
                continue
        last, self.last = self.last, (now, times)
        if last is None or now <= last[0]:
            return None
        both = [pid for pid in times if pid in last[1]]
        if not both:
            return None
        return sum(max(0.0, times[p] - last[1][p]) for p in both) / (now - last[0])


def start_workers(cpus: float, max_workers: int | None = None, ranks: int = 1, part: float = 1.0) -> int:
    """The first count for a loader on ``cpus`` usable CPUs shared by ``ranks`` processes of its job,
    whose part of those CPUs is ``part`` (``gpu_part``): one worker per CPU of its rank's part, at least
    1, within ``max_workers`` (``initial_workers``)."""
    n = max(1, math.floor(cpus * min(1.0, max(0.0, part)) / max(1, ranks) + 1e-9))
    return max(1, min(n, max_workers)) if max_workers else n


NVIDIA_GPUS_DIR = "/proc/driver/nvidia/gpus"


def node_gpu_count(gpus_dir: str | None = None) -> int:
    """GPUs the NVIDIA driver shows on this node: the entries of /proc/driver/nvidia/gpus (one per GPU,
    named by PCI address). 0 where there is no driver or the directory is not visible. Read without
    NVML or CUDA, so a training process pays a directory listing for it."""
    try:
        return sum(1 for e in os.scandir(gpus_dir or NVIDIA_GPUS_DIR) if e.is_dir())
    except OSError:
        return 0


def gpu_part(environ=None, node_gpus: int | None = None, ranks: int = 1) -> float:
    """The job's part of the node by GPUs: its GPUs over the node's (``node_gpu_count``), 1.0 where
    either is unknown. Its GPUs: those this process sees (``env.gpus``: CUDA_VISIBLE_DEVICES, else
    SLURM_JOB_GPUS), at least one per process of the job on this node (``ranks``: launchers that give
    each rank a GPU of its own show each rank one). A process that names no GPU sees them all: 1.0."""
    from adloader import env

    return part_of_node(len(env.gpus(environ)), node_gpu_count() if node_gpus is None else int(node_gpus), ranks)


def part_of_node(job_gpus: int, node_gpus: int, ranks: int = 1) -> float:
    """A job's GPUs (at least one per rank) over the node's, at most 1; 1.0 where either count is unknown
    (0). ``gpu_part``'s arithmetic, which the simulator's model of the loader uses as well."""
    if job_gpus <= 0 or node_gpus <= 0:
        return 1.0
    return min(1.0, max(job_gpus, max(1, ranks)) / node_gpus)


def whole_node(cpus: float) -> bool:
    """Whether ``cpus`` (``usable_cpus``) is every CPU of the node: nobody (a batch scheduler's cpuset,
    a container's quota) has given this process a part of its own."""
    return cpus >= (os.cpu_count() or 1) - 0.5


def default_max_workers(cpus: float, auto: bool = False) -> int:
    """``max_workers`` as the loader defaults it for ``cpus`` CPUs in its affinity mask: one worker per
    CPU (at least 1; a fixed ``num_workers`` above that raises it); with ``num_workers="auto"``
    (``auto``) the tuner's own bound, ``worker_cap``: blocked (IO) time needs workers, not cores, and a
    bound of one per CPU held an IO-bound job whose curve asked for 5 workers at 2 on 2 idle CPUs. The
    DataLoader calls this, and a model of the loader (the simulator's node, whose mask is the whole
    node) starts from it."""
    if auto:
        return worker_cap(cpus, None)
    return max(1, math.floor(cpus + 1e-9))


def initial_workers(loader) -> int:
    """A safe first count: one worker per usable CPU of the job's part of the node over its processes
    on this node (``env.local_world_size``: eight torchrun ranks on a 48-CPU node start at 6 workers
    each, not 48 each, whose memory no one has measured yet), at least 1, within the loader's
    max_workers. The job's part: where the process may use every CPU of the node (no cpuset or quota of
    its own), its GPUs' part of the node's (``gpu_part``): a job with 1 of 8 GPUs on a shared 48-CPU
    node starts at 6 workers, not 48 (eight such jobs started 384 workers before any was measured);
    where a scheduler gave it CPUs of its own, those are its part. The tuner grows from there where
    more workers pay (where the launcher bound each rank to CPUs of its own, their count over the ranks
    starts it low and the tuner's doubling climbs back)."""
    try:
        from adloader import env

        cpus, ranks = usable_cpus(), env.local_world_size()
        carried = carried_count(loader_signature(loader), cpus)
        if carried is not None:     # the count the last loader over this data was tuned to
            return max(1, min(carried, worker_cap(cpus, getattr(loader, "max_workers", None))))
        part = gpu_part(ranks=ranks) if whole_node(cpus) else 1.0
        return start_workers(cpus, getattr(loader, "max_workers", None), ranks, part)
    except Exception:
        return 1


def attach(loader, window_s: float | None = None) -> None:
    """Start tuning ``loader`` (idempotent; returns at once)."""
    try:
        with _lock:
            t = _tuners.get(id(loader))
            if t is not None and t.is_alive() and t.loader_ref() is loader:
                return
            t = _Thread(loader, usable_cpus(), window_s or WINDOW_S)
            _tuners[id(loader)] = t
            t.start()
    except Exception as e:
        log.warning("adloader autotune not started: %s", e)


def detach(loader, timeout_s: float = 1.0) -> None:
    """Stop tuning ``loader`` (idempotent). The loader keeps the count it has."""
    with _lock:
        t = _tuners.pop(id(loader), None)
    if t is not None:
        t.stop_event.set()
        if t is not threading.current_thread():
            t.join(timeout_s)


def tuner_of(loader) -> AutoTuner | None:
    """The decision state of ``loader``'s tuner (for tests and ``adloader profile``)."""
    t = _tuners.get(id(loader))
    return t.tuner if t is not None else None
