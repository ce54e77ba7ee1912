"""The cgroup v2 actuator against ``tests.fakes.FakeV2Kernel``: a faithful fake of the unified hierarchy
in tmp_path (its rules are in its docstring), standalone and under systemd's delegation (the agent's own
unit cgroup). Fixtures ``v2`` and ``delegated``: tests/conftest.py.
"""
from __future__ import annotations

import errno
import json
import os

import pytest

from agent import cgroupfs
from agent.actuators.cgroup import CgroupActuator, weight_from_shares
from agent.cgroupfs import Busy, NotSupported
from agent.model import JobAllocation
from tests.fakes import OWN, FakeV2Kernel, cgroup_job, fake_proc

pytestmark = pytest.mark.component


def read(kernel, rel, file):
    return kernel.read(rel, file)


def test_v2_shares_group_controllers_and_pids(v2):
    kernel, make = v2
    act = make()
    r = act.apply(cgroup_job("job-1", [101, 102]), JobAllocation(job="job-1", workers=2, cpus=1.0, io_weight=150))
    assert r.ok, r.error
    assert "cpu" in kernel.subtree_control("") and "memory" in kernel.subtree_control("")
    assert "cpu" in kernel.subtree_control("adloader")
    assert read(kernel, "adloader/job-1", "cpu.weight") == "100"           # 1024 shares -> weight 100
    assert read(kernel, "adloader", "cpu.weight") == "200"                # 2 workers weigh 2 tasks
    assert set(kernel.procs("adloader/job-1")) == {101, 102}
    assert cgroupfs.proc_cgroups(101, kernel.proc_root)[""] == "/adloader/job-1"
    # BFQ on sda but no iocost: io.bfq.weight is the file that does something
    assert act.io_mode == "io.bfq.weight" and read(kernel, "adloader/job-1", "io.bfq.weight") == "150"
    assert any("nvme0n1" in n for n in r.not_enforced)                    # not on the 'none' device
    assert any("nfs4 at /data" in n for n in r.not_enforced)              # network fs: never reached


def test_v2_jobs_split_by_cores_subtree_weighs_its_workers(v2):
    """Job groups: proportional to cores (the policy's split). The subtree: 100 per worker, whatever the
    cores, written again only when the worker total changes, restored (removed: we made it) on stop."""
    kernel, make = v2
    act = make(io=False)
    act.apply(cgroup_job("a", [101, 102]), JobAllocation(job="a", workers=2, cpus=0.3))
    act.apply(cgroup_job("b", [103]), JobAllocation(job="b", workers=1, cpus=0.9))
    assert read(kernel, "adloader/a", "cpu.weight") == "30" and read(kernel, "adloader/b", "cpu.weight") == "90"
    assert read(kernel, "adloader", "cpu.weight") == "300"                # 3 workers, not 1.2 cores' 120
    subtree_writes = lambda: [w for w in kernel.writes if w[:2] == ("adloader", "cpu.weight")]
    n = len(subtree_writes())
    act.apply(cgroup_job("b", [103]), JobAllocation(job="b", workers=1, cpus=1.2))     # cores change only
    assert read(kernel, "adloader/b", "cpu.weight") == "120" and len(subtree_writes()) == n
    act.apply(cgroup_job("a", [101]), JobAllocation(job="a", workers=1, cpus=0.3))     # a resized to 1 worker
    assert read(kernel, "adloader", "cpu.weight") == "200" and len(subtree_writes()) == n + 1
    act.release("a")
    assert read(kernel, "adloader", "cpu.weight") == "100"
    act.restore()
    assert not kernel.exists("adloader")


def test_v2_a_plan_cpu_weight_is_the_group_weight_and_quota_ignores_it(v2):
    """``cpu_weight`` sets the job group's cpu.weight (shares knob); a quota stays the planned cores."""
    kernel, make = v2
    act = make(io=False)
    act.apply(cgroup_job("a", [101]), JobAllocation(job="a", workers=1, cpus=0.2, cpu_weight=0.9))
    assert read(kernel, "adloader/a", "cpu.weight") == "90"
    act.apply(cgroup_job("a", [101]), JobAllocation(job="a", workers=1, cpus=0.2))
    assert read(kernel, "adloader/a", "cpu.weight") == "20"
    act = make("quota", io=False)
    act.apply(cgroup_job("q", [102]), JobAllocation(job="q", workers=1, cpus=0.2, cpu_weight=0.9))
    assert read(kernel, "adloader/q", "cpu.max") == "20000 100000"


