"""`adloader job register|release`: parsing the Slurm environment (unit) and talking to an agent that is
down, hung, answering or refusing (component: real ZeroMQ sockets, the real command in a subprocess).

The wall-time bounds below are loose on purpose: finishing in seconds whatever the agent does is a
correctness property of the Slurm prolog (a hung prolog drains the node), not a speed figure.
"""
from __future__ import annotations

import socket
import subprocess

import pytest

from adloader import protocol
from agent.commands.job import JobSpecError, cpus_per_node_runs, parse_cpus_per_node, parse_gpus, slurm_job
from tests.conftest import adloader_cmd, repo_env
from tests.slurm_support import SLURM_ENV, one_line, run_job

BOUND_S = 10.0  # "returns within a few seconds", loosely, on a noisy shared machine


# --- unit: the Slurm environment ------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize(
    "value, counts",
    [("4", [4]), ("2(x3)", [2, 2, 2]), ("4,2", [4, 2]), ("2(x3),1", [2, 2, 2, 1]), (" 8 ", [8]), ("1(x1)", [1])],
)
def test_cpus_per_node_expands_slurm_compression(value, counts):
    assert parse_cpus_per_node(value) == counts


@pytest.mark.unit
@pytest.mark.parametrize("value", ["", "x", "4(x)", "4(3)", "-1", "0", "2(x0)", "4,,2", "4;2", "2(x3"])
def test_cpus_per_node_refuses_malformed_values(value):
    with pytest.raises(JobSpecError, match="SLURM_JOB_CPUS_PER_NODE"):
        parse_cpus_per_node(value)


@pytest.mark.unit
def test_a_huge_repeat_count_is_not_expanded_and_huge_counts_are_refused():
    # (before: "2(x100000000)" became a list of 10^8 ints, ~800 MB in a prolog, and a repeat of 10^11 a
    # MemoryError traceback with exit 1 under --slurm; 5,000 digits: ValueError from int(), a traceback)
    env = {"SLURM_JOB_ID": "77", "SLURM_JOB_UID": "1000", "SLURM_JOB_CPUS_PER_NODE": "2(x100000000),4",
           "SLURM_NODEID": "100000000"}
    assert slurm_job(env).cpus == 4
    assert slurm_job(dict(env, SLURM_NODEID="3")).cpus == 2
    spec = slurm_job(dict(env, SLURM_NODEID="100000001"))
    assert spec.cpus is None and "'100000001' is not one of their 100000001 nodes" in spec.note
    for value in ("99999999999999999999(x99999999999)", "9" * 5000, "2(x" + "9" * 5000 + ")"):
        with pytest.raises(JobSpecError, match="SLURM_JOB_CPUS_PER_NODE"):
            cpus_per_node_runs(value)
        spec = slurm_job(dict(env, SLURM_JOB_CPUS_PER_NODE=value))    # registered all the same, no CPU count
        assert spec.cpus is None and "cpus left to the agent: SLURM_JOB_CPUS_PER_NODE" in spec.note


@pytest.mark.component
def test_an_unusable_cpu_count_still_exits_0_under_slurm_and_registers_without_it(fake_agent):
    # (before: "not sent: bad variable: SLURM_JOB_CPUS_PER_NODE", and the job went unregistered)
    agent = fake_agent()
    for value in ("2(x99999999999)", "4(x)", "2(x3),bad", ""):
        env = dict(SLURM_ENV, SLURM_JOB_CPUS_PER_NODE=value)
        rc, err, _ = run_job("register", "--slurm", endpoint=agent.endpoint, env=env)
        line = one_line(err)
        assert rc == 0 and "cpus ?: ok" in line and "cpus left to the agent: SLURM_JOB_CPUS_PER_NODE" in line, line
        assert (value and repr(value) in line) or "SLURM_JOB_CPUS_PER_NODE is empty" in line, line
    assert [(m["type"], m["cpus"]) for m in agent.messages] == [("register", None)] * 4


@pytest.mark.unit
@pytest.mark.parametrize(
    "value, gpus", [("0,1", ["0", "1"]), ("", []), ("NoDevFiles", []), ("-1", []), ("GPU-ab12, GPU-cd34", ["GPU-ab12", "GPU-cd34"])]
)
def test_gpus_parse(value, gpus):
    assert parse_gpus(value) == gpus


