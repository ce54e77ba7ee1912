"""Unit tests for the controller's tick: fakes for the snapshot, predictor and actuators."""
from __future__ import annotations

import dataclasses
import json

import pytest

from agent.actuators import DirectiveActuator, build
from agent.controller import Controller, TickRecord, observation_from_stats, same_allocation, same_configuration
from agent.model import ApplyResult, JobAllocation
from agent.policies import PolicyConfig, get_policy
from tests.fakes import FakeBank, FakeSink, FakeSource, RecordingActuator, job_stats

pytestmark = pytest.mark.unit


def make(source, actuators, policy="even", records=None):
    return Controller(snapshot_source=source, policy=get_policy(policy), policy_config=PolicyConfig(),
                      predictor=FakeBank(), actuators=actuators,
                      on_record=(records.append if records is not None else None))


def test_tick_applies_even_split_and_records():
    src = FakeSource(4.0, [job_stats("a"), job_stats("b")])
    sink, records = FakeSink(), []
    c = make(src, [DirectiveActuator(sink)], records=records)
    rec = c.tick(now=1.0)
    assert isinstance(rec, TickRecord) and records == [rec]
    assert rec.now == 1.0 and rec.duration_s >= 0
    assert {j: (a.workers, a.cpus) for j, a in rec.plan.allocations.items()} == {"a": (2, 2.0), "b": (2, 2.0)}
    assert all(r.ok for r in rec.results.values()) and set(rec.results) == {"a", "b"}
    assert sorted(s[0] for s in sink.sent) == ["a", "b"]
    assert all(s[4].startswith("even split") for s in sink.sent)
    assert set(c.applied()) == {"a", "b"}
    assert rec.curves["a"]["source"] == "first-principles"


def test_only_the_difference_is_applied():
    src = FakeSource(4.0, [job_stats("a"), job_stats("b")])
    sink = FakeSink()
    c = make(src, [DirectiveActuator(sink)])
    c.tick(now=1.0)
    c.tick(now=2.0)
    assert len(sink.sent) == 2          # second tick: nothing changed, nothing sent
    src.jobs["c"] = job_stats("c")
    rec = c.tick(now=3.0)
    assert set(rec.results) == {"a", "b", "c"}   # shares changed for all three
    assert len(sink.sent) == 5


def test_a_change_of_cpu_weight_alone_is_applied_and_does_not_cut_a_window():
    """A plan that changes only a job's CPU weight is a new allocation (its group's shares are written
    again) but the same configuration (a predictor window may span it: workers and cores stand)."""
    a = JobAllocation(job="j", workers=2, cpus=0.3)
    assert same_allocation(a, dataclasses.replace(a, cpu_weight=0.3 + 1e-4))      # the same weight
    for b in (dataclasses.replace(a, cpu_weight=0.9), dataclasses.replace(a, cpus=0.9)):
        assert not same_allocation(a, b) and same_configuration(a, b)
    w = dataclasses.replace(a, cpu_weight=0.9)
    assert same_allocation(w, dataclasses.replace(w, cpus=0.3 + 1e-4))


def test_the_applied_record_follows_the_policys_reason_and_cold_flag_without_a_reapply():
    """A plan that keeps a job's allocation but says why differently (a hold, a cold job now planned
    from its curve) applies nothing; the applied record (what adaptive's hold reads) takes the new
    reason and cold flag, and keeps the cores in force."""
    src = FakeSource(4.0, [job_stats("a")])
    act = RecordingActuator()
    plans = iter([JobAllocation(job="a", workers=2, cpus=2.0, reason="cold start", cold=True),
                  JobAllocation(job="a", workers=2, cpus=2.0 + 1e-4, reason="from its curve")])

    def policy(snapshot, curves, config):
        from agent.model import AllocationPlan
        return AllocationPlan(policy="test", allocations={"a": next(plans)})

    c = Controller(snapshot_source=src, policy=policy, policy_config=PolicyConfig(), predictor=FakeBank(),
                   actuators=[act])
    c.tick(now=1.0)
    assert c.applied()["a"].cold and len(act.applied) == 1
    rec = c.tick(now=2.0)
    assert not rec.results and len(act.applied) == 1        # nothing re-applied
    a = c.applied()["a"]
    assert (a.reason, a.cold, a.cpus) == ("from its curve", False, 2.0)


def test_the_policy_sees_how_long_each_allocation_has_been_in_force():
    """``NodeSnapshot.applied_age_s``: seconds since the job's allocation in force last changed (a
    change of weight alone counts; a plan that applies nothing new does not), for adaptive's
    delivery correction, which waits for the smoothed figures to follow a change."""
    src = FakeSource(4.0, [job_stats("a")])
    seen = []
    plans = iter([JobAllocation(job="a", workers=2, cpus=2.0), JobAllocation(job="a", workers=2, cpus=2.0),
                  JobAllocation(job="a", workers=2, cpus=2.0, cpu_weight=3.0),
                  JobAllocation(job="a", workers=2, cpus=2.0, cpu_weight=3.0)])

    def policy(snapshot, curves, config):
        from agent.model import AllocationPlan
        seen.append(dict(snapshot.applied_age_s))
        return AllocationPlan(policy="test", allocations={"a": next(plans)})

    c = Controller(snapshot_source=src, policy=policy, policy_config=PolicyConfig(), predictor=FakeBank(),
                   actuators=[RecordingActuator()])
    for now in (1.0, 3.5, 7.0, 8.0):
        c.tick(now=now)
    assert seen == [{}, {"a": 2.5}, {"a": 6.0}, {"a": 1.0}]


def test_departure_releases_and_hands_out_share_in_same_tick():
    src = FakeSource(4.0, [job_stats("a"), job_stats("b")])
    act = RecordingActuator()
    bank = FakeBank()
    c = Controller(snapshot_source=src, policy=get_policy("even"), policy_config=PolicyConfig(),
                   predictor=bank, actuators=[act], on_record=None)
    c.tick(now=1.0)
    del src.jobs["b"]
    rec = c.tick(now=2.0)
    assert rec.departed == ("b",) and act.released == ["b"] and bank.forgotten == ["b"]
    assert c.applied()["a"].cpus == 4.0 and "b" not in c.applied()


def test_a_job_that_departs_before_every_actuator_applied_it_is_released_and_forgotten():
    """A job whose cgroup apply failed (the kernel refused a write after the group was made) while its
    directive went out was never in force everywhere, so not in ``applied()``: when it left, no actuator
    released it (the group stayed), the predictor kept its windows and the controller its breaker, for
    good. Departure is now judged on every job the controller has seen."""
    src = FakeSource(4.0, [job_stats("a"), job_stats("b")])
    directive, cgroup = RecordingActuator(), RecordingActuator(fail_jobs={"b"})
    bank = FakeBank()
    c = Controller(snapshot_source=src, policy=get_policy("even"), policy_config=PolicyConfig(),
                   predictor=bank, actuators=[directive, cgroup])
    c.tick(now=1.0)
    c.tick(now=2.0)
    assert "b" not in c.applied() and any(j == "b" for j, _ in bank.seen)
    del src.jobs["b"]
    rec = c.tick(now=3.0)
    assert rec.departed == ("b",) and directive.released == ["b"] and cgroup.released == ["b"]
    assert bank.forgotten == ["b"] and "b" not in rec.breakers
    assert c.applied()["a"].cpus == 4.0
    assert c.tick(now=4.0).departed == ()                          # forgotten once


def test_forget_releases_now():
    src = FakeSource(4.0, [job_stats("a")])
    act = RecordingActuator()
    c = make(src, [act])
    c.tick(now=1.0)
    c.forget("a")
    assert act.released == ["a"] and c.applied() == {}


def test_breaker_opens_after_three_failures_for_that_job_only():
    src = FakeSource(4.0, [job_stats("a"), job_stats("b")])
    act = RecordingActuator(fail_jobs={"b"})
    c = Controller(snapshot_source=src, policy=get_policy("even"), policy_config=PolicyConfig(),
                   predictor=FakeBank(), actuators=[act], breaker_retry_s=30.0)
    for t in range(1, 4):
        rec = c.tick(now=float(t))
        assert not rec.results["b"].ok and "boom" in rec.results["b"].error
    assert "b" in rec.breakers and "a" not in rec.breakers
    n = len([x for x in act.applied if x[0] == "b"])
    rec = c.tick(now=4.0)
    assert len([x for x in act.applied if x[0] == "b"]) == n       # skipped while open
    assert "breaker open" in rec.results["b"].error
    assert c.applied()["a"].cpus == 2.0
    act.fail_jobs.clear()
    rec = c.tick(now=40.0)                                          # half-open retry succeeds
    assert rec.results["b"].ok and rec.breakers == {}


