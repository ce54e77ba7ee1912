"""The training process's own CPU and its GPUs, end to end through the agent's parts (ISSUE 11):
the loader reports it, the collector turns it into rates and a GPU weight, the policy keeps it out of
the loaders' budget, the status shows it, and ``num_workers="auto"`` does not grow workers that take it.

Unit and component tier: pure functions, the real Registry and Collector, no system access.
"""
from __future__ import annotations

import os
import time

import pytest

from adloader.autotune import AutoTuner, trainer_cpu_s_per_step
from agent.collector import Collector
from agent.model import JobStats, NodeSnapshot
from agent.policies import PolicyConfig, get_policy, loader_budget, trainer_cores_needed
from agent.registry import Registry
from agent.security import Peer
from predictor.curve import ThroughputCurve, shared_cpu_knee, shared_cpu_throughput
from tests.fakes import job_stats

pytestmark = pytest.mark.unit


def _totals(t, steps, main_cpu, compute):
    return {"uptime_s": t, "steps": steps, "samples": steps * 8, "batches": steps, "data_wait_s": 0.0,
            "compute_s": compute, "worker_cpu_s": 0.1 * steps, "worker_wall_s": 0.1 * steps,
            "worker_runq_s": 0.0, "worker_blocked_s": 0.0, "main_cpu_s": main_cpu}


def _collector(gpus_per_hello, ranks=1):
    reg = Registry()
    me = os.getpid()
    for rank in range(ranks):
        reg.hello(Peer(os.getuid(), 0, me), b"id%d" % rank,
                  {"job": "j", "rank": rank, "pid": me, "gpus": gpus_per_hello, "batch_size": 8, "workers": 2}, 0.0)
    return Collector(reg, loader_cpus=1.8, cpu_ids=(0, 1))


def test_one_process_with_two_gpus_weighs_two():
    """A job whose one training process drives two GPUs (CUDA_VISIBLE_DEVICES=0,1 in its hello) weighs 2:
    counting ranks alone gave it the weight of a 1-GPU job."""
    col = _collector(["0", "1"])
    assert col.snapshot(1.0).jobs["j"].gpus == 2
    # ranks that each see every GPU of the node count one per rank, not the union
    col = _collector(["0", "1", "2", "3", "4", "5", "6", "7"], ranks=2)
    assert col.snapshot(1.0).jobs["j"].gpus == 2


def test_trainer_cpu_rates_from_the_loaders_main_cpu_total():
    col = _collector(["0"])
    me = os.getpid()
    col.on_report("j", 0, me, _totals(0.0, 0, 0.0, 0.0), 0.0)
    col.on_report("j", 0, me, _totals(1.0, 10, 0.3, 1.0), 1.0)     # 10 steps, 0.3 CPU s, 1 s of compute
    js = col.snapshot(2.0).jobs["j"]
    assert js.trainer_cpu_cores == pytest.approx(0.3)
    assert js.trainer_cpu_s_per_step == pytest.approx(0.03)
    assert trainer_cores_needed(js) == pytest.approx(0.3)            # 0.03 s per 0.1 s step
    # a client that does not report main_cpu_s: no figure, no reserve
    col = _collector(["0"])
    old = {k: v for k, v in _totals(0.0, 0, 0.0, 0.0).items() if k != "main_cpu_s"}
    col.on_report("j", 0, me, old, 0.0)
    col.on_report("j", 0, me, {**old, "uptime_s": 1.0, "steps": 10, "compute_s": 1.0}, 1.0)
    assert trainer_cores_needed(col.snapshot(2.0).jobs["j"]) == 0.0


def job(name, *, c=0.3, g=0.1, t=0.0, gpus=1, **kw) -> JobStats:
    return job_stats(name, **{"gpus": gpus, "samples_per_s": 100.0, "compute_s_per_step": g,
                              "data_wait_s_per_step": 0.0, "data_wait_frac": 0.0, "cpu_s_per_batch": c,
                              "wall_s_per_batch": c, "runq_s_per_batch": 0.0, "blocked_s_per_batch": 0.0,
                              "worker_cpu_cores": 0.5, "trainer_cpu_s_per_step": t, "worker_pids": (), **kw})


def curve(j: JobStats) -> ThroughputCurve:
    return ThroughputCurve(job=j.job, batch_size=j.batch_size, compute_s_per_step=j.compute_s_per_step,
                           cpu_s_per_batch=j.cpu_s_per_batch, blocked_s_per_batch=0.0, confidence=0.5,
                           observed_configs=2)


