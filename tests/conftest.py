"""Shared test plumbing.

Tiers (STYLE.md 12): unit tests are pure; component tests use real sockets and real processes;
``@pytest.mark.system`` tests need root and real cgroup v1 and skip with a printed reason elsewhere;
``@pytest.mark.slow`` runs only with ``--runslow`` or ``ADLOADER_RUN_SLOW=1``.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from evaluation.poll import wait_for  # noqa: F401  (re-exported: one poll-with-deadline for tests and harnesses)

REPO = Path(__file__).resolve().parent.parent


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run tests marked slow")


def pytest_collection_modifyitems(config, items):
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
