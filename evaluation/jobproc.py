"""One bench job: a real training process on ``adloader.DataLoader`` over generated JPEGs.

    python -m evaluation.jobproc --spec JSON --progress FILE [--workers N|auto] [--max-workers N]
                                  [--duration-s S] [--device cpu|cuda] [--sweep 1,2,3 --segment-s S]
                                  [--lockstep]

The step emulates a GPU (``adloader.synthetic.emulated_step``: host-side copy, the spec's
``trainer_cpu_frac * step_s`` seconds of real CPU work per GPU rank (one thread each, in lockstep), then a
sleep for the rest of the calibrated ``step_s``) or, with ``--device cuda``, the same CPU part followed by a
real model step on the GPU (host-to-device copy of the batch, forward, backward and optimizer step of a
ResNet-18 from torchvision, or a small conv net without it, synchronised), then a sleep for whatever is left
of ``step_s``: one physical GPU stands in for the job's ``gpus`` and is shared with the other jobs, so the
real kernels take part of each step and the rest stays emulated (``gpu_s`` in the start record says how
much). A step whose real part is longer than ``step_s`` sets the ceiling (``step_s`` in the start record).

It connects to the node agent by itself (the loader's client reads ADLOADER_ENDPOINT/ADLOADER_JOB_ID).

Progress file: JSON lines, appended and flushed, read by the harness while the job runs:
    {"event": "start", "t", "pid", "job", "step_s", "batch_size", "loader": "adloader"|"torch"}
    {"t", "samples", "steps", "wait_s", "compute_s", "workers", "live", "resizes", "cpu_s", "main_cpu_s", "main_runq_s"}   every ~0.25 s
    {"event": "segment", "t", "workers"}          (sweep mode: a new worker count from here on)
    {"event": "phase", "t", "index"}              (the spec's ``phases``: its pipeline is the index-th's from here on)
    {"event": "done", "t", "samples", "reason"}   ("work" | "duration" | "signal" | "sweep")
``t`` is ``time.monotonic()`` (system-wide on Linux, so comparable across processes); counters are
cumulative; ``cpu_s`` is the loader workers' CPU seconds, ``main_cpu_s`` the training process's own
(every thread of it); ``main_runq_s`` the time its threads waited runnable for a CPU; ``wait_s`` the time blocked in ``next()``.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

PROGRESS_EVERY_S = 0.25


class _Progress:
    def __init__(self, path: str):
        self.f = open(path, "a", buffering=1)

    def write(self, rec: dict) -> None:
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()


class PhasedDataset:
    """The spec's pipeline, then each of its ``phases`` (``after_s`` from the job's start): a map-style
    dataset whose workers (each its own copy, forked or spawned, started now or later by a resize) take
    the next phase's pipeline once the training process has created ``FLAG.<k>``, a file: what a curriculum
    that turns augmentation up, or the next dataset in the queue, does to a loader mid-run. A stat per
    sample (microseconds, against the milliseconds a sample costs)."""

    def __init__(self, datasets: list, flag: str):
        self.datasets, self.flag, self.k = datasets, flag, 0

    def __len__(self) -> int:
        return len(self.datasets[0])

    def __getitem__(self, index):
        while self.k + 1 < len(self.datasets) and os.path.exists(f"{self.flag}.{self.k + 1}"):
            self.k += 1
        return self.datasets[self.k][index]

    def begin(self, k: int) -> None:
        """In the training process: phase ``k`` (1, 2, ...) starts in every worker."""
        with open(f"{self.flag}.{k}", "w"):
            pass
        self.k = k


_BALLAST: list = []


def hold_worker_ram(mb: float, worker_id: int) -> None:
    """``worker_init_fn``: the worker holds ``mb`` MiB of private memory, every page touched (what a
    worker's copy of a dataset index and its decode buffers cost; ``worker_ram_mb`` in the catalogue)."""
    n = int(mb * 1024 * 1024)
    if n > 0:
        buf = bytearray(n)
        buf[::4096] = b"\x01" * len(range(0, n, 4096))
        _BALLAST.append(buf)


def _make_loader(ds, batch_size: int, workers, max_workers, worker_ram_mb: float = 0.0):
    """adloader.DataLoader when it exists; else torch's (fixed workers; said in the start record)."""
    try:
        from adloader.dataloader import DataLoader
    except ImportError:
        import torch.utils.data

        n = os.cpu_count() if workers == "auto" else int(workers)
        return torch.utils.data.DataLoader(ds, batch_size=batch_size, shuffle=True, num_workers=n,
                                           persistent_workers=n > 0, prefetch_factor=2 if n else None), "torch"
    kw = {}
    if max_workers is not None:
        kw["max_workers"] = max_workers
    if worker_ram_mb > 0:
        import functools

        kw["worker_init_fn"] = functools.partial(hold_worker_ram, worker_ram_mb)
    return DataLoader(ds, batch_size=batch_size, shuffle=True, num_workers=workers, **kw), "adloader"


def _main_runq_s() -> float:
    """Seconds the training process's threads waited runnable for a CPU (second field of each
    ``/proc/self/task/<tid>/schedstat``, nanoseconds; summed over its threads); 0 where unreadable."""
    total = 0
    try:
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[1])
            except (OSError, IndexError, ValueError):
                pass
    except OSError:
        return 0.0
    return total * 1e-9