@pytest.mark.unit
def test_slurm_job_reads_this_nodes_cpu_count():
    env = {"SLURM_JOB_ID": "77", "SLURM_JOB_UID": "1000", "SLURM_JOB_GPUS": "2,3", "SLURM_JOB_CPUS_PER_NODE": "8(x2)"}
    spec = slurm_job(env)
    assert (spec.job, spec.uid, spec.gpus, spec.cpus, spec.note) == ("77", 1000, ["2", "3"], 8, "")
    assert slurm_job({**env, "SLURM_JOB_CPUS_PER_NODE": "4,2", "SLURM_NODEID": "1"}).cpus == 2
    uneven = slurm_job({**env, "SLURM_JOB_CPUS_PER_NODE": "4,2"})
    assert uneven.cpus is None and "differ" in uneven.note
    assert slurm_job({**env, "SLURM_JOB_CPUS_PER_NODE": ""}).cpus is None


@pytest.mark.unit
@pytest.mark.parametrize(
    "env, why",
    [
        ({}, "SLURM_JOB_ID is not set"),
        ({"SLURM_JOB_ID": "12a", "SLURM_JOB_UID": "1"}, "not a job number"),
        ({"SLURM_JOB_ID": "12"}, "SLURM_JOB_UID is not set"),
        ({"SLURM_JOB_ID": "12", "SLURM_JOB_UID": "bob"}, "not a numeric uid"),
        ({"SLURM_JOB_ID": "12", "SLURM_JOB_UID": "-5"}, "negative"),
    ],
)
def test_slurm_job_names_the_bad_variable(env, why):
    with pytest.raises(JobSpecError, match=why):
        slurm_job(env)


@pytest.mark.unit
@pytest.mark.parametrize("value, why", [("lots", "cannot parse 'lots'"), ("2(x3),bad", "cannot parse 'bad'"),
                                        ("", "SLURM_JOB_CPUS_PER_NODE is empty"), (" ", "is empty")])
def test_a_malformed_or_empty_cpu_count_is_left_out_and_named(value, why):
    """The job is registered without its CPU count and the note names the variable and its fault."""
    spec = slurm_job({"SLURM_JOB_ID": "12", "SLURM_JOB_UID": "5", "SLURM_JOB_GPUS": "0",
                      "SLURM_JOB_CPUS_PER_NODE": value})
    assert (spec.job, spec.uid, spec.gpus, spec.cpus) == ("12", 5, ["0"], None)
    assert spec.note.startswith("cpus left to the agent: ") and "SLURM_JOB_CPUS_PER_NODE" in spec.note and why in spec.note
    assert slurm_job({"SLURM_JOB_ID": "12", "SLURM_JOB_UID": "5"}).note == ""    # not set: nothing to say


@pytest.mark.unit
def test_a_heterogeneous_component_keeps_its_own_id_and_names_the_leader():
    env = {"SLURM_JOB_ID": "4243", "SLURM_JOB_UID": "5", "SLURM_HET_JOB_ID": "4242", "SLURM_JOB_CPUS_PER_NODE": "2"}
    for need in (True, False):
        spec = slurm_job(env, need_resources=need)
        assert spec.job == "4243" and "leader 4242" in spec.note and "attach as job 4242" in spec.note
    assert slurm_job(dict(env, SLURM_JOB_ID="4242")).note == ""


@pytest.mark.unit
def test_release_needs_only_id_and_uid():
    spec = slurm_job({"SLURM_JOB_ID": "9", "SLURM_JOB_UID": "0", "SLURM_JOB_CPUS_PER_NODE": "garbage"}, need_resources=False)
    assert (spec.job, spec.uid) == ("9", 0)


# --- component: agents that answer, refuse, hang or are absent --------------------------------------


@pytest.mark.component
def test_register_sends_the_slurm_job_and_gets_ok(fake_agent):
    agent = fake_agent()
    rc, err, _ = run_job("register", "--slurm", endpoint=agent.endpoint, env=SLURM_ENV)
    assert rc == 0 and one_line(err).endswith(": ok")
    msg = agent.messages[-1]
    assert msg["type"] == "register" and msg["v"] == protocol.VERSION
    assert (msg["job"], msg["uid"], msg["gpus"], msg["cpus"], msg["pids"], msg["source"]) == (
        "4242", 1000, ["0", "1"], 6, [], "slurm")


