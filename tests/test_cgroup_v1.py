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

