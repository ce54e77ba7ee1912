"""ThroughputCurve invariants (hypothesis), knees, and the Observation record's errors (unit tier)."""
import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from predictor.curve import KNEE_TOLERANCE, ThroughputCurve
from predictor.observation import BadObservation, Observation

pytestmark = pytest.mark.unit

pos = st.floats(min_value=1e-4, max_value=2.0, allow_nan=False)
nonneg = st.floats(min_value=0.0, max_value=2.0, allow_nan=False)
corr = st.floats(min_value=0.1, max_value=5.0)


@st.composite
def curves(draw):
    kc = draw(st.one_of(st.none(), corr))
    return ThroughputCurve(
        job="j", batch_size=draw(st.integers(1, 512)), compute_s_per_step=draw(pos),
        cpu_s_per_batch=draw(nonneg), blocked_s_per_batch=draw(nonneg), correction=draw(corr),
        core_correction=kc, sharpness=draw(st.sampled_from([0.0, 2.0, 4.0, 6.0, 12.0])),
        overhead_s_per_step=draw(st.floats(0.0, 0.05)))


workers = st.floats(min_value=0.0, max_value=64.0)
cores = st.floats(min_value=0.0, max_value=64.0)


@settings(max_examples=300, deadline=None)
@given(curves(), workers, cores)
def test_throughput_bounded(cur, w, c):
    t = cur.throughput(w, c)
    assert t >= 0
    assert t <= cur.ceiling_samples_per_s * (1 + 1e-9)
    assert 0.0 <= cur.normalized(w, c) <= 1.0


@settings(max_examples=300, deadline=None)
@given(curves(), workers, cores, st.floats(0.0, 8.0), st.floats(0.0, 8.0))
def test_non_decreasing_in_workers_and_cores(cur, w, c, dw, dc):
    if w >= 1:  # from 1 worker on (0 = in-process loading is a different regime)
        assert cur.throughput(w + dw, c) >= cur.throughput(w, c) * (1 - 1e-9)
    assert cur.throughput(w, c + dc) >= cur.throughput(w, c) * (1 - 1e-9)


@settings(max_examples=200, deadline=None)
@given(curves(), st.floats(0.1, 16.0))
def test_knee_is_least_count_within_tolerance(cur, c):
    k = cur.knee_workers(c)
    assume_limit = cur.throughput(1e15, c)  # unlimited workers
    if k >= 1 << 16 or assume_limit == math.inf:
        return
    assert cur.throughput(k, c) >= (1 - KNEE_TOLERANCE) * assume_limit * (1 - 1e-6)
    if k > 1:
        assert cur.throughput(k - 1, c) < (1 - KNEE_TOLERANCE) * assume_limit * (1 + 1e-6)


@settings(max_examples=200, deadline=None)
@given(curves(), st.floats(0.1, 16.0), st.floats(0.0, 16.0))
def test_knee_non_decreasing_in_cores(cur, c, dc):
    assert cur.knee_workers(c + dc) >= cur.knee_workers(c)
    assert cur.max_useful_workers >= cur.knee_workers(c)


extreme = st.sampled_from([0.0, 5e-324, 1e-300, 1e-12, 1e-3, 1.0, 1e6, 1e12, 1e300, 1.7e308])


@st.composite
def extreme_curves(draw):
    """Curves with each parameter anywhere in a float's range (a lying client's window, a simulator's)."""
    return ThroughputCurve(
        job="j", batch_size=draw(st.sampled_from([1, 32, 10 ** 9])), compute_s_per_step=draw(extreme),
        cpu_s_per_batch=draw(extreme), blocked_s_per_batch=draw(extreme),
        correction=draw(st.sampled_from([1e-300, 1e-9, 0.05, 1.0, 20.0, 1e300])),
        core_correction=draw(st.sampled_from([None, 5e-324, 1e-9, 1.0, 1e300])),
        sharpness=draw(st.sampled_from([0.0, 2.0, 20.0])), overhead_s_per_step=draw(extreme),
        worker_memory_bytes=draw(extreme))


@settings(max_examples=200, deadline=None)
@given(extreme_curves(), st.sampled_from([0.0, 0.05, 1.0, 512.0, 1e300]), st.sampled_from([0, 1, 3, 64, 10 ** 6]),
       extreme)
