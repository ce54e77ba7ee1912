"""The agent with one more policy, ``oracle``, for ``adloader bench``: the real daemon, server,
controller and actuators, with a policy that returns the oracle's plan for the jobs present.

    python -m evaluation.oracle_agent CURVES.json [agent flags...]

CURVES.json: ``{"note": str, "jobs": {job_id: [[workers, cores_used, normalised], ...]},
"memory": {job_id: bytes}, "budget_cores": float}`` — each job's measured points (co-located probes,
``evaluation.harness.measure_colocated``, or solo sweeps, ``measure_sweeps``), the most unique memory
one of its workers held in them, and (probes only) the cores the loaders really got beside the
trainers. At each tick the policy solves the exact knapsack (``evaluation.oracle.solve``, GPU-weighted
by each job's GPUs) over the jobs present with those cores (default: the snapshot's loader CPUs), or, when the agent has a loader memory budget (``--loader-memory``, in the snapshot as
``loader_memory_bytes``), the budget oracle (``evaluation.oracle.solve_memory``: worker counts and
cores together, each job's workers at its measured memory, GPU-weighted): the best static plan the
budget allows. Plans are cached per set of jobs and budget, so the plan is fixed while they are. A
job with no curve gets the even share (and, under a budget, one worker at its own measured memory).
CURVES.json may instead be ``{"plan": {job_id: {"workers": int, "cpus": float}}}``: that fixed plan,
as it is (the co-located probes themselves); a job not in it gets the even share. With ``"source"`` (a
bench ``plan:FILE`` policy: ``evaluation.harness.load_plans``) the plans are named "plan" and the
loaders yield as ``"loaders_yield"`` says (null: the agent's rule).
The policy is handed to the agent (``Agent(policy=...)``); no global registry is touched.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from typing import Optional

from evaluation.oracle import JobValue, options_from_sweep, solve, solve_memory, value_from_sweep


def make_fixed_policy(plan_by_job: dict, loaders_yield: Optional[bool] = None, name: str = "oracle",
                      reason: str = "probe: fixed plan"):
    """A policy that applies ``{job: {"workers": w, "cpus": c}}`` as it is (the co-located probes; a
    bench ``plan:FILE`` policy, ``name`` "plan"). ``loaders_yield``: the loaders' yield the plan was
    made with (None: the agent's rule, ``node_allocation``, decides)."""
    from agent.model import AllocationPlan, JobAllocation
    from agent.policies import node_allocation

    def fixed(snapshot, curves, config):
        present = sorted(snapshot.jobs)
        share = snapshot.loader_cpus / max(1, len(present))
        allocs = {}
        for j in present:
            p = plan_by_job.get(j)
            if p is None:
                allocs[j] = JobAllocation(job=j, workers=max(config.min_workers, int(share) or 1), cpus=share,
                                          reason=f"{name}: not in the plan, even share")
            else:
                allocs[j] = JobAllocation(job=j, workers=max(config.min_workers, int(p["workers"])),
                                          cpus=max(0.01, float(p["cpus"])), reason=reason)
        node = node_allocation(snapshot, config)
        if loaders_yield is not None:    # the plan's, also where the agent's rule happens to agree this tick
            node = dataclasses.replace(node, loaders_yield=loaders_yield,
                                       reason=f"the plan's: loaders {'yield' if loaders_yield else 'do not yield'}")
        return AllocationPlan(policy=name, allocations=allocs, node=node)

    return fixed


def make_oracle_policy(points_by_job: dict, memory_by_job: Optional[dict] = None,
                       budget_cores: Optional[float] = None):
    from agent.model import AllocationPlan, JobAllocation
    from agent.policies import node_allocation

    values = {j: value_from_sweep([tuple(p) for p in pts]) for j, pts in points_by_job.items() if pts}
    memory_by_job = dict(memory_by_job or {})
    cache: dict = {}

    def oracle(snapshot, curves, config):
        present = sorted(snapshot.jobs)
        if not present:
            return AllocationPlan(policy="oracle", allocations={}, node=node_allocation(snapshot, config))
        known = [j for j in present if j in values]
        unknown = [j for j in present if j not in values]
        budget = min(snapshot.loader_cpus, budget_cores) if budget_cores else snapshot.loader_cpus
        share = budget / len(present)
        memory = snapshot.loader_memory_bytes
        key = (tuple(present), round(budget, 3), None if memory is None else int(memory))
        if key not in cache:
            allocs = {}
            if memory is None:
                weighted = {j: JobValue(values[j].value, values[j].workers, weight=max(1, snapshot.jobs[j].gpus))
                            for j in known}
                plan = solve(weighted, budget - share * len(unknown)) if known else None
                for j in known:
                    allocs[j] = JobAllocation(job=j, workers=max(config.min_workers, plan.workers[j]),
                                              cpus=max(0.01, plan.cpus[j]),
                                              reason=f"oracle: {plan.cores[j]:.2f} cores from measured curve, "
                                                     f"predicted {plan.predicted[j]:.0%} of ceiling")
            else:
                # jobs without a curve: one worker at their own measured memory, out of the budget first
                held = sum(snapshot.jobs[j].worker_memory_bytes for j in unknown)
                per = {j: memory_by_job.get(j) or snapshot.jobs[j].worker_memory_bytes for j in known}
                opts = {j: options_from_sweep([tuple(p) for p in points_by_job[j]], per[j],
                                              weight=max(1, snapshot.jobs[j].gpus)) for j in known}
                plan = solve_memory(opts, budget - share * len(unknown), max(1.0, memory - held)) if known else None
                for j in known:
                    allocs[j] = JobAllocation(
                        job=j, workers=plan.workers[j], cpus=max(0.01, plan.cpus[j]),
                        reason=f"oracle within the loader memory budget {memory / (1 << 30):.2f} GiB: "
                               f"{plan.workers[j]} workers of {per[j] / (1 << 20):.0f} MiB, {plan.cores[j]:.2f} "
                               f"cores from measured curve, predicted {plan.predicted[j]:.0%} of ceiling"
                               + (f"; {plan.note}" if plan.note else ""))
            for j in unknown:
                allocs[j] = JobAllocation(job=j, workers=max(config.min_workers, int(share) or 1) if memory is None
                                          else config.min_workers, cpus=share,
                                          reason="oracle: no measured curve, even share")
            cache[key] = AllocationPlan(policy="oracle", allocations=allocs,
                                        predicted_total=plan.objective if plan else None)
        # the loaders against the node as every agent policy decides it (fresh each tick: it follows the
        # trainers' needs and the other processes' CPU)
        return dataclasses.replace(cache[key], node=node_allocation(snapshot, config))

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
    if "plan" in doc and "source" in doc:       # a bench plan:FILE policy (evaluation.harness.load_plans)
        policy = make_fixed_policy(doc["plan"], doc.get("loaders_yield"), name="plan",
                                   reason=f"fixed plan from {doc['source']}")
    elif "plan" in doc:
        policy = make_fixed_policy(doc["plan"])
    else:
        policy = make_oracle_policy(doc.get("jobs", {}), doc.get("memory"), doc.get("budget_cores"))
    return agent_command.run(args, policy=policy)


if __name__ == "__main__":
    sys.exit(main())
