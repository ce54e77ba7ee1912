"""Synthetic training workloads with real CPU preprocessing, for benchmarks, the predictor's corpus,
the demo and tests. Runs inside training processes (imports torch, numpy, Pillow).

``SyntheticImageDataset``: JPEG bytes generated at construction (Pillow, sizes varying per job, kept in
memory like a page-cached dataset), and per sample: decode, random resized crop, horizontal flip,
normalise -> float32 CHW tensor. ``aug_multiplier`` repeats the augmentation work (heavier models'
pipelines); ``io_sleep_s`` sleeps in fetch (an IO-bound job: blocked time, not CPU); ``cost_spread``
makes the per-sample cost vary (a sample's work is scaled by a deterministic factor in
[1, cost_spread]).

Randomness in ``__getitem__`` uses ``torch``'s global generator, which ``adloader.DataLoader`` seeds per
batch, so the result does not depend on which worker ran it.

``emulated_step(batch, step_s, cpu_s=0, ranks=1)``: what stands in for a training step: the host-side
copy of the batch, ``cpu_s`` seconds of real CPU work in the training process (per rank, on ``ranks``
threads in parallel: the Python, kernel launches and collation a real step spends on the CPU), then a
sleep for the rest of ``step_s`` (the GPU). A training process starved of CPU takes longer than
``step_s``, as a real one does.
"""
from __future__ import annotations

import io
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.utils.data

MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


@dataclass(frozen=True)
class WorkloadSpec:
    """What one synthetic job does per sample. Editable from a catalogue file (JSON/TOML)."""
    name: str = "balanced"
    num_images: int = 256          # distinct JPEGs generated (samples cycle over them)
    length: int = 4096             # dataset length (samples)
    image_px: int = 160            # side of the generated JPEG (varies per job)
    crop_px: int = 96              # output side after random resized crop
    aug_multiplier: int = 1        # repeats of the augmentation work
    io_sleep_s: float = 0.0        # sleep in fetch (IO-bound jobs)
    cost_spread: float = 1.0       # per-sample cost varies in [1, cost_spread]
    seed: int = 0


def _make_jpegs(spec: WorkloadSpec) -> list[bytes]:
    from PIL import Image

    rng = np.random.default_rng(spec.seed)
    out = []
    for i in range(spec.num_images):
        side = max(spec.crop_px, int(spec.image_px * rng.uniform(0.8, 1.2)))
        # smooth gradients plus noise: compresses like a photo, decodes at a realistic cost
        y, x = np.mgrid[0:side, 0:side].astype(np.float32) / side
        base = np.stack([x, y, (x + y) / 2], axis=-1) * 255
        img = np.clip(base + rng.normal(0, 40, size=base.shape), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out


class SyntheticImageDataset(torch.utils.data.Dataset):
    """Map-style dataset of generated JPEGs with real decode + augmentation per sample."""

    def __init__(self, spec: WorkloadSpec | None = None, **overrides):
        spec = spec or WorkloadSpec()
        if overrides:
            spec = WorkloadSpec(**{**spec.__dict__, **overrides})
        self.spec = spec
        self.jpegs = _make_jpegs(spec)
        rng = np.random.default_rng(spec.seed + 1)
        self.cost = (1.0 + rng.random(spec.length) * (spec.cost_spread - 1.0)) if spec.cost_spread > 1 else None

    def __len__(self) -> int:
        return self.spec.length

    def __getitem__(self, index: int):
        from PIL import Image

        spec = self.spec
        if not 0 <= index < spec.length:
            raise IndexError(index)
        if spec.io_sleep_s:
            time.sleep(spec.io_sleep_s)
        reps = spec.aug_multiplier
        if self.cost is not None:
            reps = max(1, int(round(reps * self.cost[index])))
        data = self.jpegs[index % len(self.jpegs)]
        out = None
        for _ in range(reps):
            img = Image.open(io.BytesIO(data)).convert("RGB")
            w, h = img.size
            scale = float(torch.empty(1).uniform_(0.35, 1.0))
            cw, ch = max(8, int(w * scale ** 0.5)), max(8, int(h * scale ** 0.5))
            x0 = int(torch.randint(0, w - cw + 1, (1,)))
            y0 = int(torch.randint(0, h - ch + 1, (1,)))
            img = img.resize((spec.crop_px, spec.crop_px), Image.BILINEAR, box=(x0, y0, x0 + cw, y0 + ch))
            arr = np.asarray(img, dtype=np.float32) / 255.0
            if bool(torch.rand(1) < 0.5):
                arr = arr[:, ::-1, :]
            out = (arr - MEAN) / STD
        tensor = torch.from_numpy(np.ascontiguousarray(out.transpose(2, 0, 1)))
        return tensor, index % 1000


_BURN_BUF = b"\x5a" * (64 * 1024)
_burn_pool = None


def burn_cpu(cpu_s: float) -> None:
    """Spend ``cpu_s`` seconds of this thread's CPU time (``time.thread_time``), however long that takes
    in wall time. sha256 of a 64 KiB buffer releases the GIL, so threads burn in parallel."""
    import hashlib

    end = time.thread_time() + cpu_s
    while time.thread_time() < end:
        hashlib.sha256(_BURN_BUF).digest()


def burn_parallel(cpu_s: float, ranks: int) -> None:
    """``burn_cpu(cpu_s)`` on each of ``ranks`` threads at once (this one and ``ranks - 1`` pooled ones),
    returning when all are done: the CPU part of a data-parallel step whose ranks run in lockstep."""
    global _burn_pool
    if ranks <= 1:
        burn_cpu(cpu_s)
        return
    from concurrent.futures import ThreadPoolExecutor

    if _burn_pool is None or _burn_pool._max_workers < ranks - 1:
        _burn_pool = ThreadPoolExecutor(max_workers=ranks - 1, thread_name_prefix="rank")
    futs = [_burn_pool.submit(burn_cpu, cpu_s) for _ in range(ranks - 1)]
    burn_cpu(cpu_s)
    for f in futs:              # lockstep: the step ends when every rank has done its CPU work
        f.result()


def emulated_step(batch, step_s: float, cpu_s: float = 0.0, ranks: int = 1) -> None:
    """Stand-in for a training step: the host-side copy of the batch, ``cpu_s`` seconds of CPU work on
    each of ``ranks`` threads (the training process's own CPU), then a sleep for the rest of ``step_s``."""
    t0 = time.perf_counter()
    data = batch[0] if isinstance(batch, (tuple, list)) else batch
    if isinstance(data, torch.Tensor):
        data.clone()
    if cpu_s > 0:
        copy_s = time.perf_counter() - t0
        burn_parallel(cpu_s, ranks)
        # the GPU part (step_s - cpu_s - copy) starts when the CPU part is done: a CPU part slowed by
        # contention lengthens the step, as the kernel launches of a starved training process do
        left = step_s - cpu_s - copy_s
    else:
        left = step_s - (time.perf_counter() - t0)
    if left > 0:
        time.sleep(left)
