"""Liveness of registered jobs (issue 13): ``agent.jobprocs`` finds a job's processes in /proc (fake
trees and the real /proc), the registry forgets a registered job none of whose processes has been seen
for ``unseen_timeout_s`` (a missed epilog release), and a registered job takes no loader share until
one of its ranks says hello. Unit tier (the real-/proc case starts one child process)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from agent import jobprocs
from agent.collector import Collector
from agent.policies import PolicyConfig, get_policy
from agent.registry import Registry
from agent.security import Peer

pytestmark = pytest.mark.component

ROOT = Peer(0, 0, 1)


# --- the parsers ------------------------------------------------------------------------------------
@pytest.mark.parametrize("cmdline, job", [
    (b"slurmstepd: [42.batch]\0\0\0", "42"),
    (b"slurmstepd: [42.extern]", "42"),
    (b"slurmstepd: [7.0]", "7"),
    (b"slurmstepd: [1234]", "1234"),
    (b"slurmstepd\0-s\0", None),          # before slurmstepd rewrote its title
    (b"/usr/sbin/slurmd\0-D", None),
    (b"slurmstepd: [4x.batch]", None),
    (b"", None),
])
def test_slurmstepd_title(cmdline, job):
    assert jobprocs.slurmstepd_job(cmdline) == job


def test_cgroup_job_ids_v1_and_v2_and_not_lookalikes():
    v1 = ("12:cpuset:/slurm/uid_1000/job_4242/step_batch/task_0\n"
          "11:memory:/slurm/uid_1000/job_4242/step_batch\n4:cpu,cpuacct:/user.slice\n")
    assert jobprocs.cgroup_job_ids(v1) == {"4242"}
    v2 = "0::/system.slice/slurmstepd.scope/job_77/step_0/user/task_0\n"
    assert jobprocs.cgroup_job_ids(v2) == {"77"}
    assert jobprocs.cgroup_job_ids("0::/user.slice/myjob_5/x\n1:cpu:/job_/x\n2:cpu:/job_9a\n") == set()


def test_environ_job_ids():
    env = b"PATH=/bin\0SLURM_JOB_ID=4242\0ADLOADER_JOB_ID=run-7\0NOT_SLURM_JOB_ID=1\0SLURM_JOB_ID_X=2\0"
    assert jobprocs.environ_job_ids(env) == {"4242", "run-7"}
    assert jobprocs.environ_job_ids(b"SLURM_JOB_ID=\0") == set()


# --- find_jobs on a fake /proc and on the real one ----------------------------------------------------
def _proc(root, pid: int, uid: int, *, comm=b"python3\n", cmdline=b"python3\0", cgroup="0::/\n", environ=b""):
    d = root / str(pid)
    d.mkdir()
    (d / "comm").write_bytes(comm)
    (d / "cmdline").write_bytes(cmdline)
    (d / "cgroup").write_text(cgroup)
    (d / "environ").write_bytes(environ)
    if uid != os.getuid():
        os.chown(d, uid, uid)


def test_find_jobs_on_a_fake_proc(tmp_path):
    if os.getuid() != 0:
        pytest.skip("needs root to give the fake /proc entries other owners")
    _proc(tmp_path, 10, 0, comm=b"slurmstepd\n", cmdline=b"slurmstepd: [101.extern]\0")
    _proc(tmp_path, 11, 1000, environ=b"SLURM_JOB_ID=102\0")
    _proc(tmp_path, 12, 1000, cgroup="4:cpuset:/slurm/uid_1000/job_103/step_0\n")
    _proc(tmp_path, 13, 2000, environ=b"SLURM_JOB_ID=104\0")            # 104 belongs to uid 1000: no
    _proc(tmp_path, 14, 0, environ=b"SLURM_JOB_ID=105\0")               # root's process, a user's job: no
    _proc(tmp_path, 15, 0, comm=b"bash\n", cmdline=b"slurmstepd: [106.batch]\0")   # not slurmstepd: no
    (tmp_path / "self").mkdir()
    (tmp_path / "stat").write_text("cpu 0\n")
    wanted = {str(j): 1000 for j in range(101, 108)}
    assert jobprocs.find_jobs(wanted, str(tmp_path)) == {"101", "102", "103"}
    assert jobprocs.find_jobs({}, str(tmp_path)) == set()
    assert jobprocs.find_jobs(wanted, str(tmp_path / "absent")) == set()


def test_find_jobs_on_the_real_proc_by_environment():
    job = f"jp-{os.getpid()}-{os.urandom(3).hex()}"
    env = {**os.environ, "ADLOADER_JOB_ID": job}
    p = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                         env=env, stdout=subprocess.PIPE, text=True)
    try:
        # until the child has exec'd, /proc/<pid>/environ is the parent's (a loaded machine showed it)
        assert p.stdout.readline().strip() == "up"
        assert jobprocs.find_jobs({job: os.getuid(), "not-here": os.getuid()}) == {job}
        assert jobprocs.find_jobs({job: os.getuid() + 1}) == set()      # wrong owner
    finally:
        p.kill()
        p.wait()
    assert jobprocs.find_jobs({job: os.getuid()}) == set()


# --- the registry's clock for registered jobs -------------------------------------------------------------
class FakeFinder:
    """find_jobs for the registry: the jobs in ``present`` have processes; each call is recorded."""

    def __init__(self):
        self.present: set[str] = set()
        self.calls: list[dict] = []

    def __call__(self, wanted):
        self.calls.append(dict(wanted))
        return self.present & set(wanted)


def test_a_registered_job_without_processes_departs_after_the_timeout():
    finder = FakeFinder()
    reg = Registry(unseen_timeout_s=10.0, find_jobs=finder)
    reg.register(ROOT, {"job": "4242", "uid": 1000, "pids": []}, 0.0)
    for t in (1.0, 5.0, 10.0):                 # within the timeout: no /proc scan at all
        reg.sweep(t)
    assert finder.calls == [] and "4242" in reg.jobs
    finder.present = {"4242"}                 # its processes run: found, the clock restarts
    reg.sweep(10.5)
    assert finder.calls == [{"4242": 1000}] and "4242" in reg.jobs and reg.jobs["4242"].seen_at == 10.5
    reg.sweep(20.0)
    assert len(finder.calls) == 1              # not due again before 20.5
    finder.present = set()                    # the job ended; its epilog's release never came
    reg.sweep(21.0)
    assert "4242" not in reg.jobs and len(finder.calls) == 2
    [(job, why)] = reg.take_departed()
    assert job == "4242" and "no process seen for 10 s" in why


def test_one_scan_serves_every_job_unseen_for_half_the_timeout():
    finder = FakeFinder()
    reg = Registry(unseen_timeout_s=10.0, find_jobs=finder)
    reg.register(ROOT, {"job": "1", "uid": 1000}, 0.0)
    reg.register(ROOT, {"job": "2", "uid": 1001}, 4.0)
    reg.register(ROOT, {"job": "3", "uid": 1002}, 8.0)
    finder.present = {"1", "2", "3"}
    reg.sweep(10.5)
    assert finder.calls == [{"1": 1000, "2": 1001}]          # 3 was seen 2.5 s ago: not asked
    assert reg.jobs["2"].seen_at == 10.5


def test_a_failing_scan_forgets_nothing():
    def broken(wanted):
        raise OSError("proc unreadable")

    reg = Registry(unseen_timeout_s=1.0, find_jobs=broken)
    reg.register(ROOT, {"job": "1", "uid": 1000}, 0.0)
    reg.sweep(5.0)
    assert "1" in reg.jobs and reg.take_departed() == []


def test_a_job_whose_ranks_all_left_gets_the_same_clock():
    """A registered job whose only rank said bye (its processes may still run, e.g. between two
    srun steps) stays while its processes are found, and departs once they are gone."""
    me = os.getpid()
    finder = FakeFinder()
    reg = Registry(heartbeat_s=100.0, unseen_timeout_s=10.0, find_jobs=finder)
    reg.register(ROOT, {"job": "9", "uid": os.getuid()}, 0.0)
    reg.hello(Peer(os.getuid(), 0, me), b"r0", {"job": "9", "rank": 0, "pid": me}, 30.0)
    reg.sweep(31.0)
    assert finder.calls == []                 # a connected rank: no scan, however old the registration
    reg.touch(b"r0", Peer(os.getuid(), 0, me), {}, 35.0)
    reg.bye(b"r0", Peer(os.getuid(), 0, me), {})
    assert "9" in reg.jobs and reg.jobs["9"].seen_at == 35.0
    reg.sweep(44.0)
    assert finder.calls == [] and "9" in reg.jobs
    reg.sweep(46.0)
    assert "9" not in reg.jobs and finder.calls == [{"9": os.getuid()}]


def test_a_journal_adopted_registration_gets_a_fresh_clock_and_then_departs():
    finder = FakeFinder()
    reg = Registry(unseen_timeout_s=10.0, find_jobs=finder)
    adopted, dead = reg.adopt({"4243": {"uid": 1000, "registered": True, "reg_pids": {}, "ranks": {}}}, 500.0)
    assert adopted == ["4243"] and dead == []
    reg.sweep(505.0)
    assert "4243" in reg.jobs
    reg.sweep(511.0)
    assert "4243" not in reg.jobs
    assert reg.take_departed()[0][0] == "4243"


# --- no share before hello ---------------------------------------------------------------------------------
def test_a_registered_job_without_ranks_takes_no_share():
    me = os.getpid()
    reg = Registry(heartbeat_s=100.0)
    reg.register(ROOT, {"job": "idle", "uid": 1000, "gpus": ["0"], "cpus": 4}, 0.0)
    reg.hello(Peer(os.getuid(), 0, me), b"r0", {"job": "busy", "rank": 0, "pid": me, "workers": 2}, 0.0)
    col = Collector(reg, loader_cpus=1.8, cpu_ids=(0, 1))
    snap = col.snapshot(1.0)
    assert set(snap.jobs) == {"busy"}
    plan = get_policy("even")(snap, {}, PolicyConfig())
    assert set(plan.allocations) == {"busy"} and plan.allocations["busy"].cpus == pytest.approx(1.8)
