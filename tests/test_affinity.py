"""agent/actuators/cgroup.py's AffinityActuator: CPU affinity of a cooperative job's workers within its
allowed CPUs (real child processes, no root needed), restored by a restarted agent from its journal."""
from __future__ import annotations

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

