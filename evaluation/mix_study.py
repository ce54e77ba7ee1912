"""Random static mixes through the simulator: ``adaptive`` against the best of what users run instead,
on node shapes from a 2-core dev VM to a 96-core GPU node (a command, not a test).

    python -m evaluation.mix_study [--nodes 2:3,2:4,8:4,16:8,32:8,96:8] [--mixes 100] [--seed 1]
                                   [--floor-fraction F] [--floor-reference share|habit] [--out FILE.json]

The bench's and the 16/96-core study's mixes are a handful chosen by hand; the policy will be judged on
mixes nobody chose. Each node shape ``CORES:GPUS`` gets ``--mixes`` random mixes that fill its GPUs
(seeded: the same arguments give the same mixes and figures). A job of a mix:

- its GPUs (ranks on the node): 1, 1, 1, 2, 2 or 4, at most the GPUs left;
- its loader's CPU at the GPUs' ceiling, per GPU: the node's CPUs per GPU times a log-uniform factor
  from 0.25 to 7 (a ResNet-50-like job on a 12-cores-per-GPU node needs a quarter of its cores, an
  AlexNet-like one with heavy augmentation several times them: DS-Analyzer/CoorDL, VLDB 2021);
- its training processes' busy part of each step, per rank: uniform 0 to 0.4 (issue 11's 20-40% for
  host-bound trainers; 0 for GPU-bound steps);
- its user's ``num_workers`` per rank: 2, 4, 8, 16 or the CPUs over its ranks, with equal chance
  (pytorch/examples 4, YOLOv5 8, torchvision's references 16, ``os.cpu_count() // ranks``).

Every mix runs under ``none``, ``autotune``, ``static-cores``, ``even-static`` and ``adaptive`` in
the simulator (``evaluation.simulate.steady_state``: the agent's own controller, policy and predictor
on the node model; 30 s of warm-up, 30 s measured), with the agent's default "auto" budget and jobs
whose own tuners see the node's GPUs, as in ``validate_sim --nodes``. Per node shape: adaptive over the
best baseline of each mix (GPU-weighted normalised throughput): median, p10, least and most, the mixes
under 0.98 and at 1.10 or more; how many of the losses are mixes whose best baseline breaks the
fairness target (a job under 0.9x its static-cores throughput that is not short of data under every
policy), a target adaptive keeps and the baselines do not; the mixes where even the ideal allocation
that keeps every job at 0.9x its simulated static-cores throughput (``validate_sim.ideal_bound``:
every core used, no slicing cost) reaches 1.10, and adaptive's aggregate over that ideal (median, p10,
most: at most 1 where the ideal is a bound for adaptive's plans); adaptive's own worst job over its
static-cores throughput; which baseline was best how often. The worst mixes are listed in the JSON
with every job and policy. Simulated figures: read them beside the validation of the simulator against
measured runs (``python -m evaluation.validate_sim``, BENCHMARKS.md).
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Optional

from evaluation.validate_sim import BASELINES, _shape
from evaluation.flags import comma_list, finite_float, path_arg, plain_int

POLICIES = BASELINES + ("adaptive",)
GPU_CHOICES = (1, 1, 1, 2, 2, 4)
DEMAND_FACTOR = (0.25, 7.0)        # loader cores per GPU at the ceiling, over the node's CPUs per GPU
TRAINER_BUSY = (0.0, 0.4)          # the training process's busy part of a step, per rank
HABITS = (2, 4, 8, 16, None)       # num_workers per rank; None: the CPUs over the job's ranks
FAIR = 0.9                         # issue 11: no job under 0.9x its static-cores throughput ...
STARVED = 0.98                     # ... unless under this part of its ceiling under every policy
STEP_S = 0.1


def mixes_rng(seed: int, cores: int, gpus: int) -> random.Random:
    """The generator of a node shape's random mixes for ``seed``: draw them in order with ``random_mix``
    (the k-th mix of a shape is the k-th draw; each shape has its own stream, so adding a shape leaves
    the others' mixes as they were). ``evaluation.best_plan --random`` draws the same."""
    return random.Random(f"{seed}:{cores}:{gpus}")


def random_mix(rng: random.Random, cores: int, gpus: int) -> dict:
    """A mix filling ``gpus`` GPUs: job -> curve with its workload (``curve_with_workload``)."""
    from evaluation.nodemodel import curve_with_workload
    from predictor.curve import ThroughputCurve

    out, used, i = {}, 0, 0
    while used < gpus:
        g = min(rng.choice(GPU_CHOICES), gpus - used)
        lo, hi = DEMAND_FACTOR
        per_gpu = cores / gpus * math.exp(rng.uniform(math.log(lo), math.log(hi)))
        busy = rng.uniform(*TRAINER_BUSY)
        habit = rng.choice(HABITS) or max(1, cores // g)
        cv = ThroughputCurve(job=f"j{i}", batch_size=64 * g, compute_s_per_step=STEP_S,
                             cpu_s_per_batch=per_gpu * g * STEP_S, blocked_s_per_batch=0.0, confidence=1.0,
                             observed_configs=3)
        out[f"j{i}"] = curve_with_workload(cv, busy * STEP_S, g, habit * g)
        used += g
        i += 1
    return out


def describe(truth: dict) -> dict:
    return {j: {"gpus": int(cv.extra["gpus"]),
                "loader_cores_per_gpu": round(cv.cpu_s_per_batch / cv.compute_s_per_step / cv.extra["gpus"], 3),
                "trainer_busy": round(cv.extra["trainer_cpu_s_per_step"] / cv.compute_s_per_step, 3),
                "num_workers": int(cv.extra["num_workers"])} for j, cv in truth.items()}


def worst_vs_static(window: dict, static: dict, exempt=()) -> Optional[float]:
    """The least of a policy's jobs' throughput over the same job's under static-cores."""
    xs = [window.get(j, 0.0) / static[j] for j in static if static[j] > 0 and j not in exempt]
    return min(xs) if xs else None


def run_mix(truth: dict, cores: int, gpus: int, floor_fraction: Optional[float] = None,
            warmup_s: float = 30.0, measure_s: float = 30.0, policy_options: tuple = ()) -> dict:
    from evaluation import simulate as S
    from evaluation.validate_sim import ideal_bound, study_config

    cfg = study_config(cores, gpus, floor_fraction, policy_options)
    res = {p: S.steady_state(truth, p, cfg, warmup_s, measure_s) for p in POLICIES}
    agg = {p: r["window_agg"] for p, r in res.items()}
    win = {p: r["window"] for p, r in res.items()}
    best = max(BASELINES, key=lambda p: agg[p])
    static = win["static-cores"]
    starved = sorted(j for j in static if all(win[p].get(j, 0.0) < STARVED for p in POLICIES))
    # the ideal that keeps every job at FAIR x its static-cores throughput (none exempt: an exempt job
    # would be given nothing, which no fair allocator does)
    fair = ideal_bound(truth, cores, FAIR, static)
    return {"ratio": agg["adaptive"] / agg[best] if agg[best] > 0 else None, "best": best, "agg": agg,
            "fair_bound": fair / agg[best] if agg[best] > 0 else None,
            "of_fair_bound": agg["adaptive"] / fair if fair > 0 else None,
            "adaptive_worst_vs_static": worst_vs_static(win["adaptive"], static, starved),
            "best_worst_vs_static": worst_vs_static(win[best], static, starved),
            "starved_everywhere": starved, "jobs": describe(truth), "window": win,
            "plan": res["adaptive"].get("plan")}


def _q(xs: list, p: float) -> float:
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def summarise(rows: list[dict]) -> dict:
    rs = sorted(r["ratio"] for r in rows if r["ratio"] is not None)
    losses = [r for r in rows if r["ratio"] is not None and r["ratio"] < 0.98]
    fair = [r["adaptive_worst_vs_static"] for r in rows if r["adaptive_worst_vs_static"] is not None]
    return {"mixes": len(rows), "median": statistics.median(rs), "p10": _q(rs, 0.1), "min": rs[0], "max": rs[-1],
            "under_0.98": len(losses), "at_1.10": sum(r >= 1.10 for r in rs),
            "fair_bound_at_1.10": sum((r.get("fair_bound") or 0.0) >= 1.10 for r in rows),
            "of_fair_bound_median": statistics.median(of) if (of := [r["of_fair_bound"] for r in rows
                                                                      if r.get("of_fair_bound") is not None]) else None,
            "of_fair_bound_p10": _q(sorted(of), 0.1) if of else None,
            "of_fair_bound_max": max(of) if of else None,
            "losses_best_breaks_fairness": sum((r["best_worst_vs_static"] or 1.0) < FAIR for r in losses),
            "adaptive_worst_job_vs_static_min": min(fair) if fair else None,
            "adaptive_jobs_under_0.9": sum(f < FAIR for f in fair),
            "best_baseline": dict(Counter(r["best"] for r in rows).most_common())}


def _g(v) -> str:
    return "-" if v is None else format(v, ".3f")


def markdown(summaries: dict) -> str:
    lines = ["| node (cores:GPUs) | mixes | adaptive x best baseline: median [p10; min-max] | under 0.98 (of which "
             "the best baseline breaks fairness) | at 1.10+ (the fair ideal at 1.10+) | adaptive / the fair ideal: "
             "median [p10; max] | adaptive's worst job / its static-cores (least; "
             "jobs under 0.9) | best baseline (mixes) |", "|---|---|---|---|---|---|---|---|"]
    for node, s in summaries.items():
        worst = s["adaptive_worst_job_vs_static_min"]
        best = ", ".join(f"{p} {n}" for p, n in s["best_baseline"].items())
        lines.append(f"| {node} | {s['mixes']} | {s['median']:.3f} [{s['p10']:.3f}; {s['min']:.3f}-{s['max']:.3f}] | "
                     f"{s['under_0.98']} ({s['losses_best_breaks_fairness']}) | {s['at_1.10']} "
                     f"({s.get('fair_bound_at_1.10', '-')}) | {_g(s.get('of_fair_bound_median'))} "
                     f"[{_g(s.get('of_fair_bound_p10'))}; {_g(s.get('of_fair_bound_max'))}] | "
                     f"{'-' if worst is None else format(worst, '.3f')}; {s['adaptive_jobs_under_0.9']} | {best} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m evaluation.mix_study", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="2:3,2:4,8:4,16:8,32:8,96:8", help="node shapes CORES:GPUS, comma-separated (default 2:3,2:4,8:4,16:8,32:8,96:8)")
    ap.add_argument("--mixes", type=plain_int, default=100, help="random mixes per node shape (default 100)")
    ap.add_argument("--seed", type=plain_int, default=1, help="the mixes' seed; each node shape draws its own stream (default 1)")
    ap.add_argument("--floor-fraction", type=finite_float, default=None,
                    help="the agent's floor_fraction (default: its default)")
    ap.add_argument("--floor-reference", choices=("habit", "share"), default=None,
                    help="the agent's floor_reference (default: its default)")
    ap.add_argument("--worst", type=plain_int, default=5, help="worst mixes per node kept in the JSON (default 5)")
    ap.add_argument("--out", type=path_arg, default=None, help="write the JSON result here")
    args = ap.parse_args(argv)
    try:   # (read here, not by argparse: the JSON records the flag as given)
        nodes = comma_list(_shape)(args.nodes)
    except argparse.ArgumentTypeError as e:
        print(f"mix_study: --nodes: {e}", file=sys.stderr)
        return 2
    if args.mixes < 1 or args.worst < 0:
        print("mix_study: --mixes must be at least 1 and --worst at least 0", file=sys.stderr)
        return 2
    if args.floor_fraction is not None and not 0.0 < args.floor_fraction <= 1.0:
        print("mix_study: --floor-fraction must be in (0, 1]", file=sys.stderr)
        return 2
    opts = (("floor_reference", args.floor_reference),) if args.floor_reference else ()
    summaries, worst, t0 = {}, {}, time.monotonic()
    for cores, gpus in nodes:
        rng = mixes_rng(args.seed, cores, gpus)
        rows = []
        for k in range(args.mixes):
            rows.append({"mix": k, **run_mix(random_mix(rng, cores, gpus), cores, gpus, args.floor_fraction,
                                                policy_options=opts)})
            if (k + 1) % 25 == 0 or k + 1 == args.mixes:
                print(f"{cores}:{gpus}: {k + 1} of {args.mixes} mixes ({time.monotonic() - t0:.0f} s)", file=sys.stderr)
        name = f"{cores}:{gpus}"
        summaries[name] = summarise(rows)
        worst[name] = sorted(rows, key=lambda r: r["ratio"] if r["ratio"] is not None else math.inf)[:args.worst]
    print(f"Random static mixes, seed {args.seed}, simulated (evaluation.simulate; see the module's docstring)\n")
    print(markdown(summaries))
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "summaries": summaries, "worst": worst},
                                             indent=1, default=str))
        print(f"\nJSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
