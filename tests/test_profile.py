"""``adloader profile`` (component tier): real ROUTER, real child process, real protocol messages.

The fake client below is a stand-in for ``adloader.client`` that speaks the wire protocol of
``adloader.protocol`` exactly (hello, reports of ``DataLoader.stats()`` totals); a second test runs a
tiny real training script through the real client once that lands.
"""
import json
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO, adloader_cmd, repo_env

pytestmark = pytest.mark.component

FAKE_CLIENT = textwrap.dedent('''
    import os, sys, time, zmq
    from adloader import protocol
    job, pid = os.environ["ADLOADER_JOB_ID"], os.getpid()
    ctx = zmq.Context(); s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.IDENTITY, protocol.client_identity(job, 0, pid)); s.setsockopt(zmq.LINGER, 0)
    s.connect(os.environ["ADLOADER_ENDPOINT"])
    s.send(protocol.encode(protocol.make("hello", job=job, rank=0, pid=pid, batch_size=16, workers=2)))
    assert s.poll(5000), "no welcome"
    reply = protocol.decode(s.recv()); assert reply["type"] == "welcome", reply
    # a job with g = 20 ms compute, c = 60 ms CPU and b = 10 ms blocked per batch, 2 workers on 1 core:
    # core-bound at 1/0.06 = 16.7 batches/s (2 workers alone would give 2/0.07 = 28.6/s); each worker
    # waits in the run queue while the other runs
    bps, g, c, b, runq = 16.67, 0.020, 0.060, 0.010, 0.050
    t = 0.0
    for i in range(int(sys.argv[1])):
        t += 0.5
        n = bps * t
        stats = {"steps": int(n), "samples": int(n) * 16, "batches": int(n), "workers": 2, "live_workers": 2,
                 "batch_size": 16, "uptime_s": t, "resizes": 0, "compute_s": n * g,
                 "data_wait_s": n * (1 / bps - g), "worker_cpu_s": n * c, "worker_wall_s": n * (c + b + runq),
                 "worker_runq_s": n * runq, "worker_blocked_s": n * b}
        s.send(protocol.encode(protocol.make("report", job=job, rank=0, pid=pid, stats=stats)))
        time.sleep(0.05)
    s.send(protocol.encode(protocol.make("bye", job=job, rank=0, pid=pid)))
    time.sleep(0.2)
''')


