"""Memory as an allocated resource: the adaptive policy within a loader memory budget, the pressure
guard, and the agent's tick (collector -> guard -> controller -> policy) under an injected pressure
signal. Unit tier (no processes): the pressure source is a two-line fake, the reports are the loader's
own stats keys.
"""
from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adloader.memory import NodeMemory
from agent.collector import Collector
from agent.controller import Controller
from agent.memory import MemoryGuard
from agent.model import ApplyResult, JobStats, NodeSnapshot
from agent.model import AllocationPlan, JobAllocation
from agent.policies import PolicyConfig, adaptive, memory_caps, memory_floors
from agent.registry import Peer, Registry
from predictor.bank import PredictorBank
from predictor.curve import ThroughputCurve
from tests.fakes import job_stats

pytestmark = pytest.mark.unit

MiB, GiB = 1 << 20, 1 << 30


def job(name, g=0.1, c=0.3, b=0.0, mem=200 * MiB, gpus=1, **kw) -> JobStats:
    return job_stats(name, **{"gpus": gpus, "requested_workers": 4, "samples_per_s": 100.0, "compute_s_per_step": g,
                              "data_wait_s_per_step": 0.0, "data_wait_frac": 0.0, "cpu_s_per_batch": c,
                              "wall_s_per_batch": c + b, "runq_s_per_batch": 0.0, "blocked_s_per_batch": b,
                              "worker_cpu_cores": 0.5, "worker_memory_bytes": mem, "worker_pids": (), **kw})


def curve(j: JobStats) -> ThroughputCurve:
    return ThroughputCurve(job=j.job, batch_size=j.batch_size, compute_s_per_step=j.compute_s_per_step,
                           cpu_s_per_batch=j.cpu_s_per_batch, blocked_s_per_batch=j.blocked_s_per_batch,
                           confidence=0.5, observed_configs=2, worker_memory_bytes=j.worker_memory_bytes)


def node(jobs, cpus=8.0, budget=None, note="") -> NodeSnapshot:
    return NodeSnapshot(now=0.0, loader_cpus=cpus, cpu_ids=tuple(range(int(cpus))), jobs={j.job: j for j in jobs},
                        loader_memory_bytes=budget, memory_note=note)


def plan_memory(plan, snap) -> float:
    return sum(a.workers * snap.jobs[j].worker_memory_bytes for j, a in plan.allocations.items())


CFG = PolicyConfig()


def test_without_a_budget_memory_changes_nothing():
    jobs = [job("a"), job("b", c=0.05, b=0.3)]
    s = node(jobs)
    curves = {j.job: curve(j) for j in jobs}
    assert adaptive(s, curves, CFG) == adaptive(node(jobs, budget=1 << 50), curves, CFG)


def test_budget_smaller_than_the_workers_need_is_respected_and_said():
    # "io": 0.05 CPU s + 0.3 s blocked per batch -> 7 workers on ~0.5 core; "cpu": 3 cores, 3 workers
    jobs = [job("cpu", c=0.3, mem=300 * MiB), job("io", c=0.05, b=0.3, mem=300 * MiB)]
    curves = {j.job: curve(j) for j in jobs}
    free = adaptive(node(jobs), curves, CFG)
    need = plan_memory(free, node(jobs))
    assert need > 2 * GiB
    s = node(jobs, budget=2 * GiB)
    plan = adaptive(s, curves, CFG)
    assert plan_memory(plan, s) <= 2 * GiB
    assert all(a.workers >= 1 for a in plan.allocations.values())
    cut = [j for j, a in plan.allocations.items() if a.workers < free.allocations[j].workers]
    assert cut and all("memory" in plan.allocations[j].reason for j in cut)
    assert all("loader memory budget allows" in plan.unsatisfied[j] for j in cut)


def test_the_worker_that_buys_least_per_byte_goes_first():
    # same throughput curves; "fat" workers cost 4x the memory: the budget takes fat's workers first
    lean, fat = job("lean", mem=100 * MiB), job("fat", mem=400 * MiB)
    curves = {j.job: curve(j) for j in (lean, fat)}
    free = adaptive(node([lean, fat]), curves, CFG)
    assert free.allocations["lean"].workers == free.allocations["fat"].workers == 3
    plan = adaptive(node([lean, fat], budget=1200 * MiB), curves, CFG)
    assert plan.allocations["lean"].workers == 3
    assert plan.allocations["fat"].workers == 2                   # 3*100 + 2*400 = 1100 <= 1200


