"""The oracle: the best static allocation of a node's loader cores, computed from each job's curve.

The objective is the one of DESIGN.md "Allocation": the GPU-weighted sum of normalised throughput
under the node's loader CPU budget. Each job's value is a function of the cores it gets (any shape:
it need not be concave, so this is solved exactly by dynamic programming over a grid of core amounts
(multiple-choice knapsack), not greedily).

Two sources of curves:
- ``value_from_sweep(points)``: measured points ``(workers, cores_used, normalised)`` of a job run at a
  few worker counts (``adloader bench`` measures them per job, alone on the node, just before the
  oracle phase). Between points the value is interpolated linearly in cores, from (0, 0).
- ``value_from_curve(curve)``: a ``predictor.curve.ThroughputCurve`` (simulator, tests).

Honesty note: the bench's oracle is the best static plan *for the curves measured*, then replayed by
the real agent and actuators. Curves measured with a job alone understate co-located demand on small
vCPU machines (DESIGN.md), so the replayed oracle is an estimate of the ceiling, not a bound; adaptive
can beat it.

Invariants (tested): allocated cores sum to at most the budget; every job gets >= 1 worker; the
objective is >= that of any other grid allocation (exact DP).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np

ValueFn = Callable[[float], float]     # cores -> normalised throughput
WorkersFn = Callable[[float], int]     # cores -> worker count that achieves it


@dataclass(frozen=True)
class JobValue:
    value: ValueFn
    workers: WorkersFn
    weight: float = 1.0                # GPUs of the job (objective weight)


@dataclass(frozen=True)
class OraclePlan:
    cores: dict[str, float]            # what the objective assigned to each job (sums <= budget)
    cpus: dict[str, float]             # cores handed to actuators: leftover spread pro rata (sums to budget)
    workers: dict[str, int]
    predicted: dict[str, float]        # normalised throughput per job predicted by its curve
    objective: float                   # sum of weight * predicted


def value_from_sweep(points: Sequence[tuple[int, float, float]]) -> JobValue:
    """Value function from measured ``(workers, cores_used, normalised)`` points of one job."""
    if not points:
        raise ValueError("oracle: a job has no measured points; cannot compute its curve")
    pts = sorted(points, key=lambda p: (p[1], p[0]))
    xs, ys, ws = [0.0], [0.0], [pts[0][0]]
    best = 0.0
    for w, c, v in pts:
        if v > best + 1e-12:          # monotone envelope in cores
            best = v
            xs.append(max(c, xs[-1] + 1e-6))
            ys.append(v)
            ws.append(w)

    def value(cores: float) -> float:
        return float(np.interp(cores, xs, ys))

    def workers(cores: float) -> int:
        for x, w in zip(xs[1:], ws[1:]):
            if x >= cores - 1e-6:
                return int(w)
        return int(ws[-1])

    return JobValue(value=value, workers=workers)


def value_from_curve(curve, max_workers: int = 64, weight: float = 1.0) -> JobValue:
    """Value function of a ``ThroughputCurve``: at each core amount, the best worker count."""
    top = max(1, min(max_workers, curve.max_useful_workers))

    def value(cores: float) -> float:
        return curve.normalized(top, cores)

    def workers(cores: float) -> int:
        target = curve.normalized(top, cores) - 1e-9
        for w in range(1, top + 1):
            if curve.normalized(w, cores) >= target:
                return w
        return top

    return JobValue(value=value, workers=workers, weight=weight)


def value_grid(jv: JobValue, budget_cores: float, grid: int) -> np.ndarray:
    """``weight * value`` at 0, 1, ..., grid steps of ``budget_cores / grid``."""
    step = budget_cores / grid
    return np.array([jv.weight * jv.value(k * step) for k in range(grid + 1)])


def solve(jobs: Mapping[str, JobValue], budget_cores: float, grid: int = 200,
          grids: Mapping[str, np.ndarray] | None = None) -> OraclePlan:
    """Exact best allocation of ``budget_cores`` over ``jobs`` on a grid of ``grid`` core steps.
    ``grids``: precomputed ``value_grid`` arrays per job (callers that repeat a job cache them)."""
    names = list(jobs)
    if not names:
        return OraclePlan({}, {}, {}, {}, 0.0)
    if budget_cores <= 0:
        raise ValueError(f"oracle: budget must be > 0 cores, got {budget_cores}")
    step = budget_cores / grid
    ks = np.arange(grid + 1)
    prev = ks[:, None] - ks[None, :]              # prev[k, m] = k - m (steps left for earlier jobs)
    valid = prev >= 0
    prev = np.where(valid, prev, 0)
    best = np.zeros(grid + 1)                     # best[k]: objective using k steps over jobs so far
    choice = []                                   # per job: array k -> steps given to this job
    for name in names:
        v = grids[name] if grids is not None and name in grids else value_grid(jobs[name], budget_cores, grid)
        cand = np.where(valid, best[prev] + v[None, :], -np.inf)   # cand[k, m] = best[k - m] + v[m]
        arg = cand.argmax(axis=1)
        best = cand[ks, arg]
        choice.append(arg)
    k = int(best.argmax())
    steps = {}
    for name, arg in zip(reversed(names), reversed(choice)):
        m = int(arg[k])
        steps[name] = m
        k -= m
    cores = {n: steps[n] * step for n in names}
    used = sum(cores.values())
    left = budget_cores - used
    if used > 0:
        cpus = {n: cores[n] + left * cores[n] / used for n in names}
    else:
        cpus = {n: budget_cores / len(names) for n in names}
    workers = {n: max(1, jobs[n].workers(cores[n])) for n in names}
    predicted = {n: jobs[n].value(cores[n]) for n in names}
    objective = sum(jobs[n].weight * predicted[n] for n in names)
    return OraclePlan(cores=cores, cpus=cpus, workers=workers, predicted=predicted, objective=objective)


def even_objective(jobs: Mapping[str, JobValue], budget_cores: float) -> float:
    """Objective of the even split (for reports: how much the oracle's curves say there is to win)."""
    if not jobs:
        return 0.0
    share = budget_cores / len(jobs)
    return sum(jv.weight * jv.value(share) for jv in jobs.values())


def fmt_plan(plan: OraclePlan) -> str:
    return ", ".join(f"{j}: {plan.workers[j]}w/{plan.cpus[j]:.2f}c (pred {plan.predicted[j]:.2f})"
                     for j in plan.workers) + f"; objective {plan.objective:.3f}"


__all__ = ["JobValue", "OraclePlan", "value_from_sweep", "value_from_curve", "value_grid", "solve", "even_objective",
           "fmt_plan"]
