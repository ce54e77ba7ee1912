"""The bench's job catalogue (``evaluation/catalog.toml``, or ``--catalog PATH``) and its calibration.

A *kind* is a model-like pipeline with a CPU demand per GPU taken from real models (``cores_per_gpu``).
``calibrate`` measures, on this machine, the CPU seconds one sample of the kind's pipeline costs
(single thread, ``time.process_time``), then derives the emulated GPU step so that one GPU of the job
needs ``demand_cores = cores_per_gpu * loader_cores / reference_cores`` busy cores to never wait:

    step_s = batch_size * cpu_s_per_sample / demand_cores      (clamped to [min_step_s, max_step_s])

so demand scales with the node and nothing depends on hard-coded timings. A ``JobSpec`` is one
calibrated job instance: everything a job process needs (see ``evaluation.jobproc``).

What a kind says about its training process and its user (the workload model, ISSUE 11):
- ``trainer_cpu_frac``: the fraction of each step the training process itself is busy on a CPU
  (kernel launches, collation, host-to-device copies, the optimizer's Python); the rest of the step
  emulates the GPU. The busy part is real CPU burned in the process, so a trainer starved of CPU
  makes its step longer, as a real one does.
- ``gpus``: GPUs (ranks) the job has on this node. Its step consumes one batch per GPU in lockstep (a
  data-parallel job), so its loader demand and its samples per step scale with ``gpus``, its step
  time does not, and its normalised throughput counts ``gpus`` times in the node's aggregate.
- ``rank_processes``: the job's GPUs as separate training processes, one rank per GPU, each with its
  own loader, stepping in lockstep, as torchrun starts a data-parallel job (``evaluation.jobproc``
  starts them; each rank takes its share of ``batch_size``, the job's, every GPU's together, burns its
  ``trainer_cpu_frac`` on one thread and loads with its share of ``num_workers``). Off (the default): one process drives every GPU of the job with
  one loader. Ignored with one GPU. In a mix: ``{kind = "resnet18x2", rank_processes = true}``, named
  ``resnet18x2[rank_processes=true]``.
- ``num_workers``: what its user sets (0 = the ``cpus // ranks`` habit, as Lightning suggests).
  ``none`` and ``static-cores`` run with it; the agent's policies start from it. With
  ``rank_processes`` it is every rank's loader together (as the agent counts a job's workers): a set
  figure is split evenly among the ranks, and the habit gives each rank ``cpus // ranks``.
- ``worker_ram_mb``: memory one loader worker holds (its copy of the dataset index, decoded buffers);
  the simulator and the memory budget read it, and ``jobproc`` touches that much in every worker.
- ``phase_kind``, ``phase_after_s``: a second phase of the job's pipeline. ``phase_after_s`` seconds
  after its start the job's samples are decoded and augmented as ``phase_kind``'s are (its images,
  augmentation work); its step, ceiling, GPUs and sample size (the model's input) stay (a curriculum
  that turns augmentation up, a dataset of larger images next in the queue). What the agent must
  notice: its loader's need moved.
- ``pause_every_s``, ``pause_s``: the training loop stops for ``pause_s`` seconds after each
  ``pause_every_s`` seconds of training (the first after ``pause_every_s`` from its start): a
  validation pass or a checkpoint save, out of its loader's ``next()``, sleeping (its GPU busy, its
  CPU idle). Both or neither.
- ``pause_loader``: the pause is a validation pass with a loader of its own, as a training script's
  is: a second ``adloader.DataLoader`` (``true``), or torch's own ``DataLoader`` (``"torch"``: a script
  that imports A-Dloader's for training only), over a tenth of the samples (shuffle off) with the user's
  habitual ``num_workers``, its workers started for each pass and stopped after it (torch's default,
  ``persistent_workers=False``), each batch a forward step of a third of the training step (its GPU
  part and its training-process CPU part alike: no backward, no optimizer). The pass is fixed work:
  the batches ``pause_s`` holds on a node with CPU to spare (``evaluation.jobproc.validation_batches``),
  however long they take, so a pass slowed by contention keeps the loop away longer and costs the job
  training time, as a real one does. Its samples do not count as the job's throughput. Needs a pause.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from importlib import resources

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

KIND_FIELDS = ("batch_size", "image_px", "crop_px", "aug_multiplier", "io_sleep_s", "cost_spread")


class CatalogError(ValueError):
    """A catalogue file that cannot be used; the message names the file and the entry."""


@dataclass(frozen=True)
class JobKind:
    name: str
    cores_per_gpu: float
    batch_size: int = 32
    image_px: int = 160
    crop_px: int = 96
    aug_multiplier: int = 1
    io_sleep_s: float = 0.0
    cost_spread: float = 1.0
    trainer_cpu_frac: float = 0.0     # fraction of a step the training process is busy on a CPU
    gpus: int = 1                     # GPUs (ranks) on this node
    num_workers: int = 0              # the user's habitual num_workers (0: node cores // gpus)
    worker_ram_mb: float = 0.0        # memory one loader worker holds
    rank_processes: bool = False      # one training process (rank) per GPU, each its own loader, in lockstep
    phase_kind: str = ""              # from phase_after_s after its start, the pipeline of this kind
    phase_after_s: float = 0.0
    pause_every_s: float = 0.0        # the training loop stops for pause_s after each pause_every_s of training
    pause_s: float = 0.0              # (a validation pass, a checkpoint save: away from its loader); 0: never
    pause_loader: bool | str = False  # the pause iterates a validation loader of its own: true, "torch" (not a sleep)
    note: str = ""


@dataclass(frozen=True)
class Catalog:
    path: str
    kinds: dict[str, JobKind]
    mixes: dict[str, list[str]]
    reference_cores: float = 12.0
    min_step_s: float = 0.02
    max_step_s: float = 1.0
    dynamic_arrivals_s: list[float] = field(default_factory=list)
    dynamic_work_s: list[float] = field(default_factory=list)
    # per mix: the shortest warm-up and measured window (s) that measure its steady state ([windows])
    windows: dict[str, dict[str, float]] = field(default_factory=dict)


@dataclass(frozen=True)
class JobSpec:
    """One calibrated job instance. ``ceiling_samples_per_s = batch_size / step_s``."""
    job_id: str
    kind: str
    batch_size: int
    step_s: float
    demand_cores: float
    cpu_s_per_sample: float
    workload: dict                 # adloader.synthetic.WorkloadSpec fields
    samples: int | None = None     # fixed amount of work (None: run until stopped)
    arrival_s: float = 0.0
    gpus: int = 1                  # the step takes one per-GPU batch per GPU: batch_size is their sum
    trainer_cpu_frac: float = 0.0  # of step_s, burned on CPU by the training process (per GPU rank)
    num_workers: int = 1           # the user's habitual num_workers (resolved for this node)
    worker_ram_mb: float = 0.0
    phases: list = field(default_factory=list)   # [{"after_s": S, "workload": {...}}]: later pipelines
    rank_processes: bool = False   # ``gpus`` training processes, one per GPU (evaluation.jobproc starts them)
    pause_every_s: float = 0.0     # the loop stops pause_s after each pause_every_s of training (0: never)
    pause_s: float = 0.0
    pause_loader: bool | str = False   # each pause a validation pass with a loader of its own (catalogue docstring)

    @property
    def ceiling_samples_per_s(self) -> float:
        return self.batch_size / self.step_s

    @property
    def trainer_cpu_cores(self) -> float:
        """CPU cores the job's training process(es) use at full speed (one busy fraction per GPU rank)."""
        return self.trainer_cpu_frac * self.gpus

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def default_catalog_path() -> str:
    return str(resources.files("evaluation").joinpath("catalog.toml"))


