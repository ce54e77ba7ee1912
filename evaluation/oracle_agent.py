"""The agent with one more policy, ``oracle``, for ``adloader bench``: the real daemon, server,
controller and actuators, with a policy that returns the oracle's plan for the jobs present.

    python -m evaluation.oracle_agent CURVES.json [agent flags...]

CURVES.json: ``{"budget_note": str, "jobs": {job_id: [[workers, cores_used, normalised], ...]}}`` —
each job's measured sweep (see ``evaluation.harness.measure_sweeps``). At each tick the policy solves
the exact knapsack (``evaluation.oracle.solve``) over the jobs present with the snapshot's loader
CPUs (cached per set of jobs, so the plan is fixed while the set is). A job with no curve gets the
even share. The policy is handed to the agent (``Agent(policy=...)``); no global registry is touched.
"""
from __future__ import annotations

import json
import sys

from evaluation.oracle import solve, value_from_sweep


def make_oracle_policy(points_by_job: dict):
    from agent.model import AllocationPlan, JobAllocation

    values = {j: value_from_sweep([tuple(p) for p in pts]) for j, pts in points_by_job.items() if pts}
    cache: dict = {}

    def oracle(snapshot, curves, config):
        present = sorted(snapshot.jobs)
        if not present:
            return AllocationPlan(policy="oracle", allocations={})
        known = [j for j in present if j in values]
        unknown = [j for j in present if j not in values]
        budget = snapshot.loader_cpus
        share = budget / len(present)
        key = (tuple(present), round(budget, 3))
        if key not in cache:
            plan = solve({j: values[j] for j in known}, budget - share * len(unknown)) if known else None
            allocs = {}
            for j in known:
                allocs[j] = JobAllocation(job=j, workers=max(config.min_workers, plan.workers[j]),
                                          cpus=max(0.01, plan.cpus[j]),
                                          reason=f"oracle: {plan.cores[j]:.2f} cores from measured curve, "
                                                 f"predicted {plan.predicted[j]:.0%} of ceiling")
            for j in unknown:
                allocs[j] = JobAllocation(job=j, workers=max(config.min_workers, int(share) or 1), cpus=share,
                                          reason="oracle: no measured curve, even share")
            cache[key] = AllocationPlan(policy="oracle", allocations=allocs,
                                        predicted_total=plan.objective if plan else None)
        return cache[key]

    return oracle


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print("usage: python -m evaluation.oracle_agent CURVES.json [agent flags...]", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        doc = json.load(f)
    from agent.cli import build_parser
    from agent.commands import agent as agent_command

    args = build_parser("agent").parse_args(["agent", *argv[1:]])
    return agent_command.run(args, policy=make_oracle_policy(doc.get("jobs", {})))


if __name__ == "__main__":
    sys.exit(main())
