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


def _procs(group: str) -> set:
    """The pids in a v1 group (none where it does not exist)."""
    try:
        with open(f"{group}/cgroup.procs") as f:
            return {int(x) for x in f.read().split()}
    except OSError:
        return set()


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
            return _procs(group)

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


# A real training script: a training adloader.DataLoader (one worker) and a validation one (one worker,
# its samples burning CPU), the validation pass run while the state file says so; the state file holds
# the validation workers' pids while they live.
VALIDATING_TRAINER = '''
import json, os, sys, time
import torch.utils.data
from adloader import DataLoader
from tests.agentd_support import BurningDataset


state, run_s = sys.argv[1], float(sys.argv[2])
train = DataLoader(list(range(10 ** 6)), batch_size=4, num_workers=1)
val = {val_loader}(BurningDataset(4000, 0.02), batch_size=2, num_workers=1)   # (a shorter epoch than training's)


def write(**kw):
    with open(state + ".tmp", "w") as f:
        json.dump(kw, f)
    os.replace(state + ".tmp", state)


t_end = time.monotonic() + run_s
it = iter(train)
for _ in range(20):
    next(it)
    time.sleep(0.02)
write(phase="validating")
vit = iter(val)
for batch in vit:                           # the validation pass: the training loop is away from its loader
    pids = val.worker_pids() if hasattr(val, "worker_pids") else [w.pid for w in vit._workers]
    write(phase="validating", val_worker_pids=pids, train_worker_pids=train.worker_pids())
    if time.monotonic() > t_end:
        break
'''


@pytest.mark.skipif(bool(_v1_writable()), reason=_v1_writable() or "ok")
@pytest.mark.parametrize("val_loader", ["DataLoader", "torch.utils.data.DataLoader"])
def test_a_validation_loaders_workers_are_placed_in_the_jobs_group_with_its_training_workers(val_loader):
    """A training script with a validation loader of its own (``adloader.DataLoader``, or torch's own,
    which never attaches to the client): while the validation pass runs, its worker is moved into the
    job's group beside the training loader's (it is a loader worker: it yields and weighs with the job's
    loaders, not at the training process's priority), the training process stays out, and status counts
    the validation's CPU as the job's, and its worker's memory in the job's loader memory."""
    base = short_dir()
    job = f"adlval-{os.getpid()}-{time.monotonic_ns() % 10**6}"
    group = f"{CPU}/adloader/{job}"
    agent = AgentProc(base, "--policy", "even", "--loader-cpus", "2", "--tick-s", "0.2", "--cgroup-mode", "v1").start()
    t = None

    def procs():
        return _procs(group)

    try:
        script = f"{base}/validating_trainer.py"
        with open(script, "w") as f:
            f.write(VALIDATING_TRAINER.replace("{val_loader}", val_loader))
        t = Trainer(base, agent.endpoint, job=job, script=script, run_s=60)

        st = wait_for(lambda: (s := t.state()).get("val_worker_pids") and set(s["val_worker_pids"]) <= procs() and s,
                      60, what="the validation loader's worker moved into the job's group")
        assert set(st["train_worker_pids"]) <= procs() and t.pid not in procs()
        j = wait_for(lambda: (x := agent.job(job)) and x["job_cpu_cores"] and x["job_cpu_cores"] > 0.2 and x, 30,
                     what="the validation pass's CPU counted as the job's")
        assert set(st["val_worker_pids"]) <= set(j["worker_pids"])
        j = wait_for(lambda: (x := agent.job(job)) and (x.get("other_loader_memory_bytes") or 0) > 0 and x, 30,
                     what="the validation worker's memory counted in the job's loader memory")
        assert j["loader_memory_bytes"] >= j["other_loader_memory_bytes"]
        t.kill()
        wait_for(lambda: not procs(), 30, what="the job's workers gone with their training process")
        wait_for(lambda: not os.path.exists(group), 15, what="the job's group removed once it left")
    finally:
        if t is not None:
            t.kill()
        if agent.proc is not None and agent.proc.poll() is None:
            agent.stop(signal.SIGTERM)
        if os.path.isdir(group):
            wait_for(lambda: not procs(), 30, what="the job's workers gone")
            os.rmdir(group)
        shutil.rmtree(base, ignore_errors=True)
