"""Reaction: after an arrival or a departure, allocations settle within two windows (controller + adaptive).

Unit tier: fakes for the snapshot source, predictor bank and actuators; ``controller.tick(now=t)``.
"""
from __future__ import annotations

import dataclasses

import pytest

from agent.controller import Controller
from agent.policies import PolicyConfig, get_policy
from predictor.bank import curve_confidence
from tests.fakes import FakeBank, FakeSource, RecordingActuator, job_stats

pytestmark = pytest.mark.unit


# one observation window per tick (the collector's window as long as the tick), so "two ticks" is
# also "two observations"
WINDOW = dict(window_s=1.0)


def heavy(name, **kw):
    return job_stats(name, compute_s_per_step=0.1, cpu_s_per_batch=0.3, blocked_s_per_batch=0.0, **{**WINDOW, **kw})


def light(name, **kw):
    return job_stats(name, compute_s_per_step=0.1, cpu_s_per_batch=0.02, blocked_s_per_batch=0.0, **{**WINDOW, **kw})


def io_bound(name, **kw):
    return job_stats(name, compute_s_per_step=0.1, cpu_s_per_batch=0.05, blocked_s_per_batch=0.3, **{**WINDOW, **kw})


def run(controller, t0, n):
    """Tick n times from t0; return the ticks (as offsets) at which anything was applied."""
    changed = []
    for i in range(n):
        rec = controller.tick(now=t0 + i)
        if rec.results:
            changed.append(i)
    return changed


def banks():
    yield "fake", FakeBank
    try:
        from predictor.bank import PredictorBank
    except ImportError:
        return
    yield "predictor.bank", lambda: PredictorBank()


@pytest.mark.parametrize("bank_name,make_bank", list(banks()), ids=[b for b, _ in banks()])
@pytest.mark.parametrize("policy,min_confidence", [("adaptive", None), ("adaptive", 0.0), ("even", None),
                                                   ("even-static", None), ("none", None)])
def test_settles_within_two_windows_after_arrival_and_departure(bank_name, make_bank, policy, min_confidence):
    """An arriving job gets its cold-start share at once; adaptive moves it once more when its curve is
    sure enough (``min_confidence``: by default the second window, 0: the first), then nothing moves."""
    cfg = PolicyConfig() if min_confidence is None else PolicyConfig(min_confidence=min_confidence)
    windows = 1 + (policy == "adaptive" and cfg.min_confidence > curve_confidence(1, 1))
    src = FakeSource(1.8, [heavy("a"), light("b")])
    act = RecordingActuator()
    c = Controller(snapshot_source=src, policy=get_policy(policy), policy_config=cfg,
                   predictor=make_bank(), actuators=[act])
    changed = run(c, 0.0, 6)
    assert changed and max(changed) <= windows, changed
    # arrival: a cold job (no window yet), whose first window shows up one tick later
    src.jobs["c"] = io_bound("c", window_s=0.0)
    rec = c.tick(now=10.0)
    assert "c" in rec.plan.allocations and rec.results["c"].ok
    src.jobs["c"] = io_bound("c")
    changed = run(c, 11.0, 6)
    assert len(changed) <= 1, changed                     # at most one move: to the plan from its curve
    if windows == 1:
        assert all(i <= 0 for i in changed), changed      # on its first window
    else:
        assert changed and changed[0] >= 1, changed       # not before its second window
    assert sum(x.cpus for x in c.applied().values()) <= 1.8 + 1e-6
    # departure: the share goes out in the same tick, then nothing moves
    del src.jobs["a"]
    rec = c.tick(now=20.0)
    assert rec.departed == ("a",) and "a" in act.released
    changed = run(c, 21.0, 6)
    assert all(i <= 0 for i in changed), changed
    if policy in ("adaptive", "even"):
        assert sum(x.cpus for x in c.applied().values()) == pytest.approx(1.8)


def test_adaptive_gives_the_departed_share_to_who_can_use_it():
    src = FakeSource(1.8, [heavy("a"), heavy("b"), light("c")])
    c = Controller(snapshot_source=src, policy=get_policy("adaptive"), policy_config=PolicyConfig(),
                   predictor=FakeBank(), actuators=[RecordingActuator()])
    run(c, 0.0, 3)
    before = c.applied()["a"].cpus
    del src.jobs["b"]
    c.tick(now=5.0)
    after = c.applied()
    assert after["a"].cpus > before + 0.5 and after["c"].cpus < 0.35
    assert "marginal gain" in after["a"].reason or "spare" in after["a"].reason


def test_breaker_is_visible_in_the_record_and_spares_other_jobs():
    src = FakeSource(1.8, [heavy("a"), light("b")])
    c = Controller(snapshot_source=src, policy=get_policy("adaptive"), policy_config=PolicyConfig(),
                   predictor=FakeBank(), actuators=[RecordingActuator(fail_jobs={"a"})])
    recs = [c.tick(now=float(t)) for t in range(4)]
    assert "a" in recs[-1].breakers and "b" not in recs[-1].breakers
    assert "b" in c.applied() and "a" not in c.applied()
    assert recs[-1].to_dict()["breakers"]["a"].startswith("3 failures")


