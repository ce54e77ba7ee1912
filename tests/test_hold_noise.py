"""evaluation.hold_noise: adaptive's re-plans under noise in its estimates (the benchmark's command)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from evaluation import hold_noise
from tests.conftest import REPO, repo_env

pytestmark = pytest.mark.unit


def test_no_noise_no_move_and_the_counts_add_up():
    """Without noise a settled plan never moves; with noise the counts are what they say (every flip is
    a worker change, no node counted twice), and the same nodes are drawn at every level."""
    r = hold_noise.run(nodes=60, ticks=6, levels=[0.0, 0.1], seed=3)
    quiet, loud = r["rows"]
    assert quiet["nodes"] == loud["nodes"] > 0 and quiet["replans"] == loud["replans"] == 6 * quiet["nodes"]
    assert quiet["worker_change_frac"] == 0.0 and quiet["flips"] == 0 and quiet["nodes_with_a_flip"] == 0
    assert 0.0 < loud["worker_change_frac"] <= 1.0
    assert loud["nodes_with_a_flip"] <= min(loud["nodes"], loud["flips"])


def test_the_command_prints_a_table_writes_json_and_refuses_bad_levels(tmp_path):
    out = tmp_path / "h.json"
    p = subprocess.run([sys.executable, "-m", "evaluation.hold_noise", "--nodes", "20", "--ticks", "3",
                        "--levels", "0,0.05", "--out", str(out)], cwd=REPO, env=repo_env(),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "| +-5% |" in p.stdout and json.loads(out.read_text())["rows"][1]["level"] == 0.05
    bad = subprocess.run([sys.executable, "-m", "evaluation.hold_noise", "--levels", "0,1.5"], cwd=REPO,
                         env=repo_env(), capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--levels: fractions in [0, 1)" in bad.stderr
