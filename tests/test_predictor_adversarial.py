"""Adversarial property tests of the predictor as the planner consumes it (unit tier).

Random sequences of windows the record accepts (tiny and huge step times, batches of 1 and 65536, no
blocked time and all of it, CPU per batch near 0, 0..64 workers on 0.05..512 cores, phase changes,
windows that contradict each other, a lying client's figures) go through ``PredictorBank``; after each
window its curve must keep what ``agent.policies`` assumes of it: every figure finite, corrections
within the prior's bounds, confidence in [0, 1], ``normalized`` in [0, 1] and non-decreasing in workers
(from 1: the planner's least) and in cores, knees that are knees, ``curve_value``'s memo equal to a
fresh evaluation. Deterministic (derandomized), a bounded number of examples.
"""
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.model import JobAllocation, NodeSnapshot
from agent.policies import PolicyConfig, _curve_worker_rule, _useful_cores, adaptive, curve_value
from predictor.bank import PredictorBank
from predictor.curve import KNEE_TOLERANCE, ThroughputCurve
from predictor.observation import MAX_SECONDS, BadObservation, Observation
from predictor.prior import K_MAX, K_MIN, Prior
from tests.fakes import job_stats

pytestmark = pytest.mark.unit

_SETTINGS = dict(max_examples=120, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])

SECONDS = st.sampled_from([0.0, 1e-9, 1e-6, 1e-3, 0.01, 0.05, 0.3, 2.0, 60.0, 3600.0, MAX_SECONDS])
SMALL = st.sampled_from([0.0, 5e-324, 1e-310, 1e-15, 1e-12, 1e-9, 1e-6, 1e-3])
BATCH = st.sampled_from([1, 2, 32, 32.5, 4096, 65536])
CORES = st.one_of(st.sampled_from([0.05, 0.1, 0.5, 1.0, 2.5, 16.0, 64.0, 512.0]), st.floats(0.05, 512.0))
WORKERS = st.one_of(st.integers(1, 64), st.sampled_from([0, 1, 64]))
PRIORS = {"none": None, "default": "default",
          "sharp": Prior(sharpness=20.0, log_kc_coef=(0.1, 0.2, -0.3, 0.1), strength=1.0),
          "soft": Prior(sharpness=1.0, theta_w=0.5, theta_c=2.0, overhead_frac_of_c=1e3, strength=0.0)}


def _model_window(w, cores, g, c, b, bs, runq, wait_extra, dur, mem):
    """The window an ideal loader of a job with costs (g, c, b) gives at (w, cores): hard-minimum step."""
    if w >= 1:
        step = max(g, (c + b) / w, c / cores)
    else:
        step = g + c + b
    step = max(step + wait_extra, 1e-9)
    steps = max(1, min(2 ** 53, int(dur / step)))
    return Observation(workers=w, cores=cores, batch_size=bs, compute_s_per_step=g,
                       data_wait_s_per_step=min(MAX_SECONDS, step - g if step > g else 0.0),
                       cpu_s_per_batch=c, wall_s_per_batch=min(MAX_SECONDS, c + runq + b),
                       runq_s_per_batch=runq, blocked_s_per_batch=b, samples_per_s=min(2.0 ** 53, bs / step),
                       duration_s=dur, steps=steps, worker_memory_bytes=mem)


def _source_window(w, cores, g, c, latency, rate_bps, bs, runq, dur):
    """A window of a job whose data source serves ``rate_bps`` batches/s at most, shared by its workers:
    each batch's blocked time is the queue at the source (``tests.test_predictor_bank._source_window``)."""
    w = max(1, w)
    rate = min(rate_bps, w / max(c + latency + runq, 1e-12), 1.0 / max(g, 1e-12))
    wall = max(w / rate, c + latency + runq)
    if wall > MAX_SECONDS:
        raise BadObservation("a batch longer than the record takes")
    return Observation(workers=w, cores=cores, batch_size=bs, compute_s_per_step=g,
                       data_wait_s_per_step=min(MAX_SECONDS, max(0.0, 1.0 / rate - g)), cpu_s_per_batch=c,
                       wall_s_per_batch=wall, runq_s_per_batch=runq, blocked_s_per_batch=max(0.0, wall - c - runq),
                       samples_per_s=min(2.0 ** 53, bs * rate), duration_s=dur,
                       steps=max(1, min(2 ** 53, int(dur * rate))))


