"""System tier: the real agent with real cgroup v1 groups (root only). A job's loader workers are moved
into the agent's group for it (the training process is not); the agent is killed with SIGKILL, the job
dies meanwhile, and the restarted agent forgets it from the journal and removes its group."""
from __future__ import annotations

import os
import shutil
import signal
import time

import pytest

from agent import cgroupfs
from tests.agentd_support import AgentProc, Trainer, short_dir
from tests.cgroup_support import CPU, ROOT
from tests.conftest import wait_for

pytestmark = pytest.mark.system


def _v1_writable() -> str:
    if os.getuid() != 0:
        return "needs root"
    return cgroupfs.v1_controller_available(ROOT, "cpu") or ""


@pytest.mark.skipif(bool(_v1_writable()), reason=_v1_writable() or "ok")
def test_kill9_restart_releases_the_cgroup_of_a_job_that_died_meanwhile():
    base = short_dir()
    job = f"adlsys-{os.getpid()}-{time.monotonic_ns() % 10**6}"
    group = f"{CPU}/adloader/{job}"
    args = ("--policy", "even", "--loader-cpus", "2", "--tick-s", "0.2", "--cgroup-mode", "v1")
    agent = AgentProc(base, *args).start()
    agent2 = None
    t = None
    try:
        assert agent.events("agent_started")[0]["actuators"][:2] == ["directive", "cgroup-v1"]
        t = Trainer(base, agent.endpoint, job=job, workers=1)

        def procs():
            try:
                with open(f"{group}/cgroup.procs") as f:
                    return {int(x) for x in f.read().split()}
            except OSError:
                return set()

        wait_for(lambda: (w := t.state().get("worker_pids")) and set(w) <= procs() and w, 30,
                 what="worker pids moved into the job's group")
        assert t.pid not in procs()                       # the training process is never throttled
        agent.kill9()
        t.kill()
        assert os.path.isdir(group)                       # left behind by the killed agent ...
        agent2 = AgentProc(base, *args).start()
        adopted = agent2.events("journal_adopted")[0]
        assert job in adopted["forgotten"] and job not in adopted["adopted"], (adopted, agent2.log()[-3000:])
        wait_for(lambda: not os.path.exists(group), 10, what="the dead job's group removed")   # ... and cleaned up
        assert agent2.job(job) is None
    finally:
        if t is not None:
            t.kill()
        for a in (agent, agent2):
            if a is not None and a.proc is not None and a.proc.poll() is None:
                a.stop(signal.SIGTERM)
        if os.path.isdir(group):
            os.rmdir(group)
        shutil.rmtree(base, ignore_errors=True)