def test_a_multi_gpu_job_keeps_its_workers_longer():
    one, four = job("one-gpu"), job("four-gpu", gpus=4)
    curves = {j.job: curve(j) for j in (one, four)}
    plan = adaptive(node([one, four], budget=4 * 200 * MiB), curves, CFG)
    assert plan.allocations["four-gpu"].workers > plan.allocations["one-gpu"].workers


def test_cores_a_memory_capped_job_cannot_use_go_to_the_others():
    big, small = job("big", c=0.6, mem=1 * GiB), job("small", c=0.4, mem=50 * MiB)
    curves = {j.job: curve(j) for j in (big, small)}
    s = node([big, small], cpus=6.0, budget=2 * GiB + 300 * MiB)
    plan = adaptive(s, curves, CFG)
    assert plan.allocations["big"].workers == 2
    # big's 2 workers keep about 2 cores busy; small gets the rest, above its even share of 3
    assert plan.allocations["small"].cpus > 3.0
    assert sum(a.cpus for a in plan.allocations.values()) <= 6.0 + 1e-6


def test_a_budget_below_one_worker_each_keeps_one_and_says_so():
    jobs = [job("a", mem=1 * GiB), job("b", mem=1 * GiB)]
    s = node(jobs, budget=1 * GiB)
    plan = adaptive(s, {j.job: curve(j) for j in jobs}, CFG)
    assert all(a.workers == 1 for a in plan.allocations.values())
    assert all("below 1 worker(s) per job" in plan.unsatisfied[j] for j in ("a", "b"))


def test_a_job_whose_one_worker_outgrew_the_budget_is_named_as_the_cause():
    """A leak (or a dataset copied into each worker): one worker of "leaky" holds more than the whole
    budget, and every job is held to one worker. Before, every job was told the same ("budget below
    1 worker(s) per job"), the leaky one that its worker fit the budget, and nothing named the cause."""
    leaky = job("leaky", mem=10 * GiB, worker_growth_bytes=9 * GiB)
    ok = job("ok", mem=200 * MiB)
    curves = {j.job: curve(j) for j in (leaky, ok)}
    plan = adaptive(node([leaky, ok], budget=8 * GiB), curves, CFG)
    assert plan.allocations["leaky"].workers == plan.allocations["ok"].workers == 1
    why = plan.unsatisfied["leaky"]
    assert "below 1 worker(s) per job" in why and "more than its share 4.00 GiB" in why
    assert "grew by 9.00 GiB" in why and "a leak" in why
    assert "held to its minimum by job(s) leaky" in plan.unsatisfied["ok"]
    assert "1 workers of 10240 MiB do not fit the loader memory budget" in plan.allocations["leaky"].reason
    assert "1 workers of 200 MiB fit the loader memory budget" in plan.allocations["ok"].reason


def test_cold_jobs_are_held_to_the_budget_too():
    jobs = [job("cold1", mem=500 * MiB), job("cold2", mem=500 * MiB)]
    s = node(jobs, budget=1500 * MiB)
    plan = adaptive(s, {}, CFG)
    assert plan_memory(plan, s) <= 1500 * MiB