@pytest.mark.component
def test_cli_register_then_release(fake_agent):
    agent = fake_agent()
    rc, err, _ = run_job("register", "--job", "j1", "--uid", "7", "--gpus", "3", "--cpus", "2", endpoint=agent.endpoint)
    assert rc == 0, err
    assert (agent.messages[-1]["uid"], agent.messages[-1]["gpus"], agent.messages[-1]["cpus"], agent.messages[-1]["source"]) == (
        7, ["3"], 2, "cli")
    rc, err, _ = run_job("release", "--job", "j1", "--uid", "7", endpoint=agent.endpoint)
    assert rc == 0 and "ok" in one_line(err)
    assert agent.messages[-1] == protocol.make("release", job="j1", uid=7)


@pytest.mark.component
def test_double_register_is_harmless(fake_agent):
    agent = fake_agent()
    for _ in range(2):
        rc, err, wall_s = run_job("register", "--slurm", endpoint=agent.endpoint, env=SLURM_ENV)
        assert rc == 0 and wall_s < BOUND_S
    assert "already registered" in one_line(err)
    assert [m["type"] for m in agent.messages] == ["register", "register"]


@pytest.mark.component
@pytest.mark.parametrize("slurm", [True, False])
def test_release_of_unknown_job_counts_as_done(fake_agent, slurm):
    agent = fake_agent()
    args = ("release", "--slurm") if slurm else ("release", "--job", "4242", "--uid", "1000")
    rc, err, wall_s = run_job(*args, endpoint=agent.endpoint, env=SLURM_ENV)
    assert rc == 0 and wall_s < BOUND_S
    assert "already released" in one_line(err)


@pytest.mark.component
@pytest.mark.parametrize("slurm, want_rc", [(True, 0), (False, 1)])
def test_agent_down_no_socket(tmp_path, slurm, want_rc):
    args = ("register", "--slurm") if slurm else ("register", "--job", "4242")
    rc, err, wall_s = run_job(*args, endpoint=f"ipc://{tmp_path}/absent.sock", env=SLURM_ENV)
    assert rc == want_rc and wall_s < BOUND_S
    line = one_line(err)
    assert "agent down" in line and "no socket" in line and "absent.sock" in line


@pytest.mark.component
@pytest.mark.parametrize("slurm", [True, False])
def test_a_gpu_id_with_a_newline_or_an_escape_keeps_the_log_line_one_line(tmp_path, slurm):
    """Before: the log line printed the GPU ids as given, so ``SLURM_JOB_GPUS=$'0\\n1'`` (or ``--gpus``)
    split the prolog's one line in two, and an escape sequence went to the terminal or the log as is."""
    env = dict(SLURM_ENV, SLURM_JOB_GPUS="0\n1,2\x1b[2J")
    args = ("register", "--slurm") if slurm else ("register", "--job", "4242", "--gpus", "0\n1,2\x1b[2J")
    rc, err, _ = run_job(*args, endpoint=f"ipc://{tmp_path}/absent.sock", env=env)
    line = one_line(err)
    assert rc == (0 if slurm else 1) and "gpus [0\\n1,2\\x1b[2J]" in line and "\x1b" not in line, line


@pytest.mark.component
def test_agent_down_stale_socket_file(tmp_path):
    """The agent crashed and left its socket file: nobody listens behind it."""
    path = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()
    assert path.exists()
    rc, err, wall_s = run_job("register", "--slurm", "--timeout-s", "1", endpoint=f"ipc://{path}", env=SLURM_ENV)
    assert rc == 0 and wall_s < BOUND_S
    assert "agent down" in one_line(err)


@pytest.mark.component
def test_a_listener_that_never_handshakes_is_a_timeout_not_down(tmp_path):
    """A stopped (SIGSTOP) or hung agent: the kernel still queues connections on its socket, but no
    ZeroMQ handshake ever completes. That is "timeout ... hung", not "agent down" (issue 13)."""
    path = tmp_path / "hung.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.listen(64)
    try:
        rc, err, wall_s = run_job("register", "--slurm", "--timeout-s", "1", endpoint=f"ipc://{path}", env=SLURM_ENV)
    finally:
        s.close()
    assert rc == 0 and wall_s < BOUND_S
    line = one_line(err)
    assert "timeout" in line and "accepts connections but did not answer" in line and "agent down" not in line


