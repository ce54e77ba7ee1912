"""``PredictorBank``: one throughput model per job, fed observation windows, asked for curves.

    bank = PredictorBank(prior="default")      # or prior=None: first principles only
    bank.observe("job-1", obs)                 # obs: predictor.observation.Observation
    curve = bank.curve("job-1")                # ThroughputCurve, or None before any usable window
    bank.forget("job-1")

How a curve is made (DESIGN.md, "Measurement"):
  1. First principles from the job's own windows: g = compute s per step, c = worker CPU s per batch,
     b = blocked s per batch (recent windows weigh more; c is measured in situ, under whatever
     contention the job sees, which is what its demand really is).
  2. Shape and default corrections from the prior (``predictor.prior``, refitted at load time from the
     measured corpus shipped in ``predictor/data/corpus.jsonl``): soft-min sharpness and how far real
     curves sit below first principles.
  3. Correction from the job's own observed throughput at the configurations it visited
     (``Prior.job_corrections``), shrunk toward the prior when there is little data; the curve stays
     within ``prior.ANCHOR_TOL`` of the measurement at every visited configuration, and the prior
     adds no per-step overhead a window does not leave room for (``prior.overhead_cap``).
     The default prior is first principles unless the learned one was validated (``prior.default_prior``).
     This per-job fit is a closed form: a ridge regression of the log correction on an intercept,
     with the prior as ``strength`` pseudo-observations, is exactly that shrunk mean of the
     configurations' votes. scikit-learn fits the offline prior (``prior.fit_prior``), where its cost
     does not matter; an sklearn ``Ridge.fit`` per job per window (~0.45 ms on the dev VM) would take
     a tick's whole budget at 64 jobs.

A job's pipeline or model can change while it runs (a new augmentation, a larger crop, layers
unfrozen): its earlier windows then describe a job that is gone, and pooled with the new ones they
held the curve between the two for ~18 s of half-life. When the latest ``CHANGE_WINDOWS`` windows each
differ from the earlier ones' recency-weighted mean, all the same way, by ``CHANGE_RATIO_CPU`` in the
workers' CPU per sample (a CPU time, which contention hardly moves: in the agent's windows of 42 bench
runs on the dev VM, consecutive windows at one configuration differ by 4.4% at the 90th percentile;
``python -m evaluation.phase_scan``) or by ``CHANGE_RATIO_STEP`` in compute per step (a wall time, which
a trainer's wait for a CPU stretches: 13% at the 90th percentile, 45% at most), the earlier windows
are dropped (``_new_phase``; counted in the curve's
``extra["phase_changes"]``). One odd window drops nothing.

Batch size (samples per batch, i.e. per step, ``Observation.batch_size``): in the agent, each window's
own, the samples its loaders delivered over the steps they took in it (``agent.collector.
window_batch_size``; a float where a batch sampler's batches differ, 32.5); where that is not taken,
and in the autotuner and ``adloader profile``, what the client reports: torch's ``batch_size``, or for
a custom ``batch_sampler`` the mean delivered batch since the loader started rounded to a whole number
(``adloader.DataLoader._stats_batch_size``), which near x.5 flips between two integers from report to
report and drifts as batches of other sizes are delivered. A job's windows are not keyed by batch
size. A window whose batch size differs from the earlier windows' recency-weighted mean by more than
``BATCH_SIZE_TOL`` of it plus ``BATCH_SIZE_SLACK`` samples (``batch_size_changed``) is a new phase at
once, on that one window (a batch size is the loader's configuration, not a noisy measurement): the
earlier windows' compute per step and CPU per batch were for batches of another size (64 -> 128
pooled with the old windows predicted 40% above what the new size gave). Inside that tolerance the
windows are one job: the CPU-per-sample vote of ``_new_phase`` divides by the windows' pooled batch
size rather than each window's own (a rounded 1 <-> 2 or 2 <-> 3 flip moved it 1.5-2x and dropped the
job's history), and the curve's ``batch_size`` is the pooled (recency- and step-weighted) mean of the
windows' sizes, as ``g`` and ``c`` are pooled over the same windows, so its samples/s is batches/s
times the samples a batch held on average (a whole number where every window agrees), not the last
window's rounding.

Supply cap: blocked time per batch is taken as a cost each batch pays whatever the worker count (a
fetch's latency), so ``b`` large against ``c`` reads as "more workers, more batches". A source shared by
the workers (a disk's or a network filesystem's bandwidth, a lock around a file) breaks that: it serves
so many batches a second, and each added worker only queues longer at it, its blocked time growing with
the workers. The curve then asked for twice the workers in every window, each measured at the same
samples/s (1 -> 2 -> 4 ... -> 64 workers on a source of 10 batches/s). So where the windows show it
(``supply_cap``: a configuration with more workers and no fewer cores than another that the curve
expected to give 15% more gave at most 5% more, its GPU waiting for data, its batches' wall time outside
the run queue grown with the workers and mostly blocked), the curve's ``supply_cap_samples_per_s`` is the
best a configuration measured, and its blocked time per batch the least a configuration measured (the
source's latency without the queue: the queue is what the cap stands for), so that its workers' term is
min(w / (c + b0), cap) and its knee the least workers that reach the cap. A window that measures 5% more lifts it,
so does a new phase, and so does ``SUPPLY_HOLD_WINDOWS`` without the windows showing it again (then the
job may be tried at more workers once more). None of the 30 jobs of the measured corpus (CPU-bound
sweeps) ever gets one, in their order or shuffled.

Invariants: ``curve()`` is None until a window with finished steps arrived; a curve never comes from
another job's windows; ``observe`` is O(1) and ``curve`` recomputes only after a new window (cached),
so 64 jobs observe+curve per tick in a few ms. What a window contributes (its pooled-cost terms, its
``job_features`` and overhead terms, whether it is loader-bound) is worked out once, when it arrives
(``_WindowFacts``); a rebuild sums those in window order, so the curve is the same, to the last bit,
as one computed from the windows afresh (``pooled_costs`` + ``Prior.correct``; tested).
Not thread-safe: one owner (controller or autotuner).
"""
from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from predictor.curve import ThroughputCurve
from predictor.observation import BadObservation, Observation

