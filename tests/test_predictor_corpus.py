"""The corpus generator on a real (tiny) sweep: real loader, real workers, the CPU allowance imposed
(component tier; the fractional allowance needs root and cgroup v1: system tier)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from predictor.prior import load_corpus
from tests.conftest import REPO, repo_env



def _sweep(tmp_path, cores: str, loader: str):
    out = tmp_path / "corpus.jsonl"
    proc = subprocess.run([sys.executable, "-m", "evaluation.predictor_corpus", "--out", str(out), "--jobs", "io",
                           "--workers", "2", "--cores", cores, "--window-s", "0.6", "--warmup-s", "0.2",
                           "--loader", loader], env=repo_env(), cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return load_corpus(out)


@pytest.mark.component
@pytest.mark.parametrize("loader", ["torch", "adloader"])
def test_sweep_records_points_with_worker_side_timing(tmp_path, loader):
    header, points = _sweep(tmp_path, "1", loader)
    assert "evaluation.predictor_corpus" in header["command"] and loader in header["loader"].split(".")[0]
    (p,) = points
    o = p["observation"]
    assert p["job"] == "io" and p["workers"] == 2 and p["cores"] == 1.0 and p["samples_per_s"] > 0
    # io: 16 samples x 4 ms of sleep per batch are blocked time, measured in the workers
    assert o.blocked_s_per_batch > 0.8 * 16 * 0.004
    assert 0 < o.cpu_s_per_batch < o.blocked_s_per_batch


@pytest.mark.system
def test_fractional_allowance_uses_a_quota_group_and_removes_it(tmp_path):
    from tests.cgroup_support import CPU

    if os.geteuid() != 0 or not (Path(CPU) / "cpu.cfs_quota_us").exists():
        pytest.skip(f"needs root and the cgroup v1 cpu controller (looked at {CPU}, from mountinfo)")
    def corpus_groups():
        return {d for d in os.listdir(CPU) if d.startswith("adloader-corpus-")}

    before = corpus_groups()    # another sweep running on the machine keeps its own group
    header, points = _sweep(tmp_path, "0.5", "torch")
    (p,) = points
    assert p["cores"] == 0.5 and header["skipped_cores_not_root"] == []
    assert not corpus_groups() - before
