"""The node's physics with the workload model of ISSUE 11: training processes that need CPU, jobs with
several GPUs, users' habitual worker counts, and the four ways a node is run (``MODES``).

A job (``JobModel``): its loader's first-principles curve (``predictor.curve.ThroughputCurve``: g =
the step with data ready, c = loader CPU s per step's batch, all its GPUs' batches together, b =
blocked s), ``trainer_cpu_s_per_step`` = CPU seconds each of its ``gpus`` rank threads spends per step
(the busy part of the step; the rest, g - t, is the GPU), and ``habitual_workers``.

How the node's CPUs ``N`` are shared, per mode (what ``adloader bench`` runs, modelled):

- ``agent``: the agent's cgroup subtree holds every loader worker; where trainers need CPU it is
  capped at ``N`` less what they use at their pace plus a margin (``agent.actuators.cgroup``), so each
  trainer finds its cores; the
  loaders share the rest by the plan's weights (``cpus``), each capped at what its workers can use
  (water-filling: work-conserving). Fixed point over the jobs' rates.
- ``none`` / ``autotune`` (no agent): the kernel shares CPU fairly between jobs (each job's processes
  form one group: a Slurm job cgroup, a pod, or one session's autogroup), water-filled up to what each
  job can use; inside a job, its trainer and its workers share the job's CPUs per runnable thread
  (``predictor.curve.shared_cpu_throughput``: busy workers stretch the trainer's CPU part).
  ``autotune``: each job's worker count is what its own tuner picks on the CPUs it may use
  (``shared_cpu_knee`` on ``N``), seeing nobody else.
- ``static``: each job gets ``N * gpus / node_gpus`` cores and no more (a hard quota or exclusive
  cores), shared inside the job as in ``none``. Not modelled: CFS quota throttling latency (a trainer
  throttled for the rest of a 100 ms period after its workers spent the quota), which the bench shows
  to cost more than the share alone.

Throughput counts once per GPU: the node's objective is ``sum(gpus * normalised)``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional

from predictor.curve import ThroughputCurve, shared_cpu_knee, shared_cpu_throughput

MODES = ("agent", "none", "autotune", "static")
TOL = 1e-6          # relative: the fixed points stop when rates move less than this


@dataclass(frozen=True)
class JobModel:
    curve: ThroughputCurve
    trainer_cpu_s_per_step: float = 0.0     # per rank thread
    gpus: int = 1
    habitual_workers: int = 1

    @property
    def trainer_cores(self) -> float:
        """Cores the trainers use at full speed."""
        g = self.curve.compute_s_per_step
        return self.gpus * self.trainer_cpu_s_per_step / g if g > 0 else 0.0

    def loader_bps(self, workers: int, cores: float) -> float:
        """Batches/s the loader delivers with ``workers`` on ``cores`` (trainer not slowed)."""
        return self.curve.throughput(workers, cores) / self.curve.batch_size

    def demand(self, workers: int) -> float:
        """Cores the whole job (trainers + loader) uses with ``workers`` and no CPU limit."""
        bps = self.loader_bps(workers, math.inf)
        return bps * (self.curve.cpu_s_per_batch + self.gpus * self.trainer_cpu_s_per_step)

    def shared_bps(self, workers: int, cpus: float) -> float:
        return shared_cpu_throughput(self.curve, workers, cpus, self.trainer_cpu_s_per_step,
                                     self.gpus) / self.curve.batch_size


def waterfill(capacity: float, weights: Mapping[str, float], caps: Mapping[str, float]) -> dict:
    """Split ``capacity`` by ``weights``, nobody above its cap; what a capped job leaves is re-split."""
    got = {j: 0.0 for j in weights}
    active = {j for j in weights if caps[j] > 1e-12 and weights[j] > 0}
    left = capacity
    while active and left > 1e-12:
        tw = sum(weights[j] for j in active)
        full = {j for j in active if got[j] + left * weights[j] / tw >= caps[j] - 1e-12}
        if not full:
            for j in active:
                got[j] += left * weights[j] / tw
            break
        for j in full:
            left -= caps[j] - got[j]
            got[j] = caps[j]
        active -= full
    return got


@dataclass(frozen=True)
class JobRate:
    workers: int
    loader_cores: float
    trainer_cores: float
    samples_per_s: float
    normalised: float


def autotune_workers(m: JobModel, node_cores: float, cap: Optional[int] = None) -> int:
    """What the job's own ``num_workers="auto"`` tuner settles at: the best count on the CPUs it may
    use (the whole node: it cannot see the other jobs), its trainer sharing them."""
    cap = cap or max(2, 4 * math.ceil(node_cores))
    if m.trainer_cpu_s_per_step > 0:
        return shared_cpu_knee(m.curve, node_cores, m.trainer_cpu_s_per_step, cap, m.gpus)
    return max(1, min(cap, m.curve.knee_workers(node_cores)))


def node_rates(models: Mapping[str, JobModel], mode: str, node_cores: float,
               allocations: Optional[Mapping] = None, node_gpus: Optional[int] = None) -> dict[str, JobRate]:
    """Steady rates of the jobs on one node. ``allocations``: job -> JobAllocation (``agent`` mode:
    workers and cpus weights; other modes: the workers, default the habitual count)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of: {', '.join(MODES)}")
    allocations = allocations or {}
    N = float(node_cores)
    ids = sorted(models)
    if not ids:
        return {}

    def workers_of(j: str) -> int:
        a = allocations.get(j)
        if a is not None:
            return max(1, int(a.workers))
        if mode == "autotune":
            return autotune_workers(models[j], N)
        return max(1, models[j].habitual_workers)

    w = {j: workers_of(j) for j in ids}
    out: dict[str, JobRate] = {}
    if mode == "agent":
        # The loaders' subtree is capped at N less the trainers' need (agent.actuators.cgroup) when they
        # need CPU, so a trainer always finds its cores; the loaders share the rest by the plan's weights
        # (``cpus``), each capped at what its workers can use (water-filling: work-conserving).
        weights = {j: max(1e-6, float(getattr(allocations.get(j), "cpus", 1.0) or 1e-6)) for j in ids}
        need = sum(models[j].trainer_cores for j in ids)
        bps = {j: models[j].loader_bps(w[j], math.inf) for j in ids}
        cores = {j: 0.0 for j in ids}
        for _ in range(80):
            trainer = {j: bps[j] * models[j].gpus * models[j].trainer_cpu_s_per_step for j in ids}
            t_total = sum(trainer.values())
            scale = min(1.0, N / t_total) if t_total > 0 else 1.0      # trainers alone over the node
            # the cap: N less what the trainers use at their pace, with the margin (trainer_cores_expected)
            pace = sum(min(models[j].trainer_cores, trainer[j] + 0.1 * models[j].trainer_cores) for j in ids)
            cap = max(sum(weights.values()), N - pace) if need >= 0.05 else N
            avail = max(0.0, min(cap, N - t_total * scale))
            cores = waterfill(avail, weights, {j: _loader_demand(models[j], w[j]) for j in ids})
            new = {}
            for j in ids:
                m = models[j]
                b = m.loader_bps(w[j], cores[j])
                t = m.trainer_cpu_s_per_step
                if scale < 1.0 and t > 0:
                    b = min(b, 1.0 / (m.curve.compute_s_per_step - t + t / scale))
                new[j] = b
            done = all(abs(new[j] - bps[j]) <= TOL * max(1e-3, bps[j]) for j in ids)
            bps = new if done else {j: 0.5 * bps[j] + 0.5 * new[j] for j in ids}
            if done:
                break
        for j in ids:
            m = models[j]
            out[j] = _rate(m, w[j], cores[j], bps[j] * m.gpus * m.trainer_cpu_s_per_step, bps[j])
        return out
    if mode == "static":
        gpus_total = float(node_gpus or sum(models[j].gpus for j in ids))
        share = {j: N * models[j].gpus / gpus_total for j in ids}
    else:
        # fair between jobs: what a job runs on while it is runnable is the water level (the share of a
        # job that wants more than the others leave), not its average use
        got = waterfill(N, {j: 1.0 for j in ids}, {j: models[j].demand(w[j]) for j in ids})
        saturated = sum(got.values()) >= N * (1.0 - 1e-9)
        level = max(got.values()) if got and saturated else N     # not saturated: nobody is held back
        share = {j: max(got[j], level) for j in ids}
    for j in ids:
        m = models[j]
        b = m.shared_bps(w[j], share[j])
        t = b * m.gpus * m.trainer_cpu_s_per_step
        out[j] = _rate(m, w[j], max(0.0, min(share[j], b * m.curve.cpu_s_per_batch)), t, b)
    return out


