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

With a loader memory budget (``solve_memory``, issue 15) the worker count is a choice of its own:
a job's workers cost memory (workers x one worker's memory) and bound what its cores can buy. The
budget oracle searches worker counts and cores together (a two-resource knapsack, exact DP over the
memory totals that can be reached, see ``solve_memory``): the best static plan the CPU and memory
budgets allow, the yardstick for ``adaptive`` under a budget.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence

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
    memory: dict[str, float] = field(default_factory=dict)   # solve_memory: loader memory per job (bytes)
    memory_budget: Optional[float] = None                     # solve_memory: the budget planned within
    note: str = ""                                           # what the plan could not honour, if anything


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


def spread_leftover(cores: Mapping[str, float], budget_cores: float) -> dict[str, float]:
    """Cores for the actuators: the plan's cores plus what it left unassigned, pro rata (even split
    when the plan assigned none), so that they sum to the budget."""
    used = sum(cores.values())
    left = budget_cores - used
    if used > 0:
        return {n: c + left * c / used for n, c in cores.items()}
    return {n: budget_cores / len(cores) for n in cores}


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
    cpus = spread_leftover(cores, budget_cores)
    workers = {n: max(1, jobs[n].workers(cores[n])) for n in names}
    predicted = {n: jobs[n].value(cores[n]) for n in names}
    objective = sum(jobs[n].weight * predicted[n] for n in names)
    return OraclePlan(cores=cores, cpus=cpus, workers=workers, predicted=predicted, objective=objective)


# -- the budget oracle: worker counts and cores within the loader memory budget (issue 15) ----------

@dataclass(frozen=True)
class WorkerOptions:
    """A job as the budget oracle sees it: with ``w`` workers (1..``max_workers``) on ``x`` cores its
    normalised throughput is ``value(w, x)`` (non-decreasing in both), and its workers hold
    ``w * worker_memory_bytes`` of loader memory (0: unknown, counted as free)."""
    value: Callable[[int, float], float]
    max_workers: int
    worker_memory_bytes: float = 0.0
    weight: float = 1.0                # GPUs of the job (objective weight)


FULL_TOLERANCE = 1e-3      # worker counts stop where more workers would add under 0.1% of the ceiling


def options_from_curve(curve, max_workers: int = 64, weight: float = 1.0,
                       worker_memory_bytes: Optional[float] = None) -> WorkerOptions:
    """A ``ThroughputCurve``'s options: ``value(w, x) = curve.normalized(w, x)``, worker counts up to
    the fewest that reach within FULL_TOLERANCE of what ``max_workers`` reach on unlimited cores (not
    the predictor's 3% knee: the oracle is a ceiling), each worker at ``worker_memory_bytes`` (default:
    the curve's own ``worker_memory_bytes``)."""
    cap = max(1, int(max_workers))
    full = curve.normalized(cap, math.inf)
    top = next(w for w in range(1, cap + 1) if curve.normalized(w, math.inf) >= full - FULL_TOLERANCE)
    mem = curve.worker_memory_bytes if worker_memory_bytes is None else worker_memory_bytes
    return WorkerOptions(value=lambda w, x: curve.normalized(w, x), max_workers=top,
                         worker_memory_bytes=max(0.0, float(mem)), weight=weight)


def options_from_sweep(points: Sequence[tuple[int, float, float]], worker_memory_bytes: float = 0.0,
                       weight: float = 1.0) -> WorkerOptions:
    """Options of a job measured at a few worker counts (``value_from_sweep``'s points): with at most
    ``w`` workers, the envelope of the points measured with ``w`` workers or fewer."""
    if not points:
        raise ValueError("oracle: a job has no measured points; cannot compute its curve")
    ws = sorted({int(p[0]) for p in points})
    per_w = {w: value_from_sweep([p for p in points if int(p[0]) <= w]) for w in ws}

    def value(w: int, x: float) -> float:
        usable = [u for u in ws if u <= w]
        return per_w[usable[-1]].value(x) if usable else 0.0

    return WorkerOptions(value=value, max_workers=ws[-1], worker_memory_bytes=max(0.0, float(worker_memory_bytes)),
                         weight=weight)


def options_grid(opt: WorkerOptions, budget_cores: float, grid: int) -> np.ndarray:
    """``weight * value(w, k * step)``: row ``w - 1`` for w = 1..max_workers, column k = 0..grid."""
    step = budget_cores / grid
    return np.array([[opt.weight * opt.value(w, k * step) for k in range(grid + 1)]
                     for w in range(1, opt.max_workers + 1)])


MAX_STATES = 2048          # memory totals kept per DP layer before they are rounded up (conservatively)


