"""Trace-driven simulation of the allocation policies over many nodes (``adloader simulate``).

The agent's own loop decides: on each simulated node, ``agent.controller.Controller.tick(now)`` with
the agent's policies (``agent.policies.get_policy``, injected) and predictor
(``predictor.bank.PredictorBank``), reading a simulated snapshot source (what the collector would
report: rates over the window since they last changed) and applying through a simulated actuator
(the allocation is in force at once). So the observation spacing and hygiene, the tolerance for what
counts as a change, cold start and departures are the controller's, not a copy. Jobs are modelled by
throughput curves (``predictor.curve.ThroughputCurve``):

- ``curves="corpus"``: one curve per job of the predictor's measured corpus
  (``predictor/data/corpus.jsonl``: its measured windows fed to a PredictorBank), its loader cost scaled
  so that a job's demand relative to its GPU's share of the node's loader cores is what it was relative
  to the measuring machine's loader cores;
- ``curves="builtin"``: first-principles curves for the bench's job kinds (``evaluation/catalog.toml``:
  cores per GPU from ~1 (NLP-like) to ~12 (AlexNet-like), step 0.1 s).

Physics of a node (what a policy's plan turns into): ``evaluation.nodemodel.node_rates``, the one node
model, with the workload model of issue 11 (a job's training process burns CPU per step and rank, a job
has ``gpus``, each user has a habitual ``num_workers``; ``builtin_curves`` carries them in a curve's
``extra``). The agent's policies: the loaders' subtree capped at the node less the trainers' pace, the
loaders water-filled by the plan's ``cpus`` (weights with ``cpu_knob="shares"``, the agent's default;
hard caps with ``"quota"``), each up to what its workers can use. ``none``: the users' habitual workers,
the kernel fair between jobs and per runnable thread inside one (busy workers stretch the trainer's CPU
part). ``autotune``: each job runs the loader's own tuner (``_SimTuner``: ``adloader.autotune.AutoTuner``
fed the job's windows, from one worker per CPU of the node, as the loader starts). ``static-cores``: a hard quota
per job of the node's cores x its GPUs / the node's GPUs. ``SimConfig.available_cores`` models other
tenants (the jobs get at most that; the agent still sees the node). The snapshot the controller reads
carries what the real collector reports (``_job_stats``): the step with the trainer's CPU wait in it
and that wait, data wait, trainer CPU per step, GPUs, worker CPU and run-queue wait per batch. Worker
restarts cost nothing here (the bench measures that).

Time: event-driven per node. A node re-decides at every arrival and departure and then every
``tick_s`` while the plan still moves (at most ``settle_ticks`` times), so the predictor gets fresh
windows after each change; between decisions rates are constant and progress is exact.

Trace file (``--trace``): CSV with a header, or JSON lines, one job per row/line:
    node      str   node name (jobs of one node share its cores)
    job       str   job id (unique within the node)
    kind      str   a curve name (``adloader simulate --list-kinds``)
    arrival_s float seconds from the start
    work_s    float the job's work, in seconds at its ceiling (samples = work_s * ceiling)
    gpus      int   optional, default 1
    phases    str   optional: the job's later phases, ``AFTER_S:KIND;...`` (JSON: ``[[AFTER_S, "KIND"], ...]``):
                    AFTER_S seconds after its arrival the job's pipeline becomes that kind's (its remaining
                    samples stay); a new phase is an event as an arrival is
Generator (no trace): ``nodes`` nodes, ``jobs_per_node`` jobs each, Poisson arrivals with mean gap
``mean_gap_s``, work ~ lognormal around ``mean_work_s``, kinds drawn uniformly; seeded.

Memory: a curve's ``worker_memory_bytes`` is what one of its workers holds (builtin kinds: the
catalogue's ``worker_ram_mb`` where it has one; ``SimConfig.worker_memory_bytes`` sets it for every
kind, e.g. for the corpus curves, which carry none). A node's loader memory is the sum over its jobs of
workers x that; ``SimConfig.loader_memory`` (bytes, None = no budget) is the node's loader memory
budget, in the snapshot the policies see (``adaptive`` plans within it, and so does the oracle, which
then searches worker counts and cores together: ``evaluation.oracle.solve_memory``; the baselines
ignore it). Reported per policy: the peak loader memory of a node (max and p95 over nodes) and the
share of node-time spent above the budget. To ask what budget a trace needs: run without a budget and
read the peak of ``adaptive`` (and of ``none``, the users' own worker counts); then run with budgets
below it to see what each costs in throughput.

Metrics per policy: aggregate normalised throughput (per node: sum over jobs of samples/ceiling over
the node's makespan; mean over nodes), makespan (mean and max over nodes), JCT mean/p95, GPU idle
fraction, Jain's index of the jobs' mean normalised throughput, min ratio to the even split (job by
job), decisions and worker changes. ``oracle``: the exact knapsack (``evaluation.oracle``) on the
*true* curves at every decision: a ceiling for static-per-set allocation.
"""
from __future__ import annotations

import csv
import dataclasses
import hashlib
import json
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from evaluation import metrics as M
from evaluation.nodemodel import waterfill  # noqa: F401  (one water-filling for both models; tests use S.waterfill)
from predictor.curve import ThroughputCurve

CORPUS_PATH = Path(__file__).resolve().parent.parent / "predictor" / "data" / "corpus.jsonl"
POLICIES_DEFAULT = ("even-static", "even", "none", "autotune", "static-cores", "adaptive", "oracle")
PREDICTORS = ("agent", "first-principles", "perfect")
CURVE_FREE_POLICIES = ("even-static", "even", "none", "oracle", "autotune", "static-cores")
# decide without the predictor's curves (the oracle reads the true ones); the last two have no agent:
NO_AGENT_POLICIES = ("none", "autotune", "static-cores")   # what users run instead, physics only
CONTROLLER_OPTIONS = ("observed_cores",)   # agent keys a variant may set that the Controller takes, not the policy
MEASURED_LOADER_CPUS = 1.8      # the corpus machine: 2 vCPUs minus the agent's 10% reserve


class SimError(ValueError):
    """A trace or option that cannot be simulated; the message names the line or option."""


@dataclass(frozen=True)
class TraceJob:
    node: str
    job: str
    kind: str
    arrival_s: float
    work_s: float
    gpus: int = 1
    phases: tuple = ()              # ((after_s, kind), ...): from arrival + after_s the job behaves as that kind
    pause: tuple = ()               # (every_s, for_s): its loop stops for_s after each every_s of training
                                    # (a validation pass: no samples, no CPU, its allocation kept); () never


