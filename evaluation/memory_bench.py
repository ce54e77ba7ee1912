"""What measuring loader memory costs, and what it sees: ``python -m evaluation.memory_bench``.

For a dataset of Python objects (a list of dicts, the copy-on-read pattern) and the same data in one
numpy array, with W real workers (fork), it runs whole epochs and reports:

- the CPU cost of one memory sample per worker (``smaps_rollup`` read and parse, the sampling
  thread's CPU time; median and range over the samples), and what that is as a share of one core at
  the sampler's period (the loader samples at most every 2 s and at most 1% of a core);
- each worker's USS, PSS and USS growth at the end of the run (copy-on-read shows as growth);
- the cost of sizing a delivered batch (``batch_nbytes``, done every 16th step).

With ``--gc-collect`` each worker runs one full garbage collection at its first sample (as a library
in the pipeline calling ``gc.collect()`` does, or the collection that the gc counters a worker inherits
from its fork can bring at its first allocations): it writes the header of every container it walks,
so any inherited object it walks is copied into the worker (the loader keeps the inherited ones
frozen for that reason: ``adloader._pool._start_process``).

Prints a table and writes JSON (``--out``). Timing figures on a shared machine are noisy: medians
and ranges are given, and the machine's load should be stated with them.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

MiB = 1 << 20


def _datasets(n: int, gc_collect: bool = False):
    import gc

    import numpy as np
    import torch

    collected = []      # per process: a forked worker starts with the parent's (empty) list

    def first_item() -> None:
        if gc_collect and not collected:
            collected.append(os.getpid())
            gc.collect()

    class ObjectRows(torch.utils.data.Dataset):
        def __init__(self):
            self.rows = [{"id": i, "name": f"sample-{i:08d}", "vals": [float(i), 1.0, 2.0, 3.0]} for i in range(n)]

        def __len__(self):
            return len(self.rows)

        def __getitem__(self, i):
            first_item()
            return torch.tensor(self.rows[i]["vals"])

    class ArrayRows(torch.utils.data.Dataset):
        def __init__(self):
            self.vals = np.ones((n, 4))

        def __len__(self):
            return len(self.vals)

        def __getitem__(self, i):
            first_item()
            return torch.from_numpy(self.vals[i].copy())

    return {"python-objects": ObjectRows, "numpy-array": ArrayRows}


def run_one(make, workers: int, epochs: int, batch_size: int, loader: str = "adloader") -> dict:
    """One dataset's run. ``loader`` "torch": torch's own DataLoader (persistent workers, fork), its
    workers measured by the same sampler (adloader's own ``WorkerMemorySampler``) from their pids."""
    import torch

    from adloader import DataLoader
    from adloader.memory import WorkerMemorySampler, batch_nbytes

    ds = make()
    if loader == "torch":
        dl = torch.utils.data.DataLoader(ds, batch_size=batch_size, num_workers=workers, persistent_workers=True,
                                         multiprocessing_context="fork")
        sampler = WorkerMemorySampler()
        it = iter(dl)

        def pids() -> list[int]:
            return [w.pid for w in it._workers]     # torch's _MultiProcessingDataLoaderIter, persistent

        def close() -> None:
            it._shutdown_workers()
    else:
        dl = DataLoader(ds, batch_size=batch_size, num_workers=workers, persistent_workers=True,
                        multiprocessing_context="fork")
        sampler = dl._core.memory
        it = iter(dl)
        pids, close = dl.worker_pids, dl.close
    costs = []
    nbytes_s = []
    try:
        next(it)
        sampler.sample(pids(), force=True)
        t_last = time.monotonic()
        for _ in range(epochs):
            for b in it:
                if time.monotonic() - t_last > 0.5:
                    t_last = time.monotonic()
                    s = sampler.sample(pids(), force=True)
                    costs.append(s.sample_cost_s / max(1, s.workers))
                    t0 = time.thread_time()
                    batch_nbytes(b)
                    nbytes_s.append(time.thread_time() - t0)
            it = iter(dl)
        s = sampler.sample(pids(), force=True)
    finally:
        close()
    return {"workers": s.workers, "uss_per_worker": s.uss_per_worker, "pss_per_worker": s.pss_per_worker,
            "growth_per_worker": s.growth_per_worker, "samples": len(costs),
            "sample_cpu_s_per_worker_median": statistics.median(costs) if costs else None,
            "sample_cpu_s_per_worker_min": min(costs) if costs else None,
            "sample_cpu_s_per_worker_max": max(costs) if costs else None,
            "batch_nbytes_s_median": statistics.median(nbytes_s) if nbytes_s else None}


def main(argv=None) -> int:
    from evaluation.flags import at_least, path_arg, plain_int

    ap = argparse.ArgumentParser(prog="python -m evaluation.memory_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=at_least(plain_int, 1), default=2, help="loader workers (fork; default 2)")
    ap.add_argument("--rows", type=at_least(plain_int, 1), default=200_000, help="rows of the dataset (default 200000)")
    ap.add_argument("--epochs", type=at_least(plain_int, 1), default=2, help="whole epochs run per dataset (default 2)")
    ap.add_argument("--batch-size", type=at_least(plain_int, 1), default=256, help="the loader's batch size (default 256)")
    ap.add_argument("--gc-collect", action="store_true",
                    help="each worker runs one full gc collection at its first sample (module docstring)")
    ap.add_argument("--loader", choices=("adloader", "torch"), default="adloader",
                    help="whose workers are measured: adloader.DataLoader's (default) or torch's own DataLoader's "
                         "(fork, persistent workers; the same sampler reads them)")
    ap.add_argument("--out", type=path_arg, default=None, help="write the JSON result here")
    args = ap.parse_args(argv)
    res = {}
    for name, make in _datasets(args.rows, args.gc_collect).items():
        res[name] = run_one(make, args.workers, args.epochs, args.batch_size, args.loader)
    print(f"memory measurement, {args.loader} workers: {args.workers}, {args.rows} rows, {args.epochs} epochs"
          f"{', a full gc collection in each worker' if args.gc_collect else ''} "
          f"({platform.node()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f})")
    print("| dataset | USS / worker MiB | PSS / worker MiB | USS growth / worker MiB | sample CPU ms / worker, "
          "median (min-max) | sampling period with 8 workers under the 1% cap | batch_nbytes µs |")
    print("|---|---|---|---|---|---|---|")
    for name, r in res.items():
        med = r["sample_cpu_s_per_worker_median"] or 0.0
        print(f"| {name} | {r['uss_per_worker'] / MiB:.1f} | {r['pss_per_worker'] / MiB:.1f} | "
              f"{r['growth_per_worker'] / MiB:.1f} | {med * 1e3:.2f} ({(r['sample_cpu_s_per_worker_min'] or 0) * 1e3:.2f}"
              f"-{(r['sample_cpu_s_per_worker_max'] or 0) * 1e3:.2f}) | {max(2.0, 8 * med / 0.01):.1f} s | "
              f"{(r['batch_nbytes_s_median'] or 0) * 1e6:.1f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": res, "load1": os.getloadavg()[0]}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
