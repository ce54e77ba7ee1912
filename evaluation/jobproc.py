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

A job of several rank processes (the spec's ``rank_processes`` with ``gpus`` R > 1; ``RankProcesses``):
the process the harness starts is rank 0 of R. It starts ranks 1..R-1 as its own children (this module,
the same spec, ``--spawned-rank``, each with its progress file ``<progress>.rank<r>``) with ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` (a free port it
picked) set, its own ``ADLOADER_*`` environment, and with the emulated device ``CUDA_VISIBLE_DEVICES``
narrowed to the rank's GPU; every rank, itself included, steps in lockstep (as ``--lockstep``), as
torchrun starts a data-parallel job. Each rank loads ``batch_size // R`` samples a step (the spec's
batch is the job's, every GPU's together; not divisible: refused), with ``ceil(workers / R)`` workers
(``--workers`` and ``--max-workers`` are the job's, as the agent counts them; ``auto`` stays ``auto``),
and burns its trainer CPU on one thread; ``step_s`` is unchanged. Rank 0's progress file is the job's:
samples and the ``workers``, ``live``, ``resizes``, ``cpu_s``, ``main_cpu_s``, ``main_runq_s`` figures
are every rank's together (each other rank's latest record); steps, ``wait_s`` and ``compute_s`` are
rank 0's own (the ranks agree to a step). A rank that exits before the job stops fails rank 0 at once
(a lockstep job cannot step without it); rank 0 stops its ranks when it stops.

Lockstep and stopping: the number every rank all-reduces (MAX) after each step is its wish to stop
(a signal, its work done, its duration over), so every rank stops after the same step, and none waits
in an all-reduce for a rank that left (``reason`` "rank": another rank's wish). ``--sweep`` is not
supported with rank processes.

Progress file: JSON lines, appended and flushed, read by the harness while the job runs:
    {"event": "start", "t", "pid", "job", "step_s", "batch_size", "loader": "adloader"|"torch", "ranks"}
    {"t", "samples", "steps", "wait_s", "compute_s", "workers", "live", "resizes", "cpu_s", "main_cpu_s", "main_runq_s"}   every ~0.25 s
    {"event": "segment", "t", "workers"}          (sweep mode: a new worker count from here on)
    {"event": "phase", "t", "index"}              (the spec's ``phases``: its pipeline is the index-th's from here on)
    {"event": "done", "t", "samples", "reason"}   ("work" | "duration" | "signal" | "sweep" | "rank")
``t`` is ``time.monotonic()`` (system-wide on Linux, so comparable across processes); counters are
cumulative; ``cpu_s`` is the loader workers' CPU seconds, ``main_cpu_s`` the training process's own
(every thread of it); ``main_runq_s`` the time its threads waited runnable for a CPU; ``wait_s`` the time blocked in ``next()``.
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import signal
import sys
import time

PROGRESS_EVERY_S = 0.25
RANK_TIMEOUT_S = 120.0      # a lockstep rank's longest wait for the others (rendezvous, each all-reduce)
RANK_SUMMED = ("workers", "live", "resizes", "cpu_s", "main_cpu_s", "main_runq_s")


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


def _make_loader(ds, batch_size: int, workers, max_workers, worker_ram_mb: float = 0.0, shuffle: bool = True):
    """adloader.DataLoader when it exists; else torch's (fixed workers; said in the start record)."""
    try:
        from adloader.dataloader import DataLoader
    except ImportError:
        import torch.utils.data

        n = os.cpu_count() if workers == "auto" else int(workers)
        return torch.utils.data.DataLoader(ds, batch_size=batch_size, shuffle=shuffle, num_workers=n,
                                           persistent_workers=n > 0, prefetch_factor=2 if n else None), "torch"
    kw = {}
    if max_workers is not None:
        kw["max_workers"] = max_workers
    if worker_ram_mb > 0:
        import functools

        kw["worker_init_fn"] = functools.partial(hold_worker_ram, worker_ram_mb)
    return DataLoader(ds, batch_size=batch_size, shuffle=shuffle, num_workers=workers, **kw), "adloader"


def _validation_loader(ds, batch_size: int, workers: int, worker_ram_mb: float, torch_own: bool):
    """A validation pass's loader (``pause_loader``): A-Dloader's, or torch's own (``"torch"``) with the
    same workers, not persistent (torch's default), each worker holding ``worker_ram_mb`` alike."""
    if not torch_own:
        return _make_loader(ds, batch_size, workers, None, worker_ram_mb, shuffle=False)[0]
    import functools

    import torch.utils.data

    init = functools.partial(hold_worker_ram, worker_ram_mb) if worker_ram_mb > 0 and workers > 0 else None
    return torch.utils.data.DataLoader(ds, batch_size=batch_size, shuffle=False, num_workers=workers,
                                       worker_init_fn=init)


def validation_batches(pause_s: float, step_s: float, batch_size: int, cpu_s_per_sample: float,
                       workers: int) -> int:
    """The batches of a validation pass (``pause_loader``): what ``pause_s`` holds on a node with CPU to
    spare, where a batch takes the longer of its forward step (a third of the training step) and its
    loader's time for it (the batch's CPU over its workers; in the training process, after the step, with
    none). At least 1. The pass is that many batches however long they take: a pass slowed by contention
    keeps the loop away longer, as a real validation pass does."""
    forward, load = step_s / 3.0, batch_size * cpu_s_per_sample
    per_batch = max(forward, load / workers) if workers > 0 else forward + load
    return max(1, round(pause_s / per_batch)) if per_batch > 0 else 1


def validate(val_loader, batches: int, forward, stop: dict) -> dict:
    """A validation pass: ``forward`` on ``batches`` batches of ``val_loader``, its epochs over again while
    batches are left (each epoch's workers started and stopped, as a non-persistent loader's are).
    Returns its batches, samples and seconds."""
    t0 = time.monotonic()
    done = samples = 0
    while not stop["signal"] and done < batches:
        it = iter(val_loader)
        for batch in it:
            forward(batch)
            done += 1
            data = batch[0] if isinstance(batch, (tuple, list)) else batch
            samples += len(data)
            if stop["signal"] or done >= batches:
                break
        del it                  # (an epoch left early: its workers stop now, as at the pass's end)
    return {"val_batches": done, "val_samples": samples, "val_s": time.monotonic() - t0}


class RankProcesses:
    """Rank 0's ranks 1..R-1 of a ``rank_processes`` job (module docstring): started as its children,
    watched, read and stopped by it. ``figures()`` sums the ``RANK_SUMMED`` fields of each rank's latest
    progress record (read incrementally: ``evaluation.harness.ProgressReader``, emptied after each read).
    A watcher thread ends rank 0 (exit 1, the other ranks killed) when a rank exits before ``stop``: rank
    0 may be blocked in the rendezvous or an all-reduce that would otherwise wait ``RANK_TIMEOUT_S``."""

    def __init__(self, argv: list[str], progress: str, world: int, narrow_gpus: bool):
        """``argv``: the job's jobproc arguments but ``--progress`` (each rank is given its own)."""
        import subprocess
        import threading

        from evaluation.harness import ProgressReader, _term_when_bench_dies
        from evaluation.slurm_cluster import free_port

        self.world, self.stopping = world, False
        port = str(free_port())
        gpus = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
        rank_env = {"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": port}
        os.environ.update(rank_env, RANK="0", LOCAL_RANK="0")      # this process: rank 0 (read by env://
        if narrow_gpus and len(gpus) >= world:                     # and by the loader's client)
            os.environ["CUDA_VISIBLE_DEVICES"] = gpus[0]
        self.paths = [f"{progress}.rank{r}" for r in range(1, world)]
        self.readers, self.procs = [], []
        me = os.getpid()
        for r, path in enumerate(self.paths, start=1):
            try:
                os.unlink(path)         # a run directory used before: the last run's records
            except FileNotFoundError:
                pass
            env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r))
            if narrow_gpus and len(gpus) >= world:
                env["CUDA_VISIBLE_DEVICES"] = gpus[r]
            # (from the main thread, before any other thread: the death signal follows the thread)
            self.procs.append(subprocess.Popen([sys.executable, "-m", "evaluation.jobproc", *argv, "--progress", path,
                                                "--spawned-rank"], env=env, stdin=subprocess.DEVNULL,
                                               preexec_fn=lambda: _term_when_bench_dies(me)))
            self.readers.append(ProgressReader(path))
        self.latest: list[dict] = [{} for _ in self.paths]
        threading.Thread(target=self._watch, name="ranks-watch", daemon=True).start()

    def _finished(self, i: int) -> bool:
        """Rank ``i + 1`` wrote its "done" record (it stopped after the step every rank agreed on)."""
        try:
            with open(self.paths[i], "rb") as f:
                f.seek(max(0, os.path.getsize(self.paths[i]) - 4096))
                return b'"event": "done"' in f.read()
        except OSError:
            return False

    def _watch(self) -> None:
        while not self.stopping:
            for i, p in enumerate(self.procs):
                rc = p.poll()
                if rc is not None and not self.stopping and not (rc == 0 and self._finished(i)):
                    r = i + 1
                    print(f"evaluation.jobproc: rank {r} of {self.world} exited (rc {rc}) before the job "
                          f"stopped; a lockstep job cannot step without it: stopping every rank",
                          file=sys.stderr, flush=True)
                    self.kill()
                    os._exit(1)
            time.sleep(0.2)

    def figures(self) -> dict:
        """The ``RANK_SUMMED`` fields of ranks 1..R-1, each rank's latest record, summed."""
        for i, rd in enumerate(self.readers):
            rd.poll()
            if rd.records:
                self.latest[i] = rd.records[-1]
                rd.records.clear()
        return {k: sum(float(rec.get(k, 0.0)) for rec in self.latest) for k in RANK_SUMMED}

    def stop(self, grace_s: float = 30.0) -> None:
        """After the agreed last step: each rank finishes on its own (its loader closed, its last record
        written) within ``grace_s``; then SIGTERM, and SIGKILL for what is left."""
        import subprocess

        self.stopping = True
        for wait_s in (grace_s, 5.0):
            deadline = time.monotonic() + wait_s
            for p in self.procs:
                try:
                    p.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.terminate()
        self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


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
    ap.add_argument("--spawned-rank", action="store_true",
                    help="internal: a rank that rank 0 of a rank_processes job started (RANK and the rest in "
                         "the environment); it starts no ranks and steps in lockstep")
    args = ap.parse_args(argv)
    if (args.max_workers is not None and not args.sweep and args.workers != "auto"
            and args.workers > args.max_workers):   # (the loader's ValueError, as a traceback)
        ap.error(f"--workers {args.workers} exceeds --max-workers {args.max_workers}")

    import psutil
    import torch
    from torch.utils.data import Subset

    from adloader.synthetic import SyntheticImageDataset, WorkloadSpec, emulated_step

    spec = json.loads(args.spec)
    batch_size = int(spec["batch_size"])
    ranks = int(spec.get("gpus") or 1)
    # a job of rank processes: this process is one of them (``ranks`` of the job), each rank one GPU
    job_ranks = ranks if spec.get("rank_processes") and ranks > 1 else 1
    job_workers, job_max_workers = args.workers, args.max_workers     # (every rank's given the same)
    if job_ranks > 1:
        if batch_size % job_ranks:
            ap.error(f"spec {spec['job_id']}: batch_size {batch_size} (the job's, every GPU's together) is "
                     f"not divisible by its {job_ranks} rank processes")
        if args.sweep:
            ap.error("--sweep with rank_processes: a sweep runs one loader (use the co-located oracle)")
        batch_size, ranks = batch_size // job_ranks, 1      # each rank its share, its CPU on one thread
        per_rank = lambda n: -(-n // job_ranks)             # noqa: E731 (the agent's split: rounded up)
        if args.workers != "auto":
            args.workers = per_rank(args.workers)
        if args.max_workers is not None:
            args.max_workers = per_rank(args.max_workers)
    rank_procs = None
    if job_ranks > 1 and not args.spawned_rank:
        # (the harness moved this process into a job cgroup, where it has one, as it started it, long
        # before this: the ranks and their workers inherit the group)
        rank_argv = ["--spec", args.spec, "--workers", str(job_workers), "--device", args.device]
        for flag, value in (("--max-workers", job_max_workers), ("--duration-s", args.duration_s),
                            ("--total-steps", args.total_steps)):
            if value is not None:
                rank_argv += [flag, repr(value) if isinstance(value, float) else str(value)]
        rank_procs = RankProcesses(rank_argv, args.progress, job_ranks, narrow_gpus=args.device == "emulated")
        atexit.register(rank_procs.stop, 5.0)    # whatever ends this process ends its ranks
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
    step_s = float(spec["step_s"])
    trainer_cpu_s = float(spec.get("trainer_cpu_frac") or 0.0) * step_s
    pause_every_s, pause_s = float(spec.get("pause_every_s") or 0.0), float(spec.get("pause_s") or 0.0)
    pause_loader, val_loader = bool(spec.get("pause_loader")) and pause_s > 0, None
    val_workers = int(spec.get("num_workers") or 0) // job_ranks      # the user's habit, for each rank's loader
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
    lockstep = args.lockstep or job_ranks > 1
    world = int(os.environ.get("WORLD_SIZE") or 1) if lockstep else 1
    target = spec.get("samples")
    job_batch = batch_size * job_ranks                   # the samples the job takes in one (lockstep) step
    vote = {"stop": False}                               # every rank's wish to stop after this step, MAXed

    def stop_reason(now, steps_done):
        if stop["signal"]:
            return "signal"
        if target is not None and steps_done * job_batch >= target:
            return "work"
        if args.duration_s is not None and now - t_start >= args.duration_s:
            return "duration"
        return None

    if world > 1:
        import datetime

        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=RANK_TIMEOUT_S))
        one_step = do_step

        def do_step(batch):     # the all-reduce is part of the step, as a DDP backward's is
            one_step(batch)
            vote["mine"] = stop_reason(time.monotonic(), steps + 1)
            wish = torch.tensor([1.0 if vote["mine"] else 0.0])
            dist.all_reduce(wish, op=dist.ReduceOp.MAX)
            vote["stop"] = bool(wish.item() > 0)
    sweep = args.sweep
    workers = sweep[0] if sweep else args.workers
    max_workers = args.max_workers
    if sweep:  # the loader's default bound is the CPU count; a sweep may go past it
        max_workers = max(max_workers or 0, max(sweep))
    loader, kind = _make_loader(ds, batch_size, workers, max_workers, float(spec.get("worker_ram_mb") or 0.0))
    if args.total_steps is not None and hasattr(loader, "set_total_steps"):
        loader.set_total_steps(args.total_steps)
    me = psutil.Process()
    t_start = time.monotonic()
    # rank 0 of rank processes writes the job's figures: its batch the job's (the ranks are in lockstep)
    share = job_ranks if rank_procs is not None else 1
    prog.write({"event": "start", "t": t_start, "pid": os.getpid(), "job": spec["job_id"], "step_s": step_s,
                "batch_size": batch_size * share, "loader": kind, "device": args.device, "ranks": share, **gpu})
    samples = steps = 0
    wait_s = compute_s = 0.0
    last_report = 0.0
    trained_from = t_start          # the last pause's end (pause_every_s of training after it, the next)
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
        rec = {"t": now, "samples": samples, "steps": steps, "wait_s": wait_s, "compute_s": compute_s,
               "workers": int(loader.num_workers), "live": live_n, "resizes": resizes, **left,
               "cpu_s": _worker_cpu_s(loader, kind, me), "main_cpu_s": time.process_time(),
               "main_runq_s": _main_runq_s()}
        if rank_procs is not None:      # the job's: every rank's together
            for k, v in rank_procs.figures().items():
                rec[k] = type(rec[k])(rec[k] + v)
        prog.write(rec)

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
                samples += batch_size * share   # rank 0 of rank processes: the job's (lockstep: R alike)
                if seg_t0 is None:
                    seg_t0 = t2
                    if sweep:
                        prog.write({"event": "segment", "t": t2, "workers": sweep[0]})
                if t2 - last_report >= PROGRESS_EVERY_S:
                    record(t2)
                    last_report = t2
                if pause_s > 0 and t2 - trained_from >= pause_every_s:
                    # a validation pass or a checkpoint save: the loop is away from its loader (records
                    # either side, so that a measured window's edge inside the pause counts no samples)
                    record(t2)
                    prog.write({"event": "pause", "t": t2, "pause_s": pause_s})
                    end = t2 + pause_s
                    if pause_loader:
                        if val_loader is None:      # made once, as a script makes its validation loader
                            val_loader = _validation_loader(Subset(ds, range(max(1, len(ds) // 10))), batch_size,
                                                            val_workers, float(spec.get("worker_ram_mb") or 0.0),
                                                            spec["pause_loader"] == "torch")
                        n = validation_batches(pause_s, step_s, batch_size,
                                               float(spec.get("cpu_s_per_sample") or 0.0), val_workers)
                        val = validate(val_loader, n, lambda b: emulated_step(b, step_s / 3, trainer_cpu_s / 3,
                                                                              ranks), stop)
                        prog.write({"event": "validated", "t": time.monotonic(), **val})
                        end = time.monotonic()      # (the pass is its batches: no sleep after it)
                    while not stop["signal"] and time.monotonic() < end:
                        time.sleep(min(0.05, max(0.0, end - time.monotonic())))
                    trained_from = last_report = time.monotonic()
                    record(trained_from)
                    t2 = trained_from
                if phases and ds.k < len(phases) and t2 - t_start >= float(phases[ds.k]["after_s"]):
                    ds.begin(ds.k + 1)
                    prog.write({"event": "phase", "t": t2, "index": ds.k})
                if world > 1:       # the ranks stop together, after the step every rank voted on
                    why = (vote.get("mine") or "rank") if vote["stop"] else None
                else:
                    why = stop_reason(t2, steps)
                if why:
                    reason, done = why, True
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
        now = time.monotonic()          # (the job's end: not when its ranks have closed their loaders)
        if rank_procs is not None:      # their last records first: the job's last figures sum them
            rank_procs.stop()
        record(now)
        prog.write({"event": "done", "t": now, "samples": samples, "reason": reason})
    finally:
        if rank_procs is not None:
            rank_procs.stop(grace_s=5.0)
        for used in (loader, val_loader):
            close = getattr(used, "close", None)
            if callable(close):
                close()
        if world > 1:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