@dataclass
class _Job:
    tj: TraceJob
    curve: ThroughputCurve          # the truth (scaled to the node)
    remaining: float                # samples
    start: float = math.nan
    done: float = math.nan
    samples: float = 0.0
    norm_s: float = 0.0             # integral of normalised throughput dt
    wait_s: float = 0.0
    alive_s: float = 0.0
    rate: float = 0.0
    workers: int = 0
    changes: int = 0
    phys: object = None             # its evaluation.nodemodel.JobRate now (what the collector reads)
    win_norm_s: float = 0.0         # integral of normalised throughput over the measured window
    win_s: float = 0.0
    since: float = 0.0              # when its rates last changed (the collector's window starts there)
    model: object = None            # its evaluation.nodemodel.JobModel, made on first use
    phase: int = 0                  # how many of its trace phases have begun
    away_from: float = math.nan     # when its current pause began (nan: its loop steps)
    trained_from: float = 0.0       # when it last began training (its arrival, a pause's end)

    @property
    def away(self) -> bool:
        """Its loop stands still (a pause of ``TraceJob.pause``)."""
        return not math.isnan(self.away_from)


# -- curves ------------------------------------------------------------------------------------

def builtin_curves(catalog_path: Optional[str] = None, step_s: float = 0.1, batch_size: int = 64) -> dict:
    """First-principles curves of the bench catalogue's kinds, demand in cores per GPU as listed; a kind
    with several GPUs takes one batch per GPU per step. ``extra`` carries the rest of the workload
    model (``evaluation.nodemodel``): the trainer's CPU per step and rank, the GPUs, the user's habit,
    and ``phase_kind`` (non-empty: the catalogue's kind changes pipeline; its curve is its first
    phase's, and ``trace_kinds`` leaves it out of generated traces)."""
    from evaluation.catalog import load_catalog

    cat = load_catalog(catalog_path)
    out = {}
    for name, k in cat.kinds.items():
        c = k.cores_per_gpu * k.gpus * step_s   # CPU s per step's batches so that c / g = cores_per_gpu x gpus
        b = k.io_sleep_s * batch_size
        out[name] = ThroughputCurve(job=name, batch_size=batch_size * k.gpus, compute_s_per_step=step_s,
                                    cpu_s_per_batch=c, blocked_s_per_batch=b, confidence=1.0,
                                    source="builtin", extra={"cores_per_gpu": k.cores_per_gpu, "gpus": k.gpus,
                                                             "trainer_cpu_s_per_step": k.trainer_cpu_frac * step_s,
                                                             "num_workers": k.num_workers,
                                                             "phase_kind": k.phase_kind},
                                    worker_memory_bytes=float(getattr(k, "worker_ram_mb", 0.0) or 0.0) * (1 << 20))
    return out


def corpus_curves(path: Path = CORPUS_PATH) -> dict:
    """One curve per corpus job: its measured windows through a PredictorBank (the agent's own model)."""
    from predictor.bank import PredictorBank
    from predictor.observation import Observation

    if not Path(path).exists():
        raise SimError(f"corpus {path} not found (use --curves builtin)")
    by_job: dict[str, list] = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                raise SimError(f"corpus {path}:{n}: not JSON") from None
            if rec.get("kind") == "point" and "observation" in rec:
                by_job.setdefault(rec["job"], []).append(Observation.from_dict(rec["observation"]))
    bank = PredictorBank()
    out = {}
    for job, obs in by_job.items():
        for o in obs:
            bank.observe(job, o)
        cv = bank.curve(job)
        if cv is not None and cv.cpu_s_per_batch > 0:
            out[job] = cv
    if not out:
        raise SimError(f"corpus {path} has no usable points")
    return out


def _scale(curve: ThroughputCurve, factor: float) -> ThroughputCurve:
    """The same job on a node where its GPU's share of loader cores is ``factor`` x the measuring one's."""
    return dataclasses.replace(curve, cpu_s_per_batch=curve.cpu_s_per_batch * factor,
                               blocked_s_per_batch=curve.blocked_s_per_batch)


# -- traces --------------------------------------------------------------------------------------

def read_trace(path: str) -> list[TraceJob]:
    p = Path(path)
    if not p.exists():
        raise SimError(f"trace {path}: no such file")
    rows = []
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:   # a directory, an unreadable or binary file
        raise SimError(f"trace {path}: cannot read it as text: {getattr(e, 'strerror', None) or e}") from None
    if p.suffix in (".jsonl", ".json") or text.lstrip().startswith("{"):
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append((n, json.loads(line)))
                except ValueError:
                    raise SimError(f"trace {path}:{n}: not a JSON object") from None
    else:
        rd = csv.DictReader(text.splitlines())
        rows = [(n, r) for n, r in enumerate(rd, 2)]
    out = []
    for n, r in rows:
        if not isinstance(r, dict):
            raise SimError(f"trace {path}:{n}: not a JSON object")
        try:
            job = TraceJob(node=str(r["node"]), job=str(r["job"]), kind=str(r["kind"]),
                           arrival_s=float(r["arrival_s"]), work_s=float(r["work_s"]),
                           gpus=1 if r.get("gpus") in (None, "") else int(r["gpus"]), phases=_phases(r.get("phases")))
        except KeyError as e:
            raise SimError(f"trace {path}:{n}: missing column {e.args[0]!r}") from None
        except (TypeError, ValueError, OverflowError) as e:
            raise SimError(f"trace {path}:{n}: {e}") from None
        # (before: NaN or negative work and arrival times, and 0 GPUs, were simulated as if they meant
        # something, and an infinite work was "jobs make no progress")
        if not (math.isfinite(job.arrival_s) and job.arrival_s >= 0):
            raise SimError(f"trace {path}:{n}: arrival_s must be a finite number >= 0, got {r['arrival_s']!r}")
        if not (math.isfinite(job.work_s) and job.work_s > 0):
            raise SimError(f"trace {path}:{n}: work_s must be a finite number > 0, got {r['work_s']!r}")
        if job.gpus < 1:
            raise SimError(f"trace {path}:{n}: gpus must be at least 1, got {r.get('gpus')!r}")
        out.append(job)
    if not out:   # (an empty file or a header alone printed a table of dashes and exited 0)
        raise SimError(f"trace {path}: no jobs (CSV: a header node,job,kind,arrival_s,work_s and a row per job; "
                       f"or one JSON object per line)")
    return out


def _phases(v) -> tuple:
    """A trace row's ``phases``: ``"30:alexnet;60:bert"`` (CSV) or ``[[30, "alexnet"], ...]`` (JSON) ->
    ((30.0, "alexnet"), ...), in time order; empty when absent."""
    if v is None or v == "":
        return ()
    items = [x.split(":", 1) for x in str(v).split(";") if x.strip()] if isinstance(v, str) else v
    out = []
    for it in items:
        if len(it) != 2:
            raise ValueError(f"phases: {it!r} is not AFTER_S:KIND")
        after, kind = float(it[0]), str(it[1]).strip()
        if not after > 0 or not kind:
            raise ValueError(f"phases: {it!r}: AFTER_S must be > 0 and KIND named")
        out.append((after, kind))
    return tuple(sorted(out))