def _loader_demand(m: JobModel, workers: int) -> float:
    """Cores the loader alone uses with ``workers`` and unlimited CPU (trainer not slowed)."""
    return m.loader_bps(workers, math.inf) * m.curve.cpu_s_per_batch


def _rate(m: JobModel, workers: int, loader: float, trainer: float, bps: float) -> JobRate:
    sps = bps * m.curve.batch_size
    ceil = m.curve.ceiling_samples_per_s
    return JobRate(workers=workers, loader_cores=loader, trainer_cores=trainer, samples_per_s=sps,
                   normalised=min(1.0, sps / ceil) if ceil > 0 and math.isfinite(ceil) else 1.0)


def objective(models: Mapping[str, JobModel], rates: Mapping[str, JobRate]) -> float:
    """GPU-weighted sum of normalised throughput."""
    return sum(models[j].gpus * r.normalised for j, r in rates.items())




# -- steady state of a static mix under each policy (what the bench's static scenarios measure) -----

AGENT_POLICIES = ("even-static", "even", "adaptive")
USER_POLICIES = ("none", "autotune", "static-cores")


def _stats(job_id: str, m: JobModel, r: Optional[JobRate], applied, requested: int):
    from agent.model import JobStats

    cv = m.curve
    sps = r.samples_per_s if r is not None else 0.0
    bps = sps / cv.batch_size
    step = 1.0 / bps if bps > 0 else 0.0
    g = cv.compute_s_per_step
    wait = max(0.0, step - g) if bps > 0 else 0.0
    return JobStats(
        job=job_id, uid=0, ranks=1, gpus=m.gpus, batch_size=cv.batch_size,
        workers=applied.workers if applied is not None else requested, requested_workers=requested,
        max_workers=None, samples_per_s=sps, compute_s_per_step=g, data_wait_s_per_step=wait,
        data_wait_frac=wait / step if step > 0 else 0.0, cpu_s_per_batch=cv.cpu_s_per_batch,
        wall_s_per_batch=cv.cpu_s_per_batch + cv.blocked_s_per_batch, runq_s_per_batch=0.0,
        blocked_s_per_batch=cv.blocked_s_per_batch, worker_cpu_cores=r.loader_cores if r is not None else 0.0,
        trainer_cpu_cores=r.trainer_cores if r is not None else 0.0,
        trainer_cpu_s_per_step=m.gpus * m.trainer_cpu_s_per_step, window_s=2.0 if r is not None else 0.0)