HISTORY_WINDOWS = 16        # windows kept per job (the controller feeds one every ~3 s: ~48 s of history)
HALF_LIFE_WINDOWS = 6.0     # recency weighting of windows when pooling g, c, b (~18 s at one per 3 s)
_DECAY = tuple(0.5 ** (k / HALF_LIFE_WINDOWS) for k in range(HISTORY_WINDOWS + 1))   # same floats as pooled_costs
# a new phase (module docstring): the last CHANGE_WINDOWS usable windows each this far from the earlier
# ones, the same way, in worker CPU per sample or in compute per step; 0 turns the detection off
CHANGE_WINDOWS = 2
CHANGE_RATIO_CPU = 1.5
CHANGE_RATIO_STEP = 2.0
# a new batch size (module docstring): off the earlier windows' mean by more than BATCH_SIZE_TOL of it plus
# BATCH_SIZE_SLACK samples. The slack is two roundings of half a sample (the client rounds its mean batch;
# the pooled mean is of rounded sizes), so a rounding flip is never a change, at any size, and neither is a
# real change of one sample, which nothing can tell from rounding. The relative part lets a mean batch
# drift (a bucketed sampler's mix of lengths) by up to 10%, which moves compute per step and CPU per batch
# by at most about as much: less than the window-to-window noise the pooled figures already carry (compute
# per step 13% at the 90th percentile, above); real changes of batch size are steps of 1.5x-2x (64 -> 128).
BATCH_SIZE_TOL = 0.10
BATCH_SIZE_SLACK = 1.0
# The supply cap (module docstring, "Supply cap"): a configuration with more workers and no fewer cores
# than another, at which the curve expected SUPPLY_EXPECTED_GAIN more and the job measured at most
# SUPPLY_TOL more (the window-to-window noise at one configuration is 4-13%, above: one window's figures,
# here each configuration's mean), while each batch's wall time outside the run queue grew at least
# SUPPLY_WALL_GROWTH of the workers' ratio, at least half of that growth blocked (waiting on the data, not
# for a CPU). A window that measures SUPPLY_TOL over the cap lifts it.
SUPPLY_EXPECTED_GAIN = 0.15
SUPPLY_TOL = 0.05
SUPPLY_WALL_GROWTH = 0.75
SUPPLY_DATA_BOUND = 0.9      # ... and below this part of the GPU's ceiling there (else the GPU is the limit)
SUPPLY_SPREAD = 1.25         # a configuration counts where two or more windows' samples/s agree this far (max / min)
SUPPLY_HOLD_WINDOWS = 2 * HISTORY_WINDOWS   # a cap no window has shown again for this long is dropped (a re-probe)
# A pooled time (compute per step, CPU, blocked or run-queue time per batch) under this is no measurement:
# below any clock's resolution, and below a float's spacing of a counter that has run for hours (~2e-12 s at
# 1e4 s). The curve takes it as 0. A lying client's 5e-324 s of CPU per batch was taken as a cost: the curve's
# max_useful_cores underflowed to 0 beside a positive CPU cost, and the planner's (c + b) x core_correction
# to 0 (ZeroDivisionError in ``agent.policies._useful_cores``, every decision of the node).
TIME_RESOLUTION = 1e-12


