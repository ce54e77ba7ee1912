"""agent/daemon.py, the composition root: what it builds and what it lets a caller inject (the end-to-end
runs of the daemon are in test_agent_component.py)."""
from __future__ import annotations

import pytest

from agent import config as configmod
from agent.model import AllocationPlan

pytestmark = pytest.mark.component


def test_an_injected_policy_decides_and_no_global_registry_changes(tmp_path):
    """The bench's oracle is handed to the Agent like a predictor; agent.policies.POLICIES is not edited."""
    from agent.daemon import Agent
    from agent.policies import POLICIES

    before = dict(POLICIES)
    seen = []

    def oracle(snapshot, curves, config):
        seen.append(snapshot)
        return AllocationPlan(policy="oracle", allocations={})

    cfg = configmod.load(None, {"endpoint": f"ipc://{tmp_path}/agent.sock", "state_dir": str(tmp_path / "state"),
                                "cgroup_mode": "off", "policy": "even"}, environ={})
    agent = Agent(cfg, policy=oracle)
    try:
        agent.controller.tick(1.0)
        assert len(seen) == 1 and seen[0].applied == {}
        assert agent.policy_name == "oracle" and agent.status_doc()["agent"]["policy"] == "oracle"
        agent.controller = agent._build_controller()           # what a SIGHUP reload does: still injected
        agent.controller.tick(2.0)
        assert len(seen) == 2
        assert POLICIES == before
    finally:
        agent.server.close()
        agent.ctx.term()


def test_each_switch_of_the_loaders_yield_is_logged_with_its_reason(tmp_path, caplog):
    """An operator sees when and why the loaders stopped yielding to the trainers (not every tick), and
    when the subtree starts keeping its weight through the gaps of a load that comes and goes
    (``foreign_intermittent``), which does not switch the yield."""
    import logging

    from agent.daemon import Agent
    from agent.model import NodeAllocation

    states = iter([(True, False), (True, False), (False, False), (False, False), (False, True), (False, True),
                   (True, False)])

    def policy(snapshot, curves, config):
        on, kept = next(states)
        return AllocationPlan(policy="t", allocations={},
                              node=NodeAllocation(on, {}, f"reason {on}{' kept' if kept else ''}", intermittent=kept))

    cfg = configmod.load(None, {"endpoint": f"ipc://{tmp_path}/agent.sock", "state_dir": str(tmp_path / "state"),
                                "cgroup_mode": "off", "policy": "even"}, environ={})
    agent = Agent(cfg, policy=policy)
    try:
        kept = []
        with caplog.at_level(logging.INFO, logger="agent.daemon"):
            for t in range(7):
                agent.tick(float(t + 1))
                kept.append(agent.status_doc()["node"]["intermittent"])
        assert kept == [False, False, False, False, True, True, False]     # status says it each tick
        got = [(r.fields["on"], r.fields["reason"], r.fields.get("intermittent", False))
               for r in caplog.records if getattr(r, "event", "") == "loaders_yield"]
        assert got == [(True, "reason True", False), (False, "reason False", False),
                       (False, "reason False kept", True), (True, "reason True", False)]
    finally:
        agent.server.close()
        agent.ctx.term()


