"""Does ``pin_memory=True`` overlap the training step? adloader's loader against torch's, side by side.

    python -m evaluation.pin_bench [--steps N] [--pin-ms MS] [--step-ms MS] [--repeats N] [--out FILE]

No GPU is needed, and none is used: the accelerator is faked (``torch.accelerator.is_available``), and
each batch is an object whose ``pin_memory()`` sleeps ``--pin-ms`` (as a copy into page-locked memory
takes time without using the training thread's CPU). The training step sleeps ``--step-ms``. With two
persistent workers the batches are always ready, so the only thing measured is where the pin happens:
on a background thread, overlapping the step (torch's ``_pin_memory_loop``; adloader since its pin
thread, ``adloader._pin``), about ``1000 / max(step, pin)`` steps/s; or on the training thread at
``next()``, about ``1000 / (step + pin)``. Runs alternate torch, adloader, torch, ... in fresh
processes; the table gives each loader's median steps/s and data wait per step with their range.
What it cannot show: the real cost of pinning a real batch on a real GPU node (a device check).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

LOADERS = ("torch", "adloader")


class _SlowPin:
    """A batch whose pin takes ``pin_s`` of wall time and no CPU."""

    def __init__(self, ids, pin_s: float) -> None:
        self.ids, self.pin_s = ids, pin_s

    def pin_memory(self, *_):
        time.sleep(self.pin_s)
        return _SlowPin(self.ids, self.pin_s)


class _Collate:
    def __init__(self, pin_s: float) -> None:
        self.pin_s = pin_s

    def __call__(self, samples):
        return _SlowPin(samples, self.pin_s)


def _child(loader: str, steps: int, pin_s: float, step_s: float) -> None:
    """One run in this process: a warm-up of 10 steps, then ``steps`` timed steps; prints one JSON line."""
    import torch

    # a fake accelerator, device 0: pinning is on (both loaders ask these), nothing is copied
    torch.accelerator.is_available = lambda: True
    torch.accelerator.current_device_index = lambda: 0
    torch.accelerator.set_device_index = lambda index: None
    if loader == "adloader":
        from adloader import DataLoader
    else:
        from torch.utils.data import DataLoader
    dl = DataLoader(list(range(2 * (steps + 10))), batch_size=2, num_workers=2, collate_fn=_Collate(pin_s),
                    pin_memory=True, persistent_workers=True)
    it = iter(dl)
    for _ in range(10):
        next(it)
    wait = 0.0
    t0 = time.perf_counter()
    for _ in range(steps):
        w0 = time.perf_counter()
        next(it)
        wait += time.perf_counter() - w0
        time.sleep(step_s)
    dt = time.perf_counter() - t0
    del it
    if hasattr(dl, "close"):
        dl.close()
    print(json.dumps({"steps_per_s": steps / dt, "data_wait_ms_per_step": 1e3 * wait / steps}))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--_child"]:
        _child(argv[1], int(argv[2]), float(argv[3]), float(argv[4]))
        return 0
    from evaluation.flags import finite_float, path_arg, plain_int

    ap = argparse.ArgumentParser(prog="python -m evaluation.pin_bench", description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=plain_int, default=200, metavar="N", help="timed steps per run (default 200)")
    ap.add_argument("--pin-ms", type=finite_float, default=20.0, metavar="MS",
                    help="wall time of one batch's pin (default 20)")
    ap.add_argument("--step-ms", type=finite_float, default=20.0, metavar="MS",
                    help="wall time of one training step (default 20)")
    ap.add_argument("--repeats", type=plain_int, default=3, metavar="N", help="runs of each loader, alternating (default 3)")
    ap.add_argument("--out", type=path_arg, default="bench-out/pin_bench.json", metavar="PATH",
                    help="write the JSON result here (default bench-out/pin_bench.json)")
    args = ap.parse_args(argv)
    for name in ("steps", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1")
    for name in ("pin_ms", "step_ms"):
        if getattr(args, name) < 0:
            ap.error(f"--{name.replace('_', '-')} must be 0 or more")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo] + ([os.environ["PYTHONPATH"]]
                                                                if os.environ.get("PYTHONPATH") else [])))
    runs: dict[str, list[dict]] = {k: [] for k in LOADERS}
    for r in range(args.repeats):
        for loader in LOADERS:
            out = subprocess.run([sys.executable, "-m", "evaluation.pin_bench", "--_child", loader, str(args.steps),
                                  str(args.pin_ms / 1e3), str(args.step_ms / 1e3)],
                                 env=env, capture_output=True, text=True, timeout=600)
            if out.returncode != 0:
                print(out.stderr[-2000:], file=sys.stderr)
                raise SystemExit(f"pin_bench: the {loader} run failed (exit {out.returncode})")
            runs[loader].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"repeat {r + 1}/{args.repeats} {loader}: {runs[loader][-1]['steps_per_s']:.1f} steps/s",
                  file=sys.stderr, flush=True)

    def summary(loader: str, key: str) -> dict:
        xs = [run[key] for run in runs[loader]]
        return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}

    doc = {"command": "python -m evaluation.pin_bench " + " ".join(argv), "loadavg": os.getloadavg(),
           "cpus": len(os.sched_getaffinity(0)),
           "steps": args.steps, "pin_ms": args.pin_ms, "step_ms": args.step_ms, "repeats": args.repeats,
           "runs": runs, "summary": {k: {"steps_per_s": summary(k, "steps_per_s"),
                                         "data_wait_ms_per_step": summary(k, "data_wait_ms_per_step")}
                                     for k in LOADERS}}
    print(f"\npin {args.pin_ms:g} ms, step {args.step_ms:g} ms, {args.steps} steps, {args.repeats} repeats "
          f"(overlapped: ~{1e3 / max(args.pin_ms, args.step_ms, 1e-9):.0f} steps/s; "
          f"inline: ~{1e3 / max(args.pin_ms + args.step_ms, 1e-9):.0f})")
    print("| loader | steps/s median [range] | data wait ms/step median [range] |\n|---|---|---|")
    for k in LOADERS:
        s, w = doc["summary"][k]["steps_per_s"], doc["summary"][k]["data_wait_ms_per_step"]
        print(f"| {k} | {s['median']:.1f} [{s['min']:.1f}-{s['max']:.1f}] | {w['median']:.2f} [{w['min']:.2f}-{w['max']:.2f}] |")
    from evaluation.report import write_json

    write_json(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
