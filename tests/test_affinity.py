"""agent/actuators/cgroup.py's AffinityActuator: CPU affinity of a cooperative job's workers within its
allowed CPUs (real child processes, no root needed), restored by a restarted agent from its journal."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from agent.actuators.cgroup import AffinityActuator
from agent.actuators.originals import Originals
from agent.model import JobAllocation
from tests.fakes import cgroup_job

pytestmark = pytest.mark.component


def test_cooperative_job_gets_affinity_not_cgroups(v2):
    kernel, make = v2
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        cpus = sorted(os.sched_getaffinity(0))
        act = make(io=False)
        job = cgroup_job("slurm-7", [child.pid], cooperative=True, allowed_cpus=tuple(cpus))
        r = act.apply(job, JobAllocation(job="slurm-7", workers=1, cpus=0.6))
        assert r.ok, r.error
        assert not kernel.exists("adloader")
        assert os.sched_getaffinity(child.pid) == {cpus[-1]}
        assert any("affinity" in n for n in r.not_enforced)
        act.release("slurm-7")
        assert os.sched_getaffinity(child.pid) == set(cpus)
    finally:
        child.kill()
        child.wait(timeout=10)


def test_affinity_actuator_restores_from_journal(tmp_path):
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip(f"needs 2 CPUs to see affinity change, this process may use {cpus}")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    journal = str(tmp_path / "orig.json")
    try:
        act = AffinityActuator(Originals(journal))
        job = cgroup_job("j", [child.pid], allowed_cpus=tuple(cpus))
        assert act.apply(job, JobAllocation(job="j", workers=1, cpus=1.0, cpuset=(cpus[0],))).ok
        assert os.sched_getaffinity(child.pid) == {cpus[0]}
        AffinityActuator(Originals(journal)).restore()          # a restarted agent puts it back
        assert os.sched_getaffinity(child.pid) == set(cpus)
    finally:
        child.kill()
        child.wait(timeout=10)
    act = AffinityActuator(Originals())
    assert act.apply(cgroup_job("k", [child.pid]), JobAllocation(job="k", workers=1, cpus=1.0)).ok  # gone: skipped



def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_affinity_is_not_put_back_on_another_process_holding_the_pid(tmp_path):
    """The journal says which process each original belongs to (its start time): a restarted agent
    whose journal names a worker that has gone, its pid now held by another process (here: an entry
    with another start time), leaves that process's affinity alone instead of setting it."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip(f"needs 2 CPUs to see affinity change, this process may use {cpus}")
    child = _sleeper()
    journal = str(tmp_path / "orig.json")
    try:
        act = AffinityActuator(Originals(journal))
        assert act.apply(cgroup_job("j", [child.pid], allowed_cpus=tuple(cpus)),
                         JobAllocation(job="j", workers=1, cpus=1.0, cpuset=(cpus[0],))).ok
        data = json.loads(open(journal).read())
        entry = data["affinity"][str(child.pid)]
        entry["start"] = entry.get("start", 0) + 1            # the worker that held the pid then
        with open(journal, "w") as f:
            json.dump(data, f)
        os.sched_setaffinity(child.pid, {cpus[-1]})            # the new holder's own affinity
        AffinityActuator(Originals(journal)).restore()
        assert os.sched_getaffinity(child.pid) == {cpus[-1]}
        assert not os.path.exists(journal)
    finally:
        child.kill()
        child.wait(timeout=10)