def test_a_curve_anywhere_in_a_floats_range_answers_every_question(cur, c, w, memory):
    """knee_workers raised OverflowError where the workers needed were beyond a float (c = 1e300 with a
    1e-12 s step), max_useful_cores ZeroDivisionError where g x correction underflowed to 0, and
    workers_within OverflowError where the budget over a worker's cost was inf: a policy that asked
    raised for every job of the node."""
    assert 1 <= cur.max_useful_workers <= 1 << 16 and 1 <= cur.knee_workers(c) <= 1 << 16
    assert cur.max_useful_cores >= 0
    t = cur.throughput(w, c)
    assert t >= 0 and not math.isnan(t)
    assert 0.0 <= cur.normalized(w, c) <= 1.0
    assert not math.isnan(cur.marginal_gain(w, c))
    n = cur.workers_within(memory)
    assert isinstance(n, int) and n >= 0


def test_blocked_time_adds_workers_not_cores():
    cpu = ThroughputCurve(job="a", batch_size=32, compute_s_per_step=0.05, cpu_s_per_batch=0.1,
                          blocked_s_per_batch=0.0)
    io = ThroughputCurve(job="b", batch_size=32, compute_s_per_step=0.05, cpu_s_per_batch=0.1,
                         blocked_s_per_batch=0.2)
    assert io.max_useful_workers > cpu.max_useful_workers
    assert io.max_useful_cores == pytest.approx(cpu.max_useful_cores)
    assert cpu.marginal_gain(1, 1.0) > 0


def _obs_dict():
    return Observation(workers=2, cores=1.0, batch_size=8, compute_s_per_step=0.01, data_wait_s_per_step=0.0,
                       cpu_s_per_batch=0.01, wall_s_per_batch=0.01, runq_s_per_batch=0.0, blocked_s_per_batch=0.0,
                       samples_per_s=100.0, duration_s=1.0, steps=10).to_dict()


@pytest.mark.parametrize("field,value", [("cores", 0), ("batch_size", 0), ("samples_per_s", float("nan")),
                                         ("steps", "many"), ("workers", True), ("duration_s", -1),
                                         ("compute_s_per_step", 1e300), ("cores", 1e-300), ("steps", 10 ** 20)])
def test_bad_record_names_field(field, value):
    d = _obs_dict()
    d[field] = value
    with pytest.raises(BadObservation, match=field):
        Observation.from_dict(d)


def test_empty_and_newer_records():
    with pytest.raises(BadObservation, match="missing field 'workers'"):
        Observation.from_dict({})
    with pytest.raises(BadObservation, match="must be a dict"):
        Observation.from_dict(None)
    d = _obs_dict()
    d["version"] = 99
    with pytest.raises(BadObservation, match="upgrade"):
        Observation.from_dict(d)
    d = _obs_dict()
    d["future_field"] = 1  # unknown keys are ignored
    assert Observation.from_dict(d).workers == 2


def test_core_efficiency_is_the_core_bound_terms_correction():
    # the core-bound term is core_efficiency x cores / c: with workers to spare and a long step
    # elsewhere, the throughput on few cores is that term
    base = dict(job="j", batch_size=1, compute_s_per_step=1e-6, cpu_s_per_batch=0.1,
                blocked_s_per_batch=0.0, correction=0.8)
    own = ThroughputCurve(**base, core_correction=0.5)
    shared = ThroughputCurve(**base)
    assert own.core_efficiency == 0.5 and shared.core_efficiency == 0.8
    for cur in (own, shared):
        assert cur.throughput(64, 0.2) == pytest.approx(cur.core_efficiency * 0.2 / 0.1, rel=1e-9)


_PLAIN = dict(job="j", batch_size=32, compute_s_per_step=0.1, cpu_s_per_batch=0.3, blocked_s_per_batch=0.1)


@pytest.mark.parametrize("field, value, words", [
    ("sharpness", 0.5, "must be 0 (hard minimum) or at least 1"),
    ("sharpness", -2.0, "must be >= 0"),
    ("sharpness", float("nan"), "must be a finite number"),
    ("compute_s_per_step", -0.1, "must be >= 0"),
    ("cpu_s_per_batch", float("inf"), "must be a finite number"),
    ("blocked_s_per_batch", float("nan"), "must be a finite number"),
    ("correction", 0.0, "must be > 0"),
    ("correction", "1", "must be a finite number"),
    ("core_correction", 0.0, "must be > 0"),
    ("core_correction", float("inf"), "must be None or a finite number"),
    ("batch_size", 0, "must be > 0"),
    ("batch_size", True, "must be a finite number"),
    ("confidence", 1.5, "must be between 0 and 1"),
    ("observed_configs", 1.5, "must be a whole number"),
    ("overhead_s_per_step", float("inf"), "must be a finite number"),
    ("worker_memory_bytes", -1.0, "must be >= 0"),
])
def test_a_curve_is_validated_where_it_is_made_naming_the_field(field, value, words):
    """As a Prior is (predictor.prior): a hand-made curve with 0 < sharpness < 1 (a soft minimum that
    says a batch takes longer than its three limits one after another), a non-finite or negative figure,
    a zero correction (knee_workers divides by it) is a ValueError naming the field, also when it is
    made from another curve with dataclasses.replace."""
    import dataclasses

    with pytest.raises(ValueError) as e:
        ThroughputCurve(**{**_PLAIN, field: value})
    assert f"throughput curve of job 'j': field {field!r} {words}" in str(e.value), str(e.value)
    with pytest.raises(ValueError, match=f"field {field!r}"):
        dataclasses.replace(ThroughputCurve(**_PLAIN), **{field: value})