def test_a_breaker_opened_before_the_clock_went_back_is_retried_not_held():
    """``now`` smaller than when a breaker opened (the caller's clock went back: a simulator or a replay
    that starts again at 0) held the breaker open until the clock passed the old time again plus
    ``breaker_retry_s``: a day back held it a day. Elsewhere the tick already treats a backwards clock
    as time passed (observations, allocation ages)."""
    src = FakeSource(4.0, [job_stats("a")])
    act = RecordingActuator(fail_jobs={"a"})
    c = Controller(snapshot_source=src, policy=get_policy("even"), policy_config=PolicyConfig(),
                   predictor=FakeBank(), actuators=[act], breaker_retry_s=30.0)
    for t in (86400.0, 86401.0, 86402.0):
        rec = c.tick(now=t)
    assert "a" in rec.breakers
    assert "breaker open" in c.tick(now=86403.0).results["a"].error      # open while the clock runs on
    act.fail_jobs.clear()
    rec = c.tick(now=5.0)                                                 # the clock went back a day
    assert rec.results["a"].ok and rec.breakers == {} and c.applied()["a"].cpus == 4.0


def test_a_failing_actuator_opens_its_own_breaker_and_the_jobs_other_actuators_go_on():
    """Found on a real cgroup v2 node: the kernel refused the cgroup write, the job's breaker opened, and
    with it the job's worker counts stopped following the plan for 30 s. The breaker is per actuator."""
    src = FakeSource(4.0, [job_stats("a"), job_stats("b")])
    directive, cgroup = RecordingActuator(), RecordingActuator(fail_jobs={"b"})
    cgroup.name = "cgroup"
    c = Controller(snapshot_source=src, policy=get_policy("even"), policy_config=PolicyConfig(),
                   predictor=FakeBank(), actuators=[directive, cgroup], breaker_retry_s=30.0)
    for t in range(1, 4):
        rec = c.tick(now=float(t))
    assert rec.breakers == {"b": "3 failures in a row; last: cgroup: boom"}
    calls = len([x for x in cgroup.applied if x[0] == "b"])
    src.jobs["c"] = job_stats("c")                                  # the split changes: b's share with it
    rec = c.tick(now=4.0)
    assert [x[1].cpus for x in directive.applied if x[0] == "b"][-1] == pytest.approx(4.0 / 3)
    assert len([x for x in cgroup.applied if x[0] == "b"]) == calls   # the open breaker skips only cgroup
    assert not rec.results["b"].ok and "breaker open" in rec.results["b"].error
    assert rec.results["a"].ok and "a" not in rec.breakers


class HungActuator:
    """An actuator whose calls for ``hung_job`` (every call, with ``hung_job=None``) block until ``gate``."""
    name = "cgroup"
    tracks_pids = True

    def __init__(self, hung_job="a"):
        import threading

        self.gate, self.hung_job = threading.Event(), hung_job
        self.applied, self.released, self.restored = [], [], 0

    def _block(self, job_id):
        if self.hung_job is None or job_id == self.hung_job:
            assert self.gate.wait(30.0), "the test never opened the gate"

    def apply(self, job, desired):
        self.applied.append(job.job)
        self._block(job.job)
        return ApplyResult(job=job.job, ok=True, applied=desired)

    def release(self, job_id):
        self.released.append(job_id)
        self._block(job_id)

    def restore(self):
        self.restored += 1
        self._block(None)


def test_a_hung_actuator_fails_its_job_after_the_timeout_and_the_tick_goes_on():
    """An actuator apply that never returned (a cgroup write the kernel never answered) held the tick,
    and with it the service loop, for ever. Now the tick waits ``actuator_timeout_s`` for it: that job's
    apply failed (its breaker counts it), the other jobs and the job's worker counts are applied and
    recorded, and the hung actuator is not called again (no thread more per tick) until the call returns."""
    import threading
    import time

    src = FakeSource(4.0, [job_stats("a"), job_stats("b")])
    directive, hung = RecordingActuator(), HungActuator("a")
    c = Controller(snapshot_source=src, policy=get_policy("even"), policy_config=PolicyConfig(),
                   predictor=FakeBank(), actuators=[directive, hung], breaker_retry_s=30.0,
                   actuator_timeout_s=0.5)   # room for the directive applies and a's start on a loaded machine
    try:
        t0 = time.monotonic()
        rec = c.tick(now=1.0)
        assert time.monotonic() - t0 < 5.0
        assert not rec.results["a"].ok and "cgroup: apply for job 'a' timed out after 0.5 s" in rec.results["a"].error
        # b's cgroup apply is not made beside the hung one: not applied, saying what still runs, not charged
        assert not rec.results["b"].ok and "actuator busy: cgroup apply for job 'a' running for" in rec.results["b"].error
        assert sorted(x[0] for x in directive.applied) == ["a", "b"]     # the worker counts went out
        assert hung.applied == ["a"] and "a" not in c.applied()
        threads = threading.active_count()
        for t in (2.0, 3.0, 4.0, 5.0):
            rec = c.tick(now=t)
            assert set(rec.results) == {"a", "b"} and not rec.results["a"].ok
        assert hung.applied == ["a"]                                    # never called again while hung
        assert threading.active_count() <= threads                      # no thread more per tick
        assert "a" in rec.breakers and "still running" in rec.breakers["a"] and "b" not in rec.breakers
        hung.gate.set()                                                 # the call returns, late
        assert c.lanes[1].wait_idle(10.0)
        rec = c.tick(now=40.0)                                          # the breakers' retry time passed
        assert rec.results["a"].ok and rec.results["b"].ok and rec.breakers == {}
        assert set(c.applied()) == {"a", "b"} and hung.applied == ["a", "a", "b"]
    finally:
        hung.gate.set()


def test_a_ticks_calls_run_back_to_back_on_one_thread_in_plan_order_and_a_hang_refuses_the_rest():
    """The tick submits every job's call before it waits for the first: the actuator sees the jobs one at
    a time, in the plan's order, all on its lane's one thread. A call that hangs mid-way fails its job,
    the calls queued behind it are not made (each job's failure says what still runs), and the jobs
    before it are applied and recorded."""
    import threading

    class Threads(HungActuator):
        def __init__(self, hung_job):
            super().__init__(hung_job)
            self.threads, self.behind, self.lane = [], [], None

        def apply(self, job, desired):
            self.threads.append(threading.current_thread().name)
            if not self.behind:          # the first call: are the others submitted before it returns?
                with self.lane._cond:
                    self.behind.append(self.lane._cond.wait_for(lambda: len(self.lane._queued) == 3, 1.5))
            return super().apply(job, desired)

    src = FakeSource(4.0, [job_stats(j) for j in "abcd"])
    act = Threads("nobody")
    c = Controller(snapshot_source=src, policy=get_policy("even"), policy_config=PolicyConfig(),
                   predictor=FakeBank(), actuators=[act], actuator_timeout_s=2.0)
    act.lane = c.lanes[0]
    try:
        rec = c.tick(now=1.0)
        assert all(rec.results[j].ok for j in "abcd") and act.applied == list("abcd")
        assert act.behind == [True]                        # b, c and d were submitted while a ran
        assert len(set(act.threads)) == 1 and act.threads[0].startswith("adloader-actuator-")
        assert act.threads[0] != threading.current_thread().name
        act.hung_job = "b"
        src.jobs["e"] = job_stats("e")                     # the split changes: every job is applied again
        rec = c.tick(now=2.0)
        assert act.applied == list("abcd") + ["a", "b"]    # c, d, e never called beside the hung b
        assert rec.results["a"].ok
        assert "apply for job 'b' timed out after 2 s" in rec.results["b"].error
        for j in "cde":
            assert not rec.results[j].ok and "actuator busy: cgroup apply for job 'b' running for" in rec.results[j].error
    finally:
        act.gate.set()


