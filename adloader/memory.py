"""Memory, read only: per-process USS/PSS, node MemAvailable and PSI memory, the cgroup memory limit.

Stdlib only (the client imports it with torch, the agent without). Nothing here ever writes: on
shared nodes the memory cgroup hierarchy belongs to someone else (the batch system, the sandbox);
A-Dloader reads memory and acts only through worker counts.

Figures, all in bytes:
- ``uss``  unique set size: Private_Clean + Private_Dirty (+ Private_Hugetlb, which Rss leaves out) of
  ``/proc/<pid>/smaps_rollup``. What the
  node gets back when the process exits, hence a worker's marginal memory cost.
- ``pss``  proportional set size (shared pages divided among the processes that map them): the fair
  per-process share; a job's workers' PSS sum to what they hold together.
- ``rss``  resident set size (shared pages counted in full in every process).
``smaps_rollup`` exists since Linux 4.14 (Documentation/filesystems/proc.rst); reading it walks the
process's page tables once (about 0.1-1 ms for a worker; ``benchmarks`` in BENCHMARKS.md). Where it is
missing, ``smaps`` gives the same fields per mapping (summed here). ``statm`` is no substitute: its
"shared" is file-backed and shmem pages (proc(5)), not pages shared with other processes, so a forked
worker's inherited copy-on-write pages would count as its own (measured: 404 MiB "unique" for a
worker whose smaps_rollup says 1.4 MiB, over a 256 MiB array of its parent). A process whose smaps
cannot be read (another uid, a non-dumpable process) is not measured (None).

Copy-on-read: a forked worker shares its parent's pages until it writes them, and CPython writes every
object it touches (reference counts, GC bits). A dataset held as a list of Python objects is therefore
copied page by page into every worker as it touches samples: the worker's USS grows with the samples
read (pytorch/pytorch#13246). A dataset held in numpy arrays or shared buffers has no per-object
header to write and stays shared. ``WorkerMemorySampler`` measures each worker's USS against its own
first sample, which is how the growth is seen.

Node: ``/proc/meminfo`` ``MemTotal``/``MemAvailable``; ``/proc/pressure/memory`` (PSI: percent of the
last 10 s in which some / all tasks stalled on memory; ``total`` in microseconds).

cgroup limit of a process (``cgroup_memory_limit``): v2 ``memory.max``, v1 ``memory.limit_in_bytes``
(values at or above 2**60 mean unlimited), of the process's own cgroup and its ancestors (the least
one binds), found from ``/proc/<pid>/cgroup``, never from a built path.
"""
from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from typing import Iterable, Optional

UNLIMITED = 1 << 60
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000 ** 2, "mb": 1000 ** 2, "g": 1000 ** 3,
          "gb": 1000 ** 3, "t": 1000 ** 4, "tb": 1000 ** 4, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30,
          "tib": 1 << 40}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*$")


def _shown(value) -> str:
    """``repr(value)`` cut to 80 characters with "...": an error names the value, not all 5,000 of them."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def parse_bytes(value) -> int:
    """``6GiB``, ``512 MiB``, ``2.5G`` (SI: 1000-based), ``1048576`` or a number -> bytes (int).

    Raises ValueError naming the value for anything else (negative, unknown unit, not finite)."""
    if isinstance(value, bool):
        raise ValueError(f"not a size: {_shown(value)}")
    if isinstance(value, (int, float)):
        if not value >= 0 or value != value or value == float("inf"):
            raise ValueError(f"a size must be a finite number >= 0, got {_shown(value)}")
        return int(value)
    if not isinstance(value, str):
        raise ValueError(f"not a size: {_shown(value)}")
    m = _SIZE_RE.match(value)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {_shown(value)} (use bytes or a unit: KiB, MiB, GiB, TiB, KB, MB, GB, TB)")
    n = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if n == float("inf"):   # ("9" * 400: a float, but not a finite one; int() raised OverflowError)
        raise ValueError(f"a size must be a finite number >= 0, got {value[:40]!r}"
                         + ("..." if len(value) > 40 else ""))
    return int(n)


def format_bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


@dataclass(frozen=True)
class ProcessMemory:
    pid: int
    rss: int
    pss: int
    uss: int
    swap: int = 0
    source: str = "smaps_rollup"          # or "smaps" (kernels before 4.14)


def _kb_fields(text: str) -> dict[str, int]:
    """The ``Name: N kB`` fields of ``smaps_rollup`` or ``smaps`` in bytes, summed over the mappings."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        k, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[-1] == "kB" and parts[0].isdigit():
            out[k.strip()] = out.get(k.strip(), 0) + int(parts[0]) * 1024
    return out