@pytest.mark.parametrize("bank_name,make_bank", list(banks()), ids=[b for b, _ in banks()])
@pytest.mark.parametrize("floor_reference", ["share", "habit"])
@pytest.mark.parametrize("seed", [7, 3, 5, 6, 8])
def test_measurement_noise_does_not_make_adaptive_oscillate(bank_name, make_bank, floor_reference, seed):
    """+-3% noise on every job's figures every tick: after settling, nothing is re-applied. (Seeds 3-8
    re-applied a settled plan once with floor_reference "habit" while a move in which no job was
    predicted worse passed the hold without the hysteresis: a job's noisy estimate of the cores it can
    use handed its spare to a neighbour.)"""
    import random

    rng = random.Random(seed)
    base = [heavy("a"), light("b"), io_bound("c"), heavy("d", gpus=2)]
    src = FakeSource(3.0, base)
    act = RecordingActuator()
    c = Controller(snapshot_source=src, policy=get_policy("adaptive"),
                   policy_config=PolicyConfig(floor_reference=floor_reference),
                   predictor=make_bank(), actuators=[act])
    changed = []
    for t in range(40):
        for j in base:
            f = rng.uniform(0.97, 1.03)
            src.jobs[j.job] = dataclasses.replace(j, cpu_s_per_batch=j.cpu_s_per_batch * f,
                                                  compute_s_per_step=j.compute_s_per_step * rng.uniform(0.97, 1.03))
        if c.tick(now=float(t)).results:
            changed.append(t)
    assert changed and max(changed) <= 3, changed


def needs(name, cores, **kw):
    """A job whose loader needs ``cores`` for its ceiling (0.1-s steps)."""
    return job_stats(name, compute_s_per_step=0.1, cpu_s_per_batch=0.1 * cores, blocked_s_per_batch=0.0,
                     **{**WINDOW, **kw})


@pytest.mark.parametrize("n", [3, 16])
def test_a_new_phase_that_lifts_one_job_moves_on_a_node_of_any_size(n):
    """Every job needs 1.5 cores; then one needs 3 (a new phase of its pipeline) and another 0.5: the
    first gets what it needs, on a node of 16 jobs as on one of 3. On 16 the move (60% -> 100% of one
    job's ceiling) is 2.6% of the node's throughput, and the hold's band held it for good."""
    src = FakeSource(1.8 * n, [needs(f"j{i}", 1.5) for i in range(n)])
    c = Controller(snapshot_source=src, policy=get_policy("adaptive"), policy_config=PolicyConfig(),
                   predictor=FakeBank(), actuators=[RecordingActuator()])
    run(c, 0.0, 6)
    assert c.applied()["j0"].cpus < 2.0
    src.jobs["j0"], src.jobs["j1"] = needs("j0", 3.0), needs("j1", 0.5)
    assert run(c, 6.0, 8)
    a = c.applied()["j0"]
    assert a.cpus >= 3.0 and a.workers >= 3, a


@pytest.mark.parametrize("n", [4, 8])
def test_a_held_plan_never_keeps_a_job_under_its_floor(n):
    """A light job (0.2 cores) beside heavy ones that take the rest turns heavy (a new phase): its GPU
    share is its floor again, though the node gains nothing by it (its cores buy what they bought its
    neighbours). The hold kept it at 0.24 cores, 8% of its ceiling, for good."""
    src = FakeSource(1.8 * n, [needs("j0", 0.2)] + [needs(f"j{i}", 3.0) for i in range(1, n)])
    c = Controller(snapshot_source=src, policy=get_policy("adaptive"), policy_config=PolicyConfig(),
                   predictor=FakeBank(), actuators=[RecordingActuator()])
    run(c, 0.0, 6)
    assert c.applied()["j0"].cpus < 0.5
    src.jobs["j0"] = needs("j0", 3.0)
    assert run(c, 6.0, 8)
    a = c.applied()["j0"]
    assert a.cpus >= 1.8 - 1e-6 and a.workers >= 2 and "fairness floor" in a.reason, a


@pytest.mark.parametrize("bank_name,make_bank", list(banks()), ids=[b for b, _ in banks()])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_measurement_noise_does_not_make_adaptive_oscillate_on_a_big_node(bank_name, make_bank, seed):
    """The noise test's four kinds of job four times over, 12 loader cores: after settling, nothing is
    re-applied. Neither rule that lets a move past the band on a big node (one job lifted at little
    cost to the others; a job under its floor) fires on +-3% noise: between two like 2-GPU jobs, noise
    moves a spare one way and back, one's lift the other's loss."""
    import random

    rng = random.Random(seed)
    kinds = (heavy, light, io_bound, lambda j: heavy(j, gpus=2))
    base = [kinds[i % 4](f"j{i}") for i in range(16)]
    src = FakeSource(12.0, base)
    c = Controller(snapshot_source=src, policy=get_policy("adaptive"), policy_config=PolicyConfig(),
                   predictor=make_bank(), actuators=[RecordingActuator()])
    changed = []
    for t in range(40):
        for j in base:
            src.jobs[j.job] = dataclasses.replace(j, cpu_s_per_batch=j.cpu_s_per_batch * rng.uniform(0.97, 1.03),
                                                  compute_s_per_step=j.compute_s_per_step * rng.uniform(0.97, 1.03))
        if c.tick(now=float(t)).results:
            changed.append(t)
    assert changed and max(changed) <= 3, changed