def test_a_hang_charges_only_the_job_whose_call_hung():
    """While job a's cgroup apply hangs, the other jobs' applies to that actuator never run. That is not
    their failure: their breakers stay closed through every tick of the hang, nothing is recorded as in
    force for them (each result says the actuator is busy with a's call), and their latest changes,
    also those of a job that arrived during the hang, go in at the first tick after it ends. a is
    charged: the timeout, then each tick its own call still runs, so its breaker opens at the third.
    (A timeout of 0.5 s: the calls that must return in time do so on a loaded machine too.)"""
    src = FakeSource(6.0, [job_stats(j) for j in "abc"])
    directive, hung = RecordingActuator(), HungActuator("a")
    c = Controller(snapshot_source=src, policy=get_policy("even"), policy_config=PolicyConfig(),
                   predictor=FakeBank(), actuators=[directive, hung], breaker_retry_s=30.0,
                   actuator_timeout_s=0.5)

    def busy(rec, jobs):
        return all(not rec.results[j].ok and rec.results[j].error.startswith(
            "actuator busy: cgroup apply for job 'a' running for ") for j in jobs)

    try:
        rec = c.tick(now=1.0)
        assert "apply for job 'a' timed out after 0.5 s" in rec.results["a"].error and rec.breakers == {}
        assert busy(rec, "bc")                                        # queued behind a's call
        rec = c.tick(now=2.0)
        assert "not called: apply for job 'a' still running" in rec.results["a"].error and rec.breakers == {}
        assert busy(rec, "bc")                                        # refused at submit
        rec = c.tick(now=3.0)
        assert set(rec.breakers) == {"a"} and busy(rec, "bc")         # a's third failure in a row
        src.jobs["d"] = job_stats("d")                                # the split changes during the hang
        for t in (4.0, 5.0, 6.0):
            rec = c.tick(now=t)
            assert set(rec.breakers) == {"a"} and "breaker open" in rec.results["a"].error
            assert busy(rec, "bcd")
        assert hung.applied == ["a"] and c.applied() == {}            # in force on the cgroup actuator: nothing
        assert [x[1].cpus for x in directive.applied if x[0] == "b"] == [2.0, 1.5]   # the worker counts went on
        hung.gate.set()
        assert c.lanes[1].wait_idle(10.0)
        rec = c.tick(now=7.0)                                         # a's breaker is still open (30 s)
        assert all(rec.results[j].ok for j in "bcd") and set(rec.breakers) == {"a"}
        assert hung.applied == ["a", "b", "c", "d"]
        assert {j: a.cpus for j, a in c.applied().items()} == {"b": 1.5, "c": 1.5, "d": 1.5}
        rec = c.tick(now=40.0)                                        # half-open: a's apply is tried again
        assert rec.results["a"].ok and rec.breakers == {} and set(c.applied()) == set("abcd")
    finally:
        hung.gate.set()


def test_a_hung_apply_node_charges_no_job():
    """A call for no job (the node allocation) that hangs keeps the jobs' applies to that actuator from
    running; it is a tick error, and none of the jobs is charged for it."""
    from agent.model import NodeAllocation

    class HungNode(HungActuator):
        def apply_node(self, node):
            assert self.gate.wait(30.0), "the test never opened the gate"
            return []

    def even_with_node(snapshot, curves, config):
        plan = get_policy("even")(snapshot, curves, config)
        return dataclasses.replace(plan, node=NodeAllocation(reason=f"{len(snapshot.jobs)} jobs"))

    src = FakeSource(4.0, [job_stats("a")])
    hung = HungNode("nobody")
    c = Controller(snapshot_source=src, policy=even_with_node, policy_config=PolicyConfig(),
                   predictor=FakeBank(), actuators=[hung], actuator_timeout_s=0.5)
    try:
        rec = c.tick(now=1.0)
        assert rec.results["a"].ok and "apply_node timed out" in rec.errors[0]
        src.jobs["b"] = job_stats("b")
        for t in (2.0, 3.0, 4.0, 5.0):
            rec = c.tick(now=t)
            for j in "ab":
                assert rec.results[j].error.startswith("actuator busy: cgroup apply_node running for "), rec.results[j]
            assert rec.breakers == {}
        hung.gate.set()
        assert c.lanes[0].wait_idle(10.0)
        rec = c.tick(now=6.0)
        assert rec.results["a"].ok and rec.results["b"].ok and rec.errors == ()
        assert c.applied_node() == NodeAllocation(reason="2 jobs")
    finally:
        hung.gate.set()


def test_a_hung_release_is_retried_and_stop_does_not_wait_for_ever():
    """A departed job whose release hangs is retried at a later tick (as a raising one is); ``stop`` waits
    one timeout for a hung call, restores every other actuator and returns."""
    import time

    src = FakeSource(4.0, [job_stats("a")])
    other, hung = RecordingActuator(), HungActuator("a")
    c = Controller(snapshot_source=src, policy=get_policy("even"), policy_config=PolicyConfig(),
                   predictor=FakeBank(), actuators=[other, hung], actuator_timeout_s=0.5)   # room for the first apply on a loaded machine
    try:
        hung.hung_job = "nobody"
        assert c.tick(now=1.0).results["a"].ok
        hung.hung_job = "a"
        del src.jobs["a"]
        rec = c.tick(now=2.0)
        assert rec.departed == ("a",) and hung.released == ["a"]
        c.tick(now=3.0)
        assert hung.released == ["a"]                                  # busy: not called beside itself
        t0 = time.monotonic()
        c.stop()
        assert time.monotonic() - t0 < 5.0
        assert other.restored == 1 and hung.restored == 0              # not restored beside the hung call
        hung.gate.set()
        assert c.lanes[1].wait_idle(10.0)
        c.tick(now=4.0)
        assert hung.released == ["a", "a"]                             # retried once the lane was free
        c.stop()
        assert hung.restored == 1
    finally:
        hung.gate.set()


def test_tick_never_raises():
    def bad_source(now):
        raise RuntimeError("collector down")

    c = make(bad_source, [RecordingActuator()])
    rec = c.tick(now=1.0)
    assert rec.errors and "collector down" in rec.errors[0]

    def bad_policy(snapshot, curves, config):
        raise ZeroDivisionError("oops")

    class Raising:
        name = "raising"

        def apply(self, job, desired):
            raise OSError("EPERM")

        def release(self, job_id):
            raise OSError("gone")

        def restore(self):
            raise OSError("gone")

    c = Controller(snapshot_source=FakeSource(2.0, [job_stats("a")]), policy=bad_policy,
                   policy_config=PolicyConfig(), predictor=FakeBank(), actuators=[Raising()])
    assert "policy: ZeroDivisionError" in c.tick(now=1.0).errors[0]
    c = make(FakeSource(2.0, [job_stats("a")]), [Raising()])
    rec = c.tick(now=1.0)
    assert not rec.results["a"].ok and "EPERM" in rec.results["a"].error
    c.forget("a")
    c.stop()


def test_an_actuator_that_returns_no_result_fails_that_job_and_opens_its_breaker():
    """An apply that returned None (not an ``ApplyResult``) raised AttributeError out of ``tick``: the
    scheduler's loop raised, and no job after it in the plan was applied. It is that job's failure."""
    class Silent:
        name = "silent"

        def __init__(self):
            self.calls = 0

        def apply(self, job, desired):
            self.calls += 1
            return None if job.job == "a" else ApplyResult(job=job.job, ok=True, applied=desired)

        def release(self, job_id):
            pass

        def restore(self):
            pass

    act = Silent()
    c = make(FakeSource(4.0, [job_stats("a"), job_stats("b")]), [act])
    first = c.tick(now=1.0)
    assert first.results["b"].ok and c.applied()["b"].cpus == 2.0
    for t in (1.0, 2.0, 3.0):
        rec = first if t == 1.0 else c.tick(now=t)
        assert not rec.results["a"].ok and "not an ApplyResult" in rec.results["a"].error
    assert "a" in rec.breakers
    calls = act.calls
    c.tick(now=4.0)
    assert act.calls == calls                                       # skipped while its breaker is open


def test_new_worker_pids_reapply_to_pid_tracking_actuators_only():
    src = FakeSource(2.0, [job_stats("a", worker_pids=(1, 2))])
    act, sink = RecordingActuator(), FakeSink()
    c = make(src, [DirectiveActuator(sink), act])
    c.tick(now=1.0)
    src.jobs["a"] = job_stats("a", worker_pids=(1, 2, 3))
    rec = c.tick(now=2.0)
    assert rec.results["a"].ok
    assert [x[2] for x in act.applied] == [(1, 2), (1, 2, 3)]
    assert len(sink.sent) == 1