def test_a_worker_that_left_the_job_is_put_back_at_the_next_apply(tmp_path):
    """A worker the loader retired (no longer in the job's worker pids) got its affinity back only
    when the job left, and a gone one stayed in the journal until then: a long job that restarts its
    workers grew the journal by one entry per worker it ever had."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip(f"needs 2 CPUs to see affinity change, this process may use {cpus}")
    a, b, c = _sleeper(), _sleeper(), _sleeper()
    try:
        act = AffinityActuator(Originals(str(tmp_path / "orig.json")))
        pin = JobAllocation(job="j", workers=2, cpus=1.0, cpuset=(cpus[0],))
        assert act.apply(cgroup_job("j", [a.pid, b.pid, c.pid], allowed_cpus=tuple(cpus)), pin).ok
        assert os.sched_getaffinity(b.pid) == {cpus[0]}
        c.kill()
        c.wait(timeout=10)
        assert act.apply(cgroup_job("j", [a.pid], allowed_cpus=tuple(cpus)), pin).ok
        assert os.sched_getaffinity(b.pid) == set(cpus)            # retired, still alive: put back
        assert os.sched_getaffinity(a.pid) == {cpus[0]}
        assert set(act.originals.affinity) == {str(a.pid)}          # c (gone) forgotten
        act.release("j")
        assert os.sched_getaffinity(a.pid) == set(cpus) and act.originals.empty()
    finally:
        for p in (a, b, c):
            p.kill()
            p.wait(timeout=10)


def _fake_stat(proc_root, pid: int, start_ticks: int) -> None:
    """``<proc_root>/<pid>/stat`` of a sleeping process that started ``start_ticks`` after boot (field 22)."""
    rest = ["S", "1"] + ["0"] * 17 + [str(start_ticks)] + ["0"] * 10
    d = proc_root / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    (d / "stat").write_text(f"{pid} (python (x)) {' '.join(rest)}\n")


@pytest.mark.parametrize("built_by", ["build", "cgroup-v2"])
def test_affinity_reads_start_times_from_the_configured_proc_root(tmp_path, v2, built_by):
    """The start time kept with each original affinity (what tells a reused pid) was read from the real
    /proc whatever proc_root the agent was built with, as Hierarchy.move's check was (1ae4660). Against
    a fake /proc that gives the worker another start time than the real one: the fake's is journaled,
    and a restarted agent to which the fake says the pid is another process's now leaves it alone."""
    from agent.actuators import build
    from tests.fakes import FakeSink

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip(f"needs 2 CPUs to see affinity change, this process may use {cpus}")
    child = _sleeper()
    try:
        if built_by == "build":     # the composition root's cooperative mode
            proc = tmp_path / "fakeproc"
            state = tmp_path / "state"
            act = build("cooperative", sink=FakeSink(), proc_root=str(proc), state_dir=str(state))[-1]
            journal = str(state / "cgroup-originals.json")
        else:                       # the affinity a v2 CgroupActuator gives its cooperative jobs
            _kernel, make = v2
            journal = str(tmp_path / "orig.json")
            act = make(io=False, journal=journal).affinity
            proc = tmp_path / "proc"            # the fixture's proc_root
        _fake_stat(proc, child.pid, 4242)
        pin = JobAllocation(job="j", workers=1, cpus=1.0, cpuset=(cpus[0],))
        assert act.apply(cgroup_job("j", [child.pid], allowed_cpus=tuple(cpus)), pin).ok
        assert os.sched_getaffinity(child.pid) == {cpus[0]}
        assert json.loads(open(journal).read())["affinity"][str(child.pid)]["start"] == 4242
        _fake_stat(proc, child.pid, 4243)         # the fake says: another process holds the pid now
        AffinityActuator(Originals(journal), proc_root=str(proc)).restore()
        assert os.sched_getaffinity(child.pid) == {cpus[0]}      # not ours: left alone
        assert not os.path.exists(journal)
    finally:
        child.kill()
        child.wait(timeout=10)


def test_a_worker_pid_that_is_another_process_now_is_not_pinned(tmp_path):
    """A listed worker pid whose process started after the one the registry recorded (the worker exited
    and its pid went to another process before the client's next report) keeps its affinity; the worker
    is pinned, and the apply is no failure."""
    from agent.security import pid_start_ticks

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip(f"needs 2 CPUs to see affinity change, this process may use {cpus}")
    worker, reused = (subprocess.Popen(["sleep", "60"]) for _ in range(2))
    try:
        act = AffinityActuator(Originals(str(tmp_path / "orig.json")), proc_root="/proc")
        job = cgroup_job("j", [worker.pid, reused.pid], uid=os.getuid(), allowed_cpus=tuple(cpus),
                         worker_starts={worker.pid: pid_start_ticks(worker.pid),
                                        reused.pid: pid_start_ticks(reused.pid) - 1})
        r = act.apply(job, JobAllocation(job="j", workers=2, cpus=1.0, cpuset=(cpus[0],)))
        assert r.ok, r.error
        assert os.sched_getaffinity(worker.pid) == {cpus[0]}
        assert os.sched_getaffinity(reused.pid) == set(cpus)
        assert sorted(act.originals.affinity) == [str(worker.pid)] and act.pids_skipped == 1
        act.release("j")
        assert os.sched_getaffinity(worker.pid) == set(cpus)
    finally:
        for p in (worker, reused):
            p.kill()
            p.wait(timeout=10)