def _resolved(t: float) -> float:
    """A pooled time as the curve takes it: 0 under ``TIME_RESOLUTION``."""
    return t if t >= TIME_RESOLUTION else 0.0


def batch_size_changed(reference: float, batch_size: float) -> bool:
    """Whether ``batch_size`` is another batch size than ``reference`` (the earlier windows' pooled mean),
    not the same one rounded or drifting: off it by more than ``BATCH_SIZE_TOL`` x ``reference`` +
    ``BATCH_SIZE_SLACK``. 32 vs 33, 34 or 32.4: the same; 64 vs 128, 32 vs 37, 2 vs 4: changed; 1 vs 2 or
    2 vs 3: the same."""
    return abs(batch_size - reference) > BATCH_SIZE_TOL * reference + BATCH_SIZE_SLACK


# a window's own batch size (``window_batch_size``): refused where it is off the reported size by more than
# this factor either way. A batch sampler's reported size is a mean since the loader started, which after
# a real change lags the window's (32 -> 64 is 2x for the first windows after it); 16x is a size changed
# 16-fold long after the start, or no loader's counters: the reported size stands, as it did before
BATCH_SIZE_DISAGREE = 16.0


def window_batch_size(samples: float, steps: float, ranks: int,
                      reported: float) -> tuple[Optional[float], bool, str]:
    """A window's batch size from its counter deltas (``agent.collector``'s module docstring; the per-job
    tuner uses it too, ``adloader.autotune``): (samples per step, or None where
    the reported size stands; whether the window's step count stands; why the window's own size is not
    taken, "" where it is). ``samples``, ``steps``: the window's, summed over its ``ranks`` ranks;
    ``reported``: the client's ``batch_size`` (one rank's: the mean over the ranks' reported sizes).

    - no step: None, and no step count (the controller estimates one from samples/s, as before);
    - no samples counted (a client that does not count them): None; its steps stand;
    - under one sample a step, or more than ``BATCH_SIZE_DISAGREE`` times off the reported size (either
      way): counters that are no loader's (a lying or broken client): None, and its steps do not stand;
    - below the reported size by more than the predictor's tolerance (``predictor.bank.
      batch_size_changed``) yet short of ``steps x reported`` by less than one batch a rank: an epoch's
      short last batch (``drop_last=False``) in a window of few steps of a fixed batch size, not a new
      size (a 3-step window of 256, 256 and 10 samples is 174 a step: taken, every epoch's end was a new
      phase for a slow job): None; its steps stand;
    - else the mean: a batch sampler's exact mean for the window (32.5 where the rounded report flips
      between 32 and 33), a new size from the first window after a change.
    """
    if not steps >= 1:
        return None, False, "no step in the window"
    if not samples > 0:
        return None, True, "no samples counted in the window"
    mean = samples / steps
    if mean < 1:
        return None, False, f"{mean:.3g} samples a step: under one"
    if reported >= 1 and not reported / BATCH_SIZE_DISAGREE <= mean <= reported * BATCH_SIZE_DISAGREE:
        return None, False, (f"{mean:.6g} samples a step, more than {BATCH_SIZE_DISAGREE:g}x off the reported "
                             f"batch size {reported:g}")
    if mean < reported and batch_size_changed(reported, mean) and steps * reported - samples < max(1, ranks) * reported:
        return None, True, (f"{mean:.6g} samples a step: short of the reported {reported:g} by less than one "
                            f"batch a rank (an epoch's short last batch)")
    return mean, True, ""