def test_a_lost_group_reapplies_the_unchanged_allocation_to_that_actuator_only():
    """An actuator that says what it made for a job is gone (``lost_group``: the cgroup actuator's
    group removed by an admin) gets the job's unchanged allocation again at the next tick; before,
    only a change of the allocation or of the worker pids made the controller call it."""
    class Losing(RecordingActuator):
        name = "losing"
        lost: set = set()

        def lost_group(self, job_id):
            return job_id in self.lost

    class Raising(RecordingActuator):
        name = "raising"

        def lost_group(self, job_id):
            raise OSError("a check that fails counts as not lost")

    src = FakeSource(2.0, [job_stats("a", worker_pids=(1, 2)), job_stats("b", worker_pids=(3,))])
    act, other, raising, sink = Losing(), RecordingActuator(), Raising(), FakeSink()
    c = make(src, [DirectiveActuator(sink), act, other, raising])
    c.tick(now=1.0)
    c.tick(now=2.0)
    assert sorted(x[0] for x in act.applied) == ["a", "b"] and len(other.applied) == len(raising.applied) == 2
    act.lost = {"a"}
    rec = c.tick(now=3.0)
    assert rec.results["a"].ok and [x[0] for x in act.applied[2:]] == ["a"]
    assert act.applied[2][1] == act.applied[0][1] if act.applied[0][0] == "a" else act.applied[1][1]
    assert len(other.applied) == len(raising.applied) == 2 and len(sink.sent) == 2     # nobody else called
    act.lost = set()
    c.tick(now=4.0)
    assert len(act.applied) == 3


def test_adopt_and_stop():
    src = FakeSource(4.0, [job_stats("a")])
    sink, act = FakeSink(), RecordingActuator()
    c = make(src, [DirectiveActuator(sink), act])
    c.adopt({"a": JobAllocation(job="a", workers=4, cpus=4.0, io_weight=100, reason="journal")})
    c.tick(now=1.0)
    assert sink.sent == []     # what the journal says is in force matches the plan
    c.stop()
    assert act.restored == 1 and c.applied() == {}


def test_directive_not_delivered_waits_for_hello_and_a_raising_sink_fails():
    c = make(FakeSource(2.0, [job_stats("a")]), [DirectiveActuator(FakeSink(ok=False))])
    rec = c.tick(now=1.0)
    assert rec.results["a"].ok and "not delivered yet" in rec.results["a"].not_enforced[0]

    class Broken:
        def send_directive(self, *a):
            raise ConnectionError("socket closed")

    c = make(FakeSource(2.0, [job_stats("a")]), [DirectiveActuator(Broken())])
    rec = c.tick(now=1.0)
    assert not rec.results["a"].ok and "socket closed" in rec.results["a"].error
    assert c.applied() == {}


def test_none_policy_sends_no_directive_when_the_job_runs_its_own_count():
    sink = FakeSink()
    src = FakeSource(2.0, [job_stats("a", workers=3, requested_workers=3), job_stats("b", workers=5, requested_workers=2)])
    c = make(src, [DirectiveActuator(sink)], policy="none")
    rec = c.tick(now=1.0)
    assert rec.results["a"].ok and rec.results["b"].ok
    assert [(s[0], s[1]) for s in sink.sent] == [("b", 2)]     # b had been moved off its own count


def test_observation_cores():
    snap = FakeSource(4.0, [job_stats("a"), job_stats("b")])(0.0)
    assert observation_from_stats(snap.jobs["a"], snap).cores == 2.0
    j = job_stats("a", allowed_cpus=(0, 1, 2))
    assert observation_from_stats(j, snap).cores == 3.0
    applied = dataclasses.replace(snap, applied={"a": JobAllocation(job="a", workers=1, cpus=1.5)})
    assert observation_from_stats(j, applied).cores == 1.5
    assert observation_from_stats(job_stats("a", window_s=0.0), snap) is None
    assert observation_from_stats(job_stats("a", cpu_s_per_batch=float("nan")), snap) is None
    # 10 batches/s at 0.1 CPU s each is 1 core of workers' CPU: measured 0.2 cores, the window was draining
    # a queue filled earlier (a job cut from 16 workers to one) and says nothing about what cores buy
    made = dict(samples_per_s=320.0, batch_size=32, cpu_s_per_batch=0.1)
    assert observation_from_stats(job_stats("a", worker_cpu_cores=0.2, **made), snap) is None
    assert observation_from_stats(job_stats("a", worker_cpu_cores=0.9, **made), snap) is not None


def test_observation_takes_the_windows_own_batch_size_and_steps_else_the_reported_ones():
    snap = FakeSource(4.0, [job_stats("a")])(0.0)
    base = dict(samples_per_s=325.0, window_s=3.0, batch_size=33, ranks=1, cpu_s_per_batch=0.01, worker_cpu_cores=1.0)
    # a batch sampler's window: 32.5 samples a step over 30 steps, while the client reports its rounded
    # mean since the start (33): the window's own figures, the steps its real count
    obs = observation_from_stats(job_stats("a", **base, samples_per_step=32.5, window_steps=30.0), snap)
    assert obs.batch_size == 32.5 and obs.steps == 30
    # a change 32 -> 64 in the first window after it, while the reported mean has crept to 35
    obs = observation_from_stats(job_stats("a", **{**base, "samples_per_s": 640.0, "batch_size": 35},
                                           samples_per_step=64.0, window_steps=30.0), snap)
    assert obs.batch_size == 64 and isinstance(obs.batch_size, int) and obs.steps == 30
    # two ranks: the window's steps are each rank's (the collector's mean), its batch size one rank's
    obs = observation_from_stats(job_stats("a", **{**base, "samples_per_s": 1280.0, "ranks": 2},
                                           samples_per_step=64.0, window_steps=30.0), snap)
    assert obs.batch_size == 64 and obs.steps == 30
    # none taken (no step, refused, hand-made stats): the reported size, and the steps samples/s make at it
    obs = observation_from_stats(job_stats("a", **base), snap)
    assert obs.batch_size == 33 and obs.steps == round(325.0 / 33 * 3.0)
    obs = observation_from_stats(job_stats("a", **base, samples_per_step=None, window_steps=30.0), snap)
    assert obs.batch_size == 33 and obs.steps == 30
    # the draining check counts batches at the window's size: 640 samples/s of 64 is 10 batches/s, 0.1 core
    drain = dict(base, samples_per_s=640.0, batch_size=2, cpu_s_per_batch=0.05, worker_cpu_cores=0.6)
    assert observation_from_stats(job_stats("a", **drain), snap) is None        # 320 batches/s of 2: 16 cores
    assert observation_from_stats(job_stats("a", **drain, samples_per_step=64.0, window_steps=30.0), snap) is not None


def test_build_off_is_directive_only():
    acts = build("off", sink=FakeSink())
    assert [a.name for a in acts] == ["directive"]
    import pytest
    with pytest.raises(ValueError, match="unknown cgroup mode"):
        build("v3", sink=FakeSink())


def test_predictor_sees_one_observation_per_window_and_curves_are_cached():
    class CountingBank(FakeBank):
        curve_calls = 0

        def curve(self, job_id):
            CountingBank.curve_calls += 1
            return super().curve(job_id)

    bank = CountingBank()
    src = FakeSource(2.0, [job_stats("a", window_s=2.0)])
    c = Controller(snapshot_source=src, policy=get_policy("adaptive"), policy_config=PolicyConfig(),
                   predictor=bank, actuators=[RecordingActuator()], observe_interval_s=0.0)
    recs = [c.tick(now=float(t)) for t in range(5)]
    assert len(bank.seen) == 3                       # t = 0, 2, 4
    assert CountingBank.curve_calls == 3             # only after each observation
    assert all(r.curves["a"]["source"] == "first-principles" for r in recs)
    c.forget("a")
    src.jobs.clear()
    assert c.tick(now=5.0).curves == {}


def test_observations_are_spaced_by_the_interval_and_spread_over_ticks():
    """Jobs that arrive together are observed at once, then at most once per interval, not all in one tick."""
    bank = FakeBank()
    jobs = [job_stats(f"j{i}", window_s=1.0) for i in range(32)]
    src = FakeSource(8.0, jobs)
    c = Controller(snapshot_source=src, policy=get_policy("even"), policy_config=PolicyConfig(),
                   predictor=bank, actuators=[RecordingActuator()], observe_interval_s=3.0)
    times: dict[str, list[float]] = {j.job: [] for j in jobs}
    per_tick = []
    for t in range(13):
        n = len(bank.seen)
        c.tick(now=float(t))
        for jid, _obs in bank.seen[n:]:
            times[jid].append(float(t))
        per_tick.append(len(bank.seen) - n)
    assert per_tick[0] == 32                                   # every job's first window at once
    assert max(per_tick[1:]) < 32 and min(per_tick[1:4]) > 0   # later ones spread over the ticks
    for jid, ts in times.items():
        assert ts[0] == 0.0 and len(ts) >= 4                   # then about every 3 s over 12 s
        assert all(b - a >= 3.0 - 1e-9 for a, b in zip(ts[1:], ts[2:])), (jid, ts)
        assert ts[1] - ts[0] <= 3.0