def _apply_failures_logged(tmp_path, caplog, errors, ticks: int) -> list:
    """The ``apply_failed`` log lines of an agent whose one actuator fails every apply of its one job with
    ``next(errors)`` for ``ticks`` ticks (each line a warning)."""
    import logging
    import os

    from agent.daemon import Agent
    from agent.model import ApplyResult, JobAllocation
    from agent.security import Peer

    class Broken:
        name = "broken"

        def apply(self, job, desired):
            return ApplyResult(job=job.job, ok=False, applied=None, error=next(errors))

        def release(self, job_id):
            pass

        def restore(self):
            pass

    def policy(snapshot, curves, config):
        return AllocationPlan(policy="t", allocations={j: JobAllocation(job=j, workers=1, cpus=1.0)
                                                       for j in snapshot.jobs})

    cfg = configmod.load(None, {"endpoint": f"ipc://{tmp_path}/agent.sock", "state_dir": str(tmp_path / "state"),
                                "cgroup_mode": "off", "policy": "even"}, environ={})
    agent = Agent(cfg, policy=policy)
    try:
        agent.server.bind()                    # the heartbeat to the registered client goes out on it
        agent.actuators = [Broken()]
        agent.controller = agent._build_controller()
        agent.registry.hello(Peer(os.getuid(), 0, os.getpid()), b"c0", {"job": "j", "rank": 0, "pid": os.getpid(),
                                                                          "gpus": ["0"], "batch_size": 8, "workers": 2}, 0.0)
        with caplog.at_level(logging.INFO, logger="agent.daemon"):
            for t in range(ticks):
                agent.tick(float(t + 1))
        records = [r for r in caplog.records if getattr(r, "event", "") == "apply_failed"]
        assert all(r.levelno == logging.WARNING for r in records)
        return [r.fields["error"] for r in records]
    finally:
        agent.server.close()
        agent.ctx.term()


def test_a_failing_apply_is_logged_once_per_new_error_and_again_when_its_breaker_opens(tmp_path, caplog):
    """Found on a real cgroup v2 node: every apply of a job failed and its breaker opened, with nothing in
    the log (only ``adloader status`` showed it). Now each new error of a job's apply is a warning."""
    import itertools

    got = _apply_failures_logged(tmp_path, caplog, itertools.repeat("Busy: write '+cpu'"), ticks=6)
    assert got == ["broken: Busy: write '+cpu'",
                   "breaker open: 3 failures in a row; last: broken: Busy: write '+cpu'"], got


def test_a_failure_whose_text_only_counts_on_is_logged_once(tmp_path, caplog):
    """A hung call's text says how long it has run ("running for 3.0 s", then 4.0 s, ...): the same
    failure going on, logged once, not once a tick for the whole hang."""
    import itertools

    calls = itertools.count(1)
    errors = (f"actuator busy: cgroup apply for job 'x' running for {next(calls)}.0 s" for _ in itertools.count())
    got = _apply_failures_logged(tmp_path, caplog, errors, ticks=2)
    assert next(calls) == 3 and got == ["broken: actuator busy: cgroup apply for job 'x' running for 1.0 s"], got


def test_the_agents_config_defaults_are_the_policys_defaults():
    """AgentConfig and PolicyConfig each declare the policy knobs (the daemon maps one onto the other):
    an agent run with no config file must decide exactly as the policy's defaults do."""
    from agent.daemon import _policy_config
    from agent.policies import PolicyConfig

    mapped, default = _policy_config(configmod.AgentConfig()), PolicyConfig()
    for name in ("hysteresis", "min_confidence", "fairness_floor", "floor_fraction", "floor_reference", "floor_allotment",
                 "delivery_correction", "loaders_yield",
                 "yield_foreign_max_cores", "pin_cpusets"):
        assert getattr(mapped, name) == getattr(default, name), name


def test_the_agent_follows_a_change_of_its_own_cpus(tmp_path, caplog):
    """The agent's CPUs (its affinity: systemd's AllowedCPUs) are read again every NODE_REFRESH_S:
    narrowed while it runs, the snapshot's CPUs and the "auto" loader budget follow, and an operator
    sees it in the log (before, both were read once at start). Real affinity of this test's process."""
    import logging
    import os

    from agent.daemon import NODE_REFRESH_S, Agent

    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < 2:
        pytest.skip(f"needs 2 CPUs in this process's affinity to narrow it, has {mine}")
    cfg = configmod.load(None, {"endpoint": f"ipc://{tmp_path}/agent.sock", "state_dir": str(tmp_path / "state"),
                                "cgroup_mode": "off", "policy": "even"}, environ={})
    agent = Agent(cfg)
    try:
        full = agent.collector.loader_cpus
        agent.tick(1.0)
        assert agent.collector.cpu_ids == tuple(mine)
        os.sched_setaffinity(0, {mine[0]})
        with caplog.at_level(logging.INFO, logger="agent.daemon"):
            agent.tick(1.0 + NODE_REFRESH_S / 2)                       # not read again yet
            assert agent.collector.cpu_ids == tuple(mine)
            agent.tick(1.0 + NODE_REFRESH_S)
        assert agent.collector.cpu_ids == (mine[0],)
        assert agent.collector.loader_cpus == configmod.auto_loader_cpus() < full
        assert agent.status_doc()["agent"]["cpu_ids"] == [mine[0]]
        assert [r.fields["cpus"] for r in caplog.records if getattr(r, "event", "") == "node_cpus_changed"] == [1]
    finally:
        os.sched_setaffinity(0, set(mine))
        agent.server.close()
        agent.ctx.term()


