"""Allocation policies: pure functions ``decide(snapshot, curves, config) -> AllocationPlan``.

No sockets, files or clocks in here; the same functions run in the agent, in table-driven tests and
in the simulator. Every ``JobAllocation`` carries its reason.

(Interface landed with the skeleton; the controller issue fills in even-static / none / adaptive.)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping

from agent.model import AllocationPlan, JobAllocation, NodeSnapshot
from predictor.curve import ThroughputCurve


@dataclass(frozen=True)
class PolicyConfig:
    min_workers: int = 1
    max_workers_per_job: int = 64
    hysteresis: float = 0.03         # no move for a predicted normalised gain under this
    fairness_floor: bool = True      # adaptive: no job below its even share unless it cannot use it


Policy = Callable[[NodeSnapshot, Mapping[str, ThroughputCurve], PolicyConfig], AllocationPlan]


def even(snapshot: NodeSnapshot, curves: Mapping[str, ThroughputCurve], config: PolicyConfig) -> AllocationPlan:
    """Even split of the node's loader CPUs over the jobs present now, recomputed at every change."""
    n = len(snapshot.jobs)
    allocs = {}
    if n:
        share = snapshot.loader_cpus / n
        workers = max(config.min_workers, min(config.max_workers_per_job, math.floor(share + 1e-9) or 1))
        for job in snapshot.jobs:
            allocs[job] = JobAllocation(job=job, workers=workers, cpus=share,
                                        reason=f"even split: {snapshot.loader_cpus:g} cores / {n} jobs")
    return AllocationPlan(policy="even", allocations=allocs)


POLICIES: dict[str, Policy] = {"even": even}


def get_policy(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of: {', '.join(sorted(POLICIES))}") from None
