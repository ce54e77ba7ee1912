"""The learned part of the predictor: a prior fitted from measured curves, and the per-job correction.

Model (seconds per batch seen by the training loop, soft maximum of the three limits):

    T(w, C)^p = (g + m)^p + theta_w * ((c + b) / w)^p + theta_c * (c / C)^p

g, c, b come from the job's own windows (``predictor.bank.pooled_costs``); m is the training process's
own per-step cost of taking a batch (measured as the data wait of a window whose workers were NOT
saturated; else the prior's estimate); theta_w = correction^-p and theta_c = core_correction^-p say
how far real workers and cores fall short of first principles; p (sharpness) bends the corners.

For a fixed p the model is linear in theta_c >= 0 (theta_w is 1 in the prior: a worker's rate is
1 / (c + b) by construction): the prior is fitted with scikit-learn's non-negative
``LinearRegression`` on every (start window, measured point) pair of the shipped corpus, for each p
on a grid, keeping the p with the least throughput error plus knee miss rate (``fit_prior``). The prior is refitted from
``predictor/data/corpus.jsonl`` at load time (about a second; nothing pickled).

Per job, each of the job's own loader-bound windows is solved exactly for the correction of the term
that binds there, and the log-corrections are averaged with the prior's (a ridge in log space; closed
form, microseconds, so 64 jobs per tick stay cheap). At load time the
prior is refitted with the exact closed-form solution of the same non-negative least squares (tested
equal to scikit-learn's), so a training process never pays for importing scikit-learn.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Sequence

from predictor.observation import Observation

CORPUS_PATH = Path(__file__).resolve().parent / "data" / "corpus.jsonl"
SATURATED_UTIL = 0.85       # workers busy at least this fraction of the window: the loader was the limit
LOADER_BOUND_WAIT = 0.05    # ... and the training loop waited at least this fraction of its step for data
SHARPNESS_GRID = (2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 20.0)
K_MIN, K_MAX = 0.05, 20.0   # bounds on learned corrections


def worker_utilization(o: Observation) -> float:
    """Fraction of the window the workers spent on batches (0 with no workers or no timing)."""
    if o.workers < 1 or o.batch_size <= 0:
        return 0.0
    return (o.samples_per_s / o.batch_size) * o.wall_s_per_batch / o.workers


def saturated(o: Observation) -> bool:
    return worker_utilization(o) >= SATURATED_UTIL


def loader_bound(o: Observation) -> bool:
    """The window's throughput was set by the loader: workers saturated AND the loop waited for data.
    (Saturated workers with no wait only bound the loader's speed from below: not fitted.)"""
    return saturated(o) and o.data_wait_frac >= LOADER_BOUND_WAIT


def spare_loader(o: Observation) -> bool:
    """The loader had capacity to spare in this window: workers not saturated and the cores' CPU
    budget not used up (c / cores well under the step). Its data wait is then not the loader's."""
    return (o.workers >= 1 and o.steps > 0 and not saturated(o)
            and o.cpu_s_per_batch / o.cores < SATURATED_UTIL * o.step_s)


def measured_overhead(windows: Sequence[Observation]) -> float | None:
    """m from windows whose loader had capacity to spare (their data wait is the training process's
    own per-step cost of taking a ready batch); None when no window had spare loader capacity."""
    num = den = 0.0
    for o in windows:
        if spare_loader(o):
            num += o.steps * o.data_wait_s_per_step
            den += o.steps
    return num / den if den > 0 else None


@dataclass(frozen=True)
class Prior:
    sharpness: float = 6.0
    theta_w: float = 1.0
    theta_c: float = 1.0
    overhead_frac_of_c: float = 0.0   # m = this * c when no window could measure m
    strength: float = 1.0             # weight of the prior, in loader-bound windows of the job's own
    fitted_on: tuple = ()             # job names of the corpus it was fitted on
    fit_error: float | None = None    # in-sample mean absolute percentage error of throughput

    def overhead(self, c: float, windows: Sequence[Observation]) -> float:
        m = measured_overhead(windows)
        return m if m is not None else self.overhead_frac_of_c * c

    def job_corrections(self, g: float, c: float, b: float, m: float,
                        windows: Iterable[Observation]) -> tuple[float, float]:
        """(correction, core_correction) for one job: each loader-bound window is solved exactly for
        the correction of its binding loader term (workers or cores, whichever first principles say
        binds), and the log-corrections are averaged with the prior's counted as ``strength`` windows
        (a ridge in log space: one window moves the estimate, several windows own it)."""
        p = self.sharpness
        kw0 = self.theta_w ** (-1.0 / p) if self.theta_w > 0 else K_MAX
        kc0 = self.theta_c ** (-1.0 / p) if self.theta_c > 0 else K_MAX
        lam = self.strength
        sw, nw, sc, nc = lam * math.log(kw0), lam, lam * math.log(kc0), lam
        base = (g + m) ** p
        for o in windows:
            if o.workers < 1 or not loader_bound(o):
                continue
            t = o.step_s
            xw, xc = (c + b) / o.workers, (c / o.cores if c > 0 else 0.0)
            if xc / kc0 >= xw / kw0 and xc > 0:      # cores bind: solve for core_correction
                rest = t ** p - base - (xw / kw0) ** p
                if rest > 0:
                    sc += math.log(min(K_MAX, max(K_MIN, xc / rest ** (1.0 / p))))
                    nc += 1
            elif xw > 0:                              # workers bind: solve for correction
                rest = t ** p - base - (xc / kc0) ** p
                if rest > 0:
                    sw += math.log(min(K_MAX, max(K_MIN, xw / rest ** (1.0 / p))))
                    nw += 1
        return math.exp(sw / nw), math.exp(sc / nc)

    def correct(self, g: float, c: float, b: float, windows: Sequence[Observation]) -> dict:
        """Curve parameters for a job: correction, core_correction, sharpness, overhead_s_per_step."""
        m = self.overhead(c, windows)
        kw, kc = self.job_corrections(g, c, b, m, windows)
        return {"correction": kw, "core_correction": kc, "sharpness": self.sharpness, "overhead_s_per_step": m}


# -- corpus ---------------------------------------------------------------------------------------


def load_corpus(path: str | Path = CORPUS_PATH) -> tuple[dict, list[dict]]:
    """(header, points). Each point: job, workers, cores, samples_per_s, observation (Observation)."""
    header, points = {}, []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            rec = json.loads(line)
            if rec.get("kind") == "header":
                header = rec
                continue
            rec.setdefault("pass", 1)
            try:
                rec["observation"] = Observation.from_dict(rec["observation"])
            except (KeyError, ValueError) as e:
                raise ValueError(f"{path}:{n}: bad corpus record: {e}") from None
            points.append(rec)
    return header, points


def by_job(points: Sequence[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for p in points:
        out.setdefault(p["job"], []).append(p)
    return out


def measured_curves(points: Sequence[dict]) -> dict[str, dict[tuple[int, float], float]]:
    """job -> (workers, cores) -> measured samples/s: the BEST over the sweeps of that point.

    On a shared machine other processes only ever take CPU away, so the least-disturbed sweep (the
    highest throughput) is the closest to the job's own curve; the spread is reported as noise."""
    out: dict[str, dict[tuple[int, float], float]] = {}
    for p in points:
        cur = out.setdefault(p["job"], {})
        k = (p["workers"], p["cores"])
        cur[k] = max(cur.get(k, 0.0), p["samples_per_s"])
    return out


def noise_level(points: Sequence[dict]) -> float | None:
    """Median relative spread (max - min) / max between sweeps of the same point; None with one sweep."""
    raw: dict[tuple, list[float]] = {}
    for p in points:
        raw.setdefault((p["job"], p["workers"], p["cores"]), []).append(p["samples_per_s"])
    spreads = sorted((max(v) - min(v)) / max(v) for v in raw.values() if len(v) > 1 and max(v) > 0)
    return spreads[len(spreads) // 2] if spreads else None


def knee_tolerance(points: Sequence[dict]) -> float:
    """Tolerance for a MEASURED knee: "within a few percent", but never finer than the noise."""
    from predictor.curve import KNEE_TOLERANCE

    return max(KNEE_TOLERANCE, noise_level(points) or 0.0)


def measured_knee(curve_pts: dict[int, float], tol: float) -> int:
    """Least measured worker count within ``tol`` of the best measured (at one cores level)."""
    best = max(curve_pts.values())
    return min(w for w, v in curve_pts.items() if v >= (1 - tol) * best)


def _nnls_1d(X, y) -> float:
    """Non-negative least squares with one feature and no intercept: max(0, sum(xy) / sum(xx)).
    The exact solution of what ``LinearRegression(positive=True, fit_intercept=False)`` fits."""
    den = float((X[:, 0] * X[:, 0]).sum())
    return max(0.0, float((X[:, 0] * y).sum()) / den) if den > 0 else 0.0


def fit_prior(points: Sequence[dict], exclude_jobs: Iterable[str] = (), engine: str = "sklearn") -> Prior:
    """Fit the prior on every (start window, measured point) pair within each job of the corpus,
    minus ``exclude_jobs``. For each sharpness p on the grid, theta_c comes from scikit-learn's
    non-negative least squares; the p kept is the one with the least (throughput MAPE + knee miss
    rate) on those jobs, a knee counting as hit within +-1 worker of the measured one.

    ``engine``: "sklearn" or "closed-form" (the exact one-feature NNLS solution, same result, tested;
    used at load time so training processes with ``num_workers="auto"`` never import scikit-learn)."""
    import numpy as np

    if engine not in ("sklearn", "closed-form"):
        raise ValueError(f"unknown engine {engine!r}; use 'sklearn' or 'closed-form'")

    from predictor.curve import ThroughputCurve

    excl = set(exclude_jobs)
    jobs = {j: pts for j, pts in by_job(points).items() if j not in excl}
    if not jobs:
        return Prior()
    truth = measured_curves([p for pts in jobs.values() for p in pts])
    tol = knee_tolerance(points)
    knees = {(j, C): measured_knee({w: v for (w, c), v in cur.items() if c == C}, tol)
             for j, cur in truth.items() for C in {c for (_w, c) in cur}}
    # m prior: where m was measurable, m relative to c
    ratios = []
    for pts in jobs.values():
        for p in pts:
            o = p["observation"]
            m = measured_overhead([o])
            if m is not None and o.cpu_s_per_batch > 0:
                ratios.append(m / o.cpu_s_per_batch)
    m_frac = float(np.median(ratios)) if ratios else 0.0
    starts = []
    for j, pts in jobs.items():
        for s in pts:
            so = s["observation"]
            if so.cpu_s_per_batch <= 0:
                continue
            m = measured_overhead([so])
            starts.append((j, so.compute_s_per_step, so.cpu_s_per_batch, so.blocked_s_per_batch,
                           m if m is not None else m_frac * so.cpu_s_per_batch, so.batch_size))

    best: Prior | None = None
    best_score = math.inf
    for sharp in SHARPNESS_GRID:
        # theta_w stays 1: one worker's rate is 1 / (c + b) by construction (measured in the worker);
        # what the corpus corrects is how many cores the loader really gets (theta_c).
        X, y, meta = [], [], []
        for (j, g, c, b, m, bs) in starts:
            for (w, C), meas in truth[j].items():
                if meas <= 0:
                    continue
                T = bs / meas
                X.append([(c / C / T) ** sharp])
                y.append(1.0 - min(1.0, (g + m) / T) ** sharp - min(1.0, (c + b) / w / T) ** sharp)
                meta.append((g + m, c, b, w, C, bs, meas))
        X, y = np.asarray(X), np.asarray(y)
        ok = np.all(np.isfinite(X), axis=1) & np.isfinite(y)
        if not ok.any():
            continue
        if engine == "sklearn":
            from sklearn.linear_model import LinearRegression

            coef = float(LinearRegression(positive=True, fit_intercept=False).fit(X[ok], y[ok]).coef_[0])
        else:
            coef = _nnls_1d(X[ok], y[ok])
        tw, tc = 1.0, max(coef, K_MAX ** -sharp)
        gm, c, b, w, C, bs, meas = (np.asarray(col, dtype=float) for col in zip(*meta))
        T = (gm ** sharp + tw * ((c + b) / w) ** sharp + tc * (c / C) ** sharp) ** (1.0 / sharp)
        mape = float(np.mean(np.abs(bs / T - meas) / meas))
        kc = tc ** (-1.0 / sharp)
        hits = total = 0
        for (j, g, c1, b1, m1, bs1) in starts:
            cur = ThroughputCurve(job=j, batch_size=bs1, compute_s_per_step=g, cpu_s_per_batch=c1,
                                  blocked_s_per_batch=b1, core_correction=kc, sharpness=sharp,
                                  overhead_s_per_step=m1)
            for (jj, C), mk in knees.items():
                if jj == j:
                    hits += abs(cur.knee_workers(C) - mk) <= 1
                    total += 1
        score = mape + (1.0 - hits / total if total else 0.0)
        if score < best_score:
            best_score = score
            best = Prior(sharpness=sharp, theta_w=tw, theta_c=tc, overhead_frac_of_c=m_frac,
                         fitted_on=tuple(sorted(jobs)), fit_error=mape)
    return best or Prior()


@lru_cache(maxsize=1)
def default_prior() -> Prior:
    """The prior refitted from the shipped corpus (once per process, a fraction of a second);
    first principles if the corpus is absent."""
    if not CORPUS_PATH.exists():
        return Prior()
    _header, points = load_corpus(CORPUS_PATH)
    return fit_prior(points, engine="closed-form")