def test_the_edges_of_a_valid_curve_are_taken():
    from predictor import prior

    assert prior.MIN_SHARPNESS == 1.0
    for p in (0.0, 1.0, 1.5, 1e300):
        assert ThroughputCurve(**_PLAIN, sharpness=p).max_useful_workers >= 1
    ThroughputCurve(**{**_PLAIN, "batch_size": 32.5}, confidence=1.0, core_correction=1e-300, correction=1e300,
                    overhead_s_per_step=0.0, worker_memory_bytes=1.7e308, observed_configs=0)


@pytest.mark.parametrize("p", [23_000.0, 25_000.0, 1e6, 1e300])
def test_a_very_sharp_curve_has_knees_near_the_hard_minimums(p):
    """The knee factor 1 / ((1 - tol)^-p - 1)^(1/p) raised OverflowError from p of about 23,000; taken in
    log space past that, it tends to the hard minimum's 1 - tol, and the knees follow."""
    from predictor.curve import KNEE_TOLERANCE

    sharp = ThroughputCurve(job="j", batch_size=32, compute_s_per_step=0.1, cpu_s_per_batch=0.3,
                            blocked_s_per_batch=0.1, sharpness=p)
    hard = ThroughputCurve(job="j", batch_size=32, compute_s_per_step=0.1, cpu_s_per_batch=0.3,
                           blocked_s_per_batch=0.1)
    assert sharp._knee_factor == pytest.approx(1.0 - KNEE_TOLERANCE, rel=1e-3)
    assert sharp.max_useful_workers == hard.max_useful_workers
    assert sharp.max_useful_cores == pytest.approx(hard.max_useful_cores, rel=1e-3)
    below = ThroughputCurve(job="j", batch_size=32, compute_s_per_step=0.1, cpu_s_per_batch=0.3,
                            blocked_s_per_batch=0.1, sharpness=22_000.0)   # (the power's own branch)
    assert below._knee_factor == pytest.approx(sharp._knee_factor, rel=1e-4)


def test_a_supply_cap_bounds_throughput_and_brings_the_knees_down_to_it():
    """A measured supply cap (what the job's data source gives however many workers read it) is a fourth
    limit: no worker count or core count predicts more, and the knees are where the cap is reached, not
    the GPU's ceiling. 0 (the default) changes nothing."""
    free = ThroughputCurve(job="io", batch_size=32, compute_s_per_step=0.05, cpu_s_per_batch=0.02,
                           blocked_s_per_batch=0.08)
    capped = dataclasses.replace(free, supply_cap_samples_per_s=320.0)      # 10 batches/s; the GPU does 20
    assert free.max_useful_workers == 2 and free.throughput(2, 8.0) == pytest.approx(640.0)
    assert capped.throughput(64, 64.0) == pytest.approx(320.0) and capped.throughput(1, 8.0) == pytest.approx(320.0)
    assert capped.max_useful_workers == 1 and capped.knee_workers(8.0) == 1
    assert capped.max_useful_cores == pytest.approx((1 - KNEE_TOLERANCE) * 0.02 * 10.0)
    assert capped.normalized(64, 64.0) == pytest.approx(0.5)            # its GPU waits half the time
    from predictor.curve import shared_cpu_knee, shared_cpu_throughput
    assert shared_cpu_throughput(capped, 8, 2.0, 0.01) <= 320.0 + 1e-9
    assert shared_cpu_knee(capped, 2.0, 0.01, 8) == 1
    with pytest.raises(ValueError, match="supply_cap_samples_per_s"):
        dataclasses.replace(free, supply_cap_samples_per_s=-1.0)
