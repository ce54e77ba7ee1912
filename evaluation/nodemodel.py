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

from predictor.curve import ThroughputCurve, shared_cpu_knee, shared_cpu_state, shared_cpu_throughput

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
    """One job's steady state: its rates, and the figures its collector would report."""
    workers: int
    loader_cores: float             # CPU its workers use
    trainer_cores: float            # CPU its training process(es) use
    samples_per_s: float
    normalised: float               # samples/s over the ceiling
    compute_s_per_step: float = 0.0         # the step less data wait (the trainer's CPU wait included)
    trainer_runq_s_per_step: float = 0.0    # the part of it the trainer waited for a CPU
    data_wait_s_per_step: float = 0.0
    wall_s_per_batch: float = 0.0           # in a worker: c / its share of a core + b


def autotune_workers(m: JobModel, node_cores: float, cap: Optional[int] = None) -> int:
    """What the job's own ``num_workers="auto"`` tuner settles at: the best count on the CPUs it may
    use (the whole node: it cannot see the other jobs), its trainer sharing them."""
    cap = cap or max(2, 4 * math.ceil(node_cores))
    if m.trainer_cpu_s_per_step > 0:
        return shared_cpu_knee(m.curve, node_cores, m.trainer_cpu_s_per_step, cap, m.gpus)
    return max(1, min(cap, m.curve.knee_workers(node_cores)))