def test_v2_existing_subtree_weight_recorded_and_restored_and_quota_knob(v2, tmp_path):
    kernel, make = v2
    kernel.write("", "cgroup.subtree_control", "+cpu")
    kernel.mkdir("adloader")                     # there before the agent, with a weight of its own
    kernel.write("adloader", "cpu.weight", "77")
    journal = str(tmp_path / "state" / "orig.json")
    q = make(knob="quota", io=False, journal=journal)
    assert q.apply(cgroup_job("c", [103, 102]), JobAllocation(job="c", workers=2, cpus=0.5)).ok
    assert read(kernel, "adloader/c", "cpu.max") == "50000 100000"
    assert read(kernel, "adloader", "cpu.weight") == "200"                # quota too: 2 workers' weight
    assert json.loads(open(journal).read())["files"]["|adloader|cpu.weight"] == "77"
    second = make(knob="quota", io=False, journal=journal)                # restarted: counts c's workers
    assert second._workers == {"c": 2}
    second.restore()
    assert read(kernel, "adloader", "cpu.weight") == "77" and not kernel.exists("adloader/c")


def test_v2_cpuset_knob(v2):
    kernel, make = v2
    act = make(knob="cpuset", io=False)
    r = act.apply(cgroup_job("a", [101]), JobAllocation(job="a", workers=1, cpus=2.0, cpuset=(2, 3)))
    assert r.ok, r.error
    assert read(kernel, "adloader/a", "cpuset.cpus") == "2-3"
    assert "cpuset" in kernel.subtree_control("adloader")
    r = act.apply(cgroup_job("b", [102]), JobAllocation(job="b", workers=1, cpus=1.0))
    assert r.ok and any("pin_cpusets" in n for n in r.not_enforced)


def test_v2_iocost_uses_io_weight(v2):
    kernel, make = v2
    with open(kernel.path("", "io.cost.qos"), "w") as f:
        f.write("8:0 enable=1 ctrl=auto")
    act = make()
    assert act.io_mode == "io.weight"
    r = act.apply(cgroup_job("a", [101]), JobAllocation(job="a", workers=1, cpus=1.0, io_weight=250))
    assert r.ok, r.error
    assert read(kernel, "adloader/a", "io.weight") == "default 250"


def test_v2_release_moves_back_and_removes(v2):
    kernel, make = v2
    act = make(io=False)
    act.apply(cgroup_job("a", [101, 102]), JobAllocation(job="a", workers=2, cpus=1.0))
    act.apply(cgroup_job("b", [103]), JobAllocation(job="b", workers=1, cpus=1.0))
    act.release("a")
    assert not kernel.exists("adloader/a")
    assert set(kernel.procs("user.slice/job.scope")) == {101, 102}
    assert read(kernel, "adloader", "cpu.weight") == "100"                 # only b's 1024 shares left
    act.restore()
    assert not kernel.exists("adloader")
    assert set(kernel.procs("user.slice/job.scope")) == {101, 102, 103}
    assert kernel.subtree_control("") == {"memory"}                       # our +cpu taken back


def test_v2_restart_from_journal(v2, tmp_path):
    kernel, make = v2
    journal = str(tmp_path / "state" / "cgroup-originals.json")
    first = make(io=False, journal=journal)
    first.apply(cgroup_job("a", [101]), JobAllocation(job="a", workers=1, cpus=2.0))
    data = json.loads(open(journal).read())
    assert data["pids"]["101"]["origins"][""] == "/user.slice/job.scope"
    assert "|adloader" in data["created"]
    second = make(io=False, journal=journal)
    # the adopted group still counts in the subtree's weight (v2 weights are lossy: compare as weights)
    assert weight_from_shares(second._shares["a"]) == weight_from_shares(2048)
    second.restore()
    assert not kernel.exists("adloader") and set(kernel.procs("user.slice/job.scope")) == {101, 102, 103}
    assert kernel.subtree_control("") == {"memory"}
    assert not os.path.exists(journal)


def test_v2_without_cpu_controller_fails_clearly(tmp_path):
    proc = fake_proc(tmp_path, [101])
    kernel = FakeV2Kernel(str(tmp_path / "cg"), proc, controllers=())     # like this machine's v2 mount
    act = CgroupActuator({"": kernel}, version=2, io=True, subtree="adloader", sys_root=str(tmp_path),
                         proc_root=proc)
    r = act.apply(cgroup_job("a", [101]), JobAllocation(job="a", workers=1, cpus=1.0))
    assert not r.ok and "no cpu controller" in r.error and "NotSupported" in r.error
    assert not kernel.exists("adloader")


def test_gone_worker_is_skipped_and_training_pid_never_moved(v2):
    kernel, make = v2
    act = make(io=False)
    r = act.apply(cgroup_job("a", [101, 999, 1]), JobAllocation(job="a", workers=3, cpus=1.0))
    assert r.ok, r.error
    assert set(kernel.procs("adloader/a")) == {101}