def test_what_the_jobs_other_loaders_hold_is_the_budgets_too():
    """A validation loader's workers (``other_loader_memory_bytes``: a loader the agent does not size)
    hold part of the budget: the sized loaders' workers are planned within what is left, and the
    reasons say so. Held memory over the whole budget leaves every job its one worker."""
    jobs = [job("cpu", c=0.3, mem=300 * MiB), job("io", c=0.05, b=0.3, mem=300 * MiB)]
    curves = {j.job: curve(j) for j in jobs}
    alone = adaptive(node(jobs, budget=3 * GiB), curves, CFG)
    assert plan_memory(alone, node(jobs)) > 1.5 * GiB       # the budget binds less than the test below
    held = [jobs[0], job("io", c=0.05, b=0.3, mem=300 * MiB, other_loader_memory_bytes=1.5 * GiB)]
    s = node(held, budget=3 * GiB)
    plan = adaptive(s, curves, CFG)
    assert plan_memory(plan, s) <= 1.5 * GiB
    assert sum(a.workers for a in plan.allocations.values()) < sum(a.workers for a in alone.allocations.values())
    capped = [j for j, a in plan.allocations.items() if a.workers < alone.allocations[j].workers]
    assert capped and all("beside 1.50 GiB that the jobs' other loaders hold" in plan.allocations[j].reason
                          for j in capped)
    # held over the job's own share (1.5 GiB of 3 for one of two 1-GPU jobs), or a client claiming a
    # terabyte: counted as its whole share and no more; its neighbour keeps what its own share holds
    free = adaptive(node(jobs), curves, CFG)
    assert free.allocations["cpu"].workers * 300 * MiB <= 1.5 * GiB      # (its whole plan fits its share)
    for claim in (4 * GiB, 1 << 40):
        over = [jobs[0], job("io", c=0.05, b=0.3, mem=300 * MiB, other_loader_memory_bytes=claim)]
        s = node(over, budget=3 * GiB)
        plan = adaptive(s, curves, CFG)
        assert plan.allocations["cpu"].workers == free.allocations["cpu"].workers and "cpu" not in plan.unsatisfied
        assert plan.allocations["io"].workers < free.allocations["io"].workers
        assert plan_memory(plan, s) <= 1.5 * GiB
        assert "the loader memory budget allows" in plan.unsatisfied["io"]


def test_a_jobs_other_loaders_memory_comes_out_of_its_own_share():
    """Two 1-GPU jobs, a 4 GiB budget: 2 GiB each is their fair share. One job's validation loader holds
    1.5 GiB: that job's floor is what the 0.5 GiB left of its share holds (one 500 MiB worker), the
    other's stays its whole share (4 workers), and the trim takes the validating job's workers first."""
    val = job("val", c=0.05, b=0.95, mem=500 * MiB, other_loader_memory_bytes=1.5 * GiB)
    other = job("other", c=0.05, b=0.95, mem=500 * MiB)
    curves = {j.job: curve(j) for j in (val, other)}
    s = node([val, other], cpus=8.0, budget=4 * GiB)
    workers, cores = {"val": 8, "other": 8}, {"val": 0.4, "other": 0.4}
    mem = {"val": 500 * MiB, "other": 500 * MiB}
    floors = memory_floors(workers, cores, mem, {"val": 1, "other": 1}, curves, CFG, 4 * GiB,
                           {"val": 1.5 * GiB, "other": 0.0})
    assert floors == {"val": 1, "other": 4}
    caps, unfit = memory_caps(_plan(workers, cores), s, curves, CFG, 4 * GiB)
    left = {j: caps.get(j, w) for j, w in workers.items()}
    assert left["other"] >= 4 and left["val"] * 500 * MiB + left["other"] * 500 * MiB + 1.5 * GiB <= 4 * GiB
    assert not unfit


def test_memory_caps_on_an_even_plan():
    jobs = [job("a", mem=300 * MiB), job("b", mem=100 * MiB)]
    s = node(jobs, budget=800 * MiB)
    curves = {j.job: curve(j) for j in jobs}
    plan = adaptive(node(jobs), curves, CFG)
    caps, unfit = memory_caps(plan, s, curves, CFG, 800 * MiB)
    assert not unfit
    left = {j: caps.get(j, a.workers) for j, a in plan.allocations.items()}
    assert left["a"] * 300 + left["b"] * 100 <= 800


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0.01, 0.5), st.floats(0.0, 0.4), st.integers(10, 2000), st.integers(1, 4)),
                min_size=1, max_size=6),
       st.floats(0.5, 32.0), st.integers(100, 16000), st.integers(0, 4000))
