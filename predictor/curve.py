"""The predictor's output, the one type every policy consumes: a job's throughput curve.

``ThroughputCurve.throughput(workers, cores)`` is the predicted samples/s of the job when its loader
runs ``workers`` worker processes on ``cores`` CPU cores. The first-principles shape (DESIGN.md,
"Measurement"), per batch:

    compute-bound:  1 / (g + m)           g = compute (GPU step) seconds per step, m = the training
                                          process's own per-step cost of taking a batch (0 unless measured)
    worker-bound:   workers / (c + b)     c = CPU s per batch, b = blocked (IO) s per batch
    core-bound:     cores / c

    batches/s = min of the three (workers = 0: the main process loads in line, 1 / (g + c + b))

and never above ``supply_cap_samples_per_s`` where the bank has measured one (0, the default: none): what
the job's data source gave it however many workers read from it, a limit neither its workers nor its
cores move (a shared disk's or a network filesystem's bandwidth; ``predictor.bank``, "supply cap").

``correction`` (from the learned model) multiplies the worker-bound term and ``core_correction`` the
core-bound term (``core_correction`` None: same as ``correction``); they stay 1.0 until observations
say otherwise. ``sharpness`` p > 0 replaces the hard min by the soft min (sum r_i^-p)^(-1/p), which
is how measured curves bend near the knee (queueing, per-sample variance); p = 0 keeps the hard min.

Memory: ``worker_memory_bytes`` is what one more worker costs the node (its unique memory plus its
share of the batches in flight, measured; 0 = unknown). Throughput does not depend on it; the policies
spend a node's loader memory budget with it (``memory_for``, ``workers_within``).

Invariants (property-tested): throughput >= 0, <= ceiling, non-decreasing in workers and in cores;
every knee is the least value reaching within KNEE_TOLERANCE of the limit it is a knee of.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

KNEE_TOLERANCE = 0.03  # "within a few percent of the ceiling"
MEMO_ENTRIES = 1024     # the most results one curve keeps in its ``memo`` (0: none; a decision adds up to ~100 a job)
MIN_SHARPNESS = 1.0    # a soft minimum's p is 0 (hard) or at least this (see ThroughputCurve.__post_init__)

# the fields that are figures: each finite and >= 0 (correction, core_correction and batch_size above 0)
_FIGURES = ("batch_size", "compute_s_per_step", "cpu_s_per_batch", "blocked_s_per_batch", "correction", "confidence",
            "observed_configs", "sharpness", "overhead_s_per_step", "worker_memory_bytes",
            "supply_cap_samples_per_s")


def _figure(v) -> bool:
    """A finite number (a bool is not one)."""
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


@dataclass(frozen=True)
class ThroughputCurve:
    job: str
    batch_size: float              # samples per batch (> 0): whole for a fixed batch size; the bank's is the
                                   # pooled mean of its windows' sizes where they differ (predictor.bank)
    compute_s_per_step: float      # g
    cpu_s_per_batch: float         # c
    blocked_s_per_batch: float     # b
    correction: float = 1.0        # learned multiplier on the worker-bound term (0 < correction)
    confidence: float = 0.0        # 0 = prior only ... 1 = many observations at several configurations
    observed_configs: int = 0      # distinct (workers, cores) seen
    source: str = "first-principles"
    extra: dict = field(default_factory=dict, compare=False)
    core_correction: float | None = None   # learned multiplier on the core-bound term (None = correction)
    sharpness: float = 0.0                 # soft-min exponent p (0 = hard min)
    overhead_s_per_step: float = 0.0       # m: per-step cost of taking a ready batch in the training process
    worker_memory_bytes: float = 0.0       # memory one worker costs (USS + batches in flight), 0 = unknown
    supply_cap_samples_per_s: float = 0.0  # the most the job's data source gives, measured (0 = no cap)

    def __post_init__(self) -> None:
        """A curve is validated where it is made (by the predictor's bank, the prior's fit, a simulator
        or a test, by hand or by ``dataclasses.replace``), as ``predictor.prior.Prior`` is: every figure
        finite and >= 0; ``batch_size``, ``correction`` and ``core_correction`` (unless None) above 0;
        ``confidence`` at most 1; ``observed_configs`` a whole number; ``sharpness`` 0 (hard minimum) or
        at least ``MIN_SHARPNESS`` (with p < 1 the soft minimum says a batch takes longer than its three
        limits one after another). Anything else is a ValueError naming the field."""
        for name in _FIGURES:
            v = getattr(self, name)
            if not _figure(v):
                self._refuse(name, "must be a finite number")
            if v < 0:
                self._refuse(name, "must be >= 0")
        kc = self.core_correction
        if kc is not None and not _figure(kc):
            self._refuse("core_correction", "must be None or a finite number")
        for name in ("batch_size", "correction", "core_correction"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                self._refuse(name, "must be > 0")
        if self.confidence > 1:
            self._refuse("confidence", "must be between 0 and 1")
        if not isinstance(self.observed_configs, int):
            self._refuse("observed_configs", "must be a whole number")
        if not (self.sharpness == 0 or self.sharpness >= MIN_SHARPNESS):
            self._refuse("sharpness", f"must be 0 (hard minimum) or at least {MIN_SHARPNESS:g}")
        # Derived constants are set once per curve (it is immutable; the predictor builds short-lived
        # curves by the hundred per tick and policies evaluate each many times), as plain attributes:
        #   _kc                    the core-bound term's correction (core_correction, else correction)
        #   ceiling_samples_per_s  throughput with data always ready: one batch per g + m seconds
        #   _cap_bps               the supply cap in batches/s (inf: none)
        g = self.compute_s_per_step + self.overhead_s_per_step
        object.__setattr__(self, "_kc", self.correction if self.core_correction is None else self.core_correction)
        cap = self.supply_cap_samples_per_s
        object.__setattr__(self, "_cap_bps", cap / self.batch_size if cap > 0 else math.inf)
        object.__setattr__(self, "ceiling_samples_per_s", self.batch_size / g if g > 0 else math.inf)

    def _refuse(self, name: str, why: str) -> None:
        raise ValueError(f"throughput curve of job {self.job!r}: field {name!r} {why}, got {getattr(self, name)!r}")

    @cached_property
    def memo(self) -> dict:
        """Results computed from this curve alone and the other inputs their key holds: the policy's
        ``normalized`` values and fairness floors (``agent.policies.curve_value``, ``job_floor``). Safe to
        keep because the curve is immutable and the memo dies with it: the predictor makes a new curve
        from each new window, with an empty memo, so no result outlives the figures it came from. At
        most ``MEMO_ENTRIES`` (``remember``). Not part of the curve's value (equality, repr), and
        ``dataclasses.replace`` starts an empty one."""
        return {}

    def remember(self, key, value):
        """Keep ``value`` in ``memo`` under ``key`` and return it. A full memo starts afresh;
        ``MEMO_ENTRIES`` 0 keeps nothing (every result computed anew: what the tests compare with)."""
        memo = self.memo
        if len(memo) >= MEMO_ENTRIES:
            memo.clear()
        if MEMO_ENTRIES > 0:
            memo[key] = value
        return value

    @property
    def core_efficiency(self) -> float:
        """The core-bound term's correction (``core_correction``, else ``correction``): the part of its
        allotted cores the curve says the loader turns into batches (that term is this x cores / c)."""
        return self._kc

    def _softmin(self, rates: list[float]) -> float:
        """Soft (p > 0) or hard (p = 0) minimum of positive rates; inf terms drop out."""
        m = math.inf
        for r in rates:
            if r <= 0:
                return 0.0
            if r < m:
                m = r
        p = self.sharpness
        if m == math.inf or p <= 0:
            return m
        s = 0.0                      # scaled by the min for numerical range
        for r in rates:
            if r != math.inf:
                s += (m / r) ** p
        return m * s ** (-1.0 / p)

    @cached_property
    def _knee_factor(self) -> float:
        """s such that rate term r >= s * L puts the soft-min within KNEE_TOLERANCE of the limit L."""
        p, tol = self.sharpness, KNEE_TOLERANCE
        if p <= 0:
            return 1.0 - tol
        y = -p * math.log1p(-tol)           # log((1 - tol)^-p)
        if y < 700.0:
            return 1.0 / ((1.0 - tol) ** (-p) - 1.0) ** (1.0 / p)
        # (1 - tol)^-p is past a float from p of about 23,000: 1 / (e^y - 1)^(1/p) in log space, which
        # tends to 1 - tol, the hard minimum's factor, as p grows
        return math.exp(-(y + math.log(-math.expm1(-y))) / p)

    def throughput(self, workers: float, cores: float) -> float:
        """Predicted samples/s with ``workers`` loader workers on ``cores`` CPU cores."""
        g, c, b = self.compute_s_per_step + self.overhead_s_per_step, self.cpu_s_per_batch, self.blocked_s_per_batch
        workers = max(0.0, float(workers))
        cores = max(0.0, float(cores))
        if workers < 1:
            per_batch = g + c + b
            bps = 1.0 / per_batch if per_batch > 0 else math.inf
        else:
            rates = [1.0 / g] if g > 0 else []
            if c + b > 0:
                rates.append(self.correction * workers / (c + b))
            if c > 0:
                rates.append(self._kc * cores / c if cores > 0 else 0.0)
            bps = self._softmin(rates)
        bps = min(bps, self._cap_bps)
        return min(bps * self.batch_size, self.ceiling_samples_per_s) if bps != math.inf else math.inf

    def normalized(self, workers: float, cores: float) -> float:
        """Throughput over the ceiling, in [0, 1]."""
        ceil = self.ceiling_samples_per_s
        if ceil == math.inf or ceil <= 0:
            return 1.0
        return max(0.0, min(1.0, self.throughput(workers, cores) / ceil))

    @cached_property
    def max_useful_cores(self) -> float:
        """Least cores that reach within KNEE_TOLERANCE of the ceiling (with enough workers)."""
        g, c = self.compute_s_per_step + self.overhead_s_per_step, self.cpu_s_per_batch
        if self._cap_bps < (1.0 / g if g > 0 else math.inf):
            # the supply binds first: the cores that reach within KNEE_TOLERANCE of what it gives
            return self._knee_factor * c * self._cap_bps / self._kc
        if g <= 0:
            return math.inf
        den = g * self._kc
        if den <= 0:                 # (g x correction below a float's range: the ratio is above it)
            return math.inf if c > 0 else 0.0
        if den == math.inf:          # (... above it: the ratio is 0, where knee x c / den was inf / inf)
            return 0.0
        return self._knee_factor * c / den

    @cached_property
    def max_useful_workers(self) -> int:
        """Least worker count that reaches within KNEE_TOLERANCE of the ceiling (with enough cores)."""
        return self.knee_workers(math.inf)

    def knee_workers(self, cores: float) -> int:
        """Least worker count (>= 1) whose throughput on ``cores`` cores is within KNEE_TOLERANCE of
        what unlimited workers would reach on those cores. Non-decreasing in ``cores``."""
        g, c, b = self.compute_s_per_step + self.overhead_s_per_step, self.cpu_s_per_batch, self.blocked_s_per_batch
        if c + b <= 0:
            return 1
        limit_bps = min(self._cap_bps, self._softmin([1.0 / g if g > 0 else math.inf,
                                                     (self._kc * cores / c if cores > 0 else 0.0) if c > 0 else math.inf]))
        if limit_bps == math.inf:
            return 1 << 16
        if limit_bps <= 0:
            return 1
        need = (c + b) * limit_bps * self._knee_factor / self.correction
        return max(1, math.ceil(min(1 << 16, need) - 1e-9))     # (need may be inf: capped before ceil)

    def memory_for(self, workers: float) -> float:
        """Loader memory (bytes) of ``workers`` workers."""
        return max(0.0, float(workers)) * self.worker_memory_bytes

    def workers_within(self, memory_bytes: float) -> int:
        """Most workers that fit in ``memory_bytes`` (a very large number when the cost is unknown)."""
        if self.worker_memory_bytes <= 0:
            return 1 << 16
        n = memory_bytes // self.worker_memory_bytes
        if not math.isfinite(n):     # (a cost so small, or a budget so large, that the count is beyond a float)
            return 0 if memory_bytes < 0 else 1 << 16
        return max(0, int(n))

    def marginal_gain(self, workers: float, cores: float, d_cores: float = 1.0) -> float:
        """Normalised throughput gained by ``d_cores`` more cores (workers grown to match)."""
        w2 = max(workers, math.ceil(cores + d_cores)) if workers >= 1 else workers
        return self.normalized(w2, cores + d_cores) - self.normalized(workers, cores)


@dataclass(frozen=True)
class SharedCpuState:
    """Where ``shared_cpu_throughput``'s fixed point settles: samples/s, the share of a CPU the trainer
    gets while its CPU part runs (its CPU part takes ``t / trainer_share``: the rest is run-queue wait),
    the share a busy worker gets (a batch takes ``c / worker_share + b``), and the workers runnable on
    average."""
    samples_per_s: float
    trainer_share: float
    worker_share: float
    runnable_workers: float
    runnable_trainers: float = 0.0


def shared_cpu_throughput(curve: ThroughputCurve, workers: int, cpus: float, trainer_cpu_s_per_step: float,
                          trainer_threads: int = 1) -> float:
    """Samples/s when the job's training process and its ``workers`` share ``cpus`` CPUs with no
    priority between them (the kernel's fair share per runnable thread: no agent, or a job whose loader
    and trainer sit in one cgroup): the slowdown that extra workers cause the main process.

    Model (a fixed point, found in a few iterations): ``u`` workers are runnable on average (Little's
    law: batches/s x the CPU seconds of a batch at their share; blocked time is not runnable); the
    training process is runnable a fraction ``r`` of the
    time (its CPU part of a step over the step). While the trainer's CPU part runs, it shares the CPUs
    with the busy workers: it gets ``s_t = min(1, cpus / (u + threads))`` of a CPU, so its CPU part
    (``trainer_cpu_s_per_step``, measured as CPU time, contention-free) takes ``t / s_t``; the rest of
    the step (``g - t``, the GPU) does not change. A worker gets ``s_w = min(1, cpus / (u + r))`` on
    average, so a batch takes ``c / s_w + b``. Batches/s is the curve's minimum of its three limits with
    those figures. Idle workers (a full queue) are not runnable and cost nothing; busy ones past what
    the CPUs left to the trainer can run only stretch its CPU part: that is what makes the optimum
    interior. With ``t = 0`` it is ``curve.throughput(workers, cpus)`` (hard minimum) up to the
    workers' own time-sharing."""
    return shared_cpu_state(curve, workers, cpus, trainer_cpu_s_per_step, trainer_threads).samples_per_s


