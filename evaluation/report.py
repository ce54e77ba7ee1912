"""Summaries of a bench run: medians over repeats, ratios measured side by side, goals, markdown, JSON.

Ratios are taken within a repeat (policy / baseline in the same repeat, i.e. minutes apart on the same
machine) and then the median over repeats is reported, so slow drifts in the machine's load cancel.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Optional

from evaluation import metrics as M

METRICS = ("agg_normalised", "samples_per_s", "gpu_idle_frac", "jain", "fairness_vs_even", "fairness_vs_static",
           "makespan_s", "jct_mean_s", "jct_gpu_mean_s", "jct_p95_s", "reaction_s_max", "tput_settle_s_max",
           "agent_cpu_cores", "resizes", "loader_memory_max_bytes", "loader_memory_over_budget_samples", "loader_memory_samples")
BASELINES = ("oracle", "even-static", "even", "none", "autotune", "static-cores")
# what users and operators run instead of the agent: "× best" is against the best of these in the same repeat
USER_BASELINES = ("none", "autotune", "static-cores", "even-static")

GOALS = (
    # (scenario, policy, ratio key, threshold, text)
    ("heterogeneous", "adaptive", "ratio_oracle", 0.95, "heterogeneous: adaptive >= 0.95 x oracle"),
    ("heterogeneous", "adaptive", "ratio_even-static", 1.10, "heterogeneous: adaptive >= 1.10 x even-static"),
    ("homogeneous", "adaptive", "ratio_even", 0.97, "homogeneous: adaptive >= 0.97 x even"),
    ("gpu-weighted", "adaptive", "ratio_best", 1.10, "gpu-weighted: adaptive >= 1.10 x best user baseline"),
    ("trainer-cpu", "adaptive", "ratio_best", 1.10, "trainer-cpu: adaptive >= 1.10 x best user baseline"),
    ("oversubscribed", "adaptive", "ratio_best", 1.10, "oversubscribed: adaptive >= 1.10 x best user baseline"),
    ("nothing-to-arbitrate", "adaptive", "ratio_best", 0.98,
     "nothing-to-arbitrate: adaptive >= 0.98 x best user baseline"),
    # under the loader memory budget the oracle is the budget oracle: the best plan the budget allows
    ("memory", "adaptive", "ratio_oracle", 0.95, "memory: adaptive >= 0.95 x the budget oracle"),
)
# a run with fixed work (the dynamic scenario): per repeat, the best user baseline's figure over the
# policy's (above 1: the policy finishes sooner); the GPU-weighted mean JCT counts a job once per GPU, as
# the aggregate throughput does (``metrics.gpu_weighted_mean``)
TIME_METRICS = ("makespan_s", "jct_mean_s", "jct_gpu_mean_s")
SETTLE_GOAL_S = 5.0
# the workload check: a job's loader CPU per sample in its workers over the calibration outside this band
# means the run's loader demand is not the catalogue's design (BENCHMARKS.md, thirtieth pass)
WORKLOAD_BAND = (0.8, 1.25)


def _finite(xs):
    return [x for x in xs if isinstance(x, (int, float)) and not math.isnan(x)]


def summarise(phases: list[dict]) -> dict:
    by = {}
    for ph in phases:
        by.setdefault(ph["scenario"], {}).setdefault(ph["rep"], {})[ph["policy"]] = ph
    out = {}
    for sc, reps in by.items():
        # fairness vs even within each repeat
        for rep, pols in reps.items():
            ref = pols.get("even") or pols.get("even-static")
            ref_norm = {j: v["normalised"] for j, v in ((ref or {}).get("metrics") or {}).get("jobs", {}).items()}
            st = ((pols.get("static-cores") or {}).get("metrics") or {}).get("jobs", {})
            st_norm = {j: v["normalised"] for j, v in st.items()}
            for ph in pols.values():
                m = ph.get("metrics") or {}
                if m.get("jobs") and ref_norm:
                    m["fairness_vs_even"] = M.fairness_vs_even({j: v["normalised"] for j, v in m["jobs"].items()},
                                                               ref_norm)
                if m.get("jobs") and st_norm:   # the worst job's throughput over its static-cores throughput
                    m["fairness_vs_static"] = M.fairness_vs_even({j: v["normalised"] for j, v in m["jobs"].items()},
                                                                 st_norm)
        policies = []
        for pols in reps.values():
            for p in pols:
                if p not in policies:
                    policies.append(p)
        table = {}
        for p in policies:
            row = {"reps": 0, "errors": []}
            vals = {k: [] for k in METRICS}
            # one slot per repeat of the scenario (None where this policy's or the baseline's phase failed),
            # so the printed lists line up with the cost per phase's, repeat by repeat
            ratios = {b: [None] * len(reps) for b in BASELINES + ("best",)}
            times = {k: [None] * len(reps) for k in TIME_METRICS}     # the best user baseline's / this one's
            for k_rep, (rep, pols) in enumerate(sorted(reps.items())):
                ph = pols.get(p)
                if not ph:
                    continue
                m = ph.get("metrics") or {}
                if ph.get("error"):
                    row["errors"].append(ph["error"][:300])
                if "agg_normalised" not in m:
                    continue
                row["reps"] += 1
                for k in METRICS:
                    if k in m:
                        vals[k].append(m[k])
                for b in BASELINES:
                    base = ((pols.get(b) or {}).get("metrics") or {}).get("agg_normalised")
                    if base:
                        ratios[b][k_rep] = m["agg_normalised"] / base
                best = [((pols.get(b) or {}).get("metrics") or {}).get("agg_normalised")
                        for b in USER_BASELINES if b != p]
                best = _finite(best)
                if best and p not in USER_BASELINES:
                    ratios["best"][k_rep] = m["agg_normalised"] / max(best)
                for k in TIME_METRICS:
                    theirs = _finite([((pols.get(b) or {}).get("metrics") or {}).get(k)
                                      for b in USER_BASELINES if b != p])
                    if theirs and p not in USER_BASELINES and _finite([m.get(k)]) and m[k] > 0:
                        times[k][k_rep] = min(theirs) / m[k]
            for k, xs in vals.items():
                xs = _finite(xs)
                if xs:
                    row[k] = M.median(xs)
                    if k == "agg_normalised":
                        row["agg_normalised_min"], row["agg_normalised_max"] = min(xs), max(xs)
            for b, xs in ratios.items():
                if _finite(xs) and b != p:
                    row[f"ratio_{b}"] = M.median(_finite(xs))
                    row[f"ratio_{b}_all"] = [None if x is None else round(x, 4) for x in xs]
            for k, xs in times.items():
                if _finite(xs):
                    row[f"{k}_best_over"] = M.median(_finite(xs))
                    row[f"{k}_best_over_all"] = [None if x is None else round(x, 4) for x in xs]
            table[p] = row
        out[sc] = table
    return out


def workload_check(phases: list[dict]) -> dict[str, dict[str, dict]]:
    """Per scenario and job: the loader CPU per sample its workers paid (their CPU over the samples the
    job consumed) over the one the bench calibrated for it (``cpu_s_per_sample``: one process's
    ``__getitem__`` in a hot loop, from which its step was derived), median and range over the phases.
    1 is the catalogue's design; a worker also collates, transfers and wakes up, and on a VM a process's
    speed can differ from the calibrating one's. A job whose pipeline changes mid-run is left out (its
    cost is a phase's)."""
    xs: dict[tuple[str, str], list[float]] = {}
    for ph in phases:
        for j, x in _phase_costs(ph).items():
            xs.setdefault((ph["scenario"], j), []).append(x)
    out: dict[str, dict[str, dict]] = {}
    for (sc, j), v in xs.items():
        out.setdefault(sc, {})[j] = _spread(v)
    return out