def test_the_agent_follows_a_change_of_its_own_memory_limit(tmp_path, monkeypatch, caplog):
    """An "auto" loader memory budget is computed again every NODE_REFRESH_S: the agent's cgroup
    memory limit cut while it runs (``systemctl set-property adloader-agent MemoryMax=...``) cuts the
    budget, an explicit budget stays, and the log says so. The sandbox owns this machine's memory
    hierarchy, so the agent reads a v1 tree of files laid out as the kernel's (the real parser on them)."""
    import logging

    from agent.daemon import NODE_REFRESH_S, Agent

    gib = 1 << 30
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text("5:cpu,cpuacct:/system.slice/adloader-agent.service\n"
                                          "4:memory:/system.slice/adloader-agent.service\n")
    (proc / "meminfo").write_text(f"MemTotal:       {64 * gib // 1024} kB\nMemAvailable:   {60 * gib // 1024} kB\n")
    group = root / "memory" / "system.slice" / "adloader-agent.service"
    group.mkdir(parents=True)
    (group / "memory.limit_in_bytes").write_text(str(16 * gib))
    (group / "memory.usage_in_bytes").write_text(str(gib))
    # a loader process in the agent's group (cgroup v2: the job groups in its delegated subtree): its limit
    # binds the loaders too (test_memory_policy: a limit on the agent alone is not their budget)
    (proc / "4242").mkdir()
    (proc / "4242" / "cgroup").write_text("4:memory:/system.slice/adloader-agent.service/adloader/job-1\n")
    real = configmod.auto_loader_memory
    asked = []

    def auto(loader_pids=()):
        asked.append(loader_pids)
        return real(str(proc), str(root), loader_pids=(4242,))

    monkeypatch.setattr(configmod, "auto_loader_memory", auto)

    def agent_with(loader_memory):
        cfg = configmod.load(None, {"endpoint": f"ipc://{tmp_path}/agent-{loader_memory}.sock",
                                    "state_dir": str(tmp_path / f"state-{loader_memory}"), "cgroup_mode": "off",
                                    "policy": "even", "loader_memory": loader_memory}, environ={})
        return Agent(cfg)

    auto, fixed = agent_with("auto"), agent_with("6GiB")
    try:
        for a in (auto, fixed):
            a.tick(1.0)
        assert auto.collector.memory_guard.configured == 12 * gib             # 16 GiB less 25%
        (group / "memory.limit_in_bytes").write_text(str(8 * gib))
        with caplog.at_level(logging.INFO, logger="agent.daemon"):
            for a in (auto, fixed):
                a.tick(1.0 + NODE_REFRESH_S / 2)                               # not read again yet
            assert auto.collector.memory_guard.configured == 12 * gib
            for a in (auto, fixed):
                a.tick(1.0 + NODE_REFRESH_S)
        assert auto.collector.memory_guard.configured == 6 * gib               # 8 GiB less 2 GiB (min reserve)
        assert auto.status_doc()["agent"]["memory"]["configured_bytes"] == 6 * gib
        assert fixed.collector.memory_guard.configured == 6 * gib              # explicit: as configured
        changed = [r.fields for r in caplog.records if getattr(r, "event", "") == "loader_memory_changed"]
        assert [(c["loader_memory_bytes"], c["was"]) for c in changed] == [(6 * gib, 12 * gib)]
    finally:
        for a in (auto, fixed):
            a.server.close()
            a.ctx.term()


