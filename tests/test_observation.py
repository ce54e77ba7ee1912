"""predictor/observation.py: the one counters -> window rule (``counter_deltas``, ``blocked_s``,
``Observation.from_window``) that the collector, the autotuner and ``adloader profile`` share."""
from __future__ import annotations

import pytest

from predictor.observation import Observation, blocked_s, counter_deltas

pytestmark = pytest.mark.unit


def _totals(t, steps, batches, cpu, wall, runq, blocked=None, **kw):
    d = {"uptime_s": t, "steps": steps, "samples": steps * 8, "batches": batches, "data_wait_s": 0.1 * steps,
         "compute_s": 0.2 * steps, "worker_cpu_s": cpu, "worker_wall_s": wall, "worker_runq_s": runq, **kw}
    if blocked is not None:
        d["worker_blocked_s"] = blocked
    return d


def test_negative_and_missing_deltas_count_zero():
    d = counter_deltas({"steps": 10, "samples": 5.0, "batches": 3}, {"steps": 4, "samples": 9.0},
                       ("steps", "samples", "batches", "nowhere"))
    assert d == {"steps": 0.0, "samples": 4.0, "batches": 0.0, "nowhere": 0.0}
    assert counter_deltas({"steps": "x"}, {"steps": 3}, ("steps",)) == {"steps": 0.0}


def test_blocked_time_is_the_loaders_counter_when_reported_else_wall_minus_cpu_minus_runq():
    d = counter_deltas(_totals(0, 0, 0, 0, 0, 0, blocked=0), _totals(2, 10, 10, 1.0, 3.0, 0.5, blocked=1.2))
    assert blocked_s(d, reported=True) == pytest.approx(1.2)
    assert blocked_s(d, reported=False) == pytest.approx(1.5)
    d = counter_deltas(_totals(0, 0, 0, 0, 0, 0), _totals(2, 10, 10, 3.0, 3.0, 0.5))
    assert blocked_s(d, reported=False) == 0.0                 # never negative


def test_from_window_builds_the_predictors_record():
    o = Observation.from_window(_totals(1, 0, 0, 0, 0, 0, blocked=0), _totals(3, 10, 20, 2.0, 6.0, 1.0, blocked=2.5),
                                workers=3, cores=1.5, batch_size=8)
    assert (o.workers, o.cores, o.batch_size, o.steps, o.duration_s) == (3, 1.5, 8, 10, 2.0)
    assert o.compute_s_per_step == pytest.approx(0.2) and o.data_wait_s_per_step == pytest.approx(0.1)
    assert o.cpu_s_per_batch == pytest.approx(0.1) and o.wall_s_per_batch == pytest.approx(0.3)
    assert o.runq_s_per_batch == pytest.approx(0.05) and o.blocked_s_per_batch == pytest.approx(0.125)
    assert o.samples_per_s == pytest.approx(40.0)
    assert Observation.from_window(_totals(1, 5, 5, 0, 0, 0), _totals(3, 5, 5, 0, 0, 0),
                                   workers=1, cores=1.0, batch_size=8) is None        # no step in the window
    again = Observation.from_window(_totals(1, 0, 0, 0, 0, 0), _totals(3, 10, 20, 2.0, 6.0, 1.0), workers=3,
                                    cores=1.5, batch_size=8, compute_s=1.0, duration_s=4.0)
    assert again.compute_s_per_step == pytest.approx(0.1) and again.duration_s == 4.0
    assert again.blocked_s_per_batch == pytest.approx(0.15)  # no counter reported: (6 - 2 - 1) / 20


def test_the_autotuner_and_the_collector_use_the_same_window():
    """The same two totals give the same per-batch figures to the autotuner and to the collector."""
    from adloader.autotune import observation_from_totals
    from agent.collector import RankRates

    prev = {**_totals(1, 0, 0, 0, 0, 0, blocked=0), "workers": 3, "batch_size": 8, "resizes": 0}
    cur = {**_totals(3, 10, 20, 2.0, 6.0, 1.0, blocked=2.5), "workers": 3, "batch_size": 8, "resizes": 0}
    o = observation_from_totals(prev, cur, cores=1.5)
    rr = RankRates()
    rr.update(prev, 1.0)
    rr.update(cur, 3.0)
    for k in ("cpu_s_per_batch", "wall_s_per_batch", "runq_s_per_batch", "blocked_s_per_batch",
              "compute_s_per_step", "data_wait_s_per_step", "samples_per_s"):
        assert rr.rates[k] == pytest.approx(getattr(o, k)), k


def test_a_batch_size_is_whole_where_it_is_and_a_windows_mean_where_not():
    from predictor.observation import as_batch_size
    assert as_batch_size(32.0) == 32 and isinstance(as_batch_size(32.0), int)
    assert as_batch_size(32.5) == 32.5                   # a batch sampler's mean: never truncated to 32
    prev, cur = _totals(1, 0, 0, 0, 0, 0, blocked=0), _totals(3, 10, 20, 2.0, 6.0, 1.0, blocked=2.5)
    assert Observation.from_window(prev, cur, workers=2, cores=1.0, batch_size=32.5).batch_size == 32.5
    assert Observation.from_dict(Observation.from_window(prev, cur, workers=2, cores=1.0,
                                                         batch_size=32.5).to_dict()).batch_size == 32.5