def solve_memory(jobs: Mapping[str, WorkerOptions], budget_cores: float, budget_memory: Optional[float],
                 grid: int = 96, grids: Mapping[str, np.ndarray] | None = None,
                 max_states: int = MAX_STATES) -> OraclePlan:
    """The best static plan (workers and cores per job) within ``budget_cores`` and ``budget_memory``
    (bytes; None = no memory budget): GPU-weighted normalised throughput, cores on a grid of ``grid``
    steps, worker counts exact.

    Dynamic programming over the jobs, one layer per job. A state is the loader memory the jobs so far
    hold (an integer number of bytes: workers x one worker's memory, rounded up); for each state and each
    core amount it keeps the best objective and how it was reached. A job's step tries every worker
    count that fits the memory left and every split of the cores (max-plus convolution, as ``solve``).
    A state is dropped when states holding no more memory do at least as well at every core amount
    (dominance: any plan through it has a plan at least as good through those). So the result is exact
    on the core grid: no feasible plan (any worker counts, any grid split of the cores) has a higher
    objective. Should more than ``max_states`` memory totals survive a layer, they are rounded up to
    ``budget_memory / max_states`` (still within the budget, possibly a hair below the best).

    Every job gets at least one worker; when one worker each does not fit the budget, that is the plan
    (the agent's own floor) and ``note`` says so. Worker counts are the fewest that give the planned
    throughput on the planned cores (no worker held for nothing).
    """
    names = list(jobs)
    if not names:
        return OraclePlan({}, {}, {}, {}, 0.0, memory={}, memory_budget=budget_memory)
    if budget_cores <= 0:
        raise ValueError(f"oracle: budget must be > 0 cores, got {budget_cores}")
    if budget_memory is not None and budget_memory <= 0:
        raise ValueError(f"oracle: memory budget must be > 0 bytes, got {budget_memory}")
    step = budget_cores / grid
    ks = np.arange(grid + 1)
    prev = ks[:, None] - ks[None, :]
    valid = prev >= 0
    prev = np.where(valid, prev, 0)
    mu = {n: int(math.ceil(jobs[n].worker_memory_bytes)) if budget_memory is not None else 0 for n in names}
    limit = int(math.floor(budget_memory)) if budget_memory is not None else 0
    floor_mem = sum(mu.values())
    note = ""
    if floor_mem > limit:
        note = (f"loader memory budget {budget_memory / (1 << 30):.2f} GiB is below one worker per job "
                f"({floor_mem / (1 << 30):.2f} GiB): one worker each")
        limit = floor_mem
    states: dict[int, np.ndarray] = {0: np.zeros(grid + 1)}     # memory held -> best objective per core budget
    layers = []                                                 # per job: key -> (parent key, workers, steps)
    for n in names:
        v = grids[n] if grids is not None and n in grids else options_grid(jobs[n], budget_cores, grid)
        top = v.shape[0]
        if mu[n] > 0:
            top = min(top, 1 + (limit - floor_mem) // mu[n])
        v = v[:top]
        new: dict[int, list] = {}
        for s, best in states.items():
            shifted = np.where(valid, best[prev], -np.inf)                    # shifted[k, m] = best[k - m]
            cand = shifted[None, :, :] + v[:, None, :]                        # cand[w-1, k, m]
            arg = cand.argmax(axis=2)
            val = np.take_along_axis(cand, arg[:, :, None], axis=2)[:, :, 0]
            for wi in range(top):
                key = s + (wi + 1) * mu[n]
                if key > limit:
                    break
                cur = new.get(key)
                if cur is None:
                    new[key] = [val[wi].copy(), np.full(grid + 1, s, dtype=np.int64),
                                np.full(grid + 1, wi + 1, dtype=np.int64), arg[wi].copy()]
                    continue
                better = val[wi] > cur[0] + 1e-12
                if better.any():
                    cur[0] = np.where(better, val[wi], cur[0])
                    cur[1] = np.where(better, s, cur[1])
                    cur[2] = np.where(better, wi + 1, cur[2])
                    cur[3] = np.where(better, arg[wi], cur[3])
        kept: dict[int, list] = {}
        env = np.full(grid + 1, -np.inf)
        for key in sorted(new):
            row = new[key]
            if np.all(row[0] <= env + 1e-12):
                continue                                   # dominated by states holding less memory
            kept[key] = row
            env = np.maximum(env, row[0])
        if len(kept) > max_states:
            unit = max(1, -(-limit // max_states))
            merged: dict[int, list] = {}
            for key in sorted(kept):
                q = min(limit, -(-key // unit) * unit)     # rounded up, never above the budget
                q = max(q, key)
                cur = merged.get(q)
                row = kept[key]
                if cur is None:
                    merged[q] = [a.copy() for a in row]
                else:
                    better = row[0] > cur[0] + 1e-12
                    for i in range(4):
                        cur[i] = np.where(better, row[i], cur[i])
            kept = merged
        layers.append({key: (row[1], row[2], row[3]) for key, row in kept.items()})
        states = {key: row[0] for key, row in kept.items()}
    final = max(states, key=lambda key: (round(float(states[key][grid]), 9), -key))
    workers: dict[str, int] = {}
    cores: dict[str, float] = {}
    key, k = final, grid
    for n, layer in zip(reversed(names), reversed(layers)):
        parent, w, m = layer[key]
        workers[n], cores[n] = int(w[k]), int(m[k]) * step
        key, k = int(parent[k]), k - int(m[k])
    for n in names:                                     # the fewest workers that give the same throughput
        while workers[n] > 1 and jobs[n].value(workers[n] - 1, cores[n]) >= jobs[n].value(workers[n], cores[n]) - 1e-12:
            workers[n] -= 1
    cpus = spread_leftover(cores, budget_cores)
    predicted = {n: jobs[n].value(workers[n], cores[n]) for n in names}
    objective = sum(jobs[n].weight * predicted[n] for n in names)
    memory = {n: workers[n] * jobs[n].worker_memory_bytes for n in names}
    return OraclePlan(cores=cores, cpus=cpus, workers=workers, predicted=predicted, objective=objective,
                      memory=memory, memory_budget=budget_memory, note=note)


def curve_policy(grid: int = 192, memory_grid: int = 96):
    """The oracle as a policy ``(snapshot, curves, config) -> AllocationPlan`` over the curves it is
    given (the simulator hands it the true ones): the exact knapsack on cores (``solve``), or, when the
    snapshot carries a loader memory budget, the budget oracle (``solve_memory``, each worker at its
    curve's ``worker_memory_bytes``). Value grids are cached per curve object, weight and budget, and
    plans per mix of jobs (identical jobs are interchangeable), so a node's repeated decisions, and
    other nodes with the same mix, cost one DP."""
    from agent.model import AllocationPlan, JobAllocation
    from agent.policies import node_allocation

    grids_cache: dict = {}
    plans: dict = {}

    def oracle(snapshot, curves, config):
        if not snapshot.jobs:
            return AllocationPlan(policy="oracle", allocations={}, node=node_allocation(snapshot, config))
        C, budget = snapshot.loader_cpus, snapshot.loader_memory_bytes
        order = sorted(snapshot.jobs, key=lambda j: (str(curves[j].job), max(1, snapshot.jobs[j].gpus), j))  # stable
        mix = tuple((id(curves[j]), max(1, snapshot.jobs[j].gpus)) for j in order)
        key = (mix, C, budget)
        hit = plans.get(key)
        if hit is None or any(h is not curves[j] for h, j in zip(hit[0], order)):
            jobs, grids = {}, {}
            for i, j in enumerate(order):
                cv, weight = curves[j], max(1, snapshot.jobs[j].gpus)
                gkey = (id(cv), weight, C, budget is None)
                g = grids_cache.get(gkey)
                if g is None or g[0] is not cv:
                    if budget is None:
                        jv = value_from_curve(cv, weight=weight)
                        g = (cv, jv, value_grid(jv, C, grid))
                    else:
                        jv = options_from_curve(cv, weight=weight)
                        g = (cv, jv, options_grid(jv, C, memory_grid))
                    if len(grids_cache) > 4096:
                        grids_cache.clear()
                    grids_cache[gkey] = g
                jobs[i], grids[i] = g[1], g[2]
            plan = solve(jobs, C, grid=grid, grids=grids) if budget is None else \
                solve_memory(jobs, C, budget, grid=memory_grid, grids=grids)
            if len(plans) > 4096:
                plans.clear()
            hit = plans[key] = (tuple(curves[j] for j in order), plan)
        plan = hit[1]
        why = "oracle" if budget is None else f"oracle within {budget / (1 << 30):.2f} GiB"
        allocs = {j: JobAllocation(job=j, workers=plan.workers[i], cpus=max(1e-3, plan.cpus[i]), reason=why)
                  for i, j in enumerate(order)}
        unsatisfied = {j: plan.note for j in order} if plan.note else {}
        return AllocationPlan(policy="oracle", allocations=allocs, unsatisfied=unsatisfied,
                              predicted_total=plan.objective, node=node_allocation(snapshot, config))

    return oracle


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
           "fmt_plan", "WorkerOptions", "options_from_curve", "options_from_sweep", "options_grid", "solve_memory", "curve_policy"]
