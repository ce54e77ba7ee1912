"""agent/actuators: which actuators each cgroup mode builds, and the cpu.shares <-> cpu.weight mapping."""
from __future__ import annotations

import pytest

from agent.actuators import DirectiveActuator, build
from agent.actuators.cgroup import shares_for, weight_from_shares
from tests.fakes import FakeV2Kernel, fake_proc

@pytest.mark.unit
def test_shares_and_weight_mapping():
    from agent.actuators.cgroup import shares_from_weight

    assert all(weight_from_shares(shares_from_weight(weight_from_shares(s))) == weight_from_shares(s)
               for s in (2, 100, 1024, 2048, 262144))
    assert weight_from_shares(2) == 1 and weight_from_shares(1024) == 100 and weight_from_shares(262144) == 10000
    # linear, as the kernel relates them: job groups keep the ratio of their cores
    assert weight_from_shares(3072) == 300 and weight_from_shares(shares_for(0.6)) == 60
    from agent.actuators.cgroup import subtree_shares_for
    assert subtree_shares_for(0) == 2 and subtree_shares_for(3) == 3072 and subtree_shares_for(10 ** 6) == 262144
    from agent.actuators.cgroup import subtree_shares_for_cores
    assert subtree_shares_for_cores(0.3) == 1024 and subtree_shares_for_cores(1.8) == 1843
    assert subtree_shares_for_cores(1e6) == 262144
    ws = [weight_from_shares(s) for s in range(2, 262145, 997)]
    assert ws == sorted(ws)
    assert shares_for(0.0) == 2 and shares_for(1.0) == 1024 and shares_for(1e6) == 262144


@pytest.mark.component
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



@pytest.mark.unit
def test_group_names_are_one_to_one_and_never_an_interface_file():
    """Issue 16.7: 'adv/col' and 'adv_col' mapped to the same group. Ids are checked at the protocol
    boundary; the name is the id, escaped where it could be a cgroup file."""
    from adloader import protocol
    from agent.actuators.cgroup import group_name, job_of_group

    ids = ["adv_col", "adv.col", "adv~col", "cpu.shares", "tasks", "notify_on_release", "release_agent",
           "cgroup.procs", "4242", "4242_7", "pid-1", "a.b.c", "a_b_c", "_", "x" * 128]
    valid = [i for i in ids if protocol.check_job_id(i) is None]
    names = [group_name(i) for i in valid]
    assert len(set(names)) == len(valid)
    assert all(job_of_group(n) == i for n, i in zip(names, valid))
    assert all("." not in n and n not in ("tasks", "notify_on_release", "release_agent") and "/" not in n
               for n in names)
    assert group_name("adv_col") == "adv_col" and group_name("4242") == "4242"