def configuration(o: Observation) -> tuple[int, float]:
    """The loader configuration a window ran at (worker count, cores): what ``curve_confidence`` counts."""
    return (o.workers, round(o.cores, 3))


def curve_confidence(windows: int, configs: int) -> float:
    """How sure a curve is, 0..1: saturates with usable windows, and more with distinct configurations
    (worker count, cores) visited. One window gives 0.13, two 0.24 (``PolicyConfig.min_confidence``)."""
    return (1.0 - math.exp(-windows / 4.0)) * (0.6 + 0.4 * min(1.0, (configs - 1) / 2.0))


class _WindowFacts:
    """What one usable window contributes to its job's curve, computed once when it arrives (the
    same expressions as ``pooled_costs``, ``prior.measured_overhead`` and ``prior.job_features``)."""

    __slots__ = ("obs", "steps_w", "g", "timed", "c", "b", "r", "config", "spare", "steps", "wait_steps",
                 "fw", "fr", "fb", "fd", "loader_bound")

    def __init__(self, o: Observation) -> None:
        from predictor import prior as pr

        self.obs = o
        self.steps_w = max(1.0, float(o.steps))
        self.g = o.compute_s_per_step
        self.timed = o.cpu_s_per_batch > 0 or o.wall_s_per_batch > 0
        self.c, self.b, self.r = o.cpu_s_per_batch, o.blocked_s_per_batch, o.runq_s_per_batch
        self.config = configuration(o)
        self.spare = pr.spare_loader(o)
        self.steps = o.steps
        self.wait_steps = o.steps * o.data_wait_s_per_step
        w = float(max(1, o.steps))
        wall = o.cpu_s_per_batch + o.runq_s_per_batch + o.blocked_s_per_batch
        self.fw = w
        self.fr = w * (o.runq_s_per_batch / wall if wall > 0 else 0.0)
        self.fb = w * (o.blocked_s_per_batch / wall if wall > 0 else 0.0)
        self.fd = w * o.data_wait_frac
        self.loader_bound = o.workers >= 1 and pr.loader_bound(o)


def supply_cap(curve: ThroughputCurve, facts: list) -> tuple[float, float]:
    """The samples/s the job's data source gives at most, where its windows show one (module docstring,
    "Supply cap"), else 0: the best any configuration measured, where a configuration with more workers
    and no fewer cores than another, which ``curve`` expected to give at least ``SUPPLY_EXPECTED_GAIN``
    more, measured at most ``SUPPLY_TOL`` more and under ``SUPPLY_DATA_BOUND`` of the ceiling (its GPU
    waiting for data), its batches' wall time outside the run queue (c + b)
    having grown with the workers (by ``SUPPLY_WALL_GROWTH`` of their ratio at least, half of it or
    more blocked time). Each configuration by the mean of its windows' figures, where two or more
    agree (``SUPPLY_SPREAD``). Returns (that cap, the least blocked time per batch a configuration
    measured: the source's latency without the queue more workers make at it), or (0, 0)."""
    acc: dict[tuple, list] = {}
    for f in facts:
        if not f.timed or f.obs.workers < 1:
            continue
        a = acc.setdefault(f.config, [0, 0.0, 0.0, 0.0, math.inf, 0.0])
        t = f.obs.samples_per_s
        a[0] += 1
        a[1] += t
        a[2] += f.c
        a[3] += f.b
        a[4], a[5] = min(a[4], t), max(a[5], t)
    # a configuration whose windows disagree (its job or its source changed while it ran there: IO latency
    # is not a new phase, ``_new_phase``) says nothing here
    seen = {k: (t / n, c / n, b / n) for k, (n, t, c, b, lo, hi) in acc.items()
            if n >= 2 and hi <= SUPPLY_SPREAD * lo}
    if len(seen) < 2:
        return 0.0, 0.0
    ceiling = curve.ceiling_samples_per_s
    for (w_lo, k_lo), (t_lo, c_lo, b_lo) in seen.items():
        x_lo = c_lo + b_lo
        if x_lo <= 0:
            continue
        p_lo = curve.throughput(w_lo, k_lo)
        for (w_hi, k_hi), (t_hi, c_hi, b_hi) in seen.items():
            if w_hi <= w_lo or k_hi < 0.97 * k_lo:
                continue
            grew = c_hi + b_hi - x_lo
            if (curve.throughput(w_hi, k_hi) >= (1.0 + SUPPLY_EXPECTED_GAIN) * p_lo
                    and t_hi <= (1.0 + SUPPLY_TOL) * t_lo and t_hi < SUPPLY_DATA_BOUND * ceiling
                    and c_hi + b_hi >= SUPPLY_WALL_GROWTH * (w_hi / w_lo) * x_lo
                    and b_hi - b_lo >= 0.5 * grew):
                return max(t for t, _, _ in seen.values()), _resolved(min(b for _, _, b in seen.values()))
    return 0.0, 0.0