def snap(jobs, loader=1.8, cpus=(0, 1)):
    return NodeSnapshot(now=0.0, loader_cpus=loader, cpu_ids=cpus, jobs={j.job: j for j in jobs})


def test_trainer_need_is_kept_out_of_the_loader_budget():
    # two trainers busy 30% of a 0.1 s step: 0.6 cores at full speed; the 2-CPU node's shares (and the
    # cold start) leave the loaders 1.4 of it, not 1.8
    s = snap([job("a", t=0.03), job("b", t=0.03)])
    budget, need = loader_budget(s)
    assert need == pytest.approx(0.6) and budget == pytest.approx(1.4)
    cold = get_policy("adaptive")(s, {}, PolicyConfig())
    assert sum(a.cpus for a in cold.allocations.values()) == pytest.approx(1.4)
    assert "trainers keep 0.60 cores" in cold.allocations["a"].reason
    # warm: loaders and the trainer CPU the planned throughput brings fit the node. These loaders need
    # 3 cores each, so the jobs run far below full speed and their trainers use far less than 0.6:
    # the loaders may take those cores (up to loader_cpus), the trainers still find theirs
    cv = {j: curve(s.jobs[j]) for j in s.jobs}
    plan = get_policy("adaptive")(s, cv, PolicyConfig())
    used = sum(a.cpus + trainer_cores_needed(s.jobs[j]) * cv[j].normalized(a.workers, a.cpus)
               for j, a in plan.allocations.items())
    assert used <= 2.0 + 1e-6 and sum(a.cpus for a in plan.allocations.values()) <= 1.8 + 1e-6
    # light loaders that reach full speed: their trainers need all 0.5 + 0.5, the loaders get the rest
    s = snap([job("a", c=0.05, t=0.05), job("b", c=0.05, t=0.05)])
    cv = {j: curve(s.jobs[j]) for j in s.jobs}
    plan = get_policy("adaptive")(s, cv, PolicyConfig())
    assert sum(a.cpus for a in plan.allocations.values()) <= 1.0 + 0.05      # within one quantum
    assert all(cv[j].normalized(a.workers, a.cpus) >= 0.95 for j, a in plan.allocations.items())   # (a quantum)
    # trainers that need nothing: the whole loader budget, as before
    s = snap([job("a"), job("b")])
    plan = get_policy("adaptive")(s, {j: curve(s.jobs[j]) for j in s.jobs}, PolicyConfig())
    assert sum(a.cpus for a in plan.allocations.values()) == pytest.approx(1.8)
    # a trainer's need is capped at one core per rank/GPU, and the loaders keep a minimum each
    assert trainer_cores_needed(job("x", t=0.5, g=0.1)) == 1.0
    assert trainer_cores_needed(job("x", t=0.5, g=0.1, gpus=2)) == 2.0
    budget, _ = loader_budget(snap([job("a", t=0.5), job("b", t=0.5), job("c", t=0.5)]))
    assert budget == pytest.approx(0.15)


def test_gpu_weight_takes_effect_a_two_gpu_job_gets_more_cores_and_workers():
    """The earlier trial's failure: a 2-GPU job beside 1-GPU jobs of the same kind got one worker and the
    least throughput. Now its weight doubles its floor and its marginal gain."""
    s = snap([job("two", gpus=2, c=0.6), job("one-a"), job("one-b")], loader=7.0, cpus=tuple(range(8)))
    plan = get_policy("adaptive")(s, {j: curve(s.jobs[j]) for j in s.jobs}, PolicyConfig())
    a = plan.allocations
    assert a["two"].cpus > a["one-a"].cpus and a["two"].workers > a["one-a"].workers
    # its floor is twice a 1-GPU job's: 90% of the throughput of 2/4 of the budget
    cv = curve(s.jobs["two"])
    assert cv.normalized(a["two"].workers, a["two"].cpus) >= 0.9 * cv.normalized(64, 0.05 + 6.85 * 2 / 4) - 1e-6


def test_with_cpu_weights_a_job_gets_the_workers_its_curve_can_use():
    """Per-job CPU weights (cgroup shares) arbitrate the cores; the worker count then does not cap a job
    at its share: two jobs with equal plans get two workers each (``thread_split``), so either can fill
    a CPU the other leaves idle (work-conserving), while without weights it is the CPU control and
    stays at the share."""
    s = snap([job("heavy", c=0.3), job("other", c=0.3)])
    cv = {j: curve(s.jobs[j]) for j in s.jobs}
    plain = get_policy("adaptive")(s, cv, PolicyConfig())
    weighted = get_policy("adaptive")(s, cv, PolicyConfig(cpu_weights=True))
    assert plain.allocations["heavy"].workers == 1                 # 0.9 cores -> 1 worker
    assert weighted.allocations["heavy"].workers == 2              # two workers for its 0.9-core plan
    assert weighted.allocations["heavy"].cpus == plain.allocations["heavy"].cpus


