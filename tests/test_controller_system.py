"""System tier: the controller driving real cgroup v1 groups, and the real agent daemon doing the same.

Root and the v1 cpu/cpuset hierarchies are needed (skipped with a printed reason otherwise). The
in-process test uses a test-only subtree ``adloader-test-<pid>-ctl``; the daemon test runs the real
``adloader agent`` with ``--cgroup-mode v1``, which writes only in the agent's own subtree
(``adloader/<job>``) and removes its groups on SIGTERM.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from agent import cgroupfs
from agent.actuators import build
from agent.controller import Controller
from agent.policies import PolicyConfig, get_policy
from tests.conftest import wait_for
from tests.cgroup_support import CPU, ROOT, skip_reason, wipe
from tests.fakes import FakeBank, FakeSink, FakeSource, job_stats

SUBTREE = f"adloader-test-{os.getpid()}-ctl"

pytestmark = [pytest.mark.system]
if skip_reason():
    print(f"skipping controller system tests: {skip_reason()}", file=sys.stderr)
    pytestmark.append(pytest.mark.skip(reason=skip_reason()))


@pytest.fixture
def procs():
    wipe(SUBTREE)
    ps: list[subprocess.Popen] = []
    yield ps
    for p in ps:
        p.kill()
        p.wait(timeout=10)
    wipe(SUBTREE)


def sleeper(ps) -> int:
    p = subprocess.Popen(["sleep", "600"])
    ps.append(p)
    return p.pid


def read(*parts) -> str:
    with open(os.path.join(CPU, *parts)) as f:
        return f.read().strip()


def test_controller_drives_real_groups_through_arrival_departure_and_stop(procs, tmp_path):
    a1, a2, b1 = sleeper(procs), sleeper(procs), sleeper(procs)
    src = FakeSource(1.8, [job_stats("a", worker_pids=(a1,)), job_stats("b", worker_pids=(b1,))])
    sink = FakeSink()
    acts = build("v1", sink=sink, cgroup_root=ROOT, subtree=SUBTREE, state_dir=str(tmp_path))
    c = Controller(snapshot_source=src, policy=get_policy("even"), policy_config=PolicyConfig(),
                   predictor=FakeBank(), actuators=acts)
    rec = c.tick(now=0.0)
    assert all(r.ok for r in rec.results.values()), rec.results
    assert read(SUBTREE, "a", "cpu.shares") == read(SUBTREE, "b", "cpu.shares") == str(round(0.9 * 1024))
    assert any("io:" in n for r in rec.results.values() for n in r.not_enforced)   # honest about IO here
    # the job's loader grows a worker: the next tick moves it in without any allocation change
    src.jobs["a"] = job_stats("a", worker_pids=(a1, a2))
    rec = c.tick(now=1.0)
    assert set(rec.results) == {"a"} and cgroupfs.proc_cgroups(a2)["cpu"] == f"/{SUBTREE}/a"
    assert [s[0] for s in sink.sent].count("a") == 1          # no directive for a pid change
    # b departs: its group goes, its worker goes back, a gets the whole 1.8 cores in the same tick
    del src.jobs["b"]
    rec = c.tick(now=2.0)
    assert rec.departed == ("b",)
    assert not os.path.exists(os.path.join(CPU, SUBTREE, "b"))
    assert cgroupfs.proc_cgroups(b1)["cpu"] == "/"
    assert read(SUBTREE, "a", "cpu.shares") == str(round(1.8 * 1024))
    c.stop()
    assert not os.path.exists(os.path.join(CPU, SUBTREE))
    assert cgroupfs.proc_cgroups(a1)["cpu"] == "/" and cgroupfs.proc_cgroups(a2)["cpu"] == "/"


def test_real_agent_moves_worker_pids_and_cleans_up(tmp_path):
    from tests.agentd_support import AgentProc, Trainer, short_dir

    base = short_dir()
    job = f"ctl-e2e-{os.getpid()}"
    agent = AgentProc(base, "--cgroup-mode", "v1", "--policy", "adaptive", "--tick-s", "0.3",
                      "--loader-cpus", "1.8").start()
    trainer = Trainer(base, agent.endpoint, job=job, workers=2)
    group = f"/adloader/{job}"
    try:
        def workers_in_group():
            pids = trainer.state().get("worker_pids") or []
            try:
                return pids if pids and all(cgroupfs.proc_cgroups(p)["cpu"] == group for p in pids) else None
            except cgroupfs.JobGone:
                return None

        pids = wait_for(workers_in_group, 30, what=f"the trainer's workers in {group}")
        assert cgroupfs.proc_cgroups(trainer.pid)["cpu"] != group     # the training process is never moved
    finally:
        rc = agent.stop()
        trainer.kill()
    assert rc == 0, agent.log()[-2000:]
    assert not os.path.exists(os.path.join(CPU, "adloader", job))
    for p in pids:
        try:
            assert cgroupfs.proc_cgroups(p)["cpu"] != group
        except cgroupfs.JobGone:
            pass


def test_a_restarted_agent_moves_no_process_that_took_a_dead_workers_pid():
    """The agent is SIGKILLed while a job's worker is in the job's group; the worker exits and its pid
    goes to another user's process before the agent restarts (a journal edit stands in for the pid's
    reuse). The restarted agent adopts the job, and leaves that process where it is (it moved it into
    the job's group on its first tick before)."""
    import json
    import shutil

    import zmq

    from tests.agentd_support import AgentProc, short_dir

    sub = f"{SUBTREE}-e2e"
    base = short_dir()
    env = {"ADLOADER_CGROUP_SUBTREE": sub, "ADLOADER_HEARTBEAT_S": "5"}
    agent = AgentProc(base, "--cgroup-mode", "v1", "--tick-s", "0.2", env=env).start()
    again = None
    worker = subprocess.Popen(["sleep", "120"])
    other = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "sleep", "120"])
    ctx = zmq.Context()
    group = f"/{sub}/reuse"
    try:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(agent.endpoint)
        s.send(json.dumps({"v": "1.0", "type": "hello", "job": "reuse", "rank": 0, "pid": os.getpid(),
                           "worker_pids": [worker.pid], "gpus": ["0"]}).encode())
        wait_for(lambda: cgroupfs.proc_cgroups(worker.pid)["cpu"] == group, 20, what="the worker in its group")
        agent.kill9()
        worker.kill()
        worker.wait()
        path = os.path.join(agent.state_dir, "journal.json")
        with open(path) as f:
            doc = json.load(f)
        rank = doc["jobs"]["reuse"]["ranks"]["0"]
        rank["worker_pids"] = [other.pid]
        rank.setdefault("worker_start_ticks", {})[str(other.pid)] = rank.get("worker_start_ticks", {}).get(
            str(worker.pid))
        with open(path, "w") as f:
            json.dump(doc, f)
        again = AgentProc(base, "--cgroup-mode", "v1", "--tick-s", "0.2", env=env, state_dir=agent.state_dir).start()
        wait_for(lambda: again.events("allocation_applied"), 20, what="the adopted job's allocation applied")
        assert [e["adopted"] for e in again.events("journal_adopted")] == [["reuse"]]
        assert cgroupfs.proc_cgroups(other.pid)["cpu"] != group
    finally:
        rc = again.stop() if again is not None else None
        for p in (worker, other):
            if p.poll() is None:
                p.kill()
                p.wait()
        ctx.destroy(0)
        left = wipe(sub)
        shutil.rmtree(base, ignore_errors=True)
    assert rc == 0, again.log()[-2000:]
    assert left == [], left


