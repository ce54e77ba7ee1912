"""The Slurm side for tests: the real scripts run the way slurmd runs them (``run_script``), the real
`adloader job` command (``run_job``), and ``FakeAgent``, an agent socket that answers, refuses or hangs
as the real one documents. Fixtures ``adloader_bin`` and ``fake_agent``: tests/conftest.py."""
from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

from adloader import protocol
from tests.agentd_support import FakeRouter
from tests.conftest import REPO, adloader_cmd, repo_env

SLURM_DIR = REPO / "deploy" / "slurm"
PROLOG, EPILOG, TASKPROLOG = SLURM_DIR / "prolog.sh", SLURM_DIR / "epilog.sh", SLURM_DIR / "taskprolog.sh"
BASH = shutil.which("bash") or "/bin/bash"
ENV_BIN = shutil.which("env") or "/usr/bin/env"
NO_PATH = "/nonexistent-adloader-test"  # bash would otherwise fall back to its built-in default PATH

SLURM_ENV = {"SLURM_JOB_ID": "4242", "SLURM_JOB_UID": "1000", "SLURM_JOB_GPUS": "0,1", "SLURM_JOB_CPUS_PER_NODE": "6(x2)"}


def run_script(script: Path, env: dict[str, str]) -> tuple[int, str, str, float]:
    t0 = time.monotonic()
    p = subprocess.run(
        [ENV_BIN, "-i", f"PATH={NO_PATH}", *(f"{k}={v}" for k, v in env.items()), BASH, str(script)],
        capture_output=True, text=True, timeout=60,
    )
    return p.returncode, p.stdout, p.stderr, time.monotonic() - t0


def log_line(stderr: str, tag: str) -> str:
    """The script's one log line (always on stderr, whether or not syslog takes it too)."""
    lines = [l for l in stderr.splitlines() if tag in l]
    assert len(lines) == 1, f"expected one {tag} line, got {stderr!r}"
    return lines[0]


def run_job(*args: str, endpoint: str, env: dict | None = None) -> tuple[int, str, float]:
    """Run the real command; return (exit status, its stderr, wall seconds)."""
    t0 = time.monotonic()
    p = subprocess.run(
        adloader_cmd("job", *args, "--endpoint", endpoint),
        env=repo_env(**(env or {})),
        capture_output=True,
        text=True,
        timeout=60,
    )
    wall_s = time.monotonic() - t0
    assert p.stdout == "", "the command prints only its one log line, on stderr"
    return p.returncode, p.stderr, wall_s


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, f"expected exactly one log line, got: {text!r}"
    return lines[0]


class FakeAgent(FakeRouter):
    """Answers like the agent's documented behaviour: register -> ok (a second register of the same
    job -> ok "already registered"); release of an unknown job -> error unknown_job; ``refuse`` ->
    error not_permitted for everything; ``hang`` -> never answers. ``messages`` records every decoded
    request."""

    def __init__(self, path: str, mode: str = "answer"):
        self.mode = mode
        self.jobs: set[str] = set()
        super().__init__(path)

    @property
    def messages(self) -> list[dict]:
        return self.received

    def reply(self, msg: dict) -> list[bytes]:
        return [] if self.mode == "hang" else [protocol.encode(self._answer(msg))]

    def _answer(self, msg: dict) -> dict:
        t, job = msg["type"], msg.get("job")
        if self.mode == "refuse":
            return protocol.error("not_permitted", f"uid {msg.get('uid')} may not {t} job {job}", re=t)
        if t == "register":
            again = job in self.jobs
            self.jobs.add(job)
            return protocol.make("ok", re=t, detail="already registered" if again else None)
        if job not in self.jobs:
            return protocol.error("unknown_job", f"job {job} is not registered", re=t)
        self.jobs.discard(job)
        return protocol.make("ok", re=t)