def test_window_spanning_an_allocation_change_is_not_observed():
    """Observation hygiene: a window that began before the last applied change mixes two configurations."""
    class Steered:
        """Policy fake: the job's workers as told by ``plan`` (a change whenever the test changes it)."""
        __name__ = "steered"
        workers = 2

        def __call__(self, snapshot, model, config):
            from agent.model import AllocationPlan
            return AllocationPlan(policy="steered", allocations={
                j: JobAllocation(job=j, workers=self.workers, cpus=2.0) for j in snapshot.jobs})

    bank, policy, act = FakeBank(), Steered(), RecordingActuator()
    src = FakeSource(4.0, [job_stats("a", window_s=2.0)])
    c = Controller(snapshot_source=src, policy=policy, policy_config=PolicyConfig(), predictor=bank,
                   actuators=[act], observe_interval_s=0.0)

    def observed_at(t):
        n = len(bank.seen)
        c.tick(now=t)
        return len(bank.seen) > n

    assert observed_at(0.0)            # first window; the first allocation is applied after it, at t=0
    assert not observed_at(1.0)        # a window length has not passed since the last observation
    assert observed_at(2.0)            # window [0, 2] starts at the change: clean
    policy.workers = 3
    assert not observed_at(3.0)        # not due; the change is applied at t=3
    assert len(act.applied) == 2
    assert not observed_at(4.0)        # due, but window [2, 4] spans the change at t=3: skipped
    assert observed_at(5.0)            # window [3, 5]: after the change
    assert bank.seen[-1][1].workers == 2     # the collector's stand-in still reports 2; only timing matters here
    # re-applying the same allocation to new worker pids is not a change
    src.jobs["a"] = dataclasses.replace(src.jobs["a"], worker_pids=(101, 102, 103))
    assert not observed_at(6.0)
    assert len(act.applied) == 3      # the pid-tracking actuator was called for the new pid
    assert observed_at(7.0)           # due (2 s after t=5) and window [5, 7] holds no change
    # a forgotten job forgets its change time too
    c.forget("a")
    assert "a" not in c._applied_at


def test_observed_cores_under_a_work_conserving_share():
    """A share is a floor, not a ceiling: uncontended workers use more, and the window says so."""
    snap = FakeSource(4.0, [job_stats("a"), job_stats("b")])(0.0)
    share = JobAllocation(job="a", workers=2, cpus=1.0)
    shared = dataclasses.replace(snap, applied={"a": share})           # what the controller adds
    busy = job_stats("a", worker_cpu_cores=2.6)
    assert observation_from_stats(busy, shared).cores == 2.6                    # used more than its share
    idle = job_stats("a", worker_cpu_cores=0.4, samples_per_s=64.0)
    assert observation_from_stats(idle, shared).cores == 1.0                    # the share is still there
    greedy = job_stats("a", worker_cpu_cores=7.0)
    assert observation_from_stats(greedy, shared).cores == 4.0                  # never past the loader CPUs
    pinned = job_stats("a", worker_cpu_cores=2.6, allowed_cpus=(0, 1))
    assert observation_from_stats(pinned, shared).cores == 2.0                  # nor past its CPU set
    # under a cap (quota / cpuset knob) the applied cores are what the workers could use
    assert observation_from_stats(busy, shared, work_conserving=False).cores == 1.0
    # an informational allocation (enforce_cpu=False) caps nothing
    info = dataclasses.replace(snap, applied={"a": dataclasses.replace(share, enforce_cpu=False)})
    assert observation_from_stats(busy, info, work_conserving=False).cores == 2.6
    # a cooperative job is pinned by affinity: its applied cores stand
    coop = dataclasses.replace(busy, cooperative=True)
    assert observation_from_stats(coop, shared).cores == 1.0
    # nothing applied yet: the even split, or more if the workers used more
    assert observation_from_stats(job_stats("a", worker_cpu_cores=3.0), snap).cores == 3.0


def test_observed_cores_received_where_a_contended_share_was_not_delivered():
    """``observed_cores="received"``: a window in which the GPU waited for data and the workers queued
    for a CPU counts the CPU they received where the share was not delivered (a small node shares a
    contended CPU per thread: a 1-worker job planned 0.5 cores ran on 0.35 beside a 2-worker one); any
    other window counts as with "share" (the default), which keeps the share."""
    snap = FakeSource(1.8, [job_stats("a"), job_stats("b")])(0.0)
    shared = dataclasses.replace(snap, applied={"a": JobAllocation(job="a", workers=1, cpus=0.5)})
    short = job_stats("a", workers=1, worker_cpu_cores=0.35, samples_per_s=160.0, cpu_s_per_batch=0.07,
                      wall_s_per_batch=0.19, runq_s_per_batch=0.12, blocked_s_per_batch=0.0, data_wait_frac=0.28)
    assert observation_from_stats(short, shared).cores == 0.5
    assert observation_from_stats(short, shared, observed_cores="received").cores == pytest.approx(0.35)
    fed = dataclasses.replace(short, data_wait_frac=0.01)          # the GPU did not wait: not the loader's limit
    assert observation_from_stats(fed, shared, observed_cores="received").cores == 0.5
    unqueued = dataclasses.replace(short, runq_s_per_batch=0.01)   # workers not kept from a CPU
    assert observation_from_stats(unqueued, shared, observed_cores="received").cores == 0.5
    more = dataclasses.replace(short, worker_cpu_cores=0.7, samples_per_s=320.0)
    assert observation_from_stats(more, shared, observed_cores="received").cores == pytest.approx(0.7)
    # under a cap (quota, cpuset) the applied cores stand
    assert observation_from_stats(short, shared, work_conserving=False, observed_cores="received").cores == 0.5
    # the controller feeds its predictor what its setting says
    for mode, cores in (("share", 0.5), ("received", 0.35)):
        bank = FakeBank()
        c = Controller(snapshot_source=lambda now: dataclasses.replace(FakeSource(1.8, [short])(now)),
                       policy=get_policy("none"), policy_config=PolicyConfig(), predictor=bank,
                       actuators=[], observed_cores=mode)
        c.adopt({"a": JobAllocation(job="a", workers=1, cpus=0.5)})
        c.tick(10.0)
        assert bank.seen and bank.seen[-1][1].cores == pytest.approx(cores), mode
    with pytest.raises(ValueError, match="observed_cores"):
        Controller(snapshot_source=FakeSource(), policy=get_policy("none"), policy_config=PolicyConfig(),
                   predictor=FakeBank(), actuators=[], observed_cores="delivered")

def test_controller_knows_share_from_cap_by_its_actuators():
    class QuotaActuator(RecordingActuator):
        cpu_knob = "quota"

    class SharesActuator(RecordingActuator):
        cpu_knob = "shares"

    src = FakeSource(4.0, [job_stats("a", worker_cpu_cores=3.5), job_stats("b", worker_cpu_cores=0.1)])
    for act, expect in ((SharesActuator(), 3.5), (QuotaActuator(), 2.0), (RecordingActuator(), 3.5)):
        bank = FakeBank()
        c = Controller(snapshot_source=src, policy=get_policy("even"), policy_config=PolicyConfig(),
                       predictor=bank, actuators=[DirectiveActuator(FakeSink()), act])
        c.tick(now=0.0)                # nothing applied yet: even split 2.0, but 3.5 used
        assert [o.cores for j, o in bank.seen if j == "a"] == [3.5]
        c.tick(now=2.0)                # even split applied at t=0 (2.0 cores): a share or a cap
        assert [o.cores for j, o in bank.seen if j == "a"][-1] == expect, act


