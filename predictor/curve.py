"""The predictor's output, the one type every policy consumes: a job's throughput curve.

``ThroughputCurve.throughput(workers, cores)`` is the predicted samples/s of the job when its loader
runs ``workers`` worker processes on ``cores`` CPU cores. The first-principles shape (DESIGN.md,
"Measurement"), per batch:

    compute-bound:  1 / g                 g = compute (GPU step) seconds per step
    worker-bound:   workers / (c + b)     c = CPU s per batch, b = blocked (IO) s per batch
    core-bound:     cores / c

    batches/s = min of the three (workers = 0: the main process loads in line, 1 / (g + c + b))

``correction`` (from the learned model) multiplies the worker- and core-bound terms; it stays 1.0
until the job's own observations say otherwise.

Invariants (property-tested): throughput >= 0, <= ceiling, non-decreasing in workers and in cores.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

KNEE_TOLERANCE = 0.03  # "within a few percent of the ceiling"


@dataclass(frozen=True)
class ThroughputCurve:
    job: str
    batch_size: int
    compute_s_per_step: float      # g
    cpu_s_per_batch: float         # c
    blocked_s_per_batch: float     # b
    correction: float = 1.0        # learned multiplier on the loader side (0 < correction)
    confidence: float = 0.0        # 0 = prior only ... 1 = many observations at several configurations
    observed_configs: int = 0      # distinct (workers, cores) seen
    source: str = "first-principles"
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def ceiling_samples_per_s(self) -> float:
        """Throughput with data always ready (the compute-bound limit)."""
        g = self.compute_s_per_step
        return self.batch_size / g if g > 0 else math.inf

    def throughput(self, workers: float, cores: float) -> float:
        """Predicted samples/s with ``workers`` loader workers on ``cores`` CPU cores."""
        g, c, b = self.compute_s_per_step, self.cpu_s_per_batch, self.blocked_s_per_batch
        workers = max(0.0, float(workers))
        cores = max(0.0, float(cores))
        if workers < 1:
            per_batch = g + c + b
            bps = 1.0 / per_batch if per_batch > 0 else math.inf
        else:
            rates = [1.0 / g if g > 0 else math.inf]
            if c + b > 0:
                rates.append(self.correction * workers / (c + b))
            if c > 0:
                rates.append(self.correction * cores / c if cores > 0 else 0.0)
            bps = min(rates)
        return min(bps * self.batch_size, self.ceiling_samples_per_s) if bps != math.inf else math.inf

    def normalized(self, workers: float, cores: float) -> float:
        """Throughput over the ceiling, in [0, 1]."""
        ceil = self.ceiling_samples_per_s
        if ceil == math.inf or ceil <= 0:
            return 1.0
        return max(0.0, min(1.0, self.throughput(workers, cores) / ceil))

    @property
    def max_useful_cores(self) -> float:
        """Least cores that reach within KNEE_TOLERANCE of the ceiling (with enough workers)."""
        g, c = self.compute_s_per_step, self.cpu_s_per_batch
        if g <= 0:
            return math.inf
        return (1.0 - KNEE_TOLERANCE) * c / (g * self.correction)

    @property
    def max_useful_workers(self) -> int:
        """Least worker count that reaches within KNEE_TOLERANCE of the ceiling (with enough cores)."""
        g, c, b = self.compute_s_per_step, self.cpu_s_per_batch, self.blocked_s_per_batch
        if g <= 0:
            return 1 << 16
        return max(1, math.ceil((1.0 - KNEE_TOLERANCE) * (c + b) / (g * self.correction) - 1e-9))

    def marginal_gain(self, workers: float, cores: float, d_cores: float = 1.0) -> float:
        """Normalised throughput gained by ``d_cores`` more cores (workers grown to match)."""
        w2 = max(workers, math.ceil(cores + d_cores)) if workers >= 1 else workers
        return self.normalized(w2, cores + d_cores) - self.normalized(workers, cores)