@st.composite
def window_sequences(draw):
    """A list of windows of one job: phases of a consistent job, each window at a random configuration,
    mixed with windows of a lying client (each figure drawn on its own)."""
    out = []
    for _ in range(draw(st.integers(1, 4))):                       # phases
        g, c, b = draw(SECONDS), draw(st.one_of(SECONDS, SMALL)), draw(st.one_of(SECONDS, SMALL))
        bs = draw(BATCH)
        source = draw(st.booleans())        # a phase reading a shared source (its supply cap)
        rate = draw(st.sampled_from([1e-3, 1.0, 10.0, 1e3, 1e6]))
        phase_cores = draw(CORES)
        for _ in range(draw(st.integers(1, 10))):
            kind = draw(st.sampled_from(["model", "model", "model", "liar"]))
            w, cores = draw(WORKERS), draw(CORES)
            dur = draw(st.sampled_from([0.05, 3.0, 30.0]))
            mem = draw(st.sampled_from([0.0, 1.0, 2.0 ** 30, 2.0 ** 53]))
            try:
                if kind == "model" and source:
                    w, cores = draw(st.sampled_from([1, 2, 4, 64])), phase_cores * draw(st.sampled_from([1, 1, 2]))
                    out.append(_source_window(w, cores, g, c, b, rate, bs, draw(SMALL), dur))
                elif kind == "model":
                    out.append(_model_window(w, cores, g, c, b, bs, draw(SMALL), draw(SMALL), dur, mem))
                else:
                    out.append(Observation(
                        workers=w, cores=cores, batch_size=draw(BATCH), compute_s_per_step=draw(SECONDS),
                        data_wait_s_per_step=draw(SECONDS), cpu_s_per_batch=draw(st.one_of(SECONDS, SMALL)),
                        wall_s_per_batch=draw(SECONDS), runq_s_per_batch=draw(SECONDS),
                        blocked_s_per_batch=draw(SECONDS),
                        samples_per_s=draw(st.sampled_from([0.0, 5e-324, 1e-6, 1.0, 1e4, 2.0 ** 53])),
                        duration_s=dur, steps=draw(st.sampled_from([0, 1, 100, 2 ** 53])),
                        worker_memory_bytes=mem))
            except BadObservation:
                pass
    return out


W_GRID = (1, 2, 3, 5, 8, 16, 33, 64, 1000, 1 << 16)
C_GRID = (0.05, 0.1, 0.33, 1.0, 2.0, 4.5, 16.0, 64.0, 512.0, 1e6)