def read_bench(path) -> dict:
    """An ``adloader bench`` bench.json (for the tools that read runs: validate_sim, best_plan,
    phase_noise). ValueError naming the file and what is wrong: unreadable, not JSON, no phases."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except OSError as e:
        raise ValueError(f"{path}: cannot read: {e.strerror or e}") from None
    except ValueError as e:
        raise ValueError(f"{path}: cannot read it as JSON: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("phases"), list):
        raise ValueError(f"{path}: no 'phases' list: not an `adloader bench` bench.json")
    return doc


def _spread(v: list[float]) -> dict:
    """A per-job figure over phases: median, least, most and how many (``workload_check``, ``delivery``)."""
    return {"x_median": M.median(v), "x_min": min(v), "x_max": max(v), "phases": len(v)}


def _spread_text(by_job: dict) -> str:
    return ", ".join(f"{j} {c['x_median']:.2f} [{c['x_min']:.2f}–{c['x_max']:.2f}]" for j, c in sorted(by_job.items()))


def _phase_costs(ph: dict) -> dict[str, float]:
    """Per job of one phase: the loader CPU per sample its workers paid over its calibration (the figure
    ``workload_check`` takes medians of); jobs whose pipeline changes mid-run, or without figures, left out."""
    # (a bench.json phase carries its jobs' specs; the run's own record keeps them under its jobs)
    specs = ph.get("specs") or {j: v.get("spec") for j, v in (ph.get("jobs") or {}).items()}
    out = {}
    for j, m in ((ph.get("metrics") or {}).get("jobs") or {}).items():
        sp = specs.get(j) or {}
        cal, cpu, sps = sp.get("cpu_s_per_sample"), m.get("worker_cpu_cores"), m.get("samples_per_s")
        if sp.get("phases") or not cal or cpu is None or not sps:
            continue
        out[j] = float(cpu) / float(sps) / float(cal)
    return out


def cost_index(phases: list[dict]) -> dict[str, dict[str, list]]:
    """Per scenario and policy, one figure per repeat of the scenario (position k: its k-th repeat, so
    the lists line up with the per-repeat ratios; None where that phase failed or gave no figure): the
    median over the phase's jobs of what their workers paid per sample over the calibration. Within a
    phase every job's cost tends to move together (BENCHMARKS.md, thirty-first pass: a policy's two
    dearest phases were its two losses), so a policy whose phases ran dearer than another's for every
    job says the comparison carries that: the machine in those phases, or the policy's own threads
    (slicing, more processes); one run cannot tell which. Read the ratios against it; nothing is
    corrected."""
    reps: dict[str, set] = {}
    for ph in phases:
        reps.setdefault(ph.get("scenario"), set()).add(ph.get("rep", 0))
    slot = {sc: {r: k for k, r in enumerate(sorted(rs))} for sc, rs in reps.items()}   # repeat -> position
    out: dict[str, dict[str, list]] = {}
    for ph in sorted(phases, key=lambda p: p.get("rep", 0)):
        xs = list(_phase_costs(ph).values())
        if xs:
            sc = ph["scenario"]
            row = out.setdefault(sc, {}).setdefault(ph["policy"], [None] * len(slot[sc]))
            row[slot[sc][ph.get("rep", 0)]] = M.median(xs)
    return out


def delivery(phases: list[dict]) -> dict[str, dict[str, dict[str, dict]]]:
    """Per scenario, agent policy and job: the loader cores the job's workers received over the window
    (the harness's measure) over the cores its plan gave it (the agent's status at the window's end),
    for the jobs planned fewer cores than they could use (the status's ``unsatisfied``): a job held at
    its fairness floor is one of them. Median, least and most over the repeats. Under 1: a CPU weight
    delivered less than planned (on a small node a one-worker job beside jobs with more workers: the
    CPUs are shared closer to per thread than per weight); above 1: it got CPU others left. The plan may
    have moved during the window; a job satisfied at its plan is left out (it takes what it needs).
    ``weight_factor``: the factor its CPU weight carried over its cores at the window's end (the
    status's ``delivery``: adaptive's ``delivery_correction``), where the status says."""
    xs: dict[tuple[str, str, str], list[float]] = {}
    fs: dict[tuple[str, str, str], list[float]] = {}
    for ph in phases:
        status = ((ph.get("agent_status") or {}).get("jobs") or {})
        jobs = (ph.get("metrics") or {}).get("jobs") or {}
        if not isinstance(status, dict):
            continue
        for j, st in status.items():
            got, planned = (jobs.get(j) or {}).get("worker_cpu_cores"), (st or {}).get("cpus")
            if not (st or {}).get("unsatisfied") or got is None or not planned or planned <= 0:
                continue
            xs.setdefault((ph["scenario"], ph["policy"], j), []).append(float(got) / float(planned))
            if isinstance(st.get("delivery"), (int, float)):
                fs.setdefault((ph["scenario"], ph["policy"], j), []).append(float(st["delivery"]))
    out: dict[str, dict[str, dict[str, dict]]] = {}
    for (sc, pol, j), v in xs.items():
        out.setdefault(sc, {}).setdefault(pol, {})[j] = _spread(v)
        if fs.get((sc, pol, j)):
            out[sc][pol][j]["weight_factor"] = _spread(fs[(sc, pol, j)])
    return out


def _delivery_text(by_job: dict) -> str:
    """``_spread_text`` with each job's weight factor where one was above 1 (``delivery``)."""
    def factor(c: dict) -> str:
        f = c.get("weight_factor")
        return f" (weight x{f['x_median']:.2f} [{f['x_min']:.2f}–{f['x_max']:.2f}])" if f and f["x_max"] > 1.0 else ""
    return ", ".join(f"{_spread_text({j: c})}{factor(c)}" for j, c in sorted(by_job.items()))


def goals(summary: dict) -> list[dict]:
    res = []
    for sc, pol, key, thr, text in GOALS:
        row = (summary.get(sc) or {}).get(pol, {})
        v = row.get(key)
        if v is None:
            res.append({"goal": text, "measured": None, "met": None})
        else:
            res.append({"goal": text, "measured": round(v, 3), "met": bool(v >= thr),
                        "per_repeat": _finite(row.get(f"{key}_all", []))})
    settle = [row.get("reaction_s_max") for sc in ("reaction", "dynamic", "hog")
              for p, row in (summary.get(sc) or {}).items() if p == "adaptive"]
    settle = _finite(settle)
    if settle:
        res.append({"goal": f"adaptive settles within {SETTLE_GOAL_S:g} s of an event (worst scenario median)",
                    "measured": round(max(settle), 2), "met": max(settle) <= SETTLE_GOAL_S})
    return res


def _fmt(v, spec=".3f"):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    return format(v, spec)


def markdown(summary: dict, goal_rows: list[dict], meta: dict, workload: Optional[dict] = None,
             costs: Optional[dict] = None, delivered: Optional[dict] = None) -> str:
    lines = []
    for sc, table in summary.items():
        lines.append(f"### {sc}\n")
        lines.append("| policy | reps | GPU-weighted agg. norm. throughput (median [min–max]) "
                     "| × best user baseline (per repeat) | × static-cores | × none | × even-static | × oracle "
                     "| GPU idle | min job ratio to static-cores | min ratio to even | makespan s "
                     "| JCT mean / GPU-weighted mean / p95 s "
                     "| settle s (alloc / tput) | agent CPU cores | resizes |")
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for p, r in table.items():
            agg = (f"{_fmt(r.get('agg_normalised'))} [{_fmt(r.get('agg_normalised_min'))}–"
                   f"{_fmt(r.get('agg_normalised_max'))}]") if "agg_normalised" in r else "failed"
            per = r.get("ratio_best_all") or []
            best = (f"{_fmt(r.get('ratio_best'))} ({', '.join(_fmt(x) for x in per)})" if per else "–")
            lines.append(
                f"| {p} | {r['reps']} | {agg} | {best} | {_fmt(r.get('ratio_static-cores'))} "
                f"| {_fmt(r.get('ratio_none'))} | {_fmt(r.get('ratio_even-static'))} | {_fmt(r.get('ratio_oracle'))} "
                f"| {_fmt(r.get('gpu_idle_frac'), '.1%')} | {_fmt(r.get('fairness_vs_static'), '.2f')} "
                f"| {_fmt(r.get('fairness_vs_even'), '.2f')} | {_fmt(r.get('makespan_s'), '.1f')} "
                f"| {_fmt(r.get('jct_mean_s'), '.1f')} / {_fmt(r.get('jct_gpu_mean_s'), '.1f')} "
                f"/ {_fmt(r.get('jct_p95_s'), '.1f')} "
                f"| {_fmt(r.get('reaction_s_max'), '.1f')} / {_fmt(r.get('tput_settle_s_max'), '.1f')} "
                f"| {_fmt(r.get('agent_cpu_cores'), '.3f')} | {_fmt(r.get('resizes'), '.0f')} |")
            for e in r.get("errors", [])[:2]:
                lines.append(f"|  | error: {e.splitlines()[0][:150]} |" + " |" * 14)
        lines.append("")
        if any(f"{k}_best_over" in r for r in table.values() for k in TIME_METRICS):
            lines.append("| policy | the best user baseline's makespan / this one's (per repeat; above 1: sooner) "
                         "| the same, mean JCT | the same, GPU-weighted mean JCT |")
            lines.append("|---|---|---|---|")
            for p, r in table.items():
                if not any(f"{k}_best_over" in r for k in TIME_METRICS):
                    continue
                cells = [f"{_fmt(r.get(f'{k}_best_over'))} ({', '.join(_fmt(x) for x in r.get(f'{k}_best_over_all') or [])})"
                         for k in TIME_METRICS]
                lines.append(f"| {p} | " + " | ".join(cells) + " |")
            lines.append("")
        if any("loader_memory_max_bytes" in r for r in table.values()):
            lines.append("| policy | loader memory peak, MiB (median over repeats) | samples over the budget / samples |")
            lines.append("|---|---|---|")
            for p, r in table.items():
                peak = r.get("loader_memory_max_bytes")
                lines.append(f"| {p} | {_fmt(peak / (1 << 20) if peak is not None else None, '.0f')} "
                             f"| {_fmt(r.get('loader_memory_over_budget_samples'), '.0f')} / "
                             f"{_fmt(r.get('loader_memory_samples'), '.0f')} |")
            lines.append("")
        check = (workload or {}).get(sc)
        if check:
            lo, hi = WORKLOAD_BAND
            off = [j for j, c in check.items() if not lo <= round(c["x_median"], 2) <= hi]     # as printed
            lines.append("Workload check, the loader CPU per sample the workers paid / the calibration (median "
                         "[range] over phases): " + _spread_text(check)
                         + (f". Outside {lo:g}–{hi:g} for {', '.join(sorted(off))}: those jobs' loader demand is not "
                            "the catalogue's design on this machine (the simulator can take the measured costs: "
                            "`validate_sim --cost measured`)." if off else "."))
            lines.append("")
        by_policy = (costs or {}).get(sc)
        if by_policy:
            lines.append("Cost per phase, the median over its jobs of the figure above, per policy by repeat: " + "; ".join(
                f"{p} {', '.join('–' if x is None else f'{x:.2f}' for x in v)}" for p, v in by_policy.items())
                + ". Every job's cost tends to move with its phase: a policy whose phases ran dearer carries that "
                  "in its ratios (the machine then, or its own threads).")
            lines.append("")
        got = (delivered or {}).get(sc)
        if got:
            lines.append("Received / planned loader cores of the jobs planned fewer cores than they could use (the "
                         "workers' CPU over the window / the plan at its end; median [range] over repeats): " + "; ".join(
                             f"{p} {_delivery_text(by_job)}" for p, by_job in got.items())
                         + ". Under 1, the job's CPU weight delivered less than its plan (weight xF: the factor "
                           "the agent's delivery correction put on it at the window's end).")
            lines.append("")
    if goal_rows:
        lines.append("Goals (ratios within a repeat, medians over repeats):\n")
        for g in goal_rows:
            mark = "n/a" if g["met"] is None else ("met" if g["met"] else "NOT met")
            reps = g.get("per_repeat") or []
            spread = ""
            if len(reps) > 1:   # the per-repeat range says how far the median can be trusted
                spread = f" (per repeat {min(reps):.3f}–{max(reps):.3f}, {len(reps)} repeats)"
            elif len(reps) == 1:
                spread = " (one repeat: indicative only)"
            lines.append(f"- {g['goal']}: measured {_fmt(g['measured'])}{spread} — {mark}")
        lines.append("")
    return "\n".join(lines)


def write_outputs(result: dict, out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "bench.json", "markdown": out_dir / "bench.md"}
    slim = dict(result)
    slim["phases"] = [{k: v for k, v in ph.items() if k != "jobs"} | {"series": ph.get("series")}
                      | {"specs": {j: v.get("spec") for j, v in (ph.get("jobs") or {}).items()}}
                      for ph in result["phases"]]
    paths["json"].write_text(json.dumps(slim, indent=1, default=_json_default))
    paths["markdown"].write_text(result.get("markdown", ""))
    return paths


def write_json(path, doc: dict) -> None:
    """Write a command's JSON result to ``path`` (its folder made as needed) and say so: what every
    benchmark command that takes ``--out FILE`` does at its end."""
    import os

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {path}")


def _json_default(o):
    if isinstance(o, Path):
        return str(o)
    if isinstance(o, float) and math.isnan(o):
        return None
    return str(o)


class Progress:
    """One line per phase on stderr: ``[3/12] heterogeneous adaptive rep 1: 14s/30s`` (rewritten in
    place on a terminal; printed once, at the end of the phase, otherwise)."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._last = 0.0

    def note(self, text: str) -> None:
        self._clear()
        print(f"  {text}", file=self.stream, flush=True)

    def begin(self, i: int, total: int, label: str) -> None:
        if self.tty:
            self.stream.write(f"\r[{i}/{total}] {label}: starting\x1b[K")
            self.stream.flush()

    def tick(self, i: int, total: int, label: str, rel_s: float, planned_s: float) -> None:
        if self.tty:
            self.stream.write(f"\r[{i}/{total}] {label}: {max(0, rel_s):.0f}s/{planned_s:.0f}s\x1b[K")
            self.stream.flush()

    def end(self, i: int, total: int, label: str, ph: dict) -> None:
        m = ph.get("metrics") or {}
        if ph.get("error") and "agg_normalised" not in m:
            tail = f"FAILED: {ph['error'].splitlines()[0][:200]}"
        else:
            tail = f"agg. normalised {m.get('agg_normalised', float('nan')):.3f}, " \
                   f"GPU idle {m.get('gpu_idle_frac', float('nan')):.1%}"
            if "makespan_s" in m:
                tail += f", makespan {m['makespan_s']:.1f}s"
            if ph.get("error"):
                tail += f" ({ph['error'][:80]})"
        self._clear()
        print(f"[{i}/{total}] {label}: {tail}", file=self.stream, flush=True)

    def _clear(self):
        if self.tty:
            self.stream.write("\r\x1b[K")