def test_a_reload_that_fails_for_any_reason_logs_one_line_and_keeps_the_running_config(tmp_path, caplog):
    """Before: only ConfigError was caught; a RecursionError out of tomllib (an array nested 3000 deep)
    escaped the SIGHUP reload and stopped the agent, and a config path that had become a FIFO blocked the
    reload (the whole service loop) for ever. Now each failure is one reload_failed line naming it, and
    the running config, controller and memory guard stay as they were."""
    import logging
    import os
    import threading

    from agent.daemon import Agent

    path = tmp_path / "agent.toml"
    path.write_text('policy = "even"\nhysteresis = 0.05\n')
    cli = {"endpoint": f"ipc://{tmp_path}/agent.sock", "state_dir": str(tmp_path / "state"), "cgroup_mode": "off"}
    agent = Agent(configmod.load(str(path), cli, environ={}), config_path=str(path), cli=cli)

    def reload_within(deadline_s=10.0):
        t = threading.Thread(target=agent.reload, daemon=True)
        t.start()
        t.join(deadline_s)
        if t.is_alive():
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)    # let the blocked open() return
            os.close(fd)
            t.join(deadline_s)
            pytest.fail("the reload blocked")

    def failures():
        return [r.fields for r in caplog.records if getattr(r, "event", "") == "reload_failed"]

    try:
        running, controller, guard = agent.config, agent.controller, agent.collector.memory_guard
        with caplog.at_level(logging.INFO, logger="agent.daemon"):
            path.write_text('policy = "adaptive"\nhysteresis = ' + "[" * 3000 + "]" * 3000 + "\n")
            reload_within()
            assert len(failures()) == 1 and "nested too deeply" in failures()[0]["error"], failures()
            assert agent.config is running and agent.controller is controller

            path.unlink()
            os.mkfifo(path)
            reload_within()
            assert len(failures()) == 2 and "not a regular file (a FIFO)" in failures()[1]["error"], failures()
            assert agent.config is running and agent.controller is controller

            path.unlink()
            path.write_text('policy = "adaptive"\nhysteresis = 0.1\nloader_memory = "1GiB"\n')

            def broken(**_):
                raise RuntimeError("no predictor today")
            agent._build_controller = broken
            reload_within()
            assert len(failures()) == 2 + 1, failures()
            assert failures()[2]["error"] == "RuntimeError: no predictor today", failures()
            assert agent.config is running and agent.controller is controller
            assert agent.collector.memory_guard is guard       # nothing of the failed reload applied
            assert all(r.levelno == logging.ERROR and "\n" not in r.getMessage()
                       for r in caplog.records if getattr(r, "event", "") == "reload_failed")

            del agent._build_controller
            reload_within()
            assert len(failures()) == 3
            assert agent.config.policy == "adaptive" and agent.config.hysteresis == 0.1
            assert agent.controller is not controller and agent.collector.memory_guard is not guard
    finally:
        agent.server.close()
        agent.ctx.term()


def test_the_actuator_timeout_is_configured_reloaded_and_a_rebuilt_controller_keeps_the_lanes(tmp_path):
    """``actuator_timeout_s`` reaches the controller and a SIGHUP changes it; a controller that a reload
    builds takes over the old one's actuator lanes, so it does not call an actuator that a call of its
    predecessor still holds."""
    from agent.daemon import Agent

    path = tmp_path / "agent.toml"
    path.write_text('policy = "even"\nactuator_timeout_s = 2.5\n')
    cli = {"endpoint": f"ipc://{tmp_path}/agent.sock", "state_dir": str(tmp_path / "state"), "cgroup_mode": "off"}
    agent = Agent(configmod.load(str(path), cli, environ={}), config_path=str(path), cli=cli)
    try:
        first = agent.controller
        assert first.actuator_timeout_s == 2.5 and len(first.lanes) == len(agent.actuators)
        path.write_text('policy = "even"\nactuator_timeout_s = 0.5\n')
        agent.reload()
        assert agent.controller is first and first.actuator_timeout_s == 0.5
        path.write_text('policy = "adaptive"\nactuator_timeout_s = 0.25\n')
        agent.reload()
        assert agent.controller is not first and agent.controller.actuator_timeout_s == 0.25
        assert all(a is b for a, b in zip(agent.controller.lanes, first.lanes, strict=True))
    finally:
        agent.server.close()
        agent.ctx.term()


