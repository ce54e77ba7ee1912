"""How a bench run's machine moved under it: the loader CPU per sample its jobs paid, phase by phase.

    python -m evaluation.phase_noise BENCH.json [BENCH.json ...] [--out FILE.json]

A policy's ratio in one repeat is two phases' throughputs, and a phase whose every worker paid more per
sample than another's shows in that ratio whatever the policies did (BENCHMARKS.md, thirty-first pass).
This says what kind of noise that is, from the figures the bench already keeps: each job's workers' CPU
per sample over its calibration (``report._phase_costs``), taken relative to the median of the same job
under the same policy in the same scenario (so a policy's own effect on its cost is not counted as
noise), and three correlations of those deviations:

- ``together``: between two jobs of one phase. Near 1: a phase's jobs ran dearer or cheaper together
  (the machine, not a job's luck).
- ``lag1``: between a phase's median deviation and the next phase's of the same scenario (in the order
  they ran). Near 0: each phase drew its own state; near 1: a drift slower than the phases, which
  interleaved repeats already pair out.
- ``halves``: between the first and the second half of a phase's measured windows, per job (from the
  agent's ``observation`` records: runs with ``--agent-log-level debug``; phases without an agent have
  none). Near 1: the state held over the phase; near 0: it changed within it, and longer phases
  average it.

With ``sd_between`` (the phases' median deviations) and ``sd_within`` (half the difference of a job's two
halves): longer phases shrink the spread of the per-repeat ratios only as far as the state changes
within a phase; otherwise only more repeats do. Prints a table; ``--out`` writes JSON.
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path
from typing import Optional

from evaluation import phase_scan, report


def corr(pairs: list[tuple[float, float]]) -> Optional[float]:
    """Pearson's r of the pairs; None under 3 pairs or without spread."""
    if len(pairs) < 3:
        return None
    try:
        return statistics.correlation([a for a, _ in pairs], [b for _, b in pairs])
    except statistics.StatisticsError:     # a constant side
        return None


def _windows(log: Path) -> dict[str, list[tuple[float, float, float]]]:
    """job -> [(ts, worker CPU s, samples)] from an agent log's ``observation`` records
    (``phase_scan.windows_by_job``), in time order; windows without a finished batch are skipped, and a
    missing log has none."""
    if not log.is_file():
        return {}
    out: dict[str, list] = {}
    for job, ws in phase_scan.windows_by_job(log).items():
        xs = []
        for ts, w in ws:
            steps, bs, c = (float(w.get(k) or 0.0) for k in ("steps", "batch_size", "cpu_s_per_batch"))
            if steps > 0 and bs > 0:
                xs.append((ts, c * steps, steps * bs))
        if xs:
            out[job] = sorted(xs)
    return out


def phase_halves(log: Path, warmup_s: float) -> dict[str, tuple[float, float]]:
    """job -> (CPU per sample over its first half of windows, over its second), skipping the windows
    within ``warmup_s`` of the job's first one (the bench's warm-up); jobs with under 2 windows left out."""
    out = {}
    for job, xs in _windows(log).items():
        xs = [x for x in xs if x[0] >= xs[0][0] + warmup_s]
        if len(xs) < 2:
            continue
        h = len(xs) // 2
        parts = (xs[:h], xs[h:])
        if all(sum(s for _, _, s in p) > 0 for p in parts):
            out[job] = tuple(sum(c for _, c, _ in p) / sum(s for _, _, s in p) for p in parts)
    return out


def analyse(bench: dict) -> dict:
    """The figures above for one bench.json (its static phases that gave costs)."""
    phases = sorted((p for p in bench.get("phases", []) if p.get("kind", "static") == "static" and not p.get("error")),
                    key=lambda p: p.get("phase_start") or 0.0)
    costs = [(p, report._phase_costs(p)) for p in phases]
    costs = [(p, c) for p, c in costs if c]
    by: dict[tuple, list] = {}
    for p, c in costs:
        for j, x in c.items():
            by.setdefault((p["scenario"], p["policy"], j), []).append(x)
    med = {k: statistics.median(v) for k, v in by.items()}
    dev = [(p, {j: x / med[(p["scenario"], p["policy"], j)] - 1.0 for j, x in c.items()}) for p, c in costs]
    together = [(d[a], d[b]) for _, d in dev for a, b in itertools.combinations(sorted(d), 2)]
    lag, seq = [], {}
    for p, d in dev:
        seq.setdefault(p["scenario"], []).append(statistics.median(d.values()))
    for xs in seq.values():
        lag.extend(zip(xs, xs[1:]))
    halves = []
    for p, _ in costs:
        if not p.get("run_dir"):
            continue
        hv = phase_halves(Path(p["run_dir"]) / "agent.log", float(p.get("warmup_s") or 0.0))
        for j, (a, b) in hv.items():
            k = (p["scenario"], p["policy"], j)
            spec = ((p.get("specs") or {}).get(j) or {}).get("cpu_s_per_sample")
            if k in med and spec:
                halves.append((a / spec / med[k] - 1.0, b / spec / med[k] - 1.0))
    between = [x for xs in seq.values() for x in xs]

    def r(pairs):
        v = corr(pairs)
        return None if v is None else round(v, 3)

    return {"phases": len(costs), "together": r(together), "together_n": len(together),
            "lag1": r(lag), "lag1_n": len(lag), "halves": r(halves), "halves_n": len(halves),
            "sd_between": round(statistics.pstdev(between), 4) if len(between) > 1 else None,
            "sd_within": round(statistics.pstdev([(a - b) / 2 for a, b in halves]), 4) if len(halves) > 1 else None}


def markdown(rows: dict[str, dict]) -> str:
    f = report._fmt
    lines = ["| run | phases | together: r (pairs) | lag-1: r (pairs) | halves: r (pairs) | sd between phases | "
             "sd within a phase |", "|---|---|---|---|---|---|---|"]
    for name, x in rows.items():
        lines.append(f"| {name} | {x['phases']} | {f(x['together'], '.2f')} ({x['together_n']}) | {f(x['lag1'], '.2f')} "
                     f"({x['lag1_n']}) | {f(x['halves'], '.2f')} ({x['halves_n']}) | {f(x['sd_between'], '.3f')} | "
                     f"{f(x['sd_within'], '.3f')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    from evaluation.flags import path_arg

    ap = argparse.ArgumentParser(prog="python -m evaluation.phase_noise", description=__doc__.split("\n\n")[0])
    ap.add_argument("bench", type=path_arg, nargs="+", help="bench.json files (their phases' run folders for the halves)")
    ap.add_argument("--out", type=path_arg, default=None, help="write the figures as JSON here")
    a = ap.parse_args(argv)
    rows = {}
    for path in a.bench:
        try:
            bench = report.read_bench(path)
        except ValueError as e:
            print(f"phase_noise: {e}", file=sys.stderr)
            return 2
        rows[path] = analyse(bench)
    print(markdown(rows))
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
