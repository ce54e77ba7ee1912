"""How often adaptive's plan moves when its estimates only wiggle: the hold under noise.

For random nodes (``evaluation.random_nodes``, every job warm), adaptive plans once from the true
curves; then, ``--ticks`` times, each job's CPU per batch and step time are multiplied by independent
uniform noise of +-``level`` (what a curve made from noisy windows would say), adaptive re-plans with
the last plan in force, and that plan is applied. Counted per level, over every re-plan: the share
with a worker change (a worker restart in a real job), and flips: a job whose worker count returns
to the count it had two re-plans before (A -> B -> A, the churn the hold is for; a single move off the
noiseless plan is not one).

    python -m evaluation.hold_noise [--nodes 500] [--ticks 20] [--levels 0,0.02,0.05,0.1] [--seed 1]
                                    [--out FILE]

Prints a table and writes JSON with ``--out``. Deterministic (the seed). What it cannot show: the
agent's curves come from the predictor bank, whose noise is not uniform nor independent from tick to
tick (it pools a job's last windows), so a level here is an upper bound's stand-in, not a measurement.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time

from agent.policies import get_policy
from evaluation.flags import comma_list, finite_float, path_arg, plain_int
from evaluation.random_nodes import curve_for, random_node


def run(nodes: int, ticks: int, levels: list[float], seed: int) -> dict:
    adaptive = get_policy("adaptive")
    rows = []
    for level in levels:
        rng = random.Random(seed)           # the same nodes at every level
        noise = random.Random(seed + 1)
        replans = changes = flips = 0
        nodes_flipping = used = 0
        for _ in range(nodes):
            s, curves, cfg = random_node(rng)
            if len(curves) < len(s.jobs):   # a cold job moves by design when it warms: not noise
                continue
            used += 1
            plan = adaptive(s, curves, cfg)
            history = {j: [a.workers] for j, a in plan.allocations.items()}
            node_flips = 0
            for _ in range(ticks):
                jobs = {j: dataclasses.replace(v, cpu_s_per_batch=v.cpu_s_per_batch * noise.uniform(1 - level, 1 + level),
                                               compute_s_per_step=v.compute_s_per_step * noise.uniform(1 - level, 1 + level))
                        for j, v in s.jobs.items()}
                seen = dataclasses.replace(s, jobs=jobs, applied=dict(plan.allocations))
                plan = adaptive(seen, {j: curve_for(v) for j, v in jobs.items()}, cfg)
                replans += 1
                moved = False
                for j, a in plan.allocations.items():
                    h = history[j]
                    if a.workers != h[-1]:
                        moved = True
                        if len(h) >= 2 and a.workers == h[-2]:
                            flips += 1
                            node_flips += 1
                    h.append(a.workers)
                changes += moved
            nodes_flipping += node_flips > 0
        rows.append({"level": level, "nodes": used, "replans": replans, "worker_change_frac": changes / max(1, replans),
                     "flips": flips, "flips_per_100_replans": 100.0 * flips / max(1, replans),
                     "nodes_with_a_flip": nodes_flipping})
    return {"nodes": nodes, "ticks": ticks, "seed": seed, "rows": rows}


def markdown(result: dict) -> str:
    out = [f"adaptive's re-plans under noise: {result['rows'][0]['nodes']} random nodes (all jobs warm), "
           f"{result['ticks']} re-plans each, seed {result['seed']}", "",
           "| noise (each job's CPU per batch and step time) | re-plans | with a worker change | flips (A -> B -> A) per 100 re-plans | nodes with a flip |",
           "|---|---|---|---|---|"]
    for r in result["rows"]:
        out.append(f"| +-{r['level']:.0%} | {r['replans']} | {r['worker_change_frac']:.1%} | "
                   f"{r['flips_per_100_replans']:.2f} | {r['nodes_with_a_flip']} of {r['nodes']} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m evaluation.hold_noise", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=plain_int, default=500, help="random nodes (those with a cold job are left out; default 500)")
    p.add_argument("--ticks", type=plain_int, default=20, help="re-plans per node (default 20)")
    p.add_argument("--levels", type=comma_list(finite_float), default="0,0.02,0.05,0.1", help="noise levels, comma-separated fractions (default 0,0.02,0.05,0.1)")
    p.add_argument("--seed", type=plain_int, default=1, help="the random nodes' and the noise's seed (default 1)")
    p.add_argument("--out", type=path_arg, help="write the JSON result here")
    args = p.parse_args(argv)
    levels = args.levels
    if any(not 0 <= x < 1 for x in levels):
        p.error(f"--levels: fractions in [0, 1), got {','.join(map(str, levels))}")
    if args.nodes < 1 or args.ticks < 2:
        p.error("--nodes must be >= 1 and --ticks >= 2")
    t0 = time.perf_counter()
    result = run(args.nodes, args.ticks, levels, args.seed)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    result["argv"] = sys.argv
    print(markdown(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"JSON: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
