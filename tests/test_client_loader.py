"""Component tests with real training processes using adloader.DataLoader (synthetic JPEG dataset,
emulated GPU step) against a real agent: directives resize the live loader, a 2-rank torchrun job
(torch.distributed, gloo on CPU) is one job, and without an agent training runs exactly as before."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.agentd_support import AgentProc
from tests.conftest import repo_env, wait_for

pytestmark = pytest.mark.component

pytest.importorskip("torch")


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _train(base: str, endpoint: str, run_s: float, workers: int, **env: str) -> tuple[subprocess.Popen, str]:
    state = f"{base}/train-{len(os.listdir(base))}.json"
    e = repo_env(ADLOADER_ENDPOINT=endpoint, **env)
    for k in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        e.pop(k, None)
    e.update(env)
    p = subprocess.Popen([sys.executable, "-m", "tests.agentd_train", state, str(run_s), str(workers), "0.02"],
                         env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return p, state


def test_agent_directive_resizes_a_real_loader(base):
    agent = AgentProc(base, "--policy", "even", "--loader-cpus", "3", "--tick-s", "0.3").start()
    p = None
    try:
        p, state = _train(base, agent.endpoint, 60, 1, ADLOADER_JOB_ID="real-1")
        # (the client records a directive just after loader.resize returns: wait for both)
        st = wait_for(lambda: (s := _read(state)) and s.get("num_workers") == 3 and len(s["worker_pids"]) == 3
                      and s.get("last_directive") and s,
                      60, what="loader resized to 3 workers by the agent")
        assert st["connected"] and st["last_directive"]["workers"] == 3
        j = wait_for(lambda: (x := agent.job("real-1")) and x["samples_per_s"] and
                     sorted(x["worker_pids"]) == sorted(_read(state)["worker_pids"]) and x, 30,
                     what="status shows the loader's live figures and worker pids")
        assert j["ranks"] == 1 and j["pids"] == [p.pid] and j["workers"] == 3
        assert 0.0 <= j["data_wait_frac"] <= 1.0 and j["worker_cpu_cores"] > 0
    finally:
        if p is not None:
            p.kill()
            p.wait()
        agent.stop()


def test_an_endless_stream_is_planned_for_the_worker_it_runs_and_sent_no_count_it_cannot_take(base):
    """A loader over an endless IterableDataset keeps its epoch's worker shards, and its epoch never ends:
    a count sent to it would only become a target that never applies. Its hello says so
    (``dataset_kind`` "iterable"), so from the first plan on the agent plans the job for the worker it
    runs and sends it that count (even's 3 cores, 1 worker; the reason says so): its loader keeps its
    one worker, its target stays 1, and status shows workers 1, live_workers 1."""
    agent = AgentProc(base, "--policy", "even", "--loader-cpus", "3", "--tick-s", "0.3").start()
    p = None
    try:
        p, state = _train(base, agent.endpoint, 60, 1, ADLOADER_JOB_ID="stream-1", TRAIN_STREAM="1")
        s = wait_for(lambda: (s := _read(state)) and s.get("last_directive") and s, 60, what="the first directive")
        assert s["last_directive"]["workers"] == 1 and "until its epoch ends" in s["last_directive"]["reason"]
        j = wait_for(lambda: (x := agent.job("stream-1")) and x["samples_per_s"] and x["live_workers"] is not None
                     and x, 30, what="status with the stream's figures")
        assert (j["workers"], j["live_workers"], j["desired_workers"]) == (1, 1, 1)
        assert "until its epoch ends" in j["reason"]
        s = _read(state)
        assert s["num_workers"] == 1 and len(s["worker_pids"]) == 1 and s["directives"] == 1
    finally:
        if p is not None:
            p.kill()
            p.wait()
        agent.stop()


def test_without_an_agent_training_is_silent_and_unchanged(base):
    p, state = _train(base, f"ipc://{base}/no-agent.sock", 1.5, 2, ADLOADER_JOB_ID="lonely")
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0, out.decode()
    st = _read(state)
    assert st["active"] and not st["connected"] and st["reports_sent"] == 0 and st["num_workers"] == 2
    lines = out.decode().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rank 0 done after "), lines   # not a word from the client
    assert not os.path.exists(f"{base}/no-agent.sock")
    # ADLOADER_DISABLE=1: no client at all
    p, state = _train(base, f"ipc://{base}/no-agent.sock", 1.0, 1, ADLOADER_DISABLE="1")
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0, out.decode()
    assert _read(state)["active"] is False


def test_two_rank_torchrun_gloo_job_registers_as_one_job(base):
    agent = AgentProc(base, "--policy", "even", "--loader-cpus", "4", "--tick-s", "0.3").start()
    p = None
    try:
        state = f"{base}/ddp.json"
        e = repo_env(ADLOADER_ENDPOINT=agent.endpoint)
        for k in ("SLURM_JOB_ID", "ADLOADER_JOB_ID", "TORCHELASTIC_RUN_ID"):
            e.pop(k, None)
        p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                              "-m", "tests.agentd_train", state, "60", "1", "0.02"],
                             env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        job = wait_for(lambda: next((j for j in agent.status()["jobs"] if j["ranks"] == 2), None), 90,
                       what="one job with two ranks")
        assert job["job"].startswith("torchrun-")
        assert [j["job"] for j in agent.status()["jobs"]] == [job["job"]]      # one job, not two
        r0, r1 = (wait_for(lambda s=s: _read(s).get("connected") and _read(s), 30, what=s)
                  for s in (f"{state}.0", f"{state}.1"))
        assert sorted(job["pids"]) == sorted([r0["pid"], r1["pid"]])
        assert r0["job"] == r1["job"] == job["job"] and {r0["rank"], r1["rank"]} == {0, 1}
        # the directive reaches both ranks: the even policy gives the job all 4 loader cores, 4 workers for
        # the job, its part to each rank (2 each, from the 1 they started with; the job's count is theirs together)
        wait_for(lambda: _read(f"{state}.0").get("num_workers") == 2 and _read(f"{state}.1").get("num_workers") == 2,
                 30, what="both ranks resized")
        # (waited for, not read once: the client records a directive once its resize has returned, and a
        # rank's state written while its new workers start shows the count before the record; the
        # 44th pass's fresh-clone run read last_directive None there)
        wait_for(lambda: all((_read(f"{state}.{r}").get("last_directive") or {}).get("workers") == 2 for r in (0, 1)),
                 30, what="both ranks' clients recorded the directive for 2 workers")
        wait_for(lambda: (j := agent.job(job["job"])) and j["workers"] == 4 and j["desired_workers"] == 4, 20,
                 what="the job's workers, both ranks' together")
    finally:
        if p is not None:
            p.terminate()
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        agent.stop()


def test_own_resize_is_the_jobs_count_and_a_directive_is_not():
    """An observe-only agent (policy none) puts a job back on its own count: a user's resize() (or
    auto's) is the job's own count from then on, a directive never is (it would lock the count in)."""
    import threading

    from adloader import DataLoader
    from adloader.client import _Client

    loader = DataLoader(list(range(64)), batch_size=4, num_workers=2, max_workers=4)
    try:
        assert loader.requested_workers == 2
        assert loader.resize(3) == 3 and loader.requested_workers == 3
        client = _Client.__new__(_Client)           # only the directive path: no thread, no socket
        client._lock, client._info = threading.Lock(), {"directives": 0}
        client._apply(loader, {"workers": 1, "seq": 1, "cpus": 0.5, "cpuset": None, "reason": "test"})
        assert loader.num_workers == 1 and loader.requested_workers == 3
        assert loader.stats()["requested_workers"] == 3
        assert sorted(sum((b.tolist() for b in loader), [])) == list(range(64))
    finally:
        loader.close() if hasattr(loader, "close") else None
