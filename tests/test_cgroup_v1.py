"""The cgroup actuator on a v1 tree in tmp_path (the real v1 hierarchy: test_cgroup_system.py)."""
from __future__ import annotations

import os

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


V1_CONTROLLERS = ("cpu", "cpuset", "blkio")
SYS_FS_CGROUP = "/sys/fs/cgroup"


def _built_v1_paths(source: str) -> list[tuple[int, str]]:
    """(line, what) for each place in Python ``source`` that builds a v1 hierarchy's path from its
    controller's name instead of finding its mount: the literal ``/sys/fs/cgroup/cpu`` (``cpuset``,
    ``blkio``, and anything below them), ``join(ROOT, "cpu")`` / ``Path(ROOT, "cpu")`` for any name
    ending in ``ROOT``, ``f"{ROOT}/cpu"``, and ``V1Hierarchy`` on the real root without a mount (it
    then defaults to ``<root>/<controller>``). Docstrings and comments are prose and are not read."""
    import ast
    import re

    literal = re.compile(r"/sys/fs/cgroup/(%s)(/|$)" % "|".join(V1_CONTROLLERS))
    tree = ast.parse(source)
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}

    def root_name(n) -> bool:
        n = n.value if isinstance(n, ast.FormattedValue) else n
        return (isinstance(n, ast.Name) and n.id.endswith("ROOT")) or \
            (isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.rstrip("/") == "/sys/fs/cgroup")

    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings \
                and literal.search(n.value):
            found.append((n.lineno, repr(n.value)))
        elif isinstance(n, ast.JoinedStr):
            for a, b in zip(n.values, n.values[1:]):
                if root_name(a) and isinstance(b, ast.Constant) and re.match(
                        r"/(%s)(/|$)" % "|".join(V1_CONTROLLERS), str(b.value)):
                    found.append((n.lineno, f"f-string: {{root}}{b.value}"))
        elif isinstance(n, ast.Call):
            fn = n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
            args = n.args
            if fn in ("join", "Path") and len(args) >= 2 and root_name(args[0]) \
                    and isinstance(args[1], ast.Constant) and args[1].value in V1_CONTROLLERS:
                found.append((n.lineno, f"{fn}(root, {args[1].value!r})"))
            elif fn == "V1Hierarchy" and args and root_name(args[0]) and len(args) + len(n.keywords) < 3:
                found.append((n.lineno, "V1Hierarchy(root, controller) without its mount"))
    return sorted(found)


def test_the_check_for_built_v1_paths_finds_each_form_and_not_prose():
    """What the repository check below must catch (each line here was in a test or command once), and
    what it must leave alone: prose, comments, a joined mount's name, a fake tree in tmp_path."""
    # @ for the cgroup root, so that this file's own strings spell no built path
    caught = _built_v1_paths('''
CPU = "@/cpu"
ok = os.path.exists("@/cpuset/cpuset.cpus")
read = open(os.path.join(ROOT, "cpu", SUBTREE))
there = Path(CGROUP_ROOT, "blkio").exists()
group = f"{ROOT}/cpu/adloader/{job}"
cpu = cgroupfs.V1Hierarchy("@", "cpu")
'''.replace("@", SYS_FS_CGROUP))
    assert [line for line, _ in caught] == [2, 3, 4, 5, 6, 7], caught
    assert _built_v1_paths('''
"""Not at @/cpu: found from mountinfo."""
def f(tmp_path):
    """Wrote @/cpu before."""
    # @/cpu is not always there
    mount = "@/cpu,cpuacct"
    fake = os.path.join(str(tmp_path), "cpu")
    h = cgroupfs.V1Hierarchy(str(tmp_path), "cpu")
    return cgroupfs.V1Hierarchy(ROOT, "cpu", v1_mount(ROOT, "cpu")), "@/unified"
'''.replace("@", SYS_FS_CGROUP)) == []


def test_no_command_or_test_builds_a_v1_hierarchy_path():
    """The evaluation commands and the tests wrote /sys/fs/cgroup/cpu (or joined the root and "cpu"),
    which a host that mounts ``cpu,cpuacct`` with no ``cpu`` symlink does not have. They find each
    hierarchy at its mount point (``cgroupfs.v1_mount`` / ``v1_hierarchy``, ``tests/cgroup_support``:
    ``CPU``, ``CPUSET``), as the agent does. Every test module is read, so a new one cannot bring a
    built path back."""
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    files = sorted(repo.glob("evaluation/*.py")) + sorted(repo.glob("tests/*.py"))
    assert len(files) > 80                   # the globs found the modules
    found = [f"{f.relative_to(repo)}:{line}: {what}" for f in files for line, what in _built_v1_paths(f.read_text())]
    assert not found, "\n".join(found)


def _fake_process(proc_root: str, pid: int, start_ticks: int, uid: int) -> None:
    """``<proc_root>/<pid>/stat`` (start time: field 22, proc(5)) and ``status`` (its Uid line)."""
    d = os.path.join(proc_root, str(pid))
    os.makedirs(d, exist_ok=True)
    fields = ["S", "1"] + ["0"] * 17 + [str(start_ticks)] + ["0"] * 10
    with open(os.path.join(d, "stat"), "w") as f:
        f.write(f"{pid} (python (worker)) " + " ".join(fields) + "\n")
    with open(os.path.join(d, "status"), "w") as f:
        f.write(f"Name:\tpython\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n")