def process_memory(pid: int, proc_root: str = "/proc") -> Optional[ProcessMemory]:
    """USS/PSS/RSS of one process, or None if it is gone or its smaps cannot be read (another uid,
    hidepid, not dumpable): ``smaps_rollup``, else ``smaps`` summed over its mappings (kernels before 4.14)."""
    base = os.path.join(proc_root, str(pid))
    for name in ("smaps_rollup", "smaps"):
        try:
            with open(os.path.join(base, name)) as f:
                d = _kb_fields(f.read())
        except (OSError, ValueError):
            continue
        if "Rss" in d:
            # hugetlbfs pages are in none of Rss, Pss, Private_* ("for historical reasons",
            # Documentation/filesystems/proc.rst); a private one is the process's own all the same
            huge = d.get("Private_Hugetlb", 0)
            uss = d.get("Private_Clean", 0) + d.get("Private_Dirty", 0) + huge
            return ProcessMemory(pid, d["Rss"] + huge, d.get("Pss", uss - huge) + huge, uss, d.get("Swap", 0), name)
    return None


@dataclass(frozen=True)
class NodeMemory:
    total: Optional[int]                  # MemTotal
    available: Optional[int]              # MemAvailable
    some_avg10: Optional[float] = None    # PSI memory, percent
    full_avg10: Optional[float] = None
    some_total_us: Optional[int] = None


def meminfo(proc_root: str = "/proc") -> tuple[Optional[int], Optional[int]]:
    """(MemTotal, MemAvailable) in bytes; None where absent."""
    try:
        with open(os.path.join(proc_root, "meminfo")) as f:
            d = _kb_fields(f.read())
    except OSError:
        return None, None
    return d.get("MemTotal"), d.get("MemAvailable")


def memory_pressure(proc_root: str = "/proc") -> tuple[Optional[float], Optional[float], Optional[int]]:
    """PSI memory (some avg10, full avg10, some total µs); Nones without CONFIG_PSI or with psi=0."""
    some = full = total = None
    try:
        with open(os.path.join(proc_root, "pressure", "memory")) as f:
            for line in f:
                kind, _, rest = line.partition(" ")
                vals = dict(p.partition("=")[::2] for p in rest.split())
                if kind == "some":
                    some = float(vals["avg10"])
                    total = int(vals["total"])
                elif kind == "full":
                    full = float(vals["avg10"])
    except (OSError, ValueError, KeyError):
        pass
    return some, full, total


def node_memory(proc_root: str = "/proc") -> NodeMemory:
    total, avail = meminfo(proc_root)
    some, full, some_total = memory_pressure(proc_root)
    return NodeMemory(total, avail, some, full, some_total)


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            s = f.read().strip()
    except OSError:
        return None
    if s == "max":
        return None
    try:
        v = int(s)
    except ValueError:
        return None
    return None if v >= UNLIMITED else v


@dataclass(frozen=True)
class CgroupMemory:
    limit: Optional[int]                  # the least limit of the cgroup and its ancestors; None = none
    usage: Optional[int]                  # memory.current / memory.usage_in_bytes of the same group
    path: str = ""                        # the group whose limit binds


