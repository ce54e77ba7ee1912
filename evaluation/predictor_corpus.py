"""Measure real throughput curves of synthetic training jobs: the predictor's ground truth and prior.

    python -m evaluation.predictor_corpus [--out predictor/data/corpus.jsonl] [--window-s 2.5]
        [--jobs light,heavy,...] [--workers 1,2,3,4,6,8] [--cores 0.5,1,2]

For each job (``adloader.synthetic`` workload + an emulated GPU step of ``step_s``), for each worker
count and CPU allowance, run a real DataLoader with real worker processes for a short window and
record the delivered samples/s and the ``Observation`` window (per-step compute and data wait measured
in the training loop; per-batch CPU, wall, run-queue delay and blocked time measured INSIDE the worker
around each batch's fetch + collate, as ``adloader.DataLoader.stats()`` does).

CPU allowance applies to the loader's worker processes only (the training process is never throttled,
as with the agent): whole cores by ``sched_setaffinity`` in ``worker_init_fn``; a fractional allowance
by a cgroup v1 CPU quota group this command creates, ``adloader-corpus-<pid>`` in the cpu hierarchy (found
at its mount point under /sys/fs/cgroup), and removes at exit (needs root; without root fractional
points are skipped and the header says so).

Loader (``--loader``): ``adloader.DataLoader`` when it is importable (its ``stats()`` totals), else
torch's DataLoader with the same in-worker measurement (a batch-level dataset wrapper). The shipped
corpus was measured with ``adloader.DataLoader`` on a quiet 2-CPU VM (3 sweeps; the header of each
sweep says which loader, the machine and what else ran: ``--note``). Output: JSON lines; a header line
per sweep (pass) with the command and the machine, then one line per point with the 1-minute load
average while it was measured. Repeat sweeps (``--append --pass-id 2``) to see the noise.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

CGROUP_ROOT = "/sys/fs/cgroup"      # the v1 cpu hierarchy is found at its mount point under it

# name -> (WorkloadSpec overrides, batch_size, emulated step seconds). Light, balanced, heavy, IO-bound.
JOBS: dict[str, tuple[dict, int, float]] = {
    "light": (dict(image_px=96, crop_px=64), 32, 0.020),
    "light-fast": (dict(image_px=96, crop_px=64), 32, 0.008),
    "balanced": (dict(), 32, 0.015),
    "balanced-slow": (dict(), 32, 0.040),
    "heavy": (dict(aug_multiplier=3), 32, 0.040),
    "heavy-big": (dict(image_px=256, crop_px=160, aug_multiplier=2), 16, 0.015),
    "spread": (dict(cost_spread=3.0), 32, 0.030),
    "io": (dict(image_px=96, crop_px=64, io_sleep_s=0.004), 16, 0.020),
    "io-heavy": (dict(image_px=96, crop_px=64, io_sleep_s=0.010), 16, 0.030),
    "io-cpu": (dict(io_sleep_s=0.002), 32, 0.025),
}


def _runq_ns() -> int:
    """Run-queue delay of this process so far (/proc/self/schedstat field 2, ns; kernel sched-stats.rst)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return 0