def test_none_policy_allocation_releases_the_group(v2):
    kernel, make = v2
    act = make(io=False)
    act.apply(cgroup_job("a", [101]), JobAllocation(job="a", workers=1, cpus=1.0))
    r = act.apply(cgroup_job("a", [101]), JobAllocation(job="a", workers=1, cpus=1.0, enforce_cpu=False))
    assert r.ok and not kernel.exists("adloader/a")


# -- v2 under systemd: the agent's own delegated group ---------------------------------------------


def test_fake_kernel_refuses_controllers_for_a_group_with_processes(delegated):
    """What makes the leaf necessary (cgroup-v2.rst, "No Internal Process Constraint")."""
    kernel, _ = delegated
    kernel.write("", "cgroup.subtree_control", "+cpu")
    kernel.write("system.slice", "cgroup.subtree_control", "+cpu")
    with pytest.raises(Busy):
        kernel.write(OWN, "cgroup.subtree_control", "+cpu")
    with pytest.raises(NotSupported):        # not in its cgroup.controllers: the parent does not delegate io
        kernel.write("user.slice", "cgroup.subtree_control", "+io")


def test_v2_job_groups_under_the_agents_own_cgroup(delegated):
    kernel, make = delegated
    act = make()
    assert act.subtree == f"{OWN}/adloader"
    assert not kernel.exists(f"{OWN}/agent")                 # nothing touched before the first apply
    r = act.apply(cgroup_job("job-1", [101, 102]), JobAllocation(job="job-1", workers=2, cpus=2.0))
    assert r.ok, r.error
    # the agent and its helper moved to a leaf, so <own> may enable controllers for its children
    assert set(kernel.procs(f"{OWN}/agent")) == {500, 501} and kernel.procs(OWN) == []
    assert cgroupfs.proc_cgroups(500, kernel.proc_root)[""] == f"/{OWN}/agent"
    # +cpu enabled all the way down: root, system.slice, the unit, the adloader subtree
    for rel in ("", "system.slice", OWN, f"{OWN}/adloader"):
        assert "cpu" in kernel.subtree_control(rel), rel
    assert kernel.subtree_control("") == {"cpu", "memory"}
    assert set(kernel.procs(f"{OWN}/adloader/job-1")) == {101, 102}
    assert read(kernel, f"{OWN}/adloader/job-1", "cpu.weight") == str(weight_from_shares(2048))
    assert not kernel.exists("adloader")                      # nothing at the top level
    # a second job reuses the prepared base
    assert act.apply(cgroup_job("job-2", [103]), JobAllocation(job="job-2", workers=1, cpus=1.0)).ok
    act.release("job-1")
    assert set(kernel.procs("user.slice/job.scope")) == {101, 102}
    act.restore()
    # everything as it was: groups gone, processes back, subtree_control back, leaf removed
    assert not kernel.exists(f"{OWN}/adloader") and not kernel.exists(f"{OWN}/agent")
    assert set(kernel.procs(OWN)) == {500, 501}
    assert set(kernel.procs("user.slice/job.scope")) == {101, 102, 103}
    assert kernel.subtree_control("") == {"memory"}
    assert kernel.subtree_control("system.slice") == set() and kernel.subtree_control(OWN) == set()


def test_v2_delegated_with_controllers_already_enabled_writes_only_below_own(delegated):
    """systemd Delegate=yes enables the controllers down to the unit: the agent writes nothing above it."""
    kernel, make = delegated
    kernel.write("", "cgroup.subtree_control", "+cpu +io")
    kernel.write("system.slice", "cgroup.subtree_control", "+cpu +io")
    kernel.writes.clear()
    act = make()
    assert act.apply(cgroup_job("a", [101]), JobAllocation(job="a", workers=1, cpus=1.0)).ok
    above = [w for w in kernel.writes if w[1] == "cgroup.subtree_control" and not w[0].startswith(OWN)]
    assert above == []
    assert "cpu" in kernel.subtree_control(OWN) and "cpu" in kernel.subtree_control(f"{OWN}/adloader")


def test_v2_a_process_forked_into_own_while_moving_is_moved_too(delegated, monkeypatch):
    """Found on a real cgroup v2 node (the GPU study): the bench shares the agent's group and starts jobs,
    so a process forked in <own> during the move to the leaf lands in <own> and the kernel refuses +cpu
    there (EBUSY). The actuator moves again and retries instead of failing every apply."""
    kernel, make = delegated
    os.makedirs(os.path.join(kernel.proc_root, "502"))
    forked = []
    real_move = kernel.move

    def move(rel, pid):
        real_move(rel, pid)
        if rel == f"{OWN}/agent" and pid == 501 and not forked:   # 500 forks while 501 is moving
            forked.append(502)
            real_move(OWN, 502)

    monkeypatch.setattr(kernel, "move", move)
    act = make()
    r = act.apply(cgroup_job("a", [101]), JobAllocation(job="a", workers=1, cpus=1.0))
    assert r.ok, r.error
    assert forked == [502] and set(kernel.procs(f"{OWN}/agent")) == {500, 501, 502} and kernel.procs(OWN) == []
    assert "cpu" in kernel.subtree_control(OWN) and set(kernel.procs(f"{OWN}/adloader/a")) == {101}


