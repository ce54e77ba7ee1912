"""Shared test plumbing: tiers, the slow switch, helpers for child processes, and the fixtures more
than one test module uses.

Tiers (STYLE.md 12), one per test, selectable with ``-m``:
    unit       pure: no process, socket or file outside tmp_path           ``pytest -m unit``
    component  real sockets, real processes, fake trees in tmp_path        ``pytest -m component``
    system     root and real cgroup v1; skips with a printed reason elsewhere   ``pytest -m system``
A module of one tier says it with ``pytestmark = pytest.mark.<tier>``; in a module of several, each
test carries its own decorator. A test with no tier, or two, stops the collection with its name.
``@pytest.mark.slow`` runs only with ``--runslow`` or ``ADLOADER_RUN_SLOW=1``.

Support modules (no tests in them): ``fakes`` (fakes and the ``job_stats`` factory), ``agentd_support``
(a real agent process, fake trainers), ``slurm_support`` (the Slurm scripts and `adloader job`),
``cgroup_support`` (real cgroup v1 for the system tier), ``loader_datasets`` (datasets for the loader).
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from evaluation.poll import wait_for  # noqa: F401  (re-exported: one poll-with-deadline for tests and harnesses)

REPO = Path(__file__).resolve().parent.parent


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run tests marked slow")


TIERS = ("unit", "component", "system")


def tier_of(item) -> str:
    """The tier markers on a test (its own, its class's and its module's), comma-separated."""
    return ",".join(sorted({m.name for m in item.iter_markers() if m.name in TIERS}))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    bad = [f"{item.nodeid}: {tier_of(item) or 'no tier'}" for item in items if tier_of(item) not in TIERS]
    if bad:
        raise pytest.UsageError("every test needs exactly one tier (unit, component or system; tests/conftest.py):\n  "
                                + "\n  ".join(bad[:20]) + (f"\n  ... and {len(bad) - 20} more" if len(bad) > 20 else ""))
    if config.getoption("--runslow") or os.environ.get("ADLOADER_RUN_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow or ADLOADER_RUN_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def repo_env(**extra: str) -> dict[str, str]:
    """Environment for a child process that must import this checkout's packages."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.pop("ADLOADER_DISABLE", None)
    env.update(extra)
    return env


def adloader_cmd(*args: str) -> list[str]:
    """argv that runs the `adloader` command from this checkout (no install needed)."""
    return [sys.executable, "-m", "agent", *args]


@pytest.fixture
def env_for_child():
    return repo_env


# -- fixtures shared by several modules -------------------------------------------------------------

@pytest.fixture
def base():
    """A short directory (``agentd_support.short_dir``) for a test's sockets and files, removed afterwards."""
    from tests.agentd_support import short_dir

    d = short_dir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def trainers():
    """A list a test appends its ``Trainer`` processes to; each is killed afterwards."""
    started = []
    yield started
    for t in started:
        t.kill()


@pytest.fixture
def v2(tmp_path):
    """(kernel, make): a ``FakeV2Kernel`` with processes 101-103 in /user.slice/job.scope; ``make(...)`` builds a
    v2 ``CgroupActuator`` on it."""
    from agent.actuators.cgroup import CgroupActuator
    from agent.actuators.originals import Originals
    from tests.fakes import FakeV2Kernel, fake_proc, fake_sys

    proc = fake_proc(tmp_path, [101, 102, 103])
    sys_root = fake_sys(tmp_path, {"nvme0n1": "[none] mq-deadline kyber bfq", "sda": "mq-deadline kyber [bfq] none"})
    # the root group holds the processes to begin with (their /proc says /user.slice/job.scope; we
    # create that group too, so moving back has somewhere to go)
    kernel = FakeV2Kernel(str(tmp_path / "cg"), proc)
    kernel.write("", "cgroup.subtree_control", "+memory")
    kernel.mkdir("user.slice")
    kernel.write("user.slice", "cgroup.subtree_control", "+memory")
    kernel.mkdir("user.slice/job.scope")
    for pid in (101, 102, 103):
        kernel.move("user.slice/job.scope", pid)

    def make(knob="shares", io=True, journal=None, **kw):
        return CgroupActuator({"": kernel}, version=2, cpu_knob=knob, io=io, subtree="adloader",
                              originals=Originals(journal), sys_root=sys_root, proc_root=proc, **kw)

    return kernel, make


@pytest.fixture
def delegated(tmp_path):
    """A systemd-like tree: the agent (pid 500) and a helper it started (501) in their unit's group,
    /system.slice/adloader-agent.service; the job's workers in a user scope."""
    from agent.actuators.cgroup import CgroupActuator
    from agent.actuators.originals import Originals
    from tests.fakes import OWN, FakeV2Kernel, fake_proc

    proc = fake_proc(tmp_path, [101, 102, 103, 500, 501])
    kernel = FakeV2Kernel(str(tmp_path / "cg"), proc)
    kernel.write("", "cgroup.subtree_control", "+memory")
    for rel in ("user.slice", "user.slice/job.scope", "system.slice", OWN):
        kernel.mkdir(rel)
    kernel.write("user.slice", "cgroup.subtree_control", "+memory")
    for pid in (101, 102, 103):
        kernel.move("user.slice/job.scope", pid)
    for pid in (500, 501):
        kernel.move(OWN, pid)

    def make(self_cgroup=f"/{OWN}", journal=None, **kw):
        (tmp_path / "proc" / "self" / "cgroup").write_text(f"0::{self_cgroup}\n")
        return CgroupActuator({"": kernel}, version=2, io=False, subtree="adloader", originals=Originals(journal),
                              sys_root=str(tmp_path), proc_root=proc, **kw)

    return kernel, make


@pytest.fixture
def adloader_bin(tmp_path) -> str:
    """A wrapper that runs this checkout's `adloader` with absolute paths only (what ADLOADER_BIN
    replaces: /opt/adloader/venv/bin/adloader)."""
    wrapper = tmp_path / "adloader"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH={REPO} exec {sys.executable} -m agent "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


@pytest.fixture
def fake_agent(tmp_path):
    """``start(mode)`` -> a ``slurm_support.FakeAgent`` on a socket in tmp_path (answer, refuse or hang)."""
    from tests.slurm_support import FakeAgent

    agents = []

    def start(mode="answer"):
        agent = FakeAgent(str(tmp_path / f"agent-{mode}-{len(agents)}.sock"), mode)
        agents.append(agent)
        return agent

    yield start
    for a in agents:
        a.close()
