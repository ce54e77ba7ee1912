"""The curve's memo (``ThroughputCurve.memo``: the policy's ``normalized`` values and fairness floors,
``agent.policies.curve_value`` and ``job_floor``) changes no decision: plans made with it are the plans made without it
(``predictor.curve.MEMO_ENTRIES = 0``), on random node sequences decided by the policy alone and by the
controller with the real predictor, and a change of any input a floor depends on is seen through it.

Unit tier: pure functions (the controller with no-op actuators and an in-process predictor).
"""
from __future__ import annotations

import dataclasses
import random

import pytest

import predictor.curve
from agent import policies
from agent.controller import Controller
from agent.policies import PolicyConfig, adaptive, get_policy
from evaluation import controller_bench
from evaluation.random_nodes import random_node
from predictor.bank import PredictorBank

pytestmark = pytest.mark.unit


def plan_key(plan) -> tuple:
    """Everything a plan decides, to the last bit (``repr`` of floats is exact)."""
    return (repr(sorted(plan.allocations.items())), repr(sorted(plan.unsatisfied.items())),
            repr(plan.predicted_total), repr(plan.node))


@pytest.fixture
def floors_computed(monkeypatch):
    """How many floors were computed (not found in a curve's memo)."""
    n = [0]
    compute = policies._compute_job_floor

    def counted(curve, f):
        n[0] += 1
        return compute(curve, f)

    monkeypatch.setattr(policies, "_compute_job_floor", counted)
    return n


def evolving_nodes(seed: int, nodes: int = 60, steps: int = 6) -> list:
    """Plans of random nodes (``evaluation.random_nodes``), each decided ``steps`` times in a row with the
    same curve objects, its previous plan applied, and between decisions, at random, nothing changed or
    one input a floor depends on: a job's habit (``requested_workers``), its trainers' CPU, its GPUs,
    its ``max_workers``, the node's loader CPUs, or a job's curve (a new window: a new object)."""
    rng = random.Random(seed)
    out = []
    for _ in range(nodes):
        s, curves, cfg = random_node(rng)
        for _ in range(steps):
            plan = adaptive(s, curves, cfg)
            out.append(plan_key(plan))
            out.append(plan_key(adaptive(dataclasses.replace(s, applied={}), curves, cfg)))   # (no hold)
            s = dataclasses.replace(s, applied=dict(plan.allocations))
            j = rng.choice(sorted(s.jobs))
            job = s.jobs[j]
            change = rng.choice(["none", "none", "habit", "trainer", "gpus", "bound", "node", "curve"])
            if change == "habit":
                job = dataclasses.replace(job, requested_workers=rng.choice([1, 2, 4, 8, 16]))
            elif change == "trainer":
                job = dataclasses.replace(job, trainer_cpu_s_per_step=rng.uniform(0, 0.9) * job.compute_s_per_step)
            elif change == "gpus":
                g = rng.choice([1, 2, 4])
                job = dataclasses.replace(job, gpus=g, ranks=g)
            elif change == "bound":
                job = dataclasses.replace(job, max_workers=rng.choice([None, 1, 2, 8]))
            elif change == "node":
                s = dataclasses.replace(s, loader_cpus=s.loader_cpus * rng.uniform(0.8, 1.0))
            elif change == "curve" and j in curves:
                curves = dict(curves)
                curves[j] = dataclasses.replace(curves[j], cpu_s_per_batch=curves[j].cpu_s_per_batch * 1.2)
            s = dataclasses.replace(s, jobs={**s.jobs, j: job})
    return out


def test_random_node_sequences_plan_the_same_with_and_without_the_memo(monkeypatch, floors_computed):
    """... and every floor the memo answered is the floor computed afresh (a new curve object, the same
    inputs), which a plan may not show (a floor under what the greedy gives, a held plan)."""
    answered = policies.job_floor
    stale = []

    def checked(curve, f):
        out = answered(curve, f)
        if out != policies._compute_job_floor(dataclasses.replace(curve), f):
            stale.append((curve.job, f))
        return out

    monkeypatch.setattr(policies, "job_floor", checked)
    with_memo = evolving_nodes(seed=11)
    assert not stale
    monkeypatch.setattr(policies, "job_floor", answered)
    floors_computed[0] = 0
    evolving_nodes(seed=11)             # (again, unchecked: what it computes, the check's aside)
    cached_runs = floors_computed[0]
    floors_computed[0] = 0
    monkeypatch.setattr(predictor.curve, "MEMO_ENTRIES", 0)
    without = evolving_nodes(seed=11)
    assert with_memo == without
    # (not vacuous: the memo kept floors, and the run without it computed every one)
    assert 0 < cached_runs < 0.8 * floors_computed[0]


