"""Component tier: cgroupfs and the cgroup actuators against faithful fake trees in tmp_path.

``FakeV2Kernel`` does what the kernel does on the unified hierarchy for the calls the actuator makes:
mkdir populates the interface files (a child's ``cgroup.controllers`` is, at any time, its parent's
``cgroup.subtree_control``), ``+ctrl`` in subtree_control is refused (ENOENT) unless the group has
that controller, a process lives in exactly one group and ``/proc/<pid>/cgroup`` follows it, the
"no internal processes" rule refuses a process in a group that delegates controllers (EBUSY), rmdir
refuses a group with processes or children (EBUSY), and cpu.weight / cpu.max / io.weight values are
range-checked (EINVAL). The affinity tests use real child processes (no root needed).
"""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import pytest

from agent import cgroupfs
from agent.actuators import DirectiveActuator, build
from agent.actuators.cgroup import AffinityActuator, CgroupActuator, shares_for, weight_from_shares
from agent.actuators.originals import Originals
from agent.cgroupfs import (Busy, InvalidValue, JobGone, NotPermitted, NotSupported, V2Hierarchy, detect_layout,
                            domain_error)
from agent.model import JobAllocation, JobStats


class FakeV2Kernel(V2Hierarchy):
    FILES = {"cpu.weight": "100", "cpu.max": "max 100000", "cpuset.cpus": "", "io.weight": "default 100",
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

    @staticmethod
    def _err(code, what):
        return domain_error(OSError(code, os.strerror(code)), what)

    def mkdir(self, rel):
        created = super().mkdir(rel)
        if created:
            parent = os.path.dirname(rel.strip("/"))
            for name, value in self.FILES.items():
                with open(self.path(rel, name), "w") as f:
                    f.write(value)
            with open(self.path(rel, "cgroup.controllers"), "w") as f:
                f.write(" ".join(sorted(self.subtree_control(parent))))
        return created

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
        elif file == "cpu.weight" and not 1 <= int(value) <= 10000:
            raise self._err(errno.EINVAL, f"write {value} to {self.path(rel, file)}")
        elif file == "cpu.max":
            q, p = value.split()
            if q != "max" and int(q) < 1000:
                raise self._err(errno.EINVAL, f"write {value} to {self.path(rel, file)}")
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


def stats(job, worker_pids, **kw):
    return JobStats(job=job, uid=0, ranks=1, gpus=1, batch_size=1, workers=len(worker_pids), requested_workers=1,
                    max_workers=None, samples_per_s=0.0, compute_s_per_step=0.1, data_wait_s_per_step=0.0,
                    data_wait_frac=0.0, cpu_s_per_batch=0.1, wall_s_per_batch=0.1, runq_s_per_batch=0.0,
                    blocked_s_per_batch=0.0, worker_cpu_cores=1.0, pids=(1,), worker_pids=tuple(worker_pids), **kw)


@pytest.fixture
def v2(tmp_path):
    proc = fake_proc(tmp_path, [101, 102, 103])
    sys_root = fake_sys(tmp_path, {"nvme0n1": "[none] mq-deadline kyber bfq", "sda": "mq-deadline kyber [bfq] none"})
    # the root group holds the processes to begin with (their /proc says /user.slice/job.scope; we
    # create that group too, so moving back has somewhere to go)
    kernel = FakeV2Kernel(str(tmp_path / "cg"), proc)
    kernel.write("", "cgroup.subtree_control", "+memory")
    kernel.mkdir("user.slice")
    kernel.write("user.slice", "cgroup.subtree_control", "+memory")
    kernel.mkdir("user.slice/job.scope")
    for pid in (101, 102, 103):
        kernel.move("user.slice/job.scope", pid)

    def make(knob="shares", io=True, journal=None, **kw):
        return CgroupActuator({"": kernel}, version=2, cpu_knob=knob, io=io, subtree="adloader",
                              originals=Originals(journal), sys_root=sys_root, proc_root=proc, **kw)

    return kernel, make


def read(kernel, rel, file):
    return kernel.read(rel, file)


def test_v2_shares_group_controllers_and_pids(v2):
    kernel, make = v2
    act = make()
    r = act.apply(stats("job-1", [101, 102]), JobAllocation(job="job-1", workers=2, cpus=1.0, io_weight=150))
    assert r.ok, r.error
    assert "cpu" in kernel.subtree_control("") and "memory" in kernel.subtree_control("")
    assert "cpu" in kernel.subtree_control("adloader")
    assert read(kernel, "adloader/job-1", "cpu.weight") == "100"           # 1024 shares -> weight 100
    assert read(kernel, "adloader", "cpu.weight") == "200"                # 2 workers weigh 2 tasks
    assert set(kernel.procs("adloader/job-1")) == {101, 102}
    assert cgroupfs.proc_cgroups(101, kernel.proc_root)[""] == "/adloader/job-1"
    # BFQ on sda but no iocost: io.bfq.weight is the file that does something
    assert act.io_mode == "io.bfq.weight" and read(kernel, "adloader/job-1", "io.bfq.weight") == "150"
    assert any("nvme0n1" in n for n in r.not_enforced)                    # not on the 'none' device
    assert any("nfs4 at /data" in n for n in r.not_enforced)              # network fs: never reached


def test_v2_jobs_split_by_cores_subtree_weighs_its_workers(v2):
    """Job groups: proportional to cores (the policy's split). The subtree: 100 per worker, whatever the
    cores, written again only when the worker total changes, restored (removed: we made it) on stop."""
    kernel, make = v2
    act = make(io=False)
    act.apply(stats("a", [101, 102]), JobAllocation(job="a", workers=2, cpus=0.3))
    act.apply(stats("b", [103]), JobAllocation(job="b", workers=1, cpus=0.9))
    assert read(kernel, "adloader/a", "cpu.weight") == "30" and read(kernel, "adloader/b", "cpu.weight") == "90"
    assert read(kernel, "adloader", "cpu.weight") == "300"                # 3 workers, not 1.2 cores' 120
    subtree_writes = lambda: [w for w in kernel.writes if w[:2] == ("adloader", "cpu.weight")]
    n = len(subtree_writes())
    act.apply(stats("b", [103]), JobAllocation(job="b", workers=1, cpus=1.2))     # cores change only
    assert read(kernel, "adloader/b", "cpu.weight") == "120" and len(subtree_writes()) == n
    act.apply(stats("a", [101]), JobAllocation(job="a", workers=1, cpus=0.3))     # a resized to 1 worker
    assert read(kernel, "adloader", "cpu.weight") == "200" and len(subtree_writes()) == n + 1
    act.release("a")
    assert read(kernel, "adloader", "cpu.weight") == "100"
    act.restore()
    assert not kernel.exists("adloader")


def test_v2_existing_subtree_weight_recorded_and_restored_and_quota_knob(v2, tmp_path):
    kernel, make = v2
    kernel.write("", "cgroup.subtree_control", "+cpu")
    kernel.mkdir("adloader")                     # there before the agent, with a weight of its own
    kernel.write("adloader", "cpu.weight", "77")
    journal = str(tmp_path / "state" / "orig.json")
    q = make(knob="quota", io=False, journal=journal)
    assert q.apply(stats("c", [103, 102]), JobAllocation(job="c", workers=2, cpus=0.5)).ok
    assert read(kernel, "adloader/c", "cpu.max") == "50000 100000"
    assert read(kernel, "adloader", "cpu.weight") == "200"                # quota too: 2 workers' weight
    assert json.loads(open(journal).read())["files"]["|adloader|cpu.weight"] == "77"
    second = make(knob="quota", io=False, journal=journal)                # restarted: counts c's workers
    assert second._workers == {"c": 2}
    second.restore()
    assert read(kernel, "adloader", "cpu.weight") == "77" and not kernel.exists("adloader/c")


def test_v2_cpuset_knob(v2):
    kernel, make = v2
    act = make(knob="cpuset", io=False)
    r = act.apply(stats("a", [101]), JobAllocation(job="a", workers=1, cpus=2.0, cpuset=(2, 3)))
    assert r.ok, r.error
    assert read(kernel, "adloader/a", "cpuset.cpus") == "2-3"
    assert "cpuset" in kernel.subtree_control("adloader")
    r = act.apply(stats("b", [102]), JobAllocation(job="b", workers=1, cpus=1.0))
    assert r.ok and any("pin_cpusets" in n for n in r.not_enforced)


def test_v2_iocost_uses_io_weight(v2):
    kernel, make = v2
    with open(kernel.path("", "io.cost.qos"), "w") as f:
        f.write("8:0 enable=1 ctrl=auto")
    act = make()
    assert act.io_mode == "io.weight"
    r = act.apply(stats("a", [101]), JobAllocation(job="a", workers=1, cpus=1.0, io_weight=250))
    assert r.ok, r.error
    assert read(kernel, "adloader/a", "io.weight") == "default 250"


def test_v2_release_moves_back_and_removes(v2):
    kernel, make = v2
    act = make(io=False)
    act.apply(stats("a", [101, 102]), JobAllocation(job="a", workers=2, cpus=1.0))
    act.apply(stats("b", [103]), JobAllocation(job="b", workers=1, cpus=1.0))
    act.release("a")
    assert not kernel.exists("adloader/a")
    assert set(kernel.procs("user.slice/job.scope")) == {101, 102}
    assert read(kernel, "adloader", "cpu.weight") == "100"                 # only b's 1024 shares left
    act.restore()
    assert not kernel.exists("adloader")
    assert set(kernel.procs("user.slice/job.scope")) == {101, 102, 103}
    assert kernel.subtree_control("") == {"memory"}                       # our +cpu taken back


def test_v2_restart_from_journal(v2, tmp_path):
    kernel, make = v2
    journal = str(tmp_path / "state" / "cgroup-originals.json")
    first = make(io=False, journal=journal)
    first.apply(stats("a", [101]), JobAllocation(job="a", workers=1, cpus=2.0))
    data = json.loads(open(journal).read())
    assert data["pids"]["101"]["origins"][""] == "/user.slice/job.scope"
    assert "|adloader" in data["created"]
    second = make(io=False, journal=journal)
    # the adopted group still counts in the subtree's weight (v2 weights are lossy: compare as weights)
    assert weight_from_shares(second._shares["a"]) == weight_from_shares(2048)
    second.restore()
    assert not kernel.exists("adloader") and set(kernel.procs("user.slice/job.scope")) == {101, 102, 103}
    assert kernel.subtree_control("") == {"memory"}
    assert not os.path.exists(journal)


def test_v2_without_cpu_controller_fails_clearly(tmp_path):
    proc = fake_proc(tmp_path, [101])
    kernel = FakeV2Kernel(str(tmp_path / "cg"), proc, controllers=())     # like this machine's v2 mount
    act = CgroupActuator({"": kernel}, version=2, io=True, subtree="adloader", sys_root=str(tmp_path),
                         proc_root=proc)
    r = act.apply(stats("a", [101]), JobAllocation(job="a", workers=1, cpus=1.0))
    assert not r.ok and "no cpu controller" in r.error and "NotSupported" in r.error
    assert not kernel.exists("adloader")


def test_gone_worker_is_skipped_and_training_pid_never_moved(v2):
    kernel, make = v2
    act = make(io=False)
    r = act.apply(stats("a", [101, 999, 1]), JobAllocation(job="a", workers=3, cpus=1.0))
    assert r.ok, r.error
    assert set(kernel.procs("adloader/a")) == {101}


def test_none_policy_allocation_releases_the_group(v2):
    kernel, make = v2
    act = make(io=False)
    act.apply(stats("a", [101]), JobAllocation(job="a", workers=1, cpus=1.0))
    r = act.apply(stats("a", [101]), JobAllocation(job="a", workers=1, cpus=1.0, enforce_cpu=False))
    assert r.ok and not kernel.exists("adloader/a")


def test_cooperative_job_gets_affinity_not_cgroups(v2):
    kernel, make = v2
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        cpus = sorted(os.sched_getaffinity(0))
        act = make(io=False)
        job = stats("slurm-7", [child.pid], cooperative=True, allowed_cpus=tuple(cpus))
        r = act.apply(job, JobAllocation(job="slurm-7", workers=1, cpus=0.6))
        assert r.ok, r.error
        assert not kernel.exists("adloader")
        assert os.sched_getaffinity(child.pid) == {cpus[-1]}
        assert any("affinity" in n for n in r.not_enforced)
        act.release("slurm-7")
        assert os.sched_getaffinity(child.pid) == set(cpus)
    finally:
        child.kill()
        child.wait(timeout=10)


def test_affinity_actuator_restores_from_journal(tmp_path):
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip(f"needs 2 CPUs to see affinity change, this process may use {cpus}")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    journal = str(tmp_path / "orig.json")
    try:
        act = AffinityActuator(Originals(journal))
        job = stats("j", [child.pid], allowed_cpus=tuple(cpus))
        assert act.apply(job, JobAllocation(job="j", workers=1, cpus=1.0, cpuset=(cpus[0],))).ok
        assert os.sched_getaffinity(child.pid) == {cpus[0]}
        AffinityActuator(Originals(journal)).restore()          # a restarted agent puts it back
        assert os.sched_getaffinity(child.pid) == set(cpus)
    finally:
        child.kill()
        child.wait(timeout=10)
    act = AffinityActuator(Originals())
    assert act.apply(stats("k", [child.pid]), JobAllocation(job="k", workers=1, cpus=1.0)).ok  # gone: skipped


def test_layout_detection_by_statfs_magic(tmp_path):
    (tmp_path / "unified").mkdir()
    magic = {str(tmp_path): cgroupfs.TMPFS_MAGIC, str(tmp_path / "unified"): cgroupfs.CGROUP2_SUPER_MAGIC}
    assert detect_layout(str(tmp_path), magic.get) == "hybrid"
    magic[str(tmp_path / "unified")] = cgroupfs.TMPFS_MAGIC
    assert detect_layout(str(tmp_path), magic.get) == "legacy"
    assert detect_layout(str(tmp_path), lambda p: cgroupfs.CGROUP2_SUPER_MAGIC) == "unified"
    with pytest.raises(NotSupported, match="neither a cgroup2 mount"):
        detect_layout(str(tmp_path), lambda p: 0xEF53)
    if os.path.isdir("/sys/fs/cgroup"):
        assert detect_layout("/sys/fs/cgroup") in ("unified", "hybrid", "legacy")


def test_domain_errors_and_parsers(tmp_path):
    assert isinstance(domain_error(OSError(errno.ESRCH, "x"), "move"), JobGone)
    assert isinstance(domain_error(OSError(errno.EACCES, "x"), "write"), NotPermitted)
    assert isinstance(domain_error(OSError(errno.ENOSPC, "x"), "write"), InvalidValue)
    assert isinstance(domain_error(OSError(errno.EBUSY, "x"), "rmdir"), Busy)
    assert "write /x: Permission denied" in str(domain_error(OSError(errno.EACCES, "x"), "write /x"))
    proc = tmp_path / "proc" / "42"
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text("4:cpu,cpuacct:/a/b\n3:cpuset:/\n1:name=systemd:/x\n0::/u.slice\n")
    cg = cgroupfs.proc_cgroups(42, str(tmp_path / "proc"))
    assert cg["cpu"] == cg["cpuacct"] == "/a/b" and cg["cpuset"] == "/" and cg[""] == "/u.slice"
    with pytest.raises(JobGone):
        cgroupfs.proc_cgroups(43, str(tmp_path / "proc"))
    assert cgroupfs.parse_cpu_list("0-2,5, 7") == (0, 1, 2, 5, 7)
    assert cgroupfs.format_cpu_list([5, 0, 1, 2, 7]) == "0-2,5,7"
    sys_root = fake_sys(tmp_path, {"vda": "none [mq-deadline] kyber bfq", "sdb": "[bfq] none"})
    assert cgroupfs.block_schedulers(sys_root) == {"sdb": "bfq", "vda": "mq-deadline"}
    with pytest.raises(ValueError, match="memory"):
        cgroupfs.open_hierarchies(str(tmp_path), 1, ("cpu", "memory"))


def test_v1_io_not_enforced_without_bfq(tmp_path):
    """On this machine's kind of disks (scheduler none / mq-deadline) IO weights are reported, not written."""
    root = tmp_path / "cg"
    for ctrl in ("cpu", "blkio"):
        (root / ctrl).mkdir(parents=True)
        (root / ctrl / "cgroup.procs").write_text("")
    hier = cgroupfs.open_hierarchies(str(root), 1)
    sys_root = fake_sys(tmp_path, {"vda": "none [mq-deadline] kyber bfq"})
    act = CgroupActuator(hier, version=1, io=True, subtree="adloader", sys_root=sys_root,
                         proc_root=fake_proc(tmp_path, []))
    assert act.io_mode is None
    assert any("not enforced" in n and "vda: mq-deadline" in n for n in act.io_notes)


def test_shares_and_weight_mapping():
    from agent.actuators.cgroup import shares_from_weight

    assert all(weight_from_shares(shares_from_weight(weight_from_shares(s))) == weight_from_shares(s)
               for s in (2, 100, 1024, 2048, 262144))
    assert weight_from_shares(2) == 1 and weight_from_shares(1024) == 100 and weight_from_shares(262144) == 10000
    # linear, as the kernel relates them: job groups keep the ratio of their cores
    assert weight_from_shares(3072) == 300 and weight_from_shares(shares_for(0.6)) == 60
    from agent.actuators.cgroup import subtree_shares_for
    assert subtree_shares_for(0) == 2 and subtree_shares_for(3) == 3072 and subtree_shares_for(10 ** 6) == 262144
    ws = [weight_from_shares(s) for s in range(2, 262145, 997)]
    assert ws == sorted(ws)
    assert shares_for(0.0) == 2 and shares_for(1.0) == 1024 and shares_for(1e6) == 262144


def test_build_modes(tmp_path):
    class Sink:
        def send_directive(self, *a):
            return True

    assert [a.name for a in build("cooperative", sink=Sink())] == ["directive", "affinity"]
    assert isinstance(build("off", sink=Sink())[0], DirectiveActuator)
    with pytest.raises(ValueError, match="cpu_knob"):
        build("v1", sink=Sink(), cpu_knob="turbo")
    proc = fake_proc(tmp_path, [])
    FakeV2Kernel(str(tmp_path / "cg"), proc)
    acts = build("v2", sink=Sink(), cgroup_root=str(tmp_path / "cg"), state_dir=str(tmp_path / "st"),
                 sys_root=str(tmp_path), proc_root=proc)
    assert [a.name for a in acts] == ["directive", "cgroup-v2"]


# -- v2 under systemd: the agent's own delegated group ---------------------------------------------

OWN = "system.slice/adloader-agent.service"


@pytest.fixture
def delegated(tmp_path):
    """A systemd-like tree: the agent (pid 500) and a helper it started (501) in their unit's group,
    /system.slice/adloader-agent.service; the job's workers in a user scope."""
    proc = fake_proc(tmp_path, [101, 102, 103, 500, 501])
    kernel = FakeV2Kernel(str(tmp_path / "cg"), proc)
    kernel.write("", "cgroup.subtree_control", "+memory")
    for rel in ("user.slice", "user.slice/job.scope", "system.slice", OWN):
        kernel.mkdir(rel)
    kernel.write("user.slice", "cgroup.subtree_control", "+memory")
    for pid in (101, 102, 103):
        kernel.move("user.slice/job.scope", pid)
    for pid in (500, 501):
        kernel.move(OWN, pid)

    def make(self_cgroup=f"/{OWN}", journal=None, **kw):
        (tmp_path / "proc" / "self" / "cgroup").write_text(f"0::{self_cgroup}\n")
        return CgroupActuator({"": kernel}, version=2, io=False, subtree="adloader", originals=Originals(journal),
                              sys_root=str(tmp_path), proc_root=proc, **kw)

    return kernel, make


def test_fake_kernel_refuses_controllers_for_a_group_with_processes(delegated):
    """What makes the leaf necessary (cgroup-v2.rst, "No Internal Process Constraint")."""
    kernel, _ = delegated
    kernel.write("", "cgroup.subtree_control", "+cpu")
    kernel.write("system.slice", "cgroup.subtree_control", "+cpu")
    with pytest.raises(Busy):
        kernel.write(OWN, "cgroup.subtree_control", "+cpu")
    with pytest.raises(NotSupported):        # not in its cgroup.controllers: the parent does not delegate io
        kernel.write("user.slice", "cgroup.subtree_control", "+io")


def test_v2_job_groups_under_the_agents_own_cgroup(delegated):
    kernel, make = delegated
    act = make()
    assert act.subtree == f"{OWN}/adloader"
    assert not kernel.exists(f"{OWN}/agent")                 # nothing touched before the first apply
    r = act.apply(stats("job-1", [101, 102]), JobAllocation(job="job-1", workers=2, cpus=2.0))
    assert r.ok, r.error
    # the agent and its helper moved to a leaf, so <own> may enable controllers for its children
    assert set(kernel.procs(f"{OWN}/agent")) == {500, 501} and kernel.procs(OWN) == []
    assert cgroupfs.proc_cgroups(500, kernel.proc_root)[""] == f"/{OWN}/agent"
    # +cpu enabled all the way down: root, system.slice, the unit, the adloader subtree
    for rel in ("", "system.slice", OWN, f"{OWN}/adloader"):
        assert "cpu" in kernel.subtree_control(rel), rel
    assert kernel.subtree_control("") == {"cpu", "memory"}
    assert set(kernel.procs(f"{OWN}/adloader/job-1")) == {101, 102}
    assert read(kernel, f"{OWN}/adloader/job-1", "cpu.weight") == str(weight_from_shares(2048))
    assert not kernel.exists("adloader")                      # nothing at the top level
    # a second job reuses the prepared base
    assert act.apply(stats("job-2", [103]), JobAllocation(job="job-2", workers=1, cpus=1.0)).ok
    act.release("job-1")
    assert set(kernel.procs("user.slice/job.scope")) == {101, 102}
    act.restore()
    # everything as it was: groups gone, processes back, subtree_control back, leaf removed
    assert not kernel.exists(f"{OWN}/adloader") and not kernel.exists(f"{OWN}/agent")
    assert set(kernel.procs(OWN)) == {500, 501}
    assert set(kernel.procs("user.slice/job.scope")) == {101, 102, 103}
    assert kernel.subtree_control("") == {"memory"}
    assert kernel.subtree_control("system.slice") == set() and kernel.subtree_control(OWN) == set()


def test_v2_delegated_with_controllers_already_enabled_writes_only_below_own(delegated):
    """systemd Delegate=yes enables the controllers down to the unit: the agent writes nothing above it."""
    kernel, make = delegated
    kernel.write("", "cgroup.subtree_control", "+cpu +io")
    kernel.write("system.slice", "cgroup.subtree_control", "+cpu +io")
    kernel.writes.clear()
    act = make()
    assert act.apply(stats("a", [101]), JobAllocation(job="a", workers=1, cpus=1.0)).ok
    above = [w for w in kernel.writes if w[1] == "cgroup.subtree_control" and not w[0].startswith(OWN)]
    assert above == []
    assert "cpu" in kernel.subtree_control(OWN) and "cpu" in kernel.subtree_control(f"{OWN}/adloader")


def test_v2_agent_already_in_its_leaf(delegated):
    """A restarted agent (or systemd DelegateSubgroup=agent) already in <own>/agent: no nested leaf."""
    kernel, make = delegated
    kernel.mkdir(f"{OWN}/agent")
    for pid in (500, 501):
        kernel.move(f"{OWN}/agent", pid)
    act = make(self_cgroup=f"/{OWN}/agent")
    assert act.subtree == f"{OWN}/adloader"
    assert act.apply(stats("a", [101]), JobAllocation(job="a", workers=1, cpus=1.0)).ok
    assert set(kernel.procs(f"{OWN}/adloader/a")) == {101}
    assert not kernel.exists(f"{OWN}/agent/agent") and set(kernel.procs(f"{OWN}/agent")) == {500, 501}
    act.restore()
    assert kernel.exists(f"{OWN}/agent")                      # not ours to remove: it was there before
    assert set(kernel.procs(f"{OWN}/agent")) == {500, 501} and not kernel.exists(f"{OWN}/adloader")


def test_v2_agent_in_the_root_cgroup_uses_top_level_subtree(delegated):
    kernel, make = delegated
    act = make(self_cgroup="/")
    assert act.subtree == "adloader"
    assert act.apply(stats("a", [101]), JobAllocation(job="a", workers=1, cpus=1.0)).ok
    assert set(kernel.procs("adloader/a")) == {101}
    assert not kernel.exists(f"{OWN}/agent") and set(kernel.procs(OWN)) == {500, 501}


def test_v2_delegated_restart_from_journal_keeps_subtree(delegated, tmp_path):
    kernel, make = delegated
    journal = str(tmp_path / "state" / "orig.json")
    first = make(journal=journal)
    assert first.apply(stats("a", [101]), JobAllocation(job="a", workers=1, cpus=2.0)).ok
    # a restarted agent in the same unit, now in the leaf, finds the group it made and its weight
    second = make(self_cgroup=f"/{OWN}/agent", journal=journal)
    assert weight_from_shares(second._shares["a"]) == weight_from_shares(2048)
    second.restore()
    assert not kernel.exists(f"{OWN}/adloader") and set(kernel.procs("user.slice/job.scope")) == {101, 102, 103}
    assert kernel.subtree_control("") == {"memory"} and kernel.subtree_control(OWN) == set()


def test_v2_own_cgroup_not_in_this_tree_fails_clearly(delegated):
    kernel, make = delegated
    act = make(self_cgroup="/machine.slice/other.scope")
    r = act.apply(stats("a", [101]), JobAllocation(job="a", workers=1, cpus=1.0))
    assert not r.ok and "own cgroup /machine.slice/other.scope" in r.error and "cgroup_root" in r.error
    assert not kernel.exists("machine.slice")