def trace_kinds(curves: dict) -> list[str]:
    """The kinds a generated trace draws from: every curve's but a catalogue kind with a second phase
    (the bench's ``phase`` scenario's, 5 s in: a bench's time scale, and its curve is its first phase
    only). A trace's ``phases`` column gives jobs phases."""
    return sorted(k for k, cv in curves.items() if not (cv.extra or {}).get("phase_kind"))


def generate_trace(kinds: list[str], nodes: int, jobs_per_node: int, mean_gap_s: float, mean_work_s: float,
                   seed: int = 0, gpus_of: Optional[dict] = None) -> list[TraceJob]:
    """``gpus_of``: kind -> GPUs of a job of that kind (default 1)."""
    if nodes < 1 or jobs_per_node < 1:
        raise SimError(f"a generated trace needs at least one node and one job per node, got {nodes} and "
                       f"{jobs_per_node} (--nodes, --jobs-per-node)")
    if not (mean_gap_s >= 0 and math.isfinite(mean_gap_s)) or not (mean_work_s > 0 and math.isfinite(mean_work_s)):
        raise SimError(f"--mean-gap-s must be 0 or more and --mean-work-s positive, got {mean_gap_s} and {mean_work_s}")
    if not kinds:
        raise SimError("a generated trace needs at least one job kind")
    rng = random.Random(seed)
    out = []
    for n in range(nodes):
        t = 0.0
        for i in range(jobs_per_node):
            if i:
                t += rng.expovariate(1.0 / mean_gap_s) if mean_gap_s > 0 else 0.0
            work = mean_work_s * rng.lognormvariate(-0.125, 0.5)
            kind = rng.choice(kinds)
            out.append(TraceJob(node=f"n{n}", job=f"n{n}-j{i}", kind=kind, arrival_s=round(t, 3),
                                work_s=round(work, 3), gpus=int((gpus_of or {}).get(kind, 1))))
    return out


# -- one node ------------------------------------------------------------------------------------

@dataclass
class SimConfig:
    cores: float = 48.0             # node CPUs
    gpus: int = 8                   # GPUs per node (a job uses its `gpus`)
    loader_cpus: Optional[float] = None   # default: cores minus the agent's 10% reserve
    cpu_knob: str = "shares"
    tick_s: float = 2.0
    settle_ticks: int = 2
    requested_workers: Optional[int] = None   # each job's own num_workers (none keeps it); default cores/gpus
    available_cores: Optional[float] = None   # CPU the jobs can get (other tenants take the rest); None = cores.
                                    # The policies still see ``cores`` (the agent does not know the tenants).
    loader_memory: Optional[float] = None      # node loader memory budget, bytes (None = no budget)
    worker_memory_bytes: Optional[float] = None   # every kind's per-worker memory (None: the curves' own)
    loaders_yield: str = "auto"     # agent.policies.PolicyConfig.loaders_yield ("never": the subtree always weighs);
                                    # a "loaders_yield" in policy_options (a variant's) wins
    policy_options: tuple = ()      # agent.policies.PolicyConfig fields, as (name, value) pairs (the rest: defaults);
                                    # also CONTROLLER_OPTIONS, the agent's keys its controller takes (default: the agent's)
    tuner_gpu_part: bool = True     # the jobs' own tuners see the node's GPUs (a driver, CUDA_VISIBLE_DEVICES)
                                    # and start at their GPUs' part of the CPUs (autotune.initial_workers);
                                    # False: at every CPU (the 2-core bench's emulated GPUs show no driver)
    steps_known: float = 0.0        # the part of the jobs that tell the agent the steps they have left (the
                                    # loader's total_steps; True or 1: every job; which ones: ``tells_steps``):
                                    # what adaptive's finish guard uses; the agent then decides every tick
                                    # (a plan that depends on the work left moves without an event)
    predictor: str = "first-principles"  # what policies see: "agent" (PredictorBank with its default prior, as in
                                    # the agent), "first-principles" (PredictorBank(prior=None)), "perfect"
                                    # (the true curves); all banks are fed synthetic windows of the truth

    def __post_init__(self):
        def bad(what: str) -> SimError:
            return SimError(f"simulated node: {what}")

        if not (isinstance(self.cores, (int, float)) and math.isfinite(self.cores) and self.cores > 0):
            raise bad(f"cores (--cores) must be a positive number, got {self.cores!r}")
        if not (isinstance(self.gpus, int) and self.gpus >= 1):
            raise bad(f"gpus (--gpus) must be a whole number of at least 1, got {self.gpus!r}")
        if self.loader_cpus is not None and not (0 < self.loader_cpus <= self.cores):
            raise bad(f"loader_cpus (--loader-cpus) must be in (0, cores={self.cores:g}], got {self.loader_cpus!r}")
        if not (self.tick_s > 0 and math.isfinite(self.tick_s)):
            raise bad(f"tick_s (--tick-s) must be positive, got {self.tick_s!r}")
        if self.settle_ticks < 0:
            raise bad(f"settle_ticks (--settle-ticks) must be 0 or more, got {self.settle_ticks!r}")
        if self.available_cores is not None and not self.available_cores >= 0:
            raise bad(f"available_cores must be 0 or more, got {self.available_cores!r}")
        if self.cpu_knob not in ("shares", "quota"):
            raise bad(f"cpu_knob (--cpu-knob) must be shares or quota, got {self.cpu_knob!r}")
        if not 0.0 <= float(self.steps_known) <= 1.0:
            raise bad(f"steps_known (--steps-known) must be in [0, 1], got {self.steps_known!r}")

    @property
    def loader(self) -> float:
        return self.loader_cpus if self.loader_cpus is not None else round(self.cores * 0.9, 2)


def _oracle_policy(grid: int = 192):
    """The oracle on the curves it is given (the true ones here), within the node's loader memory
    budget when there is one: ``evaluation.oracle.curve_policy``."""
    from evaluation.oracle import curve_policy

    return curve_policy(grid)


_ORACLE = []


def _policy(name: str):
    if name == "oracle":
        if not _ORACLE:
            _ORACLE.append(_oracle_policy())
        return _ORACLE[0]
    from agent.policies import get_policy

    return get_policy(name)


class _TruePredictor:
    """The predictor slot filled with the true curves: for ``--predictor perfect`` and for the policies
    that decide without a learned curve (the oracle reads the truth)."""

    def __init__(self, active: dict):
        self._active = active

    def observe(self, job_id, obs) -> None:
        pass

    def curve(self, job_id):
        jb = self._active.get(job_id)
        return jb.curve if jb is not None else None

    def forget(self, job_id) -> None:
        pass