def test_property_the_plan_fits_any_budget_that_fits_one_worker_each(specs, cpus, budget_mib, held_mib):
    # (held_mib: what the first job's other loaders hold, a validation loader's workers: the budget's too)
    jobs = [job(f"j{i}", c=c, b=b, mem=m * MiB, gpus=g, other_loader_memory_bytes=held_mib * MiB * (i == 0))
            for i, (c, b, m, g) in enumerate(specs)]
    s = node(jobs, cpus=cpus, budget=budget_mib * MiB)
    curves = {j.job: curve(j) for j in jobs[::2]}          # some jobs cold
    plan = adaptive(s, curves, CFG)
    held = min(held_mib * MiB, budget_mib * MiB * jobs[0].gpus / sum(j.gpus for j in jobs))   # (its share at most)
    floor = sum(j.worker_memory_bytes for j in jobs) + held
    if floor <= budget_mib * MiB:
        assert plan_memory(plan, s) + held <= budget_mib * MiB + 1
    assert all(a.workers >= 1 for a in plan.allocations.values())
    assert sum(a.cpus for a in plan.allocations.values()) <= cpus + 1e-6
    # idempotent: fed back as applied, the same plan comes out
    again = adaptive(NodeSnapshot(**{**s.__dict__, "applied": dict(plan.allocations)}), curves, CFG)
    assert {j: a.workers for j, a in again.allocations.items()} == {j: a.workers for j, a in plan.allocations.items()}


# -- fairness: no job below its share of the budget while another above its own can give ----------

def _plan(workers, cores):
    return AllocationPlan(policy="adaptive", allocations={j: JobAllocation(job=j, workers=w, cpus=cores[j])
                                                          for j, w in workers.items()})


def test_trimming_stops_at_a_jobs_fair_share_while_another_is_above_its_own():
    # fat: 1 GiB workers, 4 of them on 4 cores, each buys 1/4 of its ceiling: 0.25 per GiB freed.
    # lean: 100 MiB workers, 30 of them (3 s of IO per batch), each buys 1/30: 0.34 per GiB freed.
    # Least loss per byte alone would take fat down to 1 worker. The 4 GiB budget's GPU shares are
    # 2 GiB each: fat keeps 2 workers (its share), lean gives the rest from its 30 (share: 20).
    fat, lean = job("fat", c=0.4, mem=GiB), job("lean", c=0.05, b=2.95, mem=100 * MiB)
    curves = {j.job: curve(j) for j in (fat, lean)}
    s = node([fat, lean], cpus=8.0, budget=4 * GiB)
    plan = _plan({"fat": 4, "lean": 30}, {"fat": 4.0, "lean": 0.5})
    def floors(config):
        return memory_floors({"fat": 4, "lean": 30}, {"fat": 4.0, "lean": 0.5}, {"fat": GiB, "lean": 100 * MiB},
                             {"fat": 1, "lean": 1}, curves, config, 4 * GiB)
    assert floors(CFG) == {"fat": 2, "lean": 20}     # the default floor_fraction 1.0: the whole share
    assert floors(PolicyConfig(floor_fraction=0.9)) == {"fat": 2, "lean": 18}   # 18 keep 90% of what 20 give
    caps, unfit = memory_caps(plan, s, curves, CFG, 4 * GiB)
    assert caps == {"fat": 2, "lean": 20} and not unfit
    # without the fairness floor: the old order, fat down to one worker
    unfair = PolicyConfig(fairness_floor=False)
    assert memory_caps(plan, s, curves, unfair, 4 * GiB)[0] == {"fat": 1}
    # 1.5 GiB: fat's share (0.75 GiB) is below one of its workers, so its floor is 1; lean's is 7
    # workers. fat goes down to 1, lean to 7, and the budget is still short: lean's floor is cut, and said
    caps, unfit = memory_caps(plan, s, curves, CFG, int(1.5 * GiB))
    assert caps == {"fat": 1, "lean": 5}
    assert "below its fair share of the loader memory budget (7 workers)" in unfit["lean"] and "fat" not in unfit