class NodeActuator:
    """A RecordingActuator that also takes the plan's node allocation (as the cgroup actuator does)."""
    name = "node"
    tracks_pids = False

    def __init__(self, fail=0):
        self.nodes, self.fail = [], fail

    def apply(self, job, desired):
        from agent.model import ApplyResult

        return ApplyResult(job=job.job, ok=True, applied=desired)

    def apply_node(self, node):
        self.nodes.append(node)
        if self.fail:
            self.fail -= 1
            raise OSError("EBUSY")
        return ["a note"]

    def release(self, job_id):
        pass

    def restore(self):
        pass


def test_node_allocation_goes_to_actuators_that_take_it_on_change_only_and_is_retried():
    busy = dict(trainer_cpu_s_per_step=0.02, compute_s_per_step=0.1)
    src = FakeSource(1.8, [job_stats("a", **busy), job_stats("b", **busy)])
    src_call = src.__call__
    foreign = [0.0]
    source = lambda now: dataclasses.replace(src_call(now), foreign_cpu_cores=foreign[0])
    node_act, sink = NodeActuator(fail=1), FakeSink()
    c = make(source, [DirectiveActuator(sink), node_act])
    rec = c.tick(now=1.0)
    assert rec.plan.node.loaders_yield
    assert len(node_act.nodes) == 1 and any("node node: OSError" in e for e in rec.errors)
    assert c.applied_node() is None                       # it failed: not in force
    rec = c.tick(now=2.0)                                 # retried, applied
    assert len(node_act.nodes) == 2 and not rec.errors and rec.node_notes == ("a note",)
    assert c.applied_node() == rec.plan.node
    assert rec.to_dict()["node"]["loaders_yield"] is True
    c.tick(now=3.0)                                       # the same node allocation: not applied again
    assert len(node_act.nodes) == 2
    foreign[0] = 2.0                                      # a tenant takes 2 cores: the loaders stop yielding
    rec = c.tick(now=4.0)
    assert not rec.plan.node.loaders_yield and not node_act.nodes[-1].loaders_yield


def test_a_load_that_comes_back_keeps_the_loaders_weighing_through_its_gaps_with_foreign_intermittent():
    """The controller's ``ForeignPattern`` over the node allocations it applied: a tenant stops the
    yield, leaves (the yield resumes), comes back 5 s later (stops it again): from then on, with
    ``foreign_intermittent = "weigh"`` (the default), its next gap keeps the subtree weighing its workers
    (it yields in the gap with "yield"); after ``foreign_return_s`` (12 s by default) away it yields
    again."""
    from agent.policies import FOREIGN_RETURN_S
    busy = dict(trainer_cpu_s_per_step=0.02, compute_s_per_step=0.1)

    def run(intermittent):
        src = FakeSource(1.8, [job_stats("a", **busy), job_stats("b", **busy)])
        src_call, foreign = src.__call__, [0.0]
        source = lambda now: dataclasses.replace(src_call(now), foreign_cpu_cores=foreign[0],
                                                 foreign_held_cpu_cores=foreign[0])
        node_act = NodeActuator()
        c = Controller(snapshot_source=source, policy=get_policy("even"),
                       policy_config=PolicyConfig(foreign_intermittent=intermittent), predictor=FakeBank(),
                       actuators=[DirectiveActuator(FakeSink()), node_act])
        yields = {}
        for t in range(1, 80):
            foreign[0] = 1.2 if 5 <= t < 10 or 15 <= t < 20 or 25 <= t < 30 else 0.0
            yields[t] = c.tick(now=float(t)).plan.node
        return yields

    default, weigh = run("yield"), run("weigh")
    assert default[4].loaders_yield and not default[6].loaders_yield and default[11].loaders_yield
    assert not default[16].loaders_yield and default[21].loaders_yield      # switches with every gap
    assert [weigh[t].loaders_yield for t in (4, 6, 11, 16)] == [True, False, True, False]   # learning
    back = int(FOREIGN_RETURN_S)
    for t in range(16, 29 + back):                                           # back 5 s after it left
        assert not weigh[t].loaders_yield and weigh[t].weigh_workers, t
    assert "comes and goes" in weigh[22].reason
    assert weigh[31 + back].loaders_yield                                    # away that long since t = 30


def test_each_window_the_predictor_gets_is_logged_at_debug_with_the_curve_it_made(caplog):
    """log_level = "debug": an ``observation`` event per window fed to the predictor, with the curve's
    figures (what an operator, or the bench's --agent-log-level debug, reads to see why a curve is what
    it is); nothing at info."""
    import logging

    from predictor.bank import PredictorBank

    src = FakeSource(4.0, [job_stats("a")])
    c = Controller(snapshot_source=src, policy=get_policy("even"), policy_config=PolicyConfig(),
                   predictor=PredictorBank(prior=None), actuators=[RecordingActuator()])
    with caplog.at_level(logging.INFO, logger="agent.controller"):
        c.tick(now=10.0)
    assert not [r for r in caplog.records if getattr(r, "event", None) == "observation"]
    with caplog.at_level(logging.DEBUG, logger="agent.controller"):
        c.tick(now=30.0)
    (rec,) = [r for r in caplog.records if getattr(r, "event", None) == "observation"]
    assert rec.fields["job"] == "a"
    assert rec.fields["window"]["workers"] == src.jobs["a"].workers and rec.fields["window"]["steps"] > 0
    assert rec.fields["curve"]["source"] and rec.fields["curve"]["overhead_s_per_step"] >= 0
    assert rec.fields["curve"]["ceiling_samples_per_s"] > 0


def test_a_jobs_new_phase_is_found_in_the_agents_debug_log(tmp_path, capsys):
    """End to end through the agent's own JSON log lines: a controller at ``debug`` logs each window it
    feeds the predictor; ``evaluation.phase_scan`` replays that log through a fresh bank and finds the
    one job whose workers' CPU per batch tripled, at the second window of its new pipeline, and nothing
    in its steady neighbour."""
    import logging

    from agent import logs
    from evaluation import phase_scan
    from predictor.bank import PredictorBank

    # consistent figures: 2 workers at 0.1 CPU-s a batch keep a 0.1-s step fed (10 batches/s, 1 core);
    # at 0.3 they make 6.25 batches/s on 1.9 cores and the step waits 0.06 s for data
    fed = dict(samples_per_s=320.0, compute_s_per_step=0.1, data_wait_s_per_step=0.0, data_wait_frac=0.0,
               cpu_s_per_batch=0.1, wall_s_per_batch=0.12, runq_s_per_batch=0.0, blocked_s_per_batch=0.02,
               worker_cpu_cores=1.0)
    heavy = dict(fed, samples_per_s=200.0, data_wait_s_per_step=0.06, data_wait_frac=0.375,
                 cpu_s_per_batch=0.3, wall_s_per_batch=0.32, worker_cpu_cores=1.875)
    src = FakeSource(4.0, [job_stats("a", **fed), job_stats("b", **fed)])
    c = Controller(snapshot_source=src, policy=get_policy("even"), policy_config=PolicyConfig(),
                   predictor=PredictorBank(prior=None), actuators=[RecordingActuator()])
    path = tmp_path / "agent.log"
    log = logging.getLogger("agent.controller")
    handler = logging.FileHandler(path)
    handler.setFormatter(logs.JsonFormatter())
    old_level = log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        for k in range(24):
            if k == 12:
                src.jobs["a"] = job_stats("a", **heavy)
            c.tick(now=10.0 + 10.0 * k)
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)
        handler.close()
    jobs = phase_scan.windows_by_job(path)
    assert set(jobs) == {"a", "b"} and len(jobs["a"]) >= 8
    found = phase_scan.replay(jobs, None)
    assert [(r["job"], r["kept"]) for r in found] == [("a", 2)]
    first_new = next(i for i, (_, w) in enumerate(jobs["a"]) if w["cpu_s_per_batch"] > 2 * jobs["a"][0][1]["cpu_s_per_batch"])
    assert found[0]["window"] == first_new + 1
    assert phase_scan.main([str(tmp_path), "--prior", "none", "--out", str(tmp_path / "scan.json")]) == 0
    out = capsys.readouterr().out
    assert "new phases found: 1" in out and "| a |" in out
    assert json.loads((tmp_path / "scan.json").read_text())["adjacent"]["cpu per sample"]["pairs"] > 0


