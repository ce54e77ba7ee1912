"""``num_workers="auto"`` on a real job (component tier): real adloader.DataLoader, real worker
processes, real JPEG decode, the process confined to ONE CPU by affinity (so the tuner's CPU bound is
exercised), 1-second windows. Needs the elastic loader; skipped with a reason when it is not importable.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO, repo_env

SCRIPT = textwrap.dedent('''
    import json, os, sys, time
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})      # one CPU for the whole job
    import torch
    from adloader import DataLoader, autotune
    from adloader.synthetic import SyntheticImageDataset, WorkloadSpec, emulated_step
    autotune.WINDOW_S = 1.0
    io_sleep_s, aug, step_s, run_s = float(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
    ds = SyntheticImageDataset(WorkloadSpec(num_images=32, length=100000, image_px=96, crop_px=64,
                                            io_sleep_s=io_sleep_s, aug_multiplier=aug))
    # max_workers: the loader's own bound (its default is the usable CPUs); 8 lets blocked time use workers
    loader = DataLoader(ds, batch_size=16, shuffle=True, num_workers="auto", max_workers=8)
    start_workers = loader.num_workers
    t0 = time.monotonic(); trace = []; last = (t0, 0)
    for i, batch in enumerate(loader):
        emulated_step(batch, step_s)
        now = time.monotonic()
        if now - last[0] >= 1.0:
            st = loader.stats()
            trace.append([round(now - t0, 1), loader.num_workers, (st["samples"] - last[1]) / (now - last[0])])
            last = (now, st["samples"])
        if now - t0 > run_s:
            break
    t = autotune.tuner_of(loader)
    cur = t.bank.curve(t.job) if t else None
    diag = {"windows": t.n_windows, "moves": t.history, "measured": t.measured, "cap": t.cap,
            "curve": None if cur is None else [cur.cpu_s_per_batch, cur.blocked_s_per_batch,
                                               cur.compute_s_per_step, cur.correction, cur.core_correction,
                                               cur.knee_workers(t.cpus)]} if t else None
    print(json.dumps({"start_workers": start_workers, "trace": trace, "usable_cpus": autotune.usable_cpus(),
                      "tuner": diag}))
    loader.close()
''')


def _run(tmp_path, io_sleep_s, aug, step_s, run_s=30.0):
    pytest.importorskip("adloader.dataloader", reason="the elastic adloader.DataLoader has not landed yet")
    script = tmp_path / "auto_job.py"
    script.write_text(SCRIPT)
    out = subprocess.run([sys.executable, str(script), str(io_sleep_s), str(aug), str(step_s), str(run_s)],
                         env=repo_env(ADLOADER_DISABLE="1"), cwd=REPO, capture_output=True, text=True,
                         timeout=run_s + 60)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _settled(trace, from_s):
    return {w for t, w, _r in trace if t >= from_s}


def test_auto_grows_workers_for_an_io_bound_job_on_one_cpu(tmp_path):
    # b = 16 x 5 ms = 80 ms blocked per batch, little CPU, 20 ms step: ~5 workers hide the fetches,
    # and blocked time needs workers, not cores, so one CPU does not cap them at 1.
    res = _run(tmp_path, io_sleep_s=0.005, aug=1, step_s=0.02, run_s=20.0)
    trace = res["trace"]
    assert res["usable_cpus"] == 1.0
    assert res["start_workers"] == 1
    final = trace[-1][1]
    assert 3 <= final <= 8, (trace, res["tuner"])
    assert len(_settled(trace, 10.0)) == 1, trace            # settled within 10 s (1 s windows), then stays
    first_rate = max(r for t, w, r in trace if w == res["start_workers"])
    end_rate = sorted(r for t, w, r in trace[-4:])[1]
    assert end_rate > 2.0 * first_rate, trace


def test_auto_stays_low_for_a_cpu_bound_job_on_one_cpu(tmp_path):
    # pure CPU preprocessing on one CPU: more workers cannot help; the tuner must not pile them up
    res = _run(tmp_path, io_sleep_s=0.0, aug=3, step_s=0.005, run_s=10.0)
    trace = res["trace"]
    assert res["start_workers"] == 1
    assert max(w for _t, w, _r in trace) <= 2, trace
    assert len(_settled(trace, 5.0)) == 1, trace
