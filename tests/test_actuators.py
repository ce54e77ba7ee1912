"""agent/actuators: which actuators each cgroup mode builds, and the cpu.shares <-> cpu.weight mapping."""
from __future__ import annotations

import os

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


@pytest.mark.component
def test_a_truncated_journal_of_originals_falls_back_to_its_previous_copy(tmp_path, monkeypatch):
    """cgroup-originals.json truncated (a disk that lost the tail, a copy cut short): the last good copy
    ``.prev`` (kept by every save) is adopted with a warning, so the dead agent's moved processes go
    back where they came from. Before, the file was set aside and nothing else read: every process
    went to the hierarchy's root and every original value was lost. Groups the copy does not list
    are still found and removed."""
    from agent import cgroupfs
    from agent.model import JobAllocation
    from tests.fakes import cgroup_job, fake_sys

    class Sink:
        def send_directive(self, *a):
            return True

    proc = fake_proc(tmp_path, [101, 102, 103])
    (tmp_path / "proc" / "self" / "cgroup").write_text("0::/\n")
    sys_root = fake_sys(tmp_path, {"sda": "[none]"})
    kernel = FakeV2Kernel(str(tmp_path / "cg"), proc)
    kernel.mkdir("user.slice")
    kernel.mkdir("user.slice/job.scope")
    for pid in (101, 102, 103):
        kernel.move("user.slice/job.scope", pid)
    monkeypatch.setattr(cgroupfs, "open_hierarchies", lambda *a, **k: {"": kernel})
    state = tmp_path / "st"

    def agent(problems):
        return build("v2", sink=Sink(), cgroup_root=str(tmp_path / "cg"), state_dir=str(state), io=False,
                     sys_root=sys_root, proc_root=proc, problems=problems)[1]

    act = agent([])
    assert act.apply(cgroup_job("a", [101, 102]), JobAllocation(job="a", workers=2, cpus=1.0)).ok
    assert act.apply(cgroup_job("b", [103]), JobAllocation(job="b", workers=1, cpus=1.0)).ok
    orig = state / "cgroup-originals.json"
    assert (state / "cgroup-originals.json.prev").exists()
    data = orig.read_bytes()                       # the agent dies; its journal loses its tail
    orig.write_bytes(data[: len(data) // 2])
    problems: list = []
    again = agent(problems)
    assert any("not valid JSON" in p and "cgroup-originals.json.prev was adopted" in p for p in problems), problems
    assert any(n.startswith("cgroup-originals.json.bad-") for n in os.listdir(state))
    assert {"|adloader", "|adloader/a"} <= set(again.originals.created)
    assert again.held_jobs() >= {"a"}
    again.restore()
    assert not kernel.exists("adloader")                                  # every group removed
    for pid in (101, 102):                                                # back where they came from
        assert cgroupfs.proc_cgroups(pid, proc)[""] == "/user.slice/job.scope"
    assert cgroupfs.proc_cgroups(103, proc)[""] in ("/user.slice/job.scope", "/")


@pytest.mark.component
def test_a_previous_copy_that_is_unusable_too_is_set_aside_and_the_groups_still_removed(tmp_path):
    from agent.actuators import _recover_originals
    from agent.statefile import StateFileError

    orig = tmp_path / "cgroup-originals.json"
    orig.write_text('{"version": 1, "files": {}, "created": [')
    (tmp_path / "cgroup-originals.json.prev").write_text('{"version": 1, "created": 7}')
    problems: list = []
    o = _recover_originals(str(orig), StateFileError("bad"), problems)
    assert o.empty() and o.path == str(orig)
    assert len(problems) == 1 and "previous copy is unusable too" in problems[0] and "created must be" in problems[0]
    names = os.listdir(tmp_path)
    assert sum(n.startswith("cgroup-originals.json.bad-") for n in names) + \
        sum(n.startswith("cgroup-originals.json.prev.bad-") for n in names) == 2, names


@pytest.mark.component
def test_a_claimed_subtree_refuses_a_second_claim_naming_both_until_it_is_let_go(tmp_path):
    """``build(lock_dir=...)``: the cgroup actuator claims its subtree; a second build on the same subtree
    (another state_dir) raises SubtreeInUse naming the subtree, the holder's pid and state_dir and its
    own; a build on another subtree does not; restore lets go (and removes the lock file)."""
    from agent.actuators.cgroup import SubtreeInUse

    class Sink:
        def send_directive(self, *a):
            return True

    proc = fake_proc(tmp_path, [])
    FakeV2Kernel(str(tmp_path / "cg"), proc)
    run = tmp_path / "run"

    def agent(state, subtree="adloader"):
        return build("v2", sink=Sink(), cgroup_root=str(tmp_path / "cg"), state_dir=str(tmp_path / state),
                     subtree=subtree, sys_root=str(tmp_path), proc_root=proc, lock_dir=str(run))[1]

    first = agent("a")
    with pytest.raises(SubtreeInUse) as e:
        agent("b")
    msg = str(e.value)
    assert str(tmp_path / "cg" / "adloader") in msg and f"pid {os.getpid()}" in msg, msg
    assert f"state_dir {str(tmp_path / 'a')!r}" in msg and f"this agent's state_dir is {str(tmp_path / 'b')!r}" in msg
    other = agent("c", subtree="adloader2")
    assert len(os.listdir(run)) == 2
    first.restore()
    second = agent("b")
    second.restore()
    other.restore()
    assert os.listdir(run) == []       # the lock files removed on release