def _profile(tmp_path, *args, timeout=60):
    out = tmp_path / "profile.json"
    proc = subprocess.run(adloader_cmd("profile", "--json", str(out), *args), env=repo_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
    return proc, (json.loads(out.read_text()) if out.exists() else None)


def test_profile_with_protocol_client(tmp_path):
    script = tmp_path / "fake_train.py"
    script.write_text(FAKE_CLIENT)
    proc, doc = _profile(tmp_path, "--duration", "20", "--cores", "1", "--", sys.executable, str(script), "16")
    assert proc.returncode == 0, proc.stderr + proc.stdout
    out = proc.stdout
    for what in ("compute", "data wait", "preprocessing CPU", "fetch / IO wait", "run-queue wait", "knee"):
        assert what in out, out
    assert doc["workers"] == 2 and doc["batch_size"] == 16
    assert doc["per_batch_in_workers"]["cpu_s"] == pytest.approx(0.060, rel=0.05)
    assert doc["per_batch_in_workers"]["blocked_s"] == pytest.approx(0.010, rel=0.05)
    assert doc["per_step"]["compute_s"] == pytest.approx(0.020, rel=0.05)
    pred = doc["prediction"]
    # core-bound at 1 core: one more core helps; more workers at 1 core help little
    assert pred["cores"]["2.0"] > pred["cores"]["1.0"] * 1.2
    assert pred["workers"]["4"] < pred["workers"]["2"] * 1.1
    assert "run queue" in doc["verdict"]


def test_profile_stops_a_long_command_and_reports_no_hook(tmp_path):
    proc, doc = _profile(tmp_path, "--duration", "1", "--", sys.executable, "-c", "import time; time.sleep(30)")
    assert proc.returncode == 1
    assert "no report" in proc.stderr


def test_profile_needs_a_command(tmp_path):
    proc, _ = _profile(tmp_path)
    assert proc.returncode == 2 and "after --" in proc.stderr
    # bad numbers are refused before the command runs (--cores 0 ran it and profiled for zero cores)
    for args, words in ((("--cores", "0"), "--cores must be a positive number"),
                        (("--duration", "-1"), "--duration must be > 0")):
        proc, _ = _profile(tmp_path, *args, "--", sys.executable, "-c", "raise SystemExit(7)")
        assert proc.returncode == 2 and words in proc.stderr, proc.stderr


def test_an_unwritable_json_path_or_a_bad_job_id_is_refused_before_the_command_runs(tmp_path):
    """(--json in a missing directory was a traceback after the whole run; a job id the client does not
    send ran the command and then said "no report"; a training command without -- was "adloader: error")"""
    ran = tmp_path / "ran"
    cmd = ("--", sys.executable, "-c", f"open({str(ran)!r}, 'w')")
    for args, words in ((("--json", str(tmp_path / "no-such-dir" / "p.json")), "--json"),
                        (("--json", str(tmp_path)), "is a directory"),
                        (("--job", "a/b"), "--job: job id 'a/b' is not allowed")):
        proc = subprocess.run(adloader_cmd("profile", *args, *cmd), env=repo_env(), cwd=REPO,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and words in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr and not ran.exists()
    proc = subprocess.run(adloader_cmd("profile", sys.executable, "-c", "pass"), env=repo_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "adloader profile: error: unrecognized arguments: -c pass" in proc.stderr
    assert "goes after --" in proc.stderr


TRAIN = textwrap.dedent('''
    import sys
    from adloader import DataLoader
    from adloader.synthetic import SyntheticImageDataset, WorkloadSpec, emulated_step
    ds = SyntheticImageDataset(WorkloadSpec(num_images=16, length=100000, image_px=64, crop_px=48,
                                            io_sleep_s=0.002))
    loader = DataLoader(ds, batch_size=8, num_workers=2)
    for epoch in range(1000):                      # runs until adloader profile stops it
        for batch in loader:
            emulated_step(batch, 0.01)
''')


def test_profile_a_real_training_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    proc, doc = _profile(tmp_path, "--duration", "8", "--", sys.executable, str(script))
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout
    assert doc["workers"] == 2 and doc["batch_size"] == 8 and doc["steps"] > 10
    assert doc["stopped_after_s"] == 8
    pb, ps = doc["per_batch_in_workers"], doc["per_step"]
    assert pb["cpu_s"] > 0 and ps["compute_s"] >= 0.009          # real decode in workers; 10 ms steps
    assert pb["blocked_s"] >= 0.8 * 8 * 0.002                     # the fetch sleeps show up as blocked
    pred = doc["prediction"]
    assert pred["ceiling_samples_per_s"] > 0 and pred["knee_workers_at_cores"] >= 1
    for what in ("where a step goes", "preprocessing CPU", "what if", "knee"):
        assert what in proc.stdout
    # the workers' memory came with the client's reports (the copy-on-read test's path, here in a default test)
    m = doc["memory"]
    assert m["workers"] == 2 and m["uss_per_worker"] > 0 and m["pss_per_worker"] > 0 and len(m["per_worker"]) == 2
    assert m["shm_inflight_bytes"] == 2 * 2 * m["batch_bytes"] > 0
    assert "memory of the loader's workers" in proc.stdout and "growth of a worker's USS" in proc.stdout


COW_TRAIN = textwrap.dedent('''
    import sys, time
    import numpy as np, torch
    from adloader import DataLoader

    class ObjectRows(torch.utils.data.Dataset):          # the pattern: a list of Python objects
        def __init__(self, n):
            self.rows = [{"id": i, "name": f"sample-{i:08d}", "vals": [float(i), 1.0, 2.0]} for i in range(n)]
        def __len__(self): return len(self.rows)
        def __getitem__(self, i): return torch.tensor(self.rows[i]["vals"])

    class ArrayRows(torch.utils.data.Dataset):           # the remedy: one numpy array
        def __init__(self, n): self.vals = np.ones((n, 3))
        def __len__(self): return len(self.vals)
        def __getitem__(self, i): return torch.from_numpy(self.vals[i].copy())

    ds = (ObjectRows if sys.argv[1] == "objects" else ArrayRows)(200_000)
    loader = DataLoader(ds, batch_size=100, num_workers=2, persistent_workers=True)
    for epoch in range(2):                                # fixed work, whatever the machine's speed
        for batch in loader:
            time.sleep(0.002)
    time.sleep(5)                                         # workers alive: the client reports a last sample
''')


@pytest.mark.slow     # a 20 s run each; default tests cover its parts (see the docstring)
@pytest.mark.parametrize("kind", ["objects", "arrays"])
def test_profile_names_copy_on_read_for_python_objects_only(tmp_path, kind):
    """The whole path on a real script: a dataset of Python objects grows every worker's private memory
    and `adloader profile` names copy-on-read; the same data in one numpy array does not. Its parts, in
    the default run: the growth measured by the loader (tests/test_memory.py::
    test_worker_memory_growth_seen_for_python_objects_not_for_arrays), the workers' memory carried to
    the profile by the client's reports (test_profile_a_real_training_script), and the verdict drawn
    from a report's growth (test_memory_analysis_names_copy_on_read_from_the_growth)."""
    script = tmp_path / "train.py"
    script.write_text(COW_TRAIN)
    proc, doc = _profile(tmp_path, "--duration", "300", "--", sys.executable, str(script), kind, timeout=330)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout
    assert doc["stopped_after_s"] is None                 # the script finished its work by itself
    m = doc["memory"]
    assert m["workers"] == 2 and m["uss_per_worker"] > 0 and m["pss_per_worker"] > 0
    assert len(m["per_worker"]) == 2 and m["shm_inflight_bytes"] == 2 * 2 * m["batch_bytes"] > 0
    assert "memory of the loader's workers" in proc.stdout and "growth of a worker's USS" in proc.stdout
    if kind == "objects":
        assert m["copy_on_read"] and m["growth_per_worker"] > 8 << 20, m
        assert "copy-on-read" in proc.stdout and "numpy arrays" in proc.stdout
    else:
        assert not m["copy_on_read"] and m["growth_per_worker"] < 4 << 20, m
        assert "no copy-on-read seen" in proc.stdout


def test_memory_analysis_names_copy_on_read_from_the_growth():
    """The verdict and its lines: copy-on-read, with its remedy, for a worker growth of at least
    COPY_ON_READ_MIN_BYTES (8 MiB) and COPY_ON_READ_MIN_FRAC (5%) of the worker's first USS; not
    below either bound."""
    from agent.commands.profile import memory_analysis, render_memory

    MiB = 1 << 20

    def rep(samples, uss, growth):
        return {"samples": samples, "workers": 2, "memory_workers": 2, "worker_uss_bytes": 2 * uss,
                "worker_pss_bytes": 2 * uss, "worker_growth_bytes": growth, "batch_bytes": 1200,
                "shm_inflight_bytes": 4800}

    for uss, growth, named in ((100 * MiB, 60 * MiB, True), (30 * MiB, 1 * MiB, False),
                               (400 * MiB, 10 * MiB, False),     # 8 MiB and more, but under 5% of 390 MiB
                               (40 * MiB, 9 * MiB, True)):
        m = memory_analysis([rep(0, uss - growth, 0.0), rep(20_000, uss, growth)])
        assert m["copy_on_read"] is named and m["growth_per_worker"] == growth, (uss, growth, m)
        text = "\n".join(render_memory(m))
        assert "memory of the loader's workers" in text and "growth of a worker's USS" in text
        if named:
            assert "copy-on-read" in text and "numpy arrays" in text, text
        else:
            assert "no copy-on-read seen" in text, text


def test_memory_analysis_reads_the_last_report_that_measured_every_worker():
    """A report sent while the loader shut its workers down measures only the ones left (CI saw 1 of 2):
    the summary comes from the last report that measured all the loader's workers."""
    from agent.commands.profile import memory_analysis

    def rep(samples, measured, uss):
        return {"samples": samples, "workers": 2, "memory_workers": measured, "worker_uss_bytes": uss,
                "worker_pss_bytes": uss, "worker_growth_bytes": 0.0}

    doc = memory_analysis([rep(0, 2, 200 << 20), rep(100, 2, 220 << 20), rep(150, 1, 110 << 20),
                           rep(160, 2, 0)])           # both counted as they exited, at no memory
    assert doc["workers"] == 2 and doc["uss_per_worker"] == 110 << 20
    assert memory_analysis([rep(0, 1, 100 << 20)])["workers"] == 1     # none whole: the last one
