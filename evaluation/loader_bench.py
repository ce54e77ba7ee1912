"""Benchmark of the elastic loader (a command, not a test): prints a table, writes JSON.

    python -m evaluation.loader_bench [--quick] [--out bench-out/loader_bench.json]

Three measurements:

1. Throughput against torch's DataLoader at the same worker count, on adloader.synthetic's CPU-bound
   map dataset (JPEG decode + random resized crop + flip + normalise). Two workloads: uniform
   per-sample cost (target ratio >= 0.98) and a cost that varies 10x per sample (WorkloadSpec
   cost_spread=10, small batches; target >= 1.0: the shared task queue lets a free worker take the
   next batch instead of waiting behind a slow one). Two methods: side by side (torch and adloader
   run at the same time in two processes for the same window: identical machine load; the targets
   are judged on this one) and sequential (one process, the loaders alternate epochs; exposed to the
   shared machine's load swings). Both also report CPU seconds per sample (main + workers).
2. Resize latency: a training loop (10 ms emulated step) runs while another thread calls
   resize(n); the time from the call until worker n-1 has started a task (recorded by the dataset in
   shared memory, CLOCK_MONOTONIC, which all processes share). Grow with fork (target < 100 ms) and
   spawn (informative), and shrink (until the retired worker's process is gone).
3. Instrumentation overhead: the per-step work the loader adds for its timers (the exact statements
   of ``__next__``'s accounting: two perf_counter calls, the additions, the rate-window check) and the
   per-batch timers in the worker (process_time, perf_counter, /proc/self/schedstat reads), each timed
   directly over many iterations and expressed as a fraction of a 10 ms step. This measures the timers'
   cost in isolation, not an instrumentation-off build (there is none).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.utils.data as tud  # noqa: E402

from adloader import DataLoader  # noqa: E402
from adloader._worker import RunQueueClock  # noqa: E402
from adloader.stats import LoaderCounters, RateWindow  # noqa: E402
from adloader.synthetic import SyntheticImageDataset, WorkloadSpec  # noqa: E402
from evaluation.flags import at_least, path_arg, plain_int  # noqa: E402


def machine() -> dict:
    model = ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpus": len(os.sched_getaffinity(0)), "cpu_model": model, "python": platform.python_version(),
            "torch": torch.__version__, "loadavg_at_start": os.getloadavg(),
            "kernel": platform.release()}


# ---- 1. throughput ------------------------------------------------------------------------------
def _cpu_s() -> float:
    """CPU seconds of this process and all its live children (the loaders' workers)."""
    import psutil

    total = time.process_time()
    for child in psutil.Process().children(recursive=True):
        try:
            t = child.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def _epoch(loader) -> tuple[float, float]:
    """One epoch: (samples per wall second, CPU seconds per sample over main + workers)."""
    c0 = _cpu_s()
    t0 = time.perf_counter()
    n = 0
    for batch in loader:
        n += batch[0].shape[0]
    wall = time.perf_counter() - t0
    return n / wall, (_cpu_s() - c0) / n


def throughput(spec: WorkloadSpec, *, workers: int, batch_size: int, repeats: int) -> dict:
    ds = SyntheticImageDataset(spec)
    kw = dict(batch_size=batch_size, shuffle=True, num_workers=workers, persistent_workers=True)
    loaders = {
        "torch": tud.DataLoader(ds, generator=torch.Generator().manual_seed(0), **kw),
        "adloader": DataLoader(ds, generator=torch.Generator().manual_seed(0), max_workers=workers, **kw),
    }
    for loader in loaders.values():      # warm-up epoch: workers started, caches warm
        _epoch(loader)
    rates: dict[str, list[float]] = {"torch": [], "adloader": []}
    cpu: dict[str, list[float]] = {"torch": [], "adloader": []}
    for r in range(repeats):
        order = ("torch", "adloader") if r % 2 == 0 else ("adloader", "torch")
        for name in order:
            rate, cpu_per_sample = _epoch(loaders[name])
            rates[name].append(rate)
            cpu[name].append(cpu_per_sample)
    loaders["adloader"].close()
    del loaders
    med = {k: statistics.median(v) for k, v in rates.items()}
    cpu_med = {k: statistics.median(v) for k, v in cpu.items()}
    pair_ratios = [a / t for a, t in zip(rates["adloader"], rates["torch"])]
    return {"workload": spec.name, "workers": workers, "batch_size": batch_size, "samples_per_epoch": spec.length,
            "repeats": repeats, "torch_samples_per_s": rates["torch"], "adloader_samples_per_s": rates["adloader"],
            "torch_median": med["torch"], "adloader_median": med["adloader"],
            "ratio": med["adloader"] / med["torch"], "pair_ratio_median": statistics.median(pair_ratios),
            "torch_cpu_ms_per_sample": cpu_med["torch"] * 1e3, "adloader_cpu_ms_per_sample": cpu_med["adloader"] * 1e3,
            "cpu_ratio": cpu_med["adloader"] / cpu_med["torch"]}


def _side_child(which: str, spec_json: str, workers: int, batch_size: int, duration_s: float) -> None:
    """Child process of ``side_by_side``: one loader; says "ready", runs when told "go"."""
    spec = WorkloadSpec(**json.loads(spec_json))
    ds = SyntheticImageDataset(spec)
    kw = dict(batch_size=batch_size, shuffle=True, num_workers=workers, persistent_workers=True)
    dl = (DataLoader(ds, max_workers=workers, **kw) if which == "adloader" else tud.DataLoader(ds, **kw))
    it = iter(dl)
    for _ in range(2 * workers):            # warm: workers started, first batches through
        next(it)
    print("ready", flush=True)
    sys.stdin.readline()
    c0 = _cpu_s()
    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < duration_s:
        try:
            n += next(it)[0].shape[0]
        except StopIteration:
            it = iter(dl)
    wall = time.perf_counter() - t0
    print(json.dumps({"which": which, "samples_per_s": n / wall, "cpu_ms_per_sample": (_cpu_s() - c0) / n * 1e3}),
          flush=True)
    if isinstance(dl, DataLoader):
        dl.close()


def side_by_side(spec: WorkloadSpec, *, workers: int, batch_size: int, repeats: int, duration_s: float) -> dict:
    """torch and adloader run at the same time, in two processes, for the same wall-clock window: both
    see exactly the same machine load (on a shared, noisy box, sequential runs do not). They also
    compete with each other for the cores, so the ratio compares throughput per CPU share."""
    import subprocess
    from dataclasses import asdict

    spec_json = json.dumps(asdict(spec))
    pairs = []
    for r in range(repeats):
        order = ("torch", "adloader") if r % 2 == 0 else ("adloader", "torch")
        procs = [subprocess.Popen([sys.executable, __file__, "--_side", w, spec_json, str(workers), str(batch_size),
                                   str(duration_s)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True) for w in order]
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        for p in procs:            # both start within a millisecond of each other
            p.stdin.write("go\n")
            p.stdin.flush()
        got = {}
        for p in procs:
            out, _ = p.communicate(timeout=duration_s + 120)   # closes stdin too
            row = json.loads(out.strip().splitlines()[-1])
            got[row["which"]] = row
        pairs.append(got)
    ratios = [p["adloader"]["samples_per_s"] / p["torch"]["samples_per_s"] for p in pairs]
    cpu_ratios = [p["adloader"]["cpu_ms_per_sample"] / p["torch"]["cpu_ms_per_sample"] for p in pairs]
    return {"workload": spec.name, "workers": workers, "batch_size": batch_size, "repeats": repeats,
            "duration_s": duration_s, "pairs": pairs,
            "torch_median": statistics.median(p["torch"]["samples_per_s"] for p in pairs),
            "adloader_median": statistics.median(p["adloader"]["samples_per_s"] for p in pairs),
            "ratio_median": statistics.median(ratios), "ratios": ratios,
            "cpu_ratio_median": statistics.median(cpu_ratios)}


# ---- 2. resize latency --------------------------------------------------------------------------
class StartStamp(tud.Dataset):
    """Records, per worker id, when that worker last started a task (CLOCK_MONOTONIC seconds)."""

    def __init__(self, stamps, n: int = 1_000_000, work_s: float = 0.004):
        self.stamps = stamps
        self.n = n
        self.work_s = work_s

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        info = tud.get_worker_info()
        if info is not None and self.stamps[info.id] == 0.0:
            self.stamps[info.id] = time.monotonic()
        time.sleep(self.work_s)
        return i


def resize_latency(method: str, *, grows: int, base: int, step_s: float = 0.010) -> dict:
    ctx = multiprocessing.get_context(method)
    stamps = ctx.RawArray("d", 16)
    ds = StartStamp(stamps)
    dl = DataLoader(ds, batch_size=2, num_workers=base, max_workers=base + 1, multiprocessing_context=method,
                    persistent_workers=True)
    grow_ms, shrink_ms = [], []
    stop = threading.Event()
    it = iter(dl)

    def train():
        while not stop.is_set():
            next(it)
            time.sleep(step_s)

    t = threading.Thread(target=train, daemon=True)
    t.start()
    try:
        time.sleep(1.0 if method == "fork" else 5.0)     # workers up, steady state
        new = base           # worker id that a grow to base+1 starts
        for _ in range(grows):
            stamps[new] = 0.0
            t0 = time.monotonic()
            dl.resize(base + 1)
            deadline = t0 + 30
            while stamps[new] == 0.0 and time.monotonic() < deadline:
                time.sleep(0.0005)
            grow_ms.append((stamps[new] - t0) * 1e3 if stamps[new] else float("nan"))
            time.sleep(0.2)
            pids = set(dl.worker_pids())
            assert len(pids) == base + 1
            t0 = time.monotonic()
            dl.resize(base)
            deadline = t0 + 30
            while len(dl.worker_pids()) > base and time.monotonic() < deadline:
                time.sleep(0.0005)
            shrink_ms.append((time.monotonic() - t0) * 1e3)
            time.sleep(0.1)
    finally:
        stop.set()
        t.join(timeout=10)
        dl.close()
    return {"method": method, "from_workers": base, "to_workers": base + 1, "step_s": step_s,
            "grow_ms": grow_ms, "grow_ms_median": statistics.median(grow_ms), "grow_ms_max": max(grow_ms),
            "shrink_ms": shrink_ms, "shrink_ms_median": statistics.median(shrink_ms)}


# ---- 3. instrumentation overhead ----------------------------------------------------------------
def instrumentation_overhead(n: int) -> dict:
    c = LoaderCounters()
    rates = RateWindow(c)
    perf = time.perf_counter

    def step_accounting(iters):
        # the statements __next__ runs for its timers (see _ElasticIter.__next__)
        t_last = perf()
        t = perf()
        for _ in range(iters):
            t0 = perf()
            c.compute_s += t0 - t_last
            t1 = perf()
            c.data_wait_s += t1 - t0
            c.steps += 1
            t_last = t1
            rates.maybe_record(t1)
        return perf() - t

    def empty(iters):
        t = perf()
        for _ in range(iters):
            pass
        return perf() - t

    runq = RunQueueClock()
    ptime = time.process_time

    def worker_timers(iters):
        # the per-batch timers of worker_main.run() and the stats update in the main process
        t = perf()
        for _ in range(iters):
            t0 = perf()
            c0 = ptime()
            r0 = runq.read_ns()
            header = (ptime() - c0, perf() - t0, max(0, runq.read_ns() - r0))
            c.add_batch_timing(*header)
        return perf() - t

    step_ns = (min(step_accounting(n) for _ in range(5)) - min(empty(n) for _ in range(5))) / n * 1e9
    batch_ns = (min(worker_timers(n // 10) for _ in range(5)) - min(empty(n // 10) for _ in range(5))) / (n // 10) * 1e9
    step_s = 0.010
    return {"iterations": n, "step_ns": step_ns, "step_frac_of_10ms": step_ns * 1e-9 / step_s,
            "worker_batch_ns": batch_ns, "worker_batch_frac_of_10ms": batch_ns * 1e-9 / step_s,
            "schedstat_available": runq.read_ns() > 0}


# ---- main ---------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m evaluation.loader_bench", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="about a minute instead of a few (single repeats)")
    ap.add_argument("--out", type=path_arg, default="bench-out/loader_bench.json", metavar="PATH",
                    help="write the JSON result here (default bench-out/loader_bench.json)")
    ap.add_argument("--workers", type=at_least(plain_int, 1), default=2, metavar="N",
                    help="workers of each loader in the throughput runs; the fork resize grows from it (default 2)")
    ap.add_argument("--_side", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._side:
        w, spec_json, workers, batch, dur = args._side
        _side_child(w, spec_json, int(workers), int(batch), float(dur))
        return 0
    q = args.quick
    result = {"machine": machine(), "quick": q, "command": " ".join([os.path.basename(sys.executable)] + sys.argv)}
    t_start = time.perf_counter()

    uniform = WorkloadSpec(name="uniform", num_images=32, length=256 if q else 512, image_px=160, crop_px=96)
    spread = WorkloadSpec(name="cost_spread=10", num_images=32, length=96 if q else 192, image_px=160, crop_px=96,
                          cost_spread=10.0)
    big = dict(num_images=32, length=100_000, image_px=160, crop_px=96)
    result["side_by_side"] = [
        side_by_side(WorkloadSpec(name="uniform", **big), workers=args.workers, batch_size=16,
                     repeats=1 if q else 6, duration_s=3.0 if q else 8.0),
        side_by_side(WorkloadSpec(name="cost_spread=10", cost_spread=10.0, **big), workers=args.workers,
                     batch_size=4, repeats=1 if q else 6, duration_s=3.0 if q else 8.0),
    ]
    result["throughput"] = [
        throughput(uniform, workers=args.workers, batch_size=16, repeats=3 if q else 11),
        throughput(spread, workers=args.workers, batch_size=4, repeats=3 if q else 11),
    ]
    result["resize_latency"] = [resize_latency("fork", grows=5 if q else 15, base=args.workers)]
    result["resize_latency"].append(resize_latency("spawn", grows=1 if q else 3, base=1))
    result["instrumentation"] = instrumentation_overhead(100_000 if q else 1_000_000)
    result["duration_s"] = time.perf_counter() - t_start

    th = result["throughput"]
    sbs = result["side_by_side"]
    targets = {
        "uniform_ratio>=0.98 (side by side)": sbs[0]["ratio_median"] >= 0.98,
        "spread_ratio>=1.0 (side by side)": sbs[1]["ratio_median"] >= 1.0,
        "fork_grow_median<100ms": result["resize_latency"][0]["grow_ms_median"] < 100,
        "step_overhead<1%_of_10ms": result["instrumentation"]["step_frac_of_10ms"] < 0.01,
    }
    result["targets_met"] = targets

    print(f"machine: {result['machine']['cpus']} CPUs ({result['machine']['cpu_model']}), "
          f"load avg at start {result['machine']['loadavg_at_start'][0]:.1f}, torch {torch.__version__}")
    print(f"\n{'side by side (samples/s, median)':<34}{'workers':>8}{'batch':>6}{'torch':>9}{'adloader':>9}"
          f"{'ratio (median of pairs)':>25}{'CPU/sample ratio':>18}")
    for r in sbs:
        print(f"{r['workload']:<34}{r['workers']:>8}{r['batch_size']:>6}{r['torch_median']:>9.1f}"
              f"{r['adloader_median']:>9.1f}{r['ratio_median']:>25.3f}{r['cpu_ratio_median']:>18.3f}")
    print(f"\n{'sequential, alternating epochs':<32}{'workers':>8}{'batch':>6}{'torch':>9}{'adloader':>9}"
          f"{'ratio':>7}{'pair-med':>9}{'CPU ms/sample t/a':>20}{'CPU ratio':>10}")
    for r in th:
        print(f"{r['workload']:<32}{r['workers']:>8}{r['batch_size']:>6}{r['torch_median']:>9.1f}"
              f"{r['adloader_median']:>9.1f}{r['ratio']:>7.3f}{r['pair_ratio_median']:>9.3f}"
              f"{r['torch_cpu_ms_per_sample']:>10.3f}/{r['adloader_cpu_ms_per_sample']:<9.3f}{r['cpu_ratio']:>10.3f}")
    print(f"\n{'resize latency':<34}{'from->to':>10}{'grow med ms':>13}{'grow max ms':>13}{'shrink med ms':>15}")
    for r in result["resize_latency"]:
        print(f"{r['method']:<34}{str(r['from_workers']) + '->' + str(r['to_workers']):>10}"
              f"{r['grow_ms_median']:>13.1f}{r['grow_ms_max']:>13.1f}{r['shrink_ms_median']:>15.1f}")
    ins = result["instrumentation"]
    print(f"\ninstrumentation: {ins['step_ns']:.0f} ns per step ({ins['step_frac_of_10ms'] * 100:.4f}% of a 10 ms step); "
          f"worker timers {ins['worker_batch_ns']:.0f} ns per batch ({ins['worker_batch_frac_of_10ms'] * 100:.3f}% of 10 ms); "
          f"schedstat {'available' if ins['schedstat_available'] else 'missing'}")
    print("\ntargets: " + ", ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in targets.items()))
    print(f"duration {result['duration_s']:.0f} s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