def test_v2_own_group_that_stays_busy_fails_with_the_reason(delegated, monkeypatch):
    """Exited tasks not yet reaped keep a group populated (cgroup.procs no longer lists them): after a few
    moves the apply fails, and the error says what holds the group and what to do."""
    kernel, make = delegated
    real_write = kernel.write

    def write(rel, file, value):
        if rel == OWN and file == "cgroup.subtree_control":
            raise FakeV2Kernel._err(errno.EBUSY, f"write {value} to {kernel.path(rel, file)}")
        return real_write(rel, file, value)

    monkeypatch.setattr(kernel, "write", write)
    act = make()
    r = act.apply(cgroup_job("a", [101]), JobAllocation(job="a", workers=1, cpus=1.0))
    assert not r.ok
    assert "exited processes not yet reaped" in r.error and "group of its own" in r.error, r.error
    assert set(kernel.procs(f"{OWN}/agent")) == {500, 501}


def test_v2_agent_already_in_its_leaf(delegated):
    """A restarted agent (or systemd DelegateSubgroup=agent) already in <own>/agent: no nested leaf."""
    kernel, make = delegated
    kernel.mkdir(f"{OWN}/agent")
    for pid in (500, 501):
        kernel.move(f"{OWN}/agent", pid)
    act = make(self_cgroup=f"/{OWN}/agent")
    assert act.subtree == f"{OWN}/adloader"
    assert act.apply(cgroup_job("a", [101]), JobAllocation(job="a", workers=1, cpus=1.0)).ok
    assert set(kernel.procs(f"{OWN}/adloader/a")) == {101}
    assert not kernel.exists(f"{OWN}/agent/agent") and set(kernel.procs(f"{OWN}/agent")) == {500, 501}
    act.restore()
    assert kernel.exists(f"{OWN}/agent")                      # not ours to remove: it was there before
    assert set(kernel.procs(f"{OWN}/agent")) == {500, 501} and not kernel.exists(f"{OWN}/adloader")


def test_v2_agent_in_the_root_cgroup_uses_top_level_subtree(delegated):
    kernel, make = delegated
    act = make(self_cgroup="/")
    assert act.subtree == "adloader"
    assert act.apply(cgroup_job("a", [101]), JobAllocation(job="a", workers=1, cpus=1.0)).ok
    assert set(kernel.procs("adloader/a")) == {101}
    assert not kernel.exists(f"{OWN}/agent") and set(kernel.procs(OWN)) == {500, 501}


def test_v2_delegated_restart_from_journal_keeps_subtree(delegated, tmp_path):
    kernel, make = delegated
    journal = str(tmp_path / "state" / "orig.json")
    first = make(journal=journal)
    assert first.apply(cgroup_job("a", [101]), JobAllocation(job="a", workers=1, cpus=2.0)).ok
    # a restarted agent in the same unit, now in the leaf, finds the group it made and its weight
    second = make(self_cgroup=f"/{OWN}/agent", journal=journal)
    assert weight_from_shares(second._shares["a"]) == weight_from_shares(2048)
    second.restore()
    assert not kernel.exists(f"{OWN}/adloader") and set(kernel.procs("user.slice/job.scope")) == {101, 102, 103}
    assert kernel.subtree_control("") == {"memory"} and kernel.subtree_control(OWN) == set()


@pytest.mark.parametrize("leaf_by", ["agent", "systemd"])
def test_v2_a_restarted_agent_removes_the_leaf_a_dead_one_made_and_only_that(delegated, tmp_path, leaf_by):
    """The dead agent made <own>/agent and moved itself and its helper there; a restarted agent (in that
    leaf: DelegateSubgroup, or started from a process in it) took <own> as its base but knew the leaf
    only in memory, so on stop it left the leaf behind with every process of the unit in it, even with
    a good journal. The journal now lists the leaf the agent made: restore moves the processes back to
    <own> and removes it. A leaf systemd made (``DelegateSubgroup=agent``: the agent starts in it) is
    never listed and stays."""
    kernel, make = delegated
    journal = str(tmp_path / "state" / "cgroup-originals.json")
    if leaf_by == "systemd":
        kernel.mkdir(f"{OWN}/agent")
        for pid in (500, 501):
            kernel.move(f"{OWN}/agent", pid)
    first = make(self_cgroup=f"/{OWN}" if leaf_by == "agent" else f"/{OWN}/agent", journal=journal)
    assert first.apply(cgroup_job("a", [101]), JobAllocation(job="a", workers=1, cpus=1.0)).ok
    assert set(kernel.procs(f"{OWN}/agent")) == {500, 501}
    listed = f"|{OWN}/agent" in json.loads(open(journal).read())["created"]
    # the first agent dies (no restore); the next one runs in the leaf and reads the journal
    again = make(self_cgroup=f"/{OWN}/agent", journal=journal)
    assert again.apply(cgroup_job("b", [102]), JobAllocation(job="b", workers=1, cpus=1.0)).ok
    again.restore()
    assert not kernel.exists(f"{OWN}/adloader") and kernel.subtree_control(OWN) == set()
    assert set(kernel.procs("user.slice/job.scope")) == {101, 102, 103}
    if leaf_by == "agent":
        assert not kernel.exists(f"{OWN}/agent") and set(kernel.procs(OWN)) == {500, 501}
    else:
        assert set(kernel.procs(f"{OWN}/agent")) == {500, 501} and kernel.procs(OWN) == []
    assert listed == (leaf_by == "agent")                     # how the restarted agent knew
    assert not os.path.exists(journal)                         # nothing left to put back


