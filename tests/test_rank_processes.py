"""A bench job of several rank processes (the catalogue's ``rank_processes``): the kind variant, and
``evaluation.jobproc`` as rank 0 of two, for real: its second rank its own process and loader, both in
lockstep, the job's progress file summing them, nothing left behind, and a rank that dies failing the
job. The harness's ``worker_memory`` counts the ranks' workers, not the second rank's training process.
"""
from __future__ import annotations

import json
import subprocess
import sys

import psutil
import pytest

from evaluation.catalog import CatalogError, JobSpec, habitual_workers, load_catalog, make_job
from evaluation.poll import wait_for
from tests.conftest import REPO, repo_env

WORKLOAD = {"name": "r", "num_images": 8, "length": 1 << 20, "image_px": 48, "crop_px": 16, "aug_multiplier": 1,
            "io_sleep_s": 0.0, "cost_spread": 1.0, "seed": 1}
SPEC = {"job_id": "ddp", "kind": "x[rank_processes=true]", "batch_size": 8, "step_s": 0.03, "demand_cores": 0.5,
        "cpu_s_per_sample": 0.001, "workload": WORKLOAD, "gpus": 2, "trainer_cpu_frac": 0.1, "num_workers": 2,
        "rank_processes": True}


@pytest.mark.unit
def test_a_kind_variant_with_rank_processes_makes_a_spec_of_rank_processes(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('[jobs.x]\ncores_per_gpu = 1.0\ngpus = 2\n[mixes]\nm = [{kind = "x", rank_processes = true}, "x"]\n')
    cat = load_catalog(str(p))
    assert cat.mixes["m"] == ["x[rank_processes=true]", "x"]      # (named as TOML writes the value)
    kind = cat.kinds["x[rank_processes=true]"]
    assert kind.rank_processes and not cat.kinds["x"].rank_processes
    calib = {n: {"cpu_s_per_sample": 0.001, "demand_cores": 1.0, "step_s": 0.1} for n in cat.kinds}
    spec = make_job(cat, calib, kind.name, "j", seed=1, node_cores=8)
    assert spec.rank_processes and spec.gpus == 2 and spec.batch_size == 2 * kind.batch_size
    assert JobSpec(**json.loads(spec.to_json())) == spec
    # the habit is each rank's loader's (cpus // ranks), so the job's workers are that times its ranks
    assert habitual_workers(kind, 8) == 8 and habitual_workers(cat.kinds["x"], 8) == 4
    p.write_text('[jobs.x]\ncores_per_gpu = 1.0\n[mixes]\nm = [{kind = "x", rank_processes = "yes"}]\n')
    with pytest.raises(CatalogError, match="rank_processes of x must be true or false"):
        load_catalog(str(p))
    ddp = load_catalog().mixes["gpu-weighted-ddp"]
    assert ddp[0] == "resnet18x2[rank_processes=true]" and ddp[1:] == load_catalog().mixes["gpu-weighted"][1:]


def _records(path):
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _jobproc(tmp_path, *args, spec=None):
    return subprocess.Popen([sys.executable, "-m", "evaluation.jobproc", "--spec", json.dumps(spec or SPEC),
                             "--progress", str(tmp_path / "job.jsonl"), "--workers", "2", *args],
                            env=repo_env(ADLOADER_DISABLE="1", CUDA_VISIBLE_DEVICES="0,1"), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def _left(tmp_path) -> list[int]:
    """Processes still running that were started for this test's job (its ranks and their workers)."""
    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        if any(str(tmp_path) in a for a in p.info["cmdline"] or []):
            out.append(p.info["pid"])
    return out


@pytest.mark.component
def test_two_rank_processes_step_in_lockstep_and_the_job_file_is_the_jobs(tmp_path):
    proc = _jobproc(tmp_path, "--duration-s", "3")
    out = proc.communicate(timeout=120)[0].decode(errors="replace")
    assert proc.returncode == 0, out
    job, rank1 = _records(tmp_path / "job.jsonl"), _records(tmp_path / "job.jsonl.rank1")
    start = job[0]
    assert start["event"] == "start" and start["ranks"] == 2 and start["batch_size"] == SPEC["batch_size"]
    rows = [r for r in job if "event" not in r]
    last, last1 = rows[-1], [r for r in rank1 if "event" not in r][-1]
    assert last["steps"] >= 10
    for r in rows:      # the job's samples: each step takes every rank's batch, the job's batch in all
        assert r["samples"] == r["steps"] * SPEC["batch_size"]
    assert last1["samples"] == last1["steps"] * SPEC["batch_size"] // 2
    assert abs(last["steps"] - last1["steps"]) <= 2
    assert job[-1]["event"] == "done" and rank1[-1]["event"] == "done"
    assert {job[-1]["reason"], rank1[-1]["reason"]} <= {"duration", "rank"}
    # the job's workers and CPU are both ranks' (one worker each: the job's 2 split)
    assert last["workers"] == 2 and last1["workers"] == 1
    assert last["cpu_s"] > last1["cpu_s"] > 0 and last["main_cpu_s"] > last1["main_cpu_s"] > 0
    assert _left(tmp_path) == []


@pytest.mark.component
def test_worker_memory_counts_every_ranks_workers_not_the_other_ranks(tmp_path):
    """Two ranks of one worker each: ``worker_memory`` of the job's process (rank 0) measures two
    workers, not three (rank 1's training process is a child of rank 0, not a worker). SIGTERM to rank 0
    stops both ranks after the same step."""
    from evaluation.harness import worker_memory

    proc = _jobproc(tmp_path)
    try:
        wait_for(lambda: (tmp_path / "job.jsonl").exists() and any(
            r.get("live") == 2 for r in _records(tmp_path / "job.jsonl") if "event" not in r),
            timeout=60, interval=0.1, what="both ranks' workers up")
        kids = psutil.Process(proc.pid).children(recursive=True)
        assert len(kids) >= 3                       # rank 1 and the two workers
        n, total, largest = worker_memory(proc.pid)
        assert n == 2 and total >= largest > 0
    finally:
        proc.terminate()
        out = proc.communicate(timeout=60)[0].decode(errors="replace")
    assert proc.returncode == 0, out
    job, rank1 = _records(tmp_path / "job.jsonl"), _records(tmp_path / "job.jsonl.rank1")
    assert job[-1]["reason"] == "signal" and rank1[-1]["reason"] == "rank"
    assert job[-2]["steps"] == rank1[-2]["steps"]       # both stopped after the step they agreed on
    assert _left(tmp_path) == []


@pytest.mark.component
def test_a_rank_that_dies_fails_the_job_at_once(tmp_path):
    proc = _jobproc(tmp_path, "--duration-s", "60")
    try:
        wait_for(lambda: (tmp_path / "job.jsonl.rank1").exists() and len(_records(tmp_path / "job.jsonl.rank1")) > 2,
                 timeout=60, interval=0.1, what="rank 1 stepping")
        (rank1,) = [c for c in psutil.Process(proc.pid).children() if "--spawned-rank" in c.cmdline()]
        rank1.kill()
        out = proc.communicate(timeout=30)[0].decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1 and "rank 1 of 2 exited (rc -9) before the job stopped" in out, out
    wait_for(lambda: _left(tmp_path) == [], timeout=10, interval=0.1, what="every rank and worker gone")


@pytest.mark.component
def test_a_batch_that_the_ranks_cannot_split_is_refused(tmp_path):
    proc = _jobproc(tmp_path, "--duration-s", "1", spec=dict(SPEC, batch_size=7))
    out = proc.communicate(timeout=60)[0].decode(errors="replace")
    assert proc.returncode == 2 and "batch_size 7 (the job's, every GPU's together) is not divisible" in out