def test_a_status_read_beside_a_hung_save_of_the_originals_is_prompt_and_consistent(tmp_path, monkeypatch):
    """What the status document (and the metrics, built from it) reads of an actuator is how its journal
    of originals was saved (``Originals.save_problem``). The actuator changes that on its lane's thread,
    and a call that outlived its timeout (a state directory whose disk stopped answering) goes on there
    while the service loop builds status. A read then returns at once with both halves of one moment:
    the last save that finished (it failed) and the save still running; once the hung save returns,
    status says nothing of the originals, and the file holds both groups."""
    import errno
    import json
    import threading

    from agent import statefile
    from agent.actuators.originals import Originals
    from agent.controller import ActuatorLane
    from agent.daemon import Agent

    cfg = configmod.load(None, {"endpoint": f"ipc://{tmp_path}/agent.sock", "state_dir": str(tmp_path / "state"),
                                "cgroup_mode": "off", "policy": "even"}, environ={})
    agent = Agent(cfg)
    originals = Originals(str(tmp_path / "cgroup-originals.json"))

    class GroupMaker:            # records each group it makes in the originals, then saves them
        name = "cgroup-v1"

        def __init__(self):
            self.originals = originals

        def make(self, rel):
            originals.created.append(Originals.key("cpu", rel))
            originals.save()

    maker = GroupMaker()
    agent.actuators.append(maker)
    real_write, writes = statefile.write_atomic, []
    inside, gate = threading.Event(), threading.Event()

    def write_atomic(path, data, mode=0o600):
        writes.append(data)
        if len(writes) == 1:
            raise OSError(errno.EROFS, "Read-only file system")
        inside.set()
        assert gate.wait(30.0), "the test never opened the gate"
        real_write(path, data, mode)

    monkeypatch.setattr(statefile, "write_atomic", write_atomic)
    lane = ActuatorLane(maker.name)

    def problems():
        return [p for p in agent.status_doc()["agent"]["state_problems"] if "originals" in p]

    try:
        assert lane.call(maker.make, "adloader/a", timeout_s=5.0) == (True, None)
        assert problems() == [f"cgroup originals not saved: {originals.path}: Read-only file system"]
        call = lane.submit(maker.make, "adloader/b")
        assert inside.wait(10.0)                        # b is in memory, its save is stuck in the write
        done, why = lane.wait(call, 0.05)
        assert not done and "timed out" in why
        seen = problems()
        # the read did not wait for the hung save: that save is still stuck (it can only end after the gate)
        assert lane.busy() is not None and not gate.is_set()
        assert len(seen) == 1 and seen[0].startswith(
            f"cgroup originals not saved: {originals.path}: Read-only file system; a save running for "), seen
        gate.set()
        assert lane.wait_idle(10.0)                     # the late call returned: its save finished
        assert problems() == []
        with open(originals.path) as f:
            assert json.load(f)["created"] == ["cpu|adloader/a", "cpu|adloader/b"]
    finally:
        gate.set()
        agent.server.close()
        agent.ctx.term()


