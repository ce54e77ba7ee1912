"""Component tests: a real `adloader agent` process, real ipc sockets, real training-like processes.

Tier: component (real sockets, real processes; no root needed except the uid test, which skips
without root)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from evaluation.slurm_cluster import free_port
from tests.agentd_support import AgentProc, Trainer
from tests.conftest import adloader_cmd, repo_env, wait_for

pytestmark = pytest.mark.component


@pytest.fixture
def agent(base):
    a = AgentProc(base, "--policy", "even", "--loader-cpus", "3", "--tick-s", "0.2").start()
    yield a
    a.stop()


def test_arrival_directive_status_json_and_departure(base, agent, trainers):
    t = Trainer(base, agent.endpoint, job="job-a", workers=1, env={"FAKE_TOTAL_STEPS": "100000"})
    trainers.append(t)
    # arrival on hello; the `even` policy gives the only job all 3 loader cores -> 3 workers
    wait_for(lambda: t.state().get("num_workers") == 3, 20, what="directive applied by the client")
    st = t.state()
    assert st["connected"] and st["directives"] >= 1
    assert st["last_directive"]["workers"] == 3 and "even split" in st["last_directive"]["reason"]
    j = wait_for(lambda: (x := agent.job("job-a")) and x["samples_per_s"] and x["workers"] == 3 and x, 20,
                 what="status with rates")
    assert j["uid"] == os.getuid() and j["ranks"] == 1 and j["pids"] == [t.pid]
    assert sorted(j["worker_pids"]) == sorted(t.state()["worker_pids"])
    assert j["cpus"] == pytest.approx(3.0) and j["desired_workers"] == 3 and j["delivery"] == 1.0
    assert 0.25 < j["data_wait_frac"] < 0.35            # the fake loader waits 30% of its step time
    assert j["gpu_idle_frac"] == j["data_wait_frac"] and j["gpu_idle_source"] == "client"
    assert 100 < j["samples_per_s"] < 220                # 20 steps/s x 8 samples, smoothed
    assert j["reason"].startswith("even split")
    assert j["max_useful_workers"] is None or j["max_useful_workers"] >= 1
    assert isinstance(j["phase_changes"], int) and j["phase_changes"] >= 0    # the predictor's count, served
    # the steps the job said it has left (20 steps a second counted down from 100000), served
    assert 0 < j["steps_left"] < 100000 and j["steps_left_refused"] is False      # an honest count
    wait_for(lambda: agent.job("job-a")["steps_left"] < j["steps_left"], 10, what="steps_left counting down")
    # the CLI: table and --json
    out = subprocess.run(adloader_cmd("status", "--endpoint", agent.endpoint, "--json"), env=repo_env(),
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["version"] == 1 and doc["agent"]["policy"] == "even" and doc["agent"]["gpu_source"] == "client"
    assert [x["job"] for x in doc["jobs"]] == ["job-a"]
    applied = [e for e in agent.events("allocation_applied") if e["job"] == "job-a"]
    assert applied and applied[0]["workers"] >= 1 and applied[0]["reason"].startswith("even split")
    rt = doc["agent"]["recent_ticks"]     # where the tick's time goes, per controller phase
    assert rt["n"] >= 1 and set(rt["phases_ms_p50"]) == {"snapshot", "predict", "policy", "apply"}
    assert all(v >= 0 for v in rt["phases_ms_p50"].values()) and rt["controller_ms_p50"] <= rt["wall_ms_max"]
    table = subprocess.run(adloader_cmd("status", "--endpoint", agent.endpoint), env=repo_env(),
                           capture_output=True, text=True, timeout=30)
    assert table.returncode == 0 and "job-a" in table.stdout and "even split" in table.stdout
    # departure: the process is killed (no bye) -> noticed through psutil within a couple of ticks
    t.kill()
    wait_for(lambda: agent.job("job-a") is None, 10, what="job departure after kill")
    wait_for(lambda: any(e["job"] == "job-a" and e["why"] == "process gone" for e in agent.events("job_departed")),
             5, what="departure logged with its reason")


def test_status_shows_each_jobs_window_batch_size_or_why_it_was_not_taken(base, agent, trainers):
    """``samples_per_step`` and ``batch_size_note`` (``agent.collector``'s window batch size): a job whose
    loader counts 8 samples a step at a reported batch size of 8 shows 8 and no note; one that counts 1000
    a step at the same reported size (counters no loader of that size makes) shows null and why. Before,
    the refusal reached only the agent's debug log."""
    honest = Trainer(base, agent.endpoint, job="honest", workers=1)
    absurd = Trainer(base, agent.endpoint, job="absurd", workers=1, env={"FAKE_SAMPLES_PER_STEP": "1000"})
    trainers += [honest, absurd]
    j = wait_for(lambda: (x := agent.job("honest")) and x.get("samples_per_step") is not None and x, 20,
                 what="the honest job's window batch size in status")
    assert j["samples_per_step"] == pytest.approx(8) and j["batch_size_note"] == "", j
    j = wait_for(lambda: (x := agent.job("absurd")) and "off the reported" in x.get("batch_size_note", "") and x,
                 20, what="the absurd job's refusal in status")
    assert j["samples_per_step"] is None, j
    assert j["batch_size_note"].startswith("1000 samples a step, more than 16x off the reported batch size 8"), j
    # and through the command: --json carries both fields
    out = subprocess.run(adloader_cmd("status", "--endpoint", agent.endpoint, "--json"), env=repo_env(),
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    jobs = {x["job"]: x for x in json.loads(out.stdout)["jobs"]}
    assert jobs["honest"]["samples_per_step"] == pytest.approx(8) and jobs["honest"]["batch_size_note"] == ""
    assert jobs["absurd"]["samples_per_step"] is None
    assert "off the reported batch size 8" in jobs["absurd"]["batch_size_note"]


def test_a_two_rank_jobs_workers_are_the_jobs_and_each_rank_gets_its_part(base, agent, trainers):
    """Two training processes of one job (ranks 0 and 1): the agent counts the job's workers over both,
    and the `even` policy's 3 workers for the job's 3 cores become 4 in the plan (a multiple of its
    ranks, rounded up: a rank short of its part would pace both) and reach each rank as 2, with half
    the cores. Before, each rank was sent the job's whole count, and the job ran twice the workers its
    plan was sized for."""
    ranks = [Trainer(base, agent.endpoint, job="jm", workers=1,
                     env={"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2"}) for r in (0, 1)]
    trainers += ranks
    wait_for(lambda: (x := agent.job("jm")) and x["ranks"] == 2 and x["desired_workers"] == 4, 20,
             what="the 2-rank job planned")
    for t in ranks:
        wait_for(lambda: t.state().get("num_workers") == 2, 20, what="each rank's part applied")
        d = t.state()["last_directive"]
        assert d["workers"] == 2 and d["cpus"] == pytest.approx(1.5)
    j = wait_for(lambda: (x := agent.job("jm")) and x["workers"] == 4 and x["live_workers"] == 4 and x, 20,
                 what="the job's workers counted")
    assert j["cpus"] == pytest.approx(3.0) and len(j["worker_pids"]) == 4 and len(j["pids"]) == 2


def test_a_job_away_from_its_loader_is_planned_its_least_cores_until_it_steps_again(base, trainers):
    """The real agent (adaptive, ``release_away_s`` 2 s through its environment), a training process whose
    loop stands still from 10 s to 30 s (its loader's ``away_s`` grows, its totals stand) and a neighbour
    whose workers could use more than the node gives it: from 2 s into the stop the job is planned
    ``min_cpus`` cores with the workers it had, status says so, the neighbour is planned the room; once the
    job steps again it is planned as before and the neighbour gives the room back."""
    a = AgentProc(base, "--policy", "adaptive", "--loader-cpus", "3", "--tick-s", "0.2",
                  env={"ADLOADER_RELEASE_AWAY_S": "2"}).start()
    try:
        t = Trainer(base, a.endpoint, job="job-a", workers=2, env={"FAKE_AWAY": "10,30"})
        u = Trainer(base, a.endpoint, job="job-b", workers=2, env={"FAKE_WORKER_CORES": "2.5"})
        trainers += [t, u]
        away = wait_for(lambda: (x := a.job("job-a")) and x["cpus"] == pytest.approx(0.05) and x, 40,
                        what="job-a planned its least cores while away")
        assert away["away_s"] >= 2.0 and "away from its loader" in away["reason"]
        wait_for(lambda: a.job("job-b")["cpus"] >= 3.0 - 0.05 - 0.01, 15, what="job-b planned the room")
        applied = [e for e in a.events("allocation_applied") if e["job"] == "job-a"]
        k = next(i for i, e in enumerate(applied) if "away from its loader" in e["reason"])
        assert k > 0 and applied[k]["workers"] == applied[k - 1]["workers"]       # its workers kept
        back = wait_for(lambda: (x := a.job("job-a")) and x["cpus"] > 0.05 + 0.01 and x, 30,
                        what="job-a planned again once it steps")
        assert back["away_s"] < 2.0 and "away" not in back["reason"]
        wait_for(lambda: a.job("job-b")["cpus"] < 3.0 - 0.05 - 0.01, 15, what="job-b giving the room back")
    finally:
        a.stop()


def test_a_job_away_whose_process_still_runs_keeps_its_plan(base, trainers):
    """The same stop, but the job's process runs through it (a validation pass: a thread that burns CPU).
    Its client counts that CPU as the job's (``job_cpu_cores``, ``away_cpu_cores`` in status), and the job is
    not planned as away: it keeps its plan, and its neighbour is lent nothing."""
    a = AgentProc(base, "--policy", "adaptive", "--loader-cpus", "3", "--tick-s", "0.2",
                  env={"ADLOADER_RELEASE_AWAY_S": "2"}).start()
    try:
        t = Trainer(base, a.endpoint, job="job-a", workers=2, env={"FAKE_AWAY": "10,30", "FAKE_AWAY_BURN": "1"})
        u = Trainer(base, a.endpoint, job="job-b", workers=2, env={"FAKE_WORKER_CORES": "2.5"})
        trainers += [t, u]
        running = wait_for(lambda: (x := a.job("job-a")) and (x["away_s"] or 0) >= 6.0 and x, 40,
                           what="job-a 6 s into its stop")
        assert running["away_cpu_cores"] is not None and running["away_cpu_cores"] >= 0.1, running
        assert "away from its loader" not in running["reason"] and running["cpus"] > 0.05 + 0.01, running
        wait_for(lambda: (a.job("job-a")["away_s"] or 0) < 2.0, 40, what="job-a stepping again")
        assert not [e for e in a.events("allocation_applied")
                    if e["job"] == "job-a" and "away from its loader" in e["reason"]]
    finally:
        a.stop()


def test_two_jobs_share_and_bye_hands_share_back(base, agent, trainers):
    a = Trainer(base, agent.endpoint, job="ja", workers=1, run_s=4)
    b = Trainer(base, agent.endpoint, job="jb", workers=1)
    trainers += [a, b]
    wait_for(lambda: (x := agent.job("ja")) and (y := agent.job("jb")) and x["cpus"] and y["cpus"], 20,
             what="both jobs allocated")
    assert agent.job("ja")["cpus"] == pytest.approx(1.5)
    # `a` finishes normally: loader.close() -> detach -> bye
    wait_for(lambda: a.proc.poll() is not None, 20, what="trainer a exits")
    assert a.proc.returncode == 0, a.output()
    wait_for(lambda: agent.job("ja") is None, 10, what="ja departs")
    wait_for(lambda: any(e["job"] == "ja" and e["why"] == "bye" for e in agent.events("job_departed")), 5,
             what="departure logged with its reason")
    wait_for(lambda: b.state().get("num_workers") == 3, 10, what="jb gets the whole node back")


def test_agent_kill9_restart_readopts_live_and_forgets_dead(base, trainers):
    agent = AgentProc(base, "--policy", "even", "--loader-cpus", "2", "--tick-s", "0.2").start()
    try:
        live = Trainer(base, agent.endpoint, job="live", workers=1)
        dead = Trainer(base, agent.endpoint, job="dead", workers=1)
        trainers += [live, dead]
        wait_for(lambda: (x := agent.job("live")) and (y := agent.job("dead")) and x["cpus"] and y["cpus"], 20,
                 what="two jobs allocated")
        welcomes = live.state()["welcomes"]
        agent.kill9()
        dead.kill()
        assert os.path.exists(f"{agent.state_dir}/journal.json")
        agent2 = AgentProc(base, "--policy", "even", "--loader-cpus", "2", "--tick-s", "0.2").start()
        try:
            adopted = agent2.events("journal_adopted")[0]
            assert adopted["adopted"] == ["live"] and adopted["forgotten"] == ["dead"]
            # the live client reconnects by itself and says hello again
            wait_for(lambda: live.state().get("welcomes", 0) > welcomes, 30, what="client re-hello")
            j = wait_for(lambda: agent2.job("live"), 10, what="live job in the new agent")
            assert j["ranks"] == 1 and j["pids"] == [live.pid]
            assert agent2.job("dead") is None
            wait_for(lambda: live.state().get("num_workers") == 2, 10, what="live job gets the freed share")
        finally:
            assert agent2.stop() == 0
    finally:
        if agent.proc.poll() is None:
            agent.stop()


def test_sigterm_stops_cleanly_and_sighup_reloads(base):
    cfg = f"{base}/agent.toml"
    with open(cfg, "w") as f:
        f.write('policy = "even"\ntick_s = 0.2\n')
    agent = AgentProc(base, "--config", cfg).start()
    assert agent.events("agent_started")[0]["policy"] == "even"
    a = agent.status()["agent"]
    assert a["loader_cpus_auto"] is True and a["loader_cpus"] > 0     # the default budget, "auto"
    with open(cfg, "w") as f:
        f.write('policy = "even-static"\ntick_s = 0.2\nmax_jobs = 4\nloader_cpus = 0.5\n')
    agent.proc.send_signal(signal.SIGHUP)
    ev = wait_for(lambda: agent.events("config_reloaded"), 10, what="reload")
    assert ev[0]["changed"] == ["loader_cpus", "max_jobs", "policy"]
    a = agent.status()["agent"]
    assert a["policy"] == "even-static"
    assert a["loader_cpus"] == 0.5 and a["loader_cpus_auto"] is False     # a number is used as given
    assert agent.stop(signal.SIGTERM) == 0
    assert agent.events("agent_stopped")
    assert not os.path.exists(agent.sock_path)


def test_sd_notify_ready_and_watchdog_on_abstract_socket(base):
    name = f"adl-notify-{os.getpid()}-{time.monotonic_ns()}"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind("\0" + name)
    s.settimeout(20)
    try:
        agent = AgentProc(base, "--policy", "even", env={"NOTIFY_SOCKET": "@" + name, "WATCHDOG_USEC": "400000"})
        agent.start(wait=False)
        got = []
        while not (any(m.startswith(b"READY=1") for m in got) and b"WATCHDOG=1" in got):
            got.append(s.recv(4096))
        assert agent.stop() == 0
        s.settimeout(0.5)
        after = []
        try:
            while True:
                after.append(s.recv(4096))
        except socket.timeout:
            pass
        assert b"STOPPING=1" in after
    finally:
        s.close()


def test_explicit_missing_config_and_unknown_key_are_errors(base):
    missing = subprocess.run(adloader_cmd("agent", "--config", f"{base}/nope.toml"), env=repo_env(),
                             capture_output=True, text=True, timeout=30)
    assert missing.returncode == 2 and "nope.toml" in missing.stderr
    cfg = f"{base}/bad.toml"
    with open(cfg, "w") as f:
        f.write('tick_s = 1\ntick_seconds = 2\n')
    bad = subprocess.run(adloader_cmd("agent", "--config", cfg), env=repo_env(), capture_output=True, text=True,
                         timeout=30)
    assert bad.returncode == 2 and "'tick_seconds'" in bad.stderr


def test_second_agent_on_same_endpoint_refuses(base, agent):
    other = subprocess.run(adloader_cmd("agent", "--endpoint", agent.endpoint, "--state-dir", f"{base}/s2",
                                        "--policy", "even"), env=repo_env(), capture_output=True, text=True,
                           timeout=30)
    assert other.returncode == 1 and "another agent" in other.stderr
    assert agent.status()["agent"]["pid"] == agent.proc.pid   # the first one still serves
    sock = agent.endpoint[len("ipc://"):]                     # its socket and lock are not the refused start's
    assert os.path.exists(sock) and os.path.exists(sock + ".lock")


@pytest.mark.parametrize("what", ["directory", "tcp"])
def test_an_endpoint_that_cannot_be_bound_is_one_error_line_and_the_agent_exits(base, what):
    # (before: a traceback from Socket.bind, then the process hung for ever in the context's term(),
    # the ROUTER socket left open; under systemd a start that never fails)
    if what == "directory":
        os.mkdir(f"{base}/agent.sock")
        endpoint = f"ipc://{base}/agent.sock"
    else:
        endpoint = "tcp://no-such-interface:5555"   # (a well-formed endpoint: refused by the bind only)
    out = subprocess.run(adloader_cmd("agent", "--endpoint", endpoint, "--state-dir", f"{base}/state",
                                      "--cgroup-mode", "off"), env=repo_env(), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr and f"cannot bind {endpoint}" in out.stderr, out.stderr
    if what == "directory":   # (before: the refused start left agent.sock.lock beside the directory)
        assert "exists and is not a socket (a directory)" in out.stderr, out.stderr
        assert not os.path.exists(f"{base}/agent.sock.lock")


def test_a_file_at_the_socket_path_is_refused_and_kept(base):
    # libzmq unlinks whatever is at an ipc:// path before it binds: an endpoint set to an existing
    # file deleted that file (before: the agent started, and the file was gone)
    victim = f"{base}/notes.txt"
    with open(victim, "w") as f:
        f.write("keep me\n")
    before = os.listdir(base)
    out = subprocess.run(adloader_cmd("agent", "--endpoint", f"ipc://{victim}", "--state-dir", f"{base}/state",
                                      "--cgroup-mode", "off"), env=repo_env(), capture_output=True, text=True,
                         timeout=20)
    assert out.returncode == 1 and "exists and is not a socket" in out.stderr, out.stderr
    with open(victim) as f:
        assert f.read() == "keep me\n"
    # (before: the refused start left notes.txt.lock beside it, and the empty state directory)
    assert [f for f in os.listdir(base) if f not in before] == []


@pytest.mark.parametrize("refusal", ["unknown_key", "cgroup_root", "endpoint"])
def test_a_refused_start_removes_the_state_dir_it_made_and_keeps_one_that_existed(base, refusal):
    # each refusal at a different point: the config read, building the actuators (Agent()), binding (start())
    # (before: the refused start left the empty state directory, and the levels above it, behind)
    os.mkdir(f"{base}/nocgroup")
    cfg, endpoint = f"{base}/agent.toml", f"ipc://{base}/agent.sock"
    with open(cfg, "w") as f:
        f.write(f'cgroup_root = "{base}/nocgroup"\n' + ("tick_seconds = 2\n" if refusal == "unknown_key" else ""))
    if refusal == "endpoint":
        os.mkdir(f"{base}/agent.sock")
    mode = "v2" if refusal == "cgroup_root" else "off"
    os.mkdir(f"{base}/kept")
    for state_dir in (f"{base}/new/deeper/state", f"{base}/kept"):
        out = subprocess.run(adloader_cmd("agent", "--config", cfg, "--endpoint", endpoint, "--state-dir", state_dir,
                                          "--cgroup-mode", mode), env=repo_env(), capture_output=True, text=True,
                             timeout=60)
        assert out.returncode in (1, 2) and "Traceback" not in out.stderr, out.stderr
        assert {"unknown_key": "'tick_seconds'", "cgroup_root": "'cgroup_mode'",
                "endpoint": "is not a socket"}[refusal] in out.stderr, out.stderr
    assert not os.path.exists(f"{base}/new")               # made by the refused start: removed, every level
    assert os.path.isdir(f"{base}/kept")                    # there before: kept


def test_a_start_refused_after_the_bind_removes_the_socket_dir_it_made_and_keeps_one_that_existed(base):
    # the metrics port is taken after the ipc socket is bound: the refused start closed the socket but
    # (before) left its directory behind, with the lock file in it, and every level above it
    busy = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    os.mkdir(f"{base}/kept")
    with open(f"{base}/kept/note", "w") as f:
        f.write("keep me\n")
    try:
        for sock_dir in (f"{base}/run/deeper", f"{base}/kept"):
            out = subprocess.run(adloader_cmd("agent", "--endpoint", f"ipc://{sock_dir}/agent.sock",
                                              "--state-dir", f"{base}/state", "--cgroup-mode", "off",
                                              "--metrics-port", str(port)), env=repo_env(), capture_output=True,
                                 text=True, timeout=60)
            assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
            assert "'metrics_port'" in out.stderr, out.stderr
    finally:
        busy.close()
    assert not os.path.exists(f"{base}/run")                   # made by the refused start: removed, every level
    assert os.listdir(f"{base}/kept") == ["note"]              # there before: kept, with what it held, no lock
    assert not os.path.exists(f"{base}/state")


AS_USER = """
import os, sys
# load what the agent needs while still root (the interpreter lives under /root here, which other
# uids cannot traverse), then become the user and run `adloader agent` as that user
import agent.cli, agent.commands.agent, agent.daemon, agent.controller, agent.actuators, agent.policies
import agent.metrics, agent.status, agent.journal, predictor.bank, predictor.prior, tomllib, pynvml
import agent.cgroupfs, agent.actuators.cgroup, agent.actuators.originals
uid = int(os.environ.pop("AS_UID"))
os.setgroups([]); os.setgid(uid); os.setuid(uid)
sys.exit(agent.cli.main(sys.argv[1:]))
"""


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to start the agent as another uid")
def test_agent_as_ordinary_user_uses_its_runtime_dir(base, trainers):
    uid = 65534
    run = f"{base}/run-{uid}"
    os.makedirs(run)
    os.chown(run, uid, uid)
    os.chmod(run, 0o700)
    env = repo_env(AS_UID=str(uid), XDG_RUNTIME_DIR=run, HOME=run)
    for k in ("ADLOADER_ENDPOINT", "ADLOADER_STATE_DIR"):
        env.pop(k, None)
    log = open(f"{base}/user-agent.log", "w")
    p = subprocess.Popen([sys.executable, "-c", AS_USER, "agent", "--policy", "even", "--tick-s", "0.2"],
                         env=env, stdout=log, stderr=subprocess.STDOUT, cwd=base)
    try:
        sock = f"{run}/adloader/agent.sock"
        wait_for(lambda: os.path.exists(sock) or p.poll() is not None, 60, what="user agent socket")
        assert p.poll() is None, open(f"{base}/user-agent.log").read()
        st = os.stat(sock)
        assert st.st_uid == uid and oct(st.st_mode & 0o777) == "0o600"      # only that user may connect
        line = wait_for(lambda: next((x for x in open(f"{base}/user-agent.log") if "agent_started" in x), None), 30,
                        what="agent_started logged")
        started = json.loads(line)
        assert started["uid"] == uid and started["endpoint"] == f"ipc://{sock}"
        assert started["state_dir"] == f"{run}/adloader/state" and started["actuators"] == ["directive"], started
        # that user's training process finds the agent by itself (no ADLOADER_ENDPOINT) through
        # XDG_RUNTIME_DIR, and gets its directive
        t = Trainer(base, "", job="user-job", workers=1, user=uid,
                    env={"XDG_RUNTIME_DIR": run, "ADLOADER_ENDPOINT": ""})
        trainers.append(t)
        wait_for(lambda: t.state().get("directives", 0) >= 1, 30, what="directive to the user's trainer")
        assert t.state()["endpoint"] == f"ipc://{sock}"
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(20) == 0
        log.close()


def test_heartbeat_loss_departs_and_the_client_comes_back(base, trainers):
    agent = AgentProc(base, "--policy", "even", "--loader-cpus", "2", "--tick-s", "0.2",
                      env={"ADLOADER_HEARTBEAT_S": "0.3"}).start()
    try:
        t = Trainer(base, agent.endpoint, job="frozen", workers=1)
        trainers.append(t)
        wait_for(lambda: (j := agent.job("frozen")) and j["cpus"], 20, what="job allocated")
        welcomes = t.state()["welcomes"]
        os.kill(t.pid, signal.SIGSTOP)              # alive but silent: no reports, no bye
        try:
            wait_for(lambda: any(e["job"] == "frozen" and e["why"] == "heartbeat lost"
                                 for e in agent.events("job_departed")), 10, what="departure on heartbeat loss")
            assert agent.job("frozen") is None
        finally:
            os.kill(t.pid, signal.SIGCONT)
        # the client notices (unknown_job or silence) and says hello again: the job is back
        wait_for(lambda: t.state().get("welcomes", 0) > welcomes, 20, what="client hello again")
        wait_for(lambda: (j := agent.job("frozen")) and j["ranks"] == 1, 10, what="job back")
    finally:
        agent.stop()


def test_metrics_endpoint_serves_job_gauges(base, trainers):
    import urllib.request

    port = free_port()
    agent = AgentProc(base, "--policy", "even", "--loader-cpus", "2", "--tick-s", "0.2",
                      "--metrics-port", str(port)).start()
    try:
        t = Trainer(base, agent.endpoint, job="metered", workers=1)
        trainers.append(t)

        def scrape():
            try:
                return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            except OSError:
                return ""
        body = wait_for(lambda: (b := scrape()) and 'adloader_job_cpus{job="metered"} 2.0' in b and b, 20,
                        what="job gauges on /metrics")
        assert "adloader_jobs 1.0" in body and 'adloader_job_workers{job="metered"}' in body
    finally:
        agent.stop()


def test_a_hello_whose_rank_is_not_below_its_world_size_is_refused_naming_both(base, agent):
    """Over a real socket: rank 2 of a world of 2 (or 5 of 4) was welcomed and joined its job as one
    more rank, so the job's directive was split over a rank that cannot exist. Now refused
    ``malformed``, the reply naming the rank, the world size and the variables they come from; a
    negative rank and a world size of 0 stay refused, naming the field; rank 1 of 2 is welcomed."""
    import zmq

    from adloader import protocol

    ctx = zmq.Context()
    try:
        def hello(job: str, rank: int, world_size: int) -> dict:
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            try:
                s.connect(agent.endpoint)
                s.send(protocol.encode(protocol.make("hello", job=job, rank=rank, world_size=world_size,
                                                     pid=os.getpid(), worker_pids=[], gpus=[], batch_size=8)))
                assert s.poll(10_000), "no reply from the agent"
                return protocol.decode(s.recv())
            finally:
                s.close()

        for job, rank, ws, named in (("over", 2, 2, "rank 2 is not below world_size 2"),
                                     ("more", 5, 4, "rank 5 is not below world_size 4"),
                                     ("neg", -1, 2, "field 'rank' must be an integer >= 0, got -1"),
                                     ("zero", 0, 0, "field 'world_size' must be an integer >= 1, got 0")):
            reply = hello(job, rank, ws)
            assert reply["type"] == "error" and reply["code"] == "malformed" and reply["re"] == "hello", reply
            assert named in reply["message"], reply
            if rank >= ws >= 1:
                assert "RANK and WORLD_SIZE" in reply["message"]
        assert hello("fine", 1, 2)["type"] == "welcome"
        jobs = {j["job"] for j in agent.status()["jobs"]}
        assert "fine" in jobs and not jobs & {"over", "more", "neg", "zero"}
    finally:
        ctx.term()


def test_a_rank_that_joins_late_gets_its_share_of_the_plan_at_its_hello_and_its_peer_too(base, trainers):
    """A 2-rank job under ``adaptive`` whose rank 0 was planned alone (3 workers for 3 cores): rank 1's
    hello brings it the plan over the 2 ranks now known (2 workers, 1.5 cores), and rank 0 gets the same
    directive (one seq), before any tick re-plans. Before, rank 1 was welcomed with the plan for one
    rank (3), and the job ran 3 workers on each rank until the next tick (a tick of 5 s here; ``tick_s``
    on a node)."""
    agent = AgentProc(base, "--policy", "adaptive", "--loader-cpus", "3", "--tick-s", "5").start()
    try:
        env = [{"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2"} for r in (0, 1)]
        r0 = Trainer(base, agent.endpoint, job="late", workers=1, env=env[0])
        trainers.append(r0)
        wait_for(lambda: (r0.state().get("last_directive") or {}).get("workers") == 3, 30,
                 what="rank 0 planned alone")
        r1 = Trainer(base, agent.endpoint, job="late", workers=1, env=env[1])
        trainers.append(r1)
        st = wait_for(lambda: (s := r1.state()).get("directives", 0) >= 1 and s, 30, what="rank 1's first directive")
        first = st["last_directive"]     # the welcome's (the next tick is seconds away)
        assert first["workers"] == 2 and first["cpus"] == pytest.approx(1.5), first
        d0 = wait_for(lambda: (d := r0.state().get("last_directive") or {}).get("seq", 0) >= first["seq"] and d,
                      10, what="rank 0's new part")
        assert d0["workers"] == 2 and d0["cpus"] == pytest.approx(1.5), d0
        wait_for(lambda: r0.state().get("num_workers") == 2 and r1.state().get("num_workers") == 2, 10,
                 what="each rank runs its part")
    finally:
        agent.stop()


HOLDING_TRAINER = '''
import json, os, socket, sys, time
import agent  # a client-only process: declares itself torch-free (adloader/__init__.py)
from adloader import client, env


class Loader:
    num_workers = requested_workers = 1
    max_workers = None
    batch_size = 8

    def resize(self, n):
        self.num_workers = n

    def worker_pids(self):
        return []

    def stats(self):
        return {"steps": 0, "samples": 0, "workers": self.num_workers}


state, path = sys.argv[1], env.ipc_path(os.environ["ADLOADER_ENDPOINT"])
loader = Loader()
client.attach(loader)
while not client.state().get("connected"):
    time.sleep(0.05)
# a child that keeps every descriptor it inherits, the connection to the agent included: what a child
# forked while libzmq's I/O thread was between socket() and connect() keeps (client module docstring)
client.close_inherited_agent_connections = lambda: 0
pid = os.fork()
if pid == 0:
    held = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            with socket.socket(fileno=os.dup(int(name))) as s:
                held += s.family == socket.AF_UNIX and s.getpeername() == path
        except (OSError, ValueError):
            pass
    with open(state + ".tmp", "w") as f:
        json.dump({"child": os.getpid(), "held": held}, f)
    os.replace(state + ".tmp", state)
    while True:
        time.sleep(60)
while True:
    time.sleep(1)
'''


def test_a_child_holding_the_agent_connection_does_not_delay_the_jobs_departure(base, agent, trainers):
    """A training process's child that holds a copy of its connection to the agent (the one gap the
    at-fork hook leaves: a fork while libzmq's own I/O thread is between socket() and connect()) keeps
    that connection open at the agent for its life, but not the job: the agent departs a rank whose
    process is gone (``registry.sweep``: /proc/<pid> and its start time), whoever holds its socket. The
    training process is killed (no bye), its child lives on; the job departs within a few ticks, for
    "process gone" (not after the heartbeat timeout)."""
    script = f"{base}/holding_trainer.py"
    with open(script, "w") as f:
        f.write(HOLDING_TRAINER)
    t = Trainer(base, agent.endpoint, job="holder", script=script)
    trainers.append(t)
    child = None
    try:
        st = wait_for(lambda: t.state().get("child") and t.state(), 20, what="the child's count of held connections")
        child = st["child"]
        assert st["held"] >= 1
        wait_for(lambda: agent.job("holder"), 10, what="the job at the agent")
        t.proc.kill()              # (not t.kill(): that kills the trainer's children too)
        t.proc.wait(10)
        wait_for(lambda: agent.job("holder") is None, 10, what="the job's departure while its child lives")
        assert [e["why"] for e in agent.events("job_departed") if e["job"] == "holder"] == ["process gone"]
        with open(f"/proc/{child}/stat") as f:      # the child still runs, holding the connection
            assert f.read().rsplit(")", 1)[1].split()[0] != "Z"
    finally:
        if child is not None:
            try:
                os.kill(child, signal.SIGKILL)
            except OSError:
                pass
