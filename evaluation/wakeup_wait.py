"""How long a training-process-like thread waits for a CPU when it wakes, beside busy threads, and what
the simulator's node model says (a command, not a test).

    python -m evaluation.wakeup_wait [--neighbours 0,1,2,3] [--duty 0.5] [--iterations 60]
                                     [--gpu-ms 100] [--cpu-ms 20] [--woken-ms 20] [--out FILE.json]

For each count of neighbours: that many processes that each compute ``duty`` of the time (30 ms
bursts) run beside a "trainer" that sleeps ``--gpu-ms`` (its GPU part) then computes ``--cpu-ms``,
``--iterations`` times. The trainer's run-queue wait (``/proc/thread-self/schedstat``) per wake-up is
set beside the model's (``evaluation.nodemodel.wakeup_share`` with ``all_cpus_busy``: the chance that
the neighbours fill every CPU, binomial over them, times what time-sharing a CPU then costs). All the
processes share one session (one autogroup): threads compete one to one. The point is the shape: no
wait while an idle CPU is left, a wait once the neighbours can fill the node. Timings depend on the
machine and what else runs on it: read them side by side, in one run.

``--woken-ms`` (default 20; 0: off): each count is measured twice more, alternating with the first, with
the trainer's own "worker" beside it: a process of its session that sleeps until the trainer hands it
work at the start of each CPU part, then computes that long, as a DataLoader worker does when the
training process takes a batch and dispatches the next index. The model's figure for it counts that
worker runnable during the part (``evaluation.nodemodel.woken_beside_trainer``), not its average load.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

SCHEDSTAT = "/proc/thread-self/schedstat"
BURST_S = 0.03


def _run_delay_s() -> float:
    with open(SCHEDSTAT) as f:
        return int(f.read().split()[1]) / 1e9


def _spin(seconds: float) -> None:
    t = time.thread_time()
    while time.thread_time() - t < seconds:
        pass


def _neighbour(duty: float, seed: int, stop) -> None:
    """Busy ``duty`` of the time in 30 ms bursts, its pauses drawn uniformly around their mean so that
    the neighbours do not keep in step (forked together, fixed pauses would burst in lockstep)."""
    import random

    rng = random.Random(seed)
    sleep = BURST_S * (1.0 - duty) / duty if duty < 1.0 else 0.0
    time.sleep(rng.uniform(0.0, BURST_S + sleep))
    while not stop.is_set():
        _spin(BURST_S)
        if sleep > 0:
            time.sleep(rng.uniform(0.5, 1.5) * sleep)


def _woken(conn, work_s: float) -> None:
    """The trainer's own worker: asleep until handed work, then computes ``work_s``; None stops it."""
    while True:
        if conn.recv() is None:
            return
        _spin(work_s)


def measure(neighbours: int, duty: float, iterations: int, gpu_s: float, cpu_s: float,
            woken_s: float = 0.0) -> dict:
    """The trainer's mean run-queue wait per wake-up beside ``neighbours`` busy processes; with
    ``woken_s``, its own worker handed ``woken_s`` of work at the start of each CPU part."""
    ctx = mp.get_context("fork")
    stop = ctx.Event()
    procs = [ctx.Process(target=_neighbour, args=(duty, 1000 + i, stop), daemon=True) for i in range(neighbours)]
    ours = None
    if woken_s > 0:
        ours, theirs = ctx.Pipe()
        procs.append(ctx.Process(target=_woken, args=(theirs, woken_s), daemon=True))
    for p in procs:
        p.start()
    try:
        time.sleep(0.3)                                  # the neighbours settle into their rhythm
        r0, t0 = _run_delay_s(), time.perf_counter()
        for _ in range(iterations):
            time.sleep(gpu_s)
            if ours is not None:
                ours.send(1)
            _spin(cpu_s)
        wait = (_run_delay_s() - r0) / iterations
        wall = (time.perf_counter() - t0) / iterations
    finally:
        stop.set()
        if ours is not None:
            try:
                ours.send(None)
            except OSError:             # the worker is gone already: the join below finds it so
                pass
        for p in procs:
            p.join(timeout=2.0)
            if p.is_alive():
                p.kill()
    return {"neighbours": neighbours, "duty": duty, "woken_ms": 1000 * woken_s, "wait_ms_per_wake": 1000 * wait,
            "step_ms": 1000 * wall, "iterations": iterations}