def test_v2_own_cgroup_not_in_this_tree_fails_clearly(delegated):
    kernel, make = delegated
    act = make(self_cgroup="/machine.slice/other.scope")
    r = act.apply(cgroup_job("a", [101]), JobAllocation(job="a", workers=1, cpus=1.0))
    assert not r.ok and "own cgroup /machine.slice/other.scope" in r.error and "cgroup_root" in r.error
    assert not kernel.exists("machine.slice")


def test_v2_subtree_is_capped_at_the_node_less_the_trainers_need(v2):
    """Where training processes need CPU, the subtree's cpu.max caps the loaders at the node's CPUs less
    that need (never below the plan's cores), so a trainer always finds its cores whatever the workers'
    number; without trainer CPU there is no cap ("max"), and restore puts the original back."""
    kernel, make = v2
    act = make(io=False, node_cpus=4.0)
    busy = dict(trainer_cpu_s_per_step=0.03, compute_s_per_step=0.1)          # 0.3 cores each
    act.apply(cgroup_job("a", [101, 102], **busy), JobAllocation(job="a", workers=2, cpus=1.0))
    act.apply(cgroup_job("b", [103], **busy), JobAllocation(job="b", workers=1, cpus=1.0))
    assert read(kernel, "adloader", "cpu.max") == "340000 100000"             # 4 - 0.6 cores
    # with trainers, the weight is one task per planned loader core (2 cores), not per worker (3): a
    # trainer waking on a CPU the workers use is not held back by their number
    assert read(kernel, "adloader", "cpu.weight") == "200"
    act.apply(cgroup_job("a", [101, 102], **busy), JobAllocation(job="a", workers=2, cpus=3.0))
    assert read(kernel, "adloader", "cpu.max") == "400000 100000" or read(kernel, "adloader", "cpu.max") == \
        "max 100000"                                                         # the plan's 4 cores: no cap
    assert read(kernel, "adloader", "cpu.weight") == "300"                   # 4 cores, but 3 workers at most
    act.release("a")
    act.release("b")
    act.apply(cgroup_job("c", [101]), JobAllocation(job="c", workers=1, cpus=1.0))   # no trainer CPU
    assert read(kernel, "adloader", "cpu.max").startswith("max")
    assert read(kernel, "adloader", "cpu.weight") == "100"                   # its one worker
    act.restore()
    assert not kernel.exists("adloader")


def _node(yield_: bool, trainers: dict) -> "NodeAllocation":
    from agent.model import NodeAllocation

    return NodeAllocation(loaders_yield=yield_, trainers=trainers, reason="test")


def test_v2_yielding_loaders_are_cpu_idle_uncapped_and_back_to_weight_and_cap(v2):
    """A node allocation that lets the loaders yield sets the subtree cpu.idle = 1 and lifts the cap (a
    yielding subtree needs none: it runs only where the trainers leave a CPU idle); taking it back
    writes cpu.idle = 0 and the cap from the trainers' figures *in the node allocation* (fresher than
    the ones noted at the job's last apply, here none at all)."""
    kernel, make = v2
    act = make(io=False, node_cpus=4.0)
    act.apply(cgroup_job("a", [101, 102]), JobAllocation(job="a", workers=2, cpus=1.0))
    act.apply(cgroup_job("b", [103]), JobAllocation(job="b", workers=1, cpus=1.0))
    assert read(kernel, "adloader", "cpu.max").startswith("max")        # no trainer CPU known yet
    notes = act.apply_node(_node(True, {"a": (0.3, 0.3), "b": (0.3, 0.2)}))
    assert notes == []
    assert read(kernel, "adloader", "cpu.idle") == "1"
    assert read(kernel, "adloader", "cpu.max").startswith("max")
    assert read(kernel, "adloader/a", "cpu.weight") == "100"             # the jobs still split by the plan
    act.apply_node(_node(False, {"a": (0.3, 0.3), "b": (0.3, 0.2)}))
    assert read(kernel, "adloader", "cpu.idle") == "0"
    assert read(kernel, "adloader", "cpu.max") == "350000 100000"        # 4 - (0.3 + 0.2) cores
    assert read(kernel, "adloader", "cpu.weight") == "200"               # one task per planned core
    n = len(kernel.writes)
    act.apply_node(_node(False, {"a": (0.3, 0.3), "b": (0.3, 0.2)}))    # nothing changed: nothing written
    assert len(kernel.writes) == n
    act.apply_node(_node(True, {"a": (0.3, 0.3), "b": (0.3, 0.2)}))
    act.restore()
    assert not kernel.exists("adloader")


