"""The learned part of the predictor: a prior fitted from measured curves, and the per-job correction.

Model (seconds per batch seen by the training loop, soft maximum of the three limits):

    T(w, C)^p = (g + m)^p + theta_w * ((c + b) / w)^p + theta_c * (c / C)^p

g, c, b come from the job's own windows (``predictor.bank.pooled_costs``); m is the training process's
own per-step cost of taking a batch (measured as the data wait of a window whose workers were NOT
saturated; else the prior's estimate); theta_w = correction^-p and theta_c = core_correction^-p say
how far real workers and cores fall short of first principles; p (sharpness) bends the corners.

For a fixed p the model is linear in (theta_w, theta_c) with theta >= 0: the prior is fitted with
scikit-learn's non-negative ``LinearRegression`` on every (start window, measured point) pair of the
shipped corpus, for each p on a grid, keeping the p with the least error. The prior is refitted from
``predictor/data/corpus.jsonl`` at load time (about a second; nothing pickled).

Per job, the same linear model is refitted on the job's own loader-bound windows, as a ridge pulled toward
the prior (closed form, two unknowns: microseconds, so 64 jobs per tick stay cheap).
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


def measured_overhead(windows: Sequence[Observation]) -> float | None:
    """m from windows whose workers had spare capacity (their data wait is the training process's own
    per-step cost of taking a ready batch); None when every window was loader-saturated."""
    num = den = 0.0
    for o in windows:
        if o.workers >= 1 and o.steps > 0 and not saturated(o):
            num += o.steps * o.data_wait_s_per_step
            den += o.steps
    return num / den if den > 0 else None


@dataclass(frozen=True)
class Prior:
    sharpness: float = 6.0
    theta_w: float = 1.0
    theta_c: float = 1.0
    overhead_frac_of_c: float = 0.0   # m = this * c when no window could measure m
    strength: float = 1.0             # ridge weight of the prior, in units of one saturated window
    fitted_on: tuple = ()             # job names of the corpus it was fitted on
    fit_error: float | None = None    # in-sample mean absolute percentage error of throughput

    def overhead(self, c: float, windows: Sequence[Observation]) -> float:
        m = measured_overhead(windows)
        return m if m is not None else self.overhead_frac_of_c * c

    def job_thetas(self, g: float, c: float, b: float, m: float, windows: Iterable[Observation]) -> tuple[float, float]:
        """Ridge fit of (theta_w, theta_c) on the job's loader-bound windows, pulled toward the prior."""
        p = self.sharpness
        lam = self.strength
        a11, a12, a22 = lam, 0.0, lam
        r1, r2 = lam * self.theta_w, lam * self.theta_c
        base = g + m
        for o in windows:
            if o.workers < 1 or not loader_bound(o) or o.steps <= 0:
                continue
            t = o.step_s
            if t <= 0:
                continue
            x1 = ((c + b) / o.workers / t) ** p
            x2 = (c / o.cores / t) ** p if c > 0 else 0.0
            y = 1.0 - min(1.0, base / t) ** p
            a11 += x1 * x1
            a12 += x1 * x2
            a22 += x2 * x2
            r1 += x1 * y
            r2 += x2 * y
        det = a11 * a22 - a12 * a12
        if det <= 0:
            return self.theta_w, self.theta_c
        tw = (r1 * a22 - r2 * a12) / det
        tc = (a11 * r2 - a12 * r1) / det
        if tw < 0:  # non-negative: refit the other alone
            tw, tc = 0.0, max(0.0, r2 / a22)
        elif tc < 0:
            tw, tc = max(0.0, r1 / a11), 0.0
        return tw, tc

    def correct(self, g: float, c: float, b: float, windows: Sequence[Observation]) -> dict:
        """Curve parameters for a job: correction, core_correction, sharpness, overhead_s_per_step."""
        m = self.overhead(c, windows)
        tw, tc = self.job_thetas(g, c, b, m, windows)
        p = self.sharpness
        k = lambda th: K_MAX if th <= K_MAX ** -p else max(K_MIN, min(K_MAX, th ** (-1.0 / p)))
        return {"correction": k(tw), "core_correction": k(tc), "sharpness": p, "overhead_s_per_step": m}


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


def _start_costs(o: Observation) -> tuple[float, float, float]:
    return o.compute_s_per_step, o.cpu_s_per_batch, o.blocked_s_per_batch


def fit_prior(points: Sequence[dict], exclude_jobs: Iterable[str] = ()) -> Prior:
    """Fit the prior on every (start, target) pair within each job of the corpus (minus exclusions)."""
    import numpy as np
    from sklearn.linear_model import LinearRegression

    excl = set(exclude_jobs)
    jobs = {j: pts for j, pts in by_job(points).items() if j not in excl}
    if not jobs:
        return Prior()
    # m prior: where m was measurable, m relative to c
    ratios = []
    for pts in jobs.values():
        for p in pts:
            o = p["observation"]
            m = measured_overhead([o])
            if m is not None and o.cpu_s_per_batch > 0:
                ratios.append(m / o.cpu_s_per_batch)
    m_frac = float(np.median(ratios)) if ratios else 0.0

    best: Prior | None = None
    for sharp in SHARPNESS_GRID:
        X, y, meta = [], [], []
        for pts in jobs.values():
            for s in pts:
                so = s["observation"]
                g, c, b = _start_costs(so)
                m = measured_overhead([so])
                m = m if m is not None else m_frac * c
                for t in pts:
                    to = t["observation"]
                    if t["samples_per_s"] <= 0:
                        continue
                    T = to.batch_size / t["samples_per_s"]
                    X.append([((c + b) / t["workers"] / T) ** sharp, (c / t["cores"] / T) ** sharp])
                    y.append(1.0 - min(1.0, (g + m) / T) ** sharp)
                    meta.append((g + m, c, b, t["workers"], t["cores"], to.batch_size, t["samples_per_s"]))
        X, y = np.asarray(X), np.asarray(y)
        ok = np.all(np.isfinite(X), axis=1) & np.isfinite(y)
        reg = LinearRegression(positive=True, fit_intercept=False).fit(X[ok], y[ok])
        tw, tc = (float(v) for v in reg.coef_)
        errs = []
        for (gm, c, b, w, C, bs, meas) in meta:
            T = (gm ** sharp + tw * ((c + b) / w) ** sharp + tc * (c / C) ** sharp) ** (1.0 / sharp)
            errs.append(abs(bs / T - meas) / meas)
        err = float(np.mean(errs))
        if best is None or err < best.fit_error:
            best = Prior(sharpness=sharp, theta_w=tw, theta_c=tc, overhead_frac_of_c=m_frac,
                         fitted_on=tuple(sorted(jobs)), fit_error=err)
    return best


@lru_cache(maxsize=1)
def default_prior() -> Prior:
    """The prior refitted from the shipped corpus (once per process); first principles if absent."""
    if not CORPUS_PATH.exists():
        return Prior()
    _header, points = load_corpus(CORPUS_PATH)
    return fit_prior(points)
