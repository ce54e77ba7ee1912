"""`adloader job` and the Slurm scripts against a real `adloader agent` process: the prolog registers a
job before its training starts, a training process then joins that registered job, the epilog
releases it (the agent departs it), and both are idempotent. Component tier: real processes, real
ZeroMQ; the agent runs with cgroup_mode off (no cgroup is touched)."""
from __future__ import annotations

import os
import shutil

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