def steady_state(models: Mapping[str, JobModel], policy: str, node_cores: float, loader_cpus: float,
                 config=None, rounds: int = 12) -> dict[str, JobRate]:
    """Rates a static mix settles at under ``policy`` (one of ``USER_POLICIES + AGENT_POLICIES``).
    Agent policies are the real ``agent.policies`` functions fed the true curves (a perfect predictor)
    and the jobs' stats as the collector would see them, re-decided ``rounds`` times against their own
    applied plan (hysteresis included) with the physics in between."""
    if policy == "none":
        return node_rates(models, "none", node_cores)
    if policy == "autotune":
        return node_rates(models, "autotune", node_cores)
    if policy == "static-cores":
        return node_rates(models, "static", node_cores)
    if policy not in AGENT_POLICIES:
        raise ValueError(f"unknown policy {policy!r}")
    from agent.model import NodeSnapshot
    from agent.policies import PolicyConfig, get_policy

    config = config or PolicyConfig(cpu_weights=True)
    pol = get_policy(policy)
    ids = sorted(models)
    applied: dict = {}
    rates: dict[str, JobRate] = {}
    for _ in range(rounds):
        jobs = {j: _stats(j, models[j], rates.get(j), applied.get(j), models[j].habitual_workers) for j in ids}
        snap = NodeSnapshot(now=0.0, loader_cpus=loader_cpus, cpu_ids=tuple(range(int(math.ceil(node_cores)))),
                            jobs=jobs, max_jobs=len(ids), applied=dict(applied))
        plan = pol(snap, {j: models[j].curve for j in ids}, config)
        applied = dict(plan.allocations)
        rates = node_rates(models, "agent", node_cores, applied)
    return rates


def models_from_bench_specs(specs: Mapping[str, dict]) -> dict[str, JobModel]:
    """JobModels from the bench's calibrated job specs (``evaluation.catalog.JobSpec`` as dicts): the
    same step, loader demand, trainer fraction, GPUs and habitual workers the real jobs ran with."""
    out = {}
    for j, sp in specs.items():
        step = float(sp["step_s"])
        curve = ThroughputCurve(job=j, batch_size=int(sp["batch_size"]), compute_s_per_step=step,
                                cpu_s_per_batch=float(sp["demand_cores"]) * step, blocked_s_per_batch=0.0,
                                confidence=1.0, observed_configs=3, source="bench-calibration")
        out[j] = JobModel(curve=curve, trainer_cpu_s_per_step=float(sp.get("trainer_cpu_frac") or 0.0) * step,
                          gpus=int(sp.get("gpus") or 1), habitual_workers=int(sp.get("num_workers") or 1))
    return out


__all__ = ["JobModel", "JobRate", "MODES", "AGENT_POLICIES", "USER_POLICIES", "autotune_workers", "node_rates",
           "objective", "waterfill", "steady_state", "models_from_bench_specs"]