def test_a_worker_that_buys_nothing_is_no_ones_fair_share():
    # idle: its 4 workers keep 1 busy core's worth of work; on 1 core, 1 worker does as well as 4
    idle, busy = job("idle", c=0.1, mem=GiB), job("busy", c=0.4, mem=GiB)
    curves = {j.job: curve(j) for j in (idle, busy)}
    s = node([idle, busy], cpus=8.0, budget=5 * GiB)
    caps, _ = memory_caps(_plan({"idle": 4, "busy": 4}, {"idle": 1.0, "busy": 4.0}), s, curves, CFG, 5 * GiB)
    assert caps == {"idle": 1}


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.floats(0.01, 0.5), st.floats(0.0, 2.0), st.integers(10, 2000), st.integers(1, 4),
                          st.integers(1, 12), st.floats(0.1, 4.0)), min_size=1, max_size=6),
       st.integers(100, 16000), st.booleans())
def test_property_no_job_below_its_floor_while_another_above_its_own_could_give(specs, budget_mib, cold):
    jobs = [job(f"j{i}", c=c, b=b, mem=m * MiB, gpus=g) for i, (c, b, m, g, _, _) in enumerate(specs)]
    workers = {f"j{i}": w for i, (*_, w, _) in enumerate(specs)}
    cores = {f"j{i}": x for i, (*_, x) in enumerate(specs)}
    curves = {j.job: curve(j) for j in (jobs[::2] if cold else jobs)}
    budget = budget_mib * MiB
    s = node(jobs, budget=budget)
    mem = {j.job: j.worker_memory_bytes for j in jobs}
    floors = memory_floors(workers, cores, mem, {j.job: j.gpus for j in jobs}, curves, CFG, budget)
    caps, unfit = memory_caps(_plan(workers, cores), s, curves, CFG, budget)
    left = {j: caps.get(j, w) for j, w in workers.items()}
    assert all(1 <= left[j] <= workers[j] for j in workers)
    if sum(mem.values()) <= budget:
        assert sum(left[j] * mem[j] for j in left) <= budget + 1
    below = [j for j in left if left[j] < floors[j]]
    if below:
        assert all(left[k] <= floors[k] for k in left), (left, floors)
        assert all("fair share" in unfit[j] or "below 1 worker" in unfit[j] for j in below)
    # the floors themselves: within [1, planned] and within the job's GPU share of the budget (or 1)
    total_gpus = sum(j.gpus for j in jobs)
    for j in jobs:
        assert 1 <= floors[j.job] <= workers[j.job]
        assert floors[j.job] == 1 or floors[j.job] * mem[j.job] <= budget * j.gpus / total_gpus + 1


# -- the pressure guard -----------------------------------------------------------------------------

class Pressure:
    """The injectable source: PSI 'some' stall microseconds accumulate while ``on``."""

    def __init__(self, available=16 * GiB):
        self.on, self.total_us, self.available = False, 0, available

    def step(self, dt_s=1.0):
        if self.on:
            self.total_us += int(0.5 * dt_s * 1e6)      # 50% of the time stalled

    def __call__(self) -> NodeMemory:
        return NodeMemory(32 * GiB, self.available, 50.0 if self.on else 0.0, None, self.total_us)


def test_guard_cuts_under_pressure_holds_then_grows_back_a_step_a_tick():
    p = Pressure()
    g = MemoryGuard(8 * GiB, psi_threshold=10, min_available=1 * GiB, source=p)
    assert g.update(0.0, 4 * GiB).budget == 8 * GiB
    p.on = True
    p.step()
    st1 = g.update(1.0, 4 * GiB)
    assert st1.under_pressure and st1.budget == 3 * GiB and "PSI memory some 50%" in st1.note
    p.step()
    assert g.update(2.0, 3 * GiB).budget == 2.25 * GiB                # still stalling: cut again
    p.on = False
    states = [g.update(3.0 + i, 2 * GiB) for i in range(8)]
    budgets = [s.budget / GiB for s in states]
    # held for 3 quiet ticks, then 10% of the 4 GiB the loaders held before the pressure per tick, then lifted
    assert budgets == pytest.approx([2.25, 2.25, 2.25, 2.65, 3.05, 3.45, 3.85, 8.0])
    assert all("held" in s.note for s in states[:3])
    assert all("growing back by 409.6 MiB a tick" in s.note and "of 4.0 GiB before the pressure" in s.note
               for s in states[3:7])
    assert not states[-1].note and g.cap is None


