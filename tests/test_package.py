"""The package's import boundaries (DESIGN.md, "Packages")."""
import subprocess
import sys

import pytest

from tests.conftest import REPO, adloader_cmd, repo_env

pytestmark = pytest.mark.component


def _imported_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys; print(' '.join(sorted(sys.modules)))"],
        env=repo_env(), cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout
    return set(out.split())


def test_agent_and_client_import_without_torch():
    mods = _imported_after("import adloader, agent.cli, predictor.curve, predictor.observation, agent.model")
    assert "torch" not in mods


def test_cli_help_lists_commands():
    out = subprocess.run(adloader_cmd("--help"), env=repo_env(), cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0
    for cmd in ("agent", "status", "job", "profile", "bench", "demo", "simulate"):
        assert cmd in out.stdout


def test_unknown_command_is_named():
    out = subprocess.run(adloader_cmd("frobnicate"), env=repo_env(), cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 2
    assert "frobnicate" in out.stderr