def _worker_cpu_s(loader, kind: str, me) -> float:
    if kind == "adloader":
        try:
            return float(loader.stats().get("worker_cpu_s", 0.0))
        except Exception:
            pass
    total = 0.0
    for c in me.children(recursive=True):
        try:
            t = c.cpu_times()
            total += t.user + t.system
        except Exception:
            pass
    return total


def _cuda_model(torch):
    """A real model: torchvision's ResNet-18 where torchvision is installed, else a small conv net."""
    try:
        import torchvision

        return torchvision.models.resnet18(num_classes=1000), "resnet18"
    except ImportError:
        nn = torch.nn
        return nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(64 * 16, 1000)), "convnet"


def _cuda_step_fn(batch_size: int, crop_px: int):
    """-> (step(batch), seconds one step takes here alone, model name). The step copies the batch to the
    GPU, runs forward, backward and an SGD step, and waits for the GPU."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("adloader bench: --device cuda needs a CUDA GPU and a CUDA build of torch; "
                         f"torch {torch.__version__} reports none here (use --device emulated)")
    dev = torch.device("cuda")
    model, name = _cuda_model(torch)
    model = model.to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(batch) -> None:
        x, y = batch
        x = x.to(dev, non_blocking=True)
        y = torch.as_tensor(y).to(dev, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()
        torch.cuda.synchronize()

    x = torch.randn(batch_size, 3, crop_px, crop_px)
    y = torch.randint(0, 1000, (batch_size,))
    for _ in range(5):
        step((x, y))
    t0 = time.perf_counter()
    for _ in range(20):
        step((x, y))
    return step, (time.perf_counter() - t0) / 20, name


def main(argv=None) -> int:
    from evaluation.flags import above, at_least, comma_list, finite_float, plain_int

    count = at_least(plain_int, 0)   # a loader's num_workers: 0 loads in the training process

    def workers_arg(text: str):
        return text if text == "auto" else count(text)

    ap = argparse.ArgumentParser(prog="evaluation.jobproc")
    ap.add_argument("--spec", required=True, help="JobSpec as JSON")
    ap.add_argument("--progress", required=True)
    ap.add_argument("--workers", type=workers_arg, default="auto", metavar="N|auto",
                    help="the loader's num_workers: an integer >= 0, or auto (the default)")
    ap.add_argument("--max-workers", type=count, default=None,
                    help="the loader's max_workers (an integer >= 0; default: the loader's own bound)")
    ap.add_argument("--duration-s", type=above(finite_float, 0), default=None)
    ap.add_argument("--device", choices=("emulated", "cuda"), default="emulated")
    ap.add_argument("--sweep", type=comma_list(count), default=None,
                    help="comma-separated worker counts (integers >= 0), one segment each")
    ap.add_argument("--segment-s", type=above(finite_float, 0), default=3.0)
    ap.add_argument("--total-steps", type=count, default=None,
                    help="tell the loader the job's steps (DataLoader.set_total_steps): a job that knows its length")
    ap.add_argument("--lockstep", action="store_true",
                    help="one rank of a data-parallel job: with WORLD_SIZE > 1 in the environment, join the "
                         "job's torch.distributed group (gloo, env:// rendezvous: MASTER_ADDR, MASTER_PORT, "
                         "RANK, WORLD_SIZE) and all-reduce one number after every step, as its gradient "
                         "all-reduce would: every rank steps at the slowest one's pace")
    args = ap.parse_args(argv)
    if (args.max_workers is not None and not args.sweep and args.workers != "auto"
            and args.workers > args.max_workers):   # (the loader's ValueError, as a traceback)
        ap.error(f"--workers {args.workers} exceeds --max-workers {args.max_workers}")

    import psutil
    import torch

    from adloader.synthetic import SyntheticImageDataset, WorkloadSpec, emulated_step

    spec = json.loads(args.spec)
    torch.set_num_threads(1)
    stop = {"signal": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__("signal", True))
    prog = _Progress(args.progress)
    ds = SyntheticImageDataset(WorkloadSpec(**spec["workload"]))
    phases = sorted(spec.get("phases") or [], key=lambda p: float(p["after_s"]))
    if phases:
        for k in range(1, len(phases) + 1):      # a flag left by an earlier run of this progress file
            try:
                os.unlink(f"{args.progress}.phase.{k}")
            except FileNotFoundError:
                pass
        # (a later phase's samples keep the first's size, the model's input: a batch that straddles the
        # change collates)
        crop = spec["workload"].get("crop_px")
        ds = PhasedDataset([ds] + [SyntheticImageDataset(WorkloadSpec(**{**p["workload"], "crop_px": crop}))
                                   for p in phases], f"{args.progress}.phase")
    batch_size = int(spec["batch_size"])
    step_s = float(spec["step_s"])
    ranks = int(spec.get("gpus") or 1)
    trainer_cpu_s = float(spec.get("trainer_cpu_frac") or 0.0) * step_s
    gpu = {}
    if args.device == "cuda":
        from adloader.synthetic import burn_parallel

        cuda_step, gpu_s, model = _cuda_step_fn(batch_size, int(spec["workload"]["crop_px"]))
        rest_s = max(0.0, step_s - trainer_cpu_s - gpu_s)    # the emulated rest of the GPU's work
        step_s = trainer_cpu_s + gpu_s + rest_s
        gpu = {"gpu_s": gpu_s, "model": model}

        def do_step(batch):
            if trainer_cpu_s > 0:
                burn_parallel(trainer_cpu_s, ranks)
            cuda_step(batch)       # slowed by a starved launch thread or a busy GPU: the step lengthens
            if rest_s > 0:
                time.sleep(rest_s)
    else:
        def do_step(batch):
            emulated_step(batch, step_s, trainer_cpu_s, ranks)
    world = int(os.environ.get("WORLD_SIZE") or 1) if args.lockstep else 1
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        one_step = do_step

        def do_step(batch):     # the all-reduce is part of the step, as a DDP backward's is
            one_step(batch)
            dist.all_reduce(torch.ones(1))
    sweep = args.sweep
    workers = sweep[0] if sweep else args.workers
    max_workers = args.max_workers
    if sweep:  # the loader's default bound is the CPU count; a sweep may go past it
        max_workers = max(max_workers or 0, max(sweep))
    loader, kind = _make_loader(ds, batch_size, workers, max_workers, float(spec.get("worker_ram_mb") or 0.0))
    if args.total_steps is not None and hasattr(loader, "set_total_steps"):
        loader.set_total_steps(args.total_steps)
    me = psutil.Process()
    target = spec.get("samples")
    t_start = time.monotonic()
    prog.write({"event": "start", "t": t_start, "pid": os.getpid(), "job": spec["job_id"], "step_s": step_s,
                "batch_size": batch_size, "loader": kind, "device": args.device, **gpu})
    samples = steps = 0
    wait_s = compute_s = 0.0
    last_report = 0.0
    seg_i, seg_t0 = 0, None
    reason = "signal"

    def record(now):
        live = getattr(loader, "worker_pids", None)
        try:
            live_n = len(live()) if callable(live) else loader.num_workers
        except Exception:
            live_n = -1
        resizes, left = 0, {}
        if kind == "adloader":
            try:
                st = loader.stats()
                resizes = int(st.get("resizes", 0))
                if "steps_left" in st:
                    left = {"steps_left": st["steps_left"]}
            except Exception:
                pass
        prog.write({"t": now, "samples": samples, "steps": steps, "wait_s": wait_s, "compute_s": compute_s,
                    "workers": int(loader.num_workers), "live": live_n, "resizes": resizes, **left,
                    "cpu_s": _worker_cpu_s(loader, kind, me), "main_cpu_s": time.process_time(),
                    "main_runq_s": _main_runq_s()})

    try:
        done = False
        while not done:
            it = iter(loader)
            while True:
                t0 = time.monotonic()
                try:
                    batch = next(it)
                except StopIteration:
                    break
                t1 = time.monotonic()
                do_step(batch)
                t2 = time.monotonic()
                wait_s += t1 - t0
                compute_s += t2 - t1
                steps += 1
                samples += batch_size
                if seg_t0 is None:
                    seg_t0 = t2
                    if sweep:
                        prog.write({"event": "segment", "t": t2, "workers": sweep[0]})
                if t2 - last_report >= PROGRESS_EVERY_S:
                    record(t2)
                    last_report = t2
                if phases and ds.k < len(phases) and t2 - t_start >= float(phases[ds.k]["after_s"]):
                    ds.begin(ds.k + 1)
                    prog.write({"event": "phase", "t": t2, "index": ds.k})
                if stop["signal"]:
                    reason, done = "signal", True
                elif target is not None and samples >= target:
                    reason, done = "work", True
                elif args.duration_s is not None and t2 - t_start >= args.duration_s:
                    reason, done = "duration", True
                elif sweep and t2 - seg_t0 >= args.segment_s:
                    seg_i += 1
                    if seg_i >= len(sweep):
                        reason, done = "sweep", True
                    else:
                        seg_t0 = t2
                        if hasattr(loader, "resize"):
                            loader.resize(sweep[seg_i])
                        else:  # torch fallback: a new loader at the new count
                            record(t2)
                            del it
                            loader, kind = _make_loader(ds, batch_size, sweep[seg_i], max_workers,
                                                        float(spec.get("worker_ram_mb") or 0.0))
                            prog.write({"event": "segment", "t": time.monotonic(), "workers": sweep[seg_i]})
                            break
                        prog.write({"event": "segment", "t": t2, "workers": sweep[seg_i]})
                if done:
                    break
        now = time.monotonic()
        record(now)
        prog.write({"event": "done", "t": now, "samples": samples, "reason": reason})
    finally:
        close = getattr(loader, "close", None)
        if callable(close):
            close()
        if world > 1:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
