"""How many workers ``num_workers="auto"`` runs over a source that serves one read at a time.

    python -m evaluation.supply_check [--seconds 60] [--repeats 2] [--against TREE] [--out FILE]

A real ``adloader.DataLoader`` (its own worker processes, its own autotuner; no agent) over a map-style
dataset whose every sample holds one lock shared by all the workers for ``--read-ms`` (a source with a
fixed bandwidth: a disk, a network filesystem, a file behind a lock), the training step a sleep of
``--step-ms``. With the defaults the source serves 250 samples/s (31 batches of 8) however many workers
read it, and one worker keeps up with it; the step could take 100 batches/s. Each added worker only
queues at the lock: its batches' blocked time grows, its throughput does not.

Each run prints, every 5 s, the loader's worker count and its samples/s since the start; the table gives
per tree the median over repeats of the workers in the last half of the run (and the most it ran) and
the samples/s. ``--against TREE`` runs the same script with the loader and predictor of another checkout
(a worktree of an earlier commit), alternating trees run by run, so that both see the same machine.
What it shows: whether the tuner stops adding workers that buy nothing (the predictor's supply cap,
``predictor.bank``). What it cannot show: a real disk's behaviour (its queue can also slow each read).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from evaluation.flags import above, at_least, finite_float, path_arg, plain_int

ROOT = Path(__file__).resolve().parent.parent

_CHILD = r"""
import json, multiprocessing as mp, sys, time
import torch
from adloader import DataLoader

LOCK = mp.Lock()
READ_S, STEP_S, SECONDS = float(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])


class Source(torch.utils.data.Dataset):
    def __len__(self):
        return 10 ** 7

    def __getitem__(self, i):
        with LOCK:
            time.sleep(READ_S)
        return torch.zeros(4)


if __name__ == "__main__":
    dl = DataLoader(Source(), batch_size=8, num_workers="auto", max_workers=8)
    t0 = last = time.monotonic()
    n, seen = 0, []
    for _ in dl:
        time.sleep(STEP_S)
        n += 1
        now = time.monotonic()
        if now - last >= 5.0:
            seen.append({"t": round(now - t0, 1), "workers": dl.num_workers, "samples_per_s": n * 8 / (now - t0)})
            last = now
        if now - t0 >= SECONDS:
            break
    dl.close()
    print(json.dumps(seen))
"""


def run_once(tree: Path, read_ms: float, step_ms: float, seconds: float) -> list[dict]:
    """One run of the child script with ``tree``'s code (cwd and PYTHONPATH: ``python -c`` puts the cwd
    first on sys.path)."""
    env = dict(os.environ, PYTHONPATH=str(tree), ADLOADER_DISABLE="1")
    out = subprocess.run([sys.executable, "-c", _CHILD, str(read_ms / 1000), str(step_ms / 1000), str(seconds)],
                         cwd=tree, env=env, capture_output=True, text=True, timeout=seconds + 120)
    if out.returncode != 0:
        raise SystemExit(f"supply_check: the run in {tree} failed (exit {out.returncode}):\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def summary(points: list[dict]) -> dict:
    late = points[len(points) // 2:] or points
    return {"workers_late": statistics.median(p["workers"] for p in late),
            "workers_most": max(p["workers"] for p in points),
            "samples_per_s": points[-1]["samples_per_s"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m evaluation.supply_check", description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=at_least(finite_float, 10), default=60.0, help="length of each run (default 60)")
    ap.add_argument("--repeats", type=at_least(plain_int, 1), default=2, help="runs per tree (default 2)")
    ap.add_argument("--read-ms", type=above(finite_float, 0), default=4.0, help="the lock held per sample, ms (default 4)")
    ap.add_argument("--step-ms", type=at_least(finite_float, 0), default=10.0, help="the training step, ms (default 10)")
    ap.add_argument("--against", type=path_arg, help="another checkout to run alternately (e.g. a worktree of an older commit)")
    ap.add_argument("--out", type=path_arg, default="bench-out/supply_check.json", help="JSON result (default bench-out/supply_check.json)")
    args = ap.parse_args(argv)
    trees = {"this": ROOT}
    if args.against is not None:
        if not (Path(args.against) / "predictor" / "bank.py").is_file():
            ap.error(f"--against {args.against}: not a checkout of this project (no predictor/bank.py)")
        trees["against"] = Path(args.against).resolve()
    runs: dict[str, list] = {k: [] for k in trees}
    for r in range(args.repeats):
        for name, tree in (trees.items() if r % 2 == 0 else reversed(list(trees.items()))):
            t0 = time.monotonic()
            pts = run_once(tree, args.read_ms, args.step_ms, args.seconds)
            runs[name].append({"points": pts, **summary(pts)})
            print(f"repeat {r + 1} {name}: " + ", ".join(f"{p['t']:g}s {p['workers']}w" for p in pts)
                  + f"; {pts[-1]['samples_per_s']:.0f} samples/s ({time.monotonic() - t0:.0f} s)", flush=True)
    print(f"\nsource: one read at a time, {args.read_ms:g} ms a sample ({1000 / args.read_ms:.0f} samples/s "
          f"at most); step {args.step_ms:g} ms; num_workers='auto', max_workers=8; {args.repeats} runs per tree")
    print(f"{'tree':<8} {'workers, 2nd half (median)':>27} {'most workers':>13} {'samples/s':>10}")
    rows = {}
    for name, rs in runs.items():
        rows[name] = {"workers_late": statistics.median(x["workers_late"] for x in rs),
                      "workers_most": statistics.median(x["workers_most"] for x in rs),
                      "samples_per_s": statistics.median(x["samples_per_s"] for x in rs)}
        print(f"{name:<8} {rows[name]['workers_late']:>27g} {rows[name]['workers_most']:>13g} "
              f"{rows[name]['samples_per_s']:>10.0f}")
    from evaluation.report import write_json

    write_json(args.out, {"benchmark": "supply_check", "trees": {k: str(v) for k, v in trees.items()},
                          "read_ms": args.read_ms, "step_ms": args.step_ms, "seconds": args.seconds,
                          "rows": rows, "runs": runs,
                          "command": "python -m evaluation.supply_check " + " ".join(argv if argv is not None else sys.argv[1:])})
    return 0


if __name__ == "__main__":
    sys.exit(main())