@pytest.mark.component
@pytest.mark.parametrize("slurm, want_rc", [(True, 0), (False, 1)])
def test_agent_hung_never_answers(fake_agent, slurm, want_rc):
    agent = fake_agent("hang")
    args = ("register", "--slurm") if slurm else ("register", "--job", "4242")
    rc, err, wall_s = run_job(*args, "--timeout-s", "1", endpoint=agent.endpoint, env=SLURM_ENV)
    assert rc == want_rc and wall_s < BOUND_S
    assert "timeout" in one_line(err) and "did not answer register" in err
    assert agent.messages and agent.messages[0]["job"] == "4242"  # it was sent; the agent just sat on it


@pytest.mark.component
@pytest.mark.parametrize("slurm, want_rc", [(True, 0), (False, 1)])
def test_error_reply_is_reported(fake_agent, slurm, want_rc):
    agent = fake_agent("refuse")
    args = ("register", "--slurm") if slurm else ("register", "--job", "4242", "--uid", "1000")
    rc, err, _ = run_job(*args, endpoint=agent.endpoint, env=SLURM_ENV)
    assert rc == want_rc
    assert "agent refused register: not_permitted" in one_line(err)


@pytest.mark.component
@pytest.mark.parametrize(
    "env, why",
    [
        ({"SLURM_JOB_ID": "", "SLURM_JOB_UID": "1000"}, "SLURM_JOB_ID is not set"),
        ({"SLURM_JOB_ID": "4242", "SLURM_JOB_UID": "nobody"}, "SLURM_JOB_UID='nobody'"),
    ],
)
def test_bad_slurm_variable_exits_0_and_sends_nothing(fake_agent, env, why):
    agent = fake_agent()
    rc, err, wall_s = run_job("register", "--slurm", endpoint=agent.endpoint, env={**SLURM_ENV, **env})
    assert rc == 0 and wall_s < BOUND_S
    line = one_line(err)
    assert "bad variable" in line and why in line
    assert agent.messages == []


@pytest.mark.component
def test_cli_usage_errors_exit_2(tmp_path):
    ep = f"ipc://{tmp_path}/x.sock"
    rc, err, _ = run_job("register", endpoint=ep)
    assert rc == 2 and "--job is required" in one_line(err)
    rc, err, _ = run_job("register", "--job", "1", "--cpus", "0", endpoint=ep)
    assert rc == 2 and "not sent: bad --cpus value: 0 " in one_line(err)
    rc, err, _ = run_job("register", "--job", "1", "--uid", "-1", endpoint=ep)
    assert rc == 2 and "not sent: bad --uid value: -1 " in one_line(err)
    rc, err, _ = run_job("register", "--job", "1", "--timeout-s", "0", endpoint=ep)
    assert rc == 2 and "not sent: bad --timeout-s value: 0 " in one_line(err)


@pytest.mark.component
@pytest.mark.parametrize("slurm", [False, True])
def test_a_timeout_that_is_not_a_finite_number_of_seconds_is_refused(fake_agent, slurm):
    # (before: --timeout-s inf passed the "> 0" check and failed as "internal error: OverflowError")
    agent = fake_agent()
    how = ("--slurm",) if slurm else ("--job", "1")
    for bad in ("inf", "nan", "-1"):
        rc, err, _ = run_job("register", *how, "--timeout-s", bad, endpoint=agent.endpoint, env=SLURM_ENV)
        line = one_line(err)
        assert rc == (0 if slurm else 2) and f"not sent: bad --timeout-s value: {bad}" in line, line
        assert "internal" not in line and "variable" not in line, line
    assert agent.messages == []


@pytest.mark.component
def test_a_long_timeout_is_waited_out_by_the_deadline_not_an_overflow(fake_agent):
    # (before: 1e12 s overflowed ZMQ_SNDTIMEO, a C int: "internal error: OverflowError")
    agent = fake_agent()
    rc, err, _ = run_job("register", "--job", "1", "--timeout-s", "1e12", endpoint=agent.endpoint)
    assert rc == 0 and one_line(err).endswith(": ok"), err