def shared_cpu_state(curve: ThroughputCurve, workers: int, cpus: float, trainer_cpu_s_per_step: float,
                     trainer_threads: int = 1, trainer_share_cap: float = 1.0) -> SharedCpuState:
    """``shared_cpu_throughput`` with the shares it settles at (``SharedCpuState``). ``trainer_share_cap``:
    the most of a CPU the trainer gets while runnable whatever its own job does (what other jobs'
    threads on its CPU leave it; 1 = nothing else competes)."""
    if workers < 1:
        return SharedCpuState(curve.throughput(0, cpus), 1.0, 1.0, 0.0)
    cap_t = min(1.0, max(1e-6, float(trainer_share_cap)))
    g = curve.compute_s_per_step + curve.overhead_s_per_step
    t = max(0.0, min(trainer_cpu_s_per_step, g))
    gpu = g - t
    c, b = curve.cpu_s_per_batch, curve.blocked_s_per_batch
    cpus = max(1e-6, float(cpus))
    n = max(1, int(trainer_threads))
    u, r = float(workers), 0.0
    bps = 0.0
    for _ in range(60):
        s_t = min(cap_t, cpus / (u + n))
        s_w = min(1.0, cpus / (u + r)) if u + r > 0 else 1.0
        step = gpu + t / s_t
        rates = [1.0 / step] if step > 0 else []
        per_batch = c / s_w + b
        if per_batch > 0:
            rates.append(curve.correction * workers / per_batch)
        new = curve._softmin(rates) if rates else math.inf
        if new == math.inf:
            return SharedCpuState(math.inf, s_t, s_w, u, r)
        # busy workers compete for CPUs only while they compute: a worker blocked on IO is not runnable
        u_new = min(float(workers), new * (c / s_w))
        r_new = min(float(n), n * new * t / s_t)
        if abs(new - bps) <= 1e-7 * max(1e-3, new) and abs(u_new - u) < 1e-6 and abs(r_new - r) < 1e-6:
            bps = new
            break
        bps, u, r = new, 0.5 * u + 0.5 * u_new, 0.5 * r + 0.5 * r_new
    bps = min(bps, curve._cap_bps)
    return SharedCpuState(min(bps * curve.batch_size, curve.ceiling_samples_per_s), s_t, s_w, u, r)


def least_near_best(values) -> int:
    """The least count (``values[0]`` is 1 worker's) whose value is within KNEE_TOLERANCE of the best."""
    best = max(values)
    return next(w for w, v in enumerate(values, 1) if v >= (1.0 - KNEE_TOLERANCE) * best)


def shared_cpu_knee(curve: ThroughputCurve, cpus: float, trainer_cpu_s_per_step: float,
                    max_workers: int, trainer_threads: int = 1) -> int:
    """The least worker count within KNEE_TOLERANCE of the best ``shared_cpu_throughput`` over
    1..``max_workers``: max useful workers when the trainer shares the CPUs. Can be well below the count
    that keeps the loader's queue full (``knee_workers``), because a worker past it slows the trainer."""
    return least_near_best([shared_cpu_throughput(curve, w, cpus, trainer_cpu_s_per_step, trainer_threads)
                            for w in range(1, max(1, int(max_workers)) + 1)])
