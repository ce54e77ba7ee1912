"""The predictor's input record: one observation window of one job.

A window is what a job did over a few seconds at one configuration (worker count, CPU cores its
loader may use). The loader (``adloader.DataLoader.stats()``) keeps monotonic totals; whoever holds two
successive totals turns them into a window with :meth:`Observation.from_window` (the autotuner and
``adloader profile``), or takes the differences and per-batch figures the same way (``counter_deltas``,
``blocked_s``: the agent's collector, which then smooths them per rank). One rule for all of them: a
counter that went down counts as 0 (no negative delta), a counter missing from either total counts
as 0, and blocked time is the loader's own counter when the client reports it, else wall - cpu - runq
over the window, at least 0.

Units are in the names. Per-step figures are means over the window; per-batch figures are means over
the batches the loader's workers finished in the window (measured inside the worker).

Versioned: ``OBSERVATION_VERSION``; ``from_dict`` ignores unknown keys and refuses a record of a newer
major version or one that is missing a field, naming the field.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

OBSERVATION_VERSION = 1
# the loader's monotonic totals a window is made of (``adloader.DataLoader.stats()``)
WINDOW_COUNTERS = ("steps", "samples", "batches", "data_wait_s", "compute_s", "worker_cpu_s", "worker_wall_s",
                   "worker_runq_s", "worker_blocked_s", "uptime_s")


def _count(v) -> float | None:
    if v is None or isinstance(v, bool):
        return None
    try:
        v = float(v)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def counter_deltas(prev, cur, keys=WINDOW_COUNTERS) -> dict:
    """Each counter's increase from ``prev`` to ``cur`` (mappings of totals): a counter that went down
    counts 0, one missing (or not a number) in either counts 0."""
    out = {}
    for k in keys:
        a, b = _count(prev.get(k)), _count(cur.get(k))
        out[k] = max(0.0, b - a) if a is not None and b is not None else 0.0
    return out


def blocked_s(d, reported: bool) -> float:
    """Blocked (mostly IO) seconds in a window of ``counter_deltas`` ``d``: the loader's own counter when
    the client reports it (it clamps wall - cpu - runq at 0 batch by batch), else wall - cpu - runq over
    the window, at least 0."""
    if reported:
        return d["worker_blocked_s"]
    return max(0.0, d["worker_wall_s"] - d["worker_cpu_s"] - d["worker_runq_s"])


def as_batch_size(v: float) -> int | float:
    """A batch size as an ``Observation`` holds it: an int where it is whole (a fixed batch size: records
    and logs as they always were), else the float (a window's mean of a batch sampler's batches; truncated
    to an int, 32.5 read 32)."""
    v = float(v)
    return int(v) if v.is_integer() else v


_OPTIONAL = ("worker_memory_bytes",)   # fields added after version 1's first records

# What no window of a real job holds: the predictor raises its figures to powers (the prior's soft
# minimum, up to p = 20) and sums them weighted by steps, and a finite figure near a float's range
# (a lying client's 1e300 s step) overflowed there (OverflowError, or an inf curve). A window is at most
# MAX_SECONDS long and so is each of its per-step and per-batch times (~11.6 days); every other figure
# (steps, workers, samples/s, cores, bytes) is at most MAX_FIGURE (2**53: float counts stop counting by
# one there), and cores at least MIN_CORES.
MAX_SECONDS = 1e6
MAX_FIGURE = float(2 ** 53)
MIN_CORES = 1e-6
_SECONDS = ("compute_s_per_step", "data_wait_s_per_step", "cpu_s_per_batch", "wall_s_per_batch", "runq_s_per_batch",
            "blocked_s_per_batch", "duration_s")


class BadObservation(ValueError):
    """An observation record that cannot be used; the message names the field and the problem."""


@dataclass(frozen=True)
class Observation:
    workers: int                 # loader worker processes during the window (>= 0; 0 = in-process)
    cores: float                 # CPU cores the loader may use (quota/affinity/share), > 0
    batch_size: float            # samples per batch, i.e. per step (>= 1): an int where whole (a fixed size, as
                                 # records have always held it; ``as_batch_size``), a window's mean where a
                                 # batch sampler's batches differ (the agent's: ``predictor.bank.window_batch_size``)
    compute_s_per_step: float    # time outside next(): the training step (GPU or emulated), >= 0
    data_wait_s_per_step: float  # time blocked in next() waiting for a batch, >= 0
    cpu_s_per_batch: float       # worker CPU seconds per batch (time.process_time), >= 0
    wall_s_per_batch: float      # worker wall seconds per batch, >= 0
    runq_s_per_batch: float      # run-queue delay per batch (/proc/self/schedstat field 2), >= 0
    blocked_s_per_batch: float   # wall - cpu - runq, clamped at 0: blocked, mostly IO
    samples_per_s: float         # delivered samples per second over the window, >= 0
    duration_s: float            # window length, > 0
    steps: int                   # steps in the window, >= 0
    worker_memory_bytes: float = 0.0   # one worker's memory cost at the window's end (USS + batches in
                                       # flight), 0 = not measured; optional in records (older ones lack it)
    version: int = OBSERVATION_VERSION

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise BadObservation(f"observation field {f.name!r} must be a number, got {v!r}")
            if isinstance(v, float) and not math.isfinite(v):
                raise BadObservation(f"observation field {f.name!r} must be finite, got {v!r}")
            if v < 0:
                raise BadObservation(f"observation field {f.name!r} must be >= 0, got {v!r}")
            if v > (MAX_SECONDS if f.name in _SECONDS else MAX_FIGURE):
                raise BadObservation(f"observation field {f.name!r} must be at most "
                                     f"{MAX_SECONDS if f.name in _SECONDS else MAX_FIGURE:g}, got {v!r}")
        if self.cores < MIN_CORES:
            raise BadObservation(f"observation field 'cores' must be >= {MIN_CORES:g}, got {self.cores!r}")
        if self.batch_size < 1:
            # (samples per step: a step delivers one sample at least; under one, the curve's ceiling,
            # batch_size / compute per step, underflowed to 0 from 5e-324 samples a step)
            raise BadObservation(f"observation field 'batch_size' must be at least 1 (samples per step), "
                                 f"got {self.batch_size!r}")
        if self.duration_s <= 0:
            raise BadObservation(f"observation field 'duration_s' must be > 0, got {self.duration_s!r}")

    @property
    def step_s(self) -> float:
        return self.compute_s_per_step + self.data_wait_s_per_step

    @property
    def data_wait_frac(self) -> float:
        s = self.step_s
        return self.data_wait_s_per_step / s if s > 0 else 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_window(cls, prev, cur, *, workers: int, cores: float, batch_size: float,
                    compute_s: float | None = None, duration_s: float | None = None) -> "Observation | None":
        """The window between two loader totals (``WINDOW_COUNTERS``), or None when it holds no step or
        no time. ``duration_s``: default the totals' own ``uptime_s`` difference. ``compute_s``: the
        window's compute time when the caller corrects it (default the counters')."""
        d = counter_deltas(prev, cur)
        steps, batches = int(d["steps"]), int(d["batches"])
        dur = d["uptime_s"] if duration_s is None else float(duration_s)
        if steps <= 0 or dur <= 0:
            return None
        per_b = (lambda x: x / batches) if batches > 0 else (lambda x: 0.0)
        return cls(
            workers=int(workers), cores=float(cores), batch_size=as_batch_size(batch_size),
            compute_s_per_step=(d["compute_s"] if compute_s is None else compute_s) / steps,
            data_wait_s_per_step=d["data_wait_s"] / steps,
            cpu_s_per_batch=per_b(d["worker_cpu_s"]), wall_s_per_batch=per_b(d["worker_wall_s"]),
            runq_s_per_batch=per_b(d["worker_runq_s"]),
            blocked_s_per_batch=per_b(blocked_s(d, _count(cur.get("worker_blocked_s")) is not None)),
            samples_per_s=d["samples"] / dur, duration_s=dur, steps=steps)

    @classmethod
    def from_dict(cls, d: dict) -> "Observation":
        if not isinstance(d, dict):
            raise BadObservation(f"observation must be a dict, got {type(d).__name__}")
        version = d.get("version", OBSERVATION_VERSION)
        if not isinstance(version, int) or version > OBSERVATION_VERSION:
            raise BadObservation(
                f"observation version {version!r} is newer than this predictor understands "
                f"({OBSERVATION_VERSION}); upgrade adloader"
            )
        kw = {}
        for f in fields(cls):
            if f.name == "version":
                continue
            if f.name not in d and f.name in _OPTIONAL:
                continue
            if f.name not in d:
                raise BadObservation(f"observation is missing field {f.name!r}")
            kw[f.name] = d[f.name]
        return cls(**kw)
