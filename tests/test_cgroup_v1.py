"""The cgroup actuator on a v1 tree in tmp_path (the real v1 hierarchy: test_cgroup_system.py)."""
from __future__ import annotations

import pytest

from agent import cgroupfs
from agent.actuators.cgroup import CgroupActuator
from tests.fakes import fake_proc, fake_sys

pytestmark = pytest.mark.component


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



def _mountinfo(proc_root: str, lines: list[str]) -> None:
    with open(f"{proc_root}/self/mountinfo", "w") as f:
        f.write("\n".join(lines) + "\n")


def test_v1_joined_cpu_cpuacct_mount_is_found_from_mountinfo(tmp_path):
    """A host that mounts ``cpu,cpuacct`` with no ``cpu`` symlink: the hierarchies were looked up only
    by name (``<root>/cpu``), so the agent ran without CPU control. The mount points come from
    mountinfo (a custom name with an escaped space too), and cgroupspy still knows the controller."""
    from cgroupspy.controllers import BlkIOController, CpuController

    from agent.actuators import build, resolve_auto
    from agent.model import JobAllocation
    from tests.fakes import cgroup_job

    root = tmp_path / "cg"
    for d in ("cpu,cpuacct", "blk io", "memory"):
        (root / d).mkdir(parents=True)
        (root / d / "cgroup.procs").write_text("")
    proc = fake_proc(tmp_path, [4242], origin="/")
    (tmp_path / "proc" / "4242" / "cgroup").write_text("5:cpu,cpuacct:/\n4:blkio:/\n3:memory:/\n")
    _mountinfo(proc, [
        f"31 23 0:28 / {root} rw,relatime - tmpfs tmpfs rw,mode=755",
        f"32 31 0:29 / {root}/cpu,cpuacct rw,nosuid,nodev,noexec,relatime shared:7 - cgroup cgroup rw,cpu,cpuacct",
        f"33 31 0:30 / {root}/blk\\040io rw,relatime - cgroup cgroup rw,blkio",
        f"34 31 0:31 / {root}/memory rw,relatime - cgroup cgroup rw,memory",
        "35 23 0:32 / /elsewhere/cpuset rw,relatime - cgroup cgroup rw,cpuset",      # not under cgroup_root
        f"36 31 0:33 / {root}/unified rw,relatime - cgroup2 cgroup2 rw",
    ])
    assert cgroupfs.v1_mount(str(root), "cpu", proc) == f"{root}/cpu,cpuacct"
    assert cgroupfs.v1_mount(str(root), "cpuacct", proc) == f"{root}/cpu,cpuacct"
    assert cgroupfs.v1_mount(str(root), "blkio", proc) == f"{root}/blk io"
    assert cgroupfs.v1_mount(str(root), "cpuset", proc) == f"{root}/cpuset"      # name-based, absent
    with pytest.raises(ValueError, match="memory"):
        cgroupfs.v1_mount(str(root), "memory", proc)
    assert cgroupfs.v1_controller_available(str(root), "cpu", proc) is None
    assert "no cgroup v1 cpuset" in cgroupfs.v1_controller_available(str(root), "cpuset", proc)
    hier = cgroupfs.open_hierarchies(str(root), 1, proc_root=proc)
    assert sorted(hier) == ["blkio", "cpu"]
    assert hier["cpu"].root == f"{root}/cpu,cpuacct" and hier["blkio"].root == f"{root}/blk io"
    assert isinstance(hier["cpu"].node("adloader/j").controller, CpuController)
    assert isinstance(hier["blkio"].node("").controller, BlkIOController)
    assert resolve_auto(str(root), proc) in ("v1", "off")       # "off" only where statfs says not tmpfs
    (root / "cpu,cpuacct" / "adloader" / "j").mkdir(parents=True)      # a plain directory: no kernel files
    (root / "cpu,cpuacct" / "adloader" / "j" / "cgroup.procs").write_text("")
    act = build("v1", sink=None, cgroup_root=str(root), subtree="adloader", state_dir=str(tmp_path / "st"),
                sys_root=fake_sys(tmp_path, {}), proc_root=proc)[1]
    r = act.apply(cgroup_job("j", [4242]), JobAllocation(job="j", workers=1, cpus=0.5))
    assert r.ok, r.error
    assert (root / "cpu,cpuacct" / "adloader" / "j" / "cpu.shares").read_text() == "512"
    assert (root / "cpu,cpuacct" / "adloader" / "j" / "cgroup.procs").read_text() == "4242"
    assert not (root / "cpu").exists() and not (root / "memory" / "adloader").exists()


def test_v1_without_mountinfo_falls_back_to_the_names(tmp_path):
    root = tmp_path / "cg"
    (root / "cpu").mkdir(parents=True)
    (root / "cpu" / "cgroup.procs").write_text("")
    proc = fake_proc(tmp_path, [])                  # no self/mountinfo
    assert cgroupfs.v1_mounts(proc) is None
    assert cgroupfs.v1_mount(str(root), "cpu", proc) == f"{root}/cpu"
    assert sorted(cgroupfs.open_hierarchies(str(root), 1, proc_root=proc)) == ["cpu"]