def test_with_the_collectors_reports_the_predictor_gets_the_raw_window_since_the_change():
    """Where the snapshot carries each rank's reports (the real collector), the predictor's window is
    cut from them: it starts at a change of the worker count (or the last window's end), not at a
    smoothed figure's memory of the previous configuration, and its figures are the reports'
    differences. A change of the cores alone does not cut it: its cores are the time-weighted mean of
    the cores applied over it, and its rates the totals over it."""
    from agent.model import AllocationPlan, Report

    class Steered:
        __name__ = "steered"
        cpus, workers = 1.0, 2

        def __call__(self, snapshot, model, config):
            return AllocationPlan(policy="steered", allocations={
                j: JobAllocation(job=j, workers=self.workers, cpus=self.cpus) for j in snapshot.jobs})

    reports: list = []

    def report(t, step_s, workers):
        """The loop's pace changes with the cores: a step of ``step_s`` (all of it waiting for data
        beyond 0.1 s of compute) from the last report to ``t``."""
        prev = reports[-1].totals if reports else {"steps": 1.0, "samples": 32.0, "batches": 1.0, "data_wait_s": 0.0,
                                                   "compute_s": 0.1, "worker_cpu_s": 0.2}
        dt = t - (reports[-1].recv_t if reports else t - 1.0)
        n = dt / step_s
        totals = {"steps": prev["steps"] + n, "samples": prev["samples"] + 32 * n, "batches": prev["batches"] + n,
                  "data_wait_s": prev["data_wait_s"] + n * (step_s - 0.1), "compute_s": prev["compute_s"] + n * 0.1,
                  "worker_cpu_s": prev["worker_cpu_s"] + n * 0.2, "worker_wall_s": None, "worker_runq_s": None,
                  "worker_blocked_s": None, "main_cpu_s": None, "main_runq_s": None}
        reports.append(Report(recv_t=t, uptime_s=t, totals=totals, workers=workers, live_workers=workers))

    bank, policy = FakeBank(), Steered()
    # the smoothed figures say a 0.4 s step: the raw reports are what the window must use
    src = FakeSource(4.0, [job_stats("a", data_wait_s_per_step=0.3, compute_s_per_step=0.1, window_s=1.0)])
    c = Controller(snapshot_source=src, policy=policy, policy_config=PolicyConfig(), predictor=bank,
                   actuators=[RecordingActuator()], observe_interval_s=3.0)

    def tick(t, step_s, workers=2):
        report(t, step_s, workers)
        src.jobs["a"] = dataclasses.replace(src.jobs["a"], history=(tuple(reports),))
        n = len(bank.seen)
        c.tick(now=t)
        return bank.seen[-1][1] if len(bank.seen) > n else None

    pace = lambda t: 0.4 if t <= 6 else 0.2      # 1.0 core until t=6, then 2.0: the step halves
    assert tick(0.0, 0.4) is None                # one report: no window yet; 1.0 core applied at t=0
    seen = []
    for t in range(1, 18):
        if t == 6:
            policy.cpus = 2.0                    # more cores (workers unchanged), applied at t=6
        if t == 11:
            policy.workers = 3                   # a third worker, applied at t=11, live from t=12
        obs = tick(float(t), pace(t), workers=3 if t >= 12 else 2)
        if obs is not None:
            seen.append((float(t), obs))
    assert seen[0][0] == 1.0                     # the first window as soon as there is one: [0, 1]
    prev_end, spanned = 0.0, False
    for t, obs in seen:
        start = t - obs.duration_s
        if t <= 11.0:
            assert start == pytest.approx(prev_end)               # abutting, across the change of cores
        else:
            assert start >= 11.0 - 1e-9                            # never across the change of workers
            assert obs.workers == 3
        ones = max(0.0, min(t, 6.0) - start)                       # seconds of it at 1.0 core
        assert obs.cores == pytest.approx((ones * 1.0 + (obs.duration_s - ones) * 2.0) / obs.duration_s)
        steps = ones / 0.4 + (obs.duration_s - ones) / 0.2
        assert obs.samples_per_s == pytest.approx(32 * steps / obs.duration_s)
        assert obs.cpu_s_per_batch == pytest.approx(0.2)
        spanned |= start < 6.0 < t
        prev_end = t
    assert spanned and any(t > 12.0 for t, _ in seen)
    assert all(b - a >= 3.0 - 1e-9 for (a, _), (b, _) in zip(seen[1:], seen[2:]))


def test_a_job_that_never_holds_still_falls_back_to_the_smoothed_figures():
    """Reports whose live worker count never matches the target (workers restarted every short epoch,
    or a client that counts them differently) give no settled window: after UNSETTLED_FALLBACK_S the
    job is observed from the smoothed figures rather than never."""
    from agent.controller import UNSETTLED_FALLBACK_S
    from agent.model import Report

    bank = FakeBank()
    src = FakeSource(4.0, [job_stats("a", window_s=1.0)])
    c = Controller(snapshot_source=src, policy=get_policy("even"), policy_config=PolicyConfig(),
                   predictor=bank, actuators=[RecordingActuator()], observe_interval_s=3.0)
    reports = []
    seen_at = []
    for t in range(int(UNSETTLED_FALLBACK_S) + 8):
        steps = 1.0 + 5 * t
        reports.append(Report(recv_t=float(t), uptime_s=float(t), workers=2, live_workers=1,
                              totals={"steps": steps, "samples": 32 * steps, "batches": steps,
                                      "data_wait_s": 0.05 * steps, "compute_s": 0.15 * steps}))
        src.jobs["a"] = dataclasses.replace(src.jobs["a"], history=(tuple(reports),))
        n = len(bank.seen)
        c.tick(now=float(t))
        if len(bank.seen) > n:
            seen_at.append(float(t))
    assert seen_at and seen_at[0] >= UNSETTLED_FALLBACK_S            # not before the fallback
    assert bank.seen[0][1].samples_per_s == pytest.approx(320.0)      # the smoothed figures (job_stats')
    # ... of the one worker that took tasks, not of the target of 2 (an IterableDataset's epoch keeps its
    # shards: a resize waits for the next epoch, which for an endless stream never comes)
    assert all(obs.workers == 1 for _, obs in bank.seen)


def test_a_loop_that_stopped_stepping_is_not_observed_from_its_decaying_smoothed_figures():
    """A training loop that stops iterating while its client stays connected (a debugger, a hung trainer,
    a long validation pass): its reports keep coming with the same totals, so no window settles. The
    fallback to the smoothed figures after UNSETTLED_FALLBACK_S fed a window every 3 s in which the job
    took "1 step" (made up) and delivered ~0 samples/s at its configuration: a 150 s stop filled its whole
    history. It is fed none until the loop steps again, and then windows of its steps only."""
    from agent.controller import UNSETTLED_FALLBACK_S
    from agent.model import Report

    bank = FakeBank()
    src = FakeSource(4.0, [job_stats("a", window_s=1.0)])
    c = Controller(snapshot_source=src, policy=get_policy("even"), policy_config=PolicyConfig(),
                   predictor=bank, actuators=[RecordingActuator()], observe_interval_s=3.0)
    reports, steps = [], 1.0
    stop, resume = 6, 6 + int(UNSETTLED_FALLBACK_S) + 20
    fed = []
    for t in range(resume + 10):
        if not stop <= t < resume:
            steps += 10
        # (the loader counts the stop as paused_s at the next() that ends it)
        reports.append(Report(recv_t=float(t), uptime_s=float(t), workers=2, live_workers=2,
                              totals={"steps": steps, "samples": 32 * steps, "batches": steps,
                                      "data_wait_s": 0.01 * steps, "compute_s": 0.09 * steps,
                                      "paused_s": float(resume - stop) if t >= resume else 0.0}))
        # (the smoothed figures decay toward nothing while the loop stands still)
        rate = 320.0 if not stop <= t < resume else 320.0 * 0.5 ** (t - stop)
        src.jobs["a"] = dataclasses.replace(src.jobs["a"], samples_per_s=rate, history=(tuple(reports[-30:]),))
        n = len(bank.seen)
        c.tick(now=float(t))
        if len(bank.seen) > n:
            fed.append(float(t))
    assert any(t < stop for t in fed) and any(t > resume for t in fed)
    assert not [t for t in fed if stop + 1 < t <= resume], fed           # (nor the resume's own report)
    assert all(o.samples_per_s >= 300.0 for _, o in bank.seen)


# -- a loader whose workers change only at an epoch (an IterableDataset), through the real collector -----