@pytest.mark.parametrize("journal", ["lost", "without the job"])
def test_a_restarted_agent_releases_a_group_its_journal_does_not_adopt(procs, tmp_path, journal):
    """The dead agent made a job's group and moved a worker into it; the restarted agent's journal does
    not know the job (journal.json lost, or the job already gone from it while its release was still
    being retried when the agent was killed). Only the journal's jobs were forgotten at start, so this
    one kept its group, and its worker stayed in it, until the agent stopped. Now every job the cgroup
    actuator holds something for and the journal does not adopt is released at start."""
    from agent import config as configmod
    from agent import journal as journalmod
    from agent.daemon import Agent
    from agent.model import JobAllocation

    worker = sleeper(procs)
    cfg = configmod.load(None, {"endpoint": f"ipc://{tmp_path}/agent.sock", "state_dir": str(tmp_path / "state"),
                                "cgroup_mode": "v1", "cgroup_subtree": SUBTREE, "policy": "even"}, environ={})
    agents = [Agent(cfg)]
    try:
        act = agents[0].actuators[1]
        job = job_stats("lost1", worker_pids=(worker,), pids=(os.getpid(),), uid=0)
        assert act.apply(job, JobAllocation(job="lost1", workers=1, cpus=1.0)).ok
        assert cgroupfs.proc_cgroups(worker)["cpu"] == f"/{SUBTREE}/lost1"
        if journal == "without the job":
            journalmod.save(cfg.state_dir, {}, {})
        # the agent is killed: nothing restored, its locks let go; a new one starts on the same state directory
        agents[0].unlock_state_dir()
        agents[0]._release_subtrees()
        agents.append(Agent(cfg))
        agents[1]._adopt_journal(0.0)
        assert cgroupfs.proc_cgroups(worker)["cpu"] == "/"
        assert not os.path.exists(os.path.join(CPU, SUBTREE, "lost1"))
        agents[1].controller.stop()
        assert not os.path.exists(os.path.join(CPU, SUBTREE))
    finally:
        for a in agents:
            a.server.close()
            a.ctx.term()