@pytest.mark.component
@pytest.mark.parametrize("bad, why", [("carrier-pigeon://x", "must start with ipc:// or tcp://"),
                                      ("ipc://", "needs the socket's path"),
                                      ("ipc://rel/agent.sock", "must be absolute"),
                                      ("", "must start with ipc:// or tcp://")])
def test_a_malformed_endpoint_is_a_bad_argument_naming_the_value(bad, why):
    """Checked as the agent checks its own (``agent.config.endpoint_problem``), before anything is sent:
    exit 2 without --slurm, 0 with it, one line naming --endpoint and the value. (Before: exit 1 with
    libzmq's "Protocol not supported", or "agent down: no socket at " for 'ipc://' and a relative path
    taken as the agent being down.)"""
    for how, want_rc in ((("--job", "1"), 2), (("--slurm",), 0)):
        rc, err, _ = run_job("register", *how, endpoint=bad, env=SLURM_ENV)
        line = one_line(err)
        assert rc == want_rc and f"not sent: bad --endpoint value: {bad!r}: " in line and why in line, line


@pytest.mark.component
def test_a_malformed_job_id_is_a_bad_argument_and_not_sent(tmp_path):
    """A --job the agent would refuse (``protocol.check_job_id``) is a bad argument: exit 2 (0 with
    --slurm), named in the line, nothing sent. Before, it went to the agent and came back refused
    (exit 1, "agent refused register: malformed"); without an agent it read as "agent down"."""
    absent = f"ipc://{tmp_path}/agent.sock"     # nothing listens: a sent request would say "agent down"
    for verb in ("register", "release"):
        for how, want_rc in ((("--job", "bad/id"), 2), (("--slurm", "--job", "../x"), 0)):
            rc, err, _ = run_job(verb, *how, endpoint=absent, env=SLURM_ENV)
            line = one_line(err)
            assert rc == want_rc and f"not sent: bad --job value: job id {how[-1]!r}" in line, line
            assert "agent down" not in line, line
    # with --slurm and no --job the id is SLURM_JOB_ID's, named as the variable (before: "--job: ...")
    rc, err, _ = run_job("register", "--slurm", endpoint=absent, env={**SLURM_ENV, "SLURM_JOB_ID": "9" * 129})
    line = one_line(err)
    assert rc == 0 and "not sent: bad variable: SLURM_JOB_ID: a job id must be 1 to 128 characters" in line, line