def test_a_worker_pid_that_is_another_process_now_is_not_moved(tmp_path):
    """A worker that exits may leave its pid to another process (any user's) before the client's next
    report; the actuator moved whatever held the pid into the job's group. Each pid is checked against the
    start time the registry recorded and the job's uid right before its move: the worker is moved, a pid
    now held by a process started later, or by another uid, is left alone (and is no error); a pid with
    no start time recorded (a journal older than start times) needs the job's uid only."""
    from agent.model import JobAllocation
    from tests.fakes import cgroup_job

    root = tmp_path / "cg"
    (root / "cpu" / "adloader" / "j").mkdir(parents=True)      # plain directories: no kernel files
    for d in ("", "adloader", "adloader/j"):
        (root / "cpu" / d / "cgroup.procs").write_text("")
    worker, reused, other_uid, unrecorded, gone = 4242, 4243, 4244, 4245, 4246
    proc = fake_proc(tmp_path, [worker, reused, other_uid, unrecorded, gone], origin="/")
    for pid in (worker, reused, other_uid):
        _fake_process(proc, pid, start_ticks=1000, uid=1000)
    _fake_process(proc, unrecorded, start_ticks=5000, uid=1000)
    hier = cgroupfs.open_hierarchies(str(root), 1, proc_root=proc)
    _fake_process(proc, reused, start_ticks=3000, uid=1000)          # the worker exited, its pid reused
    _fake_process(proc, other_uid, start_ticks=1000, uid=65534)      # (same tick, another user's process)
    moved = []
    move = hier["cpu"].move
    hier["cpu"].move = lambda rel, pid: (moved.append(pid), move(rel, pid))
    act = CgroupActuator(hier, version=1, io=False, subtree="adloader", sys_root=fake_sys(tmp_path, {}),
                         proc_root=proc)
    job = cgroup_job("j", [worker, reused, other_uid, unrecorded, gone], uid=1000,
                     worker_starts={worker: 1000, reused: 1000, other_uid: 1000, unrecorded: None, gone: 1000})
    r = act.apply(job, JobAllocation(job="j", workers=5, cpus=1.0))
    assert r.ok, r.error
    assert moved == [worker, unrecorded]
    assert sorted(act.originals.pids) == sorted([str(worker), str(unrecorded)])
    assert act.pids_skipped == 3
    assert (root / "cpu" / "adloader" / "cpu.shares").read_text() == "2048"      # two workers weigh


def test_v1_a_job_group_removed_from_blkio_only_is_lost_and_a_knob_no_apply_used_is_not_checked(tmp_path):
    """The job's blkio group removed (its cpu group stays): lost, and the next apply makes it again.
    Before, only the cpu group was checked: the job's IO ran at the default weight until its allocation
    changed. A job whose apply put no group in blkio (no IO weight in the plan) is not lost for lack
    of one there (else it would be applied again at every tick)."""
    from agent.model import JobAllocation
    from tests.fakes import cgroup_job

    root = tmp_path / "cg"
    for ctrl in ("cpu", "blkio"):
        (root / ctrl).mkdir(parents=True)                   # plain directories: no kernel files
        (root / ctrl / "cgroup.procs").write_text("")
    proc = fake_proc(tmp_path, [4242, 4243], origin="/")
    for pid in (4242, 4243):
        _fake_process(proc, pid, start_ticks=1000, uid=1000)
    hier = cgroupfs.open_hierarchies(str(root), 1, controllers=("cpu", "blkio"), proc_root=proc)
    for h in hier.values():                                 # a new group has its cgroup.procs, as the kernel's
        def mkdir(rel, h=h, plain_mkdir=h.mkdir):
            if not plain_mkdir(rel):
                return False
            open(h.path(rel, "cgroup.procs"), "w").close()
            return True
        h.mkdir = mkdir
    act = CgroupActuator(hier, version=1, io=True, subtree="adloader",
                         sys_root=fake_sys(tmp_path, {"vda": "mq-deadline [bfq] none"}), proc_root=proc)
    assert act.io_mode == "blkio.bfq.weight"
    io_job = cgroup_job("io", [4242], uid=1000, worker_starts={4242: 1000})
    cpu_job = cgroup_job("cpu", [4243], uid=1000, worker_starts={4243: 1000})
    assert act.apply(io_job, JobAllocation(job="io", workers=1, cpus=1.0, io_weight=300)).ok
    assert act.apply(cpu_job, JobAllocation(job="cpu", workers=1, cpus=1.0)).ok
    assert (root / "blkio" / "adloader" / "io" / "blkio.bfq.weight").read_text() == "300"
    assert not (root / "blkio" / "adloader" / "cpu").exists()
    assert not act.lost_group("io") and not act.lost_group("cpu")
    (root / "blkio" / "adloader" / "io" / "blkio.bfq.weight").unlink()   # the admin's rmdir
    (root / "blkio" / "adloader" / "io" / "cgroup.procs").unlink()
    (root / "blkio" / "adloader" / "io").rmdir()
    assert (root / "cpu" / "adloader" / "io").is_dir()
    assert act.lost_group("io") and not act.lost_group("cpu")          # old code: False for "io"
    assert act.apply(io_job, JobAllocation(job="io", workers=1, cpus=1.0, io_weight=300)).ok
    assert not act.lost_group("io")
    assert (root / "blkio" / "adloader" / "io" / "blkio.bfq.weight").read_text() == "300"
    assert [int(x) for x in (root / "blkio" / "adloader" / "io" / "cgroup.procs").read_text().split()] == [4242]
