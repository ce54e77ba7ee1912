"""evaluation.multirank_check's guards: a comparison tree must be a checkout of this project, and its
children must import that tree's code (``python -m`` puts the working directory first on the module
path: a child started from this checkout's directory ran this checkout's agent whatever PYTHONPATH said,
and an A/B compared the code with itself)."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from evaluation.multirank_check import imports_from, main
from tests.conftest import REPO

pytestmark = pytest.mark.unit


def test_a_tree_that_is_not_a_checkout_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--against", str(tmp_path), "--reps", "1"])
    assert e.value.code == 2
    assert f"--against {tmp_path}: not a checkout of this project" in capsys.readouterr().err


def test_children_import_the_agent_of_the_tree_they_start_in(tmp_path):
    """A copy of the agent package in another directory: a child started there imports the copy, not
    this checkout's (which is on PYTHONPATH too)."""
    if shutil.which("git") is None:
        pytest.skip("needs git to copy the tracked tree")
    other = tmp_path / "other"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(other), "HEAD"], check=True,
                   capture_output=True)
    try:
        assert imports_from(other) == other.resolve()
        assert imports_from(REPO) == REPO.resolve()
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(other)], capture_output=True)