def test_v2_a_job_arriving_while_the_loaders_yield_is_applied_and_the_weight_comes_back_after(v2):
    """An idle group refuses a weight: a job applied while the subtree yields must not write one (the
    apply failed every tick until the yield ended, and the newcomer got no allocation); when the yield
    ends the kernel has put the default weight back, so the planned weight is written again."""
    kernel, make = v2
    act = make(io=False, node_cpus=4.0)
    trainers = {"a": (0.3, 0.3), "b": (0.3, 0.2)}
    act.apply(cgroup_job("a", [101, 102]), JobAllocation(job="a", workers=2, cpus=1.0))
    act.apply_node(_node(True, trainers))
    assert read(kernel, "adloader", "cpu.idle") == "1"
    res = act.apply(cgroup_job("b", [103, 104, 105]), JobAllocation(job="b", workers=3, cpus=1.0))
    assert res.ok, res
    assert read(kernel, "adloader/b", "cpu.weight") == "100"
    act.apply_node(_node(False, trainers))
    assert read(kernel, "adloader", "cpu.idle") == "0"
    assert read(kernel, "adloader", "cpu.weight") == "200"               # one task per planned core, again
    act.restore()


def test_v2_without_cpu_idle_the_loaders_are_weighted_and_it_says_so(v2, monkeypatch):
    """A kernel before 5.15 has no cpu.idle: the subtree keeps its weight and cap, and the apply says
    that the loaders cannot yield."""
    kernel, make = v2
    monkeypatch.setattr(FakeV2Kernel, "FILES", {k: v for k, v in FakeV2Kernel.FILES.items() if k != "cpu.idle"})
    act = make(io=False, node_cpus=4.0)
    act.apply(cgroup_job("a", [101]), JobAllocation(job="a", workers=1, cpus=1.0))
    notes = act.apply_node(_node(True, {"a": (0.5, 0.5)}))
    assert any("cannot yield" in n and "cpu.idle" in n for n in notes)
    assert not kernel.has_file("adloader", "cpu.idle")
    assert read(kernel, "adloader", "cpu.max") == "350000 100000"
    assert not any(w[1] == "cpu.idle" for w in kernel.writes)


def test_v2_a_restarted_agent_takes_back_the_yield_a_dead_one_left(v2):
    """The dead agent left the subtree cpu.idle = 1; the new one, whose plan does not yield, writes 0."""
    kernel, make = v2
    act = make(io=False, node_cpus=4.0)
    act.apply(cgroup_job("a", [101]), JobAllocation(job="a", workers=1, cpus=1.0))
    act.apply_node(_node(True, {"a": (0.5, 0.5)}))
    assert read(kernel, "adloader", "cpu.idle") == "1"
    again = make(io=False, node_cpus=4.0)                  # no restore: the first agent died
    again.apply(cgroup_job("a", [101]), JobAllocation(job="a", workers=1, cpus=1.0))
    again.apply_node(_node(False, {"a": (0.5, 0.5)}))
    assert read(kernel, "adloader", "cpu.idle") == "0"


def test_v2_restore_while_yielding_puts_back_a_pre_existing_subtree_weight(v2):
    """A subtree that was there before the agent, with a weight of its own, and an agent that stops while
    the loaders yield (cpu.idle = 1): the weight was written back first and refused (an idle group takes
    no weight: EINVAL), then cpu.idle = 0 reset it to the default, so restore failed and lost it."""
    kernel, make = v2
    kernel.write("", "cgroup.subtree_control", "+cpu")
    kernel.mkdir("adloader")
    kernel.write("adloader", "cpu.weight", "77")
    act = make(io=False, node_cpus=4.0)
    act.apply(cgroup_job("a", [101]), JobAllocation(job="a", workers=1, cpus=1.0))
    act.apply_node(_node(True, {"a": (0.5, 0.5)}))
    assert read(kernel, "adloader", "cpu.idle") == "1"
    act.restore()
    assert read(kernel, "adloader", "cpu.idle") == "0" and read(kernel, "adloader", "cpu.weight") == "77"
    assert not kernel.exists("adloader/a")


