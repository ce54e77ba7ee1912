"""The real Slurm scripts in deploy/slurm/, run the way slurmd runs them: ``env -i`` (no inherited
environment), a PATH that finds nothing (so any program not named by absolute path fails), only the
SLURM_* variables slurmd sets, and ADLOADER_BIN pointing at this checkout's command.

Each call must exit 0, finish within a few seconds whatever the agent does, and log one line.
"""
from __future__ import annotations

import subprocess

import pytest

from tests.slurm_support import BASH, EPILOG, PROLOG, SLURM_ENV, TASKPROLOG, log_line, run_script

pytestmark = pytest.mark.component

BOUND_S = 10.0


def test_scripts_are_valid_bash_and_executable():
    for script in (PROLOG, EPILOG, TASKPROLOG):
        assert script.stat().st_mode & 0o111, f"{script} is not executable"
        subprocess.run([BASH, "-n", str(script)], check=True)


def test_install_time_variable_is_at_the_top():
    for script in (PROLOG, EPILOG):
        lines = script.read_text().splitlines()
        assigns = [i for i, l in enumerate(lines) if l.startswith("ADLOADER=")]
        assert assigns and assigns[0] < 20 and lines[assigns[0]] == "ADLOADER=/opt/adloader/venv/bin/adloader"


def test_prolog_with_agent_down(tmp_path, adloader_bin):
    env = {**SLURM_ENV, "ADLOADER_BIN": adloader_bin, "ADLOADER_ENDPOINT": f"ipc://{tmp_path}/none.sock"}
    rc, out, err, wall_s = run_script(PROLOG, env)
    assert rc == 0 and wall_s < BOUND_S
    line = log_line(err, "adloader-prolog")
    assert "job 4242" in line and "agent down" in line


def test_prolog_with_agent_hung(fake_agent, adloader_bin):  # noqa: F811
    agent = fake_agent("hang")
    rc, out, err, wall_s = run_script(PROLOG, {**SLURM_ENV, "ADLOADER_BIN": adloader_bin, "ADLOADER_ENDPOINT": agent.endpoint})
    assert rc == 0 and wall_s < BOUND_S
    assert "timeout" in log_line(err, "adloader-prolog")
    assert agent.messages[0]["type"] == "register"


def test_prolog_then_epilog_with_an_answering_agent(fake_agent, adloader_bin):  # noqa: F811
    agent = fake_agent()
    env = {**SLURM_ENV, "ADLOADER_BIN": adloader_bin, "ADLOADER_ENDPOINT": agent.endpoint}
    for script, tag in ((PROLOG, "adloader-prolog"), (PROLOG, "adloader-prolog"), (EPILOG, "adloader-epilog"), (EPILOG, "adloader-epilog")):
        rc, out, err, wall_s = run_script(script, env)
        assert rc == 0 and wall_s < BOUND_S
        assert ": ok" in log_line(err, tag)
    assert [m["type"] for m in agent.messages] == ["register", "register", "release", "release"]
    assert agent.messages[0]["cpus"] == 6 and agent.messages[0]["gpus"] == ["0", "1"]
    assert "already released" in err  # the second epilog: idempotent


def test_prolog_with_bad_variables(fake_agent, adloader_bin):  # noqa: F811
    agent = fake_agent()
    env = {"SLURM_JOB_ID": "4242", "SLURM_JOB_UID": "root?", "ADLOADER_BIN": adloader_bin, "ADLOADER_ENDPOINT": agent.endpoint}
    rc, out, err, wall_s = run_script(PROLOG, env)
    assert rc == 0 and wall_s < BOUND_S
    assert "bad variable" in log_line(err, "adloader-prolog")
    assert agent.messages == []


def test_prolog_without_adloader_installed(tmp_path):
    rc, out, err, wall_s = run_script(PROLOG, {**SLURM_ENV, "ADLOADER_BIN": str(tmp_path / "missing")})
    assert rc == 0 and wall_s < BOUND_S
    assert "not an executable" in log_line(err, "adloader-prolog")


def test_prolog_kills_a_hung_command(tmp_path):
    """The second bound: a command that hangs itself (not just the agent) is killed by `timeout`."""
    hung = tmp_path / "hung-adloader"
    hung.write_text("#!/bin/sh\nexec /bin/sleep 60\n")
    hung.chmod(0o755)
    rc, out, err, wall_s = run_script(EPILOG, {**SLURM_ENV, "ADLOADER_BIN": str(hung)})
    assert rc == 0 and wall_s < BOUND_S
    assert "killed after 5s" in log_line(err, "adloader-epilog")


def test_prolog_survives_a_crashing_command(tmp_path):
    crash = tmp_path / "crash-adloader"
    crash.write_text("#!/bin/sh\necho 'Traceback (most recent call last):' >&2\necho 'ImportError: no zmq' >&2\nexit 1\n")
    crash.chmod(0o755)
    rc, out, err, _ = run_script(PROLOG, {**SLURM_ENV, "ADLOADER_BIN": str(crash)})
    assert rc == 0
    line = log_line(err, "adloader-prolog")
    assert "exited 1" in line and "ImportError: no zmq" in line  # multi-line output folded into one line


def test_taskprolog_exports_endpoint_and_job_id():
    rc, out, err, _ = run_script(TASKPROLOG, {"SLURM_JOB_ID": "4242"})
    assert rc == 0 and err == ""
    assert out.splitlines() == ["export ADLOADER_ENDPOINT=ipc:///run/adloader/agent.sock", "export ADLOADER_JOB_ID=4242"]


def test_taskprolog_keeps_the_jobs_own_endpoint_and_respects_opt_out():
    rc, out, _, _ = run_script(TASKPROLOG, {"SLURM_JOB_ID": "7", "ADLOADER_ENDPOINT": "ipc:///tmp/mine.sock"})
    assert rc == 0 and out.splitlines() == ["export ADLOADER_JOB_ID=7"]
    rc, out, _, _ = run_script(TASKPROLOG, {"SLURM_JOB_ID": "7", "ADLOADER_DISABLE": "1"})
    assert rc == 0 and out == ""
    rc, out, _, _ = run_script(TASKPROLOG, {"SLURM_JOB_ID": "7; rm -rf /"})
    assert rc == 0 and "ADLOADER_JOB_ID" not in out