def test_guard_grows_only_while_pressure_stays_low_and_cuts_again_at_once():
    p = Pressure()
    g = MemoryGuard(None, psi_threshold=10, min_available=1 * GiB, source=p)
    p.on = True
    p.step()
    assert g.update(1.0, 4 * GiB).budget == 3 * GiB
    p.on = False
    for t in range(2, 6):
        st = g.update(float(t), 3 * GiB)
    assert st.budget == pytest.approx(3.4 * GiB)                      # 3 held, one step up
    # PSI at 7%: not pressure (under 10%), not low (over 5%): held, and said
    p.total_us += int(0.07 * 1e6)
    st = g.update(6.0, 3 * GiB)
    assert st.budget == pytest.approx(3.4 * GiB) and not st.under_pressure
    assert "eased but not low (PSI memory some 7% >= 5%)" in st.note
    # little memory left above the pressure line: held too
    p.available = 1 * GiB + 100 * MiB
    st = g.update(7.0, 3 * GiB)
    assert st.budget == pytest.approx(3.4 * GiB) and "MemAvailable 1.1 GiB < 1.4 GiB" in st.note
    p.available = 16 * GiB
    assert g.update(8.0, 3 * GiB).budget == pytest.approx(3.8 * GiB)
    # the pressure comes back during the growth: cut at once from what is used now
    p.on = True
    p.step()
    st = g.update(9.0, 3.6 * GiB)
    assert st.under_pressure and st.budget == pytest.approx(2.7 * GiB)
    with pytest.raises(ValueError, match="grow_frac"):
        MemoryGuard(GiB, grow_frac=0)


def test_guard_frees_the_shortfall_of_available_memory():
    p = Pressure(available=1 * GiB)
    g = MemoryGuard(None, psi_threshold=10, min_available=3 * GiB, source=p)
    st = g.update(0.0, 5 * GiB)
    assert st.budget == 3 * GiB and "MemAvailable 1.0 GiB < 3.0 GiB" in st.note


def test_guard_survives_a_failing_source():
    def boom():
        raise OSError("gone")

    assert MemoryGuard(GiB, source=boom).update(0.0, 0.0).budget == GiB


# -- the agent's tick under injected pressure: shrink within two ticks, grow back after -----------

class WorkersFollowDirectives:
    """An actuator standing in for the client: the job's loader takes the planned worker count."""
    name = "directive"
    tracks_pids = False

    def __init__(self):
        self.workers: dict[str, int] = {}

    def apply(self, job, desired):
        self.workers[job.job] = desired.workers
        return ApplyResult(job=job.job, ok=True, applied=desired)

    def release(self, job_id):
        self.workers.pop(job_id, None)

    def restore(self):
        pass


def _report(t, workers, per_worker, steps):
    return {"uptime_s": t, "steps": steps, "samples": 32 * steps, "batches": steps, "data_wait_s": 0.05 * steps,
            "compute_s": 0.1 * steps, "worker_cpu_s": 0.3 * steps, "worker_wall_s": 0.3 * steps,
            "worker_runq_s": 0.0, "worker_blocked_s": 0.0, "workers": workers, "memory_workers": workers,
            "worker_uss_bytes": workers * per_worker, "shm_inflight_bytes": 0, "worker_growth_bytes": 0}


