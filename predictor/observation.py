"""The predictor's input record: one observation window of one job.

A window is what a job did over a few seconds at one configuration (worker count, CPU cores its
loader may use). The loader (``adloader.DataLoader.stats()``) and the agent's collector produce the
totals; whoever holds two successive totals turns them into a window with :meth:`Observation.from_window`.

Units are in the names. Per-step figures are means over the window; per-batch figures are means over
the batches the loader's workers finished in the window (measured inside the worker).

Versioned: ``OBSERVATION_VERSION``; ``from_dict`` ignores unknown keys and refuses a record of a newer
major version or one that is missing a field, naming the field.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

OBSERVATION_VERSION = 1


_OPTIONAL = ("worker_memory_bytes",)   # fields added after version 1's first records


class BadObservation(ValueError):
    """An observation record that cannot be used; the message names the field and the problem."""


@dataclass(frozen=True)
class Observation:
    workers: int                 # loader worker processes during the window (>= 0; 0 = in-process)
    cores: float                 # CPU cores the loader may use (quota/affinity/share), > 0
    batch_size: int              # samples per batch (> 0)
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
        if self.cores <= 0:
            raise BadObservation(f"observation field 'cores' must be > 0, got {self.cores!r}")
        if self.batch_size <= 0:
            raise BadObservation(f"observation field 'batch_size' must be > 0, got {self.batch_size!r}")
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