class _SimActuator:
    """The node side of an apply: the allocation is in force at once (no worker restart cost); the
    controller owns what is applied, this only keeps what the physics reads."""
    name = "sim"
    tracks_pids = False
    may_block = False                 # in memory: called on the tick's thread (agent.controller.ActuatorLane)

    def __init__(self, cpu_knob: str, active: dict):
        self.cpu_knob = cpu_knob          # the controller reads it: a quota is a cap, a share is not
        self.in_force: dict = {}
        self.node = None                  # the plan's NodeAllocation in force (apply_node)
        self.node_changed = False         # whether the loaders' yield changed since the physics last ran
        self._active = active

    def apply_node(self, node):
        if self.node is None or self.node.loaders_yield != node.loaders_yield:
            self.node_changed = True
        self.node = node
        return []

    def apply(self, job, desired):
        from agent.model import ApplyResult

        old = self.in_force.get(job.job)
        jb = self._active.get(job.job)
        if old is not None and jb is not None and old.workers != desired.workers:
            jb.changes += 1
        self.in_force[job.job] = desired
        return ApplyResult(job=job.job, ok=True, applied=desired)

    def release(self, job_id) -> None:
        self.in_force.pop(job_id, None)

    def restore(self) -> None:
        self.in_force.clear()
        self.node = None


def _worker_cpu_s_per_batch(jb: "_Job") -> float:
    """A worker's CPU per batch as the loader would measure it: the physics' (time slicing's cost in
    it), else the curve's."""
    r = jb.phys
    return r.cpu_s_per_batch if r is not None and r.cpu_s_per_batch > 0 else jb.curve.cpu_s_per_batch


def tells_steps(job: str, part: float) -> bool:
    """Whether the job is one of the ``part`` (0-1) of the jobs that say their steps left: a fixed draw
    from its id (a hash: crc32 of ids that differ in a digit is far from uniform), so every policy and
    run sees the same jobs saying."""
    return part >= 1.0 or (part > 0.0 and int.from_bytes(hashlib.blake2b(job.encode(), digest_size=8).digest(),
                                                           "big") / 2.0 ** 64 < part)


def _job_stats(jb: _Job, now: float, window_s: float, requested: int, trainer_cpu_s_per_step: float,
               steps_known: float = 0.0):
    """What the collector would report for a simulated job (``agent.collector``): its rates over the
    window since they last changed, from the node physics' ``JobRate``: the step less data wait with the
    trainer's CPU wait in it (``compute_s_per_step``) and that wait alone (``trainer_runq_s_per_step``,
    the loader's ``main_runq_s`` per step), the data wait, the trainer's CPU per step and cores, a
    worker's wall time per batch (its run-queue wait when it gets less than a core) and CPU cores."""
    from agent.model import JobStats

    cv, r = jb.curve, jb.phys
    bs, thr = cv.batch_size, jb.rate
    c, b = _worker_cpu_s_per_batch(jb), cv.blocked_s_per_batch
    compute = r.compute_s_per_step if r is not None and thr > 0 else cv.compute_s_per_step
    wait = r.data_wait_s_per_step if r is not None and thr > 0 else 0.0
    wall = max(r.wall_s_per_batch if r is not None else 0.0, c + b)
    return JobStats(
        job=jb.tj.job, uid=0, ranks=1, gpus=jb.tj.gpus, batch_size=bs, workers=jb.workers,
        requested_workers=requested, max_workers=None, samples_per_s=thr, compute_s_per_step=compute,
        data_wait_s_per_step=wait, data_wait_frac=wait / (wait + compute) if thr > 0 and wait + compute > 0 else 0.0,
        cpu_s_per_batch=c, wall_s_per_batch=wall, runq_s_per_batch=max(0.0, wall - c - b), blocked_s_per_batch=b,
        worker_cpu_cores=r.loader_cores if r is not None else 0.0,
        trainer_cpu_cores=r.trainer_cores if r is not None else 0.0,
        trainer_cpu_s_per_step=trainer_cpu_s_per_step,
        away_s=now - jb.away_from if jb.away else 0.0,
        trainer_runq_s_per_step=r.trainer_runq_s_per_step if r is not None and thr > 0 else 0.0,
        age_s=now - jb.start, observed_s=now - jb.start,
        window_s=window_s if thr > 0 else 0.0, worker_memory_bytes=cv.worker_memory_bytes,
        loader_memory_bytes=jb.workers * cv.worker_memory_bytes,
        steps_left=jb.remaining / bs if tells_steps(jb.tj.job, steps_known) else None)


@dataclass(frozen=True)
class _Workers:
    """A no-agent job's worker count where the physics takes it from an allocation (its own tuner's)."""
    workers: int


class _SimTuner:
    """A job's own ``num_workers="auto"`` tuner in the simulated loop: the loader's real ``AutoTuner``
    (``adloader.autotune``), started as the loader starts it (``initial_workers``: one worker per CPU of
    its GPUs' part of the node, ``SimConfig.tuner_gpu_part``, else of the whole node; at most
    ``max_workers``, which defaults to the node's CPUs) and fed a window
    every ``WINDOW_S`` of the job's life, as its thread is: the samples of that window, the job's
    per-batch figures, trainer CPU and its processes' CPU use from the physics (``JobRate``), the
    compute time less the trainer's run-queue wait (``autotune._unstarved_compute``). The window after
    a resize is dropped, as the thread drops a window whose resize count moved. Noise-free windows give
    the same decision again and again, so a tuner that has not moved for ``QUIET_WINDOWS`` windows since
    the node last changed stops being fed until it changes again (arrivals and departures wake every
    tuner)."""
    QUIET_WINDOWS = 6

    def __init__(self, cpus: float, start: float, samples: float, part: float = 1.0):
        from adloader import autotune

        self.window_s = autotune.WINDOW_S
        most = autotune.default_max_workers(cpus, auto=True)
        self.tuner = autotune.AutoTuner(cpus=float(cpus), cap=autotune.worker_cap(cpus, most),
                                        current=autotune.start_workers(cpus, most, part=part))
        self.next_s = start + self.window_s
        self.samples = samples
        self.drop = False
        self.quiet = 0

    @property
    def workers(self) -> int:
        return self.tuner.current

    def wake(self, now: float, samples: float) -> None:
        if self.next_s == math.inf:
            self.next_s, self.samples, self.quiet = now + self.window_s, samples, 0

    def window(self, now: float, jb: "_Job") -> bool:
        """One window ending now; True when the tuner resized the loader."""
        from predictor.observation import BadObservation, Observation

        done, self.samples = jb.samples - self.samples, jb.samples
        self.next_s = now + self.window_s
        r, cv = jb.phys, jb.curve
        obs = None
        if not self.drop and r is not None and done > 0:
            bs = cv.batch_size
            steps = done / bs
            # the training process's CPU per step (``main_cpu_s``: every rank's thread in it)
            self.tuner.trainer_cpu_s_per_step = r.trainer_cores / (jb.rate / bs) if jb.rate > 0 else 0.0
            self.tuner.cpu_used = r.loader_cores + r.trainer_cores   # its processes' CPU (/proc on a node)
            compute = max(0.5 * r.compute_s_per_step, r.compute_s_per_step - r.trainer_runq_s_per_step)
            c, b = _worker_cpu_s_per_batch(jb), cv.blocked_s_per_batch
            wall = max(r.wall_s_per_batch, c + b)
            try:
                obs = Observation(workers=self.tuner.current, cores=self.tuner.cpus, batch_size=bs,
                                  compute_s_per_step=compute, data_wait_s_per_step=r.data_wait_s_per_step,
                                  cpu_s_per_batch=c, wall_s_per_batch=wall, runq_s_per_batch=max(0.0, wall - c - b),
                                  blocked_s_per_batch=b, samples_per_s=done / self.window_s,
                                  duration_s=self.window_s, steps=max(1, int(round(steps))))
            except BadObservation:
                obs = None
        self.drop = False
        before = self.tuner.current
        want = self.tuner.window(obs)
        if want is None or want == before:
            self.quiet += 1
            if self.quiet >= self.QUIET_WINDOWS:
                self.next_s = math.inf
            return False
        self.drop, self.quiet = True, 0
        return True