@dataclass
class _JobState:
    windows: deque
    facts: deque = field(default_factory=lambda: deque(maxlen=HISTORY_WINDOWS))   # per window; None = unusable
    curve: ThroughputCurve | None = None
    dirty: bool = True
    phase_changes: int = 0  # new phases detected (``_new_phase``): older windows dropped
    supply_cap: float = 0.0  # samples/s the job's data source was measured to give at most (0: none)
    supply_cap_age: int = 0  # windows since the windows last showed it (``SUPPLY_HOLD_WINDOWS``)
    supply_blocked: float = 0.0  # with it: blocked s per batch without the queue at the source


def _usable(obs: Observation) -> bool:
    """A window says something about per-step and per-batch cost only if steps finished in it."""
    return obs.steps > 0 and obs.samples_per_s > 0


def _new_phase(facts) -> int:
    """How many of the latest windows to keep when they show a new phase (``CHANGE_WINDOWS``: from the
    first of them), else 0. Compared with the recency-weighted mean of the windows before them."""
    if CHANGE_WINDOWS <= 0:
        return 0
    recent = []
    for i in range(len(facts) - 1, -1, -1):
        if facts[i] is not None:
            recent.append(i)
            if len(recent) == CHANGE_WINDOWS:
                break
    if len(recent) < CHANGE_WINDOWS:
        return 0
    first = recent[-1]
    old = [f for f in list(facts)[:first] if f is not None]
    if not old:
        return 0
    new = [facts[i] for i in recent]
    m = len(old)
    # CPU per sample at the windows' pooled batch size: within BATCH_SIZE_TOL the windows have one batch
    # size (a larger one is a new phase, ``_new_batch_size``), and each window's own rounded size moved
    # its CPU per sample by 1/size (1 <-> 2: 2x, a "new phase" on every flip)
    sbs = sum(_DECAY[m - 1 - i] * f.steps_w * f.obs.batch_size for i, f in enumerate(old))
    bs = sbs / sum(_DECAY[m - 1 - i] * f.steps_w for i, f in enumerate(old))
    for ratio, value, voter in ((CHANGE_RATIO_CPU, lambda f: f.c / bs, lambda f: f.timed),
                                (CHANGE_RATIO_STEP, lambda f: f.g, lambda f: True)):
        sw = sv = 0.0
        for i, f in enumerate(old):
            if voter(f):
                w = _DECAY[m - 1 - i] * f.steps_w
                sv += w * value(f)
                sw += w
        if sw <= 0 or not all(voter(f) for f in new):
            continue
        ref = sv / sw
        if not ref > 0:        # (no cost; or a mean under a float's range, 5e-324 s beside windows of 0 s:
            continue           # the ratios below raised ZeroDivisionError out of ``observe``)
        rs = [value(f) / ref for f in new]
        if all(r >= ratio for r in rs) or all(r <= 1.0 / ratio for r in rs):
            return len(facts) - first
    return 0


