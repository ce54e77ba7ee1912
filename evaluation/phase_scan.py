"""Replay the agent's observation windows through the predictor bank: the new phases it finds, and how
much a job's windows move between two consecutive windows at one configuration (a command, not a test).

    python -m evaluation.phase_scan PATH [PATH ...] [--prior default|none] [--out FILE.json]

PATH: an agent log written with ``--log-level debug`` (``adloader agent``; the bench's
``--agent-log-level debug`` writes ``runs/SCENARIO/POLICY-repN/agent.log``), or a folder searched for
``agent.log`` files. Each ``observation`` record's window is fed, per job and in order, to a fresh
``predictor.bank.PredictorBank``; where the bank drops a job's earlier windows (a new phase,
``predictor.bank._new_phase``) the table names the job, the window and the seconds since the job's first
window. The second table is what the detection's thresholds stand on: over pairs of consecutive windows at
one configuration (same worker count, cores within 0.02), the relative change of the workers' CPU per
sample, of compute per step and of samples/s (median, 90th percentile, most), skipping each job's first
two windows (start-up).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections import defaultdict
from pathlib import Path

FIGURES = (("cpu per sample", lambda w: w["cpu_s_per_batch"] / w["batch_size"]),
           ("compute per step", lambda w: w["compute_s_per_step"]),
           ("samples/s", lambda w: w["samples_per_s"]))


def log_files(paths) -> list[Path]:
    out = []
    for p in map(Path, paths):
        if p.is_dir():
            out.extend(sorted(p.rglob("agent.log")))
        elif p.is_file():
            out.append(p)
        else:
            raise FileNotFoundError(f"{p}: no such file or folder")
    return out


def windows_by_job(path: Path) -> dict[str, list[tuple[float, dict]]]:
    """job -> [(ts, window dict)] from one agent log's ``observation`` records, in order. Other lines
    (other events, text, a line cut short by a crash) are skipped."""
    jobs: dict[str, list] = defaultdict(list)
    with open(path, errors="replace") as f:
        for line in f:
            if '"observation"' not in line:
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("event") == "observation" and isinstance(rec.get("window"), dict) and rec.get("job"):
                jobs[str(rec["job"])].append((float(rec.get("ts") or 0.0), rec["window"]))
    return jobs


def replay(jobs, prior) -> list[dict]:
    """Each job's windows through a fresh bank: where it dropped earlier windows."""
    from predictor.bank import PredictorBank
    from predictor.observation import BadObservation, Observation

    found = []
    bank = PredictorBank(prior=prior)
    for job, seq in jobs.items():
        t0 = seq[0][0] if seq else 0.0
        seen = 0
        for k, (ts, w) in enumerate(seq):
            try:
                bank.observe(job, Observation.from_dict(w))
            except BadObservation:
                continue
            cur = bank.curve(job)
            n = cur.extra.get("phase_changes", 0) if cur is not None else 0
            if n > seen:
                seen = n
                found.append({"job": job, "window": k, "of": len(seq), "after_s": round(ts - t0, 1),
                              "kept": len(bank.windows(job)), "cpu_s_per_batch": cur.cpu_s_per_batch,
                              "compute_s_per_step": cur.compute_s_per_step})
    return found


def adjacent_changes(jobs) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {name: [] for name, _ in FIGURES}
    for seq in jobs.values():
        ws = [w for _, w in seq if w.get("steps", 0) > 0 and w.get("samples_per_s", 0) > 0][2:]
        for a, b in zip(ws, ws[1:]):
            if a["workers"] != b["workers"] or abs(a["cores"] - b["cores"]) > 0.02:
                continue
            for name, fig in FIGURES:
                x, y = fig(a), fig(b)
                if x > 0 and y >= 0:
                    out[name].append(abs(y / x - 1.0))
    return out


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main(argv=None) -> int:
    from evaluation.flags import path_arg

    ap = argparse.ArgumentParser(prog="python -m evaluation.phase_scan", description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", type=path_arg, nargs="+", help="agent logs (--log-level debug) or folders holding agent.log files")
    ap.add_argument("--prior", choices=("default", "none"), default="default", help="the bank's prior (default: default)")
    ap.add_argument("--out", type=path_arg, default=None, help="write the result as JSON here")
    a = ap.parse_args(argv)
    try:
        files = log_files(a.paths)
    except FileNotFoundError as e:
        ap.error(str(e))
    if not files:
        ap.error("no agent.log under " + ", ".join(a.paths))
    prior = None if a.prior == "none" else "default"
    found, changes, runs = [], defaultdict(list), 0
    for path in files:
        jobs = windows_by_job(path)
        if not jobs:
            continue
        runs += 1
        for row in replay(jobs, prior):
            found.append({"log": os.path.relpath(path), **row})
        for name, xs in adjacent_changes(jobs).items():
            changes[name].extend(xs)
    if runs == 0:
        print("no observation records in " + ", ".join(map(str, files)) + " (was the agent run with "
              "--log-level debug?)", file=sys.stderr)
        return 1
    print(f"{runs} agent logs; new phases found: {len(found)}\n")
    if found:
        print("| log | job | window | after s | windows kept | CPU s per batch | compute s per step |")
        print("|---|---|---|---|---|---|---|")
        for r in found:
            print(f"| {r['log']} | {r['job']} | {r['window'] + 1} of {r['of']} | {r['after_s']} | {r['kept']} | "
                  f"{r['cpu_s_per_batch']:.4f} | {r['compute_s_per_step']:.4f} |")
        print()
    print("| consecutive windows at one configuration | pairs | median change | p90 | most |")
    print("|---|---|---|---|---|")
    summary = {}
    for name, xs in changes.items():
        if xs:
            summary[name] = {"pairs": len(xs), "median": statistics.median(xs), "p90": _pct(xs, 0.9), "max": max(xs)}
            s = summary[name]
            print(f"| {name} | {s['pairs']} | {s['median']:.1%} | {s['p90']:.1%} | {s['max']:.1%} |")
    if a.out:
        Path(a.out).write_text(json.dumps({"argv": sys.argv, "logs": [str(p) for p in files], "phases": found,
                                           "adjacent": summary}, indent=1))
        print(f"\nJSON: {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
