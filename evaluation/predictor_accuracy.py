"""Predictor accuracy on measured curves held out from the fit (leave-one-job-out).

    python -m evaluation.predictor_accuracy [--corpus predictor/data/corpus.jsonl]
        [--starts 2:2,1:1,4:0.5] [--json predictor-accuracy.json]

For each job of the corpus: fit the prior on the OTHER jobs, give a fresh ``PredictorBank`` the job's
single corpus window at the starting configuration (standing in for <= 30 s of observation), and
compare its curve with everything measured for that job:

- throughput MAPE over every measured (workers, cores) point of the job;
- knee: predicted ``knee_workers(cores)`` vs the measured knee (least measured worker count whose
  samples/s is within max(KNEE_TOLERANCE, measurement noise) of the best measured at those cores,
  the truth being the best over the sweeps of a point), hit if within +-1;
  headline at the machine's full cores, also over every cores level;
- achieved: measured samples/s at the chosen worker count over the best measured at those cores.

Baselines (same curves): first principles only (no learned correction), fixed 4 workers, Lightning's
suggestion (cpus // ranks - 1, at least 1), and a +1-worker hill climb on the measured curve from 1
worker that stops when the next count gains < that tolerance (it needs one window per count it visits).
Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Sequence

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from evaluation.flags import comma_list, finite_float, path_arg, plain_int  # noqa: E402
from predictor.bank import PredictorBank  # noqa: E402
from predictor.curve import KNEE_TOLERANCE  # noqa: E402
from predictor.prior import (CORPUS_PATH, VALIDATION_PATH, by_job, corpus_digest, fit_prior,  # noqa: E402
                             knee_tolerance, load_corpus, measured_curves, measured_knee, noise_level)


def validation_verdict(results: Sequence[dict]) -> bool:
    """Does the learned prior beat first principles out of sample? ``results``: this benchmark's
    summaries (learned and first-principles rows per start). Yes only if,
    averaged over the starts, its throughput MAPE is lower AND its knee hit rate (all cores) no lower."""
    def avg(learned: bool, key: str) -> float:
        v = [r[key] for r in results if r["learned"] is learned]
        return sum(v) / len(v) if v else math.nan

    return (avg(True, "mape") < avg(False, "mape")
            and avg(True, "all_knee_hit") >= avg(False, "all_knee_hit"))


def snap(w: int, grid: list[int]) -> int:
    """The measured worker count a decision of ``w`` lands on (least grid count >= w, else the max)."""
    up = [g for g in grid if g >= w]
    return min(up) if up else max(grid)


def hill_climb(curve_pts: dict[int, float], tol: float) -> tuple[int, int]:
    """(+1 worker hill climb result, windows visited) on the measured grid, starting at 1 worker."""
    grid = sorted(curve_pts)
    i = 0
    while i + 1 < len(grid) and curve_pts[grid[i + 1]] > curve_pts[grid[i]] * (1 + tol):
        i += 1
    return grid[i], min(i + 2, len(grid))


CALM_LOAD = 5.0   # 1-min load average of the 2-core box below which a start window counts as calm


def _mean(v):
    return statistics.mean(v) if v else float("nan")


def noise_floor_mape(points: list[dict]) -> float:
    """MAPE of the single sweeps' own measurements against the truth (best over sweeps): no predictor
    can be expected to do much better than the machine repeats itself."""
    truth = measured_curves(points)
    errs = [abs(p["samples_per_s"] - truth[p["job"]][(p["workers"], p["cores"])]) / truth[p["job"]][(p["workers"], p["cores"])]
            for p in points if truth[p["job"]][(p["workers"], p["cores"])] > 0]
    return statistics.mean(errs) if errs else float("nan")


def evaluate(points: list[dict], start: tuple[int, float], learned: bool, knee_tol: float) -> dict:
    curves = measured_curves(points)
    jobs = by_job(points)
    full = max(p["cores"] for p in points)
    per_job = {}
    for job, pts in jobs.items():
        truth = curves[job]
        starts = [p for p in pts if (p["workers"], p["cores"]) == start]
        if not starts:
            continue
        prior = fit_prior(points, exclude_jobs=[job]) if learned else None
        trials, trials2 = [], []
        for sp in starts:  # one trial per sweep's window at the starting configuration
            bank = PredictorBank(prior=prior)
            bank.observe(job, sp["observation"])
            cur = bank.curve(job)
            trials.append(cur)
            # then the job moves to the count the curve suggests at its cores (a second window there)
            wgrid = sorted({p["workers"] for p in pts if p["cores"] == start[1]})
            nxt = snap(cur.knee_workers(start[1]), wgrid)
            second = [p for p in pts if (p["workers"], p["cores"]) == (nxt, start[1]) and p["pass"] == sp["pass"]]
            if second and nxt != start[0]:
                bank.observe(job, second[0]["observation"])
            trials2.append(bank.curve(job))
        apes = [abs(cur.throughput(w, C) - v) / v for cur in trials for (w, C), v in truth.items() if v > 0]
        by_load = {"calm": [], "loaded": []}  # start windows measured at 1-min load < / >= CALM_LOAD
        for sp, cur in zip(starts, trials):
            by_load["calm" if sp.get("loadavg_1m", 0.0) < CALM_LOAD else "loaded"].extend(
                abs(cur.throughput(w, C) - v) / v for (w, C), v in truth.items() if v > 0)
        apes2 = [abs(cur.throughput(w, C) - v) / v for cur in trials2 for (w, C), v in truth.items() if v > 0]
        cur = trials[0]
        knees = {}
        for C in sorted({C for (_w, C) in truth}):
            meas = {w: v for (w, c), v in truth.items() if c == C}
            wgrid = sorted(meas)
            best = max(meas.values())
            mk = measured_knee(meas, knee_tol)
            mk_strict = measured_knee(meas, KNEE_TOLERANCE)
            pks = [t.knee_workers(C) for t in trials]
            pk = pks[0]
            hc, hc_windows = hill_climb(meas, knee_tol)
            lightning = max(1, math.floor(C) - 1)
            knees[C] = {
                "measured": mk, "predicted": pk, "predicted_all_trials": pks,
                "hit": sum(abs(k - mk) <= 1 or snap(k, wgrid) == mk for k in pks) / len(pks),
                "measured_strict": mk_strict,
                "strict_hit": sum(abs(k - mk_strict) <= 1 or snap(k, wgrid) == mk_strict for k in pks) / len(pks),
                "fixed4_strict_hit": float(abs(4 - mk_strict) <= 1),
                "achieved": statistics.mean(meas[snap(k, wgrid)] / best for k in pks),
                "fixed4_hit": float(abs(4 - mk) <= 1), "fixed4_achieved": meas[snap(4, wgrid)] / best,
                "lightning": lightning, "lightning_hit": float(abs(lightning - mk) <= 1),
                "lightning_achieved": meas[snap(lightning, wgrid)] / best,
                "hillclimb": hc, "hillclimb_hit": float(abs(hc - mk) <= 1), "hillclimb_achieved": meas[hc] / best,
                "hillclimb_windows": hc_windows,
            }
        per_job[job] = {"mape": statistics.mean(apes), "max_ape": max(apes), "trials": len(trials), "knees": knees,
                        "mape_after_second_window": statistics.mean(apes2),
                        "apes_calm": by_load["calm"], "apes_loaded": by_load["loaded"],
                        "curve": {"g": cur.compute_s_per_step, "m": cur.overhead_s_per_step,
                                  "c": cur.cpu_s_per_batch, "b": cur.blocked_s_per_batch,
                                  "kw": cur.correction, "kc": cur.core_correction, "p": cur.sharpness}}

    def vals(key, only_full):
        return [k[key] for j in per_job.values() for C, k in j["knees"].items() if (C == full or not only_full)]

    summary = {
        "start": {"workers": start[0], "cores": start[1]}, "learned": learned, "jobs": len(per_job),
        "mape": statistics.mean(j["mape"] for j in per_job.values()) if per_job else float("nan"),
        "median_job_mape": statistics.median(j["mape"] for j in per_job.values()) if per_job else float("nan"),
        "mape_after_second_window": statistics.mean(j["mape_after_second_window"] for j in per_job.values())
        if per_job else float("nan"),
        "mape_calm_starts": _mean([a for j in per_job.values() for a in j["apes_calm"]]),
        "calm_start_trials": sum(len(j["apes_calm"]) > 0 for j in per_job.values()),
        "mape_loaded_starts": _mean([a for j in per_job.values() for a in j["apes_loaded"]]),
        "full_cores": full, "knee_tolerance": knee_tol,
    }
    for scope, only_full in (("full", True), ("all", False)):
        for name in ("", "fixed4_", "lightning_", "hillclimb_", "strict_", "fixed4_strict_"):
            v = vals(f"{name}hit", only_full)
            summary[f"{scope}_{name}knee_hit"] = statistics.mean(v) if v else float("nan")
            if "strict" not in name:
                a = vals(f"{name}achieved", only_full)
                summary[f"{scope}_{name}achieved"] = statistics.mean(a) if a else float("nan")
        h = vals("hillclimb_windows", only_full)
        summary[f"{scope}_hillclimb_windows"] = statistics.mean(h) if h else float("nan")
    return {"summary": summary, "per_job": per_job}


def _start(text: str) -> tuple[int, float]:
    """One ``--starts`` item (``evaluation.flags.comma_list``): "4:0.5" -> (4 workers, 0.5 cores)."""
    try:
        workers, cores = text.split(":")
        workers, cores = plain_int(workers), finite_float(cores)
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"not WORKERS:CORES: {text!r}") from None
    if workers < 1 or cores <= 0:
        raise argparse.ArgumentTypeError(f"workers at least 1 and cores above 0 expected, got {text!r}")
    return workers, cores


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m evaluation.predictor_accuracy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", type=path_arg, default=str(CORPUS_PATH), metavar="PATH",
                    help="measured curves (default predictor/data/corpus.jsonl)")
    ap.add_argument("--starts", default="2:2,1:1,4:0.5",
                    help="workers:cores of the single starting window, comma-separated (default 2:2,1:1,4:0.5)")
    ap.add_argument("--json", type=path_arg, default="predictor-accuracy.json", metavar="PATH",
                    help="write the results here (default predictor-accuracy.json)")
    ap.add_argument("--validation", default=str(VALIDATION_PATH),
                    help="write the verdict (learned prior beats first principles?) here; the default "
                         "prior is the learned one only if this file says so for the same corpus ('' = skip; "
                         "default predictor/data/prior_validation.json)")
    args = ap.parse_args(argv)
    try:   # (a missing or malformed corpus, or a --starts without ':', was a traceback)
        starts = comma_list(_start)(args.starts)   # (read here, not by argparse: the JSON records the flag as given)
    except argparse.ArgumentTypeError as e:
        ap.error(f"--starts takes WORKERS:CORES pairs separated by commas (e.g. 2:2,1:1): {e}")
    try:
        header, points = load_corpus(args.corpus)
    except OSError as e:
        ap.error(f"--corpus {args.corpus}: cannot read: {e.strerror or e}")
    except (ValueError, KeyError, TypeError) as e:
        ap.error(f"--corpus {args.corpus}: not a corpus (JSON lines of predictor_corpus): {e}")
    if not points:
        ap.error(f"--corpus {args.corpus}: no measurements in it")
    noise = noise_level(points)
    knee_tol = knee_tolerance(points)
    results = []
    for start in starts:
        for learned in (True, False):
            results.append(evaluate(points, start, learned, knee_tol))
    print(f"corpus: {args.corpus} ({len(points)} measurements, {len(by_job(points))} jobs, "
          f"{len({p.get('pass', 1) for p in points})} sweeps); {header.get('machine', '?')}")
    floor = noise_floor_mape(points)
    print("measurement noise (median spread between sweeps of a point): "
          + (f"{noise:.1%}" if noise is not None else "unknown (one sweep)")
          + f"; a single sweep's own measurements vs the truth: MAPE {floor:.1%} (the noise floor)")
    print(f"knee hit = predicted knee within +-1 of the measured knee (least count within {knee_tol:.1%} "
          "of the best measured, the tolerance being max(3%, noise)); truth = best over sweeps (others' "
          "load only takes throughput away); "
          "achieved = measured samples/s at the chosen count / best measured at those cores")
    cols = ("start", "model", "MAPE", f"MAPE calm/loaded start (load<{CALM_LOAD:g})", "MAPE +1 window", "knee hit@full", "knee hit@all", "strict 3% hit@all",
            "achieved@all",
            "fixed4 hit", "lightning hit", "hillclimb hit (windows)")
    print(" | ".join(cols))
    for r in results:
        s = r["summary"]
        print(" | ".join([
            f"{s['start']['workers']}w/{s['start']['cores']:g}c", "learned" if s["learned"] else "first-principles",
            f"{s['mape']:.1%}", f"{s['mape_calm_starts']:.1%}/{s['mape_loaded_starts']:.1%}",
            f"{s['mape_after_second_window']:.1%}", f"{s['full_knee_hit']:.0%}", f"{s['all_knee_hit']:.0%}",
            f"{s['all_strict_knee_hit']:.0%} (fixed4 {s['all_fixed4_strict_knee_hit']:.0%})", f"{s['all_achieved']:.1%}",
            f"{s['all_fixed4_knee_hit']:.0%} ({s['all_fixed4_achieved']:.1%})",
            f"{s['all_lightning_knee_hit']:.0%} ({s['all_lightning_achieved']:.1%})",
            f"{s['all_hillclimb_knee_hit']:.0%} ({s['all_hillclimb_windows']:.1f})"]))
    head = results[0]
    print(f"\nper job (start {args.starts.split(',')[0]}, learned): MAPE, knee measured (at 3%)/predicted by cores")
    for job, j in head["per_job"].items():
        ks = " ".join(f"{C:g}c:{k['measured']}({k['measured_strict']})/{k['predicted']}{'' if k['hit'] else '!'}"
                      for C, k in j["knees"].items())
        print(f"  {job:14s} MAPE {j['mape']:6.1%}  {ks}")
    with open(args.json, "w") as f:
        json.dump({"corpus": args.corpus, "corpus_header": header, "knee_tolerance": knee_tol, "noise": noise,
                   "noise_floor_mape": floor,
                   "results": results}, f, indent=1, default=str)
    print(f"\nwrote {args.json}")
    summaries = [r["summary"] for r in results]
    verdict = validation_verdict(summaries)
    print(f"verdict: the learned prior {'beats' if verdict else 'does NOT beat'} first principles out of sample "
          f"(mean MAPE and knee hit over the starts); the default prior is "
          f"{'the learned one' if verdict else 'first principles'}")
    if args.validation:
        with open(args.validation, "w") as f:
            json.dump({"corpus_sha256": corpus_digest(args.corpus), "learned_beats_first_principles": verdict,
                       "rule": "mean MAPE over starts lower and mean knee hit (all cores) no lower",
                       "starts": args.starts,
                       "learned": {k: _mean([s[k] for s in summaries if s["learned"]]) for k in ("mape", "all_knee_hit")},
                       "first_principles": {k: _mean([s[k] for s in summaries if not s["learned"]])
                                            for k in ("mape", "all_knee_hit")}}, f, indent=1)
            f.write("\n")
        print(f"wrote {args.validation}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