@pytest.mark.component
def test_a_malformed_adloader_endpoint_is_a_bad_variable_naming_it():
    """ADLOADER_ENDPOINT is checked as --endpoint is, by job and status, before anything is sent (as the
    training-side client refuses it). Before: 'ipc://' was taken as the agent being down ("no socket
    at "), 'bogus' failed in libzmq ("Invalid argument"). With --slurm the prolog still exits 0."""
    for bad, why in (("ipc://", "needs the socket's path"), ("bogus", "must start with ipc:// or tcp://")):
        env = repo_env(ADLOADER_ENDPOINT=bad, **SLURM_ENV)
        for how, want_rc in ((("--job", "1"), 2), (("--slurm",), 0)):
            p = subprocess.run(adloader_cmd("job", "register", *how, "--timeout-s", "1"), env=env,
                               capture_output=True, text=True, timeout=60)
            line = one_line(p.stderr)
            assert p.returncode == want_rc and p.stdout == "", (p.returncode, p.stdout)
            assert f"not sent: bad variable: ADLOADER_ENDPOINT {bad!r}: " in line and why in line, line
        p = subprocess.run(adloader_cmd("status", "--timeout-s", "1"), env=repo_env(ADLOADER_ENDPOINT=bad),
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 2 and f"ADLOADER_ENDPOINT {bad!r}: " in one_line(p.stderr) and why in p.stderr, p.stderr
    # --endpoint wins over the variable: a good flag is used whatever the variable holds
    rc, err, _ = run_job("register", "--job", "1", "--timeout-s", "1", endpoint="ipc:///nonexistent/agent.sock",
                         env={"ADLOADER_ENDPOINT": "bogus"})
    assert rc == 1 and "bad variable" not in err, err


@pytest.mark.unit
@pytest.mark.parametrize("as_json", [False, True])
def test_status_names_a_broken_agent_config_also_when_it_succeeds(tmp_path, monkeypatch, capsys, as_json):
    """A misspelt key in the agent's config file is named by `adloader status` on stderr also when the
    agent answered on the default endpoint (before, the note was printed only on failure); stdout stays
    the table or the JSON document alone."""
    import argparse
    import json

    from agent import config, status
    from agent.commands import status as status_command
    from tests.fakes import status_doc

    cfg = tmp_path / "agent.toml"
    cfg.write_text('endpiont = "ipc:///srv/adl/agent.sock"\n')
    monkeypatch.setattr(config, "DEFAULT_CONFIG_PATH", str(cfg))
    monkeypatch.delenv("ADLOADER_ENDPOINT", raising=False)
    asked = []
    monkeypatch.setattr(status, "query", lambda endpoint, timeout_s: asked.append(endpoint) or status_doc())
    rc = status_command.run(argparse.Namespace(endpoint=None, json=as_json, timeout_s=1.0))
    out, err = capsys.readouterr()
    assert rc == 0 and len(asked) == 1
    assert "'endpiont' (did you mean 'endpoint'?)" in one_line(err) and str(cfg) in err and "adloader status" in err
    if as_json:
        assert json.loads(out) == status_doc()
    else:
        assert out == status.render_table(status_doc()) + "\n"


@pytest.mark.component
def test_status_refuses_a_malformed_endpoint_naming_it():
    p = subprocess.run(adloader_cmd("status", "--endpoint", "ipc://", "--timeout-s", "1"), env=repo_env(),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--endpoint 'ipc://': " in one_line(p.stderr) and "socket's path" in p.stderr


@pytest.mark.component
def test_an_agent_not_reached_at_adloader_endpoint_says_where_the_endpoint_came_from(tmp_path):
    """`adloader job` and `adloader status` that cannot reach the agent at ADLOADER_ENDPOINT say the
    endpoint came from there (a variable set long ago, or inherited from a job's environment, is easy to
    forget; before, only the endpoint was named); with --endpoint, nothing is added."""
    env = repo_env(ADLOADER_ENDPOINT=f"ipc://{tmp_path}/absent.sock")
    for argv in (("job", "register", "--job", "4242", "--timeout-s", "1"), ("status", "--timeout-s", "1"),
                 ("job", "release", "--slurm", "--timeout-s", "1")):
        p = subprocess.run(adloader_cmd(*argv), env={**env, **SLURM_ENV}, capture_output=True, text=True, timeout=60)
        assert p.returncode == (0 if "--slurm" in argv else 1), p.stderr
        assert "absent.sock" in p.stderr and "endpoint from ADLOADER_ENDPOINT" in one_line(p.stderr), p.stderr
    rc, err, _ = run_job("register", "--job", "4242", endpoint=f"ipc://{tmp_path}/absent.sock",
                         env={"ADLOADER_ENDPOINT": "ipc:///elsewhere.sock"})
    assert rc == 1 and "ADLOADER_ENDPOINT" not in err


@pytest.mark.unit
def test_endpoint_precedence_flag_environment_config_default(tmp_path):
    """One source of truth for commands on the node: --endpoint, else ADLOADER_ENDPOINT, else the agent
    config's endpoint key, else the default; a bad config is named and the default used."""
    from adloader import env
    from agent.config import client_endpoint

    cfg = tmp_path / "agent.toml"
    cfg.write_text('endpoint = "ipc:///srv/from-config.sock"\n')
    e = {"ADLOADER_ENDPOINT": "ipc:///srv/from-env.sock"}
    assert client_endpoint("ipc:///srv/flag.sock", str(cfg), e) == ("ipc:///srv/flag.sock", "")
    assert client_endpoint(None, str(cfg), e) == ("ipc:///srv/from-env.sock", "")
    assert client_endpoint(None, str(cfg), {}) == ("ipc:///srv/from-config.sock", "")
    cfg.write_text('policy = "even"\n')
    assert client_endpoint(None, str(cfg), {}) == (env.endpoint({}), "")
    cfg.write_text("endpoint = 42\n")
    ep, note = client_endpoint(None, str(cfg), {})
    assert ep == env.endpoint({}) and "must be a string" in note and str(cfg) in note
    cfg.write_text("endpoint = \n")
    ep, note = client_endpoint(None, str(cfg), {})
    assert ep == env.endpoint({}) and "not valid TOML" in note
    ep, note = client_endpoint(None, str(tmp_path / "absent.toml"), {})
    assert ep == env.endpoint({}) and "no agent config" in note


@pytest.mark.unit
def test_an_ordinary_user_without_a_system_socket_gets_their_own_and_the_help_says_so(tmp_path, monkeypatch):
    """The commands' last default is the client's (``adloader.env.endpoint``): the system socket if it
    exists, else the user's own. ``job --help`` said "else ipc:///run/adloader/agent.sock" while a user
    beside their own agent was sent to theirs; it now says what ``status --help`` says."""
    import io
    from contextlib import redirect_stdout

    from adloader import env
    from agent.cli import build_parser
    from agent.commands.job import resolve_endpoint

    xdg = tmp_path / "run"
    xdg.mkdir()
    monkeypatch.setattr(env.os, "getuid", lambda: 1000)
    ep, _ = resolve_endpoint(None, str(tmp_path / "absent.toml"), {"XDG_RUNTIME_DIR": str(xdg)})
    if not (env.ipc_path(env.default_endpoint(0, {})) and
            env.os.path.exists(env.ipc_path(env.default_endpoint(0, {})))):
        assert ep == f"ipc://{xdg}/adloader/agent.sock"
    for verb in ("register", "release"):
        out = io.StringIO()
        with redirect_stdout(out), pytest.raises(SystemExit):
            build_parser("job").parse_args(["job", verb, "--help"])
        text = " ".join(out.getvalue().split())
        assert "else the system socket if it exists, else your user's" in text, text


@pytest.mark.unit
def test_a_valid_endpoint_beside_an_unknown_key_is_used_and_the_key_named(tmp_path):
    """An unknown key does not hide the file's valid endpoint from the commands (nothing the file says
    is lost; before, the whole file was refused and the default used): the endpoint is taken and the
    key named, with its "did you mean"; a misspelt endpoint key alone is named too, not silent."""
    from adloader import env
    from agent.config import client_endpoint

    cfg = tmp_path / "agent.toml"
    cfg.write_text('endpoint = "ipc:///srv/from-config.sock"\npolcy = "even"\n[agent]\ntick_s = 1\n')
    ep, note = client_endpoint(None, str(cfg), {})
    assert ep == "ipc:///srv/from-config.sock"
    assert str(cfg) in note and "'polcy' (did you mean 'policy'?)" in note and "'agent'" in note
    assert "default endpoint" not in note
    cfg.write_text('endpiont = "ipc:///srv/from-config.sock"\n')
    ep, note = client_endpoint(None, str(cfg), {})
    assert ep == env.endpoint({}) and "'endpiont' (did you mean 'endpoint'?)" in note and "default endpoint" in note
    cfg.write_text('endpoint = "http://nope"\npolcy = "even"\n')
    ep, note = client_endpoint(None, str(cfg), {})
    assert ep == env.endpoint({}) and "'polcy'" in note and "must start with ipc:// or tcp://" in note


@pytest.mark.component
def test_a_tcp_endpoint_whose_host_does_not_resolve_is_one_line_naming_the_host():
    """(before: "agent down: nobody accepts connections at tcp://nohost.invalid:5555 within 2s", after
    the whole timeout: the host was never named)"""
    ep = "tcp://nohost.invalid:5555"   # .invalid never resolves (RFC 6761)
    for argv, want_rc in ((("job", "register", "--job", "4242"), 1), (("job", "release", "--slurm"), 0),
                          (("status",), 1), (("status", "--json"), 1)):
        p = subprocess.run(adloader_cmd(*argv, "--endpoint", ep, "--timeout-s", "10"), env=repo_env(**SLURM_ENV),
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == want_rc and p.stdout == "", p.stderr
        line = one_line(p.stderr)
        assert f"cannot reach {ep}: cannot resolve host 'nohost.invalid'" in line and "Traceback" not in line, line