def modelled_wait_s(cpus: int, neighbours: int, duty: float, cpu_s: float, woken_s: float = 0.0) -> float:
    """The node model's wait for the trainer's CPU part: threads compete one to one (one group); with
    ``woken_s``, its own worker runnable beside the part as ``woken_beside_trainer`` counts it (a fixed
    point: the part's stretch shortens the overlap's share of it)."""
    from evaluation.nodemodel import wakeup_share

    load = neighbours * duty
    share = wakeup_share(cpus, others_threads=load, spread_weight=load, others_count=neighbours)
    if woken_s > 0:
        for _ in range(100):
            woken = min(1.0, woken_s / (cpu_s / share))
            new = wakeup_share(cpus, others_threads=load + woken, spread_weight=load + woken,
                               others_count=neighbours + 1)
            if abs(new - share) < 1e-9:
                break
            share = 0.5 * share + 0.5 * new
    return cpu_s / share - cpu_s


def main(argv=None) -> int:
    from evaluation.flags import comma_list, finite_float, path_arg, plain_int

    ap = argparse.ArgumentParser(prog="python -m evaluation.wakeup_wait", description=__doc__.split("\n\n")[0])
    ap.add_argument("--neighbours", type=comma_list(plain_int), default="0,1,2,3", help="comma-separated neighbour counts (default 0,1,2,3)")
    ap.add_argument("--duty", type=finite_float, default=0.5, help="part of the time each neighbour computes, (0, 1] (default 0.5)")
    ap.add_argument("--iterations", type=plain_int, default=60, help="the trainer's steps per count (default 60)")
    ap.add_argument("--gpu-ms", type=finite_float, default=100.0, help="the trainer's sleep per step, its GPU part (default 100)")
    ap.add_argument("--cpu-ms", type=finite_float, default=20.0, help="the trainer's CPU part per step (default 20)")
    ap.add_argument("--woken-ms", type=finite_float, default=20.0,
                    help="also measure each count with the trainer's own worker handed this much work at the "
                         "start of each CPU part (0: do not; default 20)")
    ap.add_argument("--out", type=path_arg, default=None, help="write the rows as JSON here")
    a = ap.parse_args(argv)
    if not os.path.exists(SCHEDSTAT):
        ap.error(f"{SCHEDSTAT} is missing: this needs Linux with schedstats (CONFIG_SCHED_INFO)")
    counts = a.neighbours
    if any(c < 0 for c in counts):
        ap.error(f"--neighbours must be non-negative integers, got {','.join(map(str, counts))}")
    if not 0.0 < a.duty <= 1.0:
        ap.error(f"--duty must be in (0, 1], got {a.duty}")
    if a.iterations < 1 or a.gpu_ms < 0 or a.cpu_ms <= 0 or a.woken_ms < 0:
        ap.error("--iterations must be >= 1, --gpu-ms >= 0, --cpu-ms > 0 and --woken-ms >= 0")
    cpus = len(os.sched_getaffinity(0))
    rows = []
    woken = [0.0, a.woken_ms / 1000] if a.woken_ms > 0 else [0.0]
    for n in counts:
        # alone and with the woken worker, alternating in halves: the machine's drift falls on both
        halves = {}
        for half in (a.iterations - a.iterations // 2, a.iterations // 2):
            for ws in woken:
                if half > 0:
                    halves.setdefault(ws, []).append(measure(n, a.duty, half, a.gpu_ms / 1000, a.cpu_ms / 1000, ws))
        for ws in woken:
            parts = halves[ws]
            its = sum(p["iterations"] for p in parts)
            r = dict(parts[0], iterations=its,
                     wait_ms_per_wake=sum(p["wait_ms_per_wake"] * p["iterations"] for p in parts) / its,
                     step_ms=sum(p["step_ms"] * p["iterations"] for p in parts) / its)
            r["modelled_wait_ms_per_wake"] = 1000 * modelled_wait_s(cpus, n, a.duty, a.cpu_ms / 1000, ws)
            r["cpus"] = cpus
            rows.append(r)
            print(f"  {n} neighbours{f', worker woken for {1000 * ws:g} ms' if ws else ''}: "
                  f"{r['wait_ms_per_wake']:.2f} ms measured, {r['modelled_wait_ms_per_wake']:.2f} ms modelled",
                  file=sys.stderr)
    print(f"\n{cpus} CPUs; trainer: {a.gpu_ms:g} ms asleep, {a.cpu_ms:g} ms of CPU per step; "
          f"neighbours busy {a.duty:.0%} of the time\n")
    print("| neighbours | own worker woken at the CPU part, ms of work | run-queue wait per wake-up, ms: measured "
          "| modelled | step ms |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['neighbours']} | {r['woken_ms']:g} | {r['wait_ms_per_wake']:.2f} | "
              f"{r['modelled_wait_ms_per_wake']:.2f} | {r['step_ms']:.1f} |")
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
