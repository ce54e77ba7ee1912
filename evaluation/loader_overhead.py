"""Per-batch cost of the elastic loader's own machinery, code tree against code tree (a command, not a test).

    python evaluation/loader_overhead.py --tree before=/tmp/a --tree after=/tmp/b [--pairs 8]

Each ``--tree NAME=DIR`` is a directory holding an ``adloader/`` package (for a commit:
``git archive REV adloader | tar -x -C DIR``); without one, the installed ``adloader`` is measured.
A trivial map-style dataset (``__getitem__`` returns its index; batches of 4; 2 persistent workers),
so what is timed is the loader itself: dispatch, the task and result messages, the bookkeeping, the
delivery. Each run is a fresh process importing one tree; the trees run one after the other in pairs
whose order alternates, so a load swing on a shared machine hits both sides alike. Reported per tree:
batches per second and the main process's CPU microseconds per batch (``time.process_time``), median
and range over the pairs, and the median of the paired ratios against the first tree. Writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def _child(batches: int, workers: int, repeats: int) -> None:
    import torch.utils.data as tud

    from adloader import DataLoader

    class Trivial(tud.Dataset):
        def __init__(self, n):
            self.n = n

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            return i

    dl = DataLoader(Trivial(batches * 4), batch_size=4, num_workers=workers, persistent_workers=True,
                    max_workers=workers)
    for _ in dl:            # warm: workers started, first epoch through
        pass
    rates, cpu = [], []
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        k = sum(1 for _ in dl)
        t1, c1 = time.perf_counter(), time.process_time()
        rates.append(k / (t1 - t0))
        cpu.append((c1 - c0) / k * 1e6)
    dl.close()
    print(json.dumps({"batches_per_s": statistics.median(rates), "main_cpu_us_per_batch": statistics.median(cpu)}))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--_child"]:
        # a run of the parent's below (--_child BATCHES WORKERS REPEATS, numbers it parsed): it imports
        # only the measured tree's adloader, whose checkout need not hold evaluation.flags
        _child(*(int(x) for x in argv[1:4]))
        return 0
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))    # (run as a script)
    from evaluation.flags import at_least, path_arg, plain_int

    ap = argparse.ArgumentParser(prog="python -m evaluation.loader_overhead", description=__doc__.split("\n")[0])
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                    help="a directory with an adloader/ package to measure (repeatable; default: the installed one)")
    ap.add_argument("--pairs", type=at_least(plain_int, 1), default=8, metavar="N", help="runs per tree, in alternating order (default 8)")
    ap.add_argument("--batches", type=at_least(plain_int, 1), default=3000, metavar="N", help="batches per epoch (default 3000)")
    ap.add_argument("--workers", type=at_least(plain_int, 1), default=2, metavar="N", help="persistent workers of the loader (default 2)")
    ap.add_argument("--repeats", type=at_least(plain_int, 1), default=3, metavar="N",
                    help="timed epochs per run (the run reports their median; default 3)")
    ap.add_argument("--out", type=path_arg, default="bench-out/loader_overhead.json", metavar="PATH",
                    help="write the JSON result here (default bench-out/loader_overhead.json)")
    args = ap.parse_args(argv)
    trees = []
    for spec in args.tree or ["installed="]:
        name, sep, path = spec.partition("=")
        if not sep or not name:
            ap.error(f"--tree wants NAME=DIR, got {spec!r}")
        if path and not os.path.isdir(os.path.join(path, "adloader")):
            ap.error(f"--tree {spec}: {path}/adloader is not a directory")
        trees.append((name, os.path.abspath(path) if path else ""))
    runs: dict[str, list[dict]] = {name: [] for name, _ in trees}
    for i in range(args.pairs):
        order = trees if i % 2 == 0 else trees[::-1]
        for name, path in order:
            env = dict(os.environ)
            if path:
                env["PYTHONPATH"] = path + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--_child", str(args.batches),
                                  str(args.workers), str(args.repeats)],
                                 env=env, capture_output=True, text=True, check=True, timeout=600)
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    first = trees[0][0]
    summary = {}
    print(f"{'tree':<12} {'batches/s median [range]':>30} {'main CPU us/batch median [range]':>36} {'CPU ratio':>10}")
    for name, _ in trees:
        rate = [r["batches_per_s"] for r in runs[name]]
        cpu = [r["main_cpu_us_per_batch"] for r in runs[name]]
        ratio = statistics.median(c / b["main_cpu_us_per_batch"] for c, b in zip(cpu, runs[first]))
        summary[name] = {"batches_per_s": statistics.median(rate), "batches_per_s_range": [min(rate), max(rate)],
                         "main_cpu_us_per_batch": statistics.median(cpu), "main_cpu_us_range": [min(cpu), max(cpu)],
                         "main_cpu_ratio_vs_" + first: ratio}
        print(f"{name:<12} {statistics.median(rate):>10.0f} [{min(rate):.0f}, {max(rate):.0f}]".ljust(43)
              + f"{statistics.median(cpu):>14.1f} [{min(cpu):.1f}, {max(cpu):.1f}]".ljust(37) + f"{ratio:>10.2f}")
    doc = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "trees": dict(trees),
           "loadavg": os.getloadavg(), "cpus": len(os.sched_getaffinity(0)), "runs": runs, "summary": summary}
    from evaluation.report import write_json

    write_json(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