def test_v2_a_restarted_agent_lifts_the_cap_a_dead_one_left(v2, tmp_path):
    """The dead agent capped the subtree (cpu.max) for a job whose trainers needed CPU; the new one's
    job needs none, so its plan has no cap: it must write "max", not keep the loaders under the old cap
    (it compared with None, "no cap written", and wrote nothing)."""
    kernel, make = v2
    busy = dict(trainer_cpu_s_per_step=0.03, compute_s_per_step=0.1)
    journal = str(tmp_path / "state" / "cgroup-originals.json")
    act = make(io=False, node_cpus=4.0, journal=journal)
    act.apply(cgroup_job("a", [101], **busy), JobAllocation(job="a", workers=1, cpus=1.0))
    assert read(kernel, "adloader", "cpu.max") == "370000 100000"
    again = make(io=False, node_cpus=4.0, journal=journal)     # no restore: the first agent died
    again.apply(cgroup_job("b", [102]), JobAllocation(job="b", workers=1, cpus=1.0))
    assert read(kernel, "adloader", "cpu.max").startswith("max")
    again.restore()
    assert not kernel.exists("adloader")


@pytest.mark.parametrize("held", [False, True])
def test_v2_a_restarted_agent_with_a_lost_journal_takes_the_subtree_and_lifts_its_cap(v2, held):
    """The journal of originals lost (corrupt: ``build`` then calls ``adopt_orphans``): the job groups
    were adopted, the subtree itself was not, so restore left it, capped at the dead agent's cpu.max.
    Now it is removed; where it cannot be (``held``: a group not ours in it), it gets a new group's
    CPU values back."""
    kernel, make = v2
    busy = dict(trainer_cpu_s_per_step=0.03, compute_s_per_step=0.1)
    first = make(io=False, node_cpus=4.0)
    first.apply(cgroup_job("a", [101, 102], **busy), JobAllocation(job="a", workers=2, cpus=2.0))
    assert [read(kernel, "adloader", f) for f in ("cpu.max", "cpu.weight")] == ["370000 100000", "200"]
    again = make(io=False, node_cpus=4.0)                       # no restore, and nothing of the first known
    assert again.adopt_orphans() == ["a"]
    if held:
        kernel.mkdir("adloader/theirs")                        # made by someone else after the adoption
        with pytest.raises(cgroupfs.CgroupError, match="rmdir .*adloader: Device or resource busy"):
            again.restore()
        assert not kernel.exists("adloader/a")
        assert [read(kernel, "adloader", f) for f in ("cpu.max", "cpu.weight", "cpu.idle")] == \
            ["max 100000", "100", "0"]                          # a new group's: no cap
    else:
        again.restore()
        assert not kernel.exists("adloader")
    assert set(kernel.procs("user.slice/job.scope")) | set(kernel.procs("")) >= {101, 102, 103}


def test_v2_subtree_cap_is_never_below_the_planned_cores(v2):
    """The cap is the node less the trainers' pace in 0.05-core steps, but never below the loaders'
    planned cores: 2 - 0.17 = 1.83 floored to 1.80 cut a job planned 1.83 cores."""
    kernel, make = v2
    act = make(io=False, node_cpus=2.0)
    act.apply_node(_node(False, {"a": (1.0, 0.17)}))
    assert act.apply(cgroup_job("a", [101]), JobAllocation(job="a", workers=1, cpus=1.83)).ok
    assert read(kernel, "adloader", "cpu.max") == "183000 100000"
    act.apply_node(_node(False, {"a": (1.0, 0.5)}))
    assert read(kernel, "adloader", "cpu.max") == "183000 100000"
    act.apply(cgroup_job("a", [101]), JobAllocation(job="a", workers=1, cpus=1.0))
    assert read(kernel, "adloader", "cpu.max") == "150000 100000"
    act.restore()


