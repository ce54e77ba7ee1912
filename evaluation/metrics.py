"""Metric formulas of ``adloader bench`` and ``adloader simulate``. Pure functions on plain data.

Definitions (one GPU per job unless said otherwise):

- normalised throughput of a job = its samples/s over its throughput with data always ready
  (``batch_size / step_s``, the ceiling). Aggregate = the GPU-weighted sum over jobs.
- GPU idle fraction (emulated GPUs: the data-wait fraction) = total time jobs spent blocked on data
  over total time they were alive, i.e. time-weighted over jobs and over time.
- makespan = last finish - first arrival; JCT = finish - arrival of each job; GPU-weighted mean JCT =
  the mean with each job counted once per GPU (``gpu_weighted_mean``).
- Jain's index = (sum x)^2 / (n * sum x^2): 1 when all equal, 1/n when one job has everything.
- fairness vs even = min over jobs of (job's normalised throughput / its throughput under an even split).
- settling time after an event = time from the event until a series stops moving (see ``settle_time``).

A job's progress is a list of records ``{"t": monotonic s, "samples": int, "wait_s": float,
"compute_s": float, "workers": int}`` with cumulative counters; ``counter_at`` interpolates them.
"""
from __future__ import annotations

import math
from typing import Iterable, Mapping, Sequence


def jain_index(values: Iterable[float]) -> float:
    """Jain's fairness index of non-negative values; 1.0 for an empty or all-zero set."""
    xs = [max(0.0, float(v)) for v in values]
    sq = sum(x * x for x in xs)
    if not xs or sq == 0:
        return 1.0
    return sum(xs) ** 2 / (len(xs) * sq)


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics (numpy's default).
    NaN for an empty set."""
    xs = sorted(float(v) for v in values)
    if not xs:
        return math.nan
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * min(100.0, max(0.0, q)) / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def mean(values: Iterable[float]) -> float:
    xs = [float(v) for v in values]
    return sum(xs) / len(xs) if xs else math.nan


def median(values: Iterable[float]) -> float:
    return percentile(values, 50.0)


def makespan(arrivals_s: Sequence[float], finishes_s: Sequence[float]) -> float:
    """Last finish minus first arrival (seconds); NaN without jobs."""
    if not arrivals_s or not finishes_s:
        return math.nan
    return max(finishes_s) - min(arrivals_s)


def completion_times(arrivals_s: Mapping[str, float], finishes_s: Mapping[str, float]) -> dict[str, float]:
    """JCT per job that finished."""
    return {j: finishes_s[j] - arrivals_s[j] for j in finishes_s if j in arrivals_s}


def gpu_weighted_mean(values: Mapping[str, float], gpus: Mapping[str, int]) -> float:
    """Mean of per-job ``values`` with each job counted once per GPU (``gpus``, at least 1): for
    completion times, how long the node's GPUs waited on average for their job to finish, the way
    the aggregate throughput counts a job once per GPU. NaN without jobs."""
    w = {j: max(1, int(gpus.get(j) or 1)) for j in values}
    total = sum(w.values())
    return sum(w[j] * float(v) for j, v in values.items()) / total if total else math.nan


def normalised(samples_per_s: float, ceiling_samples_per_s: float) -> float:
    return samples_per_s / ceiling_samples_per_s if ceiling_samples_per_s > 0 else 0.0


def time_weighted_mean(times_s: Sequence[float], values: Sequence[float], t0: float, t1: float) -> float:
    """Mean over [t0, t1] of a step function that takes ``values[i]`` from ``times_s[i]`` until the
    next time (the first value also covers any time before ``times_s[0]``). NaN if t1 <= t0."""
    if t1 <= t0 or not times_s:
        return math.nan
    total = 0.0
    for i, v in enumerate(values):
        a = t0 if i == 0 else max(t0, times_s[i])
        b = t1 if i + 1 == len(values) else min(t1, times_s[i + 1])
        if b > a:
            total += v * (b - a)
    return total / (t1 - t0)


def gpu_idle_fraction(wait_s: Sequence[float], alive_s: Sequence[float]) -> float:
    """Time-weighted idle fraction over jobs: sum of data-wait time over sum of alive time."""
    alive = sum(alive_s)
    return sum(wait_s) / alive if alive > 0 else math.nan


def counter_at(records: Sequence[Mapping], key: str, t: float) -> float:
    """Linear interpolation of a cumulative counter at time ``t`` (clamped to the recorded range)."""
    if not records:
        return 0.0
    if t <= records[0]["t"]:
        return float(records[0][key])
    for a, b in zip(records, records[1:]):
        if a["t"] <= t <= b["t"]:
            span = b["t"] - a["t"]
            f = (t - a["t"]) / span if span > 0 else 1.0
            return float(a[key]) + f * (float(b[key]) - float(a[key]))
    return float(records[-1][key])


def rate_between(records: Sequence[Mapping], key: str, t0: float, t1: float) -> float:
    """Mean rate of a cumulative counter over [t0, t1]."""
    if t1 <= t0:
        return 0.0
    return max(0.0, counter_at(records, key, t1) - counter_at(records, key, t0)) / (t1 - t0)


def series(records: Sequence[Mapping], key: str, t0: float, t1: float, bin_s: float = 1.0) -> tuple[list, list]:
    """Rate of a counter per bin of ``bin_s`` over [t0, t1]: (bin mid-times, rates)."""
    ts, vs = [], []
    t = t0
    while t + bin_s <= t1 + 1e-9:
        ts.append(t + bin_s / 2)
        vs.append(rate_between(records, key, t, t + bin_s))
        t += bin_s
    return ts, vs


def settle_time(times_s: Sequence[float], values: Sequence[float], event_s: float, end_s: float,
                rel_tol: float = 0.10) -> float:
    """Seconds from ``event_s`` until the series enters, and stays in, a band of ``rel_tol`` around its
    final level (the mean of the last third of [event_s, end_s]). 0 if it never leaves the band; NaN
    when there are no samples after the event."""
    pts = [(t, v) for t, v in zip(times_s, values) if event_s <= t <= end_s]
    if not pts:
        return math.nan
    tail = [v for t, v in pts if t >= end_s - (end_s - event_s) / 3] or [pts[-1][1]]
    level = sum(tail) / len(tail)
    band = max(abs(level) * rel_tol, 1e-9)
    last_out = None
    for t, v in pts:
        if abs(v - level) > band:
            last_out = t
    if last_out is None:
        return 0.0
    later = [t for t, _ in pts if t > last_out]
    return (later[0] if later else end_s) - event_s


def last_change_after(times_s: Sequence[float], values: Sequence[float], event_s: float, end_s: float) -> float:
    """Seconds from ``event_s`` to the last change of a piecewise-constant series (e.g. a job's worker
    target) within (event_s, end_s]; 0 when it does not change."""
    last = None
    prev = None
    for t, v in zip(times_s, values):
        if t <= event_s:
            prev = v
            continue
        if t > end_s:
            break
        if prev is not None and v != prev:
            last = t
        prev = v
    return 0.0 if last is None else last - event_s


def fairness_vs_even(norm_by_job: Mapping[str, float], even_norm_by_job: Mapping[str, float]) -> float:
    """Min over jobs of normalised throughput / the same job's under the even split; NaN if no overlap."""
    ratios = [norm_by_job[j] / even_norm_by_job[j] for j in norm_by_job
              if j in even_norm_by_job and even_norm_by_job[j] > 0]
    return min(ratios) if ratios else math.nan
