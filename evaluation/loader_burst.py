"""How bursty a loader's CPU use is, and what a CPU quota does to it (a command, not a test).

    python -m evaluation.loader_burst [--loaders torch,adloader] [--kind KIND] [--seconds 4]
                                      [--quota CORES] [--out FILE.json]

Runs one emulated training job (``adloader.synthetic``: the catalogue kind's dataset, 2 workers, its
step with its trainer's CPU part, as ``evaluation.jobproc`` runs it) with each loader in turn, samples
the CPU time of all its threads (``/proc/<pid>/task/*/schedstat``) every 2 ms, and prints the CPU it
used in sliding 100 ms windows (the CFS bandwidth period) and its steps/s. A loader that hands its
workers a whole prefetch window at once shows a p99 well above the median; torch's, which sends one
index per batch taken, does not. With ``--quota CORES`` (root, the cgroup v1 ``cpu`` hierarchy, found at
its mount point under /sys/fs/cgroup) the job runs in a group with that CFS quota per 100 ms, and the
table adds the training process's run-queue wait per step (the quota's cost).
"""
from __future__ import annotations

import argparse
import bisect
import glob
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CGROUP_ROOT = "/sys/fs/cgroup"      # the v1 cpu hierarchy is found at its mount point under it


def _child(loader: str, kind: str, seconds: float, ready_path: str) -> None:
    """The job: the loader's batches through emulated steps for ``seconds`` after a warm-up."""
    import torch

    from adloader.synthetic import SyntheticImageDataset, WorkloadSpec, emulated_step
    from evaluation.catalog import calibrate, load_catalog, make_job
    from evaluation.jobproc import _main_runq_s as runq_s     # the bench job's own run-queue reading

    cat = load_catalog()
    if kind not in cat.kinds:
        raise SystemExit(f"unknown job kind {kind!r}; the catalogue has: {', '.join(sorted(cat.kinds))}")
    spec = make_job(cat, calibrate(cat, 1.8, [kind]), kind, f"burst-{kind}", seed=100, node_cores=2)
    torch.set_num_threads(1)
    ds = SyntheticImageDataset(WorkloadSpec(**spec.workload))
    if loader == "torch":
        dl = torch.utils.data.DataLoader(ds, batch_size=spec.batch_size, shuffle=True, num_workers=2,
                                         persistent_workers=True, prefetch_factor=2)
    else:
        from adloader.dataloader import DataLoader
        dl = DataLoader(ds, batch_size=spec.batch_size, shuffle=True, num_workers=2)
    step, t_cpu = spec.step_s, spec.trainer_cpu_frac * spec.step_s
    runq0 = steps0 = t0 = None
    steps = 0
    end = None
    while end is None or time.monotonic() < end:
        for b in dl:
            emulated_step(b, step, t_cpu, 1)
            steps += 1
            if steps == 20:          # warm: workers started, window full
                t0, steps0, runq0 = time.monotonic(), steps, runq_s()
                end = t0 + seconds
                Path(ready_path).write_text("go")
            if end is not None and time.monotonic() >= end:
                break
    dt = time.monotonic() - t0
    print(json.dumps({"steps_per_s": (steps - steps0) / dt,
                      "runq_ms_per_step": 1000 * (runq_s() - runq0) / max(1, steps - steps0)}), flush=True)