@pytest.mark.parametrize("root_error", [errno.ESRCH, errno.EINVAL])
def test_release_of_a_worker_that_exits_while_moved_back_is_not_a_failure(v2, tmp_path, root_error):
    """The origin refuses the worker (e.g. a Slurm step's group), and by the move to the root it has
    exited (ESRCH; v1 says EINVAL for a pid that is gone): the error escaped and the release failed."""
    from agent.cgroupfs import NotPermitted

    kernel, make = v2
    act = make(io=False)
    assert act.apply(cgroup_job("a", [101, 102]), JobAllocation(job="a", workers=2, cpus=1.0)).ok
    real_move, calls = kernel.move, []

    def move(rel, pid):
        if pid != 102:
            return real_move(rel, pid)
        calls.append(rel)
        if len(calls) == 1:       # the origin refuses it (a Slurm step's group, say)
            raise NotPermitted(f"write 102 to {kernel.path(rel, 'cgroup.procs')}: Permission denied")
        # and by the move to the root it has exited: gone from the group and from /proc
        with open(kernel.path("adloader/a", "cgroup.procs"), "w") as f:
            f.write("\n".join(str(p) for p in kernel.procs("adloader/a") if p != 102))
        for name in os.listdir(os.path.join(kernel.proc_root, "102")):
            os.unlink(os.path.join(kernel.proc_root, "102", name))
        os.rmdir(os.path.join(kernel.proc_root, "102"))
        raise cgroupfs.domain_error(OSError(root_error, os.strerror(root_error)), f"move 102 into {rel!r}")

    kernel.move = move
    act.release("a")                                  # no error
    assert calls == ["/user.slice/job.scope", ""]
    assert not kernel.exists("adloader/a")
    assert set(kernel.procs("user.slice/job.scope")) >= {101}
    act.restore()
    assert not kernel.exists("adloader")


def test_a_subtree_removed_by_someone_else_is_made_again_with_its_weights(v2):
    """An admin (or a systemd reset) empties and removes the agent's subtree while the agent runs. The
    actuator says the job's group is lost (the controller then applies the job again), and that apply
    makes the groups again, moves the workers back and writes the subtree's weight again. Before, the
    subtree's weight was cached: the new subtree kept the kernel's default (cpu.weight 100 for two
    workers' 200) for good, and the journal of originals listed the subtree twice."""
    kernel, make = v2
    act = make(io=False)
    alloc = JobAllocation(job="a", workers=2, cpus=0.5)
    assert act.apply(cgroup_job("a", [101, 102]), alloc).ok
    assert read(kernel, "adloader", "cpu.weight") == "200" and read(kernel, "adloader/a", "cpu.weight") == "50"
    assert not act.lost_group("a") and not act.lost_group("never-applied")
    for pid in (101, 102):                                     # what `cgdelete -r` or systemd does
        kernel.move("user.slice/job.scope", pid)
    kernel.rmdir("adloader/a")
    kernel.rmdir("adloader")
    assert act.lost_group("a")
    assert act.apply(cgroup_job("a", [101, 102]), alloc).ok    # what the controller does then
    assert not act.lost_group("a")
    assert read(kernel, "adloader", "cpu.weight") == "200"     # old code: "100", never written again
    assert read(kernel, "adloader/a", "cpu.weight") == "50"
    assert set(kernel.procs("adloader/a")) == {101, 102}
    created = act.originals.created
    assert len(created) == len(set(created)), created
    act.restore()
    assert not kernel.exists("adloader")
    assert cgroupfs.proc_cgroups(101, kernel.proc_root)[""] == "/user.slice/job.scope"


def test_a_subtree_made_again_by_someone_else_gets_its_weight_and_cap_again(v2):
    """The subtree gone and made again by someone else (systemd) before the agent's next apply: it
    exists, so the agent makes only the job's group in it, and its weight is written again all the
    same (a new group, by its inode, forgets what was written to the old one)."""
    kernel, make = v2
    act = make(io=False)
    alloc = JobAllocation(job="a", workers=2, cpus=0.5)
    assert act.apply(cgroup_job("a", [101, 102]), alloc).ok
    for pid in (101, 102):
        kernel.move("user.slice/job.scope", pid)
    kernel.rmdir("adloader/a")
    kernel.rmdir("adloader")
    kernel.mkdir("adloader")
    assert read(kernel, "adloader", "cpu.weight") == "100"
    assert act.lost_group("a") and act.apply(cgroup_job("a", [101, 102]), alloc).ok
    assert read(kernel, "adloader", "cpu.weight") == "200"
    act.restore()


def test_a_subtree_we_made_that_cannot_be_removed_gets_a_new_groups_cpu_values_back(v2):
    """Someone put a group of theirs in our subtree: restore cannot remove the subtree (EBUSY), and
    before, it kept the weight and cap the agent wrote (the loaders capped after the agent stopped)."""
    kernel, make = v2
    act = make(io=False, node_cpus=2.0)
    trainer = dict(trainer_cpu_s_per_step=0.03, compute_s_per_step=0.1)
    assert act.apply(cgroup_job("a", [101, 102], **trainer), JobAllocation(job="a", workers=2, cpus=1.0)).ok
    assert read(kernel, "adloader", "cpu.max") != "max 100000"          # capped for the trainers
    kernel.mkdir("adloader/theirs")
    with pytest.raises(cgroupfs.CgroupError, match="restore incomplete"):
        act.restore()
    assert kernel.exists("adloader/theirs") and not kernel.exists("adloader/a")
    assert read(kernel, "adloader", "cpu.max") == "max 100000" and read(kernel, "adloader", "cpu.weight") == "100"
