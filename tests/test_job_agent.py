"""`adloader job` and the Slurm scripts against a real `adloader agent` process: the prolog registers a
job before its training starts, a training process then joins that registered job, the epilog
releases it (the agent departs it), and both are idempotent. Component tier: real processes, real
ZeroMQ; the agent runs with cgroup_mode off (no cgroup is touched)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.agentd_support import AgentProc, Trainer, short_dir
from tests.conftest import wait_for
from tests.slurm_support import EPILOG, PROLOG, log_line, one_line, run_job, run_script

pytestmark = pytest.mark.component

JOB = "31337"


@pytest.fixture
def agent():
    base = short_dir()
    a = AgentProc(base, "--cgroup-mode", "off", "--tick-s", "0.2", "--policy", "even").start()
    yield a
    a.stop()
    shutil.rmtree(base, ignore_errors=True)


def slurm_env(agent: AgentProc, **extra: str) -> dict[str, str]:
    return {"SLURM_JOB_ID": JOB, "SLURM_JOB_UID": str(os.getuid()), "SLURM_JOB_GPUS": "0,1",
            "SLURM_JOB_CPUS_PER_NODE": "2(x2)", "ADLOADER_ENDPOINT": agent.endpoint, **extra}


def test_prolog_registers_training_joins_epilog_releases(agent, adloader_bin):  # noqa: F811
    rc, _, err, _ = run_script(PROLOG, {**slurm_env(agent), "ADLOADER_BIN": adloader_bin})
    assert rc == 0 and log_line(err, "adloader-prolog").endswith(": ok"), err
    job = agent.job(JOB)
    assert job is not None and job["registered"] is True and job["source"] == "register"
    assert job["uid"] == os.getuid() and job["gpus"] == ["0", "1"] and job["ranks"] == 0
    assert agent.events("job_registered")[-1]["cpus"] == 2

    trainer = Trainer(agent.base, agent.endpoint, job=JOB, workers=2)
    try:
        joined = wait_for(lambda: (j := agent.job(JOB)) and j["ranks"] == 1 and j, 20, what="the trainer joining")
        assert joined["registered"] is True and joined["source"] == "register"  # the same job, not a new one
        assert trainer.pid in joined["pids"]

        rc, _, err, _ = run_script(EPILOG, {**slurm_env(agent), "ADLOADER_BIN": adloader_bin})
        assert rc == 0 and ": ok" in log_line(err, "adloader-epilog"), err
        wait_for(lambda: any(e["job"] == JOB and e["why"] == "released" for e in agent.events("job_departed")),
                 10, what="the agent departing the released job")
    finally:
        trainer.kill()


def test_register_and_release_are_idempotent(agent):
    env = slurm_env(agent)
    for _ in range(2):
        rc, err, _ = run_job("register", "--slurm", endpoint=agent.endpoint, env=env)
        assert rc == 0 and one_line(err).endswith(": ok"), err
    assert [j["job"] for j in agent.status()["jobs"]] == [JOB]
    rc, err, _ = run_job("release", "--job", JOB, "--uid", str(os.getuid()), endpoint=agent.endpoint)
    assert rc == 0 and "ok (released)" in one_line(err)
    rc, err, _ = run_job("release", "--job", JOB, "--uid", str(os.getuid()), endpoint=agent.endpoint)
    assert rc == 0 and "already released" in one_line(err)
    assert agent.status()["jobs"] == []


def test_release_of_a_job_the_agent_never_saw(agent):
    rc, err, _ = run_job("release", "--slurm", endpoint=agent.endpoint, env=slurm_env(agent, SLURM_JOB_ID="999"))
    assert rc == 0 and "already released" in one_line(err)


# --- registered jobs that never attach, and missed releases (issue 13) -----------------------------------
def _departed(agent: AgentProc, job: str) -> list[dict]:
    return [e for e in agent.events("job_departed") if e["job"] == job]


def test_a_registered_job_costs_nothing_until_hello_and_is_forgotten_when_its_processes_are_gone(trainers):
    """A job registered by the prolog whose training never says hello takes no share from the job that
    does; without any process it departs after unseen_job_timeout_s (the epilog's release missed); a
    registered job whose process (found by its ADLOADER_JOB_ID) still runs stays until that ends."""
    base = short_dir()
    a = AgentProc(base, "--tick-s", "0.2", "--policy", "even", env={"ADLOADER_UNSEEN_JOB_TIMEOUT_S": "1.5"}).start()
    sleeper = None
    try:
        uid = str(os.getuid())
        for job in ("gone", "quiet"):
            rc, err, _ = run_job("register", "--job", job, "--uid", uid, endpoint=a.endpoint)
            assert rc == 0, err
        sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                                   env={**os.environ, "ADLOADER_JOB_ID": "quiet"})
        trainers.append(Trainer(base, a.endpoint, job="busy", workers=2))
        loader_cpus = a.status()["agent"]["loader_cpus"]
        busy = wait_for(lambda: (j := a.job("busy")) and j["cpus"] is not None and j, 20, what="busy's allocation")
        assert busy["cpus"] == pytest.approx(loader_cpus, abs=0.01), busy   # the whole budget: nobody else counts
        quiet = a.job("quiet")
        assert quiet["ranks"] == 0 and quiet["cpus"] is None and "until one of its ranks says hello" in quiet["reason"]

        wait_for(lambda: _departed(a, "gone"), 15, what="the registered job without processes departing")
        assert "no process seen" in _departed(a, "gone")[0]["why"]
        scans = a.status()["agent"]["job_scans"]
        wait_for(lambda: a.status()["agent"]["job_scans"] >= scans + 2, 15, what="two more /proc scans")
        assert a.job("quiet") is not None and not _departed(a, "quiet")    # its process runs: kept
        sleeper.send_signal(signal.SIGKILL)
        sleeper.wait()
        wait_for(lambda: _departed(a, "quiet"), 15, what="the job departing once its process is gone")
        assert a.job("busy")["cpus"] == pytest.approx(loader_cpus, abs=0.01)
    finally:
        if sleeper is not None and sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait()
        a.stop()
        shutil.rmtree(base, ignore_errors=True)


def test_a_registration_adopted_after_a_restart_is_forgotten_when_nothing_runs():
    base = short_dir()
    env = {"ADLOADER_UNSEEN_JOB_TIMEOUT_S": "1.5"}
    a = AgentProc(base, "--tick-s", "0.2", env=env).start()
    try:
        rc, err, _ = run_job("register", "--job", "orphan", "--uid", str(os.getuid()), endpoint=a.endpoint)
        assert rc == 0, err
        wait_for(lambda: "orphan" in (Path(a.state_dir) / "journal.json").read_text(), 10, what="the journal")
        a.kill9()                                   # the agent dies before the epilog's release
        b = AgentProc(base, "--tick-s", "0.2", env=env).start()
        try:
            assert "orphan" in b.events("journal_adopted")[0]["adopted"]
            wait_for(lambda: _departed(b, "orphan"), 15, what="the adopted registration departing")
            assert b.status()["jobs"] == []
        finally:
            b.stop()
    finally:
        if a.proc.poll() is None:
            a.stop()
        shutil.rmtree(base, ignore_errors=True)


def test_a_non_default_endpoint_set_only_in_the_agents_config_works_end_to_end(tmp_path, adloader_bin, trainers):  # noqa: F811
    """The agent reads its endpoint from its config file only; the installed prolog registers there, the
    TaskProlog exports it, a training process started with that environment joins the registered job,
    and the epilog releases it there (component tier: the scripts as slurmd runs them, no Slurm)."""
    from agent.commands.install_service import SLURM_SCRIPTS, slurm_script

    base = short_dir()
    config = Path(base) / "agent.toml"
    endpoint = f"ipc://{base}/elsewhere/agent.sock"
    os.makedirs(f"{base}/elsewhere")
    config.write_text(f'endpoint = "{endpoint}"\nstate_dir = "{base}/state"\ntick_s = 0.2\ncgroup_mode = "off"\n')
    a = AgentProc(base)
    a.endpoint, a.args = endpoint, ["--config", str(config)]
    a.start()
    try:
        scripts = tmp_path / "slurm"
        scripts.mkdir()
        for name in SLURM_SCRIPTS:
            (scripts / name).write_text(slurm_script(name, "/opt/adloader", config=str(config), log_file=str(tmp_path / "log")))
        env = {"SLURM_JOB_ID": JOB, "SLURM_JOB_UID": str(os.getuid()), "SLURM_JOB_CPUS_PER_NODE": "2"}
        rc, _, err, _ = run_script(scripts / "prolog.sh", {**env, "ADLOADER_BIN": adloader_bin})
        assert rc == 0 and log_line(err, "adloader-prolog").endswith(": ok"), err
        rc, out, err, _ = run_script(scripts / "taskprolog.sh", env)
        exported = dict(line[len("export "):].split("=", 1) for line in out.splitlines())
        assert rc == 0 and exported == {"ADLOADER_ENDPOINT": endpoint, "ADLOADER_JOB_ID": JOB}, (out, err)
        trainers.append(Trainer(base, exported["ADLOADER_ENDPOINT"], env=exported))
        joined = wait_for(lambda: (j := a.job(JOB)) and j["ranks"] == 1 and j, 20, what="the trainer joining")
        assert joined["registered"] is True
        rc, _, err, _ = run_script(scripts / "epilog.sh", {**env, "ADLOADER_BIN": adloader_bin})
        assert rc == 0 and ": ok" in log_line(err, "adloader-epilog"), err
        wait_for(lambda: any(e["why"] == "released" for e in _departed(a, JOB)), 10, what="the release")
    finally:
        a.stop()
        shutil.rmtree(base, ignore_errors=True)