def test_shared_cpu_model_a_worker_past_the_queue_filling_count_only_slows_the_trainer():
    cv = ThroughputCurve(job="x", batch_size=64, compute_s_per_step=0.1, cpu_s_per_batch=0.05,
                         blocked_s_per_batch=0.0)
    # no trainer CPU: the shared model is the curve (hard minimum) where workers fit the CPUs
    for w in (1, 2):
        assert shared_cpu_throughput(cv, w, 2.0, 0.0) == pytest.approx(cv.throughput(w, 2.0))
    # a trainer busy half its step on a 1-CPU share: more busy workers stretch its CPU part
    vals = [shared_cpu_throughput(cv, w, 1.0, 0.05) for w in range(1, 9)]
    assert all(v <= cv.ceiling_samples_per_s + 1e-9 for v in vals)
    assert max(vals) < cv.throughput(8, 1.0)                       # below what the loader alone could feed
    assert shared_cpu_knee(cv, 1.0, 0.05, 8) <= cv.knee_workers(1.0)


def test_autotune_reads_its_trainers_cpu_and_does_not_grow_past_it():
    prev = {"steps": 10, "main_cpu_s": 1.0}
    assert trainer_cpu_s_per_step(prev, {"steps": 30, "main_cpu_s": 1.6}) == pytest.approx(0.03)
    assert trainer_cpu_s_per_step(prev, {"steps": 10, "main_cpu_s": 1.6}) is None
    assert trainer_cpu_s_per_step({"steps": 1}, {"steps": 2}) is None
    cv = ThroughputCurve(job="x", batch_size=64, compute_s_per_step=0.1, cpu_s_per_batch=0.2,
                         blocked_s_per_batch=0.0)
    alone = AutoTuner(cpus=2.0, cap=8, current=1, bank=object())
    busy = AutoTuner(cpus=2.0, cap=8, current=1, bank=object(), trainer_cpu_s_per_step=0.05)
    assert busy.useful_workers(cv) <= alone.useful_workers(cv)
    assert busy.predict(cv, 2) <= alone.predict(cv, 2)


def test_loader_reports_its_training_process_cpu_during_steps_only():
    """``main_cpu_s`` counts the training process's CPU between next() calls (its steps), not what it
    burns elsewhere (before iterating, or background threads while it waits for data)."""
    import torch

    from adloader.dataloader import DataLoader

    def burn(s):
        end = time.process_time() + s
        while time.process_time() < end:
            pass

    ds = torch.utils.data.TensorDataset(torch.arange(64.0))
    loader = DataLoader(ds, batch_size=8, num_workers=0)
    burn(0.05)                                   # not a step
    for _ in loader:
        burn(0.01)                               # 8 steps of 10 ms CPU
    got = loader.stats()["main_cpu_s"]
    assert 0.075 <= got < 0.12, got


def test_a_starved_trainers_wait_for_a_cpu_is_not_taken_for_compute():
    """A trainer kept waiting for a core stretches the measured compute time; that wait (its main
    thread's run-queue delay, ``main_runq_s``) comes out of the step the predictor sees and of the
    trainer's need, else a loader would look cheap (c / g small) exactly when the node is starved."""
    from agent.controller import observation_from_stats

    j = job("a", g=0.3, t=0.03, trainer_runq_s_per_step=0.1)
    s = snap([j])
    assert observation_from_stats(j, s).compute_s_per_step == pytest.approx(0.2)
    assert trainer_cores_needed(j) == pytest.approx(0.15)
    # at most half of the measured compute time is taken out (a bad reading cannot zero the step)
    assert observation_from_stats(job("b", g=0.3, trainer_runq_s_per_step=5.0), s).compute_s_per_step == \
        pytest.approx(0.15)
    from adloader.autotune import observation_from_totals

    prev = {"steps": 0, "samples": 0, "batches": 0, "compute_s": 0.0, "uptime_s": 0.0, "main_runq_s": 1.0,
            "workers": 1, "batch_size": 8}
    cur = {**prev, "steps": 10, "samples": 80, "batches": 10, "compute_s": 3.0, "uptime_s": 3.0, "main_runq_s": 2.0}
    assert observation_from_totals(prev, cur, 1.0).compute_s_per_step == pytest.approx(0.2)


