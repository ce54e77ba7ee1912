"""Small, faithful fakes of what this machine cannot have, and the ``job_stats`` factory.

One place for them (tests import from here, never from another test module):
    job_stats(job, **overrides)   a ``JobStats`` with plausible figures of a job that has been observed
    FakeSource, FakeBank, FakeSink, RecordingActuator   the controller's collaborators
    FakeNvml                      the pynvml functions the GPU sampler calls
    FakeV2Kernel, fake_proc, fake_sys   a cgroup v2 hierarchy, /proc and /sys trees in tmp_path
    status_doc()                  a status document of one job, as the agent serves it
"""
from __future__ import annotations

import errno
import math
import os
from types import SimpleNamespace

from agent.cgroupfs import V2Hierarchy, domain_error
from agent.config import LOADER_CPU_RESERVE
from agent.model import ApplyResult, JobStats, NodeSnapshot
from predictor.bank import configuration, curve_confidence
from predictor.curve import ThroughputCurve

JOB_STATS_DEFAULTS = dict(
    uid=1000, ranks=1, gpus=1, batch_size=32, workers=2, requested_workers=2, max_workers=None,
    samples_per_s=320.0, compute_s_per_step=0.1, data_wait_s_per_step=0.05, data_wait_frac=0.33,
    cpu_s_per_batch=0.2, wall_s_per_batch=0.25, runq_s_per_batch=0.03, blocked_s_per_batch=0.02,
    worker_cpu_cores=1.5, window_s=2.0, worker_pids=(101, 102))

# a job known to the agent but with no measured figures (zero rates, no window): what the simulator
# and the oracle's tests hand a policy that decides from curves alone
UNMEASURED = dict(uid=0, samples_per_s=0.0, data_wait_s_per_step=0.0, data_wait_frac=0.0, cpu_s_per_batch=0.1,
                  wall_s_per_batch=0.1, runq_s_per_batch=0.0, blocked_s_per_batch=0.0, worker_cpu_cores=0.0,
                  window_s=0.0, worker_pids=())


def job_stats(job: str = "a", **overrides) -> JobStats:
    """A ``JobStats`` for ``job``: ``JOB_STATS_DEFAULTS`` with ``overrides`` (any field)."""
    return JobStats(job=job, **{**JOB_STATS_DEFAULTS, **overrides})


def cgroup_job(job: str, worker_pids, **overrides) -> JobStats:
    """A job as the cgroup actuators see it: root's, its loader workers ``worker_pids``."""
    return job_stats(job, **{**UNMEASURED, "batch_size": 1, "requested_workers": 1, "worker_cpu_cores": 1.0,
                             "workers": len(worker_pids), "pids": (1,), "worker_pids": tuple(worker_pids),
                             **overrides})


# -- the controller's collaborators ----------------------------------------------------------------

class FakeSource:
    def __init__(self, loader_cpus=4.0, jobs=()):
        self.loader_cpus = loader_cpus
        self.jobs = {j.job: j for j in jobs}

    def __call__(self, now):
        # a node as the agent sees it: loader_cpus is 90% of its CPUs (``config.auto_loader_cpus``), so
        # 1.8 loader cores sit on a 2-CPU node, not on one CPU (a 1-CPU node cannot hold 1.8 loader cores)
        n = max(1, math.ceil(self.loader_cpus / (1.0 - LOADER_CPU_RESERVE) - 1e-9))
        return NodeSnapshot(now=now, loader_cpus=self.loader_cpus, cpu_ids=tuple(range(n)),
                            jobs=dict(self.jobs))


class FakeBank:
    def __init__(self):
        self.seen, self.forgotten = [], []

    def observe(self, job_id, obs):
        self.seen.append((job_id, obs))

    def curve(self, job_id):
        obs = [o for j, o in self.seen if j == job_id]
        if not obs:
            return None
        o = obs[-1]
        sure = curve_confidence(len(obs), len({configuration(x) for x in obs}))   # as the bank's
        return ThroughputCurve(job=job_id, batch_size=o.batch_size, compute_s_per_step=o.compute_s_per_step,
                               cpu_s_per_batch=o.cpu_s_per_batch, blocked_s_per_batch=o.blocked_s_per_batch,
                               confidence=sure)

    def forget(self, job_id):
        self.forgotten.append(job_id)


class FakeSink:
    def __init__(self, ok=True):
        self.sent, self.ok = [], ok

    def send_directive(self, job_id, workers, cpus, cpuset, reason):
        self.sent.append((job_id, workers, cpus, cpuset, reason))
        return self.ok


class RecordingActuator:
    name = "rec"
    tracks_pids = True

    def __init__(self, fail_jobs=()):
        self.applied, self.released, self.restored, self.fail_jobs = [], [], 0, set(fail_jobs)

    def apply(self, job, desired):
        self.applied.append((job.job, desired, job.worker_pids))
        if job.job in self.fail_jobs:
            return ApplyResult(job=job.job, ok=False, applied=None, error="boom")
        return ApplyResult(job=job.job, ok=True, applied=desired)

    def release(self, job_id):
        self.released.append(job_id)

    def restore(self):
        self.restored += 1