def _stream_agent(hello_extra: dict, workers: int = 1):
    """A registry, collector and controller (``even`` on 3 loader cores, a recording actuator) with one
    rank of job "s" that said hello with ``workers`` (its own count) and ``hello_extra``; returns
    (controller, actuator, bank, report(t, stats))."""
    import os

    from adloader import protocol
    from agent.collector import Collector
    from agent.registry import Registry
    from agent.security import Peer

    me, peer = os.getpid(), Peer(os.getuid(), 0, os.getpid())
    reg = Registry()
    reg.hello(peer, b"c", protocol.make("hello", job="s", rank=0, pid=me, gpus=["0"], batch_size=4, workers=workers,
                                        requested_workers=workers, max_workers=4, **hello_extra), 0.0)
    col = Collector(reg, loader_cpus=3.0, cpu_ids=(0, 1, 2))
    act, bank = RecordingActuator(), FakeBank()
    ctl = Controller(snapshot_source=col.snapshot, policy=get_policy("even"), policy_config=PolicyConfig(),
                     predictor=bank, actuators=[act], observe_interval_s=3.0)

    def report(t: float, stats: dict) -> None:
        r = reg.report(b"c", peer, protocol.make("report", job="s", rank=0, pid=me, worker_pids=[], stats=stats), t)
        col.on_report(r.job, r.rank, r.pid, stats, t)

    return ctl, act, bank, report


def _stream_totals(t: float) -> dict:
    """A loader's totals after ``t`` seconds of 10 steps a second, 4 samples each."""
    steps = 10.0 * t
    return {"steps": steps, "samples": 4 * steps, "batches": steps, "data_wait_s": 0.05 * t, "compute_s": 0.9 * t,
            "worker_cpu_s": 0.5 * t, "worker_wall_s": 0.9 * t, "uptime_s": t, "batch_size": 4}


def test_a_streams_first_directive_sends_no_count_its_epoch_cannot_take_and_a_finite_ones_next_epoch_gets_one():
    """The hello says dataset_kind "iterable": from the first plan on (before any report), the stream is
    held at the worker it runs; a count sent then would only become a target for the next epoch, which
    for an endless stream never comes (the old first directive said 3). Its reports in epoch 0 keep it
    there. Past its first epoch's end (a finite IterableDataset) the plan sets the next epoch's count,
    3, once: the pending target then stays, and at the epoch after, its 3 workers run."""
    ctl, act, _, report = _stream_agent({"dataset_kind": "iterable"})
    rec = ctl.tick(0.5)
    assert not rec.errors and rec.plan.allocations["s"].workers == 1
    assert "runs 1 workers until its epoch ends" in rec.plan.allocations["s"].reason
    base = dict(workers=1, live_workers=1, dataset_kind="iterable")
    for t in range(1, 4):
        report(float(t), {**_stream_totals(t), **base, "epoch": 0})
        assert ctl.tick(t + 0.5).plan.allocations["s"].workers == 1
    assert [d.workers for _, d, _ in act.applied] == [1]
    report(4.0, {**_stream_totals(4), **base, "epoch": 1})
    assert ctl.tick(4.5).plan.allocations["s"].workers == 3               # for when epoch 1 ends
    report(5.0, {**_stream_totals(5), **base, "workers": 3, "epoch": 1})    # target 3, 1 live until then
    assert ctl.tick(5.5).plan.allocations["s"].workers == 3
    report(6.0, {**_stream_totals(6), **base, "workers": 3, "live_workers": 3, "epoch": 2})
    assert ctl.tick(6.5).plan.allocations["s"].workers == 3
    assert [d.workers for _, d, _ in act.applied] == [1, 3]


def test_a_client_that_does_not_say_its_datasets_kind_is_never_held_and_is_learned_by_its_live_workers():
    """An adloader older than ``dataset_kind`` (hello and stats without it): the agent cannot tell a
    stream from a map-style loader, so it is planned as one whose workers change when told (3 at once,
    and its target stays 3) and never held. Its windows never settle (1 live worker of 3) and it is
    learned from its smoothed figures labelled with the 1 worker that ran, and nothing raises."""
    from agent.controller import UNSETTLED_FALLBACK_S

    ctl, act, bank, report = _stream_agent({})
    assert ctl.tick(0.5).plan.allocations["s"].workers == 3
    for t in range(1, int(UNSETTLED_FALLBACK_S) + 8):
        report(float(t), {**_stream_totals(t), "workers": 3, "live_workers": 1, "epoch": 0})
        rec = ctl.tick(t + 0.5)
        assert not rec.errors, rec.errors
        assert rec.plan.allocations["s"].workers == 3 and "epoch" not in rec.plan.allocations["s"].reason
    assert bank.seen and all(obs.workers == 1 for _, obs in bank.seen)


def test_a_stream_loading_in_its_training_process_is_not_told_to_start_workers():
    """``num_workers=0`` over an IterableDataset: its loading runs in the training process, 0 live workers.
    A count sent mid-epoch only becomes its target (adloader warns; it starts workers at the next epoch,
    never for an endless stream). Held from the hello on, before and after its first epoch's end: its
    count stays 0, and it is learned as the in-process loader it is (the old plan said 3 at once)."""
    ctl, act, bank, report = _stream_agent({"dataset_kind": "iterable"}, workers=0)
    assert ctl.tick(0.5).plan.allocations["s"].workers == 0
    for t in range(1, 8):
        report(float(t), {**_stream_totals(t), "workers": 0, "live_workers": 0, "dataset_kind": "iterable",
                          "epoch": 0 if t < 4 else 1})
        rec = ctl.tick(t + 0.5)
        assert not rec.errors, rec.errors
        a = rec.plan.allocations["s"]
        assert a.workers == 0 and "loads in its training process" in a.reason
    assert [d.workers for _, d, _ in act.applied] == [0]
    assert bank.seen and all(obs.workers == 0 for _, obs in bank.seen)


@pytest.mark.parametrize("fields", [dict(window_s=float("nan")), dict(window_s=float("inf")),
                                    dict(samples_per_s=float("nan")), dict(window_steps=float("nan")),
                                    dict(window_steps=float("inf")),
                                    dict(window_steps=float("nan"), samples_per_s=float("nan"))])
def test_a_window_whose_figures_are_not_numbers_is_no_observation(fields):
    """A JobStats with a NaN or infinite window length, samples/s or step count (no collector's: it takes
    report figures up to 2**53 over at least MIN_WINDOW_S; a hand-made or corrupt one) raised ValueError or
    OverflowError from int(round(...)) while counting the window's steps, where the docstring promised None:
    the controller caught it, but dropped the job's curve and recorded an error at every tick it lasted."""
    snap = FakeSource(4.0, [job_stats("a")])(0.0)
    assert observation_from_stats(job_stats("a", **fields), snap) is None
    # and a finite window still counts its steps as before
    assert observation_from_stats(job_stats("a", window_steps=30.4), snap).steps == 30
    assert observation_from_stats(job_stats("a"), snap).steps == round(320.0 / 32 * 2.0)


def test_a_change_of_the_jobs_ranks_resends_its_directive_to_rank_tracking_actuators_only():
    """The directive's count is the job's, each rank sent its part: when a rank leaves (or joins, or is
    restarted) the parts sent no longer add up to it. Before, a 2-rank job planned 4 workers (2 a rank)
    that lost a rank ran 2 while the plan, held, and ``adloader status`` said 4: nothing was sent again."""
    two = dict(ranks=2, pids=(10, 11), workers=4, worker_pids=(1, 2, 3, 4))
    src = FakeSource(4.0, [job_stats("a", **two)])
    act, sink = RecordingActuator(), FakeSink()
    c = make(src, [DirectiveActuator(sink), act])
    c.tick(now=1.0)
    assert [s[:2] for s in sink.sent] == [("a", 4)] and len(act.applied) == 1
    c.tick(now=2.0)
    assert len(sink.sent) == 1                                      # nothing changed: nothing sent
    src.jobs["a"] = job_stats("a", **dict(two, ranks=1, pids=(10,), workers=2, worker_pids=(1, 2)))
    rec = c.tick(now=3.0)
    assert rec.results["a"].ok and [s[:2] for s in sink.sent] == [("a", 4), ("a", 4)]
    assert len(act.applied) == 2                                    # (its worker pids changed too)
    src.jobs["a"] = job_stats("a", **dict(two, pids=(10, 12)))      # a rank restarted: new pid, same count
    c.tick(now=4.0)
    assert len(sink.sent) == 3
    # adopted from the journal: in force as it was, its ranks' pids not known yet; nothing is re-sent
    c2 = make(src, [DirectiveActuator(sink)])
    c2.adopt({"a": c.applied()["a"]})
    c2.tick(now=5.0)
    assert len(sink.sent) == 3