def test_the_budget_does_not_follow_every_wiggle_of_the_trainers_need():
    """The trainers' measured need moves a little from window to window; a plan that followed it would
    re-split every share every tick and the predictor (which skips windows spanning a change) would never
    see a clean window. Within BUDGET_TOLERANCE of the held total, the held plan stays."""
    import dataclasses

    from agent.policies import BUDGET_TOLERANCE

    s = snap([job("a", t=0.03), job("b", t=0.03)])
    cold = get_policy("adaptive")(s, {}, PolicyConfig())             # no curves yet: cold shares
    assert sum(a.cpus for a in cold.allocations.values()) == pytest.approx(1.4)
    held = dict(cold.allocations)                                     # what the controller would hold
    for t in (0.025, 0.035):                                          # need 0.5 or 0.7 cores: budget 1.5 or 1.3
        wiggled = {j: dataclasses.replace(v, trainer_cpu_s_per_step=t) for j, v in s.jobs.items()}
        plan = get_policy("adaptive")(dataclasses.replace(s, jobs=wiggled, applied=held), {}, PolicyConfig())
        assert {j: a.cpus for j, a in plan.allocations.items()} == {j: a.cpus for j, a in cold.allocations.items()}
    # a real change (the need doubles) moves it
    moved = {j: dataclasses.replace(v, trainer_cpu_s_per_step=0.06) for j, v in s.jobs.items()}
    plan = get_policy("adaptive")(dataclasses.replace(s, jobs=moved, applied=held), {}, PolicyConfig())
    assert sum(a.cpus for a in plan.allocations.values()) < 1.4 * (1 - BUDGET_TOLERANCE)


def test_the_held_budget_is_the_plans_own_not_its_total():
    """The sticky budget is the one the held plan split (``JobAllocation.budget``), not the plan's total.
    A warm job may take cores past its share (up to the loader CPUs, its trainers charged): here a cold
    2-GPU job with busy trainers (a 2.55-core budget on 3.6 loader cores) beside a warm one. Read as the
    total (2.88 cores), the held plan's budget gave the cold job a larger share, which made the total
    exceed the tolerance, which gave the smaller share back: 1.68 and 1.91 cores, tick after tick (a
    random fuzz of the policy found 6 such plans in 1500 nodes, all with a cold job). Applied, the plan
    now stays; an allocation without a budget (a journal from before it) is read as before."""
    import dataclasses

    jobs = {"cold": job("cold", c=0.45, g=0.05, t=0.072, gpus=2, ranks=2, requested_workers=4),
            "warm": job("warm", c=0.55, g=0.1, requested_workers=4)}
    s = NodeSnapshot(now=0.0, loader_cpus=3.6, cpu_ids=(0, 1, 2, 3), jobs=jobs)
    curves = {"warm": curve(jobs["warm"])}
    adaptive = get_policy("adaptive")
    first = adaptive(s, curves, PolicyConfig())
    assert first.allocations["cold"].cold and first.allocations["warm"].budget == pytest.approx(2.55)
    assert sum(a.cpus for a in first.allocations.values()) > 2.55 * (1 + 0.1)    # the warm job past its share
    plan = first
    for _ in range(4):
        plan = adaptive(dataclasses.replace(s, applied=dict(plan.allocations)), curves, PolicyConfig())
        assert {j: (a.cpus, a.workers) for j, a in plan.allocations.items()} == \
            {j: (a.cpus, a.workers) for j, a in first.allocations.items()}
    # without the record the total stands for the budget, as before (the flip)
    unmarked = {j: dataclasses.replace(a, budget=None) for j, a in first.allocations.items()}
    flipped = adaptive(dataclasses.replace(s, applied=unmarked), curves, PolicyConfig())
    assert flipped.allocations["cold"].cpus > first.allocations["cold"].cpus + 0.1


def test_a_job_slower_than_one_step_per_report_is_still_observed():
    from agent.controller import observation_from_stats

    slow = job("two", gpus=2, batch_size=128, samples_per_s=60.0, window_s=1.0)   # ~0.47 steps per window
    obs = observation_from_stats(slow, snap([slow]))
    assert obs is not None and obs.steps == 1


def test_a_data_starved_trainer_is_expected_to_use_only_its_pace():
    from agent.policies import TRAINER_MARGIN, trainer_cores_expected

    busy = job("a", t=0.03, data_wait_frac=0.0)                   # CPU-bound or at full speed: all of it
    starved = job("b", t=0.03, data_wait_frac=0.8)                # waits for data 80% of its step
    assert trainer_cores_expected(busy) == pytest.approx(0.3)
    assert trainer_cores_expected(starved) == pytest.approx(0.3 * (0.2 + TRAINER_MARGIN))
