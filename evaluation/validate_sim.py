"""The simulator's node model checked against measured bench runs, and the same mixes on bigger nodes.

    python -m evaluation.validate_sim BENCH.json [BENCH.json ...] [--out FILE.json]
    python -m evaluation.validate_sim --nodes 16:8,96:8 [--out FILE.json]

Validation: for every static scenario of the given ``adloader bench`` runs, the same jobs (the specs
the bench calibrated and ran: step, loader demand, trainer CPU fraction, GPUs, habitual workers) go
through ``evaluation.nodemodel.steady_state`` on a node of the bench's cores and loader budget under
each policy the bench measured, and the simulated ratios (policy / best user baseline, policy / none,
policy / static-cores, policy / even-static) are printed next to the measured medians, with the
difference. What the model leaves out is said in ``evaluation.nodemodel``'s docstring (quota
throttling latency, worker start-up, the machine's other tenants).

Bigger nodes: each catalogue mix is filled to the node's GPUs (its members repeated in order until
the GPUs are used) with the kinds' real demands (``cores_per_gpu`` as published, not scaled to the
node) and ``cpus // ranks`` habits for the node, and the same policies are simulated.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from typing import Optional

from evaluation.nodemodel import AGENT_POLICIES, USER_POLICIES, JobModel, models_from_bench_specs, objective, \
    steady_state

BASELINES = ("none", "autotune", "static-cores", "even-static")
RATIOS = ("best", "none", "static-cores", "even-static")


def _ratios(values: dict[str, float], policy: str) -> dict[str, Optional[float]]:
    out: dict[str, Optional[float]] = {}
    v = values.get(policy)
    base = [values[b] for b in BASELINES if b in values and b != policy and values[b] > 0]
    out["best"] = v / max(base) if v is not None and base else None
    for b in RATIOS[1:]:
        out[b] = v / values[b] if v is not None and values.get(b) and b != policy else None
    return out


def simulate_specs(specs: dict, node_cores: float, loader_cpus: float, policies) -> dict[str, float]:
    models = models_from_bench_specs(specs)
    return {p: objective(models, steady_state(models, p, node_cores, loader_cpus))
            for p in policies if p in USER_POLICIES + AGENT_POLICIES}


def validate(bench: dict) -> list[dict]:
    """Rows: scenario, policy, measured and simulated aggregate and ratios."""
    meta = bench.get("meta") or {}
    node, loader = float(meta.get("node_cores") or 2), float(meta.get("loader_cpus") or 1.8)
    rows = []
    by_sc: dict[str, list] = {}
    for ph in bench.get("phases", []):
        if ph.get("kind") == "static" and (ph.get("metrics") or {}).get("agg_normalised") and ph.get("specs"):
            by_sc.setdefault(ph["scenario"], []).append(ph)
    for sc, phases in by_sc.items():
        specs = {j: s for j, s in phases[0]["specs"].items() if s}
        policies = sorted({ph["policy"] for ph in phases})
        sim = simulate_specs(specs, node, loader, policies)
        reps: dict[int, dict[str, float]] = {}
        for ph in phases:
            reps.setdefault(ph["rep"], {})[ph["policy"]] = ph["metrics"]["agg_normalised"]
        for p in policies:
            if p not in sim:
                continue
            meas = {k: [] for k in RATIOS}
            for vals in reps.values():
                for k, v in _ratios(vals, p).items():
                    if v is not None:
                        meas[k].append(v)
            srat = _ratios(sim, p)
            row = {"scenario": sc, "policy": p, "sim_agg": sim[p],
                   "measured_agg": _median([vals[p] for vals in reps.values() if p in vals])}
            for k in RATIOS:
                row[f"measured_{k}"] = _median(meas[k])
                row[f"sim_{k}"] = srat[k]
            rows.append(row)
    return rows


def simulate_dynamic(specs: dict, node_cores: float, loader_cpus: float, policies, startup_s: float = 0.0) -> dict:
    """The bench's dynamic scenario through ``evaluation.simulate`` (same jobs: arrivals, samples of work,
    the workload model; a perfect predictor): policy -> {agg, makespan_s, jct_mean_s}. ``startup_s`` (the
    measured seconds from a job's launch to its first batch, the same under every policy) is added to
    every JCT and to the makespan, as the bench counts them from the launch."""
    from evaluation import simulate as S

    models = models_from_bench_specs(specs)
    truth, trace = {}, []
    for j, sp in specs.items():
        m = models[j]
        truth[j] = dataclasses.replace(m.curve, extra={"gpus": m.gpus, "trainer_cpu_s_per_step": m.trainer_cpu_s_per_step,
                                                       "num_workers": m.habitual_workers})
        work_s = float(sp.get("samples") or 0) / m.curve.ceiling_samples_per_s
        trace.append(S.TraceJob("bench", j, j, float(sp.get("arrival_s") or 0.0), max(1e-3, work_s), m.gpus))
    cfg = S.SimConfig(cores=float(node_cores), gpus=sum(m.gpus for m in models.values()), loader_cpus=loader_cpus,
                      predictor="perfect", tick_s=1.0)
    out = {}
    for p in policies:
        r = S.simulate_node(trace, truth, p, cfg)
        jct = [v["jct_s"] + startup_s for v in r["jobs"].values()]
        out[p] = {"makespan_s": r["makespan_s"] + startup_s, "jct_mean_s": sum(jct) / len(jct),
                  "agg": sum(v["norm_s"] for v in r["jobs"].values()) / r["makespan_s"] if r["makespan_s"] else None}
    return out


def validate_dynamic(bench: dict) -> list[dict]:
    """Rows for the dynamic scenario: measured (median over repeats) and simulated makespan and mean JCT,
    and their ratios to ``none``."""
    meta = bench.get("meta") or {}
    node, loader = float(meta.get("node_cores") or 2), float(meta.get("loader_cpus") or 1.8)
    phases = [ph for ph in bench.get("phases", []) if ph.get("kind") == "dynamic" and ph.get("specs")
              and (ph.get("metrics") or {}).get("makespan_s")]
    if not phases:
        return []
    specs = {j: s for j, s in phases[0]["specs"].items() if s}
    delays = [e["t"] - e["launch_t"] for ph in phases for e in ph.get("events") or []
              if e.get("kind") == "arrival" and "launch_t" in e]
    startup = _median(delays) or 0.0
    policies = sorted({ph["policy"] for ph in phases})
    sim = simulate_dynamic(specs, node, loader, [p for p in policies if p in USER_POLICIES + AGENT_POLICIES], startup)
    meas = {p: {k: _median([ph["metrics"][k] for ph in phases if ph["policy"] == p]) for k in ("makespan_s", "jct_mean_s")}
            for p in policies}
    rows = []
    for p in policies:
        if p not in sim:
            continue
        row = {"scenario": "dynamic", "policy": p, "startup_s": startup}
        for k in ("makespan_s", "jct_mean_s"):
            row[f"measured_{k}"], row[f"sim_{k}"] = meas[p][k], sim[p][k]
            if "none" in meas and "none" in sim and meas["none"][k] and sim["none"][k]:
                row[f"measured_{k}_x_none"] = meas[p][k] / meas["none"][k]
                row[f"sim_{k}_x_none"] = sim[p][k] / sim["none"][k]
        rows.append(row)
    return rows


def markdown_dynamic(rows: list[dict]) -> str:
    lines = ["| policy | makespan s: measured / sim | × none: measured / sim | mean JCT s: measured / sim "
             "| × none: measured / sim |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['policy']} | {_f(r['measured_makespan_s'], '.1f')} / {_f(r['sim_makespan_s'], '.1f')} "
                     f"| {_f(r.get('measured_makespan_s_x_none'))} / {_f(r.get('sim_makespan_s_x_none'))} "
                     f"| {_f(r['measured_jct_mean_s'], '.1f')} / {_f(r['sim_jct_mean_s'], '.1f')} "
                     f"| {_f(r.get('measured_jct_mean_s_x_none'))} / {_f(r.get('sim_jct_mean_s_x_none'))} |")
    if rows:
        lines.append(f"\n(start-up, launch to first batch, measured median {rows[0]['startup_s']:.1f} s, added to the "
                     "simulated JCTs and makespan)")
    return "\n".join(lines)


def _median(xs):
    xs = sorted(x for x in xs if x is not None and not math.isnan(x))
    if not xs:
        return None
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def node_study(node_cores: int, node_gpus: int, policies=BASELINES + ("adaptive",), catalog_path=None,
               step_s: float = 0.1) -> dict[str, dict[str, float]]:
    """Each catalogue mix filled to ``node_gpus`` GPUs with the kinds' real demands -> policy -> aggregate."""
    from evaluation.catalog import habitual_workers, load_catalog
    from predictor.curve import ThroughputCurve

    cat = load_catalog(catalog_path)
    loader = round(node_cores * 0.9, 2)
    out = {}
    for mix in ("heterogeneous", "gpu-weighted", "trainer-cpu", "oversubscribed", "nothing-to-arbitrate"):
        if mix not in cat.mixes:
            continue
        models: dict[str, JobModel] = {}
        gpus, i = 0, 0
        while gpus < node_gpus:
            k = cat.mixes[mix][i % len(cat.mixes[mix])]
            kd = cat.kinds[k]
            if gpus + kd.gpus > node_gpus:
                break
            cv = ThroughputCurve(job=f"{i}-{k}", batch_size=64 * kd.gpus, compute_s_per_step=step_s,
                                 cpu_s_per_batch=kd.cores_per_gpu * kd.gpus * step_s, blocked_s_per_batch=0.0,
                                 confidence=1.0, observed_configs=3)
            models[f"{i}-{k}"] = JobModel(curve=cv, trainer_cpu_s_per_step=kd.trainer_cpu_frac * step_s,
                                          gpus=kd.gpus, habitual_workers=habitual_workers(kd, node_cores))
            gpus += kd.gpus
            i += 1
        out[mix] = {p: objective(models, steady_state(models, p, node_cores, loader)) for p in policies}
        out[mix]["_demand_cores"] = sum(m.curve.cpu_s_per_batch / m.curve.compute_s_per_step + m.trainer_cores
                                        for m in models.values())
        out[mix]["_gpus"] = gpus
    return out


def _f(v, spec=".3f"):
    return "–" if v is None else format(v, spec)


def markdown_validation(rows: list[dict]) -> str:
    lines = ["| scenario | policy | measured agg. | sim agg. | × best baseline: measured / sim | × none: measured / sim "
             "| × static-cores: measured / sim | × even-static: measured / sim | worst ratio difference |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        diffs = [abs(r[f"sim_{k}"] / r[f"measured_{k}"] - 1) for k in RATIOS
                 if r.get(f"sim_{k}") and r.get(f"measured_{k}")]
        lines.append(f"| {r['scenario']} | {r['policy']} | {_f(r['measured_agg'])} | {_f(r['sim_agg'])} | "
                     + " | ".join(f"{_f(r[f'measured_{k}'])} / {_f(r[f'sim_{k}'])}" for k in RATIOS)
                     + f" | {_f(max(diffs) if diffs else None, '.1%')} |")
    return "\n".join(lines)


def markdown_study(study: dict, node_cores: int, node_gpus: int) -> str:
    pols = [p for p in BASELINES + ("adaptive",)]
    lines = [f"Node: {node_cores} cores, {node_gpus} GPUs (loader budget {node_cores * 0.9:g})\n",
             "| mix (filled to the GPUs) | demand, cores | " + " | ".join(pols) + " | adaptive × best baseline |",
             "|---|---|" + "---|" * (len(pols) + 1)]
    for mix, vals in study.items():
        best = max(vals[p] for p in BASELINES)
        lines.append(f"| {mix} ({vals['_gpus']} GPUs) | {vals['_demand_cores']:.1f} | "
                     + " | ".join(_f(vals[p]) for p in pols) + f" | {_f(vals['adaptive'] / best)} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m evaluation.validate_sim", description=__doc__.split("\n\n")[0])
    ap.add_argument("bench", nargs="*", help="bench.json files of `adloader bench` runs")
    ap.add_argument("--nodes", default=None, help="node shapes for the study, CORES:GPUS,... (e.g. 16:8,96:8)")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    if not args.bench and not args.nodes:
        ap.error("give bench.json files and/or --nodes")
    doc: dict = {"validation": [], "study": {}}
    for path in args.bench:
        with open(path) as f:
            bench = json.load(f)
        rows = validate(bench)
        dyn = validate_dynamic(bench)
        for r in rows + dyn:
            r["bench"] = path
        doc["validation"] += rows + dyn
        print(f"\n{path}\n")
        if rows:
            print(markdown_validation(rows))
        if dyn:
            print(markdown_dynamic(dyn))
    if args.nodes:
        for shape in args.nodes.split(","):
            c, g = (int(x) for x in shape.split(":"))
            st = node_study(c, g)
            doc["study"][shape] = st
            print()
            print(markdown_study(st, c, g))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