def _new_batch_size(facts) -> bool:
    """Whether the latest window (usable) has another batch size than the usable windows before it
    (``batch_size_changed`` against their recency- and step-weighted mean, the weights of ``pooled_costs``)."""
    if not facts or facts[-1] is None:
        return False
    old = [f for f in list(facts)[:-1] if f is not None]
    if not old:
        return False
    m = len(old)
    sw = sbs = 0.0
    for i, f in enumerate(old):
        w = _DECAY[m - 1 - i] * f.steps_w
        sw += w
        sbs += w * f.obs.batch_size
    return batch_size_changed(sbs / sw, facts[-1].obs.batch_size)


def pooled_costs(windows) -> tuple[float, float, float, float]:
    """(g, c, b, runq) pooled over usable windows: recency-weighted means, weight ~ steps in window.

    Windows whose workers finished no batch (cpu and wall per batch both 0) do not vote on c and b.
    A mean under ``TIME_RESOLUTION`` is 0.
    """
    windows = list(windows)
    n = len(windows)
    sg = wg = sc = sb = sr = wc = 0.0
    for i, o in enumerate(windows):
        if not _usable(o):
            continue
        decay = 0.5 ** ((n - 1 - i) / HALF_LIFE_WINDOWS)
        w = decay * max(1.0, float(o.steps))
        sg += w * o.compute_s_per_step
        wg += w
        if o.cpu_s_per_batch > 0 or o.wall_s_per_batch > 0:
            sc += w * o.cpu_s_per_batch
            sb += w * o.blocked_s_per_batch
            sr += w * o.runq_s_per_batch
            wc += w
    if wg == 0:
        raise BadObservation("no usable observation window (every window has steps == 0 or samples_per_s == 0)")
    g = _resolved(sg / wg)
    if wc == 0:  # no batch was timed in a worker: nothing says the loader costs anything yet
        return g, 0.0, 0.0, 0.0
    return g, _resolved(sc / wc), _resolved(sb / wc), _resolved(sr / wc)