def test_injected_pressure_shrinks_workers_within_two_ticks_and_they_grow_back():
    reg = Registry()
    me = os.getpid()
    per_worker = {"heavy": 800 * MiB, "light": 100 * MiB}
    for i, name in enumerate(per_worker):
        reg.hello(Peer(os.getuid(), 0, me), b"id%d" % i,
                  {"job": name, "rank": 0, "pid": me, "gpus": [str(i)], "batch_size": 32, "workers": 3}, 0.0)
    p = Pressure()
    guard = MemoryGuard(16 * GiB, psi_threshold=10, min_available=1 * GiB, source=p)
    col = Collector(reg, loader_cpus=8.0, cpu_ids=tuple(range(8)), memory_guard=guard)
    act = WorkersFollowDirectives()
    ctl = Controller(snapshot_source=col.snapshot, policy=adaptive, policy_config=PolicyConfig(),
                     predictor=PredictorBank(prior=None), actuators=[act])
    steps = {n: 0 for n in per_worker}
    history = []

    def tick(t):
        for name in per_worker:
            w = act.workers.get(name, 3)
            steps[name] += 10
            col.on_report(name, 0, me, _report(t, w, per_worker[name], steps[name]), t)
        p.step()
        rec = ctl.tick(float(t))
        history.append({n: act.workers.get(n) for n in per_worker})
        return rec

    for t in range(1, 8):                       # settle without pressure
        tick(t)
    before = dict(history[-1])
    used_before = sum(before[n] * per_worker[n] for n in per_worker)
    p.on = True
    recs = [tick(t) for t in (8, 9)]            # two ticks under pressure
    after = history[-1]
    assert sum(after[n] * per_worker[n] for n in per_worker) < used_before
    assert after["heavy"] < before["heavy"]     # the heavy workers buy least per byte: they go first
    reason = recs[-1].plan.allocations["heavy"].reason
    assert "memory pressure" in reason and "PSI memory some" in reason
    assert col.memory_state.under_pressure
    p.on = False
    notes = []
    for t in range(10, 24):
        rec = tick(t)
        notes.append((col.memory_state.note, rec.plan.allocations["heavy"].reason))
    assert history[-1] == before                # grown back once the pressure is gone
    assert not col.memory_state.note
    # ... gradually: the loaders' memory never falls and rises over at least two ticks, not in one jump
    used = [sum(h[n] * per_worker[n] for n in per_worker) for h in history[9:]]
    assert all(b >= a for a, b in zip(used, used[1:]))
    assert sum(1 for a, b in zip(used, used[1:]) if b > a) >= 2, used
    assert any("growing back" in note and "growing back" in why for note, why in notes)


def test_a_loaders_memory_bound_is_the_jobs_worker_bound():
    """A loader refuses a directive's growth past what its own memory limit holds (the agent cannot read
    a container's limit) and reports ``memory_bound_workers``: the job's ``max_workers`` takes it, so
    the plan gives no cores to workers the job cannot hold, and the directive matches the loader."""
    reg = Registry()
    me = os.getpid()
    reg.hello(Peer(os.getuid(), 0, me), b"id0",
              {"job": "pod", "rank": 0, "pid": me, "gpus": ["0"], "batch_size": 32, "workers": 2,
               "max_workers": 8}, 0.0)
    col = Collector(reg, loader_cpus=8.0, cpu_ids=tuple(range(8)))
    stats = {**_report(1.0, 2, 1 * GiB, 10), "max_workers": 8, "memory_bound_workers": 3}
    reg.report(b"id0", Peer(os.getuid(), 0, me), {"job": "pod", "rank": 0, "pid": me, "worker_pids": [],
                                                   "stats": stats}, 1.0)
    col.on_report("pod", 0, me, stats, 1.0)
    job = col.snapshot(1.0).jobs["pod"]
    assert job.max_workers == 3
    ctl = Controller(snapshot_source=col.snapshot, policy=adaptive, policy_config=PolicyConfig(),
                     predictor=PredictorBank(prior=None), actuators=[WorkersFollowDirectives()])
    assert ctl.tick(1.0).plan.allocations["pod"].workers <= 3
    stats["memory_bound_workers"] = None                  # nothing measured: the loader's own bound alone
    reg.report(b"id0", Peer(os.getuid(), 0, me), {"job": "pod", "rank": 0, "pid": me, "worker_pids": [],
                                                   "stats": stats}, 2.0)
    assert col.snapshot(2.0).jobs["pod"].max_workers == 8


# -- config ----------------------------------------------------------------------------------------