def test_a_reload_of_a_config_file_that_never_answers_keeps_the_running_config(tmp_path, monkeypatch, caplog):
    """Before: a SIGHUP reload of a config file on a hung network mount held the service loop for ever.
    Now it fails after the read's timeout with one reload_failed line naming the file."""
    import logging
    import threading
    import time

    from agent.daemon import Agent

    path = tmp_path / "agent.toml"
    path.write_text('policy = "even"\n')
    cli = {"endpoint": f"ipc://{tmp_path}/agent.sock", "state_dir": str(tmp_path / "state"), "cgroup_mode": "off"}
    agent = Agent(configmod.load(str(path), cli, environ={}), config_path=str(path), cli=cli)
    gate = threading.Event()

    def hung(p, missing_ok=False):
        gate.wait(30.0)
        return b'policy = "adaptive"\n'

    monkeypatch.setattr(configmod, "_read_file", hung, raising=False)
    monkeypatch.setattr(configmod, "CONFIG_READ_TIMEOUT_S", 0.1, raising=False)
    try:
        running, controller = agent.config, agent.controller
        with caplog.at_level(logging.INFO, logger="agent.daemon"):
            t = threading.Thread(target=agent.reload, daemon=True)
            t.start()
            t.join(10.0)
            assert not t.is_alive(), "the reload blocked"
        failed = [r.fields for r in caplog.records if getattr(r, "event", "") == "reload_failed"]
        assert len(failed) == 1 and str(path) in failed[0]["error"] and "no answer within" in failed[0]["error"]
        assert agent.config is running and agent.controller is controller
    finally:
        gate.set()
        deadline = time.monotonic() + 10.0
        while str(path) in getattr(configmod, "_reading", {}) and time.monotonic() < deadline:
            time.sleep(0.01)
        agent.server.close()
        agent.ctx.term()


def test_a_refused_bind_removes_only_what_it_made_and_never_another_servers_socket(tmp_path):
    """``Server.close(refused=True)``: the lock file and the socket directories this bind made go (empty
    only); a second server refused by the lock touches neither the first one's socket nor its lock."""
    import os

    import zmq

    from agent.registry import Registry
    from agent.server import EndpointBusy, Server

    ctx = zmq.Context()
    sock = f"{tmp_path}/run/deeper/agent.sock"

    def server():
        return Server(f"ipc://{sock}", Registry(), heartbeat_s=1.0, on_report=lambda *a: None,
                      status_doc=dict, ctx=ctx)
    try:
        first, second = server(), server()
        first.bind()
        with pytest.raises(EndpointBusy):
            second.bind()
        second.close(refused=True)
        assert sorted(os.listdir(os.path.dirname(sock))) == ["agent.sock", "agent.sock.lock"]
        first.close(refused=True)
        assert os.listdir(tmp_path) == []              # run/ and run/deeper/ were made by this bind
        os.makedirs(os.path.dirname(sock))
        third = server()
        third.bind()
        third.close(refused=True)                      # the lock it made goes, the directory that existed stays
        assert os.listdir(os.path.dirname(sock)) == []
        fourth = server()
        fourth.bind()
        fourth.close()                                 # a normal stop keeps the lock file, as before
        assert os.listdir(os.path.dirname(sock)) == ["agent.sock.lock"]
    finally:
        ctx.term()


def test_a_lock_file_replaced_while_it_is_taken_is_taken_again(tmp_path, monkeypatch):
    """A refused start unlinks the lock file it made while holding it; an agent that had opened that file
    and locked it after is holding a lock on a file no longer at the path, and must take the new one."""
    import fcntl
    import os

    from agent import server as servermod
    from agent.registry import Registry

    lock = str(tmp_path / "agent.sock.lock")
    with open(lock, "w"):
        pass
    real_flock, calls = fcntl.flock, []

    def flock(fd, op):
        calls.append(os.fstat(fd).st_ino)
        if len(calls) == 1:                            # the first file is unlinked and replaced meanwhile
            os.unlink(lock)
            with open(lock, "w"):
                pass
        return real_flock(fd, op)
    monkeypatch.setattr(fcntl, "flock", flock)
    s = servermod.Server(f"ipc://{tmp_path}/agent.sock", Registry(), heartbeat_s=1.0, on_report=lambda *a: None,
                         status_doc=dict)
    s._lock(lock)
    try:
        assert len(calls) == 2 and calls[0] != calls[1]
        assert os.path.samestat(os.fstat(s._lock_fd), os.stat(lock))
    finally:
        os.close(s._lock_fd)