# -- NVML -------------------------------------------------------------------------------------------

class FakeNvml:
    """The pynvml functions the sampler uses, with NotFound when no new process sample exists."""

    class NVMLError(Exception):
        pass

    class NVMLError_NotFound(NVMLError):
        pass

    class NVMLError_GpuIsLost(NVMLError):
        pass

    class NVMLError_NoPermission(NVMLError):
        pass

    def __init__(self, fail_init=False):
        self.fail_init = fail_init
        self.util = {0: 30, 1: 90}
        self.samples = {0: [SimpleNamespace(pid=111, smUtil=25, timeStamp=5)], 1: []}
        self.inits = 0
        self.fail_handle = {}     # index -> the NVMLError nvmlDeviceGetHandleByIndex raises for it
        self.fail_util = {}       # handle -> the NVMLError nvmlDeviceGetUtilizationRates raises for it

    def nvmlInit(self):
        self.inits += 1
        if self.fail_init:
            raise self.NVMLError("Driver Not Loaded")

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        if i in self.fail_handle:
            raise self.fail_handle[i]
        return i

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-{h}"

    def nvmlDeviceGetUtilizationRates(self, h):
        if h in self.fail_util:
            raise self.fail_util[h]
        return SimpleNamespace(gpu=self.util[h], memory=0)

    def nvmlDeviceGetProcessUtilization(self, h, last_ts):
        new = [s for s in self.samples[h] if s.timeStamp > last_ts]
        if not new:
            raise self.NVMLError_NotFound()
        return new


# -- cgroup v2, /proc and /sys in tmp_path ------------------------------------------------------------