class PredictorBank:
    """Per-job throughput models. ``prior``: None (first principles, no learned correction),
    "default" (the prior fitted from the shipped corpus; loaded once per process, lazily), or a
    ``predictor.prior.Prior`` (benchmarks pass one fitted with a job held out)."""

    def __init__(self, prior="default"):
        self._prior = None
        if prior is not None and not isinstance(prior, str):
            from predictor.prior import Prior
            if not isinstance(prior, Prior):
                raise ValueError(f"unknown prior {prior!r}; use None, 'default' or a predictor.prior.Prior")
            self._prior, prior = prior, "given"
        elif prior not in (None, "default"):
            raise ValueError(f"unknown prior {prior!r}; use None, 'default' or a predictor.prior.Prior")
        self.prior_name = prior
        self._jobs: dict[str, _JobState] = {}

    # -- public API ------------------------------------------------------------------------------
    def observe(self, job_id: str, obs: Observation) -> None:
        """Add one observation window of ``job_id``. Raises BadObservation for a non-Observation."""
        if not isinstance(obs, Observation):
            if isinstance(obs, dict):
                obs = Observation.from_dict(obs)
            else:
                raise BadObservation(f"observe() needs an Observation (or its dict), got {type(obs).__name__}")
        st = self._jobs.get(job_id)
        if st is None:
            st = self._jobs[job_id] = _JobState(windows=deque(maxlen=HISTORY_WINDOWS))
        st.windows.append(obs)
        st.facts.append(_WindowFacts(obs) if _usable(obs) else None)
        st.dirty = True
        st.supply_cap_age += 1
        if st.supply_cap and ((_usable(obs) and obs.samples_per_s > (1.0 + SUPPLY_TOL) * st.supply_cap)
                              or st.supply_cap_age > SUPPLY_HOLD_WINDOWS):
            st.supply_cap = 0.0         # the source gave more, or long unconfirmed: found again if still the limit
        keep = 1 if _new_batch_size(st.facts) else _new_phase(st.facts)
        if keep:
            for _ in range(len(st.facts) - keep):
                st.facts.popleft()
                st.windows.popleft()
            st.phase_changes += 1
            st.supply_cap = 0.0

    def curve(self, job_id: str) -> ThroughputCurve | None:
        """The job's current curve; None before any usable window (or for an unknown job)."""
        st = self._jobs.get(job_id)
        if st is None:
            return None
        if st.dirty:
            facts = [f for f in st.facts if f is not None]
            curve = self._build(job_id, facts, st.phase_changes)
            if curve is not None:
                cap, blocked = supply_cap(curve, facts)
                if cap:
                    st.supply_cap, st.supply_blocked, st.supply_cap_age = cap, blocked, 0
                if st.supply_cap:
                    # the workers' term with the source's own latency, not the queue's: min(w / (c + b0), cap)
                    curve = dataclasses.replace(curve, supply_cap_samples_per_s=st.supply_cap,
                                                blocked_s_per_batch=min(curve.blocked_s_per_batch, st.supply_blocked))
            st.curve = curve
            st.dirty = False
        return st.curve

    def phase_changes(self, job_id: str) -> int:
        """New phases detected for ``job_id`` so far (its curve's ``extra["phase_changes"]``, without
        building the curve); 0 for an unknown job."""
        st = self._jobs.get(job_id)
        return st.phase_changes if st else 0

    def forget(self, job_id: str) -> None:
        self._jobs.pop(job_id, None)

    def jobs(self) -> list[str]:
        return list(self._jobs)

    def windows(self, job_id: str) -> list[Observation]:
        st = self._jobs.get(job_id)
        return list(st.windows) if st else []

    # -- internals -------------------------------------------------------------------------------
    @property
    def prior(self):
        if self._prior is None and self.prior_name == "default":
            try:
                from predictor.prior import default_prior
                self._prior = default_prior()
            except ImportError:  # prior module not present: first principles only
                self.prior_name = None
        return self._prior

    def _build(self, job_id: str, facts: list[_WindowFacts], phase_changes: int = 0) -> ThroughputCurve | None:
        """The curve from the job's usable windows (their facts, oldest first)."""
        if not facts:
            return None
        n = len(facts)
        # pooled_costs, from the facts
        sg = wg = sc = sb = sr = wc = sbs = 0.0
        for i, f in enumerate(facts):
            w = _DECAY[n - 1 - i] * f.steps_w
            sg += w * f.g
            sbs += w * f.obs.batch_size
            wg += w
            if f.timed:
                sc += w * f.c
                sb += w * f.b
                sr += w * f.r
                wc += w
        g = _resolved(sg / wg)
        c, b, runq = (_resolved(sc / wc), _resolved(sb / wc), _resolved(sr / wc)) if wc else (0.0, 0.0, 0.0)
        configs = {f.config for f in facts}
        confidence = curve_confidence(n, len(configs))
        last = facts[-1].obs
        # samples per batch, pooled as g and c are (module docstring): whole where the windows agree
        bs = last.batch_size if all(f.obs.batch_size == last.batch_size for f in facts) else sbs / wg
        # memory per worker: the latest measured window (a worker's private memory grows as it runs)
        mem = next((f.obs.worker_memory_bytes for f in reversed(facts) if f.obs.worker_memory_bytes > 0), 0.0)
        params: dict = {}
        source = "first-principles"
        prior = self.prior
        if prior is not None:
            # prior.measured_overhead and prior.job_features of the usable windows, from the facts
            num = den = 0.0
            sw = s_r = s_d = s_b = 0.0
            for f in facts:
                if f.spare:
                    num += f.wait_steps
                    den += f.steps
                s_r += f.fr
                s_b += f.fb
                s_d += f.fd
                sw += f.fw
            m_measured = num / den if den > 0 else None
            features = (1.0, s_r / sw, s_d / sw, s_b / sw) if sw else (1.0, 0.0, 0.0, 0.0)
            params = prior.correct_from(g, c, b, [f.obs for f in facts], m_measured, features,
                                        bound_windows=[f.obs for f in facts if f.loader_bound])
            source = "first-principles+learned" if prior.log_kc_coef or prior.sharpness > 0 else "first-principles+own"
        return ThroughputCurve(
            job=job_id, batch_size=bs, compute_s_per_step=g, cpu_s_per_batch=c,
            blocked_s_per_batch=b, confidence=round(confidence, 4), observed_configs=len(configs),
            source=source, worker_memory_bytes=mem, **params,
            extra={"runq_s_per_batch": runq, "windows": n, "phase_changes": phase_changes,
                   "last_config": {"workers": last.workers, "cores": last.cores},
                   "last_samples_per_s": last.samples_per_s},
        )
