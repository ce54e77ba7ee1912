"""agent/cgroupfs.py: layout detection by statfs magic, OSError -> domain errors, /proc/<pid>/cgroup,
cpu lists and block schedulers parsed from fake trees in tmp_path."""
from __future__ import annotations

import errno
import os

import pytest

from agent import cgroupfs
from agent.cgroupfs import Busy, InvalidValue, JobGone, NotPermitted, NotSupported, detect_layout, domain_error
from tests.fakes import fake_sys

pytestmark = pytest.mark.component


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



def test_move_tells_a_gone_process_by_the_configured_proc_root(tmp_path):
    """v1 answers EINVAL for a pid that no longer exists; ``move`` then looked at the real /proc, not
    ``proc_root``: a process the fake tree lists was JobGone, one it does not list was not."""
    from tests.fakes import fake_proc

    (tmp_path / "cg" / "cpu" / "g").mkdir(parents=True)
    (tmp_path / "cg" / "cpu" / "cgroup.procs").write_text("")
    listed = 4194305                       # above the kernel's largest pid_max: never in the real /proc
    proc = fake_proc(tmp_path, [listed])
    h = cgroupfs.open_hierarchies(str(tmp_path / "cg"), 1, ("cpu",), proc_root=proc)["cpu"]

    def einval(rel, file, value):          # what v1 says to a write of a pid it cannot move
        raise domain_error(OSError(errno.EINVAL, "x"), f"write {value} to {h.path(rel, file)}")

    h.write = einval
    with pytest.raises(InvalidValue):
        h.move("g", listed)                # in proc_root: a real refusal
    with pytest.raises(JobGone):
        h.move("g", os.getpid())           # alive in /proc, but not in proc_root: gone
