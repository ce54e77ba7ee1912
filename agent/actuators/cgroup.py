"""CPU and IO for a job's loader workers: cgroup v1 / v2 groups the agent creates, or CPU affinity.

Ownership (DESIGN.md, "cgroups"): the agent writes only groups it created, ``<subtree>/<job>`` in its
own subtree of each hierarchy, and moves only the job's loader worker processes
(``JobStats.worker_pids``) into them, never its training processes (``JobStats.pids``), so the
process that feeds the GPU is never throttled.

CPU knob (``cpu_knob``), default ``shares`` (work-conserving: an idle share goes to whoever needs it):
- ``shares``: v1 ``cpu.shares = 1024 * cores`` (clamped to [2, 262144]); v2 ``cpu.weight`` from those
  shares as the kernel converts them (``weight = shares * 100 / 1024``, clamped to [1, 10000]), so
  jobs split the subtree in proportion to their cores.
- ``quota``: a hard cap, v1 ``cpu.cfs_quota_us = cores * cpu.cfs_period_us``; v2 ``cpu.max``. Leaves
  cores idle that another job could use; for isolation only.
- ``cpuset``: exclusive CPUs from the plan (``PolicyConfig.pin_cpusets``); v1 ``cpuset.cpus`` and
  ``cpuset.mems`` are both written before any task joins (ENOSPC otherwise).

The subtree's own weight (every knob): the subtree competes as ONE entity against every other
runnable task and group on the node, so the agent must arbitrate between jobs without shrinking the
loaders' claim against the rest of the node. Unmanaged, each busy worker process in the root group
weighs 1024 (a nice-0 task), N workers N x 1024. So the subtree weighs what its workers would:
v1 ``<subtree>/cpu.shares = 1024 * workers`` (the worker pids in our job groups, all jobs; clamped to
[2, 262144]); v2 ``cpu.weight = 100 * workers`` ([1, 10000]). Worker processes, not allocated cores:
the cores add up to the loader budget (e.g. 1.8 on a 2-core node), far less than the workers would
weigh, and with cores the subtree took CPU away from the loaders as a whole (BENCHMARKS.md, the
bench's "Reading"). Where the training processes need CPU themselves (``trainer_cpu_s_per_step``
measured, ``agent.policies.trainer_cores_needed``), the subtree is also capped (v1
``cpu.cfs_quota_us``, v2 ``cpu.max``) at the node's CPUs less what the trainers will use at the pace
their data allows (``trainer_cores_expected``: a data-starved job's trainer needs a fraction of its
full-speed need; a CPU-starved one, which does not wait for data, all of it; plus a margin), never
below the cores the plan gave the loaders: the loaders never get the cores a trainer needs, whatever
their number, while they keep every other core, the agent's 10% reserve included (so the cap is not
the loader budget). A weight could not do this: against a crowd of busy workers a runnable trainer (one
nice-0 task) gets a fraction of a core unless the subtree weighs so little that it loses to every
other process on the node. The cap bounds the loaders' CPU per period, not who runs first: a trainer
sleeps through its GPU part every step and, when it wakes, time-shares the CPU it lands on with the
subtree by weight, so while it is there its CPU part (on the step's critical path; the loaders have a
queue of batches) stretches by the subtree's weight on that CPU. So where trainers need CPU the
subtree weighs the cores the plan gives the loaders, one nice-0 task per planned core
(``subtree_shares_for_cores``), as each trainer (one task) weighs the core it needs, not one task per
worker (issue 11: the controller-driven simulator, validated against the measured runs, put adaptive
at 1.03x / 0.91x / 1.04x the best baseline on the 2-core gpu-weighted / trainer-cpu / oversubscribed
mixes with one task per worker, 1.14x / 0.98x / 1.08x with one per planned core). The cost: against
processes the agent does not manage (a CPU hog, a daemon) the loaders then claim their planned cores,
not their worker count, except while other processes' CPU stops the yield below
(``NodeAllocation.weigh_workers``, config ``foreign_weight = "workers"``, the default): then the
subtree weighs its workers, still capped. Without trainer CPU the subtree weighs its workers and is not capped (the
original quota).

Yielding (the plan's ``NodeAllocation.loaders_yield``, ``agent.policies.node_allocation``): while the
trainers need CPU and the rest of the node is quiet, the subtree is ``cpu.idle = 1`` (v1 and v2, kernel
5.15+; kernel/sched/fair.c ``sched_group_set_idle``): it weighs as a SCHED_IDLE task against its
siblings, a waking trainer preempts its workers at once, and it still runs on every core nobody
else wants (work-conserving, so no cap is written). Within the subtree the jobs still split by their
shares. The trainers' figures come fresh with each node allocation (``apply_node``); without one, the
ones noted at each job's apply are used. Where the kernel has no ``cpu.idle`` the weight and cap above
are used and the result says so. The original value is recorded before the first write and restored by
``restore()``; the file is written again only when the total changes. Caveats: with sched autogroup
(``/proc/sys/kernel/sched_autogroup_enabled``) the root group's tasks of one session weigh 1024
together, so there unmanaged workers weigh less than this; on v2 under systemd the subtree sits in
the agent's unit, whose own ``CPUWeight=`` (systemd's, not ours) decides against other units.

IO: ``blkio.bfq.weight`` (v1), ``io.weight`` (v2 with iocost) or ``io.bfq.weight`` (v2 with BFQ), written
only where some block device's scheduler enforces it; otherwise the result says "not enforced", as it
does for network file systems, which no block IO weight reaches.

Cooperative jobs (Slurm with ConstrainCores owns the job's cgroup; ``JobStats.cooperative``) and the
``cooperative`` mode: no cgroup writes; CPU affinity of the worker pids within the job's allowed CPUs.

Every original value is recorded before the first write (``Originals``), restored by ``restore()``;
a job's groups are removed on ``release()`` after its processes are moved back where they came from.
Worker pids change (resizes, restarts): every ``apply`` moves the job's new worker pids in, each only
while it is still the process the registry took as the worker (``still_the_worker``: its recorded start
time and the job's uid; a pid reused since the client's last report is left where it is).

Where the groups live:
- v1: ``<hierarchy>/<subtree>/<job>`` at the top of each controller hierarchy (e.g. /sys/fs/cgroup/cpu/adloader/j).
- v2: under the agent's own cgroup, read from ``<proc_root>/self/cgroup`` ("0::/path"). Under systemd with
  ``Delegate=yes`` the agent owns only its unit's group (e.g. /system.slice/adloader-agent.service), so job
  groups are ``<own>/<subtree>/<job>``. v2's "no internal processes" rule (a non-root group with processes
  cannot enable controllers for its children: EBUSY; Documentation/admin-guide/cgroup-v2.rst) means the
  processes in ``<own>`` must first go to a leaf, ``<own>/agent`` (``V2_AGENT_LEAF``): before the first group
  is made, every process of ``<own>`` (the agent and any helper it started) moves there, and ``+cpu``
  (``+cpuset``, ``+io`` when used and available) is enabled in ``cgroup.subtree_control`` from the root down
  to ``<own>`` and then ``<own>/<subtree>``, each original recorded and restored. An agent already in a
  group named ``agent`` (a previous run, or systemd ``DelegateSubgroup=agent``) takes its parent as
  ``<own>``. When the agent's cgroup is the root ("0::/"), the groups are ``/<subtree>/<job>`` as on v1.
  ``restore()`` moves the processes of the leaf back to ``<own>`` and removes the leaf once ``<own>`` has
  no controllers enabled for its children any more. A leaf the agent made is in the journal of
  originals (``created``, as ``|<own>/agent``), so a restarted agent (which then usually runs in that
  leaf itself) removes it on stop as the one that made it would have; a leaf it did not make (systemd's
  ``DelegateSubgroup=agent``, or one that was there before) is never listed, and stays.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import time
from typing import Optional

from agent import cgroupfs, logs, statefile
from agent.actuators import CPU_KNOBS, SubtreeInUse
from agent.actuators.originals import Originals
from agent.cgroupfs import Busy, CgroupError, Hierarchy, JobGone, NotSupported
from agent.model import ApplyResult, JobAllocation, JobStats, NodeAllocation

SHARES_MIN, SHARES_MAX, SHARES_DEFAULT = 2, 262144, 1024
TRAINER_CPU_MIN = 0.05      # cores: below this the training processes are taken to need no CPU (as agent.policies)
QUOTA_MIN_US = 1000
V2_BUSY_TRIES = 4           # v2: moves of <own>'s processes to the leaf before its controllers are refused
V2_AGENT_LEAF = "agent"      # v2: the leaf under the agent's own cgroup that the agent's processes move to
log = logging.getLogger("agent.cgroup")
# what the kernel gives a new group in the cpu files the agent writes on its subtree (cpu.idle: 5.15+)
NEW_GROUP_CPU = {1: {"cpu.idle": "0", "cpu.shares": str(SHARES_DEFAULT), "cpu.cfs_quota_us": "-1"},
                 2: {"cpu.idle": "0", "cpu.weight": "100", "cpu.max": "max 100000"}}


CGROUP_RESERVED = frozenset({"tasks", "notify_on_release", "release_agent"})   # v1 files without a dot
_ESCAPE = "~"     # never in a job id (protocol.JOB_ID_GRAMMAR), so escaped names and plain ones never meet


def group_name(job_id: str) -> str:
    """The cgroup directory name of a job: one-to-one (``job_of_group`` inverts it). A job id
    (``protocol.check_job_id``: no '/', never '.' or '..') is its own name unless it could be a cgroup
    interface file (every such file has a dot, or is one of ``CGROUP_RESERVED``): then the name is
    ``~`` + the id with each '.' as '~'. So ``adv_col`` and ``adv.col`` (once ``adv/col`` is refused at
    the protocol boundary) get two groups, and ``cpu.shares`` cannot collide with the file."""
    if not job_id or "/" in job_id or "\0" in job_id or job_id.startswith(_ESCAPE) or _ESCAPE in job_id:
        raise CgroupError(f"job id {job_id!r} cannot name a cgroup (refused by protocol.check_job_id)")
    if "." in job_id or job_id in CGROUP_RESERVED:
        return _ESCAPE + job_id.replace(".", _ESCAPE)
    return job_id


def job_of_group(name: str) -> str:
    """Inverse of ``group_name``."""
    return name[1:].replace(_ESCAPE, ".") if name.startswith(_ESCAPE) else name


def shares_for(cores: float) -> int:
    return max(SHARES_MIN, min(SHARES_MAX, int(round(SHARES_DEFAULT * cores))))


def weight_from_shares(shares: int) -> int:
    """cgroup v1 cpu.shares -> v2 cpu.weight as the kernel relates them: linear, 1024 -> 100.

    The kernel turns cpu.weight w into the load weight w * 1024 / 100 (sched_weight_from_cgroup in
    kernel/sched; a nice-0 task weighs 1024), and cpu.shares s into s, so ``round(s * 100 / 1024)``
    (clamped to [1, 10000]) keeps the ratios between groups, and a group's weight against tasks, as on
    v1. Not runc's curved mapping (runc >= 1.3: 2 -> 1, 1024 -> 100, 262144 -> 10000), which is right for
    Kubernetes requests but gives a 3-core job only 2.4x a 1-core one, and 8 workers 531, not 800.
    """
    if shares <= 0:
        return 100
    s = max(SHARES_MIN, min(SHARES_MAX, int(shares)))
    return max(1, min(10000, int(round(s * 100 / SHARES_DEFAULT))))


def _node_cpus() -> float:
    """CPUs this agent may run on (the node's, unless it is pinned)."""
    try:
        return float(len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return float(os.cpu_count() or 1)


def subtree_shares_for(workers: int) -> int:
    """What ``workers`` busy worker processes weigh in the root group, as v1 cpu.shares (clamped)."""
    return max(SHARES_MIN, min(SHARES_MAX, SHARES_DEFAULT * int(workers)))


def subtree_shares_for_cores(cores: float) -> int:
    """One nice-0 task per planned loader core (at least one), as v1 cpu.shares (clamped): the subtree's
    weight where training processes need CPU (module docstring)."""
    return max(SHARES_MIN, min(SHARES_MAX, int(round(SHARES_DEFAULT * max(1.0, float(cores))))))


def shares_from_weight(weight: int) -> int:
    """The least shares whose ``weight_from_shares`` reaches ``weight`` (inverse of the mapping)."""
    lo, hi = SHARES_MIN, SHARES_MAX
    while lo < hi:
        mid = (lo + hi) // 2
        if weight_from_shares(mid) < weight:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _start_ticks(pid: int, proc_root: str = "/proc") -> Optional[int]:
    """The process's start time (``agent.security.pid_start_ticks``): with the pid, an identity that
    survives pid reuse. None if it is gone."""
    from agent.security import pid_start_ticks

    return pid_start_ticks(pid, proc_root)


def still_the_worker(job: JobStats, pid: int, proc_root: str = "/proc") -> bool:
    """Whether ``pid`` is still the worker the registry took: the start time it recorded
    (``JobStats.worker_starts``) and the job's uid (``agent.security.same_process``). Checked right before
    each write to a worker pid (a move into a group, an affinity): a worker that exited may have left its
    pid to another process, of any user, since the client's last report, and that process was moved into
    the job's group with the job's loaders. Such a pid is skipped, not an error (the job's other workers
    are applied, its breaker is not tripped), and logged at debug. A pid the stats carry no start time
    for is not checked (``JobStats.worker_starts``). The check and the write are two system calls: a pid
    reused between them (microseconds, against the second or so to the client's next report) is not
    caught; cgroup v1 has no pidfd to write."""
    if pid not in job.worker_starts:
        return True
    from agent.security import same_process

    if same_process(pid, job.worker_starts[pid], job.uid, proc_root):
        return True
    logs.event(log, "worker_pid_not_the_worker", logging.DEBUG, job=job.job, pid=pid,
               start_ticks=job.worker_starts[pid], uid=job.uid,
               detail="exited; its pid is another process now, or gone: left alone")
    return False


def _exited(pid: int, proc_root: str = "/proc") -> bool:
    """True for a process that has exited but is not reaped yet (state Z or X in /proc/<pid>/stat).
    A pid whose stat cannot be read is not taken as exited here (moving it says JobGone if it is gone)."""
    from agent.psi import pid_stat

    rest = pid_stat(pid, proc_root)
    return bool(rest) and rest[0] in (b"Z", b"X", b"x")


class AffinityActuator:
    """CPU affinity of a job's worker pids within its allowed CPUs (cooperative mode; no cgroup writes).

    CPUs: the plan's cpuset if it has one (intersected with the allowed CPUs), else the last
    ``ceil(cores)`` of the allowed CPUs (a set cannot hold a fraction: that is reported).

    Each original affinity is kept with the process's start time, and put back only on that same
    process: a worker's pid that another process holds by the time it is put back (pid reuse, on a
    long job whose loader restarts its workers) is left alone. A pid that left the job's worker list
    is put back (or forgotten, if gone) at the job's next apply, so the journal holds the workers of
    now, not every worker the job ever had. A listed pid that is no longer the worker the registry took
    (``still_the_worker``) is neither recorded nor pinned.

    ``proc_root``: where a process's start time is read (the agent's configured /proc, as for every
    other read of a process; the affinity itself is a system call on the pid).
    """

    name = "affinity"
    tracks_pids = True

    def __init__(self, originals: Optional[Originals] = None, all_cpus: Optional[tuple[int, ...]] = None,
                 proc_root: str = "/proc") -> None:
        self.originals = originals if originals is not None else Originals()
        self._all_cpus = all_cpus
        self.proc_root = proc_root
        self.pids_skipped = 0        # worker pids left alone: no longer the recorded worker (still_the_worker)

    def cpus_for(self, job: JobStats, desired: JobAllocation) -> tuple[int, ...]:
        allowed = tuple(job.allowed_cpus) or self._all_cpus or cgroupfs.get_affinity(0)
        if desired.cpuset:
            chosen = tuple(c for c in desired.cpuset if c in allowed)
            if chosen:
                return chosen
        n = max(1, min(len(allowed), math.ceil(desired.cpus - 0.05)))
        return tuple(sorted(allowed)[-n:])

    def apply(self, job: JobStats, desired: JobAllocation) -> ApplyResult:
        if not desired.enforce_cpu:
            self.release(job.job)
            return ApplyResult(job=job.job, ok=True, applied=desired)
        try:
            cpus = self.cpus_for(job, desired)
            pids = worker_pids(job)
            current = {str(p) for p in pids}
            self._restore_pids([k for k, v in self.originals.affinity.items()
                                if v.get("job") == job.job and k not in current])
            for pid in pids:
                key = str(pid)
                if not still_the_worker(job, pid, self.proc_root):
                    self.pids_skipped += 1
                    continue
                try:
                    if key not in self.originals.affinity:
                        entry = {"job": job.job, "cpus": list(cgroupfs.get_affinity(pid))}
                        start = _start_ticks(pid, self.proc_root)
                        if start is not None:
                            entry["start"] = start
                        self.originals.affinity[key] = entry
                        self.originals.save()
                    cgroupfs.set_affinity(pid, cpus)
                except JobGone:
                    self.originals.affinity.pop(key, None)
        except CgroupError as e:
            return ApplyResult(job=job.job, ok=False, applied=None, error=f"affinity for job {job.job!r}: {e}")
        finally:
            self.originals.save()
        notes = ()
        if abs(desired.cpus - len(cpus)) > 0.05 and not desired.cpuset:
            notes = (f"cpu: affinity gives whole CPUs: {len(cpus)} for {desired.cpus:.2f} cores",)
        return ApplyResult(job=job.job, ok=True, applied=desired, not_enforced=notes)

    def _restore_pids(self, keys) -> None:
        for key in list(keys):
            entry = self.originals.affinity.pop(key, None)
            if entry is None:
                continue
            if "start" in entry and _start_ticks(int(key), self.proc_root) != entry["start"]:
                continue      # gone, or the pid is another process's now: nothing of ours to put back
            try:
                cgroupfs.set_affinity(int(key), entry["cpus"])
            except CgroupError:
                pass      # gone, or no longer ours to change: nothing to put back
        self.originals.save()

    def release(self, job_id: str) -> None:
        self._restore_pids([k for k, v in self.originals.affinity.items() if v.get("job") == job_id])

    def held_jobs(self) -> set[str]:
        """The jobs whose workers' original affinity the journal of originals holds."""
        return {v["job"] for v in self.originals.affinity.values()}

    def restore(self) -> None:
        self._restore_pids(list(self.originals.affinity))


def worker_pids(job: JobStats) -> list[int]:
    """The job's loader workers, never its training processes."""
    training = set(job.pids)
    return [p for p in job.worker_pids if p not in training and p > 0]


class SubtreeClaim:
    """One agent per cgroup subtree: an exclusive ``flock`` on ``<lock_dir>/cgroup-subtree-<hash>.lock``,
    the hash of the subtree's path in the cpu hierarchy (so agents on other subtrees, or on fake trees,
    never meet), held from before the first write until ``release``, and let go by the kernel when the
    process dies (SIGKILL included). The file holds the holder's pid, state directory and subtree, for
    the message of the agent it refuses.

    Why: the state directory's lock (``agent.daemon``) stops two agents on one state directory, not two
    with their own state directories and the same ``cgroup_subtree``. Each took the subtree as its own:
    each wrote the subtree's weight over the other's, one that lost its journal of originals took the
    other's job groups as a dead agent's (``adopt_orphans``) and emptied and removed them, and the
    first to stop put the subtree back under the other's groups.

    ``lock_dir`` is shared by every agent of this user on the node (``adloader.env.runtime_dir``:
    /run/adloader for root, the systemd unit's RuntimeDirectory). The file is removed on ``release``
    while still locked; a claim checks, once locked, that the path is still the file it locked (one
    removed meanwhile by a releasing holder is tried again), so two holders never lock two files."""

    def __init__(self, lock_dir: str, subtree_path: str, owner: str) -> None:
        self.subtree_path = subtree_path
        name = hashlib.sha256(os.fsencode(subtree_path)).hexdigest()[:20]
        self.path = os.path.join(lock_dir, f"cgroup-subtree-{name}.lock")
        self._made = statefile.make_dir(lock_dir, mode=0o755)
        self.fd: Optional[int] = None
        for _ in range(5):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = self._holder(fd)
                os.close(fd)
                statefile.remove_made(self._made)
                raise SubtreeInUse(
                    f"cgroup subtree {subtree_path} is in use by another agent on this node "
                    f"(pid {holder.get('pid', '?')}, state_dir {holder.get('state_dir', '?')!r}); this agent's "
                    f"state_dir is {owner!r}. Two agents on one subtree remove each other's groups: give each a "
                    f"cgroup_subtree of its own (config key cgroup_subtree, ADLOADER_CGROUP_SUBTREE), or stop "
                    f"the other one (lock {self.path})") from None
            except BaseException:
                os.close(fd)
                raise
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:            # released (and removed) by its holder between our open and our lock
                os.close(fd)
                continue
            doc = json.dumps({"pid": os.getpid(), "state_dir": owner, "subtree": subtree_path}).encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, doc, 0)
            self.fd = fd
            return
        raise SubtreeInUse(f"cgroup subtree {subtree_path}: its lock {self.path} kept changing hands")

    @staticmethod
    def _holder(fd: int) -> dict:
        try:
            doc = json.loads(os.pread(fd, 4096, 0) or b"{}")
        except (OSError, ValueError):
            return {}
        return doc if isinstance(doc, dict) else {}

    def release(self) -> None:
        """Remove the file (still locked: no other claim can hold it) and let go; idempotent."""
        if self.fd is None:
            return
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None
        statefile.remove_made(self._made)


class CgroupActuator:
    """One cgroup group per job under ``subtree`` in each hierarchy it needs (see the module docstring).

    ``hierarchies``: v1 {controller: Hierarchy} ('cpu' required; 'cpuset', 'blkio' optional),
    v2 {'': the unified Hierarchy}.
    """

    tracks_pids = True

    def __init__(self, hierarchies: dict[str, Hierarchy], *, version: int, cpu_knob: str = "shares",
                 io: bool = True, subtree: str = "adloader", originals: Optional[Originals] = None,
                 sys_root: str = "/sys", proc_root: str = "/proc",
                 affinity: Optional[AffinityActuator] = None, node_cpus: Optional[float] = None) -> None:
        if cpu_knob not in CPU_KNOBS:
            raise ValueError(f"unknown cpu_knob {cpu_knob!r}; choose one of: {', '.join(CPU_KNOBS)}")
        self.h = hierarchies
        self.version = version
        self.name = f"cgroup-v{version}"
        self.cpu_knob = cpu_knob
        self.subtree = subtree.strip("/")
        self.base = ""              # v2: the agent's own group ('' = root); see the module docstring
        if version == 2:
            own = cgroupfs.own_v2_cgroup(proc_root).strip("/")
            if own.rsplit("/", 1)[-1] == V2_AGENT_LEAF:
                own = own.rsplit("/", 1)[0] if "/" in own else ""
            self.base = own
            if own:
                self.subtree = f"{own}/{self.subtree}"
        self._base_ready = not self.base
        self.originals = originals if originals is not None else Originals()
        # v2: the leaf this actuator (or the dead agent whose journal it read) created and moved into
        self._leaf: Optional[str] = None
        if self.base and Originals.key("", self._leaf_path()) in self.originals.created:
            self._leaf = self._leaf_path()
        self.proc_root = proc_root
        self.affinity = affinity or AffinityActuator(self.originals, proc_root=proc_root)
        self._shares: dict[str, int] = {}            # job -> shares written to its group
        self._workers: dict[str, int] = {}           # job -> its worker pids in its cpu group
        self._hiers: dict[str, set[str]] = {}        # job -> hierarchies its last apply put its group in
        self._cores: dict[str, float] = {}           # job -> cores the plan gives its loader
        self._trainer: dict[str, float] = {}         # job -> cores its training processes need
        self._trainer_pace: dict[str, float] = {}    # job -> cores they use at the pace the data allows
        self._subtree_shares: Optional[int] = None   # the subtree's weight last written, as shares
        self._subtree_cap: Optional[float] = None    # the subtree's CPU cap last written (None: none)
        self._subtree_cap_read = False               # _subtree_cap read back from the subtree (a restart)
        self._subtree_idle: Optional[bool] = None    # cpu.idle last written (None: never written)
        self._subtree_ident: Optional[int] = None    # the subtree group those three were written to (inode)
        self._node: Optional[NodeAllocation] = None  # the last node allocation (apply_node)
        self.pids_skipped = 0                        # worker pids not moved: no longer the recorded worker
        self.node_cpus = node_cpus if node_cpus is not None else _node_cpus()
        self._cpu_hier = "cpu" if version == 1 else ""
        if self._cpu_hier not in self.h:
            raise NotSupported(f"no cgroup v{version} cpu hierarchy to write (looked in {sorted(self.h)})")
        self.io_mode, self.io_notes = self._probe_io(io, sys_root, proc_root)
        self.claim: Optional[SubtreeClaim] = None
        self._load_existing_shares()

    def claim_subtree(self, lock_dir: str, owner: str) -> None:
        """Take the subtree for this agent (``SubtreeClaim``; raises ``SubtreeInUse``); ``restore`` or
        ``release_subtree`` lets it go."""
        if self.claim is None:
            self.claim = SubtreeClaim(lock_dir, self.h[self._cpu_hier].path(self.subtree), owner)

    def release_subtree(self) -> None:
        if self.claim is not None:
            self.claim.release()
            self.claim = None

    def _load_existing_shares(self) -> None:
        """After a restart, the job groups already in our subtree still weigh what they weighed, and
        their processes still count in the subtree's weight. A group's quota (the ``quota`` knob) is
        read back as its planned cores: the subtree's cap is never written below them, or v1 refuses
        it (EINVAL: a child's quota above its parent's) until that job is applied again."""
        h = self.h[self._cpu_hier]
        if not h.exists(self.subtree):
            return
        created = set(self.originals.created)
        for rel in _children(h, self.subtree):
            name = rel[len(self.subtree) + 1:]
            if "/" in name or Originals.key(self._cpu_hier, rel) not in created:
                continue
            job = job_of_group(name)
            try:
                self._workers[job] = len(h.procs(rel))
                if self.version == 1:
                    self._shares[job] = int(h.read(rel, "cpu.shares"))
                else:
                    self._shares[job] = shares_from_weight(int(h.read(rel, "cpu.weight")))
            except (CgroupError, ValueError):
                continue
            cores = self._read_quota_cores(rel)
            if cores is not None and job not in self._cores:
                self._cores[job] = cores

    def adopt_orphans(self) -> list[str]:
        """Take the subtree and every group below it that the journal of originals does not list as
        ours (it was lost): recorded as created, so ``release``/``restore`` empty and remove them.
        The subtree's own CPU files (its weight, cap and idle flag, which the dead agent may have left
        capped) get a new group's values as their originals: where the subtree cannot be removed (a
        group that is not ours is still in it), ``restore`` writes those back, so no cap outlives us.
        Returns the job names found."""
        found: list[str] = []
        adopted = False
        for hier, h in self.h.items():
            if not h.exists(self.subtree):
                continue
            if Originals.key(hier, self.subtree) not in self.originals.created:
                if hier == self._cpu_hier:
                    for file, value in NEW_GROUP_CPU[self.version].items():
                        if h.has_file(self.subtree, file):
                            self.originals.files.setdefault(Originals.key(hier, self.subtree, file), value)
                self.originals.created.append(Originals.key(hier, self.subtree))     # before its children
                adopted = True
            for rel in sorted(_children(h, self.subtree), key=lambda r: r.count("/")):
                key = Originals.key(hier, rel)
                if key not in self.originals.created:
                    self.originals.created.append(key)
                    adopted = True
                    name = rel[len(self.subtree) + 1:]
                    if "/" not in name and job_of_group(name) not in found:
                        found.append(job_of_group(name))
        if adopted:
            self.originals.save()
            self._load_existing_shares()      # they weigh, and hold quotas, as the journal's groups do
        return found

    # -- probing ------------------------------------------------------------------------------
    def _probe_io(self, io: bool, sys_root: str, proc_root: str) -> tuple[Optional[str], tuple[str, ...]]:
        """Which IO weight file enforces anything here, and honest notes about what it cannot reach."""
        if not io:
            return None, ()
        notes: list[str] = []
        nets = cgroupfs.network_mounts(proc_root)
        if nets:
            notes.append("io: network file systems not covered by io weights: "
                         + ", ".join(f"{fs} at {mp}" for mp, fs in nets[:3]))
        scheds = cgroupfs.block_schedulers(sys_root)
        bfq = sorted(d for d, s in scheds.items() if s == "bfq")
        others = ", ".join(f"{d}: {s}" for d, s in sorted(scheds.items()) if s != "bfq" and not d.startswith(("loop", "ram")))
        mode = None
        if self.version == 2:
            root = self.h[""]
            iocost = False
            try:
                iocost = "enable=1" in root.read("", "io.cost.qos")
            except CgroupError:
                pass
            if "io" not in root.controllers():
                notes.append("io: no io controller in the cgroup v2 hierarchy; io weights not enforced")
            elif iocost:
                mode = "io.weight"
            elif bfq:
                mode = "io.bfq.weight"
        elif "blkio" in self.h and bfq:
            mode = "blkio.bfq.weight"
        if mode is None and not (self.version == 2 and notes and "no io controller" in notes[-1]):
            notes.append(f"io: not enforced: no device uses bfq{' or iocost' if self.version == 2 else ''}"
                         f" ({others or 'no block devices'}); loader parallelism is the IO lever")
        elif mode is not None and others:
            notes.append(f"io: weights enforced on {', '.join(bfq) or 'iocost devices'} only, not on {others}")
        return mode, tuple(notes)

    # -- groups -------------------------------------------------------------------------------
    def _group(self, job_id: str) -> str:
        return f"{self.subtree}/{group_name(job_id)}"

    def _record(self, hier: str, rel: str, file: str) -> None:
        """Remember a file's value before our first write (only for groups we did not create)."""
        key = Originals.key(hier, rel, file)
        if key in self.originals.files or Originals.key(hier, rel) in self.originals.created:
            return
        h = self.h[hier]
        if h.has_file(rel, file):
            self.originals.files[key] = h.read(rel, file)
            self.originals.save()

    def _write(self, hier: str, rel: str, file: str, value) -> None:
        self._record(hier, rel, file)
        self.h[hier].write(rel, file, value)

    def _prepare_v2_base(self) -> None:
        """v2, the agent's own group not the root: controllers enabled down to it, its processes in a leaf."""
        if self._base_ready:
            return
        h = self.h[""]
        if not h.exists(self.base):
            raise NotSupported(f"the agent's own cgroup /{self.base} (from {self.proc_root}/self/cgroup) is not "
                               f"under {h.root}; set cgroup_root to the cgroup2 mount this process sees")
        parts = self.base.split("/")
        for i in range(len(parts)):                # the root and every ancestor of <own>
            self._enable_v2_controllers("/".join(parts[:i]))
        self._own_to_leaf()
        self._base_ready = True

    def _leaf_path(self) -> str:
        return f"{self.base}/{V2_AGENT_LEAF}"

    def _own_to_leaf(self) -> None:
        """Every process now in <own> to <own>/agent (created if need be, and then journaled as ours)."""
        h = self.h[""]
        own = h.procs(self.base)
        if own:
            leaf = self._leaf_path()
            if not h.exists(leaf) and self._mkdir_journaled("", leaf):
                self._leaf = leaf
            for pid in own:
                try:
                    h.move(leaf, pid)
                except JobGone:
                    pass

    def _enable_v2_controllers_on_own(self) -> None:
        """``+cpu`` for <own>'s children. A process forked in <own> while its processes moved to the leaf
        (a job started by a process that shares the agent's group: the bench, a shell) lands in <own> and
        the kernel refuses (EBUSY): move again and retry, a few times. Exited tasks that their parent has
        not reaped yet keep a group populated and cannot be moved; if it stays busy the error says so."""
        h = self.h[""]
        for attempt in range(V2_BUSY_TRIES):
            try:
                self._enable_v2_controllers(self.base)
                return
            except Busy as e:
                if attempt == V2_BUSY_TRIES - 1:
                    left = h.procs(self.base)
                    raise Busy(f"{e}: the agent's own group /{self.base} still holds "
                               + (f"processes {left[:10]} after {V2_BUSY_TRIES} moves to its leaf" if left else
                                  "exited processes not yet reaped by their parent")
                               + "; start the agent in a group of its own (systemd does)") from e
                time.sleep(0.02 * (attempt + 1))
                self._own_to_leaf()

    def _undo_v2_leaf(self) -> None:
        """Back to how we found it: the leaf's processes to <own>, the leaf removed (only if we made it:
        this agent, or the dead one whose journal lists it), and forgotten by the journal."""
        if self._leaf is None:
            return
        h = self.h[""]
        if h.exists(self._leaf) and h.subtree_control(self.base):
            return          # <own> still enables controllers for its children: no process may go back there
        if h.exists(self._leaf):
            for pid in h.procs(self._leaf):
                try:
                    h.move(self.base, pid)
                except JobGone:
                    pass
            h.rmdir(self._leaf)
        key = Originals.key("", self._leaf)
        if key in self.originals.created:
            self.originals.created.remove(key)
        self._leaf = None

    def _ensure(self, hier: str, rel: str) -> None:
        """Create ``rel`` (and its parents) in the hierarchy, preparing what a task needs to join."""
        h = self.h[hier]
        if h.version == 2:
            self._prepare_v2_base()
        parts = rel.split("/")
        for i in range(1, len(parts) + 1):
            cur = "/".join(parts[:i])
            parent = "/".join(parts[:i - 1])
            if h.exists(cur):
                if hier == "cpuset" and Originals.key(hier, cur) in self.originals.created:
                    self._fill_cpuset(cur, parent)   # made by an agent killed before it filled them
                continue
            if h.version == 2 and parent == self.base and self.base:
                self._enable_v2_controllers_on_own()
            elif h.version == 2:
                self._enable_v2_controllers(parent)
            self._mkdir_journaled(hier, cur)
            if hier == "cpuset":
                self._fill_cpuset(cur, parent)

    def _fill_cpuset(self, rel: str, parent: str) -> None:
        """v1: a new cpuset group starts with empty ``cpuset.cpus`` and ``cpuset.mems``; both must be set
        before a task may join (ENOSPC), and a child's CPUs must be within its parent's (an empty parent
        refuses every one: EACCES). Each that is empty gets the parent's. Also done for a group of ours
        found existing: an agent SIGKILLed between the mkdir and these writes left them empty, and every
        cpuset job then failed, for ever, with "Permission denied"."""
        h = self.h["cpuset"]
        for file in ("cpuset.cpus", "cpuset.mems"):
            if not h.read(rel, file):
                h.write(rel, file, h.read(parent, file))

    def _mkdir_journaled(self, hier: str, rel: str) -> bool:
        """Create a group, listed in the journal of originals (``created``) BEFORE the mkdir: a SIGKILL
        between the two leaves a listed group that was never made (``_drop_group`` forgets it), never a
        made one that no journal lists (a restarted agent found it existing, took it as not its own, and
        neither removed it on stop nor moved its workers out: the subtree's rmdir then failed EBUSY).
        False (and not listed) if the group existed already: someone else made it meanwhile."""
        key = Originals.key(hier, rel)
        listed = key in self.originals.created       # made before, and removed by someone else since
        if not listed:
            self.originals.created.append(key)
            self.originals.save()
        made = False
        try:
            made = self.h[hier].mkdir(rel)
        finally:
            if not made and not listed:
                self.originals.created.remove(key)
                self.originals.save()
        return made

    def _enable_v2_controllers(self, rel: str) -> None:
        h = self.h[""]
        want = {"cpu"}
        if self.cpu_knob == "cpuset":
            want.add("cpuset")
        if self.io_mode:
            want.add("io")
        have = h.controllers(rel)
        missing = want - have
        if "cpu" in missing:
            raise NotSupported(f"the cgroup v2 group {h.path(rel)} has no cpu controller "
                               f"(cgroup.controllers: {' '.join(sorted(have)) or 'none'}); use cgroup_mode v1 or off")
        todo = (want & have) - h.subtree_control(rel)
        if todo:
            self._record("", rel, "cgroup.subtree_control")
            h.write(rel, "cgroup.subtree_control", " ".join(f"+{c}" for c in sorted(todo)))

    def _move_pids(self, hier: str, rel: str, job: JobStats) -> int:
        """Move the job's worker pids into the group; returns how many of them are in it now.

        A zombie (exited, not yet reaped) is neither moved nor counted: v1 accepts the write and does
        nothing, and an exited task may still be listed in the group, so it would weigh in the
        subtree's shares as a live worker."""
        h = self.h[hier]
        inside = set(h.procs(rel))
        changed = False
        count = 0
        for pid in worker_pids(job):
            if _exited(pid, self.proc_root):
                if not self.originals.pids.get(str(pid), {}).get("origins"):
                    changed = self.originals.pids.pop(str(pid), None) is not None or changed
                continue
            if pid in inside:
                count += 1
                continue
            if not still_the_worker(job, pid, self.proc_root):
                self.pids_skipped += 1
                continue
            key = str(pid)
            try:
                entry = self.originals.pids.setdefault(key, {"job": job.job, "origins": {}})
                if hier not in entry["origins"]:
                    cg = cgroupfs.proc_cgroups(pid, self.proc_root)
                    entry["origins"][hier] = cg.get(hier or "", cg.get("", "/"))
                    changed = True
                    self.originals.save()
                h.move(rel, pid)
                count += 1
            except JobGone:
                if not self.originals.pids.get(key, {}).get("origins"):
                    self.originals.pids.pop(key, None)
                changed = True
        # a worker the job no longer lists and that is not in the group has nothing left to put back here:
        # its origin goes (before, every worker a job ever had stayed in cgroup-originals.json until the job
        # left, the file growing with each resize and rewritten whole at each move)
        listed = set(worker_pids(job))
        for key, entry in list(self.originals.pids.items()):
            if entry.get("job") != job.job or int(key) in listed or int(key) in inside:
                continue
            origins = entry.get("origins") or {}
            changed = origins.pop(hier, None) is not None or changed
            if not origins:
                del self.originals.pids[key]
                changed = True
        if changed:
            self.originals.save()
        return count

    # -- Actuator -----------------------------------------------------------------------------
    def apply(self, job: JobStats, desired: JobAllocation) -> ApplyResult:
        if job.cooperative:
            r = self.affinity.apply(job, desired)
            return ApplyResult(job=r.job, ok=r.ok, applied=r.applied, error=r.error,
                               not_enforced=r.not_enforced + ("cgroup: cooperative job, affinity only",))
        if not desired.enforce_cpu:
            self.release(job.job)
            return ApplyResult(job=job.job, ok=True, applied=desired)
        self._hiers[job.job] = set()
        try:
            notes = self._apply_cpu(job, desired)
            notes += self._apply_io(job, desired)
        except CgroupError as e:
            return ApplyResult(job=job.job, ok=False, applied=None,
                               error=f"{self.name} for job {job.job!r}: {type(e).__name__}: {e}")
        return ApplyResult(job=job.job, ok=True, applied=desired, not_enforced=tuple(notes))

    def _apply_cpu(self, job: JobStats, desired: JobAllocation) -> list[str]:
        notes: list[str] = []
        rel = self._group(job.job)
        knob = self.cpu_knob
        if knob == "cpuset" and not desired.cpuset:
            notes.append("cpu: cpuset knob but the plan has no cpuset (PolicyConfig.pin_cpusets); shares used")
            knob = "shares"
        if self.version == 1:
            if knob == "cpuset":
                if "cpuset" not in self.h:
                    raise NotSupported("no cgroup v1 cpuset hierarchy for cpu_knob=cpuset")
                self._ensure("cpuset", rel)
                self._hiers[job.job].add("cpuset")
                self._write("cpuset", rel, "cpuset.cpus", cgroupfs.format_cpu_list(desired.cpuset))
                self._move_pids("cpuset", rel, job)
            self._ensure("cpu", rel)
            self._hiers[job.job].add("cpu")
            if knob == "quota":
                period = int(self.h["cpu"].read(rel, "cpu.cfs_period_us") or 100000)
                quota = max(QUOTA_MIN_US, int(round(desired.cpus * period)))
                cap = self._current_subtree_cap()
                if cap is not None and quota > cap * period:
                    # v1 refuses a group's quota above its parent's (EINVAL, kernel/sched/core.c
                    # tg_cfs_schedulable_down): raise the subtree's cap (never below the planned cores) first
                    self._workers.setdefault(job.job, 0)
                    self._note_budget(job, desired)
                    self._set_subtree_weight()
                self._write("cpu", rel, "cpu.cfs_quota_us", quota)
            else:
                self._set_shares(job.job, rel, shares_for(desired.weight_cores))
            self._workers[job.job] = self._move_pids("cpu", rel, job)
            self._note_budget(job, desired)
        else:
            self._ensure("", rel)
            self._hiers[job.job].add("")
            if knob == "cpuset":
                self._write("", rel, "cpuset.cpus", cgroupfs.format_cpu_list(desired.cpuset))
            if knob == "quota":
                period = 100000
                self._write("", rel, "cpu.max", f"{max(QUOTA_MIN_US, int(round(desired.cpus * period)))} {period}")
            else:
                self._set_shares(job.job, rel, shares_for(desired.weight_cores))
            self._workers[job.job] = self._move_pids("", rel, job)
            self._note_budget(job, desired)
        notes += self._set_subtree_weight()
        return notes

    def _set_shares(self, job_id: str, rel: str, shares: int) -> None:
        self._shares[job_id] = shares
        if self.version == 1:
            self._write("cpu", rel, "cpu.shares", shares)
        else:
            self._write("", rel, "cpu.weight", weight_from_shares(shares))

    def _note_budget(self, job: JobStats, desired: JobAllocation) -> None:
        from agent.policies import trainer_cores_expected, trainer_cores_needed

        self._cores[job.job] = float(desired.cpus)
        self._trainer[job.job] = trainer_cores_needed(job)
        self._trainer_pace[job.job] = trainer_cores_expected(job)

    def apply_node(self, node: NodeAllocation) -> list[str]:
        """The plan's node allocation: whether the loaders yield, and the trainers' needs measured this
        tick (fresher than those noted at each job's last apply). Returns notes (what is not enforced)."""
        self._node = node
        return self._set_subtree_weight()

    def _trainer_figures(self) -> tuple[float, float]:
        """(cores the jobs with workers in our groups need for their training processes at full speed,
        cores those will use at the pace the data allows): from the node allocation when there is one."""
        jobs = list(self._workers)
        if self._node is not None:
            t = self._node.trainers
            return (sum(t[j][0] for j in jobs if j in t), sum(t[j][1] for j in jobs if j in t))
        return (sum(self._trainer.get(j, 0.0) for j in jobs), sum(self._trainer_pace.get(j, 0.0) for j in jobs))

    def _set_subtree_weight(self) -> list[str]:
        """The subtree's standing against the rest of the node (module docstring); written on change only.

        Yielding (``NodeAllocation.loaders_yield``, where the kernel has ``cpu.idle``): ``cpu.idle = 1``,
        no cap. Otherwise ``cpu.idle = 0`` (if we set it) and the subtree weighs what its workers would
        unmanaged; where training processes need CPU, at most one task per planned loader core (unless
        the plan says ``weigh_workers``: other processes stopped the yield), and capped at the node's
        CPUs less what the trainers use. The kernel refuses a weight for an idle
        group (EINVAL) and puts it back at the default weight when idle ends, so none is written while
        yielding and it is written again after."""
        if not self.h[self._cpu_hier].exists(self.subtree):
            return []
        self._check_subtree_identity()
        notes: list[str] = []
        need, pace = self._trainer_figures()
        want_idle = bool(self._node is not None and self._node.loaders_yield)
        has_idle = self.h[self._cpu_hier].has_file(self.subtree, "cpu.idle")
        if self._subtree_idle is None and has_idle:
            try:    # a restarted agent: the subtree may still yield as the dead one left it
                self._subtree_idle = self.h[self._cpu_hier].read(self.subtree, "cpu.idle").strip() == "1" or None
            except CgroupError:
                pass
        self._current_subtree_cap()
        if want_idle and not has_idle:
            want_idle = False
            notes.append("cpu: loaders cannot yield to the training processes: no cpu.idle in this kernel "
                         "(5.15+); the subtree weighs its planned cores instead")
        if want_idle != bool(self._subtree_idle):
            if want_idle or self._subtree_idle is not None:
                self._write(self._cpu_hier, self.subtree, "cpu.idle", 1 if want_idle else 0)
                self._subtree_shares = None     # the kernel resets the weight on either edge
            self._subtree_idle = want_idle
        shares = subtree_shares_for(sum(self._workers.values()))
        cap = None
        if need >= TRAINER_CPU_MIN and not (self._node is not None and self._node.weigh_workers):
            shares = min(shares, subtree_shares_for_cores(sum(self._cores.get(j, 0.0) for j in self._workers)))
        if need >= TRAINER_CPU_MIN and self.node_cpus and not want_idle:
            # the node less the pace in 0.05-core steps (the pace moves a little every tick), but never
            # below the planned cores, not even by a step: on v1 a job group's quota above its parent's
            # is refused (EINVAL, kernel/sched/core.c tg_cfs_schedulable_down), and on v2 it is cut
            loaders = sum(self._cores.get(j, 0.0) for j in self._workers)
            cap = max(loaders, round(math.floor((self.node_cpus - pace) * 20) / 20, 2))
            cap = cap if cap < self.node_cpus - 1e-9 else None
        if shares != self._subtree_shares and not want_idle:    # an idle group refuses a weight (EINVAL)
            if self.version == 1:
                self._write("cpu", self.subtree, "cpu.shares", shares)
            else:
                self._write("", self.subtree, "cpu.weight", weight_from_shares(shares))
            self._subtree_shares = shares
        if cap != self._subtree_cap:
            period = 100000
            quota = -1 if cap is None else max(QUOTA_MIN_US, int(round(cap * period)))
            if self.version == 1:
                if cap is not None:
                    self._write("cpu", self.subtree, "cpu.cfs_period_us", period)
                self._write("cpu", self.subtree, "cpu.cfs_quota_us", quota)
            else:
                self._write("", self.subtree, "cpu.max", f"{'max' if cap is None else quota} {period}")
            self._subtree_cap = cap
        return notes

    def _check_subtree_identity(self) -> None:
        """The subtree's weight, cap and idle flag are written on change only, against what was last
        written (``_subtree_shares``, ``_subtree_cap``, ``_subtree_idle``). A subtree removed and made
        again since (an admin's rmdir, a systemd reset; made again by our next apply, or by someone
        else) has the kernel's defaults instead: before, the agent compared against its cache, wrote
        nothing, and the loaders ran at 1024 shares (or another's cap) for good. A new inode forgets
        what was written, as a restarted agent starts (read back where it can)."""
        ident = self.h[self._cpu_hier].identity(self.subtree)
        if ident == self._subtree_ident:
            return
        if self._subtree_ident is not None:
            logs.event(log, "cgroup_subtree_recreated", logging.WARNING,
                       group=self.h[self._cpu_hier].path(self.subtree),
                       detail="removed and made again since the agent last wrote it: its weight, cap and "
                              "idle flag are written again")
            self._subtree_shares = None
            self._subtree_cap = None
            self._subtree_cap_read = False
            self._subtree_idle = None
        self._subtree_ident = ident

    def lost_group(self, job_id: str) -> bool:
        """Whether a group an apply made for the job is gone (an admin's rmdir, a systemd reset of the
        subtree) while the job still holds an allocation here: in any hierarchy its last apply put it
        in (v1: cpu, and cpuset and blkio where that apply used them; a job adopted from the journal and
        not applied since: cpu). The controller then applies the job again with its allocation
        unchanged (``Controller._prepare_job``), which makes the group again (the subtree too, if it
        went), writes its values and moves the job's workers back in; before, nothing changed for the
        controller, so the group stayed gone until the job's allocation or workers did (and a group
        gone from cpuset or blkio only was not noticed: the workers ran on every CPU, or at the default
        IO weight). A stat per hierarchy, job and tick (about 3 us each on the 2-core VM); read on the
        tick's thread (``_workers`` and ``_hiers`` only by key)."""
        if job_id not in self._workers:
            return False
        rel = self._group(job_id)
        return any(not self.h[hier].exists(rel) for hier in self._hiers.get(job_id) or (self._cpu_hier,))

    def _current_subtree_cap(self) -> Optional[float]:
        if not self._subtree_cap_read:
            self._subtree_cap = self._read_subtree_cap()
            self._subtree_cap_read = True
        return self._subtree_cap

    def _read_subtree_cap(self) -> Optional[float]:
        """The cap the subtree has now, in cores (None: none): a restarted agent finds the one a dead
        agent wrote, which it must lift when its own plan has none (it compared against None, wrote
        nothing, and the loaders stayed capped)."""
        return self._read_quota_cores(self.subtree)

    def _read_quota_cores(self, rel: str) -> Optional[float]:
        """A group's CPU quota now, in cores (None: none, or unreadable)."""
        h = self.h[self._cpu_hier]
        try:
            if self.version == 1:
                quota = int(h.read(rel, "cpu.cfs_quota_us"))
                return None if quota < 0 else quota / int(h.read(rel, "cpu.cfs_period_us"))
            quota, _, period = h.read(rel, "cpu.max").partition(" ")
            return None if quota == "max" else int(quota) / int(period or 100000)
        except (CgroupError, ValueError, ZeroDivisionError):
            return None

    def _apply_io(self, job: JobStats, desired: JobAllocation) -> list[str]:
        if desired.io_weight is None:
            return []
        if self.io_mode is None:
            return list(self.io_notes)
        w = max(1, min(1000, int(desired.io_weight)))
        rel = self._group(job.job)
        if self.version == 1:
            self._ensure("blkio", rel)
            self._hiers[job.job].add("blkio")
            self._write("blkio", rel, "blkio.bfq.weight", w)
            self._move_pids("blkio", rel, job)
        else:
            self._write("", rel, self.io_mode, f"default {w}" if self.io_mode == "io.weight" else w)
        return list(self.io_notes)

    def _drop_group(self, hier: str, rel: str) -> None:
        """Move every process in the group (and its children) back where it came from, then rmdir.

        A process that is gone (JobGone, no ``<proc_root>/<pid>``, or a zombie) needs no move: it
        exited while we moved it (the origin refused it, then so did the root), which is not a failure."""
        h = self.h[hier]
        key = Originals.key(hier, rel)
        if not h.exists(rel):     # removed by someone else, or listed by a mkdir that a SIGKILL cut short
            if key in self.originals.created:
                self.originals.created.remove(key)
            for k in [k for k in self.originals.files if k.startswith(key + "|")]:
                del self.originals.files[k]
            return
        for pid in h.procs(rel):
            entry = self.originals.pids.get(str(pid), {})
            origin = entry.get("origins", {}).get(hier, "/")
            try:
                h.move(origin if h.exists(origin) else "", pid)
            except JobGone:
                pass
            except CgroupError:
                if self._gone(pid):
                    continue
                try:
                    h.move("", pid)       # the origin refuses it (e.g. a Slurm step): the hierarchy root
                except JobGone:
                    pass
                except CgroupError:
                    if not self._gone(pid):
                        raise
        h.rmdir(rel)
        if key in self.originals.created:
            self.originals.created.remove(key)
        for k in [k for k in self.originals.files if k.startswith(key + "|")]:
            del self.originals.files[k]

    def _gone(self, pid: int) -> bool:
        """The process has exited: no /proc entry, or a zombie."""
        return not os.path.exists(os.path.join(self.proc_root, str(int(pid)))) or _exited(pid, self.proc_root)

    def release(self, job_id: str) -> None:
        rel = self._group(job_id)
        errors = []
        for hier in self.h:
            try:
                self._drop_group(hier, rel)
            except CgroupError as e:
                errors.append(str(e))
        self._shares.pop(job_id, None)
        self._workers.pop(job_id, None)
        self._hiers.pop(job_id, None)
        self._cores.pop(job_id, None)
        self._trainer.pop(job_id, None)
        self._trainer_pace.pop(job_id, None)
        for key in [k for k, v in self.originals.pids.items() if v.get("job") == job_id]:
            del self.originals.pids[key]
        try:
            self._set_subtree_weight()
        except CgroupError as e:
            errors.append(str(e))
        self.affinity.release(job_id)
        self.originals.save()
        if errors:
            raise CgroupError(f"release of job {job_id!r}: " + "; ".join(errors))

    def held_jobs(self) -> set[str]:
        """The jobs this actuator (or the dead agent whose journal of originals it read) holds something
        for: a group it created, a moved process's origin, an affinity. A restarted agent releases those
        its journal does not adopt (``Agent._adopt_journal``)."""
        jobs = {v["job"] for v in self.originals.pids.values()} | self.affinity.held_jobs()
        prefix = self.subtree + "/"
        for key in self.originals.created:
            rel = key.split("|", 1)[1]
            if rel.startswith(prefix) and "/" not in rel[len(prefix):]:
                jobs.add(job_of_group(rel[len(prefix):]))
        return jobs

    def restore(self) -> None:
        """Put back everything: processes to their origins, the groups we created removed (children
        first), original values written. Groups in the subtree that we did not create are left alone;
        our subtree, if one of them keeps it from being removed, gets a new group's CPU values."""
        errors = []
        # Only the groups this agent (or the dead one whose journal it read) created: another agent
        # on the machine (tests, benchmarks) may share the subtree name and own the other children.
        leaf = Originals.key("", self._leaf) if self._leaf else None
        for key in reversed(list(self.originals.created)):
            hier, rel = key.split("|", 1)
            if key == leaf:
                continue        # after <own>'s controllers are put back (_undo_v2_leaf, below)
            if hier in self.h:
                try:
                    self._drop_group(hier, rel)
                except CgroupError as e:
                    errors.append(str(e))
        # our subtree, still there: a group that is not ours is in it (rmdir EBUSY). It gets a new group's
        # CPU values back, so no weight, cap or idle flag of ours outlives us (adopt_orphans does the same
        # for a subtree it takes over; here for one this agent, or the journal it read, made itself)
        h = self.h[self._cpu_hier]
        if Originals.key(self._cpu_hier, self.subtree) in self.originals.created and h.exists(self.subtree):
            for file, value in NEW_GROUP_CPU[self.version].items():
                if h.has_file(self.subtree, file):
                    self.originals.files.setdefault(Originals.key(self._cpu_hier, self.subtree, file), value)
        # deepest group first: a parent's subtree_control is put back after its children's (older kernels
        # refuse to disable a controller that a child still enables: EBUSY). Within a group cpu.idle goes
        # first: an idle group refuses a weight (EINVAL) and leaving idle resets it to the default
        # (kernel/sched/fair.c sched_group_set_shares / sched_group_set_idle), so a weight put back
        # before the idle flag would be refused, and lost again when the flag is.
        def order(key: str) -> tuple[int, bool]:
            _, rel, file = key.split("|", 2)
            return -(rel.count("/") + 1 if rel else 0), file != "cpu.idle"

        for key, value in sorted(self.originals.files.items(), key=lambda kv: order(kv[0])):
            hier, rel, file = key.split("|", 2)
            try:
                if hier in self.h and self.h[hier].exists(rel):
                    if file == "cgroup.subtree_control":
                        self._restore_subtree_control(rel, value)
                    else:
                        self.h[hier].write(rel, file, value)
                del self.originals.files[key]
            except CgroupError as e:
                errors.append(str(e))
        try:
            self._undo_v2_leaf()
        except CgroupError as e:
            errors.append(str(e))
        self._base_ready = not self.base
        self.originals.pids.clear()
        self._shares.clear()
        self._workers.clear()
        self._subtree_shares = None
        self._subtree_cap = None
        self._subtree_cap_read = False
        self._subtree_idle = None
        self._subtree_ident = None
        self._node = None
        self.affinity.restore()
        self.originals.save()
        self.release_subtree()       # (an incomplete restore too: the agent stops, its journal says what is left)
        if errors:
            raise CgroupError("restore incomplete: " + "; ".join(errors))

    def _restore_subtree_control(self, rel: str, original: str) -> None:
        h = self.h[""]
        added = h.subtree_control(rel) - set(original.split())
        if added:
            h.write(rel, "cgroup.subtree_control", " ".join(f"-{c}" for c in sorted(added)))


def _children(h: Hierarchy, rel: str) -> list[str]:
    """Every group below ``rel`` (not ``rel`` itself) whose name is text. A group named with bytes that
    are not UTF-8 is none of ours (job ids are text, ``protocol.check_job_id``): someone else made it.
    It is left out, with everything below it, and logged once, by its path's bytes (os.walk hands the
    name back with surrogates, which cgroupspy, encoding names strictly, refused with UnicodeEncodeError)."""
    out: list[str] = []
    skipped: list[str] = []
    for child in h.children(rel):
        if any(child.startswith(s + "/") for s in skipped):
            continue
        try:
            child.encode()
        except UnicodeEncodeError:
            skipped.append(child)
            path = repr(os.fsencode(h.path(child)))
            logs.once(f"cgroup_name_undecodable|{path}", log, "cgroup_name_undecodable", logging.WARNING,
                      group=path, detail="not a group the agent made: left alone")
            continue
        out.append(child)
    return out