def _cpu_ns(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        for f in glob.glob(f"/proc/{pid}/task/*/schedstat"):
            try:
                total += int(Path(f).read_text().split()[0])
            except (OSError, IndexError, ValueError):
                pass
    return total


def measure(loader: str, kind: str, seconds: float, quota: float | None) -> dict:
    import psutil
    import tempfile

    ready = Path(tempfile.mkdtemp(prefix="adl-burst-")) / "ready"
    group = None
    if quota is not None:
        from agent.cgroupfs import v1_mount

        cpu = v1_mount(CGROUP_ROOT, "cpu")
        if os.geteuid() != 0 or not Path(cpu, "cpu.cfs_quota_us").exists():
            raise SystemExit(f"--quota needs root and a cgroup v1 cpu hierarchy at {cpu}")
        group = Path(cpu, f"adl-burst-{os.getpid()}")
        group.mkdir(exist_ok=True)
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text(str(int(quota * 100000)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ADLOADER_")}
    env.update(PYTHONPATH=str(ROOT), ADLOADER_DISABLE="1")
    p = subprocess.Popen([sys.executable, "-m", "evaluation.loader_burst", "--_child", loader, "--kind", kind,
                          "--seconds", str(seconds), "--_ready", str(ready)], env=env, cwd=str(ROOT),
                         stdout=subprocess.PIPE, text=True)
    try:
        if group is not None:
            (group / "cgroup.procs").write_text(str(p.pid))     # before it forks its workers
        deadline = time.monotonic() + 120
        while not ready.exists():
            if p.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the {loader} job did not start (rc {p.returncode})")
            time.sleep(0.05)
        pids = [p.pid] + [c.pid for c in psutil.Process(p.pid).children(recursive=True)]
        ts, cpu = [], []
        stop = time.monotonic() + seconds - 0.1       # within the job's measured span, before it exits
        while p.poll() is None and time.monotonic() < stop:
            ts.append(time.monotonic())
            cpu.append(_cpu_ns(pids) * 1e-9)
            time.sleep(0.002)
        out, _ = p.communicate(timeout=120)
        job = json.loads(out.strip().splitlines()[-1])
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()
        if group is not None:
            for _ in range(50):
                try:
                    group.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)
    windows = []
    for i, t in enumerate(ts):
        k = bisect.bisect_left(ts, t + 0.1)
        if k >= len(ts):
            break
        windows.append(cpu[k] - cpu[i])
    windows.sort()
    q = lambda f: windows[min(len(windows) - 1, int(f * len(windows)))] if windows else float("nan")
    span = ts[-1] - ts[0] if len(ts) > 1 else float("nan")
    return {"loader": loader, "kind": kind, "quota": quota, "samples": len(ts),
            "mean_cores": (cpu[-1] - cpu[0]) / span if len(ts) > 1 else float("nan"),
            "p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": windows[-1] if windows else float("nan"), **job}


def main(argv=None) -> int:
    from evaluation.flags import above, finite_float, names_arg, path_arg

    ap = argparse.ArgumentParser(prog="python -m evaluation.loader_burst", description=__doc__.split("\n\n")[0])
    ap.add_argument("--loaders", type=names_arg, default="torch,adloader", help="comma-separated: torch, adloader (default both)")
    ap.add_argument("--kind", default="bert[trainer_cpu_frac=0.15]",
                    help="catalogue job kind (evaluation/catalog.toml; default: the nothing-to-arbitrate mix's "
                         "BERT-like job)")
    ap.add_argument("--seconds", type=above(finite_float, 0), default=4.0, help="measured seconds per loader (default 4)")
    ap.add_argument("--quota", type=above(finite_float, 0), default=None, help="CFS quota in cores (root, cgroup v1)")
    ap.add_argument("--out", type=path_arg, default=None, help="write the rows as JSON here")
    ap.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_ready", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a._child:
        _child(a._child, a.kind, a.seconds, a._ready)
        return 0
    rows = []
    for loader in [x.strip() for x in a.loaders.split(",") if x.strip()]:
        if loader not in ("torch", "adloader"):
            ap.error(f"unknown loader {loader!r}; choose torch or adloader")
        rows.append(measure(loader, a.kind, a.seconds, a.quota))
    print(f"\n{a.kind}, 2 workers, quota {a.quota if a.quota is not None else 'none'}: "
          "CPU seconds in sliding 100 ms windows\n")
    print("| loader | mean cores | p50 | p90 | p99 | max | steps/s | trainer run-queue ms/step |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['loader']} | {r['mean_cores']:.3f} | {r['p50']:.3f} | {r['p90']:.3f} | {r['p99']:.3f} | "
              f"{r['max']:.3f} | {r['steps_per_s']:.2f} | {r['runq_ms_per_step']:.1f} |")
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