class FakeV2Kernel(V2Hierarchy):
    """What the kernel does on the unified hierarchy for the calls the actuator makes: mkdir populates
    the interface files (a child's ``cgroup.controllers`` is, at any time, its parent's
    ``cgroup.subtree_control``), ``+ctrl`` in subtree_control is refused (ENOENT) unless the group has
    that controller, a process lives in exactly one group and ``/proc/<pid>/cgroup`` follows it, the
    "no internal processes" rule refuses a process in a group that delegates controllers (EBUSY), rmdir
    refuses a group with processes or children (EBUSY), and cpu.weight / cpu.max / io.weight values are
    range-checked (EINVAL), as is cpu.idle (0 or 1; a kernel before 5.15 has no such file:
    ``FakeV2Kernel.FILES`` without it). A group with cpu.idle = 1 refuses a cpu.weight (EINVAL), and
    leaving idle puts its weight back at the default 100 (sched_group_set_shares / sched_group_set_idle)."""
    FILES = {"cpu.weight": "100", "cpu.max": "max 100000", "cpu.idle": "0", "cpuset.cpus": "", "io.weight": "default 100",
             "io.bfq.weight": "default 100", "cgroup.procs": "", "cgroup.subtree_control": ""}

    def __init__(self, root: str, proc_root: str, controllers=("cpuset", "cpu", "io", "memory", "pids")):
        super().__init__(root)
        self.proc_root = proc_root
        os.makedirs(root, exist_ok=True)
        for name, value in {"cgroup.controllers": " ".join(controllers), "cgroup.procs": "",
                            "cgroup.subtree_control": "", "io.cost.qos": ""}.items():
            with open(os.path.join(root, name), "w") as f:
                f.write(value)
        self.writes: list[tuple[str, str, str]] = []
        self._ids: dict[str, int] = {}       # group -> the id its last mkdir gave it (``identity``)
        self._next_id = 0

    @staticmethod
    def _err(code, what):
        return domain_error(OSError(code, os.strerror(code)), what)

    def mkdir(self, rel):
        created = super().mkdir(rel)
        if created:
            self._next_id += 1
            self._ids[rel.strip("/")] = self._next_id
            parent = os.path.dirname(rel.strip("/"))
            for name, value in self.FILES.items():
                with open(self.path(rel, name), "w") as f:
                    f.write(value)
            with open(self.path(rel, "cgroup.controllers"), "w") as f:
                f.write(" ".join(sorted(self.subtree_control(parent))))
        return created

    def identity(self, rel):
        """A group made again gets a new id, as kernfs gives it a new inode number (ids from
        idr_alloc_cyclic, fs/kernfs/dir.c); the files under tmp_path may reuse a freed inode."""
        if not self.exists(rel):
            return None
        return self._ids.get(rel.strip("/")) or -super().identity(rel)

    def read(self, rel, file):
        parent = os.path.dirname(rel.strip("/"))
        if file == "cgroup.controllers" and rel.strip("/") and self.exists(rel):
            return " ".join(sorted(self.subtree_control(parent)))
        return super().read(rel, file)

    def rmdir(self, rel):
        if not self.exists(rel):
            return
        if self.procs(rel) or any(os.path.isdir(os.path.join(self.path(rel), d)) for d in os.listdir(self.path(rel))):
            raise self._err(errno.EBUSY, f"rmdir {self.path(rel)}")
        for name in os.listdir(self.path(rel)):
            os.unlink(os.path.join(self.path(rel), name))
        super().rmdir(rel)

    def write(self, rel, file, value):
        value = str(value)
        self.writes.append((rel, file, value))
        if file == "cgroup.subtree_control":
            have, cur = self.controllers(rel), self.subtree_control(rel)
            for tok in value.split():
                if tok[1:] not in have:
                    raise self._err(errno.ENOENT, f"write {value} to {self.path(rel, file)}")
                if rel.strip("/") and self.procs(rel):
                    raise self._err(errno.EBUSY, f"write {value} to {self.path(rel, file)}")
                cur = cur | {tok[1:]} if tok[0] == "+" else cur - {tok[1:]}
            value = " ".join(sorted(cur))
        elif file == "cpu.weight" and (not 1 <= int(value) <= 10000
                                       or self.has_file(rel, "cpu.idle") and self.read(rel, "cpu.idle").strip() == "1"):
            raise self._err(errno.EINVAL, f"write {value} to {self.path(rel, file)}")
        elif file == "cpu.max":
            q, p = value.split()
            if q != "max" and int(q) < 1000:
                raise self._err(errno.EINVAL, f"write {value} to {self.path(rel, file)}")
        elif file == "cpu.idle" and value not in ("0", "1"):
            raise self._err(errno.EINVAL, f"write {value} to {self.path(rel, file)}")
        elif file == "cpu.idle" and value == "0" and self.has_file(rel, file) and self.read(rel, file).strip() == "1":
            super().write(rel, "cpu.weight", "100")
        elif file == "io.weight" and not 1 <= int(value.split()[-1]) <= 10000:
            raise self._err(errno.EINVAL, f"write {value} to {self.path(rel, file)}")
        if not self.has_file(rel, file):
            raise self._err(errno.ENOENT, f"write {value} to {self.path(rel, file)}")
        super().write(rel, file, value)

    def move(self, rel, pid):
        if not os.path.exists(os.path.join(self.proc_root, str(pid))):
            raise self._err(errno.ESRCH, f"move {pid}")
        if rel.strip("/") and self.subtree_control(rel):
            raise self._err(errno.EBUSY, f"move {pid} into {self.path(rel)} (no internal processes)")
        for d, _, files in os.walk(self.root):
            if "cgroup.procs" in files:
                p = os.path.join(d, "cgroup.procs")
                with open(p) as f:
                    pids = [x for x in f.read().split() if x != str(pid)]
                with open(p, "w") as f:
                    f.write("\n".join(pids))
        with open(self.path(rel, "cgroup.procs"), "a") as f:
            f.write(f"\n{pid}")
        with open(os.path.join(self.proc_root, str(pid), "cgroup"), "w") as f:
            f.write(f"0::/{rel.strip('/')}\n")


OWN = "system.slice/adloader-agent.service"   # the agent's own unit cgroup under systemd (``delegated``)


def fake_proc(tmp_path, pids, origin="/user.slice/job.scope"):
    proc = tmp_path / "proc"
    for pid in pids:
        (proc / str(pid)).mkdir(parents=True, exist_ok=True)
        (proc / str(pid) / "cgroup").write_text(f"0::{origin}\n")
    (proc / "self").mkdir(parents=True, exist_ok=True)
    (proc / "self" / "mounts").write_text("/dev/vda1 / ext4 rw 0 0\nsrv:/data /data nfs4 rw 0 0\n")
    return str(proc)


def fake_sys(tmp_path, schedulers):
    for dev, text in schedulers.items():
        q = tmp_path / "sys" / "block" / dev / "queue"
        q.mkdir(parents=True)
        (q / "scheduler").write_text(text + "\n")
    return str(tmp_path / "sys")


# -- a status document ------------------------------------------------------------------------------

def status_doc() -> dict:
    """One job's status document, as ``adloader status`` and the metrics exporter read it."""
    return {"version": 1, "agent": {"pid": 1, "policy": "adaptive", "tick_s": 1.0, "last_tick_ms": 0.4,
                                    "loader_cpus": 1.8, "cgroup_mode": "v1", "gpu_source": "client",
                                    "uptime_s": 5, "ticks": 5},
            "jobs": [{"job": "j1", "uid": 0, "ranks": 2, "workers": 2, "desired_workers": 3, "cpus": 1.2,
                      "data_wait_frac": 0.31, "gpu_idle_frac": 0.31, "gpu_idle_source": "client",
                      "samples_per_s": 250.0, "max_useful_workers": 4, "reason": "marginal gain 0.2/core",
                      "unsatisfied": None, "breaker": None}]}