def test_loader_memory_config_units_sources_and_errors(tmp_path):
    from agent import config as configmod

    f = tmp_path / "agent.toml"
    f.write_text('loader_memory = "6GiB"\nmemory_min_available = "512MiB"\n')
    cfg = configmod.load(str(f), environ={})
    assert cfg.resolved_loader_memory() == 6 * GiB and cfg.resolved_memory_min_available() == 512 * MiB
    assert configmod.load(str(f), {"loader_memory": "8000000000"}, environ={}).resolved_loader_memory() == 8_000_000_000
    assert configmod.load(str(f), environ={"ADLOADER_LOADER_MEMORY": "off"}).resolved_loader_memory() is None
    with pytest.raises(configmod.ConfigError, match=r"'loader_memory' from the command line: not a size: '6 gigs'"):
        configmod.load(str(f), {"loader_memory": "6 gigs"}, environ={})
    with pytest.raises(configmod.ConfigError, match="at least 64 MiB"):
        configmod.load(str(f), {"loader_memory": "1MiB"}, environ={})
    with pytest.raises(configmod.ConfigError, match="memory_pressure_psi"):
        configmod.load(str(f), {"memory_pressure_psi": 0}, environ={})


def test_auto_loader_memory_is_node_memory_or_the_cgroup_limit_minus_the_reserve(tmp_path):
    from agent.config import auto_loader_memory

    proc, cg = tmp_path / "proc", tmp_path / "cg"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal: {32 * GiB // 1024} kB\nMemAvailable: {20 * GiB // 1024} kB\n")
    (proc / "self" / "cgroup").write_text("4:memory:/agent\n")
    (proc / "77").mkdir()
    (proc / "77" / "cgroup").write_text("4:memory:/agent/adloader/job-1\n")     # a loader in the agent's group
    assert auto_loader_memory(str(proc), str(cg), loader_pids=(77,)) == 24 * GiB   # 32 GiB - 25%
    (cg / "memory" / "agent").mkdir(parents=True)
    (cg / "memory" / "agent" / "memory.limit_in_bytes").write_text(str(4 * GiB))
    assert auto_loader_memory(str(proc), str(cg), loader_pids=(77,)) == 2 * GiB   # 4 GiB limit - 2 GiB minimum reserve


def test_a_limit_on_the_agent_alone_is_not_the_loaders_budget(tmp_path):
    """The shipped Kubernetes DaemonSet limits the agent's container to 512Mi (its own memory), and a
    unit's MemoryMax on cgroup v1 caps the agent's group only: the jobs' processes are in memory groups
    of their own. Read as the loaders' budget, that limit held every job on the node to one worker (51
    MiB). It is the budget only when every loader process is in the limited group or below it."""
    from agent.config import auto_loader_memory

    proc, cg = tmp_path / "proc", tmp_path / "cg"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal: {32 * GiB // 1024} kB\nMemAvailable: {20 * GiB // 1024} kB\n")
    (proc / "self" / "cgroup").write_text("4:memory:/kubepods/agent-pod\n")
    (cg / "memory" / "kubepods" / "agent-pod").mkdir(parents=True)
    (cg / "memory" / "kubepods" / "agent-pod" / "memory.limit_in_bytes").write_text(str(512 << 20))
    for pid, group in ((100, "/kubepods/train-pod"), (101, "/kubepods/agent-pod/inner"), (102, "/kubepods/agent-pod-2")):
        (proc / str(pid)).mkdir()
        (proc / str(pid) / "cgroup").write_text(f"4:memory:{group}\n")
    node = 24 * GiB                                                             # 32 GiB - 25%
    assert auto_loader_memory(str(proc), str(cg)) == node                       # no loader yet: nothing to bind
    assert auto_loader_memory(str(proc), str(cg), loader_pids=(100,)) == node  # another pod's training process
    assert auto_loader_memory(str(proc), str(cg), loader_pids=(102,)) == node  # a group whose name only starts alike
    assert auto_loader_memory(str(proc), str(cg), loader_pids=(100, 101)) == node
    assert auto_loader_memory(str(proc), str(cg), loader_pids=(101,)) == int(0.1 * (512 << 20))   # bound: its 10%
    assert auto_loader_memory(str(proc), str(cg), loader_pids=(999,)) == node  # vanished: not known to be bound


def test_the_agent_command_takes_loader_memory():
    from agent.cli import build_parser

    args = build_parser().parse_args(["agent", "--loader-memory", "6GiB"])
    assert args.loader_memory == "6GiB"