def test_status_counts_the_worker_pids_every_actuator_left_alone(tmp_path):
    """``agent.pids_skipped`` is the actuators' count of worker pids not moved or pinned because another
    process held the pid by then (before, the count was kept but no operator could read it)."""
    from agent.actuators.cgroup import AffinityActuator
    from agent.actuators.originals import Originals
    from agent.daemon import Agent

    cfg = configmod.load(None, {"endpoint": f"ipc://{tmp_path}/agent.sock", "state_dir": str(tmp_path / "state"),
                                "cgroup_mode": "off", "policy": "even"}, environ={})
    agent = Agent(cfg)
    try:
        assert agent.status_doc()["agent"]["pids_skipped"] == 0
        pinning = AffinityActuator(Originals(str(tmp_path / "orig.json")))
        pinning.pids_skipped = 2
        agent.actuators.append(pinning)
        assert agent.status_doc()["agent"]["pids_skipped"] == 2
    finally:
        agent.server.close()
        agent.ctx.term()
        agent.unlock_state_dir()


def test_a_second_agent_on_the_same_state_dir_is_refused_before_it_touches_anything(tmp_path):
    """Two agents started by mistake with one state_dir and two endpoints (the socket's lock stopped only
    a second one on the same endpoint): the second adopted the first one's journal, then both applied to
    the same groups and rewrote the same journals. It is refused, naming the directory and the first
    agent's pid, before it reads (or sets aside) a single state file; once the first has let go, an agent
    starts there again."""
    import json
    import os

    from agent.daemon import Agent, CannotStart

    state = tmp_path / "state"

    def cfg(name):
        return configmod.load(None, {"endpoint": f"ipc://{tmp_path}/{name}.sock", "state_dir": str(state),
                                     "cgroup_mode": "off", "policy": "even"}, environ={})

    first = Agent(cfg("first"))
    try:
        first._write_journal(force=True)
        (state / "cgroup-originals.json").write_text("{torn")
        before = sorted(os.listdir(state))
        with pytest.raises(CannotStart) as e:
            Agent(cfg("second"))
        assert str(state) in str(e.value) and "another agent" in str(e.value)
        assert f"pid {os.getpid()}" in str(e.value)
        assert sorted(os.listdir(state)) == before          # nothing set aside, nothing written
        assert json.loads((state / "journal.json").read_text())["agent_pid"] == os.getpid()
    finally:
        first.server.close()
        first.ctx.term()
        first.unlock_state_dir()
    again = Agent(cfg("again"))
    again.server.close()
    again.ctx.term()
    again.unlock_state_dir()


def test_the_auto_memory_budget_is_computed_over_the_jobs_processes(tmp_path, monkeypatch):
    """The "auto" loader memory budget is told the jobs' training processes and workers at each refresh
    (``auto_loader_memory`` takes the agent's own limit only where it binds them)."""
    import os

    from agent.daemon import Agent
    from agent.registry import Job, Rank

    asked = []
    monkeypatch.setattr(configmod, "auto_loader_memory", lambda loader_pids=(): asked.append(loader_pids) or 8 << 30)
    cfg = configmod.load(None, {"endpoint": f"ipc://{tmp_path}/agent.sock", "state_dir": str(tmp_path / "state"),
                                "cgroup_mode": "off", "policy": "even", "loader_memory": "auto"}, environ={})
    agent = Agent(cfg)
    try:
        agent.registry.jobs["j"] = Job(job="j", uid=os.getuid(), arrived_at=0.0, source="hello", ranks={
            0: Rank(job="j", rank=0, pid=os.getpid(), uid=os.getuid(), identity=b"r0", start_ticks=None,
                    last_seen=0.0, connected_at=0.0, worker_pids=(4243, 4244))})
        agent._node_read_at = None
        agent._refresh_node_resources(1.0)
        assert sorted(asked[-1]) == sorted((os.getpid(), 4243, 4244))
    finally:
        agent.server.close()
        agent.ctx.term()
        agent.unlock_state_dir()