def load_catalog(path: str | None = None) -> Catalog:
    path = path or default_catalog_path()
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as e:
        raise CatalogError(f"catalogue {path}: cannot read: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise CatalogError(f"catalogue {path}: not valid TOML: {e}") from None
    except UnicodeDecodeError as e:   # (tomllib decodes the bytes itself and lets this through)
        raise CatalogError(f"catalogue {path}: not valid TOML: not UTF-8 text ({e.reason} at byte {e.start})") from None
    unknown = set(doc) - set(TOP_LEVEL)
    if unknown:
        raise CatalogError(f"catalogue {path}: unknown top-level keys: {', '.join(sorted(unknown))} "
                           f"(known: {', '.join(TOP_LEVEL)})")
    for key in ("jobs", "mixes", "dynamic"):
        if not isinstance(doc.get(key, {}), dict):
            raise CatalogError(f"catalogue {path}: {key} must be a table ([{key}]), got {doc[key]!r}")
    for key in ("reference_cores", "min_step_s", "max_step_s"):
        _need_type(path, key, doc.get(key, 1.0), "float")
    kinds = {}
    for name, entry in (doc.get("jobs") or {}).items():
        if not isinstance(entry, dict) or "cores_per_gpu" not in entry:
            raise CatalogError(f"catalogue {path}: [jobs.{name}] needs cores_per_gpu")
        unknown = set(entry) - (set(JobKind.__dataclass_fields__) - {"name"})
        if unknown:
            raise CatalogError(f"catalogue {path}: [jobs.{name}] has unknown keys: {', '.join(sorted(unknown))}")
        for k, v in entry.items():
            _need_type(path, f"[jobs.{name}] {k}", v, JobKind.__dataclass_fields__[k].type)
        try:
            kind = JobKind(name=name, **entry)
        except TypeError as e:
            raise CatalogError(f"catalogue {path}: [jobs.{name}]: {e}") from None
        if kind.cores_per_gpu <= 0 or kind.batch_size <= 0:
            raise CatalogError(f"catalogue {path}: [jobs.{name}] cores_per_gpu and batch_size must be > 0")
        if not 0.0 <= kind.trainer_cpu_frac < 1.0:
            raise CatalogError(f"catalogue {path}: [jobs.{name}] trainer_cpu_frac must be in [0, 1), "
                               f"got {kind.trainer_cpu_frac}")
        if kind.gpus < 1 or kind.num_workers < 0 or kind.worker_ram_mb < 0:
            raise CatalogError(f"catalogue {path}: [jobs.{name}] needs gpus >= 1, num_workers >= 0 and "
                               f"worker_ram_mb >= 0")
        if not isinstance(kind.rank_processes, bool):
            raise CatalogError(f"catalogue {path}: [jobs.{name}] rank_processes must be true or false, "
                               f"got {kind.rank_processes!r}")
        kinds[name] = kind
    if not kinds:
        raise CatalogError(f"catalogue {path}: no [jobs.*] entries")
    mixes = {}
    for mix, members in (doc.get("mixes") or {}).items():
        if not isinstance(members, list):
            raise CatalogError(f"catalogue {path}: mix {mix!r} must be a list of kinds, got {members!r}")
        names = []
        for m in members:
            if isinstance(m, dict):      # {kind = "alexnet", num_workers = 8, ...}: a variant of a kind
                names.append(_variant(path, mix, m, kinds))
            else:
                names.append(str(m))
        missing = [m for m in names if m not in kinds]
        if missing:
            raise CatalogError(f"catalogue {path}: mix {mix!r} names unknown kinds: {', '.join(missing)}")
        mixes[mix] = names
    for name, kind in kinds.items():     # (variants included: a phase or a pause is usually set in a mix)
        if kind.pause_every_s < 0 or kind.pause_s < 0 or (kind.pause_s > 0) != (kind.pause_every_s > 0):
            raise CatalogError(f"catalogue {path}: {name}: pause_every_s and pause_s must be >= 0 and set "
                               f"together, got {kind.pause_every_s!r} and {kind.pause_s!r}")
        if not isinstance(kind.pause_loader, bool) and kind.pause_loader != "torch":
            raise CatalogError(f"catalogue {path}: {name}: pause_loader must be true, false or \"torch\", "
                               f"got {kind.pause_loader!r}")
        if kind.pause_loader and kind.pause_s <= 0:
            raise CatalogError(f"catalogue {path}: {name}: pause_loader needs a pause (pause_every_s and pause_s)")
        if kind.phase_kind and (kind.phase_kind not in kinds or not kind.phase_after_s > 0):
            raise CatalogError(f"catalogue {path}: {name}: phase_kind must name a kind ({kind.phase_kind!r}) "
                               f"and phase_after_s be > 0 (got {kind.phase_after_s!r})")
    dyn = doc.get("dynamic") or {}
    unknown = set(dyn) - {"arrivals_s", "work_s"}
    if unknown:
        raise CatalogError(f"catalogue {path}: [dynamic] has unknown keys: {', '.join(sorted(unknown))} "
                           f"(known: arrivals_s, work_s)")
    for key, v in dyn.items():
        if not isinstance(v, list):
            raise CatalogError(f"catalogue {path}: [dynamic] {key} must be a list of seconds, got {v!r}")
        for x in v:
            _need_type(path, f"[dynamic] {key}", x, "float")
    windows = _windows(path, doc.get("windows") or {}, mixes)
    for mix, names in mixes.items():     # a pause measured in part reads as a policy's gain or loss
        for name in names:
            k = kinds[name]
            need, got = k.pause_every_s + k.pause_s, windows.get(mix, {}).get("measure_s")
            if k.pause_every_s > 0 and (got is None or got < need):
                raise CatalogError(f"catalogue {path}: mix {mix!r}: {name} pauses {k.pause_s:g} s after every "
                                   f"{k.pause_every_s:g} s of training: [windows] {mix} needs measure_s >= {need:g} "
                                   f"(a whole pause and its training in the measured window), got "
                                   f"{'none' if got is None else f'{got:g}'}")
    return Catalog(path=str(path), kinds=kinds, mixes=mixes, windows=windows,
                   reference_cores=float(doc.get("reference_cores", 12.0)),
                   min_step_s=float(doc.get("min_step_s", 0.02)), max_step_s=float(doc.get("max_step_s", 1.0)),
                   dynamic_arrivals_s=[float(x) for x in dyn.get("arrivals_s", [])],
                   dynamic_work_s=[float(x) for x in dyn.get("work_s", [])])


WINDOW_KEYS = ("warmup_s", "measure_s")
TOP_LEVEL = ("reference_cores", "min_step_s", "max_step_s", "jobs", "mixes", "dynamic", "windows")
_TOML_TYPES = {"float": (int, float), "int": (int,), "bool": (bool,), "str": (str,), "bool | str": (bool, str)}


def _need_type(path, where: str, value, kind: str) -> None:
    """``value`` is what a ``kind`` field ("float", "int", "bool", "str": JobKind's annotations) takes from
    TOML (an integer for a float; a boolean for no number), else a ``CatalogError`` naming ``where``.
    Before, ``cores_per_gpu = "x"`` or ``reference_cores = "x"`` was a TypeError or ValueError traceback
    from whatever first used the value."""
    ok = isinstance(value, _TOML_TYPES[kind]) and (kind.startswith("bool") or not isinstance(value, bool))
    if ok and kind == "float" and not math.isfinite(value):
        ok = False
    if not ok:
        what = {"float": "a finite number", "int": "an integer", "bool": "true or false", "str": "a string",
                "bool | str": "true, false or a string"}[kind]
        raise CatalogError(f"catalogue {path}: {where} must be {what}, got {value!r}")


def _windows(path, table, mixes: dict) -> dict[str, dict[str, float]]:
    """``[windows]``: ``mix = {warmup_s = S, measure_s = S}``, the least warm-up and measured window that
    mix's steady state needs (``adloader bench`` lengthens shorter phases of that mix to these)."""
    if not isinstance(table, dict):
        raise CatalogError(f"catalogue {path}: [windows] must be a table of mix = {{warmup_s, measure_s}}")
    out = {}
    for mix, entry in table.items():
        if mix not in mixes:
            raise CatalogError(f"catalogue {path}: [windows] names unknown mix {mix!r}; mixes: {', '.join(sorted(mixes))}")
        if not isinstance(entry, dict):
            raise CatalogError(f"catalogue {path}: [windows] {mix} must be {{warmup_s = S, measure_s = S}}")
        unknown = set(entry) - set(WINDOW_KEYS)
        if unknown:
            raise CatalogError(f"catalogue {path}: [windows] {mix}: unknown keys: {', '.join(sorted(unknown))} "
                               f"(known: {', '.join(WINDOW_KEYS)})")
        w = {}
        for k, v in entry.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise CatalogError(f"catalogue {path}: [windows] {mix}.{k} must be a number of seconds > 0, got {v!r}")
            w[k] = float(v)
        out[mix] = w
    return out


def _variant(path, mix: str, entry: dict, kinds: dict) -> str:
    """A mix member written as ``{kind = "alexnet", num_workers = 8}``: that kind with those fields
    changed, registered as ``alexnet[num_workers=8]``."""
    import dataclasses

    base = entry.get("kind")
    if base not in kinds:
        raise CatalogError(f"catalogue {path}: mix {mix!r} names unknown kinds: {base}")
    changes = {k: v for k, v in entry.items() if k != "kind"}
    unknown = set(changes) - (set(JobKind.__dataclass_fields__) - {"name", "note"})
    if unknown:
        raise CatalogError(f"catalogue {path}: mix {mix!r}: unknown keys for {base}: {', '.join(sorted(unknown))}")
    for k, v in changes.items():
        _need_type(path, f"mix {mix!r}: {k} of {base}", v, JobKind.__dataclass_fields__[k].type)
    # (a boolean as TOML writes it: resnet18x2[rank_processes=true])
    name = base + "[" + ",".join(f"{k}={json.dumps(v) if isinstance(v, bool) else v}"
                                 for k, v in sorted(changes.items())) + "]" if changes else base
    if name not in kinds:
        kinds[name] = dataclasses.replace(kinds[base], name=name, **changes)
    return name


def workload_for(kind: JobKind, seed: int, num_images: int = 48) -> dict:
    return dict(name=kind.name.split("[")[0], num_images=num_images, length=1 << 20, image_px=kind.image_px,
                crop_px=kind.crop_px, aug_multiplier=kind.aug_multiplier, io_sleep_s=kind.io_sleep_s,
                cost_spread=kind.cost_spread, seed=seed)


def measure_cpu_s_per_sample(kind: JobKind, samples: int = 40, seed: int = 0) -> float:
    """CPU seconds of one sample of the kind's pipeline on this machine, single thread, in-process."""
    import torch

    from adloader.synthetic import SyntheticImageDataset, WorkloadSpec

    torch.set_num_threads(1)
    wl = workload_for(kind, seed, num_images=16)
    wl["io_sleep_s"] = 0.0
    ds = SyntheticImageDataset(WorkloadSpec(**wl))
    for i in range(5):
        ds[i]
    best = float("inf")
    for rep in range(3):  # the least of three: other processes only ever add (cache, frequency)
        t0 = time.process_time()
        for i in range(samples):
            ds[(rep * samples + i) % len(ds)]
        best = min(best, (time.process_time() - t0) / samples)
    return best


_MEASURE_CHILD = ("import json, sys\n"
                  "from evaluation.catalog import JobKind, measure_cpu_s_per_sample\n"
                  "kinds = json.load(sys.stdin)\n"
                  "print(json.dumps({n: measure_cpu_s_per_sample(JobKind(**k)) for n, k in kinds.items()}))\n")


def measure_in_processes(kinds: dict[str, JobKind], processes: int, timeout_s: float = 600.0) -> dict[str, list[float]]:
    """``measure_cpu_s_per_sample`` for every kind in each of ``processes`` fresh Python processes, one
    after the other: kind -> one figure per process. A process's speed can be a lottery: on a 2-vCPU
    Intel VM one fresh process in four ran the BERT-like kind 1.5-1.8x slower than the others, steadily
    (BENCHMARKS.md, thirtieth pass), and a bench calibrated in a slow one ran every job 1.6-2x lighter
    than designed."""
    import subprocess
    import sys

    payload = json.dumps({n: asdict(k) for n, k in kinds.items()})
    runs: dict[str, list[float]] = {n: [] for n in kinds}
    for i in range(processes):
        try:
            p = subprocess.run([sys.executable, "-c", _MEASURE_CHILD], input=payload, capture_output=True,
                               text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"calibration process {i + 1} of {processes} took over {timeout_s:g} s") from None
        if p.returncode != 0:
            tail = (p.stderr or "").strip().splitlines()[-3:]
            raise RuntimeError(f"calibration process {i + 1} of {processes} failed (exit {p.returncode}): "
                               + " | ".join(tail))
        got = json.loads(p.stdout.strip().splitlines()[-1])
        for n in kinds:
            runs[n].append(float(got[n]))
    return runs


def calibrate(catalog: Catalog, loader_cores: float, kinds: list[str] | None = None,
              processes: int = 1) -> dict[str, dict]:
    """Measure every kind (or ``kinds``) on this machine -> kind -> {cpu_s_per_sample, demand_cores, step_s}.

    ``demand_cores`` is the whole job's (all its GPUs); the step is that of one GPU's batch.
    ``processes`` > 1: measured in that many fresh processes (``measure_in_processes``), the least
    figure taken (a slow process only ever adds), each process's in ``cpu_s_per_sample_runs``; 1: in
    this process."""
    names = kinds or list(catalog.kinds)
    runs = measure_in_processes({n: catalog.kinds[n] for n in names}, processes) if processes > 1 else {}
    out = {}
    for name in names:
        kind = catalog.kinds[name]
        cpu = min(runs[name]) if name in runs else measure_cpu_s_per_sample(kind)
        demand = kind.cores_per_gpu * loader_cores / catalog.reference_cores
        step = kind.batch_size * cpu / demand
        clamped = min(catalog.max_step_s, max(catalog.min_step_s, step))
        if clamped != step:  # the demand that this step really implies, reported as such
            demand = kind.batch_size * cpu / clamped
        out[name] = dict(cpu_s_per_sample=cpu, demand_cores=demand * kind.gpus, step_s=clamped,
                         clamped=clamped != step, trainer_cpu_cores=kind.trainer_cpu_frac * kind.gpus)
        if name in runs:
            out[name]["cpu_s_per_sample_runs"] = runs[name]
    return out


def habitual_workers(kind: JobKind, node_cores: int) -> int:
    """The ``num_workers`` the kind's user sets: the catalogue's figure, else ``cpus // ranks``. With
    ``rank_processes`` the habit is every rank's (each rank's loader its ``cpus // ranks``), so the job's
    figure, all its ranks' together, is that times the ranks."""
    if kind.num_workers > 0:
        return kind.num_workers
    per_loader = max(1, node_cores // kind.gpus)
    return per_loader * kind.gpus if kind.rank_processes and kind.gpus > 1 else per_loader


def make_job(catalog: Catalog, calib: dict[str, dict], kind_name: str, job_id: str, seed: int,
             samples: int | None = None, arrival_s: float = 0.0, node_cores: int = 1) -> JobSpec:
    kind = catalog.kinds[kind_name]
    c = calib[kind_name]
    return JobSpec(job_id=job_id, kind=kind_name, batch_size=kind.batch_size * kind.gpus, step_s=c["step_s"],
                   demand_cores=c["demand_cores"], cpu_s_per_sample=c["cpu_s_per_sample"],
                   workload=workload_for(kind, seed), samples=samples, arrival_s=arrival_s, gpus=kind.gpus,
                   trainer_cpu_frac=kind.trainer_cpu_frac, num_workers=habitual_workers(kind, node_cores),
                   worker_ram_mb=kind.worker_ram_mb, rank_processes=kind.rank_processes,
                   pause_every_s=kind.pause_every_s, pause_s=kind.pause_s, pause_loader=kind.pause_loader,
                   phases=[{"after_s": kind.phase_after_s, "workload": workload_for(catalog.kinds[kind.phase_kind], seed)}]
                   if kind.phase_kind else [])


__all__ = ["Catalog", "CatalogError", "JobKind", "JobSpec", "load_catalog", "calibrate", "make_job", "habitual_workers",
           "default_catalog_path", "measure_cpu_s_per_sample", "measure_in_processes"]
