"""Security and bad input against a real agent process: the uid check (a client running as another
uid), malformed/oversized/wrong-version frames, floods, and a fuzz run of thousands of random and
mutated frames. The agent must stay up and other jobs must be unaffected."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import zmq

from adloader import protocol
from tests.agentd_support import AgentProc, Trainer
from tests.conftest import repo_env, wait_for

pytestmark = pytest.mark.component

NOBODY = 65534

PROBE = textwrap.dedent('''
    import json, os, sys, zmq
    from adloader import protocol
    endpoint, uid, root_pid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    os.setgroups([]); os.setgid(uid); os.setuid(uid)
    ctx = zmq.Context()

    def ask(msg):
        s = ctx.socket(zmq.DEALER); s.setsockopt(zmq.LINGER, 0)
        s.connect(endpoint); s.send(protocol.encode(msg))
        r = protocol.decode(s.recv()) if s.poll(5000) else None
        s.close()
        return r

    m, me = protocol.make, os.getpid()
    out = {
        "register_root_job": ask(m("register", job="rootjob", uid=uid, pids=[])),
        "register_for_root": ask(m("register", job="x", uid=0)),
        "release_root_job": ask(m("release", job="rootjob", uid=uid)),
        "release_root_job_claiming_root": ask(m("release", job="rootjob", uid=0)),
        "hello_with_root_pid": ask(m("hello", job="mine", rank=0, pid=root_pid, uid=uid)),
        "hello_join_root_job": ask(m("hello", job="rootjob", rank=1, pid=me, uid=uid)),
        "hello_claims_uid0": ask(m("hello", job="mine2", rank=0, pid=me, uid=0)),
        "hello_root_worker_pids": ask(m("hello", job="mine3", rank=0, pid=me, uid=uid, worker_pids=[root_pid])),
        "report_without_hello": ask(m("report", job="rootjob", rank=0, pid=root_pid, stats={})),
        "register_own_with_root_pid": ask(m("register", job="nb2", uid=uid, pids=[root_pid])),
        "register_own": ask(m("register", job="nobody-job", uid=uid, pids=[me])),
        "register_own_again": ask(m("register", job="nobody-job", uid=uid, pids=[me])),
        "release_own": ask(m("release", job="nobody-job", uid=uid)),
        "release_own_again": ask(m("release", job="nobody-job", uid=uid)),
    }
    print(json.dumps(out))
''')


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a client as another uid (os.setuid)")
def test_uid_check_with_a_client_running_as_another_uid(base, trainers):
    agent = AgentProc(base, "--policy", "even", "--loader-cpus", "2", "--tick-s", "0.2").start()
    try:
        assert oct(os.stat(agent.sock_path).st_mode & 0o777) == "0o666"   # root agent: any user may connect
        root = Trainer(base, agent.endpoint, job="rootjob", workers=1)
        trainers.append(root)
        try:
            wait_for(lambda: (j := agent.job("rootjob")) and j["ranks"] == 1, 20, what="root job")
        except AssertionError:
            raise AssertionError(root.dump() + agent.log()[-3000:])
        # an ordinary user's training process may run its own job ...
        mine = Trainer(base, agent.endpoint, job="nobody-train", workers=1, user=NOBODY)
        trainers.append(mine)
        try:
            j = wait_for(lambda: (x := agent.job("nobody-train")) and x["cpus"] and x, 20, what="nobody's job")
        except AssertionError:
            raise AssertionError(mine.dump() + agent.log()[-3000:])
        assert j["uid"] == NOBODY and j["pids"] == [mine.pid]
        wait_for(lambda: mine.state().get("num_workers") == 1 and mine.state().get("directives"), 10,
                 what="directive reaches the other user's process")
        # ... but cannot join root's job
        intruder = Trainer(base, agent.endpoint, job="rootjob", workers=1, user=NOBODY,
                           env={"RANK": "1", "WORLD_SIZE": "2"})
        trainers.append(intruder)
        wait_for(lambda: "not_permitted" in (intruder.state().get("last_error") or ""), 20, what="intruder refused")
        assert "belongs to uid 0" in intruder.state()["last_error"]
        assert agent.job("rootjob")["ranks"] == 1 and agent.job("rootjob")["uid"] == 0
        # raw requests as uid 65534
        out = subprocess.run([sys.executable, "-c", PROBE, agent.endpoint, str(NOBODY), str(root.pid)],
                             env=repo_env(), capture_output=True, text=True, timeout=60, cwd=base)
        assert out.returncode == 0, out.stderr
        r = json.loads(out.stdout)
        for key in ("register_root_job", "register_for_root", "release_root_job", "release_root_job_claiming_root",
                    "hello_with_root_pid", "hello_join_root_job", "hello_claims_uid0", "hello_root_worker_pids",
                    "register_own_with_root_pid"):
            assert r[key]["type"] == "error" and r[key]["code"] == "not_permitted", (key, r[key])
        assert r["report_without_hello"]["code"] == "unknown_job"
        for key in ("register_own", "register_own_again", "release_own", "release_own_again"):
            assert r[key]["type"] == "ok", (key, r[key])
        assert "already released" in r["release_own_again"]["detail"]
        # root's job is untouched by all of that
        j = agent.job("rootjob")
        assert j["uid"] == 0 and j["ranks"] == 1 and j["pids"] == [root.pid]
        assert agent.proc.poll() is None
    finally:
        agent.stop()




def test_fuzz_and_flood_leave_the_agent_up_and_other_jobs_unaffected(base, trainers):
    agent = AgentProc(base, "--policy", "even", "--loader-cpus", "2", "--tick-s", "0.2").start()
    try:
        victim = Trainer(base, agent.endpoint, job="victim", workers=1)
        trainers.append(victim)
        wait_for(lambda: (j := agent.job("victim")) and j["samples_per_s"], 20, what="victim job reporting")
        reports_before = victim.state()["reports_sent"]
        uid = NOBODY if os.getuid() == 0 else os.getuid()   # as root: fuzz as an unprivileged attacker
        out = subprocess.run([sys.executable, "-m", "tests.agentd_fuzz", agent.endpoint, str(uid), "4"], env=repo_env(),
                             capture_output=True, text=True, timeout=120, cwd=base)
        assert out.returncode == 0, out.stderr[-3000:]
        r = json.loads(out.stdout)
        sent = r["sent"]
        assert r["limited"] is not None and r["limited"]["code"] == "rate_limited", r
        assert sent >= 1000, sent
        # the agent is up, answers, counted the bad input, and the victim is unaffected
        assert agent.proc.poll() is None, agent.log()[-3000:]
        doc = agent.status()
        errs = doc["agent"]["errors"]
        assert errs.get("malformed", 0) > 100 and errs.get("version", 0) > 0 and errs.get("unknown_type", 0) > 0
        assert errs.get("rate_limited", 0) >= 1   # (how many of the flood arrive before the fuzzer exits varies)
        v = next(j for j in doc["jobs"] if j["job"] == "victim")
        assert v["uid"] == os.getuid() and v["ranks"] == 1 and v["pids"] == [victim.pid]
        wait_for(lambda: victim.state()["reports_sent"] > reports_before + 2, 10, what="victim keeps reporting")
        assert victim.state()["connected"] and victim.state()["last_error"] is None
        # floods get one log line per identity and period, not one per message
        refused_lines = len(agent.events("request_refused")) + len(agent.events("rate_limited"))
        assert refused_lines < sent / 3, refused_lines
        assert not agent.events("message_failed"), agent.events("message_failed")[:3]
    finally:
        assert agent.stop() == 0


ROTATING_FLOOD = textwrap.dedent('''
    import json, os, sys, zmq
    from adloader import protocol
    endpoint, uid = sys.argv[1], int(sys.argv[2])
    os.setgroups([]); os.setgid(uid); os.setuid(uid)
    ctx = zmq.Context()
    hb = protocol.encode(protocol.make("heartbeat"))
    socks = []
    for i in range(80):                      # 80 identities x 60 messages: each under its own burst
        s = ctx.socket(zmq.DEALER); s.setsockopt(zmq.LINGER, 0); s.setsockopt(zmq.SNDHWM, 100000)
        s.connect(endpoint)
        socks.append(s)
    for s in socks:
        for _ in range(60):
            s.send(hb)
    why = None
    poller = zmq.Poller()
    for s in socks:
        poller.register(s, zmq.POLLIN)
    while why is None:
        ready = dict(poller.poll(10000))
        if not ready:
            break
        for s in ready:
            m = protocol.decode(s.recv())
            if m["type"] == "error" and m["code"] == "rate_limited":
                why = m["message"]
    print(json.dumps({"why": why}))
    ctx.destroy(0)
''')


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to flood as another uid (os.setuid)")
def test_rotating_identities_do_not_escape_the_per_uid_bucket(base):
    agent = AgentProc(base, "--policy", "even", "--tick-s", "0.2").start()
    try:
        out = subprocess.run([sys.executable, "-c", ROTATING_FLOOD, agent.endpoint, str(NOBODY)], env=repo_env(),
                             capture_output=True, text=True, timeout=60, cwd=base)
        assert out.returncode == 0, out.stderr
        why = json.loads(out.stdout)["why"]
        assert why is not None and f"from uid {NOBODY}" in why
        assert agent.status()["agent"]["errors"]["rate_limited"] >= 1
    finally:
        assert agent.stop() == 0
