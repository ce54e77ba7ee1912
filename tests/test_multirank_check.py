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


@pytest.mark.unit
def test_a_tree_that_is_not_a_checkout_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--against", str(tmp_path), "--reps", "1"])
    assert e.value.code == 2
    assert f"--against {tmp_path}: not a checkout of this project" in capsys.readouterr().err


@pytest.mark.component
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


@pytest.mark.component
def test_lockstep_ranks_step_together_as_a_data_parallel_job(tmp_path):
    """Two jobproc ranks with ``--lockstep`` (gloo all-reduce after every step), one of them with a step
    three times as long: both take the same number of steps, at the slow one's pace (give or take the
    step each may take past the other's last record). Without the all-reduce the fast one takes about
    three times as many."""
    import json
    import sys

    from evaluation.multirank_check import RANK_SPEC
    from evaluation.slurm_cluster import free_port
    from tests.conftest import repo_env

    port = str(free_port())
    procs = []
    for rank, step_s in ((0, 0.02), (1, 0.06)):
        spec = dict(RANK_SPEC, job_id="lock", step_s=step_s, trainer_cpu_frac=0.0, batch_size=4)
        env = repo_env(ADLOADER_DISABLE="1", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(subprocess.Popen([sys.executable, "-m", "evaluation.jobproc", "--spec", json.dumps(spec),
                                       "--progress", str(tmp_path / f"r{rank}.jsonl"), "--workers", "1",
                                       "--duration-s", "3", "--lockstep"],
                                      env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outs = [p.communicate(timeout=120)[0].decode(errors="replace") for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    steps = []
    for rank in (0, 1):
        recs = [json.loads(x) for x in (tmp_path / f"r{rank}.jsonl").read_text().splitlines()]
        steps.append(max(r.get("steps", 0) for r in recs))
    assert steps[1] >= 10 and abs(steps[0] - steps[1]) <= 2, steps