class TimedBatches:
    """Batch-level dataset: ``ds[list_of_indices]`` fetches and collates one batch in the worker and
    returns (batch, (cpu_s, wall_s, runq_s)) measured around that work."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, indices):
        import torch.utils.data

        r0, c0, w0 = _runq_ns(), time.process_time(), time.perf_counter()
        batch = torch.utils.data.default_collate([self.dataset[i] for i in indices])
        wall, cpu, runq = time.perf_counter() - w0, time.process_time() - c0, (_runq_ns() - r0) / 1e9
        return batch, (cpu, wall, runq)


def _cpu_hierarchy():
    """The cgroup v1 cpu hierarchy, at its mount point under ``CGROUP_ROOT``, through ``agent.cgroupfs``
    (the one module that writes cgroups)."""
    from agent.cgroupfs import v1_hierarchy

    return v1_hierarchy(CGROUP_ROOT, "cpu")


class CpuLimit:
    """Where the loader workers of one measurement may run: None (all CPUs), whole cores (affinity),
    or a fractional quota (``cgroup``: a cgroup v1 group with cpu.cfs_quota_us, by its name in the cpu
    hierarchy). Picklable: workers apply it, each moving itself (all its threads) into the group."""

    def __init__(self, cores: float, all_cpus: list[int], cgroup: str | None):
        self.cores = cores
        self.cpus = all_cpus[: max(1, math.ceil(cores))]
        self.cgroup = cgroup

    def __call__(self, worker_id: int) -> None:
        os.sched_setaffinity(0, self.cpus)
        if self.cgroup is not None:
            _cpu_hierarchy().move(self.cgroup, os.getpid())


def make_cgroup(cores: float) -> str:
    """A group of the cpu hierarchy with a quota of ``cores``; its name."""
    h, rel = _cpu_hierarchy(), f"adloader-corpus-{os.getpid()}"
    h.mkdir(rel)
    period = 100_000
    h.write(rel, "cpu.cfs_period_us", period)
    h.write(rel, "cpu.cfs_quota_us", max(1000, int(cores * period)))
    return rel


def remove_cgroup(rel: str) -> None:
    from agent.cgroupfs import CgroupError

    h = _cpu_hierarchy()
    if not h.exists(rel):
        return
    try:
        for pid in h.procs(rel):  # leftover processes go back to the root group
            try:
                h.move("", pid)
            except CgroupError:
                pass
        h.rmdir(rel)
    except CgroupError as e:
        print(f"corpus: could not remove {h.path(rel)}: {e}", file=sys.stderr)


def measure_point(dataset, batch_size: int, step_s: float, workers: int, limit: CpuLimit,
                  window_s: float, warmup_s: float, seed: int) -> dict:
    """Run one configuration (workers >= 1); return {samples_per_s, observation{...}}."""
    if workers < 1:
        raise ValueError("the corpus measures loader worker processes: workers must be >= 1")
    import torch
    import torch.utils.data
    from adloader.synthetic import emulated_step
    from predictor.observation import Observation

    gen = torch.Generator().manual_seed(seed)
    sampler = torch.utils.data.BatchSampler(
        torch.utils.data.RandomSampler(range(len(dataset)), replacement=True, num_samples=10**7, generator=gen),
        batch_size, drop_last=True)
    loader = torch.utils.data.DataLoader(
        TimedBatches(dataset), batch_size=None, sampler=sampler, num_workers=workers,
        worker_init_fn=limit, prefetch_factor=2, persistent_workers=False)
    it = iter(loader)
    t_start = time.perf_counter()
    steps = 0
    wait_s = compute_s = 0.0
    cpu = wall = runq = 0.0
    batches = 0
    t_window = None
    try:
        while True:
            t0 = time.perf_counter()
            batch, (b_cpu, b_wall, b_runq) = next(it)
            t1 = time.perf_counter()
            emulated_step(batch, step_s)
            t2 = time.perf_counter()
            if t_window is None:
                if t2 - t_start >= warmup_s and steps >= 2 * max(1, workers):
                    t_window = t2
                steps += 1
                continue
            steps += 1
            wait_s += t1 - t0
            compute_s += t2 - t1
            cpu, wall, runq, batches = cpu + b_cpu, wall + b_wall, runq + b_runq, batches + 1
            if t2 - t_window >= window_s and batches >= 4:
                break
        duration = time.perf_counter() - t_window
    finally:
        del it
    n = batches
    obs = Observation(
        workers=workers, cores=float(limit.cores), batch_size=batch_size,
        compute_s_per_step=compute_s / n, data_wait_s_per_step=wait_s / n,
        cpu_s_per_batch=cpu / n, wall_s_per_batch=wall / n, runq_s_per_batch=runq / n,
        blocked_s_per_batch=max(0.0, (wall - cpu - runq) / n),
        samples_per_s=n * batch_size / duration, duration_s=duration, steps=n)
    return {"samples_per_s": obs.samples_per_s, "observation": obs.to_dict()}


def measure_point_adloader(dataset, batch_size: int, step_s: float, workers: int, limit: CpuLimit,
                           window_s: float, warmup_s: float, seed: int) -> dict:
    """Same as ``measure_point`` with the elastic ``adloader.DataLoader``: the window is the difference
    of two ``loader.stats()`` totals (its own in-worker timing and step timer)."""
    import torch

    from adloader import DataLoader
    from adloader.autotune import observation_from_totals
    from adloader.synthetic import emulated_step

    torch.manual_seed(seed)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True, num_workers=workers,
                        max_workers=workers, worker_init_fn=limit, prefetch_factor=2)
    try:
        t_start = time.perf_counter()
        first = last = None
        while True:
            for batch in loader:
                emulated_step(batch, step_s)
                now = time.perf_counter()
                if first is None:
                    st = loader.stats()
                    if now - t_start >= warmup_s and st["steps"] >= 2 * workers and st["live_workers"] == workers:
                        first, t_window = st, now
                elif now - t_window >= window_s:
                    last = loader.stats()
                    if last["steps"] - first["steps"] >= 4:
                        break
            if last is not None and last["steps"] - first["steps"] >= 4:
                break
    finally:
        loader.close()
    obs = observation_from_totals(first, last, float(limit.cores), strict=False)
    return {"samples_per_s": obs.samples_per_s, "observation": obs.to_dict()}


def limit_all_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def main(argv: list[str] | None = None) -> int:
    from evaluation.flags import above, at_least, comma_list, finite_float, names_arg, path_arg, plain_int

    ap = argparse.ArgumentParser(prog="python -m evaluation.predictor_corpus", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=path_arg, default=str(REPO / "predictor" / "data" / "corpus.jsonl"), metavar="PATH",
                    help="the corpus file, JSON lines (default predictor/data/corpus.jsonl: the shipped corpus)")
    ap.add_argument("--jobs", type=names_arg, default=",".join(JOBS), metavar="LIST",
                    help=f"synthetic jobs, comma-separated (default all: {','.join(JOBS)})")
    ap.add_argument("--workers", type=comma_list(at_least(plain_int, 1)), default="1,2,3,4,6,8", metavar="LIST",
                    help="worker counts (at least 1), comma-separated (default 1,2,3,4,6,8)")
    ap.add_argument("--cores", type=comma_list(above(finite_float, 0)), default="0.5,1,2", metavar="LIST",
                    help="CPU allowances of the workers in cores (above 0), comma-separated; fractional ones need root "
                         "(default 0.5,1,2)")
    ap.add_argument("--window-s", type=above(finite_float, 0), default=2.5, metavar="S", help="measured seconds per point (default 2.5)")
    ap.add_argument("--warmup-s", type=at_least(finite_float, 0), default=0.8, metavar="S",
                    help="seconds before each point's window (default 0.8)")
    ap.add_argument("--loader", choices=("auto", "torch", "adloader"), default="auto",
                    help="auto: adloader.DataLoader when importable, else torch's with in-worker timing")
    ap.add_argument("--pass-id", type=plain_int, default=1,
                    help="label of this sweep (repeat sweeps to see the noise; default 1)")
    ap.add_argument("--note", default="", help="what else ran on the machine (recorded in the sweep's header)")
    ap.add_argument("--append", action="store_true", help="add this sweep to --out (a header line per sweep)")
    args = ap.parse_args(argv)

    import warnings

    import torch

    from adloader.synthetic import SyntheticImageDataset, WorkloadSpec

    # more workers than CPUs is the point of the sweep; torch's advice about it is noise here
    warnings.filterwarnings("ignore", message=".*worker processes in total.*")
    torch.set_num_threads(1)
    all_cpus = limit_all_cpus()
    jobs = [j.strip() for j in args.jobs.split(",") if j.strip()]
    unknown = [j for j in jobs if j not in JOBS]
    if unknown:
        ap.error(f"unknown job(s) {unknown}; known: {', '.join(JOBS)}")
    worker_counts, core_counts = args.workers, args.cores
    is_root = os.geteuid() == 0 and _cpu_hierarchy().has_file("", "cpu.cfs_quota_us")
    skipped = [c for c in core_counts if c != int(c) and not is_root]
    core_counts = [c for c in core_counts if c not in skipped]

    use_adloader = args.loader == "adloader"
    if args.loader == "auto":
        try:
            import adloader.dataloader  # noqa: F401
            use_adloader = True
        except ImportError:
            use_adloader = False
    if use_adloader:
        os.environ["ADLOADER_DISABLE"] = "1"  # measure the loader alone: no agent client
    measure = measure_point_adloader if use_adloader else measure_point
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    header = {
        "kind": "header", "format": 1, "pass": args.pass_id,
        "command": "python -m evaluation.predictor_corpus " + " ".join(argv if argv is not None else sys.argv[1:]),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": f"{platform.node()}: {len(all_cpus)} CPUs, {platform.platform()}"
                   + (f"; {args.note}" if args.note else ""),
        "loadavg_1m_start": round(os.getloadavg()[0], 2),
        "loader": ("adloader.DataLoader (stats() totals)" if use_adloader
                   else "torch.utils.data.DataLoader + in-worker batch timing"),
        "window_s": args.window_s, "skipped_cores_not_root": skipped,
        "jobs": {j: {"spec": JOBS[j][0], "batch_size": JOBS[j][1], "step_s": JOBS[j][2]} for j in jobs},
    }
    t_all = time.perf_counter()
    with open(out, "a" if args.append else "w") as f:
        f.write(json.dumps(header) + "\n")
        for ji, job in enumerate(jobs):
            spec_kw, bs, step_s = JOBS[job]
            dataset = SyntheticImageDataset(WorkloadSpec(name=job, num_images=128, length=4096, seed=ji, **spec_kw))
            for cores in core_counts:
                cg = make_cgroup(cores) if cores != int(cores) else None
                try:
                    limit = CpuLimit(cores, all_cpus, cg)
                    for w in worker_counts:
                        pt = measure(dataset, bs, step_s, w, limit, args.window_s, args.warmup_s, seed=ji)
                        rec = {"kind": "point", "pass": args.pass_id, "job": job, "workers": w, "cores": cores,
                               "loadavg_1m": os.getloadavg()[0], **pt}
                        f.write(json.dumps(rec) + "\n")
                        f.flush()
                        o = pt["observation"]
                        print(f"{job:14s} w={w} cores={cores:<4g} {pt['samples_per_s']:8.1f} samples/s "
                              f"c={o['cpu_s_per_batch'] * 1e3:6.1f}ms b={o['blocked_s_per_batch'] * 1e3:6.1f}ms "
                              f"runq={o['runq_s_per_batch'] * 1e3:6.1f}ms wait={o['data_wait_s_per_step'] * 1e3:6.1f}ms "
                              f"g={o['compute_s_per_step'] * 1e3:5.1f}ms load={rec['loadavg_1m']:.1f}", flush=True)
                finally:
                    if cg is not None:
                        remove_cgroup(cg)
    print(f"corpus: {out} written in {time.perf_counter() - t_all:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
