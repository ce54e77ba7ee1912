"""Unit tests (pure): the bench's metric formulas and the oracle on known curves."""
from __future__ import annotations

import itertools
import math

import pytest

from evaluation import metrics as M
from evaluation.oracle import even_objective, solve, value_from_curve, value_from_sweep
from predictor.curve import ThroughputCurve

pytestmark = pytest.mark.unit


def test_jain_index_equal_and_one_hog():
    assert M.jain_index([0.5, 0.5, 0.5]) == pytest.approx(1.0)
    assert M.jain_index([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)
    assert M.jain_index([1.0, 2.0]) == pytest.approx(9 / 10)
    assert M.jain_index([]) == 1.0


def test_percentile_matches_linear_interpolation():
    xs = list(range(1, 21))               # 1..20
    assert M.percentile(xs, 95) == pytest.approx(19.05)
    assert M.percentile(xs, 50) == pytest.approx(10.5)
    assert M.percentile([7.0], 95) == 7.0
    assert math.isnan(M.percentile([], 95))


def test_time_weighted_idle_and_mean():
    # a step series: 0 on [0,2), 1 on [2,10) -> mean over [0,10] = 0.8
    assert M.time_weighted_mean([0, 2], [0.0, 1.0], 0, 10) == pytest.approx(0.8)
    # window inside: [1,3] -> 0.5
    assert M.time_weighted_mean([0, 2], [0.0, 1.0], 1, 3) == pytest.approx(0.5)
    # two jobs: 2 s waiting of 10 alive, 6 of 10 -> 8/20
    assert M.gpu_idle_fraction([2.0, 6.0], [10.0, 10.0]) == pytest.approx(0.4)


def test_makespan_and_jct():
    arr = {"a": 0.0, "b": 5.0, "c": 7.0}
    fin = {"a": 20.0, "b": 12.0, "c": 30.0}
    assert M.makespan(list(arr.values()), list(fin.values())) == 30.0
    assert M.completion_times(arr, fin) == {"a": 20.0, "b": 7.0, "c": 23.0}


def test_gpu_weighted_mean_counts_a_job_once_per_gpu():
    # a 2-GPU job finishing in 10 s and a 1-GPU job in 40 s: three GPUs waited 10, 10 and 40 s
    assert M.gpu_weighted_mean({"a": 10.0, "b": 40.0}, {"a": 2, "b": 1}) == pytest.approx(20.0)
    assert M.mean([10.0, 40.0]) == pytest.approx(25.0)
    # a job without a GPU count (or 0) counts once, as the aggregate throughput counts it
    assert M.gpu_weighted_mean({"a": 10.0, "b": 40.0}, {"b": 0}) == pytest.approx(25.0)
    assert math.isnan(M.gpu_weighted_mean({}, {}))


def test_dynamic_summary_gives_each_repeats_finishing_times_against_the_best_baseline():
    """With fixed work, every repeat's makespan, mean JCT and GPU-weighted mean JCT of a policy are
    compared with the best user baseline's in the same repeat (theirs / its: above 1, it finishes
    sooner); the GPU-weighted JCT may favour it where the plain mean does not."""
    from evaluation import report

    def phase(rep, policy, span, jct, gjct):
        return {"scenario": "dynamic", "rep": rep, "policy": policy,
                "metrics": {"agg_normalised": 1.0, "makespan_s": span, "jct_mean_s": jct, "jct_gpu_mean_s": gjct}}

    phases = [phase(0, "even-static", 80.0, 40.0, 44.0), phase(0, "none", 90.0, 50.0, 50.0),
              phase(0, "adaptive", 80.0, 42.0, 40.0),
              phase(1, "even-static", 78.0, 40.0, 42.0), phase(1, "adaptive", 82.0, 41.0, 42.0)]
    row = report.summarise(phases)["dynamic"]["adaptive"]
    assert row["makespan_s_best_over_all"] == [pytest.approx(1.0), pytest.approx(78 / 82, abs=1e-4)]
    assert row["jct_mean_s_best_over_all"] == [pytest.approx(40 / 42, abs=1e-4), pytest.approx(40 / 41, abs=1e-4)]
    assert row["jct_gpu_mean_s_best_over_all"] == [pytest.approx(1.1), pytest.approx(1.0)]
    assert row["jct_gpu_mean_s_best_over"] == pytest.approx(1.05)
    assert "jct_mean_s_best_over" not in report.summarise(phases)["dynamic"]["none"]    # a baseline itself
    md = report.markdown(report.summarise(phases), [], {})
    assert "| adaptive | 0.976 (1.000, 0.951) | 0.964 (0.952, 0.976) | 1.050 (1.100, 1.000) |" in md, md
    assert "| 42.0 / 41.0 / – |" not in md and "/ 41.0 /" in md        # JCT mean / GPU-weighted / p95


def test_counters_interpolate_and_rate():
    recs = [{"t": 0.0, "samples": 0}, {"t": 1.0, "samples": 100}, {"t": 3.0, "samples": 500}]
    assert M.counter_at(recs, "samples", 2.0) == pytest.approx(300)
    assert M.rate_between(recs, "samples", 1.0, 3.0) == pytest.approx(200)
    assert M.counter_at(recs, "samples", 9.0) == 500


def test_settle_and_last_change():
    ts = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    vs = [1, 1, 0.2, 0.4, 0.9, 1.0, 1.0, 1.0, 1.0, 1.0]
    # event at 1.5: the series is back within 10% of 1.0 from t=4 on -> 2.5 s
    assert M.settle_time(ts, vs, 1.5, 9.0) == pytest.approx(2.5)
    assert M.settle_time(ts, [1.0] * 10, 1.5, 9.0) == 0.0
    assert M.last_change_after([0, 1, 2, 3], [2, 2, 1, 1], 0.5, 3.0) == pytest.approx(1.5)
    assert M.last_change_after([0, 1, 2, 3], [2, 2, 2, 2], 0.5, 3.0) == 0.0


def test_fairness_vs_even():
    assert M.fairness_vs_even({"a": 0.5, "b": 1.0}, {"a": 1.0, "b": 1.0}) == pytest.approx(0.5)


def _curve(job, g, c, b=0.0):
    return ThroughputCurve(job=job, batch_size=32, compute_s_per_step=g, cpu_s_per_batch=c, blocked_s_per_batch=b)


def test_oracle_on_known_curves_is_the_fractional_knapsack():
    # demands (cores to reach the ceiling): A 1.5, B 0.25, C 1.0; budget 2.
    jobs = {"A": value_from_curve(_curve("A", 0.1, 0.15)), "B": value_from_curve(_curve("B", 0.4, 0.1)),
            "C": value_from_curve(_curve("C", 0.1, 0.1))}
    plan = solve(jobs, 2.0)
    # B and C saturate (gain/core 1/0.25 and 1/1.0 beat A's 1/1.5); A gets the rest
    assert plan.cores["B"] == pytest.approx(0.25, abs=0.011)
    assert plan.cores["C"] == pytest.approx(1.0, abs=0.011)
    assert plan.cores["A"] == pytest.approx(0.75, abs=0.011)
    assert plan.objective == pytest.approx(2.5, abs=0.01)
    assert sum(plan.cpus.values()) == pytest.approx(2.0)
    assert all(w >= 1 for w in plan.workers.values())
    assert plan.objective >= even_objective(jobs, 2.0)


def test_oracle_beats_every_grid_allocation_on_measured_points():
    pts = {"x": [(1, 0.6, 0.5), (2, 1.1, 0.8), (3, 1.2, 0.82)],
           "y": [(1, 0.3, 0.9), (2, 0.35, 0.95)],
           "z": [(1, 0.9, 0.3), (2, 1.5, 0.55)]}
    jobs = {j: value_from_sweep(p) for j, p in pts.items()}
    budget = 1.8
    plan = solve(jobs, budget, grid=36)
    assert sum(plan.cores.values()) <= budget + 1e-9
    step = budget / 36
    best = 0.0
    for a, b in itertools.product(range(37), repeat=2):
        c = 36 - a - b
        if c < 0:
            continue
        best = max(best, jobs["x"].value(a * step) + jobs["y"].value(b * step) + jobs["z"].value(c * step))
    assert plan.objective == pytest.approx(best, abs=1e-9)
    # worker counts follow the measured point whose cores cover the allocation
    assert plan.workers["y"] in (1, 2)


def test_sweep_value_is_monotone_and_zero_at_zero():
    jv = value_from_sweep([(1, 0.5, 0.6), (2, 0.9, 0.55), (3, 1.0, 0.9)])
    assert jv.value(0.0) == 0.0
    xs = [i * 0.05 for i in range(40)]
    vals = [jv.value(x) for x in xs]
    assert all(b >= a - 1e-12 for a, b in zip(vals, vals[1:]))
    with pytest.raises(ValueError, match="no measured points"):
        value_from_sweep([])


def test_oracle_agent_policy_replays_the_plan_for_the_jobs_present():
    from evaluation.oracle_agent import make_oracle_policy
    from agent.model import NodeSnapshot
    from tests.fakes import UNMEASURED, job_stats
    from agent.policies import PolicyConfig

    def stats(j):
        return job_stats(j, **UNMEASURED)

    policy = make_oracle_policy({"heavy": [[1, 0.9, 0.45], [2, 1.8, 0.9]], "light": [[1, 0.2, 1.0]]})
    snap = NodeSnapshot(now=0.0, loader_cpus=1.8, cpu_ids=(0, 1),
                        jobs={"heavy": stats("heavy"), "light": stats("light"), "new": stats("new")})
    plan = policy(snap, {}, PolicyConfig())
    a = plan.allocations
    assert set(a) == {"heavy", "light", "new"}
    assert a["new"].cpus == pytest.approx(0.6) and "no measured curve" in a["new"].reason
    assert a["light"].cpus >= 0.2 - 1e-6 and a["heavy"].workers == 2
    assert sum(x.cpus for x in a.values()) <= 1.8 + 1e-6
    again = policy(snap, {}, PolicyConfig())
    assert again.allocations is plan.allocations           # fixed while the set of jobs is
    assert again.node == plan.node                         # the node part follows the live trainers


def test_goal_reports_the_per_repeat_spread_of_its_ratio():
    """A goal's median ratio comes with the range of the per-repeat ratios it is the median of."""
    from evaluation import report

    def phase(rep, policy, agg):
        return {"scenario": "homogeneous", "rep": rep, "policy": policy, "metrics": {"agg_normalised": agg}}

    phases = [phase(0, "even", 2.0), phase(0, "adaptive", 1.9), phase(1, "even", 2.0), phase(1, "adaptive", 2.1),
              phase(2, "even", 2.0), phase(2, "adaptive", 1.96)]
    summary = report.summarise(phases)
    goal = [g for g in report.goals(summary) if g["goal"].startswith("homogeneous")][0]
    assert goal["measured"] == pytest.approx(0.98) and goal["met"] is True
    assert sorted(goal["per_repeat"]) == pytest.approx([0.95, 0.98, 1.05])
    md = report.markdown(summary, [goal], {})
    assert "measured 0.980 (per repeat 0.950–1.050, 3 repeats) — met" in md
    one = report.goals(report.summarise(phases[:2]))
    assert "(one repeat: indicative only)" in report.markdown(report.summarise(phases[:2]), one, {})


def test_per_repeat_ratios_keep_a_failed_repeats_place():
    """A repeat whose phase failed (the policy's or its baseline's) is a gap (None, "–") in the per-repeat
    ratios, not dropped, so the printed list lines up with the cost per phase's, repeat by repeat; the
    median and the goal's range take the repeats that gave a figure."""
    from evaluation import report

    def phase(rep, policy, agg):
        return {"scenario": "homogeneous", "rep": rep, "policy": policy, "metrics": {"agg_normalised": agg}}

    phases = [{"scenario": "homogeneous", "rep": 0, "policy": "even", "error": "job a died", "metrics": {}},
              phase(0, "adaptive", 1.9), phase(1, "even", 2.0), phase(1, "adaptive", 2.1),
              phase(2, "even", 2.0), {"scenario": "homogeneous", "rep": 2, "policy": "adaptive", "error": "x"},
              phase(3, "even", 2.0), phase(3, "adaptive", 1.9)]
    row = report.summarise(phases)["homogeneous"]["adaptive"]
    assert row["ratio_even_all"] == [None, pytest.approx(1.05), None, pytest.approx(0.95)]
    assert row["ratio_even"] == pytest.approx(1.0) and row["reps"] == 3
    goal = [g for g in report.goals(report.summarise(phases)) if g["goal"].startswith("homogeneous")][0]
    assert sorted(goal["per_repeat"]) == pytest.approx([0.95, 1.05])
    summary = {"gpu-weighted": {"adaptive": {"reps": 3, "errors": [], "agg_normalised": 2.0,
                                             "ratio_best": 1.0, "ratio_best_all": [None, 1.05, 0.95]}}}
    assert "| 1.000 (–, 1.050, 0.950) |" in report.markdown(summary, [], {})


def test_calibration_in_fresh_processes_takes_the_least_and_keeps_each(monkeypatch):
    """``calibrate(processes=3)``: every kind measured in three fresh Python processes, one after the
    other (a process's speed can be a lottery on a VM), the least taken as the kind's CPU per sample and
    the step derived from it; each process's figure kept. A process that fails is an error that says
    which one and why, not a silent figure."""
    from evaluation import catalog as C

    cat = C.load_catalog(C.default_catalog_path())
    calib = C.calibrate(cat, 1.8, ["bert"], processes=3)["bert"]
    runs = calib["cpu_s_per_sample_runs"]
    assert len(runs) == 3 and all(r > 0 for r in runs)
    assert calib["cpu_s_per_sample"] == min(runs)
    kind = cat.kinds["bert"]
    want_step = kind.batch_size * min(runs) / (kind.cores_per_gpu * 1.8 / cat.reference_cores)
    assert calib["step_s"] == pytest.approx(min(cat.max_step_s, max(cat.min_step_s, want_step)))
    assert "cpu_s_per_sample_runs" not in C.calibrate(cat, 1.8, ["bert"])["bert"]     # in this process
    monkeypatch.setattr(C, "_MEASURE_CHILD", "import sys; sys.exit('no dataset here')")
    with pytest.raises(RuntimeError, match=r"calibration process 1 of 2 failed \(exit 1\): no dataset here"):
        C.calibrate(cat, 1.8, ["bert"], processes=2)


def test_bench_reports_the_loader_cost_its_workers_paid_against_the_calibration():
    """``report.workload_check``: per scenario and job, the workers' CPU per sample (worker cores over the
    samples/s the job consumed) over the calibrated ``cpu_s_per_sample``, median and range over the
    phases; the markdown names the jobs outside ``WORKLOAD_BAND`` (their loader demand is not the
    catalogue's design). A job whose pipeline changes mid-run is left out."""
    from evaluation import report

    specs = {"a": {"cpu_s_per_sample": 0.001}, "b": {"cpu_s_per_sample": 0.002},
             "c": {"cpu_s_per_sample": 0.001, "phases": [{"after_s": 5.0}]}}

    def phase(rep, policy, a_cores):    # a consumes 500 samples/s, b 200, c 100
        jobs = {"a": {"worker_cpu_cores": a_cores, "samples_per_s": 500.0},
                "b": {"worker_cpu_cores": 0.4, "samples_per_s": 200.0},
                "c": {"worker_cpu_cores": 0.3, "samples_per_s": 100.0}}
        return {"scenario": "trainer-cpu", "rep": rep, "policy": policy, "specs": specs,
                "metrics": {"agg_normalised": 2.0, "jobs": jobs}}

    phases = [phase(0, "none", 0.75), phase(0, "adaptive", 0.7), phase(1, "none", 0.8),
              {"scenario": "trainer-cpu", "rep": 1, "policy": "adaptive", "error": "job a died"}]
    check = report.workload_check(phases)["trainer-cpu"]
    assert set(check) == {"a", "b"}                     # c's cost is a phase's; the failed phase has no jobs
    assert check["a"] == {"x_median": pytest.approx(1.5), "x_min": pytest.approx(1.4), "x_max": pytest.approx(1.6),
                          "phases": 3}
    assert check["b"]["x_median"] == pytest.approx(1.0) and check["b"]["phases"] == 3
    md = report.markdown(report.summarise(phases), [], {}, {"trainer-cpu": check})
    line = [x for x in md.splitlines() if x.startswith("Workload check")]
    assert len(line) == 1 and "a 1.50 [1.40–1.60], b 1.00 [1.00–1.00]" in line[0]
    assert "Outside 0.8–1.25 for a:" in line[0]
    assert "Workload check" not in report.markdown(report.summarise(phases), [], {})


def test_bench_reports_each_phases_cost_per_policy_by_repeat():
    """``report.cost_index``: per scenario and policy, one figure per repeat in repeat order, the median
    over the phase's jobs of the workload check's figure (a phase where every job ran dearer shows as one
    dear figure); a phased job is left out, and a failed phase is a gap (None, "–") in its repeat's place,
    so each list lines up with the per-repeat ratios; the markdown prints it under the check."""
    from evaluation import report

    specs = {"a": {"cpu_s_per_sample": 0.001}, "b": {"cpu_s_per_sample": 0.002},
             "c": {"cpu_s_per_sample": 0.001, "phases": [{"after_s": 5.0}]}}

    def phase(rep, policy, a_cores, b_cores):    # a consumes 500 samples/s, b 200; c's cost is a phase's
        jobs = {"a": {"worker_cpu_cores": a_cores, "samples_per_s": 500.0},
                "b": {"worker_cpu_cores": b_cores, "samples_per_s": 200.0},
                "c": {"worker_cpu_cores": 3.0, "samples_per_s": 100.0}}
        return {"scenario": "gpu-weighted", "rep": rep, "policy": policy, "specs": specs,
                "metrics": {"agg_normalised": 2.0, "jobs": jobs}}

    phases = [phase(1, "adaptive", 0.6, 0.48), phase(0, "adaptive", 0.7, 0.56), phase(1, "even-static", 0.5, 0.4),
              {"scenario": "gpu-weighted", "rep": 0, "policy": "even-static", "error": "job a died"}]
    costs = report.cost_index(phases)
    # a: 1.4 / 1.2 / 1.0, b: 1.4 / 1.2 / 1.0 (medians of two equal figures); repeat 0 first
    assert costs == {"gpu-weighted": {"adaptive": [pytest.approx(1.4), pytest.approx(1.2)],
                                      "even-static": [None, pytest.approx(1.0)]}}
    md = report.markdown({"gpu-weighted": {}}, [], {}, None, costs)
    line = [x for x in md.splitlines() if x.startswith("Cost per phase")]
    assert len(line) == 1 and "adaptive 1.40, 1.20; even-static –, 1.00." in line[0]
    assert "Cost per phase" not in report.markdown({"gpu-weighted": {}}, [], {})


def test_bench_reports_what_a_short_job_received_of_its_plan():
    """``report.delivery``: per scenario, agent policy and job planned fewer cores than it could use (its
    status says ``unsatisfied``), the workers' measured CPU over the planned cores, median and range over
    repeats; a satisfied job, a phase without the agent's status (no agent) or without a measure is left
    out; the markdown prints it per policy."""
    from evaluation import report

    def phase(rep, policy, got_a, got_b, status=True):
        jobs = {"a": {"worker_cpu_cores": got_a}, "b": {"worker_cpu_cores": got_b}, "c": {"worker_cpu_cores": None}}
        st = {"jobs": {"a": {"cpus": 0.4, "unsatisfied": "wanted 1.80 cores for full speed, got 0.40"},
                       "b": {"cpus": 0.8, "unsatisfied": ""},
                       "c": {"cpus": 0.5, "unsatisfied": "wanted 1.0"}}} if status else None
        return {"scenario": "gpu-weighted", "rep": rep, "policy": policy, "agent_status": st,
                "metrics": {"agg_normalised": 2.0, "jobs": jobs}}

    phases = [phase(0, "adaptive", 0.36, 0.2), phase(1, "adaptive", 0.32, 0.9), phase(2, "adaptive", 0.44, 0.5),
              phase(0, "none", 0.6, 0.6, status=False),
              {"scenario": "gpu-weighted", "rep": 1, "policy": "none", "error": "job a died"}]
    got = report.delivery(phases)
    assert got == {"gpu-weighted": {"adaptive": {"a": {"x_median": pytest.approx(0.9), "x_min": pytest.approx(0.8),
                                                       "x_max": pytest.approx(1.1), "phases": 3}}}}
    md = report.markdown({"gpu-weighted": {}}, [], {}, None, None, got)
    line = [x for x in md.splitlines() if x.startswith("Received / planned")]
    assert len(line) == 1 and "adaptive a 0.90 [0.80–1.10]." in line[0]
    assert "Received / planned" not in report.markdown({"gpu-weighted": {}}, [], {})
    # the factor the delivery correction put on the job's weight (the status's ``delivery``), where above 1
    for ph, f in zip(phases[:3], (1.0, 1.6, 1.3)):
        ph["agent_status"]["jobs"]["a"]["delivery"] = f
    got = report.delivery(phases)
    assert got["gpu-weighted"]["adaptive"]["a"]["weight_factor"] == {
        "x_median": pytest.approx(1.3), "x_min": 1.0, "x_max": 1.6, "phases": 3}
    md = report.markdown({"gpu-weighted": {}}, [], {}, None, None, got)
    assert "adaptive a 0.90 [0.80–1.10] (weight x1.30 [1.00–1.60])." in md


def test_probe_plans_spend_the_budget_and_show_each_job_three_levels():
    from evaluation.catalog import JobSpec
    from evaluation.harness import probe_plans

    specs = [JobSpec(job_id=f"j{i}", kind="k", batch_size=8, step_s=0.1, demand_cores=0.5, cpu_s_per_sample=0.01,
                     workload={}, num_workers=2) for i in range(3)]
    plans = probe_plans(specs, 1.8)
    assert len(plans) == 4                                     # even, then one skewed plan per job
    for p in plans:
        assert sum(x["cpus"] for x in p.values()) == pytest.approx(1.8, abs=0.01)
        assert all(x["workers"] >= 2 for x in p.values())
    for j in ("j0", "j1", "j2"):
        levels = sorted({p[j]["cpus"] for p in plans})
        assert levels == pytest.approx([0.3, 0.6, 1.2], abs=0.01)
    assert len(probe_plans(specs[:1], 1.8)) == 1


def test_colocated_probes_only_where_the_whole_mix_runs_the_whole_phase():
    from evaluation.catalog import JobSpec
    from evaluation.harness import Launch, Scenario, colocated_applies

    spec = JobSpec(job_id="a", kind="k", batch_size=8, step_s=0.1, demand_cores=0.5, cpu_s_per_sample=0.01,
                   workload={}, num_workers=2)
    assert colocated_applies(Scenario("s", [Launch(spec)], "static", 1.0, 2.0))
    assert not colocated_applies(Scenario("s", [Launch(spec, at_s=3.0)], "dynamic", 1.0, 2.0))
    assert not colocated_applies(Scenario("s", [Launch(spec)], "timed", 1.0, 2.0, hog_at_s=1.0))
    assert not colocated_applies(Scenario("s", [Launch(spec)], "static", 1.0, 2.0, loader_memory=1 << 30))


def test_fixed_probe_policy_applies_the_plan_and_shares_evenly_otherwise():
    from agent.model import NodeSnapshot
    from agent.policies import PolicyConfig
    from evaluation.oracle_agent import make_fixed_policy
    from tests.fakes import UNMEASURED, job_stats

    policy = make_fixed_policy({"a": {"workers": 3, "cpus": 1.2}, "b": {"workers": 2, "cpus": 0.3}})
    snap = NodeSnapshot(now=0.0, loader_cpus=1.8, cpu_ids=(0, 1),
                        jobs={j: job_stats(j, **UNMEASURED) for j in ("a", "b", "c")})
    a = policy(snap, {}, PolicyConfig()).allocations
    assert (a["a"].workers, a["a"].cpus, a["b"].workers, a["b"].cpus) == (3, 1.2, 2, 0.3)
    assert a["c"].cpus == pytest.approx(0.6) and "even share" in a["c"].reason


def test_oracle_weighs_a_job_by_its_gpus_and_plans_within_the_probed_budget():
    # two jobs with the same measured points: the one with 2 GPUs is worth twice as much per unit of
    # normalised throughput, so it gets the cores; the plan never spends more than the cores the
    # loaders really got in the probes (budget_cores), whatever the snapshot's loader CPUs say
    from agent.model import NodeSnapshot
    from agent.policies import PolicyConfig
    from evaluation.oracle_agent import make_oracle_policy
    from tests.fakes import UNMEASURED, job_stats

    pts = [[2, 0.2, 0.2], [2, 0.5, 0.5], [3, 1.0, 1.0]]
    policy = make_oracle_policy({"one": pts, "two": pts}, budget_cores=1.0)
    snap = NodeSnapshot(now=0.0, loader_cpus=1.8, cpu_ids=(0, 1),
                        jobs={"one": job_stats("one", **UNMEASURED), "two": job_stats("two", gpus=2, **UNMEASURED)})
    plan = policy(snap, {}, PolicyConfig())
    a = plan.allocations
    assert a["two"].cpus == pytest.approx(1.0) and a["one"].cpus == pytest.approx(0.01)   # (the floor)
    assert plan.predicted_total == pytest.approx(2 * 1.0)   # an even split would be 2 x 0.5 + 0.5


def test_static_phase_reports_what_else_used_the_node():
    """A static phase's node_other_cores: the node's busy (and stolen) CPU over the window less the jobs'
    workers and training processes and the agent: what the jobs could not have had (validate_sim gives
    the simulated phase the node less it). Without the node's counters, or where a job's trainer CPU is
    unknown, nothing is claimed."""
    from evaluation.harness import phase_metrics

    def recs(cpu, main):      # 10 s of a job: 1 step/s, its workers and trainer at constant rates
        return [{"t": 100.0 + k, "samples": 64 * k, "steps": k, "wait_s": 0.0, "compute_s": 1.0 * k, "workers": 2,
                 "cpu_s": cpu * k, "main_cpu_s": main * k, "main_runq_s": 0.0, "resizes": 0} for k in range(11)]

    spec = {"kind": "k", "batch_size": 64, "step_s": 1.0, "gpus": 1}
    ph = {"kind": "static", "window": [100.0, 110.0], "origin": 94.0, "events": [],
          "jobs": {"a": {"spec": spec, "records": recs(0.5, 0.2)}, "b": {"spec": spec, "records": recs(0.3, 0.1)}},
          "agent_cpu": {"t0": 100.0, "cpu0": 0.0, "t1": 110.0, "cpu1": 0.5},
          "node_cpu": {"t0": 100.0, "busy0": 1000.0, "t1": 110.0, "busy1": 1016.0}}
    m = phase_metrics(ph)
    assert m["node_busy_cores"] == pytest.approx(1.6)
    assert m["node_other_cores"] == pytest.approx(1.6 - (0.5 + 0.2 + 0.3 + 0.1) - 0.05)
    del ph["node_cpu"]
    assert "node_other_cores" not in phase_metrics(ph)
    ph["node_cpu"] = {"t0": 100.0, "busy0": 1000.0, "t1": 110.0, "busy1": 1016.0}
    for r in ph["jobs"]["b"]["records"]:
        del r["main_cpu_s"]
    m = phase_metrics(ph)
    assert "node_busy_cores" in m and "node_other_cores" not in m
