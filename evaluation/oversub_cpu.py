"""What a batch's CPU becomes when more loader processes than CPUs time-slice them, and what the
simulator's node model says (a command, not a test).

    python -m evaluation.oversub_cpu [--procs 1,2,3,4,6,8,16,32] [--items 6400] [--reps 3]
                                     [--image-px 96] [--aug 3] [--out FILE.json]

For each count N of processes (each with torch at one thread, as a DataLoader worker is), N processes
share ``--items`` items of the synthetic dataset's work (real JPEG decode and augmentation,
``adloader.synthetic``: ``--image-px`` images, ``--aug`` augmentation passes) at once, started
together; each process's CPU seconds (``time.process_time``) over its items are summed. The figure is CPU milliseconds per item; at N
processes per CPU above one, its increase over the least-threads figure is what time slicing costs
(every switch refills caches and TLBs). The counts run interleaved, ``--reps`` times; medians with
their range. The fit: ``OVERSUB_CPU_PER_DOUBLING`` of ``evaluation.nodemodel`` is the least-squares
slope of (CPU per item over the reference) - 1 against log2(processes per CPU), through the origin, over
the counts above one per CPU; the model's factor (``nodemodel.oversubscription_factor``'s formula) is
printed beside each measured one. The reference is the median at one process per CPU (or the fewest
processes measured). The CPUs are this process's affinity mask. Timings depend on the machine and what
else runs on it: run it on a quiet node, and read the figures side by side.
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path


def _work(args) -> float:
    """CPU seconds this process spent on ``n`` items (after one warm-up item)."""
    n, seed, image_px, aug = args
    import torch

    from adloader.synthetic import SyntheticImageDataset, WorkloadSpec

    torch.set_num_threads(1)
    ds = SyntheticImageDataset(WorkloadSpec(num_images=32, length=100000, image_px=image_px,
                                            crop_px=max(8, image_px * 2 // 3), io_sleep_s=0.0, aug_multiplier=aug))
    ds[0]
    t0 = time.process_time()
    for i in range(n):
        ds[(seed * 7919 + i) % 100000]
    return time.process_time() - t0


def measure(procs: int, items: int, image_px: int = 96, aug: int = 3) -> float:
    """CPU milliseconds per item with ``procs`` processes sharing ``items`` items at once."""
    per = max(1, items // procs)
    with mp.get_context("fork").Pool(procs) as pool:
        cpu = pool.map(_work, [(per, s, image_px, aug) for s in range(procs)], chunksize=1)
    return sum(cpu) / (per * procs) * 1e3


def fit(cpus: int, medians: dict[int, float]) -> tuple[float, float]:
    """(reference ms per item, slope per doubling of processes per CPU past one)."""
    ref_n = cpus if cpus in medians else min(medians)
    ref = medians[ref_n]
    xs, ys = [], []
    for n, v in medians.items():
        if n > cpus:
            xs.append(math.log2(n / cpus))
            ys.append(v / ref - 1.0)
    slope = sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs) if xs else 0.0
    return ref, slope


def main(argv=None) -> int:
    from evaluation.flags import at_least, comma_list, path_arg, plain_int

    ap = argparse.ArgumentParser(prog="python -m evaluation.oversub_cpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", type=comma_list(at_least(plain_int, 1)), default="1,2,3,4,6,8,16,32", help="process counts (at least 1), comma-separated (default 1,2,3,4,6,8,16,32)")
    ap.add_argument("--items", type=plain_int, default=6400, help="items per run, shared by its processes (default 6400)")
    ap.add_argument("--reps", type=plain_int, default=3, help="interleaved repeats of every count (default 3)")
    ap.add_argument("--image-px", type=plain_int, default=96,
                    help="image side in pixels (the GPU study's catalogue doubles the default 96)")
    ap.add_argument("--aug", type=plain_int, default=3, help="augmentation passes per item (default 3)")
    ap.add_argument("--out", type=path_arg, default=None, help="write the JSON result here")
    args = ap.parse_args(argv)
    counts = sorted(set(args.procs))
    if min(args.items, args.reps, args.aug) < 1 or args.image_px < 16:
        print("oversub_cpu: --items, --reps and --aug must be at least 1, --image-px at least 16",
              file=sys.stderr)
        return 2
    from evaluation import nodemodel

    cpus = len(os.sched_getaffinity(0))
    runs: dict[int, list[float]] = {n: [] for n in counts}
    for rep in range(args.reps):
        for n in counts:
            runs[n].append(measure(n, args.items, args.image_px, args.aug))
        print(f"repeat {rep + 1} of {args.reps} done", file=sys.stderr)
    med = {n: statistics.median(v) for n, v in runs.items()}
    ref, slope = fit(cpus, med)
    k = nodemodel.OVERSUB_CPU_PER_DOUBLING
    print(f"{cpus} CPUs; {args.items} items of {args.image_px} px x{args.aug} per run; {args.reps} interleaved "
          f"repeats; reference "
          f"{ref:.3f} ms per item")
    print("| processes | per CPU | CPU ms per item, median [range] | x reference | model (k = "
          f"{k:.3f}) |")
    print("|---|---|---|---|---|")
    for n in counts:
        per_cpu = n / cpus
        model = 1.0 + k * math.log2(per_cpu) if per_cpu > 1 else 1.0
        print(f"| {n} | {per_cpu:.1f} | {med[n]:.3f} [{min(runs[n]):.3f}-{max(runs[n]):.3f}] | "
              f"{med[n] / ref:.3f} | {model:.3f} |")
    print(f"fitted slope per doubling of processes per CPU: {slope:.4f} (the model's "
          f"OVERSUB_CPU_PER_DOUBLING: {k:.4f})")
    if args.out:
        Path(args.out).write_text(json.dumps({"cpus": cpus, "items": args.items, "reps": args.reps,
                                              "image_px": args.image_px, "aug": args.aug,
                                              "runs_ms_per_item": {str(n): v for n, v in runs.items()},
                                              "median_ms_per_item": {str(n): v for n, v in med.items()},
                                              "reference_ms": ref, "fitted_per_doubling": slope,
                                              "model_per_doubling": k}, indent=1))
        print(f"JSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
