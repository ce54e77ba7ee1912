"""The controller: one ``tick(now)`` is snapshot -> observe/predict -> decide -> diff -> apply -> record.

Invariants (what the tests hold it to):
- ``tick`` never raises. A snapshot, predictor or policy failure is recorded in ``TickRecord.errors``
  and the applied state is left as it is; an actuator failure is that job's ``ApplyResult(ok=False)``.
- Desired and applied state are kept apart, per actuator. An actuator is called for a job only when
  the job's desired allocation differs from what that actuator last applied for it (cores compared
  with a small tolerance, the reason ignored), or, for actuators with ``tracks_pids = True`` (cgroup,
  affinity), when the job's loader worker pids changed since that actuator last applied, or, for
  actuators with ``tracks_ranks = True`` (the directive), when the job's training processes did (a rank
  joined, left or was restarted: its ranks' part of an unchanged count is not what was sent), or, for
  actuators with a ``lost_group(job)`` check (cgroup), when it says what was made for the job is gone
  (removed by someone else; asked only while the actuator's lane is free; ``_lost_group``).
- Breaker: three failed applies in a row of one actuator for one job open that breaker; the actuator
  is skipped for that job (its result says so) until ``breaker_retry_s`` has passed, then one apply is
  tried again (half-open). Other jobs, and the job's other actuators, are never affected: a cgroup
  write the kernel refuses does not stop the job's worker counts. Open breakers are visible in
  ``TickRecord.breakers``.
- A job present in ``applied()`` or in an earlier snapshot but absent from this one has departed: it is
  forgotten (every actuator releases it, the predictor forgets it) in that tick, before the policy runs,
  so the policy hands its share out in the same tick. (Also a job whose allocation is in force on no
  actuator or only some: one that failed the others still made a group for it or was fed its windows.)
- The predictor gets a job's window at most once per ``observe_interval_s`` (default 3 s); a job's
  first window is fed as soon as there is one, and each job's later observations are phase-shifted by
  a hash of its id so that jobs that arrived together do not all rebuild their curves in the same tick
  (with 64 clients that rebuild was most of the agent's tick). Its curve is asked for again only after
  an observation.
- Observation hygiene: where the snapshot carries the ranks' reports (``JobStats.history``: the real
  collector), a window is cut from their raw totals (``agent.collector.settled_window``): it starts no
  earlier than the job's last change of configuration (workers, CPU set, IO weight) and the end of its
  last window, holds one worker count with every worker live, and starts after the loop's first step;
  windows do not overlap. It may span changes of the job's cores alone: its cores are then the
  time-weighted mean of the cores applied over it. Smoothed
  figures are never fed to the predictor there: a second after a change they still hold most of the
  previous configuration. Without reports (the simulator, hand-made stats) the smoothed figures are
  the window, and one that started before the last change was applied (``now - window_s <
  applied_at``) is not fed; the job is observed again once a whole window lies after the change. A job
  with reports but no settled window for ``UNSETTLED_FALLBACK_S`` (its worker count never holds still
  that long) is observed from the smoothed figures, by the same rule, until it has one again; not one
  whose loop took no step over that time (paused in a debugger, hung, in a long validation pass): its
  wait starts again, from when it steps again (``agent.collector.stepped_since``). Only
  a change of the allocation counts (workers, cores, cpuset, IO weight), not re-applying the same one
  to new worker pids.
- ``applied`` is the controller's alone: the snapshot source measures, the controller adds what is in
  force on every actuator (``NodeSnapshot.applied``) before it observes and decides, so hysteresis is
  judged against what is really in force and nothing upstream needs to know it.
- The plan's ``NodeAllocation`` (the loaders together against the rest of the node) goes, after the
  jobs' allocations, to every actuator that has ``apply_node``, when it differs from what that
  actuator last applied; a failure is a tick error and is retried at the next tick. What is in force
  everywhere is ``NodeSnapshot.applied_node``.
- An actuator call never holds the tick for longer than ``actuator_timeout_s`` (config key, default 5 s):
  each actuator that may block (all but those with ``may_block = False``, the directive actuator) is
  called on a worker thread of its own (``ActuatorLane``) and waited for that long. A call that has not
  returned by then is that job's failure in this tick (counted by its breaker; a hung ``release`` is
  retried like a raising one, a hung ``apply_node`` is a tick error), and the lane is busy until the call
  returns: no other call is made to that actuator (for any job) in the meantime, so a hung actuator
  holds one thread, never one more per tick, and is never called from two threads at once. A call that
  returns late is dropped: what it applied is not recorded as in force, so the next tick applies the
  difference again.
- Only the job whose call hung is charged for the hang. While the lane is busy, that job's own later
  applies are refused and each counts against its breaker (so it opens after the timeout and two more
  ticks, as three raising applies would). Another job's apply that the busy lane kept from running
  (refused at submit, queued behind the hung call, or not started in time) is not a failure of that
  job: its breaker is left as it is, nothing is recorded as applied (the diff tries again at each tick,
  and the change goes in once the lane is free), and its result says ``actuator busy: <actuator>
  <call> running for N s``. A busy ``apply_node`` or ``restore`` (a call for no job) charges no job.
- A tick submits every job's calls before it waits for the first, and a lane runs its calls back to
  back in that order (each actuator still sees the jobs one at a time, in the plan's order, then
  ``apply_node``): one thread hand-off per actuator per tick, not one per call (about 0.1 ms each on
  the dev VM).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Protocol, Sequence

from agent import logs
from agent.collector import settled_window, stepped_since
from agent.model import AllocationPlan, ApplyResult, JobAllocation, JobStats, NodeAllocation, NodeSnapshot, live_workers
from agent.policies import (ForeignPattern, Policy, PolicyConfig, cpu_starved_loader, grown_loader_cpus,
                            plan_around_epochs, trainer_compute_s)
from predictor.curve import ThroughputCurve
from predictor.observation import BadObservation, Observation, as_batch_size

log = logging.getLogger("agent.controller")

BREAKER_FAILURES = 3
CPUS_TOLERANCE = 0.01      # cores; smaller changes are not a difference worth applying
OBSERVE_INTERVAL_S = 3.0   # default: a job's window is fed to the predictor at most this often
MIN_OBSERVE_S = 0.9        # the shortest window fed to it (about one client report period, REPORT_S)
UNSETTLED_FALLBACK_S = 15.0   # no settled window for this long: the smoothed figures are the window
OBSERVED_CORES = ("share", "received")
DRAINING_FACTOR, DRAINING_SLACK_CORES = 2.0, 0.1   # a window that delivered more than this was draining a queue
ACTUATOR_TIMEOUT_S = 5.0   # default: the longest the tick waits for one actuator call
LANE_IDLE_S = 10.0         # an actuator lane's worker thread exits after this long without a call


class ActuatorLane:
    """One actuator's calls, made on a worker thread of the lane's own, one at a time, each waited for at
    most ``timeout_s`` (see the module docstring).

    ``call(fn, *args, timeout_s=...)`` returns ``(True, result)`` or raises what ``fn`` raised, or, where
    the call did not return in time or an earlier one is still running, returns ``(False, why)`` and
    leaves the lane busy until that call returns. A call that was never made says so: its ``ran`` is
    False and ``blocked_by`` is the hung call it was refused behind (None: not started in time), whose
    ``key`` (given at ``submit``: the job it is for) tells the caller whose hang it was. ``call`` is
    ``wait(submit(...))``: a caller with many calls submits them all, then waits for each in turn. The
    worker thread is started on the first call and exits after ``LANE_IDLE_S`` without one (a
    controller's lanes hold no thread while nothing is applied); a hung call holds it, and only it. A
    lane outlives a controller: the agent hands its lanes to the controller a reload builds, so the new
    one does not call an actuator its predecessor's hung call still holds.
    """

    def __init__(self, name: str = "actuator") -> None:
        self.name = name
        self._cond = threading.Condition()
        self._queued: list = []                # submitted, not yet started, in order
        self._busy: Optional[_Call] = None     # the call that outlived its wait, until it returns
        self._worker = False                   # whether a worker thread is alive

    def busy(self) -> Optional[str]:
        """What the lane's hung call is and how long it has run, or None when the lane is free."""
        with self._cond:
            b = self._busy
            return None if b is None else f"{b.what} still running after {b.running_s():.1f} s"

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` for a hung call to return; whether the lane is free."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._cond:
            while self._busy is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def _refuse(self, c: "_Call") -> None:
        """(Under the lock.) ``c`` is not made: the lane's hung call is still running."""
        b = self._busy
        c.blocked_by = b
        c.refused = f"not called: {b.what} still running after {b.running_s():.1f} s"
        c.done.set()

    def submit(self, fn: Callable, *args, what: str = "call", key: Optional[str] = None) -> "_Call":
        """Queue ``fn(*args)`` and return at once; ``wait`` gives its outcome. Calls run in the order they
        were submitted, back to back, so a tick that submits every job's call before it waits for the
        first pays one thread hand-off, not one per call. Refused at once while a call is hung.
        ``key``: whom the call is for (a job id; None: no job), for whoever reads ``blocked_by``."""
        c = _Call(fn, args, what, key)
        with self._cond:
            if self._busy is not None:
                self._refuse(c)
                return c
            self._queued.append(c)
            if self._worker:
                self._cond.notify_all()
            else:
                self._worker = True
                threading.Thread(target=self._run, name=f"adloader-actuator-{self.name}", daemon=True).start()
        return c

    def wait(self, c: "_Call", timeout_s: float):
        """The outcome of a submitted call, waited for at most ``timeout_s``: ``(True, result)``, what it
        raised, or ``(False, why)``. Wait for calls in the order they were submitted: where one has not
        returned in time, the lane is busy until it does, and the calls queued behind it are refused."""
        if c.refused is None:
            c.done.wait(max(0.0, timeout_s))
        with self._cond:
            if c.refused is not None:
                return False, c.refused
            if not c.done.is_set():           # (under the lock: the worker cannot finish it unseen)
                if c in self._queued:          # never started (no worker got to it): nothing is running
                    self._queued.remove(c)
                    return False, f"{c.what} not started within {timeout_s:g} s"
                self._busy = c
                for q in self._queued:         # they would run after the hung call: none is made
                    self._refuse(q)
                self._queued.clear()
                return False, f"{c.what} timed out after {timeout_s:g} s (not called again until it returns)"
        if c.error is not None:
            raise c.error
        return True, c.result

    def call(self, fn: Callable, *args, timeout_s: float, what: str = "call"):
        return self.wait(self.submit(fn, *args, what=what), timeout_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queued:
                    if not self._cond.wait(LANE_IDLE_S) and not self._queued:
                        self._worker = False
                        return
                c = self._queued.pop(0)
                c.ran, c.started = True, time.monotonic()
            try:
                c.result = c.fn(*c.args)
            except BaseException as e:   # noqa: BLE001 — handed to the caller, who records it
                c.error = e
            with self._cond:
                c.done.set()
                if self._busy is c:
                    self._busy = None
                    logs.event(log, "actuator_returned_late", logging.WARNING, actuator=self.name, call=c.what,
                               after_s=round(c.running_s(), 3),
                               detail="its result is dropped; the next tick applies the difference again")
                self._cond.notify_all()


class _Call:
    __slots__ = ("fn", "args", "what", "key", "ran", "started", "done", "result", "error", "refused",
                 "blocked_by")

    def __init__(self, fn: Callable, args: tuple, what: str, key: Optional[str] = None) -> None:
        self.fn, self.args, self.what, self.key = fn, args, what, key
        self.ran = False                       # whether the lane's thread began it (set under the lane's lock)
        self.started = time.monotonic()        # when submitted; reset when it starts to run
        self.done = threading.Event()
        self.result = None
        self.error: Optional[BaseException] = None
        self.refused: Optional[str] = None     # why it was never called (a hung call before it)
        self.blocked_by: Optional[_Call] = None   # that hung call

    def running_s(self) -> float:
        return time.monotonic() - self.started


class PredictorLike(Protocol):
    def observe(self, job_id: str, obs: Observation) -> None: ...

    def curve(self, job_id: str) -> Optional[ThroughputCurve]: ...

    def forget(self, job_id: str) -> None: ...


@dataclass
class TickRecord:
    now: float
    duration_s: float
    plan: AllocationPlan
    results: dict[str, ApplyResult]            # only jobs something was applied to (or skipped by a breaker)
    curves: dict[str, dict]                    # job -> curve summary (see ``curve_summary``)
    breakers: dict[str, str] = field(default_factory=dict)   # job -> why its breaker is open
    departed: tuple[str, ...] = ()             # jobs forgotten in this tick
    errors: tuple[str, ...] = ()               # tick-level failures (snapshot, predictor, policy)
    phases_ms: dict[str, float] = field(default_factory=dict)   # snapshot, predict, policy, apply
    node_notes: tuple[str, ...] = ()           # what the actuators said of the node allocation this tick

    def to_dict(self) -> dict:
        def alloc(a: Optional[JobAllocation]) -> Optional[dict]:
            return None if a is None else dataclasses.asdict(a)

        return {
            "now": self.now,
            "duration_s": self.duration_s,
            "policy": self.plan.policy,
            "allocations": {j: alloc(a) for j, a in self.plan.allocations.items()},
            "unsatisfied": dict(self.plan.unsatisfied),
            "predicted_total": self.plan.predicted_total,
            "results": {j: {"ok": r.ok, "applied": alloc(r.applied), "error": r.error,
                            "not_enforced": list(r.not_enforced)} for j, r in self.results.items()},
            "curves": self.curves,
            "breakers": dict(self.breakers),
            "departed": list(self.departed),
            "errors": list(self.errors),
            "phases_ms": dict(self.phases_ms),
            "node": None if self.plan.node is None else {
                "loaders_yield": self.plan.node.loaders_yield, "reason": self.plan.node.reason,
                "notes": list(self.node_notes)},
        }


def curve_summary(curve: Optional[ThroughputCurve]) -> dict:
    if curve is None:
        return {"source": "none", "confidence": 0.0}

    def fin(x: float) -> Optional[float]:
        return round(x, 4) if math.isfinite(x) else None

    return {
        "source": curve.source,
        "confidence": round(curve.confidence, 3),
        "ceiling_samples_per_s": fin(curve.ceiling_samples_per_s),
        "max_useful_workers": curve.max_useful_workers,
        "max_useful_cores": fin(curve.max_useful_cores),
        "cpu_s_per_batch": curve.cpu_s_per_batch,
        "compute_s_per_step": curve.compute_s_per_step,
        "phase_changes": curve.extra.get("phase_changes", 0),
        # what its data source gives at most, measured (predictor.bank, "Supply cap"); null: none seen
        "supply_cap_samples_per_s": fin(curve.supply_cap_samples_per_s) if curve.supply_cap_samples_per_s else None,
    }


def observation_from_stats(job: JobStats, snapshot: NodeSnapshot,
                           work_conserving: bool = True, applied_cpus: Optional[float] = None,
                           observed_cores: str = "share") -> Optional[Observation]:
    """The predictor's window for one job, or None when the job has no usable window yet (or the window
    delivered more batches than its workers' CPU could make: a queue filled earlier was draining; or a
    figure of it is not a finite number). Never raises for the job's figures.

    Cores the loader could use (``Observation.cores``): the applied CPU allocation
    (``snapshot.applied``; ``applied_cpus``, where given, is its cores over the window), else the job's
    allowed CPUs (a CPU set: a hard bound), else an even share of the node's loader CPUs. An applied
    cap (cpu_knob ``quota`` or ``cpuset``: ``work_conserving=False``) is what the workers could use.
    A share (``shares`` knob, or no CPU actuator at all) is not: it is
    work-conserving, so when the node is not contended the workers use more than their share, and
    calling the window's cores "the share" would tell the predictor that cores bound a window they did
    not bind. There the cores are min(loader_cpus, max(share, measured worker_cpu_cores)): at least the
    share (the floor the kernel guarantees under contention), at least what the workers were seen to
    use, never more than the node's loader CPUs.

    ``observed_cores`` "received": a share is not a floor where a contended CPU is shared per runnable
    thread more than per group weight (a small node: ``agent.policies.thread_split``), so a window in
    which the training loop waited for data and the workers waited for a CPU (``agent.policies.
    cpu_starved_loader``) counts the CPU they received, where that
    is less than the share. With "share" the curve learns such a gap as the job's own inefficiency and
    the policy plans it more cores on the same workers, which the same sharing withholds again.

    Batch size and steps (``Observation.batch_size``, ``steps``): the window's own, from its counters
    (``JobStats.samples_per_step``: samples over steps; ``window_steps``: the steps each rank took),
    where the collector took them (``predictor.bank.window_batch_size``); else the reported
    ``batch_size`` (a batch sampler's rounded mean since its loader started, which lags a change by
    many reports) and the steps that samples/s at that size make (off by up to 1 in ``batch_size``).
    """
    bs = job.samples_per_step if job.samples_per_step is not None and job.samples_per_step > 0 else job.batch_size
    if not 0 < job.window_s < math.inf or not bs > 0:
        return None
    share = True                           # the figure is a share or an even split, not a CPU set
    applied = snapshot.applied.get(job.job)
    if applied is not None and applied.cpus > 0:
        cores = applied.cpus if applied_cpus is None or not applied_cpus > 0 else float(applied_cpus)
    elif job.allowed_cpus:
        cores, share = float(len(job.allowed_cpus)), False
    else:
        cores = snapshot.loader_cpus / max(1, len(snapshot.jobs))
    capped = not work_conserving and applied is not None and applied.enforce_cpu
    if share and not capped and not job.cooperative:          # cooperative jobs are pinned (affinity)
        cap = snapshot.loader_cpus
        if job.cpu_cap_cores:
            cap = min(cap, job.cpu_cap_cores)
        if cap > 0:
            cores = min(cap, max(cores, job.worker_cpu_cores))
        if observed_cores == "received" and 0 < job.worker_cpu_cores < cores and cpu_starved_loader(job):
            cores = job.worker_cpu_cores
    if cores <= 0:
        return None
    if job.cpu_s_per_batch > 0:
        # Batches delivered cost CPU in the workers: a window that delivered far more than its workers'
        # CPU could have made was draining a queue filled earlier (the first seconds after a job that
        # started with 16 workers was cut to one: it ran at its ceiling on a fraction of a core, and its
        # curve said 0.05 cores were enough). Such a window says nothing about what the cores buy.
        made = job.samples_per_s / bs * job.cpu_s_per_batch
        if made > DRAINING_FACTOR * job.worker_cpu_cores + DRAINING_SLACK_CORES:
            return None
    if job.window_steps is not None:
        per_rank = job.window_steps
    else:
        per_rank = job.samples_per_s / bs * job.window_s      # bs: the job's step, every rank's batch
    if not math.isfinite(per_rank):
        # (no collector's figure: it takes report figures only up to 2**53, over at least MIN_WINDOW_S; a
        # hand-made or corrupt JobStats, NaN samples/s or steps, raised ValueError from int() here)
        return None
    steps = int(round(per_rank))
    if steps == 0 and job.samples_per_s > 0 and job.compute_s_per_step > 0:
        # a slow job (a step every few seconds: several GPUs' batches per step, or a starved loader)
        # finishes under half a step per report window; its smoothed per-step figures still describe
        # steps it took, so the window counts as one step rather than as none (it was never observed)
        steps = 1
    try:
        return Observation(
            workers=max(0, int(job.workers)),
            cores=float(cores),
            batch_size=as_batch_size(bs),
            # the step with data ready AND the trainer not starved of CPU: a trainer kept waiting for a core
            # would make the loader look like it needs fewer cores than it does (ISSUE 11)
            compute_s_per_step=trainer_compute_s(job),
            data_wait_s_per_step=job.data_wait_s_per_step,
            cpu_s_per_batch=job.cpu_s_per_batch,
            wall_s_per_batch=job.wall_s_per_batch,
            runq_s_per_batch=job.runq_s_per_batch,
            blocked_s_per_batch=job.blocked_s_per_batch,
            samples_per_s=job.samples_per_s,
            duration_s=job.window_s,
            steps=steps,
            worker_memory_bytes=job.worker_memory_bytes,
        )
    except BadObservation:
        return None


def same_configuration(a: Optional[JobAllocation], b: Optional[JobAllocation]) -> bool:
    """Equal but for the cores: the same workers, CPU set and IO weight. A predictor window may span a
    change of cores alone (its cores are then the time-weighted mean of what was applied), not of these."""
    if a is None or b is None:
        return a is b
    return (a.workers == b.workers and (tuple(a.cpuset) if a.cpuset else None) == (tuple(b.cpuset) if b.cpuset else None)
            and a.io_weight == b.io_weight)


def same_allocation(a: Optional[JobAllocation], b: Optional[JobAllocation]) -> bool:
    """Equal for actuation purposes: the reason is ignored, cores and CPU weights within ``CPUS_TOLERANCE``."""
    if a is None or b is None:
        return a is b
    return (same_configuration(a, b) and abs(a.cpus - b.cpus) < CPUS_TOLERANCE
            and abs(a.weight_cores - b.weight_cores) < CPUS_TOLERANCE)


class _Breaker:
    __slots__ = ("failures", "opened_at", "last_error")

    def __init__(self) -> None:
        self.failures = 0
        self.opened_at: Optional[float] = None
        self.last_error = ""


class Controller:
    """See the module docstring for the invariants."""

    def __init__(self, *, snapshot_source: Callable[[float], NodeSnapshot], policy: Policy,
                 policy_config: PolicyConfig, predictor: PredictorLike, actuators: Sequence,
                 on_record: Optional[Callable[[TickRecord], None]] = None,
                 breaker_retry_s: float = 30.0, work_conserving: Optional[bool] = None,
                 observe_interval_s: float = OBSERVE_INTERVAL_S, observed_cores: str = "share",
                 actuator_timeout_s: float = ACTUATOR_TIMEOUT_S,
                 lanes: Optional[Sequence[ActuatorLane]] = None) -> None:
        """``lanes``: one ``ActuatorLane`` per actuator, in order (the agent keeps its lanes across the
        controllers a reload builds); by default the controller makes its own."""
        """``work_conserving``: whether an applied ``cpus`` is a share (True) or a cap (False), for
        ``observation_from_stats``; None: a cap when some actuator's ``cpu_knob`` is quota or cpuset.
        ``observed_cores``: what a contended window's cores are (``observation_from_stats``)."""
        if observed_cores not in OBSERVED_CORES:
            raise ValueError(f"observed_cores must be one of {', '.join(OBSERVED_CORES)}, got {observed_cores!r}")
        self.observed_cores = observed_cores
        self._snapshot_source = snapshot_source
        self._policy = policy
        self._config = policy_config
        self._predictor = predictor
        self._actuators = list(actuators)
        self.actuator_timeout_s = float(actuator_timeout_s)
        if lanes is None:
            lanes = [ActuatorLane(str(getattr(a, "name", i))) for i, a in enumerate(self._actuators)]
        if len(lanes) != len(self._actuators):
            raise ValueError(f"{len(lanes)} actuator lanes for {len(self._actuators)} actuators")
        self.lanes = list(lanes)
        self._on_record = on_record
        self._breaker_retry_s = breaker_retry_s
        self._observe_interval_s = max(0.0, float(observe_interval_s))
        self.loader_cpus_in_force: Optional[float] = None   # the budget the last plan used (grown_loader_cpus)
        if work_conserving is None:
            work_conserving = not any(getattr(a, "cpu_knob", "shares") in ("quota", "cpuset") for a in self._actuators)
        self.work_conserving = work_conserving
        self._applied: dict[str, JobAllocation] = {}                       # in force on every actuator
        self._node_by: dict[int, NodeAllocation] = {}                      # actuator -> node allocation applied
        self._applied_by: dict[int, dict[str, JobAllocation]] = {i: {} for i in range(len(self._actuators))}
        self._pids_by: dict[int, dict[str, tuple[int, ...]]] = {i: {} for i in range(len(self._actuators))}
        self._ranks_by: dict[int, dict[str, tuple[int, ...]]] = {i: {} for i in range(len(self._actuators))}
        self._breakers: dict[str, dict[int, _Breaker]] = {}   # job -> actuator index -> breaker
        self._pending_forget: set[str] = set()
        self._seen: dict[str, None] = {}           # jobs of earlier snapshots not forgotten yet (in order)
        self._observed_at: dict[str, float] = {}
        self._window_end: dict[str, float] = {}     # the end of each job's last window (settled_window)
        self._unsettled_since: dict[str, float] = {}   # since when a due job has had no settled window
        self._applied_at: dict[str, float] = {}      # job -> when its allocation last changed (tick time)
        self._config_at: dict[str, float] = {}       # ... when anything but its cores changed (workers, cpuset, IO)
        self._cpus_log: dict[str, list[tuple[float, float]]] = {}   # job -> (tick time, cores applied from then)
        self._curves: dict[str, ThroughputCurve] = {}
        self._summaries: dict[str, dict] = {}
        self.last_record: Optional[TickRecord] = None
        self._foreign_pattern = ForeignPattern()    # other processes' load that comes and goes

    # -- public API -------------------------------------------------------------------------
    def applied(self) -> dict[str, JobAllocation]:
        return dict(self._applied)

    def applied_node(self) -> Optional[NodeAllocation]:
        """The node allocation in force on every actuator that takes one (None: none applied yet)."""
        takers = [i for i, a in enumerate(self._actuators) if hasattr(a, "apply_node")]
        if not takers or any(i not in self._node_by for i in takers):
            return None
        first = self._node_by[takers[0]]
        return first if all(self._node_by[i] == first for i in takers) else None

    def adopt(self, applied: Mapping[str, JobAllocation]) -> None:
        """Restart from the journal: treat ``applied`` as in force on every actuator."""
        for job, alloc in applied.items():
            self._applied[job] = alloc
            for i in self._applied_by:
                self._applied_by[i][job] = alloc

    def forget(self, job_id: str) -> None:
        """The job departed: actuators release it now; its share goes to the others on the next tick."""
        errors = self._release(job_id)
        if errors:
            self._pending_forget.add(job_id)   # retried at the next tick

    def stop(self) -> None:
        """Restore every original value the actuators changed. Never raises."""
        for i, act in enumerate(self._actuators):
            # a hung call is given one more timeout to return; restoring beside it would be two threads in
            # one actuator, so while it still runs the restore is not made (its journal of originals, where
            # it keeps one, lets the next start restore what this one changed)
            if not self.lanes[i].wait_idle(self.actuator_timeout_s):
                logs.event(log, "restore_skipped", logging.ERROR, actuator=getattr(act, "name", i),
                           why=self.lanes[i].busy())
                continue
            try:
                done, why = self._call(i, act.restore, what="restore")
                if not done:
                    logs.event(log, "restore_failed", logging.ERROR, actuator=getattr(act, "name", i), error=why)
            except Exception:   # noqa: BLE001 — stop must finish for every actuator
                pass
        self._applied.clear()
        self._node_by.clear()
        for i in self._applied_by:
            self._applied_by[i].clear()
            self._pids_by[i].clear()
            self._ranks_by[i].clear()

    def tick(self, now: float) -> TickRecord:
        t0 = time.perf_counter()
        errors: list[str] = []
        results: dict[str, ApplyResult] = {}
        curves: dict[str, dict] = {}
        departed: list[str] = []
        node_notes: list[str] = []
        plan = AllocationPlan(policy=getattr(self._policy, "__name__", "?"), allocations={})
        phases: dict[str, float] = {}
        try:
            snapshot = self._snapshot_source(now)
        except Exception as e:   # noqa: BLE001 — a tick never raises
            errors.append(f"snapshot: {type(e).__name__}: {e}")
            snapshot = None
        t1 = time.perf_counter()
        phases["snapshot"] = (t1 - t0) * 1000.0
        if snapshot is not None:
            for job_id in list(self._pending_forget):
                if not self._release(job_id):
                    self._pending_forget.discard(job_id)
            # departed: in force somewhere or seen before (a job some actuator applied while another
            # failed is not in ``_applied``, yet holds a cgroup group, predictor windows, a breaker)
            for job_id in [j for j in dict.fromkeys([*self._applied, *self._seen]) if j not in snapshot.jobs]:
                self.forget(job_id)
                departed.append(job_id)
            self._seen.update(dict.fromkeys(snapshot.jobs))
            budget = grown_loader_cpus(snapshot)
            if budget != self.loader_cpus_in_force:
                logs.event(log, "loader_budget", logging.INFO if budget != snapshot.loader_cpus else logging.DEBUG,
                           cores=budget, configured=snapshot.loader_cpus,
                           why="grown into the reserve the training processes and other processes leave"
                           if budget != snapshot.loader_cpus else "as configured")
                self.loader_cpus_in_force = budget
            node = self.applied_node()
            snapshot = dataclasses.replace(snapshot, applied=dict(self._applied), applied_node=node,
                                           foreign_intermittent=self._foreign_pattern.update(
                                               now, node, snapshot.foreign_cpu_cores, self._config),
                                           applied_age_s={j: max(0.0, now - t) for j, t in self._applied_at.items()
                                                          if j in self._applied},
                                           loader_cpus=budget)
            model: dict[str, ThroughputCurve] = {}
            for job_id, job in snapshot.jobs.items():
                curve = self._observe(job_id, job, snapshot, now, errors)
                if curve is not None:
                    model[job_id] = curve
                curves[job_id] = self._summaries[job_id] if curve is not None else curve_summary(None)
            t2 = time.perf_counter()
            try:
                plan = plan_around_epochs(self._policy, snapshot, model, self._config)
            except Exception as e:   # noqa: BLE001
                errors.append(f"policy: {type(e).__name__}: {e}")
            t3 = time.perf_counter()
            phases["predict"], phases["policy"] = (t2 - t1) * 1000.0, (t3 - t2) * 1000.0
            # every job's calls are submitted before the first is waited for: an actuator's lane runs
            # them back to back, one thread hand-off per tick rather than one per call (ActuatorLane)
            prepared = []
            for job_id, desired in plan.allocations.items():
                job = snapshot.jobs.get(job_id)
                if job is None:
                    continue
                p = self._prepare_job(job, desired, now)
                if p is not None:
                    prepared.append(p)
            for p in prepared:
                results[p[0].job] = self._finish_job(p)
            if plan.node is not None:
                node_notes = self._apply_node(plan.node, errors)
            phases["apply"] = (time.perf_counter() - t3) * 1000.0
        record = TickRecord(now=now, duration_s=time.perf_counter() - t0, plan=plan, results=results,
                            curves=curves, breakers=self._open_breakers(), departed=tuple(departed),
                            errors=tuple(errors), phases_ms=phases, node_notes=tuple(node_notes))
        self.last_record = record
        if self._on_record is not None:
            try:
                self._on_record(record)
            except Exception:   # noqa: BLE001 — a recorder failure must not stop the loop
                pass
        return record

    # -- internals --------------------------------------------------------------------------
    def _call(self, i: int, fn: Callable, *args, what: str, key: Optional[str] = None):
        """``fn(*args)`` for actuator ``i``: ``(True, result)``, what it raised, or ``(False, why)`` where it
        did not return within ``actuator_timeout_s`` or the actuator's lane is busy (``ActuatorLane``).
        An actuator with ``may_block = False`` is called here, on the tick's thread."""
        return self._collect(i, self._submit(i, fn, *args, what=what, key=key))

    def _submit(self, i: int, fn: Callable, *args, what: str, key: Optional[str] = None):
        """Start ``fn(*args)`` for actuator ``i`` on its lane and return a token for ``_collect``; for an
        actuator with ``may_block = False`` nothing starts: ``_collect`` calls it, on the tick's thread.
        ``key``: the job the call is for (None: no job)."""
        if getattr(self._actuators[i], "may_block", True) is False:
            return ("inline", fn, args)
        return self.lanes[i].submit(fn, *args, what=what, key=key)

    def _busy_elsewhere(self, i: int, token, job_id: str) -> Optional[str]:
        """Why a call for ``job_id`` that did not complete is not that job's failure: it never ran, and
        what kept it from running was not a hung call of the job's own (module docstring). None when
        the job is charged: its call ran (and timed out), or its own earlier call is what still runs."""
        if isinstance(token, tuple) or token.ran:
            return None
        holder = token.blocked_by
        name = getattr(self._actuators[i], "name", str(i))
        if holder is None:
            return f"actuator busy: {name} {token.what} not started within {self.actuator_timeout_s:g} s"
        if holder.key == job_id:
            return None
        return f"actuator busy: {name} {holder.what} running for {holder.running_s():.1f} s"

    def _collect(self, i: int, token):
        """The outcome of a ``_submit``: as ``_call``. Collect tokens in the order they were submitted."""
        if isinstance(token, tuple):
            _, fn, args = token
            return True, fn(*args)
        return self.lanes[i].wait(token, self.actuator_timeout_s)

    CPUS_LOG_S = 120.0      # how far back a job's applied cores are kept (windows are seconds long)

    def _log_cpus(self, job_id: str, now: float, cpus: float) -> None:
        log_ = self._cpus_log.setdefault(job_id, [])
        if log_ and log_[-1][0] == now:
            log_[-1] = (now, cpus)
        elif not log_ or abs(log_[-1][1] - cpus) > 1e-9:
            log_.append((now, cpus))
        while len(log_) > 1 and log_[1][0] < now - self.CPUS_LOG_S:
            log_.pop(0)

    def _mean_cpus(self, job_id: str, t0: float, t1: float) -> Optional[float]:
        """The cores applied to the job over [t0, t1], time-weighted; None when nothing was applied then."""
        log_ = self._cpus_log.get(job_id) or []
        if not log_ or t1 <= t0 or log_[0][0] > t0:
            return None
        total = 0.0
        for k, (t, c) in enumerate(log_):
            end = log_[k + 1][0] if k + 1 < len(log_) else math.inf
            a, b = max(t, t0), min(end, t1)
            if b > a:
                total += c * (b - a)
        return total / (t1 - t0)

    def _observe(self, job_id: str, job: JobStats, snapshot: NodeSnapshot, now: float,
                 errors: list[str]) -> Optional[ThroughputCurve]:
        """Feed the job's window to the predictor once per window length; return its curve.

        Successive snapshots cover overlapping windows (the collector's window is longer than a
        tick), so a window is observed only when a whole window has passed since the last one;
        the curve is asked for again only after an observation (or while there is none).
        """
        last = self._observed_at.get(job_id)
        due = last is None or now - last >= max(job.window_s, self._observe_interval_s, 1e-9) or now < last
        changed_at = self._applied_at.get(job_id)
        config_at = self._config_at.get(job_id)
        window = None
        if due and job.history:
            # the collector's raw reports: the window since the configuration settled (never a smoothed
            # figure, never across a change of workers or an unfinished resize; see settled_window). A
            # change of cores alone does not cut it: its cores are what was applied, averaged over it.
            # (On a busy node the cores are re-split at nearly every tick as jobs come and go and the
            # trainers' measured need moves; a window that had to start after the last such change
            # left a new job on its cold-start share for 8-10 s of its 12-30 s.)
            since = max(config_at if config_at is not None and config_at <= now else -math.inf,
                        self._window_end.get(job_id, -math.inf))
            span = max(self._observe_interval_s, MIN_OBSERVE_S)
            window = settled_window(job.history, since, span_s=span, min_s=MIN_OBSERVE_S)
            if window is not None:
                self._unsettled_since.pop(job_id, None)
            else:
                # none yet (just changed, resizing, a slow step): wait; but a job that never holds still
                # long enough (epochs shorter than a window with workers restarted at each, a client
                # whose live worker count never matches its target) falls back to the smoothed figures
                first = self._unsettled_since.setdefault(job_id, now)
                if not stepped_since(job.history, now - UNSETTLED_FALLBACK_S):
                    # ... but a loop that took no step over that time (paused, hung, validating) is not one
                    # that never holds still: its smoothed figures only decay (each such window said the job
                    # delivered ~0 samples/s at its configuration, a step count of 1 made up for it; a 150 s
                    # stop was its whole history), and for seconds after it resumes they still hold the stop
                    first = self._unsettled_since[job_id] = now
                due = now - first >= UNSETTLED_FALLBACK_S
        if due and window is None and changed_at is not None and changed_at <= now and now - job.window_s < changed_at:
            due = False            # the window spans an allocation change: wait for a clean one
        try:
            if due:
                if window is not None:
                    seen = dataclasses.replace(job, **window.stats_fields(job.batch_size))
                else:       # the smoothed figures, of the workers that took tasks (not a target not yet live)
                    live = live_workers(job)
                    seen = job if live is None or live == job.workers else dataclasses.replace(job, workers=live)
                obs = observation_from_stats(seen, snapshot, self.work_conserving,
                                             applied_cpus=(self._mean_cpus(job_id, window.start_t, window.end_t)
                                                           if window is not None else None),
                                             observed_cores=self.observed_cores)
                if window is not None:
                    self._window_end[job_id] = window.end_t
                if obs is not None:
                    self._predictor.observe(job_id, obs)
                    # first observation: shift this job's phase (0..interval) so jobs spread over ticks
                    phase = (zlib.crc32(job_id.encode()) % 1000) / 1000.0 * self._observe_interval_s
                    self._observed_at[job_id] = now if last is not None else now - phase
                    self._curves.pop(job_id, None)
                    self._summaries.pop(job_id, None)
            if job_id not in self._curves:
                curve = self._predictor.curve(job_id)
                if curve is None:
                    return None
                self._curves[job_id] = curve
                self._summaries[job_id] = curve_summary(curve)
                if due and obs is not None and log.isEnabledFor(logging.DEBUG):
                    # what the predictor was fed and what it made of it (log_level = "debug")
                    logs.event(log, "observation", logging.DEBUG, job=job_id,
                               window={k: round(v, 5) if isinstance(v, float) else v
                                       for k, v in dataclasses.asdict(obs).items()},
                               batch_size_note=seen.samples_per_step_note,
                               curve=dict(self._summaries[job_id], correction=round(curve.correction, 4),
                                          core_correction=curve.core_correction,
                                          blocked_s_per_batch=curve.blocked_s_per_batch,
                                          overhead_s_per_step=curve.overhead_s_per_step,
                                          sharpness=curve.sharpness))
            return self._curves[job_id]
        except Exception as e:   # noqa: BLE001 — a predictor failure is recorded, the tick goes on
            errors.append(f"predictor {job_id}: {type(e).__name__}: {e}")
            self._curves.pop(job_id, None)
            self._summaries.pop(job_id, None)
            return None

    def _apply_node(self, node: NodeAllocation, errors: list[str]) -> list[str]:
        """Hand the node allocation to each actuator that takes one and has not applied it yet."""
        notes: list[str] = []
        for i, act in enumerate(self._actuators):
            fn = getattr(act, "apply_node", None)
            if fn is None or self._node_by.get(i) == node:
                continue
            try:
                done, out = self._call(i, fn, node, what="apply_node")
                if not done:
                    raise TimeoutError(out)
                notes.extend(out or ())
                self._node_by[i] = node
            except Exception as e:   # noqa: BLE001 — one actuator's failure never stops the tick
                errors.append(f"node {getattr(act, 'name', i)}: {type(e).__name__}: {e}")
        return notes

    def _release(self, job_id: str) -> list[str]:
        errors = []
        for i, act in enumerate(self._actuators):
            try:
                done, why = self._call(i, act.release, job_id, what=f"release of job {job_id!r}", key=job_id)
                if not done:
                    errors.append(f"{getattr(act, 'name', i)}: {why}")
            except Exception as e:   # noqa: BLE001
                errors.append(f"{getattr(act, 'name', i)}: {e}")
            self._applied_by[i].pop(job_id, None)
            self._pids_by[i].pop(job_id, None)
            self._ranks_by[i].pop(job_id, None)
        self._applied.pop(job_id, None)
        self._seen.pop(job_id, None)
        self._breakers.pop(job_id, None)
        self._observed_at.pop(job_id, None)
        self._window_end.pop(job_id, None)
        self._unsettled_since.pop(job_id, None)
        self._applied_at.pop(job_id, None)
        self._config_at.pop(job_id, None)
        self._cpus_log.pop(job_id, None)
        self._curves.pop(job_id, None)
        self._summaries.pop(job_id, None)
        try:
            self._predictor.forget(job_id)
        except Exception as e:   # noqa: BLE001
            errors.append(f"predictor: {e}")
        return errors

    def _open_breakers(self) -> dict[str, str]:
        out = {}
        for j, brs in self._breakers.items():
            opened = [f"{b.failures} failures in a row; last: {b.last_error}" for b in brs.values() if b.opened_at is not None]
            if opened:
                out[j] = "; ".join(opened)
        return out

    def _apply_job(self, job: JobStats, desired: JobAllocation, now: float) -> Optional[ApplyResult]:
        """Apply ``desired`` where it differs from what each actuator has in force; None if nothing
        differs. (The tick does the two halves for every job in turn: all submitted, then collected.)"""
        p = self._prepare_job(job, desired, now)
        return None if p is None else self._finish_job(p)

    def _prepare_job(self, job: JobStats, desired: JobAllocation, now: float) -> Optional[tuple]:
        """The first half of ``_apply_job``: which actuators differ, their breakers, and each call
        submitted to its actuator's lane (``_submit``); None if nothing differs."""
        held = self._applied.get(job.job)
        if held is not None and same_allocation(held, desired) \
                and (held.reason, held.cold, held.budget, held.extra_workers) != \
                (desired.reason, desired.cold, desired.budget, desired.extra_workers):
            # what is in force stays; its record follows the policy (why it holds, whether the plan still
            # holds a cold-start rule's allocation, the budget it split, which of its workers are over its
            # thread split: adaptive's hold reads them)
            self._applied[job.job] = dataclasses.replace(held, reason=desired.reason, cold=desired.cold,
                                                         budget=desired.budget, extra_workers=desired.extra_workers)
        todo = []
        for i, act in enumerate(self._actuators):
            if not same_allocation(self._applied_by[i].get(job.job), desired):
                todo.append(i)
            elif getattr(act, "tracks_pids", False) and self._pids_by[i].get(job.job) != job.worker_pids:
                todo.append(i)
            elif getattr(act, "tracks_ranks", False) and self._ranks_by[i].setdefault(job.job, job.pids) != job.pids:
                todo.append(i)      # (none recorded: adopted from the journal, its ranks say hello again)
            elif self._lost_group(i, act, job.job):
                todo.append(i)
        if not todo:
            return None
        brs = self._breakers.setdefault(job.job, {})
        before = {i: self._applied_by[i].get(job.job) for i in todo}
        calls = []      # (actuator, token or None, why not called)
        for i in todo:
            act = self._actuators[i]
            br = brs.setdefault(i, _Breaker())
            # (a clock that went back, now < opened_at, counts as the retry time passed: else the breaker
            # would hold for as long as it went back)
            if br.opened_at is not None and 0.0 <= now - br.opened_at < self._breaker_retry_s:
                calls.append((i, None, f"breaker open: {br.failures} failures in a row; last: {br.last_error}"))
                continue
            try:
                calls.append((i, self._submit(i, act.apply, job, desired, what=f"apply for job {job.job!r}",
                                              key=job.job), ""))
            except Exception as e:   # noqa: BLE001 — (a thread that cannot start): this job's failure
                calls.append((i, e, ""))
        return job, desired, now, before, calls

    def _lost_group(self, i: int, act, job_id: str) -> bool:
        """Whether the actuator says what it made for the job is gone (``lost_group``: the cgroup
        actuator's group removed by someone else), so an unchanged allocation is applied again. Not asked
        while the actuator's lane is busy (a hung call: nothing is submitted to it anyway), nor for a job
        whose allocation it never applied. A check that raises counts as not lost."""
        fn = getattr(act, "lost_group", None)
        if fn is None or job_id not in self._applied_by[i] or self.lanes[i].busy() is not None:
            return False
        try:
            lost = bool(fn(job_id))
        except Exception:   # noqa: BLE001 — a check, never a reason to stop the tick
            return False
        if lost:
            logs.event(log, "group_lost", logging.WARNING, job=job_id, actuator=getattr(act, "name", str(i)),
                       detail="removed by someone else: the allocation is applied again")
        return lost

    def _finish_job(self, prepared: tuple) -> ApplyResult:
        """The second half of ``_apply_job``: each submitted call's outcome, recorded; the breakers."""
        job, desired, now, before, calls = prepared
        brs = self._breakers[job.job]
        errs: list[str] = []
        not_enforced: list[str] = []
        for i, token, why in calls:
            if token is None:
                errs.append(why)
                continue
            act = self._actuators[i]
            name = getattr(act, "name", str(i))
            br = brs[i]
            try:
                if isinstance(token, Exception):
                    raise token
                done, r = self._collect(i, token)
                if not done:
                    busy = self._busy_elsewhere(i, token, job.job)
                    if busy is not None:      # never ran, another call's hang: not charged, retried by the diff
                        errs.append(busy)
                        continue
                    r = ApplyResult(job=job.job, ok=False, applied=None, error=r)
                elif not isinstance(r, ApplyResult):   # (None from an apply that forgot its result)
                    raise TypeError(f"apply returned {type(r).__name__}, not an ApplyResult")
            except Exception as e:   # noqa: BLE001 — the protocol says never raise; hold it to that
                r = ApplyResult(job=job.job, ok=False, applied=None, error=f"{type(e).__name__}: {e}")
            not_enforced.extend(r.not_enforced)
            if r.ok:
                self._applied_by[i][job.job] = desired
                self._pids_by[i][job.job] = job.worker_pids
                self._ranks_by[i][job.job] = job.pids
                if not same_allocation(before[i], desired):
                    self._applied_at[job.job] = now
                    if not same_configuration(before[i], desired):
                        self._config_at[job.job] = now
                    self._log_cpus(job.job, now, desired.cpus)
                br.failures, br.opened_at, br.last_error = 0, None, ""
            else:
                br.failures += 1
                br.last_error = f"{name}: {r.error}"
                if br.failures >= BREAKER_FAILURES:
                    br.opened_at = now
                errs.append(br.last_error)
        everywhere = all(same_allocation(self._applied_by[i].get(job.job), desired)
                         for i in range(len(self._actuators)))
        if everywhere:
            self._applied[job.job] = desired
        if errs:
            return ApplyResult(job=job.job, ok=False, applied=self._applied.get(job.job),
                               error="; ".join(errs), not_enforced=tuple(not_enforced))
        return ApplyResult(job=job.job, ok=True, applied=desired, not_enforced=tuple(not_enforced))