def test_v1_discovery_on_this_machine_gives_the_usual_paths():
    """Where this host mounts each v1 controller at /sys/fs/cgroup/<name> (this machine: cpu, cpuset,
    blkio), mountinfo gives the same paths as the names did."""
    mounts = cgroupfs.v1_mounts()
    if not mounts:
        pytest.skip("no cgroup v1 mount in /proc/self/mountinfo")
    for ctrl in ("cpu", "cpuset", "blkio"):
        usual = f"/sys/fs/cgroup/{ctrl}"
        if any(mp == usual and ctrl in opts for mp, _, opts in mounts):
            assert cgroupfs.v1_mount("/sys/fs/cgroup", ctrl) == usual
    for ctrl, h in cgroupfs.open_hierarchies("/sys/fs/cgroup", 1).items():
        assert any(mp == h.root and ctrl in opts for mp, _, opts in mounts), (ctrl, h.root)


def test_v1_a_group_named_with_undecodable_bytes_is_left_alone_and_logged_once(tmp_path, caplog):
    """Someone else's group named with a byte that is not UTF-8 (b'\\xff') in the agent's subtree, and
    the journal of originals lost: adopt_orphans took it as the dead agent's, and restore raised
    UnicodeEncodeError from cgroupspy on its name (the rest of the restore never ran). It is left out
    of everything, logged once with its path's bytes; the job's group and the subtree are restored."""
    import logging
    import os

    from agent.actuators import build
    from agent.cgroupfs import CgroupError
    from agent.model import JobAllocation
    from tests.fakes import cgroup_job

    cpu = tmp_path / "cg" / "cpu"
    (cpu / "adloader" / "j").mkdir(parents=True)
    for rel, files in {"": {}, "adloader": {"cpu.shares": "2048", "cpu.cfs_quota_us": "150000"},
                       "adloader/j": {"cpu.shares": "512"}}.items():
        for name, value in {"cgroup.procs": "", **files}.items():
            (cpu / rel / name).write_text(value)
    theirs = os.fsencode(cpu / "adloader") + b"/\xff"
    os.makedirs(theirs + b"/below")
    state = tmp_path / "st"
    state.mkdir()
    (state / "cgroup-originals.json").write_text("{not json")
    problems: list = []
    with caplog.at_level(logging.WARNING, logger="agent.cgroup"):
        act = build("v1", sink=None, cgroup_root=str(tmp_path / "cg"), subtree="adloader", state_dir=str(state),
                    sys_root=fake_sys(tmp_path, {}), proc_root=fake_proc(tmp_path, [4242]), problems=problems)[1]
        assert act.originals.created == ["cpu|adloader", "cpu|adloader/j"]
        assert any(p.endswith("previous agent: j") for p in problems), problems
        r = act.apply(cgroup_job("j", [4242]), JobAllocation(job="j", workers=1, cpus=0.5))    # a tick
        assert r.ok, r.error
        h = act.h["cpu"]
        real_rmdir = h.rmdir

        def rmdir(rel):                    # as the kernel's: a group's interface files go with it
            for f in os.scandir(h.path(rel)):
                if f.is_file():
                    os.unlink(f.path)
            real_rmdir(rel)

        h.rmdir = rmdir
        with pytest.raises(CgroupError, match=r"restore incomplete: rmdir .*/adloader: Directory not empty$"):
            act.restore()                  # their group keeps the subtree: said, not raised through
    logged = [r for r in caplog.records if getattr(r, "event", None) == "cgroup_name_undecodable"]   # 3 walks
    assert [r.fields["group"] for r in logged] == [repr(theirs)]
    assert os.path.isdir(theirs + b"/below") and not (cpu / "adloader" / "j").exists()
    assert (cpu / "cgroup.procs").read_text() == "4242"
    assert {f: (cpu / "adloader" / f).read_text() for f in ("cpu.shares", "cpu.cfs_quota_us")} == \
        {"cpu.shares": "1024", "cpu.cfs_quota_us": "-1"}          # a new group's values: no cap


def test_no_command_or_system_test_builds_a_v1_hierarchy_path():
    """The evaluation commands and the cgroup system tests wrote /sys/fs/cgroup/cpu (or joined the root
    and "cpu"), which a host that mounts ``cpu,cpuacct`` with no ``cpu`` symlink does not have. They find
    each hierarchy at its mount point (``cgroupfs.v1_mount`` / ``v1_hierarchy``), as the agent does."""
    import re
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    built = re.compile(r"/sys/fs/cgroup/(cpu|cpuset|blkio)\b(?![,a-z])|(join|Path)\(\w*ROOT, \"(cpu|cpuset|blkio)\"")
    files = sorted(repo.glob("evaluation/*.py")) + [repo / "tests" / n for n in (
        "cgroup_support.py", "test_cgroup_system.py", "test_predictor_corpus.py", "test_sim.py")]
    found = [f"{f.relative_to(repo)}:{i}: {line.strip()}" for f in files
             for i, line in enumerate(f.read_text().splitlines(), 1) if built.search(line)]
    assert not found, "\n".join(found)