@pytest.mark.parametrize("mode", ["v1", "auto"])
def test_a_second_agent_on_the_same_cgroup_subtree_is_refused_naming_both(procs, tmp_path, mode):
    """Two agents with their own state directories and one cgroup_subtree: each took the subtree as its
    own (each wrote the subtree's weight over the other's; one whose journal of originals was lost took
    the other's job groups as a dead agent's and emptied and removed them). The second is refused,
    whatever the mode (auto must not fall back to off over it), naming the subtree, the first agent's
    pid and state directory and its own; once the first stops, the subtree can be had again; another
    subtree is never refused."""
    from agent import config as configmod
    from agent.daemon import Agent, CannotStart
    from agent.model import JobAllocation

    from adloader import env

    worker = sleeper(procs)
    run_dir_there = os.path.isdir(env.runtime_dir())        # where the claims live (/run/adloader for root)

    def cfg(name, subtree=SUBTREE):
        return configmod.load(None, {"endpoint": f"ipc://{tmp_path}/{name}.sock", "state_dir": str(tmp_path / name),
                                     "cgroup_mode": mode, "cgroup_subtree": subtree, "policy": "even"}, environ={})

    first = Agent(cfg("first"))
    agents = [first]
    try:
        act = first.actuators[1]
        assert act.apply(job_stats("mine", worker_pids=(worker,), pids=(os.getpid(),), uid=0),
                         JobAllocation(job="mine", workers=1, cpus=1.0)).ok
        (tmp_path / "second").mkdir()
        (tmp_path / "second" / "cgroup-originals.json").write_text("{torn")     # would adopt the first's groups
        with pytest.raises(CannotStart) as e:
            Agent(cfg("second"))
        msg = str(e.value)
        assert "'cgroup_subtree'" in msg and os.path.join(CPU, SUBTREE) in msg and "another agent" in msg, msg
        assert f"pid {os.getpid()}" in msg and str(tmp_path / "first") in msg and str(tmp_path / "second") in msg, msg
        assert cgroupfs.proc_cgroups(worker)["cpu"] == f"/{SUBTREE}/mine"      # the first's group untouched
        other = Agent(cfg("other", f"{SUBTREE}-b"))                              # another subtree: no conflict
        agents.append(other)
        first.stop()
        agents.remove(first)
        assert not os.path.exists(os.path.join(CPU, SUBTREE))
        again = Agent(cfg("second"))                                             # the subtree is free again
        agents.append(again)
    finally:
        for a in agents:
            a.stop()
        wipe(f"{SUBTREE}-b")
        if not run_dir_there:
            try:
                os.rmdir(env.runtime_dir())     # (empty: every claim removed its file)
            except OSError:
                pass