def controller_plans(scenario: str, seed: int, cores: float = 6.0, jobs: int = 12, ticks: int = 30) -> list:
    """Every plan of a controller with the real predictor over the controller bench's node sequence
    (every job's figures move a few percent each tick; ``churn``: one job leaves and one arrives each tick)."""
    snaps = iter(controller_bench.snapshots(random.Random(seed), jobs, cores, ticks, scenario == "churn"))
    c = Controller(snapshot_source=lambda now: next(snaps), policy=get_policy("adaptive"),
                   policy_config=PolicyConfig(), predictor=PredictorBank(),
                   actuators=[controller_bench.NullActuator()])
    out = []
    for t in range(ticks):
        rec = c.tick(now=float(t))
        assert not rec.errors
        out.append(plan_key(rec.plan))
    return out


@pytest.mark.parametrize("scenario", ["steady", "churn"])
def test_controller_plans_the_same_with_and_without_the_memo(monkeypatch, floors_computed, scenario):
    with_memo = [controller_plans(scenario, seed) for seed in (1, 2)]
    cached_runs = floors_computed[0]
    floors_computed[0] = 0
    monkeypatch.setattr(predictor.curve, "MEMO_ENTRIES", 0)
    assert with_memo == [controller_plans(scenario, seed) for seed in (1, 2)]
    assert cached_runs < floors_computed[0]     # ticks found floors in the memo


def two_jobs(**b_fields):
    """A 4-CPU node with two warm jobs, ``b`` CPU-heavy; its curves."""
    s, curves, _ = random_node(random.Random(0))
    a = dataclasses.replace(next(iter(s.jobs.values())), job="a", gpus=1, ranks=1, requested_workers=4,
                            max_workers=None, trainer_cpu_s_per_step=0.0, allowed_cpus=(), steps_left=None,
                            compute_s_per_step=0.1, cpu_s_per_batch=0.15, blocked_s_per_batch=0.0,
                            worker_memory_bytes=0)
    b = dataclasses.replace(a, job="b", cpu_s_per_batch=0.4, **b_fields)
    s = dataclasses.replace(s, loader_cpus=3.6, cpu_ids=(0, 1, 2, 3), jobs={"a": a, "b": b}, applied={},
                            loader_memory_bytes=None, foreign_cpu_cores=0.0, busy_cpu_cores=0.0)
    from evaluation.random_nodes import curve_for
    return s, {j: curve_for(s.jobs[j]) for j in s.jobs}


@pytest.mark.parametrize("change", [dict(requested_workers=1), dict(trainer_cpu_s_per_step=0.08),
                                    dict(max_workers=1), dict(gpus=4, ranks=4)])
def test_a_changed_input_is_not_answered_from_the_memo(change):
    """Decided once (its floors kept in the curves' memos), then one of job b's inputs changes with the
    same curve objects: the plan is the one made from fresh curves, and it differs from the plan before
    the change (what a memo that missed the change would have answered)."""
    cfg = PolicyConfig(floor_reference="habit")
    s, curves = two_jobs()
    before = plan_key(adaptive(s, curves, cfg))
    assert any(k[0] == "floor" for k in curves["b"].memo)
    changed = dataclasses.replace(s, jobs={**s.jobs, "b": dataclasses.replace(s.jobs["b"], **change)})
    fresh = {j: dataclasses.replace(c) for j, c in curves.items()}    # new objects: empty memos
    assert not fresh["b"].memo
    after = plan_key(adaptive(changed, curves, cfg))
    assert after == plan_key(adaptive(changed, fresh, cfg))
    assert after != before


def test_the_memo_is_the_curves_own_and_bounded(monkeypatch):
    """A new curve (``dataclasses.replace``, as the predictor makes one from a new window) starts with an
    empty memo; equal curves are still equal whatever their memos hold; a full memo starts afresh."""
    s, curves = two_jobs()
    c = curves["b"]
    v = policies.curve_value(c, 2, 1.5)
    assert v == c.normalized(2, 1.5) and c.memo == {(2, 1.5): v}
    d = dataclasses.replace(c)
    assert not d.memo and d == c
    monkeypatch.setattr(predictor.curve, "MEMO_ENTRIES", 3)
    for x in (1.0, 2.0, 3.0):
        policies.curve_value(c, 1, x)
    assert c.memo == {(1, 3.0): c.normalized(1, 3.0)}
