"""The best fixed plan the agent's actuators can express, in the simulator's node model, that keeps
every job at 0.9x its ``static-cores`` throughput (issue 11's fairness rule): how far ``adaptive`` is
from what any allocator with the same knobs could reach on that node.

    python -m evaluation.best_plan BENCH.json [BENCH.json ...] [--cost calibrated|measured] [--reps K]
                                   [--out FILE.json]
    python -m evaluation.best_plan --nodes 16:8,96:8 [--mixes gpu-weighted,...] [--random N [--seed S]
                                   [--pick K,...]] [--out FILE.json]

``validate_sim``'s ideal bound (every core doing a loader's or a trainer's work, no time slicing, no
wake-up wait, fractional workers) is an upper bound no plan reaches; this is the other side: a plan
that the node model (``evaluation.nodemodel.node_rates``, the physics the simulator validates against
measured runs) says reaches a figure, found by search. A fixed plan is, per job, a worker count and a
CPU weight (the weights sum to the loader CPUs, as a plan's cores do), with the loaders yielding to
the training processes or not (``NodeAllocation.loaders_yield``). The search (``search``) climbs from
several starts (even weights at one and two workers, GPU-proportional weights, adaptive's own plan, six
seeded random plans):
each sweep tries every move of weight from one job to another and every worker count up or down
(+-1, x2, /2), takes the best, and halves the weight step when nothing gains, then starts again from
the top step while that gains; a plan with less shortfall under the floors ranks first, then the one
with more throughput, so a start below the floors climbs to them first. It finds a good plan, not
the proven best: on three-job mixes it matches an exhaustive grid (tests/test_best_plan.py).

Bench files: for each static scenario and repeat, the jobs of the run (their calibrated or, with
``--cost measured``, measured loader cost, as ``validate_sim``) on the CPU the repeat's ``adaptive``
phase could get; the baselines, ``adaptive`` (the agent's controller in the simulator) and the search
on that one capacity; medians over repeats. ``--nodes``: the catalogue mixes filled to the node's
GPUs (``validate_sim.node_study``); with ``--random N``, also ``evaluation.mix_study``'s first N random mixes
for the seed on each node shape, summarised as that study is (median, p10, least, most; how many reach
1.10x), the policy judged on mixes nobody chose. Each row: the best baseline in the model and its name, adaptive,
the best fixed plan found and the ideal fair bound, each over the best baseline, and adaptive over the
best plan (1.0: adaptive is at the best the knobs reach; the rest of the way to the bound is the
node's physics, not the policy's choice). A random mix's row also holds adaptive's plan and its jobs'
normalised throughput (``adaptive_plan``, ``adaptive_norm``) beside the best plan's, so a gap can be
read job by job; ``--pick`` searches only some of the N mixes (the rest are drawn and skipped, so mix
k is the same with or without it).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
from typing import Mapping, Optional

from agent.model import JobAllocation
from evaluation import mix_study as MS
from evaluation import nodemodel as NM
from evaluation import validate_sim as V
from evaluation.flags import comma_list, names_arg, path_arg, plain_int
from evaluation.report import read_bench

FAIRNESS = 0.9          # issue 11: no job below 0.9x its static-cores throughput (kept for every job, also
                        # one starved of data under every policy, which the issue exempts: a little conservative)
MIN_STEP = 1.0 / 512    # the weight step stops halving below this part of the loader CPUs
RANDOM_STARTS = 6       # seeded random plans among the starts (the model has steps: climbs can stall)
# the ratios a summary reports: (name, numerator, denominator) over a row's aggregates
RATIOS = (("adaptive_x_best", "adaptive_agg", "best_baseline_agg"), ("plan_x_best", "best_plan_agg", "best_baseline_agg"),
          ("bound_x_best", "bound_fair_agg", "best_baseline_agg"), ("adaptive_x_plan", "adaptive_agg", "best_plan_agg"))


def job_models(truth: Mapping, node_cores: float) -> dict[str, NM.JobModel]:
    """The node model's jobs for curves with their workload, as the simulator builds them (its habitual
    workers: the node's CPUs over its GPUs)."""
    out = {}
    for j, cv in truth.items():
        g = max(1, int((cv.extra or {}).get("gpus") or 1))
        out[j] = NM.job_model(cv, g, int(node_cores // g))
    return out


class Evaluator:
    """A fixed plan's rates in the node model, memoised: ``plan`` is job -> (workers, weight)."""

    def __init__(self, models: Mapping[str, NM.JobModel], node_cores: float, node_gpus: int,
                 available: Optional[float] = None):
        self.models, self.node_cores, self.node_gpus, self.available = dict(models), float(node_cores), node_gpus, available
        self.gpus = {j: m.gpus for j, m in self.models.items()}
        self.evals = 0
        self._memo: dict = {}

    def rates(self, plan: Mapping[str, tuple[int, float]], loaders_yield: bool) -> dict[str, float]:
        key = (loaders_yield,) + tuple((j, plan[j][0], round(plan[j][1], 9)) for j in sorted(plan))
        got = self._memo.get(key)
        if got is None:
            self.evals += 1
            allocs = {j: JobAllocation(job=j, workers=int(w), cpus=float(c)) for j, (w, c) in plan.items()}
            r = NM.node_rates(self.models, "agent", self.node_cores, allocs, node_gpus=self.node_gpus,
                              available_cores=self.available, loaders_yield=loaders_yield)
            got = self._memo[key] = {j: r[j].normalised for j in self.models}
        return got

    def static(self) -> dict[str, float]:
        """Each job's normalised throughput under ``static-cores`` (hard quotas in proportion to GPUs,
        the users' habitual workers) in the same model."""
        r = NM.node_rates(self.models, "static", self.node_cores, None, node_gpus=self.node_gpus,
                          available_cores=self.available)
        return {j: r[j].normalised for j in self.models}

    def aggregate(self, norm: Mapping[str, float]) -> float:
        return sum(self.gpus[j] * v for j, v in norm.items())


def _score(ev: Evaluator, norm: Mapping[str, float], floors: Mapping[str, float]) -> tuple[float, float]:
    """Less shortfall under the floors first, then more aggregate: a climb from under the floors goes
    to them before it trades anything."""
    short = sum(max(0.0, floors.get(j, 0.0) - v) for j, v in norm.items())
    return (-round(short, 9), ev.aggregate(norm))


def _better(a: tuple, b: tuple) -> bool:
    return a[0] > b[0] or (a[0] == b[0] and a[1] > b[1] + 1e-12)


def _moves(plan: dict, step: float, max_workers: int, least: float):
    ids = sorted(plan)
    for a in ids:
        for b in ids:
            if a != b and plan[a][1] - step >= least:
                new = dict(plan)
                new[a] = (plan[a][0], plan[a][1] - step)
                new[b] = (plan[b][0], plan[b][1] + step)
                yield new
    for j in ids:
        w = plan[j][0]
        for nw in {w - 1, w + 1, w * 2, w // 2}:
            if 1 <= nw <= max_workers and nw != w:
                new = dict(plan)
                new[j] = (nw, plan[j][1])
                yield new


def climb(ev: Evaluator, start: Mapping[str, tuple[int, float]], floors: Mapping[str, float], loader_cpus: float,
          loaders_yield: bool, max_workers: int, rounds: int = 3) -> tuple[tuple, dict]:
    """Best-improvement hill climbing from ``start`` (weights rescaled to sum to ``loader_cpus``); once
    the step is at its least, it starts again from the top step (up to ``rounds`` times, while that
    gains): a big move can clear a step of the model that small ones stall on."""
    total = sum(c for _, c in start.values()) or 1.0
    plan = {j: (max(1, min(max_workers, int(w))), c * loader_cpus / total) for j, (w, c) in start.items()}
    best = _score(ev, ev.rates(plan, loaders_yield), floors)
    least = loader_cpus * MIN_STEP
    for _ in range(rounds):
        at_round = best
        step = loader_cpus / 8
        while step >= least:
            cand, cand_score = None, best
            for new in _moves(plan, step, max_workers, least):
                s = _score(ev, ev.rates(new, loaders_yield), floors)
                if _better(s, cand_score):
                    cand, cand_score = new, s
            if cand is None:
                step /= 2
            else:
                plan, best = cand, cand_score
        if not _better(best, at_round):
            break
    return best, plan


def starts(models: Mapping[str, NM.JobModel], loader_cpus: float, adaptive_plan: Optional[Mapping] = None) -> list[dict]:
    """Where the climbs begin: even weights at one worker and at two, GPU-proportional weights with a
    worker per planned core (at least one), adaptive's plan (its group weights where it set them), and
    ``RANDOM_STARTS`` random plans (seeded by the jobs' names: the same mix gets the same starts)."""
    ids = sorted(models)
    g = {j: models[j].gpus for j in ids}
    even = loader_cpus / len(ids)
    out = [{j: (1, even) for j in ids}, {j: (2, even) for j in ids},
           {j: (max(1, round(loader_cpus * g[j] / sum(g.values()))), loader_cpus * g[j] / sum(g.values())) for j in ids}]
    if adaptive_plan:
        out.append({j: (int(a["workers"]), float(a.get("cpu_weight") or a["cpus"])) for j, a in adaptive_plan.items()
                    if j in models})
    rng = random.Random(",".join(ids))
    top = max(2, int(math.ceil(2 * loader_cpus / len(ids))))
    for _ in range(RANDOM_STARTS):
        w = {j: (rng.randint(1, top), rng.uniform(0.05, 1.0)) for j in ids}
        total = sum(c for _, c in w.values())
        out.append({j: (n, c * loader_cpus / total) for j, (n, c) in w.items()})
    return [p for p in out if set(p) == set(ids)]


def search(ev: Evaluator, loader_cpus: float, floors: Mapping[str, float], start_plans: list[dict],
           max_workers: Optional[int] = None) -> dict:
    """The best plan the climbs find, with and without the loaders yielding: ``agg`` (GPU-weighted
    normalised throughput), ``norm`` per job, ``plan`` (job -> [workers, weight]), ``loaders_yield``,
    ``feasible`` (every job at its floor), ``evals`` (node-model evaluations)."""
    max_workers = max_workers or max(4, 2 * int(math.ceil(ev.node_cores)))
    best = None
    for y in (True, False):
        for st in start_plans:
            s, plan = climb(ev, st, floors, loader_cpus, y, max_workers)
            if best is None or _better(s, best[0]):
                best = (s, plan, y)
    _, plan, y = best
    norm = ev.rates(plan, y)
    return {"agg": ev.aggregate(norm), "norm": norm, "plan": {j: [w, c] for j, (w, c) in plan.items()},
            "loaders_yield": y, "feasible": all(norm[j] >= floors.get(j, 0.0) - 1e-9 for j in norm),
            "evals": ev.evals}


def _row(name: str, truth: dict, node_cores: float, node_gpus: int, loader_cpus: float,
         available: Optional[float], sims: Mapping[str, float], adaptive_plan: Optional[Mapping],
         adaptive_window: Optional[Mapping[str, float]] = None) -> dict:
    """One mix on one capacity: the search, against the simulated policies ``sims`` (policy -> aggregate)
    and adaptive's jobs (``adaptive_window``: job -> normalised throughput over the simulated window)."""
    ev = Evaluator(job_models(truth, node_cores), node_cores, node_gpus, available)
    static = ev.static()
    floors = {j: FAIRNESS * v for j, v in static.items()}
    res = search(ev, loader_cpus, floors, starts(ev.models, loader_cpus, adaptive_plan))
    base = {p: v for p, v in sims.items() if p in V.BASELINES}
    best_base = max(base, key=base.get) if base else None
    cores = available if available is not None else node_cores
    bound = V.ideal_bound(truth, cores, FAIRNESS, static)
    worst = min((adaptive_window[j] / static[j] for j in static if static[j] > 0 and j in adaptive_window),
                default=None) if adaptive_window else None
    return {"scenario": name, "best_baseline": best_base, "adaptive_worst_vs_static": worst, "best_baseline_agg": base.get(best_base),
            "adaptive_agg": sims.get("adaptive"), "best_plan_agg": res["agg"], "bound_fair_agg": bound,
            "best_plan": res["plan"], "best_plan_norm": res["norm"], "loaders_yield": res["loaders_yield"],
            "feasible": res["feasible"], "static_norm": static, "evals": res["evals"], "capacity": cores}


def bench_rows(bench: dict, reps: Optional[int] = None) -> list[dict]:
    """Per static scenario and repeat of a bench run: ``_row`` on the CPU its adaptive phase could get."""
    meta = bench.get("meta") or {}
    node, loader = float(meta.get("node_cores") or 2), float(meta.get("loader_cpus") or 1.8)
    rows = []
    for sc, ph, truth, run in V._sim_phases(bench, "measured"):
        if ph["policy"] != "adaptive" or ph["_phases"] or (reps is not None and ph["rep"] >= reps):
            continue
        sims = {p: run(p)["window_agg"] for p in V.BASELINES}
        ad = run("adaptive")
        sims["adaptive"] = ad["window_agg"]
        gpus = sum(m.gpus for m in job_models(truth, node).values())
        row = _row(sc, truth, node, gpus, loader, None if ph["_cap"] >= node else ph["_cap"], sims, ad["plan"],
                   ad["window"])
        row["rep"] = ph["rep"]
        rows.append(row)
    return rows


def node_rows(node_cores: int, node_gpus: int, mixes=V.MIXES) -> list[dict]:
    """Each catalogue mix on a ``node_cores``:``node_gpus`` node (``validate_sim.node_study``)."""
    rows = []
    for mix in mixes:
        study = V.node_study(node_cores, node_gpus, mixes=(mix,))[mix]
        truth = V.mix_curves(mix, node_cores, node_gpus)
        cfg = V.study_config(node_cores, node_gpus)
        sims = {p: study[p] for p in V.BASELINES + ("adaptive",)}
        rec = study["_records"]["adaptive"]
        row = _row(mix, truth, node_cores, node_gpus, cfg.loader, None, sims, rec["plan"], rec["window"])
        row["node"] = f"{node_cores}:{node_gpus}"
        rows.append(row)
    return rows


def random_rows(node_cores: int, node_gpus: int, n: int, seed: int = 1,
                pick: Optional[frozenset] = None) -> list[dict]:
    """``n`` random mixes on a ``node_cores``:``node_gpus`` node, the same as ``evaluation.mix_study``'s
    for that seed (``mix_study.mixes_rng`` and ``random_mix``, run by ``mix_study.run_mix``), each searched;
    with ``pick``, only the mixes of those indices among the first ``n`` (the others are drawn, not run)."""
    rng = MS.mixes_rng(seed, node_cores, node_gpus)
    cfg = V.study_config(node_cores, node_gpus)
    rows = []
    for k in range(n):
        truth = MS.random_mix(rng, node_cores, node_gpus)
        if pick is not None and k not in pick:
            continue
        r = MS.run_mix(truth, node_cores, node_gpus)
        row = _row(f"random-{k}", truth, node_cores, node_gpus, cfg.loader, None, r["agg"], r["plan"],
                   r["window"]["adaptive"])
        row["node"] = f"{node_cores}:{node_gpus}"
        row["adaptive_plan"] = {j: [a["workers"], a["cpus"]] for j, a in (r["plan"] or {}).items()}
        row["adaptive_norm"] = r["window"]["adaptive"]
        rows.append(row)
        print(f"node {node_cores}:{node_gpus} random mix {k + 1}/{n}: adaptive / best plan "
              f"{row['adaptive_agg'] / row['best_plan_agg']:.3f}", file=sys.stderr)
    return rows


def random_summary(rows: list[dict]) -> dict:
    """Per node shape over its random mixes: median, p10, least and most of adaptive x the best baseline,
    the best plan x the best baseline and adaptive / the best plan; how many reach 1.10x."""
    by: dict[str, list] = {}
    for r in rows:
        if r["scenario"].startswith("random-"):
            by.setdefault(r["node"], []).append(r)
    out = {}
    for node, rs in by.items():
        s = {"mixes": len(rs), "feasible": sum(1 for r in rs if r["feasible"])}
        for name, key, over in RATIOS:
            if name == "bound_x_best":
                continue
            xs = sorted(r[key] / r[over] for r in rs if r[over])
            s[name] = {"median": V._median(xs), "p10": MS._q(xs, 0.1), "min": xs[0], "max": xs[-1],
                       "at_1.10": sum(1 for x in xs if x >= 1.10)} if xs else None
        out[node] = s
    return out


def markdown_random(summary: dict) -> str:
    lines = ["| node | random mixes | adaptive × best: median [p10; least–most] (at 1.10) "
             "| best fixed plan × best (at 1.10) | adaptive / best plan |", "|---|---|---|---|---|"]
    for node, s in summary.items():
        def f(d, count=True):
            if not d:
                return "–"
            return (f"{d['median']:.3f} [{d['p10']:.3f}; {d['min']:.3f}–{d['max']:.3f}]"
                    + (f" ({d['at_1.10']})" if count else ""))
        lines.append(f"| {node} | {s['mixes']} ({s['feasible']} with a fair plan) | {f(s['adaptive_x_best'])} "
                     f"| {f(s['plan_x_best'])} | {f(s['adaptive_x_plan'], False)} |")
    return "\n".join(lines)


def summarise(rows: list[dict]) -> list[dict]:
    """Per bench file (or node) and scenario: medians over its repeats of each ratio, with their ranges."""
    by: dict[tuple, list] = {}
    for r in rows:
        by.setdefault((r.get("source"), r.get("node"), r["scenario"]), []).append(r)
    out = []
    for (source, node, sc), rs in by.items():
        def ratios(key, over):
            return [r[key] / r[over] for r in rs if r.get(key) is not None and r.get(over)]
        s = {"source": source, "node": node, "scenario": sc, "reps": len(rs),
             "best_baseline": sorted({r["best_baseline"] for r in rs if r["best_baseline"]}),
             "feasible": all(r["feasible"] for r in rs),
             "adaptive_worst_vs_static": V._median([r["adaptive_worst_vs_static"] for r in rs
                                                    if r.get("adaptive_worst_vs_static") is not None])}
        for name, key, over in RATIOS:
            xs = ratios(key, over)
            s[name] = V._median(xs) if xs else None
            s[name + "_range"] = [min(xs), max(xs)] if xs else None
        s["plan"], s["plan_norm"] = rs[0]["best_plan"], rs[0]["best_plan_norm"]
        out.append(s)
    return out


def markdown(summary: list[dict]) -> str:
    def f(v, r=None):    # a median with its range over repeats where they differ
        return V._f(v) + (f" [{r[0]:.3f}–{r[1]:.3f}]" if v is not None and r and r[1] - r[0] > 5e-4 else "")

    lines = ["| run or node | scenario | reps | best baseline (model) | adaptive × best | best fixed plan × best "
             "| ideal fair bound × best | adaptive / best plan | adaptive's worst job / static-cores "
             "| the best plan: job workers @ weight -> normalised |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for s in summary:
        plan = "; ".join(f"{j} {w} @ {c:.2f} -> {s['plan_norm'][j]:.2f}" for j, (w, c) in sorted(s["plan"].items()))
        lines.append(f"| {s['node'] or s['source'] or 'bench'} | {s['scenario']} | {s['reps']} | {', '.join(s['best_baseline'])} "
                     f"| {f(s['adaptive_x_best'], s['adaptive_x_best_range'])} "
                     f"| {f(s['plan_x_best'], s['plan_x_best_range'])}{'' if s['feasible'] else ' (a floor missed)'} "
                     f"| {f(s['bound_x_best'], s['bound_x_best_range'])} "
                     f"| {f(s['adaptive_x_plan'], s['adaptive_x_plan_range'])} "
                     f"| {f(s['adaptive_worst_vs_static'])} | {plan} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m evaluation.best_plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("bench", type=path_arg, nargs="*", help="bench.json files of `adloader bench` runs")
    ap.add_argument("--cost", choices=V.COSTS, default="calibrated",
                    help="the jobs' loader CPU per sample: the bench's calibration (the default) or what the run's workers "
                         "paid")
    ap.add_argument("--reps", type=plain_int, default=None, help="only the first K repeats of each scenario (default: all)")
    ap.add_argument("--nodes", type=comma_list(V._shape), default=None,
                    help="node shapes, CORES:GPUS,... (e.g. 16:8,96:8)")
    ap.add_argument("--mixes", type=names_arg, default=",".join(V.MIXES), help=f"with --nodes: the catalogue mixes (default {','.join(V.MIXES)})")
    ap.add_argument("--random", type=plain_int, default=0,
                    help="with --nodes: also N random mixes per node shape (evaluation.mix_study's, same seed; "
                         "default 0)")
    ap.add_argument("--seed", type=plain_int, default=1, help="with --random: the mixes' seed (mix_study's default 1)")
    ap.add_argument("--pick", type=comma_list(plain_int), default=None,
                    help="with --random N: search only these of the N mixes, by index from 0 (K,K,...; "
                         "mix_study's JSON lists its worst mixes by the same index)")
    ap.add_argument("--out", type=path_arg, default=None, help="write the rows and the summary here (JSON)")
    args = ap.parse_args(argv)
    if not args.bench and not args.nodes:
        ap.error("give bench.json files and/or --nodes")
    if args.reps is not None and args.reps < 1:
        ap.error("--reps must be at least 1")
    if args.random < 0 or (args.random and not args.nodes):
        ap.error("--random takes a count >= 0 and needs --nodes")
    pick = None
    if args.pick is not None:
        pick = frozenset(args.pick)
        bad = sorted(k for k in pick if not 0 <= k < args.random)
        if not args.random or bad:
            ap.error(f"--pick needs --random N and indices from 0 to N-1"
                     + (f"; out of range: {', '.join(map(str, bad))}" if bad and args.random else ""))
    mixes = [m for m in args.mixes.split(",") if m]
    unknown = [m for m in mixes if m not in V.MIXES]
    if unknown:
        ap.error(f"unknown mix(es) {', '.join(unknown)}; choose from {', '.join(V.MIXES)}")
    rows: list[dict] = []
    for path in args.bench:
        try:
            bench = read_bench(path)
        except ValueError as e:
            print(f"best_plan: {e}", file=sys.stderr)
            return 2
        if args.cost == "measured":
            bench, _ = V.with_measured_costs(bench, "measured")
        got = bench_rows(bench, args.reps)
        for r in got:
            r["source"] = os.path.basename(path)
        print(f"{path}: {len(got)} phase(s) searched", file=sys.stderr)
        rows += got
    if args.nodes:
        for cores, gpus in args.nodes:
            print(f"node {cores}:{gpus}: {len(mixes)} mix(es)", file=sys.stderr)
            rows += node_rows(cores, gpus, mixes)
            if args.random:
                rows += random_rows(cores, gpus, args.random, args.seed, pick)
    fixed = [r for r in rows if not r["scenario"].startswith("random-")]
    summary = summarise(fixed)
    rand = random_summary(rows)
    if fixed:
        print(markdown(summary))
    if rand:
        print(("\n" if fixed else "") + markdown_random(rand))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"rows": rows, "summary": summary, "random": rand, "cost": args.cost}, fh, indent=1,
                      default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