def node_rates(models: Mapping[str, JobModel], mode: str, node_cores: float,
               allocations: Optional[Mapping] = None, node_gpus: Optional[int] = None,
               available_cores: Optional[float] = None, hard_caps: bool = False) -> dict[str, JobRate]:
    """Steady rates of the jobs on one node. ``allocations``: job -> JobAllocation (``agent`` mode:
    workers and cpus weights, a job without one runs its habitual workers; other modes: the workers,
    default the habitual count). ``available_cores``: the CPU the jobs can get at most (default
    ``node_cores``; less where other tenants take the rest); ``node_cores`` stays what the node is
    configured with (the agent's subtree cap and static quotas are computed from it). ``hard_caps``
    (``agent`` mode): a plan's ``cpus`` is a hard quota on the job's loader (``cpu_knob="quota"``), not
    a weight."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of: {', '.join(MODES)}")
    allocations = allocations or {}
    N = float(node_cores)
    A = min(N, float(available_cores)) if available_cores is not None else N
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
        # The loaders' subtree is capped at N less the trainers' pace (agent.actuators.cgroup) when they
        # need CPU, so a trainer always finds its cores; the loaders share the rest by the plan's weights
        # (``cpus``), each capped at what its workers can use (water-filling: work-conserving).
        weights = {j: max(1e-6, float(getattr(allocations.get(j), "cpus", 1.0) or 1e-6)) for j in ids}
        need = sum(models[j].trainer_cores for j in ids)
        bps = {j: models[j].loader_bps(w[j], math.inf) for j in ids}
        cores = {j: 0.0 for j in ids}
        caps = {j: _loader_demand(models[j], w[j]) for j in ids}
        if hard_caps:
            caps = {j: min(caps[j], weights[j]) if j in allocations else caps[j] for j in ids}
        scale = 1.0
        for _ in range(80):
            trainer = {j: bps[j] * models[j].gpus * models[j].trainer_cpu_s_per_step for j in ids}
            t_total = sum(trainer.values())
            scale = min(1.0, A / t_total) if t_total > 0 else 1.0      # trainers alone over the CPU they get
            # the cap: N less what the trainers use at their pace, with the margin (trainer_cores_expected)
            pace = sum(min(models[j].trainer_cores, trainer[j] + 0.1 * models[j].trainer_cores) for j in ids)
            cap = max(sum(weights.values()), N - pace) if need >= 0.05 else N
            avail = max(0.0, min(cap, A - t_total * scale))
            cores = waterfill(avail, weights, caps)
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
            m, c = models[j], models[j].curve.cpu_s_per_batch
            # a busy worker's share of a core: all of one unless the loader is held to fewer cores than workers
            core_bound = c > 0 and bps[j] * c >= cores[j] * (1 - 1e-6) and cores[j] < w[j]
            s_w = max(1e-6, cores[j] / w[j]) if core_bound else 1.0
            out[j] = _rate(m, w[j], cores[j], bps[j] * m.gpus * m.trainer_cpu_s_per_step, bps[j],
                           trainer_share=scale, worker_share=s_w)
        return out
    if mode == "static":
        # a hard quota per job (node cores x its GPUs / the node's GPUs); where other tenants leave the
        # jobs less than the node, each job gets at most the fair level of what is left
        gpus_total = float(node_gpus or sum(models[j].gpus for j in ids))
        quota = {j: N * models[j].gpus / gpus_total for j in ids}
        if A >= N - 1e-12:
            share = quota
        else:
            got = waterfill(A, {j: 1.0 for j in ids}, {j: min(quota[j], models[j].demand(w[j])) for j in ids})
            level = max(got.values()) if sum(got.values()) >= A * (1.0 - 1e-9) else N
            share = {j: min(quota[j], max(got[j], level)) for j in ids}
    else:
        # fair between jobs: what a job runs on while it is runnable is the water level (the share of a
        # job that wants more than the others leave), not its average use
        got = waterfill(A, {j: 1.0 for j in ids}, {j: models[j].demand(w[j]) for j in ids})
        saturated = sum(got.values()) >= A * (1.0 - 1e-9)
        level = max(got.values()) if got and saturated else A     # not saturated: nobody is held back
        share = {j: max(got[j], level) for j in ids}
    for j in ids:
        m = models[j]
        st = shared_cpu_state(m.curve, w[j], share[j], m.trainer_cpu_s_per_step, m.gpus)
        b = st.samples_per_s / m.curve.batch_size
        t = b * m.gpus * m.trainer_cpu_s_per_step
        out[j] = _rate(m, w[j], max(0.0, min(share[j], b * m.curve.cpu_s_per_batch)), t, b,
                       trainer_share=st.trainer_share, worker_share=st.worker_share)
    return out


def _loader_demand(m: JobModel, workers: int) -> float:
    """Cores the loader alone uses with ``workers`` and unlimited CPU (trainer not slowed)."""
    return m.loader_bps(workers, math.inf) * m.curve.cpu_s_per_batch


def _rate(m: JobModel, workers: int, loader: float, trainer: float, bps: float, trainer_share: float = 1.0,
          worker_share: float = 1.0) -> JobRate:
    """A job's rates and what its collector would read: the trainer's CPU part stretched to ``t /
    trainer_share`` (the stretch is run-queue wait), a batch taking ``c / worker_share + b`` in a worker."""
    cv = m.curve
    sps = bps * cv.batch_size
    ceil = cv.ceiling_samples_per_s
    g, t = cv.compute_s_per_step, min(m.trainer_cpu_s_per_step, cv.compute_s_per_step)
    runq = t / max(1e-9, min(1.0, trainer_share)) - t if t > 0 else 0.0
    step = 1.0 / bps if bps > 0 else math.inf
    compute = min(step, g + runq)
    return JobRate(workers=workers, loader_cores=loader, trainer_cores=trainer, samples_per_s=sps,
                   normalised=min(1.0, sps / ceil) if ceil > 0 and math.isfinite(ceil) else 1.0,
                   compute_s_per_step=compute, trainer_runq_s_per_step=max(0.0, compute - g),
                   data_wait_s_per_step=max(0.0, step - compute) if bps > 0 else 0.0,
                   wall_s_per_batch=cv.cpu_s_per_batch / max(1e-9, min(1.0, worker_share)) + cv.blocked_s_per_batch)


def objective(models: Mapping[str, JobModel], rates: Mapping[str, JobRate]) -> float:
    """GPU-weighted sum of normalised throughput."""
    return sum(models[j].gpus * r.normalised for j, r in rates.items())


def curve_with_workload(curve: ThroughputCurve, trainer_cpu_s_per_step: float = 0.0, gpus: int = 1,
                        num_workers: int = 0) -> ThroughputCurve:
    """``curve`` carrying the rest of a job's workload model in its ``extra`` (what the simulator's
    ``job_model`` reads): its trainer's CPU per step and rank, its GPUs, its user's ``num_workers``."""
    import dataclasses

    extra = dict(curve.extra or {})
    extra.update(trainer_cpu_s_per_step=float(trainer_cpu_s_per_step), gpus=int(gpus), num_workers=int(num_workers))
    return dataclasses.replace(curve, extra=extra)


def job_model(curve: ThroughputCurve, gpus: int, default_workers: int) -> JobModel:
    """The JobModel of a curve that carries its workload in ``extra`` (``curve_with_workload``); a
    curve without a habitual worker count gets ``default_workers``."""
    ex = curve.extra or {}
    return JobModel(curve=curve, trainer_cpu_s_per_step=float(ex.get("trainer_cpu_s_per_step") or 0.0),
                    gpus=max(1, int(gpus)), habitual_workers=int(ex.get("num_workers") or 0) or max(1, default_workers))


def curves_from_bench_specs(specs: Mapping[str, dict]) -> dict[str, ThroughputCurve]:
    """Curves (with their workload, ``curve_with_workload``) from the bench's calibrated job specs
    (``evaluation.catalog.JobSpec`` as dicts): the same step, loader demand, trainer fraction, GPUs and
    habitual workers the real jobs ran with."""
    out = {}
    for j, sp in specs.items():
        step = float(sp["step_s"])
        curve = ThroughputCurve(job=j, batch_size=int(sp["batch_size"]), compute_s_per_step=step,
                                cpu_s_per_batch=float(sp["demand_cores"]) * step, blocked_s_per_batch=0.0,
                                confidence=1.0, observed_configs=3, source="bench-calibration")
        out[j] = curve_with_workload(curve, float(sp.get("trainer_cpu_frac") or 0.0) * step, int(sp.get("gpus") or 1),
                                     int(sp.get("num_workers") or 1))
    return out


__all__ = ["JobModel", "JobRate", "MODES", "autotune_workers", "node_rates", "objective", "waterfill",
           "curve_with_workload", "job_model", "curves_from_bench_specs"]
