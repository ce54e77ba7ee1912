"""What a job's CPU weight buys when its loader has one worker beside jobs with more (a command, not a
test; needs root and the cgroup v1 cpu controller).

    python -m evaluation.lone_worker [--seconds 8] [--repeats 3] [--out FILE.json]

Three "jobs", each a cgroup under the cpu hierarchy (``adloader-lone-<pid>/<job>``) with ``cpu.shares``
in proportion to the cores a plan gives it, each running busy worker processes that never wait (a
loader-bound job's workers): A with one worker and 0.37 cores' weight, B with 0.49, C with two workers
and 0.74 (the plan adaptive holds in the bench's oversubscribed mix on two CPUs). B runs once with one
worker and once with two, alternating, ``--repeats`` times. Each job's CPU (its processes' utime +
stime over the window) is set beside the share its weight entitles it to when every group is always
runnable: weight / all weights x the CPUs (capped at its workers, the rest shared out again). The
kernel's group scheduler splits a group's weight over the CPUs its threads ran on; one thread can be
on one CPU at a time, so a lone worker can receive less than its weight says. The agent and the node
model plan with the weight. Timings depend on the machine and what else runs on it: read the ratios
side by side, in one run.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

CGROUP_ROOT = "/sys/fs/cgroup"      # the v1 cpu hierarchy is found at its mount point under it
JOBS = {"A": 0.37, "B": 0.49, "C": 0.74}     # planned cores (weights)
WORKERS = {"A": 1, "C": 2}


def _spin() -> None:
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    while True:
        pass


def _cpu_s(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def entitled(weights: dict, workers: dict, cpus: float) -> dict:
    """Each group's CPU when all are always runnable: weight-proportional, at most one CPU per worker,
    what a capped group cannot use shared out again among the rest (the node model's water-filling)."""
    from evaluation.nodemodel import waterfill

    return waterfill(float(cpus), weights, {g: float(workers[g]) for g in weights})


def run_once(base: Path, b_workers: int, seconds: float) -> dict:
    workers = dict(WORKERS, B=b_workers)
    pids: dict[str, list[int]] = {}
    try:
        for g, cores in JOBS.items():
            d = base / g
            d.mkdir(exist_ok=True)
            (d / "cpu.shares").write_text(str(max(2, round(1024 * cores))))
            for _ in range(workers[g]):
                pid = os.fork()
                if pid == 0:
                    _spin()
                (d / "cgroup.procs").write_text(str(pid))
                pids.setdefault(g, []).append(pid)
        time.sleep(1.0)                                   # past the start-up
        t0, c0 = time.monotonic(), {g: sum(_cpu_s(p) for p in ps) for g, ps in pids.items()}
        time.sleep(seconds)
        dt = time.monotonic() - t0
        got = {g: (sum(_cpu_s(p) for p in ps) - c0[g]) / dt for g, ps in pids.items()}
    finally:
        for ps in pids.values():
            for p in ps:
                try:
                    os.kill(p, signal.SIGTERM)
                    os.waitpid(p, 0)
                except OSError:
                    pass
    cpus = len(os.sched_getaffinity(0))
    want = entitled(JOBS, workers, cpus)
    return {"b_workers": b_workers, "cpus": cpus, "received": got, "entitled": want,
            "ratio": {g: got[g] / want[g] for g in got}}


def main(argv=None) -> int:
    from evaluation.flags import finite_float, path_arg, plain_int

    ap = argparse.ArgumentParser(prog="python -m evaluation.lone_worker", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=finite_float, default=8.0, help="measured seconds per run (default 8)")
    ap.add_argument("--repeats", type=plain_int, default=3,
                    help="times B runs with one worker and with two, alternating (default 3)")
    ap.add_argument("--out", type=path_arg, default=None, help="write the runs as JSON here")
    args = ap.parse_args(argv)
    if args.seconds <= 0 or args.repeats < 1:
        ap.error("--seconds must be positive and --repeats at least 1")
    from agent.cgroupfs import v1_controller_available, v1_mount

    why = "needs root" if os.geteuid() != 0 else v1_controller_available(CGROUP_ROOT, "cpu")
    if why:
        print(f"lone_worker: {why} (it runs in cgroup v1 cpu groups of its own)", file=sys.stderr)
        return 2
    base = Path(v1_mount(CGROUP_ROOT, "cpu")) / f"adloader-lone-{os.getpid()}"
    base.mkdir()
    runs = []
    try:
        for rep in range(args.repeats):
            for bw in (1, 2):
                r = run_once(base, bw, args.seconds)
                runs.append(r)
                print(f"  repeat {rep + 1}, B with {bw} worker(s): " + ", ".join(
                    f"{g} {r['received'][g]:.2f} of {r['entitled'][g]:.2f} cores ({r['ratio'][g]:.2f})" for g in JOBS),
                    flush=True)
    finally:
        for g in JOBS:
            try:
                (base / g).rmdir()
            except OSError:
                pass
        base.rmdir()
    print("\n| B's workers | A received / entitled | B | C (median [range] over repeats) |\n|---|---|---|---|")
    for bw in (1, 2):
        rs = [r for r in runs if r["b_workers"] == bw]
        cells = []
        for g in JOBS:
            xs = [r["ratio"][g] for r in rs]
            cells.append(f"{statistics.median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]")
        print(f"| {bw} | " + " | ".join(cells) + " |")
    if args.out:
        Path(args.out).write_text(json.dumps({"argv": sys.argv[1:], "runs": runs}, indent=1))
        print(f"JSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