def simulate_node(jobs_in: list[TraceJob], truth: dict, policy_name: str, cfg: SimConfig,
                  until_s: Optional[float] = None, measure_from_s: float = 0.0) -> dict:
    """One node under one policy: per-job results and node totals.

    The agent's own ``Controller`` decides, tick by tick (``tick(now)``), from a simulated snapshot
    source and through a simulated actuator: the same observation spacing and hygiene, the same
    tolerance for what counts as a change (``CPUS_TOLERANCE``), the same departure handling. Ticks
    are event-driven: one at each arrival or departure, then every ``tick_s`` while the predictor is
    learning, until the plan has held for ``settle_ticks`` plus one observation interval. The
    no-agent baselines (``NO_AGENT_POLICIES``) decide nothing: the physics alone
    (``evaluation.nodemodel.node_rates``, the one node model: trainer CPU, GPUs, habitual workers,
    static quotas, per-job autotune).

    ``until_s``: stop there even if jobs are left (a steady-state run; ``jobs`` holds the finished
    ones); ``window`` then holds every job's mean normalised throughput over [``measure_from_s``,
    ``until_s``] and ``window_agg`` their GPU-weighted sum, what the bench's static phases measure.
    ``plan`` is the allocation in force at the end (with the reason it was applied for), ``desired``
    and ``curves`` the controller's latest tick record (its plan, with reasons, and the curve it
    decided on per job: held back by its hysteresis where it differs from ``plan``), and ``rates``
    each job's physics then."""
    from agent.config import AgentConfig
    from agent.controller import OBSERVE_INTERVAL_S, Controller
    from agent.model import NodeSnapshot
    from agent.policies import PolicyConfig

    from evaluation import nodemodel

    if cfg.predictor not in PREDICTORS:
        raise SimError(f"unknown predictor {cfg.predictor!r}; choose one of: {', '.join(PREDICTORS)}")
    if cfg.cpu_knob not in ("shares", "quota"):
        raise SimError(f"unknown cpu knob {cfg.cpu_knob!r}; choose shares or quota")
    _check_kinds(jobs_in, truth)
    C = cfg.loader
    cpu_ids = tuple(range(int(cfg.cores)))
    pending = sorted(jobs_in, key=lambda j: j.arrival_s)
    active: dict[str, _Job] = {}
    finished: list[_Job] = []
    learning = cfg.predictor != "perfect" and policy_name not in CURVE_FREE_POLICIES
    if learning:
        from predictor.bank import PredictorBank

        predictor = PredictorBank(prior="default" if cfg.predictor == "agent" else None)
    else:
        predictor = _TruePredictor(active)
    act = _SimActuator(cfg.cpu_knob, active)
    t = 0.0
    end = math.inf if until_s is None else float(until_s)
    m0 = min(max(0.0, measure_from_s), end)

    def model_of(jb) -> "nodemodel.JobModel":
        if jb.model is None:
            m = nodemodel.job_model(jb.curve, jb.tj.gpus, int(cfg.cores // max(1, jb.tj.gpus)))
            jb.model = dataclasses.replace(m, habitual_workers=cfg.requested_workers) if cfg.requested_workers else m
        return jb.model

    def snapshot(now: float) -> NodeSnapshot:
        jobs = {}
        for jid, jb in active.items():
            m = model_of(jb)
            jobs[jid] = _job_stats(jb, now, min(cfg.tick_s, now - jb.since), m.habitual_workers,
                                   m.gpus * m.trainer_cpu_s_per_step, cfg.steps_known)
        # the CPU the jobs cannot get (``available_cores``) is unexplained capacity, not a tenant the
        # agent measures: the agent sees no other processes' CPU (foreign 0), as on the bench node
        return NodeSnapshot(now=now, loader_cpus=C, cpu_ids=cpu_ids, jobs=jobs, max_jobs=cfg.gpus,
                            loader_memory_bytes=cfg.loader_memory, foreign_cpu_cores=0.0,
                            loader_cpus_auto=cfg.loader_cpus is None)

    controller = None
    if policy_name not in NO_AGENT_POLICIES:
        options = dict(cfg.policy_options)
        controller_options = {k: options.pop(k, getattr(AgentConfig, k)) for k in CONTROLLER_OPTIONS}
        controller = Controller(snapshot_source=snapshot, policy=_policy(policy_name),
                                policy_config=PolicyConfig(**{"cpu_weights": cfg.cpu_knob == "shares",
                                                              "loaders_yield": cfg.loaders_yield, **options}),
                                predictor=predictor, actuators=[act], **controller_options)
    settle_full = cfg.settle_ticks + math.ceil(OBSERVE_INTERVAL_S / cfg.tick_s)
    settle = settle_full if learning else 0
    decisions = 0
    ticks_left = 0
    n_jobs = len(pending)
    mem_now = mem_peak = 0.0
    mem_over_s = 0.0
    mode = {"none": "none", "autotune": "autotune", "static-cores": "static"}.get(policy_name, "agent")
    rates_cache: dict = {}      # the physics of one set of jobs and allocations, computed once

    tuners: dict[str, _SimTuner] = {}       # autotune: each job's own tuner

    def physics():
        nonlocal mem_now
        applied = act.in_force if mode == "agent" else None
        if mode == "autotune":
            applied = {j: _Workers(tn.workers) for j, tn in tuners.items()}
        yielding = bool(mode == "agent" and act.node is not None and act.node.loaders_yield)
        # a job whose loop stopped (a validation pass) takes no CPU and delivers nothing; its allocation stays
        models = {j: model_of(jb) for j, jb in active.items() if not jb.away}
        # (a job's model is made once per phase: its id and the phase name it)
        key = (yielding,) + (tuple(sorted((j, active[j].phase, id(m), getattr((applied or {}).get(j), "workers", 0),
                             round(getattr((applied or {}).get(j), "cpus", 0.0), 6)) for j, m in models.items())))
        res = rates_cache.get(key)
        if res is None:
            if len(rates_cache) > 4096:
                rates_cache.clear()
            res = rates_cache[key] = nodemodel.node_rates(models, mode, cfg.cores, applied, node_gpus=cfg.gpus,
                                                          available_cores=cfg.available_cores,
                                                          hard_caps=cfg.cpu_knob == "quota",
                                                          loaders_yield=yielding)
        for jid, jb in active.items():
            r = res.get(jid)
            if r is None:                      # away: no samples; the rates it had stand (no window: rate 0)
                if jb.rate != 0.0:
                    jb.since = t
                jb.rate = 0.0
                continue
            if r.workers != jb.workers or abs(r.samples_per_s - jb.rate) > 1e-9 * max(1.0, jb.rate):
                jb.since = t                   # a new window starts: the collector's rates restart here
            jb.workers, jb.rate, jb.phys = r.workers, r.samples_per_s, r
        mem_now = sum(jb.workers * jb.curve.worker_memory_bytes for jb in active.values())

    last: list = []                     # the controller's latest tick record

    def tick() -> bool:
        nonlocal decisions
        decisions += 1
        if controller is None:           # no agent: nothing is decided, the physics alone
            return False
        record = controller.tick(t)
        last[:] = [record]
        if record.errors:
            raise SimError(f"node {jobs_in[0].node} at t={t:g} under {policy_name}: {'; '.join(record.errors)}")
        changed = bool(record.results) or act.node_changed
        act.node_changed = False
        if changed:
            physics()
        return changed

    while (pending or active) and t < end:
        # next event
        t_arr = pending[0].arrival_s if pending else math.inf
        t_fin = min((t + jb.remaining / jb.rate if jb.rate > 0 else math.inf) for jb in active.values()) \
            if active else math.inf
        # (the agent ticks on while a job's loop stands still: how long it has been away is what it reads)
        t_tick = t + cfg.tick_s if ticks_left > 0 or (controller is not None and (
            cfg.steps_known or any(jb.away for jb in active.values()))) else math.inf
        t_tune = min((tn.next_s for tn in tuners.values()), default=math.inf)
        t_phase = min((jb.start + jb.tj.phases[jb.phase][0] for jb in active.values()
                       if jb.phase < len(jb.tj.phases)), default=math.inf)
        # (a pause's start or end is an event like a phase's)
        t_phase = min([t_phase] + [(jb.away_from + jb.tj.pause[1]) if jb.away
                                   else (jb.trained_from + jb.tj.pause[0]) for jb in active.values() if jb.tj.pause])
        t_next = min(t_arr, t_fin, t_tick, t_tune, t_phase, end, m0 if t < m0 else math.inf)
        if t_next == math.inf:
            raise SimError(f"node {jobs_in[0].node}: jobs make no progress under {policy_name}")
        dt = t_next - t
        if dt > 0:                      # memory held over a stretch of time (not between two same-instant steps)
            mem_peak = max(mem_peak, mem_now)
            if cfg.loader_memory is not None and mem_now > cfg.loader_memory + 1.0:
                mem_over_s += dt
        in_window = dt if t >= m0 - 1e-12 else 0.0     # m0 is an event: a step never straddles it
        for jb in active.values():
            done = jb.rate * dt
            jb.remaining -= done
            jb.samples += done
            ceil = jb.curve.ceiling_samples_per_s
            jb.norm_s += (jb.rate / ceil) * dt
            jb.alive_s += dt
            if not jb.away:   # (a pause is no wait for data)
                jb.wait_s += (1.0 - jb.rate / ceil) * dt
            jb.win_norm_s += (jb.rate / ceil) * in_window
            jb.win_s += in_window
        t = t_next
        if t >= end:
            break
        changed = False
        for jid in [j for j, jb in active.items() if jb.remaining <= 1e-6 * jb.curve.batch_size]:
            jb = active.pop(jid)
            jb.done = t
            finished.append(jb)
            tuners.pop(jid, None)
            changed = True
        while pending and pending[0].arrival_s <= t + 1e-12:
            tj = pending.pop(0)
            cv = truth[tj.kind]
            active[tj.job] = _Job(tj=tj, curve=cv, remaining=max(1.0, tj.work_s * cv.ceiling_samples_per_s),
                                  start=t, since=t, trained_from=t)
            if mode == "autotune":
                from adloader.autotune import part_of_node

                part = part_of_node(max(1, tj.gpus), cfg.gpus) if cfg.tuner_gpu_part else 1.0
                tuners[tj.job] = _SimTuner(cfg.cores, t, 0.0, part)
            changed = True
        phased = False
        for jb in active.values():      # a new phase: the job's pipeline is another kind's from now on
            while jb.phase < len(jb.tj.phases) and jb.start + jb.tj.phases[jb.phase][0] <= t + 1e-12:
                jb.curve, jb.model = truth[jb.tj.phases[jb.phase][1]], None
                jb.phase += 1
                changed = phased = True
            if jb.tj.pause:               # its loop stops, or steps again
                every, length = jb.tj.pause
                if not jb.away and jb.trained_from + every <= t + 1e-12:
                    jb.away_from = t
                    changed = True
                elif jb.away and jb.away_from + length <= t + 1e-12:
                    jb.away_from, jb.trained_from = math.nan, t
                    changed = True
        if changed:
            for jid, tn in tuners.items():      # the node changed: every tuner's windows show it
                tn.wake(t, active[jid].samples)
            physics()          # rates before the tick (a new job at its own request, unmanaged)
            tick()             # the controller forgets departed jobs and places new ones
            # (a new phase shows in the job's next windows, not at this instant: the agent ticks on
            # until they come, whatever the predictor)
            ticks_left = settle_full if phased else settle
        elif t == t_tick:
            ticks_left = settle if tick() else ticks_left - 1
        if t == t_tune:
            resized = False
            for jid, tn in tuners.items():
                if tn.next_s <= t:
                    resized |= tn.window(t, active[jid])
            if resized:
                physics()
    starts = [jb.start for jb in finished]
    ends = [jb.done for jb in finished]
    span = max(ends) - min(starts) if finished else 0.0
    everyone = finished + list(active.values())
    window = {jb.tj.job: jb.win_norm_s / jb.win_s for jb in everyone if jb.win_s > 0}
    recorded = controller.applied() if controller is not None else {}
    return {
        "jobs": {jb.tj.job: {"kind": jb.tj.kind, "gpus": max(1, jb.tj.gpus), "jct_s": jb.done - jb.start, "norm_mean": jb.norm_s / jb.alive_s
                             if jb.alive_s > 0 else 0.0, "wait_s": jb.wait_s, "alive_s": jb.alive_s,
                             "norm_s": jb.norm_s * max(1, jb.tj.gpus), "changes": jb.changes} for jb in finished},
        "makespan_s": span, "decisions": decisions, "n_jobs": n_jobs,
        "loader_memory_peak_bytes": mem_peak, "memory_over_budget_s": mem_over_s,
        "window": window,
        "window_agg": sum(max(1, jb.tj.gpus) * window[jb.tj.job] for jb in everyone if jb.tj.job in window),
        # the allocation in force; its reason the controller's record of it (a hold says why it holds)
        # (cpu_weight: the cores its group weighs where the plan sets it apart from cpus; None: cpus)
        "plan": {j: {"workers": a.workers, "cpus": a.cpus, "cpu_weight": a.cpu_weight,
                     "reason": recorded.get(j, a).reason} for j, a in act.in_force.items()},
        "desired": ({j: {"workers": a.workers, "cpus": a.cpus, "cpu_weight": a.cpu_weight, "reason": a.reason}
                     for j, a in last[0].plan.allocations.items()} if last else {}),
        "loaders_yield": bool(act.node is not None and act.node.loaders_yield),
        "curves": dict(last[0].curves) if last else {},
        "rates": {jb.tj.job: dataclasses.asdict(jb.phys) for jb in active.values() if jb.phys is not None},
    }


def steady_state(truth: dict, policy_name: str, cfg: SimConfig, warmup_s: float = 6.0, measure_s: float = 12.0,
                 gpus_of: Optional[dict] = None, phases_of: Optional[dict] = None,
                 pauses_of: Optional[dict] = None) -> dict:
    """A static mix (what the bench's static phases run): every job of ``truth`` (name -> curve with its
    workload, ``evaluation.nodemodel.curve_with_workload``) arrives at 0 on one node and runs under
    ``policy_name`` for ``warmup_s`` + ``measure_s``; ``simulate_node``'s result, whose ``window_agg``
    is the GPU-weighted normalised throughput over the measured part. ``gpus_of``: job -> GPUs
    (default: the curve's ``extra["gpus"]``, else 1). ``phases_of``: job -> its later phases,
    ``((after_s, name), ...)``, each name a curve of ``truth`` that is no job of its own. ``pauses_of``:
    job -> (every_s, for_s), its loop's pauses (``TraceJob.pause``)."""
    phases_of = phases_of or {}
    phase_only = {name for ph in phases_of.values() for _, name in ph}
    trace = [TraceJob("node", j, j, 0.0, 1e9, int((gpus_of or {}).get(j) or (cv.extra or {}).get("gpus") or 1),
                      tuple(phases_of.get(j, ())), tuple((pauses_of or {}).get(j, ())))
             for j, cv in truth.items() if j not in phase_only]
    # the agent ticks every tick_s for the whole run, as a real one does (not only while its plan moves)
    cfg = dataclasses.replace(cfg, settle_ticks=max(cfg.settle_ticks, int(math.ceil((warmup_s + measure_s) / cfg.tick_s)) + 1))
    return simulate_node(trace, truth, policy_name, cfg, until_s=warmup_s + measure_s, measure_from_s=warmup_s)


# -- many nodes ----------------------------------------------------------------------------------

def _run_chunk(args):
    nodes, truth, policies, cfg = args
    out = {p: {} for p in policies}
    for p in policies:
        for node, jobs in nodes:
            out[p][node] = simulate_node(jobs, truth, p, cfg)
    return out


def node_truth(curves: dict, cfg: SimConfig, source: str) -> dict:
    """Curves as they behave on a simulated node (corpus curves scaled to the node's cores per GPU)."""
    if source != "corpus":
        return curves
    factor = (cfg.loader / cfg.gpus) / MEASURED_LOADER_CPUS
    return {k: _scale(cv, factor) for k, cv in curves.items()}


def _check_kinds(trace, curves) -> None:
    """SimError naming every kind (a job's, or a later phase's) the trace has and ``curves`` lacks."""
    unknown = sorted(({tj.kind for tj in trace} | {k for tj in trace for _, k in tj.phases}) - set(curves))
    if unknown:
        raise SimError(f"trace names unknown kinds: {', '.join(unknown)}; known: {', '.join(sorted(curves))}")


def simulate(trace: list[TraceJob], curves: dict, policies, cfg: SimConfig, source: str = "builtin",
             processes: Optional[int] = None) -> dict:
    """Run every policy over every node of the trace; returns per-policy summaries and per-node results."""
    _check_kinds(trace, curves)
    truth = with_memory(node_truth(curves, cfg, source), cfg)
    by_node: dict[str, list] = {}
    for tj in trace:
        by_node.setdefault(tj.node, []).append(tj)
    items = sorted(by_node.items())
    procs = processes if processes is not None else min(os.cpu_count() or 1, max(1, len(items) // 50))
    t0 = time.perf_counter()
    if procs > 1:
        import multiprocessing as mp

        chunks = [items[i::procs] for i in range(procs)]
        with mp.get_context("fork").Pool(procs) as pool:
            parts = pool.map(_run_chunk, [(c, truth, list(policies), cfg) for c in chunks])
    else:
        parts = [_run_chunk((items, truth, list(policies), cfg))]
    per_policy = {p: {} for p in policies}
    for part in parts:
        for p, nodes in part.items():
            per_policy[p].update(nodes)
    wall = time.perf_counter() - t0
    summary = {p: summarise_policy(per_policy[p]) for p in policies}
    ref = "even" if "even" in per_policy else ("even-static" if "even-static" in per_policy else None)
    if ref:
        even_norm = {(n, j): v["norm_mean"] for n, r in per_policy[ref].items() for j, v in r["jobs"].items()}
        for p in policies:
            ratios = [v["norm_mean"] / even_norm[(n, j)] for n, r in per_policy[p].items()
                      for j, v in r["jobs"].items() if even_norm.get((n, j), 0) > 0]
            summary[p]["fairness_vs_even_min"] = min(ratios) if ratios else math.nan
            summary[p]["fairness_vs_even_p5"] = M.percentile(ratios, 5) if ratios else math.nan
    for p, cmp in per_node_comparison(per_policy).items():
        summary[p]["per_node"] = cmp
    for p in policies:
        for base in ("oracle", "even-static", "even"):
            if base in summary and base != p and summary[base]["agg_normalised"] > 0:
                summary[p][f"ratio_{base}"] = summary[p]["agg_normalised"] / summary[base]["agg_normalised"]
    return {"summary": summary, "wall_s": wall, "nodes": len(items), "jobs": len(trace), "processes": procs,
            "config": cfg.__dict__ | {"loader_cpus_resolved": cfg.loader}}


def _jct_gpu_mean(jobs: dict) -> float:
    """Mean JCT with each job counted once per GPU (``metrics.gpu_weighted_mean``)."""
    return M.gpu_weighted_mean({j: v["jct_s"] for j, v in jobs.items()}, {j: v.get("gpus", 1) for j, v in jobs.items()})


def _node_figures(r: dict) -> Optional[tuple[float, float, float]]:
    """A node's (makespan, mean JCT, GPU-weighted mean JCT), None for a node with no finished job."""
    if r["makespan_s"] <= 0 or not r["jobs"]:
        return None
    return r["makespan_s"], M.mean([v["jct_s"] for v in r["jobs"].values()]), _jct_gpu_mean(r["jobs"])


PER_NODE_TIE = 0.001     # per-node ratios within this of 1 are ties (neither better nor worse)


def per_node_comparison(per_policy: dict) -> dict:
    """Each policy node by node against the best of the other policies on that node (the oracle is no
    one's alternative and is left out of "the others"): for the makespan and the mean JCT, the best
    other's figure over the policy's (above 1: the policy is better there; "jct_gpu": the mean JCT with
    each job counted once per GPU, as the aggregate counts throughput), its median, 10th
    percentile, min and max over the nodes, and on how many nodes it is better or worse (beyond
    ``PER_NODE_TIE``). (A trace's aggregate is its work over the makespan: the makespan's ratio is the
    aggregate's.) An average over a trace can hide the nodes where a policy loses; this shows them."""
    users = [p for p in per_policy if p != "oracle"]
    if len(users) < 2:
        return {}
    figs = {p: {n: _node_figures(r) for n, r in per_policy[p].items()} for p in per_policy}
    out = {}
    for p in per_policy:
        others = [o for o in users if o != p]
        rows: dict[str, list[float]] = {"makespan": [], "jct": [], "jct_gpu": []}
        for n, mine in figs[p].items():
            theirs = [figs[o].get(n) for o in others]
            if mine is None or any(t is None for t in theirs) or min(mine) <= 0:
                continue
            for i, k in enumerate(rows):
                rows[k].append(min(t[i] for t in theirs) / mine[i])
        out[p] = {k: {"median": M.median(v), "p10": M.percentile(v, 10), "min": min(v), "max": max(v),
                      "better": sum(x > 1.0 + PER_NODE_TIE for x in v),
                      "worse": sum(x < 1.0 - PER_NODE_TIE for x in v), "nodes": len(v)}
                  for k, v in rows.items() if v}
    return out


def with_memory(truth: dict, cfg: SimConfig) -> dict:
    """The curves with ``cfg.worker_memory_bytes`` as every kind's per-worker memory, when it is set."""
    if cfg.worker_memory_bytes is None:
        return truth
    return {k: dataclasses.replace(cv, worker_memory_bytes=float(cfg.worker_memory_bytes)) for k, cv in truth.items()}


def summarise_policy(nodes: dict) -> dict:
    aggs, spans, jcts, waits, alive, norms, changes, decisions = [], [], [], 0.0, 0.0, [], 0, 0
    every_job = {(n, j): v for n, r in nodes.items() for j, v in r["jobs"].items()}
    peaks = [r.get("loader_memory_peak_bytes", 0.0) for r in nodes.values()]
    over = sum(r.get("memory_over_budget_s", 0.0) for r in nodes.values())
    for r in nodes.values():
        if r["makespan_s"] > 0:
            aggs.append(sum(v["norm_s"] for v in r["jobs"].values()) / r["makespan_s"])
            spans.append(r["makespan_s"])
        for v in r["jobs"].values():
            jcts.append(v["jct_s"])
            waits += v["wait_s"]
            alive += v["alive_s"]
            norms.append(v["norm_mean"])
            changes += v["changes"]
        decisions += r["decisions"]
    return {"agg_normalised": M.mean(aggs), "makespan_mean_s": M.mean(spans),
            "makespan_max_s": max(spans) if spans else math.nan, "jct_mean_s": M.mean(jcts),
            "jct_gpu_mean_s": _jct_gpu_mean(every_job),
            "jct_p95_s": M.percentile(jcts, 95), "gpu_idle_frac": M.gpu_idle_fraction([waits], [alive]),
            "jain": M.jain_index(norms), "worker_changes": changes, "decisions": decisions,
            "loader_memory_peak_max_bytes": max(peaks) if peaks else 0.0,
            "loader_memory_peak_p95_bytes": M.percentile(peaks, 95) if peaks else 0.0,
            "memory_over_budget_frac": over / sum(spans) if spans and sum(spans) > 0 else 0.0}


def markdown(result: dict) -> str:
    s = result["summary"]
    lines = ["| policy | agg. norm. throughput / node | × oracle | × even-static | × even | makespan mean / max s "
             "| JCT mean / GPU-weighted mean / p95 s | GPU idle | Jain | min ratio to even (p5) | worker changes "
             "| decisions |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def f(v, spec=".3f"):
        return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)

    for p, r in s.items():
        lines.append(f"| {p} | {f(r['agg_normalised'])} | {f(r.get('ratio_oracle'))} | {f(r.get('ratio_even-static'))} "
                     f"| {f(r.get('ratio_even'))} | {f(r['makespan_mean_s'], '.1f')} / {f(r['makespan_max_s'], '.1f')} "
                     f"| {f(r['jct_mean_s'], '.1f')} / {f(r.get('jct_gpu_mean_s'), '.1f')} / {f(r['jct_p95_s'], '.1f')} "
                     f"| {f(r['gpu_idle_frac'], '.1%')} "
                     f"| {f(r['jain'])} | {f(r.get('fairness_vs_even_min'), '.2f')} ({f(r.get('fairness_vs_even_p5'), '.2f')}) "
                     f"| {r['worker_changes']} | {r['decisions']} |")
    if any(r.get("per_node") for r in s.values()):
        lines += ["", "| policy | per node, the best other policy's makespan / this one's (above 1: better), median "
                  "[p10, min–max] | the same for mean JCT | the same for GPU-weighted mean JCT "
                  "| nodes better / worse: makespan; JCT; GPU-weighted JCT |",
                  "|---|---|---|---|---|"]

        def dist(d):
            return "–" if d is None else f"{d['median']:.3f} [{d['p10']:.3f}, {d['min']:.3f}–{d['max']:.3f}]"

        for p, r in s.items():
            c = r.get("per_node") or {}
            if not c:
                continue
            n = max(d["nodes"] for d in c.values())
            wins = "; ".join(f"{c[k]['better']} / {c[k]['worse']}" if k in c else "–"
                             for k in ("makespan", "jct", "jct_gpu"))
            lines.append(f"| {p} | {dist(c.get('makespan'))} | {dist(c.get('jct'))} | {dist(c.get('jct_gpu'))} "
                         f"| {wins} of {n} |")
    if any(r.get("loader_memory_peak_max_bytes") for r in s.values()):
        budget = (result.get("config") or {}).get("loader_memory")
        lines += ["", "| policy | loader memory peak per node, max / p95 GiB | node-time over the budget"
                  + (f" ({budget / (1 << 30):.2f} GiB)" if budget else " (no budget)") + " |", "|---|---|---|"]
        for p, r in s.items():
            lines.append(f"| {p} | {r['loader_memory_peak_max_bytes'] / (1 << 30):.2f} / "
                         f"{r['loader_memory_peak_p95_bytes'] / (1 << 30):.2f} | {f(r['memory_over_budget_frac'], '.1%')} |")
    return "\n".join(lines)