def _finite_figure(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_curve(cur: ThroughputCurve, prior_name: str) -> None:
    """What the planner assumes of a curve (``agent.policies``); an AssertionError names the breach."""
    for name in ("batch_size", "compute_s_per_step", "cpu_s_per_batch", "blocked_s_per_batch", "correction",
                 "core_efficiency", "confidence", "sharpness", "overhead_s_per_step", "worker_memory_bytes",
                 "supply_cap_samples_per_s"):
        v = getattr(cur, name)
        assert _finite_figure(v) and v >= 0, (name, v, cur)
    assert cur.batch_size > 0
    assert 0.0 <= cur.confidence <= 1.0
    assert K_MIN <= cur.correction <= K_MAX and K_MIN <= cur.core_efficiency <= K_MAX, cur
    if prior_name == "none":
        assert cur.correction == 1.0 and cur.core_efficiency == 1.0
    ceiling = cur.ceiling_samples_per_s
    assert ceiling > 0 and not math.isnan(ceiling)
    assert ceiling == math.inf or cur.compute_s_per_step + cur.overhead_s_per_step > 0

    mw = cur.max_useful_workers
    assert isinstance(mw, int) and 1 <= mw <= 1 << 16, mw
    mc = cur.max_useful_cores
    assert not math.isnan(mc) and mc >= 0, mc
    if cur.cpu_s_per_batch > 0 and ceiling < math.inf:
        assert mc > 0, (mc, cur)

    # normalized: in [0, 1], non-decreasing in workers (from 1) and in cores; knees non-decreasing in cores
    prev_row = None
    prev_knee = 0
    for c in C_GRID:
        row = [cur.normalized(w, c) for w in W_GRID]
        for v in row:
            assert 0.0 <= v <= 1.0, (v, cur)
        for a, b in zip(row, row[1:]):
            assert b >= a - 1e-12, ("workers", row, c, cur)
        if prev_row is not None:
            for a, b in zip(prev_row, row):
                assert b >= a - 1e-12, ("cores", prev_row, row, c, cur)
        prev_row = row
        k = cur.knee_workers(c)
        assert isinstance(k, int) and prev_knee <= k <= mw, (k, prev_knee, mw, c, cur)
        prev_knee = k
        # a knee reaches within the tolerance of what unlimited workers reach on those cores
        t_inf = cur.throughput(1 << 20, c)
        if k < 1 << 16 and math.isfinite(t_inf):
            assert cur.throughput(k, c) >= (1 - KNEE_TOLERANCE) * t_inf * (1 - 1e-6), (k, c, cur)
    # max useful cores reach within the tolerance of the most any cores give (enough workers)
    if math.isfinite(mc) and ceiling < math.inf:
        best = cur.throughput(1 << 20, 1e12)
        assert cur.throughput(1 << 20, mc * (1 + 1e-9) + 1e-300) >= (1 - KNEE_TOLERANCE) * best * (1 - 1e-6), (mc, cur)

    # curve_value's memo: the same value as a fresh evaluation, asked twice
    for w, c in ((1, 0.05), (mw, 1.0), (3, 512.0)):
        first = curve_value(cur, w, c)
        assert first == curve_value(cur, w, c) == cur.normalized(w, c)

    # the planner's worker rule and useful cores from this curve
    rule = _curve_worker_rule(cur, 1, 64)
    for c in C_GRID:
        n = rule(c)
        assert isinstance(n, int) and 1 <= n <= 64
    uc = _useful_cores(cur, job_stats("j", max_workers=64), 64.0, PolicyConfig())
    assert _finite_figure(uc) and 0 <= uc <= 64.0


@settings(**_SETTINGS)
@given(windows=window_sequences(), prior=st.sampled_from(sorted(PRIORS)))
def test_any_sequence_of_windows_gives_curves_the_planner_can_use(windows, prior):
    bank = PredictorBank(prior=PRIORS[prior])
    previous = None
    for o in windows:
        bank.observe("j", o)
        cur = bank.curve("j")
        if cur is None:
            continue
        # a new window makes a new curve, with an empty memo (no value outlives its figures)
        assert cur is not previous and not cur.memo
        check_curve(cur, prior)
        previous = cur


@settings(**{**_SETTINGS, "max_examples": 40})
@given(windows=window_sequences(), prior=st.sampled_from(sorted(PRIORS)),
       budget=st.sampled_from([None, 1.0, 2.0 ** 30, 2.0 ** 60]))
def test_the_planner_plans_any_such_curve(windows, prior, budget):
    """The adaptive policy, given the last curve of such a sequence beside a plain job's, plans finite
    cores and a worker count within the bounds for both, under any loader memory budget (the curve's
    worker memory is what its workers cost there)."""
    bank = PredictorBank(prior=PRIORS[prior])
    for o in windows:
        bank.observe("j", o)
    cur = bank.curve("j")
    if cur is None:
        return
    plain = ThroughputCurve(job="k", batch_size=32, compute_s_per_step=0.1, cpu_s_per_batch=0.2,
                            blocked_s_per_batch=0.0, confidence=0.9, observed_configs=3)
    jobs = {"j": job_stats("j", max_workers=64), "k": job_stats("k", max_workers=64)}
    snap = NodeSnapshot(now=100.0, loader_cpus=7.2, cpu_ids=tuple(range(8)), jobs=jobs, loader_memory_bytes=budget)
    plan = adaptive(snap, {"j": cur, "k": plain}, PolicyConfig())
    for j, a in plan.allocations.items():
        assert _finite_figure(a.cpus) and 0 <= a.cpus <= 8.0, (j, a)
        assert 1 <= a.workers <= 64, (j, a)
    if plan.predicted_total is not None:
        assert _finite_figure(plan.predicted_total)


# -- the controller's feeding: observation_from_stats of degenerate JobStats ------------------------------

_EXTREME = {
    "samples_per_s": [0.0, 1e-12, 1e6, 2.0 ** 53, 1e300], "compute_s_per_step": [0.0, 1e-12, 1e6, 1e300],
    "data_wait_s_per_step": [0.0, 1e-12, 1e6], "cpu_s_per_batch": [0.0, 1e-12, 1e6],
    "wall_s_per_batch": [0.0, 1e-12, 1e6], "runq_s_per_batch": [0.0, 1e6], "blocked_s_per_batch": [0.0, 1e-12, 1e6],
    "worker_cpu_cores": [0.0, 1e-12, 512.0, 1e300], "trainer_runq_s_per_step": [0.0, 1e6],
    "worker_memory_bytes": [0.0, 1.0, 2.0 ** 53], "batch_size": [0, 1, 65536, 2 ** 60],
    "workers": [0, 1, 64, 2 ** 60], "window_s": [0.0, 1e-9, 0.05, 1e6, 1e300],
    "samples_per_step": [None, 0.0, 0.5, 1.0, 32.5, 1e300], "window_steps": [None, 0.0, 0.4, 1.0, 1e20],
    "allowed_cpus": [(), (0,), tuple(range(64))], "cpu_quota_cores": [None, 0.0, 1e-9, 0.5, 512.0],
    "data_wait_frac": [0.0, 1.0], "cooperative": [False, True],
}


@st.composite
def degenerate_stats(draw):
    """A plausible JobStats with some of its figures zero, tiny or huge (never NaN), and its snapshot."""
    names = draw(st.lists(st.sampled_from(sorted(_EXTREME)), min_size=1, max_size=6, unique=True))
    job = job_stats("j", **{k: draw(st.sampled_from(_EXTREME[k])) for k in names})
    applied = draw(st.sampled_from([None, 0.0, 1e-9, 0.05, 4.0, 1e300]))
    snap = NodeSnapshot(now=10.0, loader_cpus=draw(st.sampled_from([0.0, 1e-9, 0.05, 7.2, 512.0])),
                        cpu_ids=tuple(range(8)), jobs={"j": job},
                        applied={} if applied is None else {"j": JobAllocation(job="j", workers=1, cpus=applied)})
    return job, snap, draw(st.sampled_from([None, 0.0, 1e-9, 2.0, 1e300]))


@settings(**{**_SETTINGS, "max_examples": 300})
@given(case=degenerate_stats(), work_conserving=st.booleans(), observed=st.sampled_from(["share", "received"]))
def test_observation_from_degenerate_stats_is_none_or_a_window_the_bank_takes(case, work_conserving, observed):
    from agent.controller import observation_from_stats

    job, snap, applied_cpus = case
    obs = observation_from_stats(job, snap, work_conserving, applied_cpus=applied_cpus, observed_cores=observed)
    if obs is None:
        return
    assert isinstance(obs, Observation) and obs.cores > 0 and obs.batch_size > 0 and obs.workers >= 0
    bank = PredictorBank(prior="default")
    for _ in range(3):
        bank.observe("j", obs)
        cur = bank.curve("j")
        if cur is not None:
            check_curve(cur, "default")


# -- regressions: what the properties above found ----------------------------------------------------------

def _window(workers=1, cores=0.05, bs=1, g=2.0, wait=0.0, c=0.0, wall=0.0, b=0.0, rate=0.5, steps=1, dur=3.0):
    return Observation(workers=workers, cores=cores, batch_size=bs, compute_s_per_step=g, data_wait_s_per_step=wait,
                       cpu_s_per_batch=c, wall_s_per_batch=wall, runq_s_per_batch=0.0, blocked_s_per_batch=b,
                       samples_per_s=rate, duration_s=dur, steps=steps)


@pytest.mark.parametrize("prior", sorted(PRIORS))
@pytest.mark.parametrize("c", [5e-324, 1e-310, 1e-13])
def test_a_cpu_cost_under_a_clocks_resolution_is_no_cost(prior, c):
    """A lying client's 5e-324 s of worker CPU per batch (the record takes any figure >= 0) was pooled
    into the curve as a cost: its max_useful_cores underflowed to 0 beside a positive CPU cost, and with
    a core correction under 1 the planner's (c + b) x core_correction was 0: ZeroDivisionError in
    ``agent.policies._useful_cores``, for every decision of the node while the window was in the job's
    history. A pooled time under ``predictor.bank.TIME_RESOLUTION`` is now 0."""
    bank = PredictorBank(prior=PRIORS[prior])
    bank.observe("j", _window(c=c, wall=c))
    cur = bank.curve("j")
    check_curve(cur, prior)
    assert cur.cpu_s_per_batch == 0.0
    # a measurable cost stays what it was measured
    bank = PredictorBank(prior=PRIORS[prior])
    bank.observe("j", _window(c=1e-9, wall=1e-9))
    assert bank.curve("j").cpu_s_per_batch == 1e-9


def test_a_mean_cost_under_a_floats_range_is_no_new_phase_and_no_error():
    """The phase detection's reference (the earlier windows' weighted mean compute per step) underflowed
    to 0 where one earlier window's 5e-324 s step sat beside another of 0 s with many steps: its test
    divided by it, and ``observe`` raised ZeroDivisionError (the window was kept: every later window of the
    job raised again)."""
    bank = PredictorBank(prior=None)
    bank.observe("j", _window(g=0.0, steps=1000, rate=100.0))
    bank.observe("j", _window(g=5e-324, steps=1, rate=100.0))
    for _ in range(2):
        bank.observe("j", _window(g=0.1, steps=30, rate=10.0))
    cur = bank.curve("j")
    assert cur.extra["phase_changes"] == 0 and cur.extra["windows"] == 4
    check_curve(cur, "none")


@pytest.mark.parametrize("bs", [0.5, 1e-300, 5e-324])
def test_a_window_of_under_one_sample_a_step_is_refused(bs):
    """A step delivers one sample at least. The record took any batch size above 0, and a window of
    5e-324 samples a step with a 1 s step made a curve whose ceiling (batch_size / compute per step)
    underflowed to 0: normalized() read 1.0 at every configuration, the job "satisfied" on no cores."""
    with pytest.raises(BadObservation, match="'batch_size' must be at least 1"):
        _window(bs=bs, g=1.0)
    assert _window(bs=1, g=1.0).batch_size == 1