def cgroup_memory(pid="self", proc_root: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> CgroupMemory:
    """The memory limit over process ``pid`` (v2 ``memory.max``, v1 ``memory.limit_in_bytes``) and
    that group's usage. Read only. ``CgroupMemory(None, None)`` when there is no limit or no cgroup."""
    try:
        with open(os.path.join(proc_root, str(pid), "cgroup")) as f:
            lines = f.read().splitlines()
    except OSError:
        return CgroupMemory(None, None)
    candidates = []          # (directory under cgroup_root, limit file, usage file)
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, ctrls, path = parts
        if "memory" in ctrls.split(","):
            candidates.append((os.path.join(cgroup_root, "memory"), path, "memory.limit_in_bytes",
                               "memory.usage_in_bytes"))
        elif hid == "0" and ctrls == "":
            base = cgroup_root
            if os.path.isdir(os.path.join(cgroup_root, "unified")):       # hybrid layout
                base = os.path.join(cgroup_root, "unified")
            candidates.append((base, path, "memory.max", "memory.current"))
    best = CgroupMemory(None, None)
    for base, path, limit_file, usage_file in candidates:
        rel = path.strip("/")
        while True:
            d = os.path.join(base, rel) if rel else base
            lim = _read_int(os.path.join(d, limit_file))
            if lim is not None and (best.limit is None or lim < best.limit):
                best = CgroupMemory(lim, _read_int(os.path.join(d, usage_file)), d)
            if not rel:
                break
            rel = os.path.dirname(rel)
    return best


def memory_room(pid="self", proc_root: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> Optional[int]:
    """Bytes more this process's cgroup and the node can give before either runs out: the least of
    MemAvailable and (cgroup limit - cgroup usage). None when neither is known."""
    return room_of(meminfo(proc_root)[1], cgroup_memory(pid, proc_root, cgroup_root))


def room_of(available: Optional[int], cg: CgroupMemory) -> Optional[int]:
    """``memory_room`` from figures already read: the node's MemAvailable and a ``cgroup_memory``."""
    room = available
    if cg.limit is not None and cg.usage is not None:
        cg_room = max(0, cg.limit - cg.usage)
        room = cg_room if room is None else min(room, cg_room)
    return room


def oom_kills(pid="self", proc_root: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> Optional[int]:
    """The OOM-kill count of process ``pid``'s memory cgroup (v2 ``memory.events`` ``oom_kill``, v1
    ``memory.oom_control`` ``oom_kill``), read only; None where the kernel does not say."""
    try:
        with open(os.path.join(proc_root, str(pid), "cgroup")) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        hid, _, rest = line.partition(":")
        ctrls, _, path = rest.partition(":")
        if "memory" in ctrls.split(","):
            d, name = os.path.join(cgroup_root, "memory", path.strip("/")), "memory.oom_control"
        elif hid == "0" and ctrls == "":
            base = os.path.join(cgroup_root, "unified") if os.path.isdir(os.path.join(cgroup_root, "unified")) \
                else cgroup_root
            d, name = os.path.join(base, path.strip("/")), "memory.events"
        else:
            continue
        try:
            with open(os.path.join(d, name)) as f:
                for row in f:
                    k, _, v = row.partition(" ")
                    if k == "oom_kill":
                        return int(v)
        except (OSError, ValueError):
            continue
    return None


# -- per-worker sampling in the loader's main process ------------------------------------------

@dataclass
class _WorkerTrack:
    first: ProcessMemory
    last: ProcessMemory
    first_t: float
    last_t: float
    fixed: bool = True                    # ``first`` is the baseline; False: it moves with each sample


@dataclass
class MemorySummary:
    """One sample of a loader's workers (bytes); what ``DataLoader.stats()["memory"]`` holds."""
    workers: int = 0                      # workers measured
    uss: int = 0                          # sum over workers
    pss: int = 0
    rss: int = 0
    uss_per_worker: float = 0.0           # mean over workers
    pss_per_worker: float = 0.0
    growth_per_worker: float = 0.0        # mean USS growth since each worker's baseline (first ready sample)
    max_uss: int = 0
    sampled_at: float = 0.0               # monotonic seconds of the sample (0 = never)
    sample_cost_s: float = 0.0            # CPU seconds the last sample cost (all workers)
    per_worker: dict = field(default_factory=dict)   # pid -> {uss, pss, growth}

    def to_dict(self) -> dict:
        return {"workers": self.workers, "uss": self.uss, "pss": self.pss, "rss": self.rss,
                "uss_per_worker": self.uss_per_worker, "pss_per_worker": self.pss_per_worker,
                "growth_per_worker": self.growth_per_worker, "max_uss": self.max_uss,
                "sample_cost_s": self.sample_cost_s,
                "per_worker": {str(p): dict(v) for p, v in self.per_worker.items()}}


class WorkerMemorySampler:
    """Samples the USS/PSS of a set of worker pids at most once per ``every_s`` (default 2 s).

    Each worker's first sample once it is ready (``sample``'s ``ready``: it finished a task) is its
    baseline; growth = its USS now - at its baseline. A worker that
    has gone keeps its last sample in ``last_seen`` (for a death report) until ``forget_dead``.
    Cost: one ``smaps_rollup`` read per worker per sample (``sample_cost_s``: the CPU time of the
    sampling thread, the kernel's page-table walk included; BENCHMARKS.md): the next sample is taken
    no sooner than ``every_s`` and no sooner than ``last cost / max_overhead`` (1%), so sampling
    never costs the training process more than ``max_overhead`` of one core however many workers."""

    def __init__(self, every_s: float = 2.0, proc_root: str = "/proc", max_overhead: float = 0.01) -> None:
        self.every_s = every_s
        self.max_overhead = max_overhead
        self.proc_root = proc_root
        self._tracks: dict[int, _WorkerTrack] = {}
        self.last_seen: dict[int, ProcessMemory] = {}
        self.summary = MemorySummary()
        self._next = 0.0
        self.last_death = ""
        try:
            self._oom_kills = oom_kills(proc_root=proc_root)
        except Exception:   # noqa: BLE001 — never fail a loader for a counter
            self._oom_kills = None

    def sample(self, pids: Iterable[int], now: Optional[float] = None, force: bool = False,
               ready: Optional[Iterable[int]] = None) -> MemorySummary:
        """``ready``: the workers that finished starting (None: all of ``pids``). A worker's baseline is
        its first sample once ready; until then each sample replaces it (growth 0). A fork copies pages
        into the new worker as it starts (its own start-up writes and its parent's, about 8 MiB with
        torch): measured from a sample taken before that, which a busy node's scheduling decides, a
        worker whose dataset stays shared would seem to grow with the samples it reads."""
        now = time.monotonic() if now is None else now
        pids = list(pids)
        ready = set(pids) if ready is None else set(ready)
        if not force and now < self._next and all(
                p in self._tracks and (self._tracks[p].fixed or p not in ready) for p in pids):
            # (a new worker, or one just ready, is sampled at once: its baseline should be early,
            # before it reads many samples); a worker that left the
            # set (retired) leaves the summary at once too, from the others' last samples, reading nothing
            if len(self._tracks) > len(set(pids)):
                self._drop_all_but(set(pids))
                self.summary = self._summarize(self.summary.sampled_at, self.summary.sample_cost_s)
            return self.summary
        self._next = now + self.every_s
        t0 = time.thread_time()
        alive = set()
        for pid in pids:
            m = process_memory(pid, self.proc_root)
            if m is None:
                continue
            alive.add(pid)
            tr = self._tracks.get(pid)
            if tr is None or not tr.fixed:
                self._tracks[pid] = _WorkerTrack(m, m, now, now, fixed=pid in ready)
            else:
                tr.last, tr.last_t = m, now
            self.last_seen[pid] = m
        self._drop_all_but(alive)
        cost = time.thread_time() - t0          # CPU time this thread spent (not wall: a loaded
                                                # node's run-queue wait is no cost to training)
        s = self._summarize(now, cost)
        self._next = now + max(self.every_s, cost / self.max_overhead)
        self.summary = s
        return s

    def _drop_all_but(self, pids: set) -> None:
        for pid in [p for p in self._tracks if p not in pids]:
            del self._tracks[pid]

    def _summarize(self, sampled_at: float, cost_s: float) -> MemorySummary:
        """The summary of every tracked worker's last sample."""
        s = MemorySummary(sampled_at=sampled_at, sample_cost_s=cost_s)
        growth_sum = 0.0
        for pid, tr in self._tracks.items():
            m = tr.last
            growth = m.uss - tr.first.uss
            s.workers += 1
            s.uss += m.uss
            s.pss += m.pss
            s.rss += m.rss
            s.max_uss = max(s.max_uss, m.uss)
            growth_sum += growth
            s.per_worker[pid] = {"uss": m.uss, "pss": m.pss, "growth": growth}
        if s.workers:
            s.uss_per_worker = s.uss / s.workers
            s.pss_per_worker = s.pss / s.workers
            s.growth_per_worker = growth_sum / s.workers
        return s

    def last_memory(self, pid: int) -> Optional[ProcessMemory]:
        return self.last_seen.get(pid)

    def describe_death(self, pid: int, exitcode: Optional[int]) -> str:
        """What is known of a worker that died: its last measured memory and the likely cause.

        SIGKILL is what the kernel's OOM killer sends. It is called the OOM killer's for certain when
        this process's memory cgroup counted a new ``oom_kill`` since the last death (or since the
        sampler started), and "likely" when the worker held much memory at its last sample (at least
        twice the other workers' mean, or 1 GiB) or the node or cgroup had little left (MemAvailable under
        10% of MemTotal, or usage within 10% of the cgroup limit). Kept in ``last_death``."""
        m = self.last_seen.get(pid)
        if m is not None:
            mem = f"last measured memory {format_bytes(m.uss)} unique / {format_bytes(m.pss)} proportional"
        else:
            mem = "its memory was not measured yet (it died within its first sample period)"
        cause = ""
        kills = oom_kills(proc_root=self.proc_root)
        before, self._oom_kills = self._oom_kills, kills
        if exitcode == -9:
            total, avail = meminfo(self.proc_root)
            cg = cgroup_memory("self", self.proc_root)
            low = (avail is not None and total and avail < 0.1 * total) or (
                cg.limit is not None and cg.usage is not None and cg.usage > 0.9 * cg.limit)
            others = [v["uss"] for p, v in self.summary.per_worker.items() if p != pid]
            big = m is not None and (m.uss >= (1 << 30) or (bool(others) and m.uss >= 2 * sum(others) / len(others)))
            if kills is not None and before is not None and kills > before:
                cause = f"killed by the kernel's OOM killer (SIGKILL; this cgroup's oom_kill count went {before} -> {kills})"
            elif big or low:
                why = "it held much memory" if big else "the node or cgroup was nearly out of memory"
                cause = f"likely killed by the kernel's OOM killer (SIGKILL while {why})"
            else:
                cause = "SIGKILL: the OOM killer or a kill -9 (no sign of memory shortage at the last sample)"
        self.last_death = f"worker pid {pid}: {mem}" + (f"; {cause}" if cause else "")
        return self.last_death

    def forget_dead(self, keep: Iterable[int]) -> None:
        keep = set(keep)
        for pid in [p for p in self.last_seen if p not in keep]:
            del self.last_seen[pid]


def batch_nbytes(data, _depth: int = 0) -> int:
    """Bytes of the tensors/arrays in a batch (containers walked; objects with ``nbytes``), the size
    a batch occupies in shared memory while in flight. Duck-typed: no torch or numpy import. An object
    whose ``nbytes`` raises (a sparse tensor's: RuntimeError) counts 0."""
    if _depth > 8:
        return 0
    try:
        nb = getattr(data, "nbytes", None)
    except Exception:       # noqa: BLE001 — a measurement never hurts training
        nb = None
    if isinstance(nb, int) and not isinstance(data, type):
        return nb
    if isinstance(data, (str, bytes, bytearray)):
        return len(data)
    if isinstance(data, dict):
        return sum(batch_nbytes(v, _depth + 1) for v in data.values())
    if isinstance(data, (list, tuple)):
        return sum(batch_nbytes(v, _depth + 1) for v in data[:4096])
    return 0


#: Keys that ``adloader.DataLoader.stats()`` adds for memory (bytes; see ``stats`` for their meaning).
STATS_KEYS = ("worker_uss_bytes", "worker_pss_bytes", "worker_uss_per_worker", "worker_growth_bytes",
              "memory_workers", "batch_bytes", "shm_inflight_bytes", "memory_sample_cost_s", "last_worker_death",
              "worker_cost_peak_bytes")
