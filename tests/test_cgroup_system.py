"""System tier: the cgroup v1 actuator against this machine's real hierarchies (root only).

Groups live only under ``adloader-test-<pid>`` and are removed after every test, whatever happens.
Busy-loop processes are real; CPU used is measured with psutil (per-process cpu_times).
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time

import psutil
import pytest

from agent import cgroupfs
from agent.actuators import build
from agent.actuators.cgroup import subtree_shares_for_cores
from agent.model import JobAllocation
from tests.cgroup_support import CPU, CPUSET, ROOT, SUBTREE, skip_reason, wipe
from tests.fakes import cgroup_job

pytestmark = [pytest.mark.system]
if skip_reason():
    print(f"skipping cgroup system tests: {skip_reason()}", file=sys.stderr)
    pytestmark.append(pytest.mark.skip(reason=skip_reason()))


@pytest.fixture
def clean():
    wipe()
    procs: list[subprocess.Popen] = []
    yield procs
    for p in procs:
        p.kill()
        p.wait(timeout=10)
    wipe()


def busy(procs, cpu: int | None = None, own_session: bool = False) -> int:
    """A busy loop; ``own_session``: in a new session, hence (with sched autogroup) its own autogroup."""
    p = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=own_session)
    procs.append(p)
    if cpu is not None:
        os.sched_setaffinity(p.pid, {cpu})
    return p.pid


def stats(job: str, worker_pids, **kw):
    """A job whose training process is this test process (never moved) and whose workers are ``worker_pids``."""
    return cgroup_job(job, worker_pids, pids=(os.getpid(),), **kw)


def cpu_s(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def cores_used(pids, seconds: float = 3.0) -> list[float]:
    t0, c0 = time.monotonic(), [cpu_s(p) for p in pids]
    time.sleep(seconds)     # measuring a rate over a fixed window, not waiting for a condition
    dt = time.monotonic() - t0
    return [(cpu_s(p) - c) / dt for p, c in zip(pids, c0)]


def cgroup_of(pid: int, ctrl: str) -> str:
    return cgroupfs.proc_cgroups(pid)[ctrl]


def cgroup_actuator(tmp_path, knob="shares"):
    acts = build("v1", sink=None, cgroup_root=ROOT, cpu_knob=knob, subtree=SUBTREE, state_dir=str(tmp_path))
    return acts[1]


def test_quota_holds_a_busy_loop(clean, tmp_path):
    pid = busy(clean)
    act = cgroup_actuator(tmp_path, "quota")
    r = act.apply(stats("q1", [pid]), JobAllocation(job="q1", workers=1, cpus=0.5))
    assert r.ok, r.error
    assert cgroup_of(pid, "cpu") == f"/{SUBTREE}/q1"
    with open(os.path.join(CPU, SUBTREE, "q1", "cpu.cfs_quota_us")) as f:
        assert int(f.read()) == 50000
    (used,) = cores_used([pid])
    print(f"busy loop under a 0.5-core quota used {used:.3f} cores")
    assert 0.02 < used <= 0.55
    assert os.getpid() not in set(act.h["cpu"].procs(f"{SUBTREE}/q1"))   # the training process stays out
    act.restore()
    assert cgroup_of(pid, "cpu") == "/"
    assert not os.path.exists(os.path.join(CPU, SUBTREE))


def _quota_us(rel: str) -> int:
    with open(os.path.join(CPU, rel, "cpu.cfs_quota_us")) as f:
        return int(f.read())


def test_quota_knob_subtree_cap_never_falls_below_a_jobs_quota(clean, tmp_path):
    """v1 refuses a parent's quota below a child's (EINVAL). The subtree's cap (the node less the
    trainers' pace, 2 - 0.17 = 1.83, floored to 0.05-core steps: 1.80) fell below the job's planned 1.83
    cores, so the apply failed on every tick."""
    from agent.model import NodeAllocation

    pid = busy(clean)
    act = cgroup_actuator(tmp_path, "quota")
    act.node_cpus = 2.0
    act.apply_node(NodeAllocation(False, {"q1": (1.0, 0.17)}))
    r = act.apply(stats("q1", [pid]), JobAllocation(job="q1", workers=1, cpus=1.83))
    assert r.ok, r.error
    assert _quota_us(f"{SUBTREE}/q1") == 183000 and _quota_us(SUBTREE) == 183000
    act.restore()
    assert not os.path.exists(os.path.join(CPU, SUBTREE))


def test_quota_knob_a_job_grows_past_the_subtree_cap(clean, tmp_path):
    """The controller applies the jobs before the node allocation: a job's quota raised above the
    subtree's cap of the last tick was written first and refused (EINVAL, v1 wants a child's quota within
    its parent's); the cap must be raised before the job's quota."""
    from agent.model import NodeAllocation

    pid = busy(clean)
    act = cgroup_actuator(tmp_path, "quota")
    act.node_cpus = 2.0
    assert act.apply(stats("q1", [pid]), JobAllocation(job="q1", workers=1, cpus=1.0)).ok
    act.apply_node(NodeAllocation(False, {"q1": (1.0, 1.0)}))           # a CPU-starved trainer: cap 1.0
    assert _quota_us(SUBTREE) == 100000
    r = act.apply(stats("q1", [pid]), JobAllocation(job="q1", workers=1, cpus=1.5))
    assert r.ok, r.error
    assert _quota_us(f"{SUBTREE}/q1") == 150000 and _quota_us(SUBTREE) == 150000
    r = act.apply(stats("q1", [pid]), JobAllocation(job="q1", workers=1, cpus=0.5))    # and back down
    assert r.ok, r.error
    assert _quota_us(f"{SUBTREE}/q1") == 50000 and _quota_us(SUBTREE) == 100000
    act.restore()
    assert not os.path.exists(os.path.join(CPU, SUBTREE))


def test_shares_split_a_contended_cpu(clean, tmp_path):
    cpu = max(os.sched_getaffinity(0))
    a, b = busy(clean, cpu), busy(clean, cpu)
    act = cgroup_actuator(tmp_path, "shares")
    assert act.apply(stats("s1", [a]), JobAllocation(job="s1", workers=1, cpus=0.25)).ok
    assert act.apply(stats("s3", [b]), JobAllocation(job="s3", workers=1, cpus=0.75)).ok
    with open(os.path.join(CPU, SUBTREE, "s1", "cpu.shares")) as f:
        assert int(f.read()) == 256
    with open(os.path.join(CPU, SUBTREE, "cpu.shares")) as f:
        assert int(f.read()) == 2048          # the subtree weighs what its 2 workers would unmanaged
    ua, ub = cores_used([a, b])
    print(f"shares 1:3 on one CPU: {ua:.3f} vs {ub:.3f} cores, ratio {ub / max(ua, 1e-9):.2f}")
    assert 2.0 <= ub / max(ua, 1e-9) <= 4.5
    act.restore()


def test_a_plan_cpu_weight_sets_the_group_shares_and_the_subtree_counts_planned_cores(clean, tmp_path):
    """``JobAllocation.cpu_weight`` (a job planned all it can use weighs more) is what the job's group
    weighs; the subtree's weight where trainers need CPU still counts the planned cores."""
    a, b = busy(clean), busy(clean)
    act = cgroup_actuator(tmp_path, "shares")
    trainer = dict(trainer_cpu_s_per_step=0.03, compute_s_per_step=0.1)
    assert act.apply(stats("w1", [a], **trainer), JobAllocation(job="w1", workers=1, cpus=0.25, cpu_weight=0.9)).ok
    assert act.apply(stats("w2", [b], **trainer), JobAllocation(job="w2", workers=1, cpus=1.5)).ok
    read = lambda rel: int(open(os.path.join(CPU, rel, "cpu.shares")).read())
    assert read(f"{SUBTREE}/w1") == 922 and read(f"{SUBTREE}/w2") == 1536
    assert read(SUBTREE) == subtree_shares_for_cores(1.75)          # 0.25 + 1.5 planned, not 0.9 + 1.5
    act.restore()


def test_cpuset_written_before_join_and_new_worker_pids_follow(clean, tmp_path):
    cpus = sorted(os.sched_getaffinity(0))
    pid = busy(clean)
    act = cgroup_actuator(tmp_path, "cpuset")
    job = stats("p1", [pid])
    r = act.apply(job, JobAllocation(job="p1", workers=1, cpus=1.0, cpuset=(cpus[-1],)))
    assert r.ok, r.error
    assert cgroup_of(pid, "cpuset") == f"/{SUBTREE}/p1"
    assert os.sched_getaffinity(pid) == {cpus[-1]}
    # the loader resized: a new worker appears; the next apply moves it in too
    pid2 = busy(clean)
    r = act.apply(stats("p1", [pid, pid2]), JobAllocation(job="p1", workers=2, cpus=1.0, cpuset=(cpus[-1],)))
    assert r.ok, r.error
    assert cgroup_of(pid2, "cpuset") == f"/{SUBTREE}/p1" and cgroup_of(pid2, "cpu") == f"/{SUBTREE}/p1"
    act.release("p1")
    assert cgroup_of(pid, "cpuset") == "/" and cgroup_of(pid2, "cpu") == "/"
    assert not os.path.exists(os.path.join(CPUSET, SUBTREE, "p1"))
    act.restore()


def test_cleanup_leaves_no_group_and_a_gone_pid_is_not_an_error(clean, tmp_path):
    pid, gone = busy(clean), busy(clean)
    clean[-1].kill()
    clean[-1].wait(timeout=10)
    act = cgroup_actuator(tmp_path)
    r = act.apply(stats("c1", [pid, gone]), JobAllocation(job="c1", workers=2, cpus=1.0))
    assert r.ok, r.error
    act.release("c1")
    act.restore()
    for ctrl in ("cpu", "cpuset", "blkio"):
        assert not os.path.exists(os.path.join(cgroupfs.v1_mount(ROOT, ctrl), SUBTREE)), ctrl
    assert cgroup_of(pid, "cpu") == "/"
    assert not os.path.exists(tmp_path / "cgroup-originals.json")


def test_the_originals_keep_only_the_workers_still_listed_or_still_in_the_group(clean, tmp_path):
    """Every worker a job ever had kept its origin in cgroup-originals.json until the job left: a job
    resized again and again grew the file, rewritten whole at every move (found by applying thirty
    short-lived workers in turn and counting the entries). A worker the job no longer lists goes once it
    is out of the group; one still in it keeps its origin, and is put back where it came from."""
    import json

    act = cgroup_actuator(tmp_path)
    retired = subprocess.Popen(["sleep", "60"])
    clean.append(retired)
    assert act.apply(stats("o1", [retired.pid]), JobAllocation(job="o1", workers=1, cpus=1.0)).ok
    for _ in range(20):                                 # short-lived workers, each listed at one apply
        p = subprocess.Popen(["sleep", "60"])
        assert act.apply(stats("o1", [p.pid]), JobAllocation(job="o1", workers=1, cpus=1.0)).ok
        p.kill()
        p.wait()
    with open(tmp_path / "cgroup-originals.json") as f:
        pids = json.load(f)["pids"]
    # the last one (listed at the last apply) and the retired one, still in the group, alive
    assert sorted(pids) == sorted([str(p.pid), str(retired.pid)]), pids
    assert cgroup_of(retired.pid, "cpu") == f"/{SUBTREE}/o1"
    act.release("o1")
    assert cgroup_of(retired.pid, "cpu") == "/"
    act.restore()


def _zombie() -> int:
    """A child that has exited and is not reaped: state Z until ``os.waitpid``."""
    from agent.psi import pid_stat

    pid = os.fork()
    if pid == 0:
        os._exit(0)
    deadline = time.monotonic() + 10
    while (pid_stat(pid) or [b"?"])[0] != b"Z":
        assert time.monotonic() < deadline, "the child never became a zombie"
        time.sleep(0.01)
    return pid


def test_a_zombie_worker_is_neither_moved_nor_counted(clean, tmp_path):
    """v1 accepts a zombie's pid in cgroup.procs and does nothing; it was counted as a worker, so the
    subtree weighed 2048 (two workers) with one live one."""
    pid = busy(clean)
    zombie = _zombie()
    try:
        act = cgroup_actuator(tmp_path)
        r = act.apply(stats("z1", [pid, zombie]), JobAllocation(job="z1", workers=2, cpus=1.0))
        assert r.ok, r.error
        with open(os.path.join(CPU, SUBTREE, "cpu.shares")) as f:
            assert int(f.read()) == 1024            # one live worker
        assert str(zombie) not in act.originals.pids
        assert cgroup_of(pid, "cpu") == f"/{SUBTREE}/z1"
        act.restore()
        assert not os.path.exists(os.path.join(CPU, SUBTREE))
    finally:
        os.waitpid(zombie, 0)


def test_restart_from_journal_restores_originals(clean, tmp_path):
    # a subtree that existed before the agent, with a value of its own the agent will overwrite
    base = os.path.join(CPU, SUBTREE)
    os.mkdir(base)
    with open(os.path.join(base, "cpu.shares"), "w") as f:
        f.write("777")
    pid = busy(clean)
    first = cgroup_actuator(tmp_path)
    assert first.apply(stats("r1", [pid]), JobAllocation(job="r1", workers=1, cpus=2.0)).ok
    with open(os.path.join(base, "cpu.shares")) as f:
        assert int(f.read()) == 1024            # one worker
    assert cgroup_of(pid, "cpu") == f"/{SUBTREE}/r1"
    del first                                   # the agent dies without restoring
    second = cgroup_actuator(tmp_path)          # a new one, from the journal of originals
    second.restore()
    with open(os.path.join(base, "cpu.shares")) as f:
        assert int(f.read()) == 777
    assert cgroup_of(pid, "cpu") == "/"
    assert not os.path.exists(os.path.join(base, "r1"))
    assert os.path.isdir(base)                  # not ours to remove


def _die_after_mkdir(tmp_path, rel: str, job: str, worker: int, ctrl: str = "cpu", knob: str = "shares",
                     cpuset=None) -> None:
    """An agent (a forked child) applying ``job`` is SIGKILLed right after its ``ctrl`` mkdir of ``rel``."""
    import signal

    child = os.fork()
    if child == 0:
        try:
            real = cgroupfs.V1Hierarchy.mkdir

            def mkdir(self, path):
                made = real(self, path)
                if self.controller == ctrl and path == rel:
                    os.kill(os.getpid(), signal.SIGKILL)
                return made

            cgroupfs.V1Hierarchy.mkdir = mkdir
            cgroup_actuator(tmp_path, knob).apply(stats(job, [worker]),
                                                  JobAllocation(job=job, workers=1, cpus=1.0, cpuset=cpuset))
        finally:
            os._exit(1)
    _, status = os.waitpid(child, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status


@pytest.mark.parametrize("killed_after", ["subtree", "job group"])
def test_an_agent_killed_between_a_mkdir_and_its_journal_leaves_no_group(clean, tmp_path, killed_after):
    """The group was made first and journaled after: a SIGKILL between the two left a group no journal
    listed. The restarted agent found it existing, took it as not its own, and on stop neither removed it
    nor moved the worker out of it (the subtree's rmdir failed EBUSY, the worker stayed in the job's
    group); a bare subtree was left behind. Now the journal lists a group before it is made."""
    pid = busy(clean)
    _die_after_mkdir(tmp_path, SUBTREE if killed_after == "subtree" else f"{SUBTREE}/d1", "d1", pid)
    assert os.path.isdir(os.path.join(CPU, SUBTREE))
    second = cgroup_actuator(tmp_path)               # restarted: the job is still alive, applied again
    r = second.apply(stats("d1", [pid]), JobAllocation(job="d1", workers=1, cpus=1.0))
    assert r.ok, r.error
    assert cgroup_of(pid, "cpu") == f"/{SUBTREE}/d1"
    second.restore()
    assert cgroup_of(pid, "cpu") == "/"
    assert not os.path.exists(os.path.join(CPU, SUBTREE))
    assert not os.path.exists(tmp_path / "cgroup-originals.json")


@pytest.mark.parametrize("killed_after", ["subtree", "job group"])
def test_a_cpuset_group_left_empty_by_a_killed_agent_is_filled_on_restart(clean, tmp_path, killed_after):
    """An agent SIGKILLed between a cpuset group's mkdir and the writes of its cpuset.cpus and
    cpuset.mems left them empty; the restarted agent found the group existing and skipped it, so every
    cpuset job failed for ever (the kernel refuses a child's CPUs outside an empty parent's: "Permission
    denied", or a task joining an empty group: ENOSPC)."""
    pid = busy(clean)
    cpu = max(os.sched_getaffinity(0))
    rel = SUBTREE if killed_after == "subtree" else f"{SUBTREE}/e1"
    _die_after_mkdir(tmp_path, rel, "e1", pid, ctrl="cpuset", knob="cpuset", cpuset=(cpu,))
    with open(os.path.join(CPUSET, rel, "cpuset.mems")) as f:
        assert f.read().strip() == ""               # what the dead agent left
    second = cgroup_actuator(tmp_path, "cpuset")
    r = second.apply(stats("e1", [pid]), JobAllocation(job="e1", workers=1, cpus=1.0, cpuset=(cpu,)))
    assert r.ok, r.error
    assert cgroup_of(pid, "cpuset") == f"/{SUBTREE}/e1"
    assert os.sched_getaffinity(pid) == {cpu}
    second.restore()
    assert cgroup_of(pid, "cpuset") == "/"
    assert not os.path.exists(os.path.join(CPUSET, SUBTREE))


def test_a_journaled_group_that_is_gone_is_forgotten(clean, tmp_path):
    """A group listed but not there (someone removed it, or a SIGKILL came between the journal and the
    mkdir) stayed in the journal for ever: nothing to remove, so it was never struck off."""
    pid = busy(clean)
    act = cgroup_actuator(tmp_path)
    assert act.apply(stats("g1", [pid]), JobAllocation(job="g1", workers=1, cpus=1.0)).ok
    with open(os.path.join(CPU, "cgroup.procs"), "w") as f:     # someone else empties and removes it
        f.write(str(pid))
    os.rmdir(os.path.join(CPU, SUBTREE, "g1"))
    act.release("g1")
    act.restore()
    assert not os.path.exists(os.path.join(CPU, SUBTREE))
    assert not os.path.exists(tmp_path / "cgroup-originals.json")


def test_restore_while_yielding_puts_back_a_pre_existing_subtree_shares(clean, tmp_path):
    """A subtree there before the agent (cpu.shares 777) and an agent stopped while its loaders yield:
    the real kernel refuses cpu.shares for an idle group (EINVAL) and resets it to 1024 when idle
    ends, so cpu.idle must be put back before cpu.shares."""
    from agent.model import NodeAllocation

    base = os.path.join(CPU, SUBTREE)
    os.mkdir(base)
    if not os.path.exists(os.path.join(base, "cpu.idle")):
        pytest.skip("this kernel has no cpu.idle (5.15+)")
    with open(os.path.join(base, "cpu.shares"), "w") as f:
        f.write("777")
    pid = busy(clean)
    act = cgroup_actuator(tmp_path, "shares")
    assert act.apply(stats("y1", [pid]), JobAllocation(job="y1", workers=1, cpus=1.0)).ok
    assert act.apply_node(NodeAllocation(True, {"y1": (0.4, 0.4)})) == []
    with open(os.path.join(base, "cpu.idle")) as f:
        assert f.read().strip() == "1"
    act.restore()
    with open(os.path.join(base, "cpu.idle")) as f:
        assert f.read().strip() == "0"
    with open(os.path.join(base, "cpu.shares")) as f:
        assert int(f.read()) == 777
    assert cgroup_of(pid, "cpu") == "/"


def test_a_restarted_agent_lifts_the_subtree_cap_a_dead_one_left(clean, tmp_path):
    """The dead agent capped the subtree (cpu.cfs_quota_us) for trainers that needed CPU; the new
    agent's plan has no cap, so it must write -1 rather than leave the loaders capped."""
    a, b = busy(clean), busy(clean)
    quota_file = os.path.join(CPU, SUBTREE, "cpu.cfs_quota_us")
    first = cgroup_actuator(tmp_path)
    first.node_cpus = 2.0
    trainer = dict(trainer_cpu_s_per_step=0.03, compute_s_per_step=0.1)
    assert first.apply(stats("k1", [a], **trainer), JobAllocation(job="k1", workers=1, cpus=1.0)).ok
    with open(quota_file) as f:
        assert int(f.read()) == 170000                 # 2 CPUs less the trainer's 0.3 cores
    del first                                          # the agent dies without restoring
    second = cgroup_actuator(tmp_path)
    assert second.apply(stats("k2", [b]), JobAllocation(job="k2", workers=1, cpus=1.0)).ok
    with open(quota_file) as f:
        assert int(f.read()) == -1
    second.restore()
    assert not os.path.exists(os.path.join(CPU, SUBTREE))


@pytest.mark.parametrize("journal", ["kept", "corrupt"])
def test_a_restarted_agent_never_caps_the_subtree_below_an_adopted_jobs_quota(clean, tmp_path, journal):
    """The dead agent left job k1 at a 1.5-core quota. The new one applies k2 first, whose trainer needs
    a core of the 2: the subtree's cap (the node less the trainer, never below the planned cores) left
    out the adopted k1, whose planned cores it did not know, and v1 refused the 1.0-core cap below
    k1's quota (EINVAL) until k1 was applied. Its quota is read back as its planned cores. Also with
    the journal lost, the groups taken as orphans, and the subtree with them (it was left behind, with
    its cap)."""
    a, b = busy(clean), busy(clean)
    first = cgroup_actuator(tmp_path, "quota")
    first.node_cpus = 2.0
    assert first.apply(stats("k1", [a]), JobAllocation(job="k1", workers=1, cpus=1.5)).ok
    assert _quota_us(f"{SUBTREE}/k1") == 150000 and _quota_us(SUBTREE) == -1
    del first                                          # the agent dies without restoring
    if journal == "corrupt":
        (tmp_path / "cgroup-originals.json").write_text("{not json")
    second = cgroup_actuator(tmp_path, "quota")
    second.node_cpus = 2.0
    trainer = dict(trainer_cpu_s_per_step=0.1, compute_s_per_step=0.1)       # needs 1 core, uses it all
    r = second.apply(stats("k2", [b], **trainer), JobAllocation(job="k2", workers=1, cpus=0.3))
    assert r.ok, r.error
    assert _quota_us(SUBTREE) == 180000                # 1.5 + 0.3 planned: above the node less the trainer
    assert second.apply(stats("k1", [a]), JobAllocation(job="k1", workers=1, cpus=0.5)).ok
    assert _quota_us(f"{SUBTREE}/k1") == 50000 and _quota_us(SUBTREE) == 100000
    second.restore()
    assert not os.path.exists(os.path.join(CPU, SUBTREE))


def test_a_group_not_ours_named_with_undecodable_bytes_is_left_alone(clean, tmp_path):
    """A real group named b'\\xff' (not UTF-8) made by someone else in the subtree, the journal lost:
    restore raised UnicodeEncodeError from cgroupspy on its name. It is left alone; ours are restored
    and the subtree, which it keeps, loses the dead agent's cap."""
    pid = busy(clean)
    trainer = dict(trainer_cpu_s_per_step=0.03, compute_s_per_step=0.1)
    first = cgroup_actuator(tmp_path)
    first.node_cpus = 2.0
    assert first.apply(stats("u1", [pid], **trainer), JobAllocation(job="u1", workers=1, cpus=1.0)).ok
    assert _quota_us(SUBTREE) == 170000
    theirs = os.fsencode(os.path.join(CPU, SUBTREE)) + b"/\xff"
    os.mkdir(theirs)
    del first                                          # the agent dies without restoring
    (tmp_path / "cgroup-originals.json").write_text("{not json")
    second = cgroup_actuator(tmp_path)
    second.node_cpus = 2.0
    assert second.apply(stats("u1", [pid], **trainer), JobAllocation(job="u1", workers=1, cpus=1.0)).ok
    assert _quota_us(SUBTREE) == 170000                # (a tick: the cap still wanted)
    with pytest.raises(cgroupfs.CgroupError, match=f"restore incomplete: rmdir .*/{SUBTREE}: Device or resource busy$"):
        second.restore()
    assert os.path.isdir(theirs) and cgroup_of(pid, "cpu") == "/"
    assert not os.path.exists(os.path.join(CPU, SUBTREE, "u1"))
    assert _quota_us(SUBTREE) == -1


def test_subtree_weighs_what_its_workers_would_unmanaged(clean, tmp_path):
    """Two jobs' workers in our subtree and two unmanaged busy processes, all on one CPU: moving the
    workers into our groups must not shrink what they get together against the rest of the node."""
    cpu = max(os.sched_getaffinity(0))
    # Unmanaged tasks in the root cpu group weigh 1024 each, except that with sched autogroup
    # (/proc/sys/kernel/sched_autogroup_enabled, on by default in many kernels) the root group's tasks
    # of one session share one autogroup of weight 1024: each unmanaged loop gets a session of its own,
    # as tasks of different jobs (or daemons) have.
    m1, m2 = busy(clean, cpu), busy(clean, cpu)
    u1, u2 = busy(clean, cpu, own_session=True), busy(clean, cpu, own_session=True)
    act = cgroup_actuator(tmp_path, "shares")
    # the policy gives 1 core in all (0.5 each): the job groups weigh 512 each, the loaders 2 workers
    assert act.apply(stats("w1", [m1]), JobAllocation(job="w1", workers=1, cpus=0.5)).ok
    assert act.apply(stats("w2", [m2]), JobAllocation(job="w2", workers=1, cpus=0.5)).ok
    with open(os.path.join(CPU, SUBTREE, "cpu.shares")) as f:
        subtree_shares = int(f.read())
    used = cores_used([m1, m2, u1, u2])
    share = [u / max(sum(used), 1e-9) for u in used]
    print(f"subtree cpu.shares {subtree_shares}; share of the one CPU among the 4 busy loops: managed "
          f"{share[0]:.3f} {share[1]:.3f}, unmanaged {share[2]:.3f} {share[3]:.3f} (cores {sum(used):.3f})")
    assert subtree_shares == 2048                      # 2 loader workers, as 2 tasks in the root weigh
    assert all(0.19 <= s <= 0.31 for s in share), share
    act.release("w1")                                  # one worker left in the subtree
    with open(os.path.join(CPU, SUBTREE, "cpu.shares")) as f:
        assert int(f.read()) == 1024
    act.restore()
    with open(os.path.join(CPU, "cgroup.procs")) as f:
        root_procs = set(int(p) for p in f.read().split())
    assert {m1, m2} <= root_procs
    assert not os.path.exists(os.path.join(CPU, SUBTREE))


def test_yielding_loaders_give_way_to_every_other_task(clean, tmp_path):
    """Two loader workers and an unmanaged busy process (a training process that never sleeps, in a
    session of its own) on one CPU. Weighted, the subtree weighs its one planned core against the
    process's one task: the workers get about half the CPU. Yielding (cpu.idle = 1 on the real
    subtree), they run only when nothing else wants the CPU: a few percent of it. Ratios on one CPU, so
    other work on the machine does not change the verdict."""
    from agent.model import NodeAllocation

    cpu = max(os.sched_getaffinity(0))
    w1, w2 = busy(clean, cpu), busy(clean, cpu)
    trainer = busy(clean, cpu, own_session=True)
    act = cgroup_actuator(tmp_path, "shares")
    trainers = {"y1": (0.4, 0.4)}
    assert act.apply(stats("y1", [w1, w2], trainer_cpu_s_per_step=0.02, compute_s_per_step=0.05),
                     JobAllocation(job="y1", workers=2, cpus=1.0)).ok
    idle_file = os.path.join(CPU, SUBTREE, "cpu.idle")
    if not os.path.exists(idle_file):
        pytest.skip("this kernel has no cpu.idle (5.15+)")

    def workers_share() -> float:
        used = cores_used([w1, w2, trainer], seconds=2.0)
        return (used[0] + used[1]) / max(sum(used), 1e-9)

    assert act.apply_node(NodeAllocation(False, trainers)) == []
    with open(idle_file) as f:
        assert f.read().strip() == "0"
    weighted = workers_share()
    assert act.apply_node(NodeAllocation(True, trainers)) == []
    with open(idle_file) as f:
        assert f.read().strip() == "1"
    with open(os.path.join(CPU, SUBTREE, "cpu.cfs_quota_us")) as f:
        assert int(f.read()) == -1                        # yielding needs no cap
    yielding = workers_share()
    print(f"the loader workers' share of one CPU beside a busy training process: weighted {weighted:.3f}, "
          f"yielding {yielding:.3f}")
    assert 0.3 <= weighted <= 0.7, weighted
    assert yielding <= 0.1, yielding
    # the kernel refuses a weight for an idle group: a change of plan while yielding must still apply
    res = act.apply(stats("y1", [w1, w2], trainer_cpu_s_per_step=0.02, compute_s_per_step=0.05),
                    JobAllocation(job="y1", workers=2, cpus=1.5))
    assert res.ok, res.error
    assert act.apply_node(NodeAllocation(False, trainers)) == []
    with open(idle_file) as f:
        assert f.read().strip() == "0"
    with open(os.path.join(CPU, SUBTREE, "cpu.shares")) as f:
        assert int(f.read()) == subtree_shares_for_cores(1.5)   # written again: leaving idle resets it
    act.restore()
    assert not os.path.exists(os.path.join(CPU, SUBTREE))


def test_where_other_processes_stop_the_yield_the_subtree_may_weigh_its_workers(clean, tmp_path):
    """``foreign_weight = "workers"`` (``NodeAllocation.weigh_workers``): the subtree, not yielding
    because other processes use the node, weighs one task per worker, as those workers would
    unmanaged, instead of one per planned core; the cap at the node less the trainers' use stays. Back
    to the planned cores when the plan no longer says so."""
    from agent.model import NodeAllocation

    w1, w2, w3 = busy(clean), busy(clean), busy(clean)
    act = cgroup_actuator(tmp_path, "shares")
    trainers = {"f1": (0.4, 0.4)}
    assert act.apply(stats("f1", [w1, w2, w3], trainer_cpu_s_per_step=0.02, compute_s_per_step=0.05),
                     JobAllocation(job="f1", workers=3, cpus=1.2)).ok
    shares = lambda: int(open(os.path.join(CPU, SUBTREE, "cpu.shares")).read())
    quota = lambda: _quota_us(SUBTREE)
    assert act.apply_node(NodeAllocation(False, trainers)) == []
    assert shares() == subtree_shares_for_cores(1.2)
    capped = quota()
    assert act.apply_node(NodeAllocation(False, trainers, weigh_workers=True)) == []
    assert shares() == 3 * 1024                          # its three workers, as unmanaged
    assert quota() == capped                             # the trainers' cores still kept
    assert act.apply_node(NodeAllocation(False, trainers)) == []
    assert shares() == subtree_shares_for_cores(1.2)
    act.restore()
    assert not os.path.exists(os.path.join(CPU, SUBTREE))


def test_static_cores_puts_a_job_under_a_hard_quota_and_cleans_up(tmp_path):
    import subprocess
    from pathlib import Path

    from evaluation.catalog import JobSpec
    from evaluation.harness import BenchError, StaticCores
    from tests.conftest import wait_for

    if os.geteuid() != 0 or not Path(CPU, "cpu.cfs_quota_us").exists():
        with pytest.raises(BenchError, match="static-cores needs root and a cgroup v1 cpu hierarchy at .* or cgroup v2"):
            StaticCores(2, 4)
        pytest.skip("needs root and cgroup v1 cpu to place a process (the refusal was checked)")
    spec = JobSpec(job_id="adl-test-static", kind="x", batch_size=8, step_s=0.1, demand_cores=1.0,
                   cpu_s_per_sample=0.001, workload={}, gpus=2)
    # 2 cores for 16 GPUs: quotas small enough (an eighth of a core for one GPU) that a busy loop reaches
    # its quota even when other work on the machine leaves it only part of a core
    st = StaticCores(node_cores=2, node_gpus=16)
    p = subprocess.Popen(["sleep", "30"])
    busy_spec = dataclasses.replace(spec, job_id="adl-test-static-busy", gpus=1)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        assert st.place(spec, p.pid) == pytest.approx(0.25)         # 2 cores x 2 of 16 GPUs
        group = st.base / spec.job_id
        assert (group / "cpu.cfs_quota_us").read_text().strip() == "25000"
        assert str(p.pid) in (group / "cgroup.procs").read_text().split()
        # a busy thread under an eighth of a core's quota is throttled in its periods; a sleeper never is
        assert st.place(busy_spec, busy.pid) == pytest.approx(0.125)
        t0 = st.throttling()
        b0 = t0[busy_spec.job_id]

        def throttled_in_most_periods():
            b1 = st.throttling()[busy_spec.job_id]
            periods = b1["periods"] - b0["periods"]
            return (periods >= 3 and b1["throttled"] - b0["throttled"] >= 0.5 * periods
                    and b1["throttled_s"] > b0["throttled_s"])

        wait_for(throttled_in_most_periods, 30, what="the busy loop throttled in most of its periods")
        assert st.throttling()[spec.job_id]["throttled"] == 0
    finally:
        st.close()
        for q in (p, busy):
            q.kill()
            q.wait()
    assert not st.base.exists()


def test_static_cores_on_cgroup_v2_writes_cpu_max(tmp_path, monkeypatch):
    """cgroup v2 (no v1 cpu hierarchy; the unified root has the cpu controller): the job's group gets
    ``cpu.max``, and ``+cpu`` is enabled for the base's children and the root's. A directory stands in for
    the cgroup2 mount (this machine has cgroup v1; the device study ran it on a real v2 node)."""
    from evaluation.catalog import JobSpec
    from evaluation.harness import BenchError, StaticCores

    if os.geteuid() != 0:
        pytest.skip("StaticCores refuses non-root before it looks at the hierarchy")
    v2 = tmp_path / "unified"
    v2.mkdir()
    with pytest.raises(BenchError, match="cgroup v2 with the cpu controller"):
        StaticCores(2, 4, cgroup_root=str(v2))   # no cgroup.controllers
    (v2 / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (v2 / "cgroup.subtree_control").write_text("memory\n")
    st = StaticCores(node_cores=16, node_gpus=4, cgroup_root=str(v2))
    assert st.version == 2 and st.base.parent == v2
    assert (v2 / "cgroup.subtree_control").read_text() == "+cpu"
    assert (st.base / "cgroup.subtree_control").read_text() == "+cpu"
    spec = JobSpec(job_id="j2", kind="x", batch_size=8, step_s=0.1, demand_cores=1.0, cpu_s_per_sample=0.001,
                   workload={}, gpus=2)
    assert st.place(spec, 4242) == pytest.approx(8.0)          # 16 cores x 2 of 4 GPUs
    assert (st.base / "j2" / "cpu.max").read_text() == "800000 100000"
    assert (st.base / "j2" / "cgroup.procs").read_text() == "4242"
    assert not (st.base / "j2" / "cpu.cfs_quota_us").exists()
    (st.base / "j2" / "cpu.stat").write_text("usage_usec 9000\nnr_periods 40\nnr_throttled 10\nthrottled_usec 250000\n")
    assert st.throttling() == {"j2": {"periods": 40, "throttled": 10, "throttled_s": 0.25}}


def test_static_cores_finds_a_joined_cpu_cpuacct_hierarchy_from_mountinfo(tmp_path):
    """A host that mounts ``cpu,cpuacct`` with no ``cpu`` symlink: the bench looked only at
    /sys/fs/cgroup/cpu, so static-cores fell to v2 or refused. A directory with a mountinfo that lists
    it stands in for the mount (the quota files are plain files here)."""
    from evaluation.catalog import JobSpec
    from evaluation.harness import StaticCores
    from tests.fakes import fake_proc

    if os.geteuid() != 0:
        pytest.skip("StaticCores refuses non-root before it looks at the hierarchy")
    joined = tmp_path / "cg" / "cpu,cpuacct"
    joined.mkdir(parents=True)
    for name, value in {"cgroup.procs": "", "cpu.cfs_quota_us": "-1", "cpu.cfs_period_us": "100000"}.items():
        (joined / name).write_text(value)
    proc = fake_proc(tmp_path, [4242])
    (tmp_path / "proc" / "self" / "mountinfo").write_text(
        f"31 23 0:28 / {tmp_path}/cg rw,relatime - tmpfs tmpfs rw,mode=755\n"
        f"32 31 0:29 / {joined} rw,nosuid,nodev,noexec,relatime shared:7 - cgroup cgroup rw,cpu,cpuacct\n")
    st = StaticCores(node_cores=16, node_gpus=4, cgroup_root=str(tmp_path / "cg"), proc_root=proc)
    assert st.version == 1 and st.base.parent == joined
    spec = JobSpec(job_id="j1", kind="x", batch_size=8, step_s=0.1, demand_cores=1.0, cpu_s_per_sample=0.001,
                   workload={}, gpus=1)
    assert st.place(spec, 4242) == pytest.approx(4.0)          # 16 cores x 1 of 4 GPUs
    assert (st.base / "j1" / "cpu.cfs_quota_us").read_text() == "400000"
    assert (st.base / "j1" / "cgroup.procs").read_text() == "4242"


def test_a_worker_pid_another_process_took_is_not_moved_into_the_jobs_group(clean, tmp_path):
    """A worker that exits may leave its pid to another process, of any user, before the client's next
    report (about a second): the next apply moved that process into the job's group with the job's
    loaders. Here a real process stands for it, listed with a start time other than its own (the worker's,
    recorded when the registry took it), and one of uid 65534 with its own start time in a job of this
    uid: neither is moved, the worker is, and the apply succeeds."""
    from agent.security import pid_start_ticks, pid_uid
    from tests.conftest import wait_for

    worker, reused = (subprocess.Popen(["sleep", "60"]) for _ in range(2))
    stranger = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "sleep", "60"])
    clean.extend([worker, reused, stranger])
    wait_for(lambda: pid_uid(stranger.pid) == 65534, 10, what="the process as uid 65534")
    before = {p.pid: cgroup_of(p.pid, "cpu") for p in (reused, stranger)}
    act = cgroup_actuator(tmp_path)
    job = stats("r1", [worker.pid, reused.pid, stranger.pid], uid=os.getuid(),
                worker_starts={worker.pid: pid_start_ticks(worker.pid),
                               reused.pid: pid_start_ticks(reused.pid) - 1,
                               stranger.pid: pid_start_ticks(stranger.pid)})
    r = act.apply(job, JobAllocation(job="r1", workers=3, cpus=1.0))
    assert r.ok, r.error
    assert cgroup_of(worker.pid, "cpu") == f"/{SUBTREE}/r1"
    assert {p: cgroup_of(p, "cpu") for p in before} == before
    with open(os.path.join(CPU, SUBTREE, "r1", "cgroup.procs")) as f:
        assert [int(x) for x in f.read().split()] == [worker.pid]
    act.release("r1")
    act.restore()
    assert cgroup_of(worker.pid, "cpu") == "/"


def test_a_job_group_removed_from_cpuset_only_is_lost_and_made_again(clean, tmp_path):
    """An admin removes the job's cpuset group only (its cpu group stays): the actuator says the group
    is lost, and the apply the controller then makes puts it back, with its CPUs and the worker in it.
    Before, only the cpu group was checked: the worker ran on every CPU until its allocation changed."""
    cpus = sorted(os.sched_getaffinity(0))
    pid = subprocess.Popen(["sleep", "300"])
    clean.append(pid)
    act = cgroup_actuator(tmp_path, "cpuset")
    alloc = JobAllocation(job="p1", workers=1, cpus=1.0, cpuset=(cpus[-1],))
    assert act.apply(stats("p1", [pid.pid]), alloc).ok
    assert not act.lost_group("p1")
    with open(os.path.join(CPUSET, "cgroup.procs"), "w") as f:        # the admin: the task out, rmdir
        f.write(str(pid.pid))
    os.rmdir(os.path.join(CPUSET, SUBTREE, "p1"))
    assert os.path.isdir(os.path.join(CPU, SUBTREE, "p1"))
    assert act.lost_group("p1")                                         # old code: False
    assert act.apply(stats("p1", [pid.pid]), alloc).ok                  # what the controller does then
    assert not act.lost_group("p1")
    assert cgroup_of(pid.pid, "cpuset") == f"/{SUBTREE}/p1" and os.sched_getaffinity(pid.pid) == {cpus[-1]}
    act.restore()
    assert not os.path.exists(os.path.join(CPUSET, SUBTREE))


def test_a_subtree_removed_by_an_admin_is_made_again_with_its_weight(clean, tmp_path):
    """An admin empties and removes the agent's subtree (cgdelete, a systemd reset) while the agent runs:
    the actuator says the job's group is lost (the controller then applies the job again), and that
    apply makes the groups again, moves the workers back in and writes the subtree's weight again
    (a new group by its kernfs inode). Before, the weight it had written was cached: the new subtree
    kept the kernel's 1024 for two workers' 2048."""
    pids = []
    for _ in range(2):
        p = subprocess.Popen(["sleep", "300"])
        clean.append(p)
        pids.append(p.pid)
    act = cgroup_actuator(tmp_path)
    alloc = JobAllocation(job="gone", workers=2, cpus=0.5)
    assert act.apply(stats("gone", pids), alloc).ok
    subtree = os.path.join(CPU, SUBTREE)
    with open(os.path.join(subtree, "cpu.shares")) as f:
        assert f.read().strip() == "2048"
    assert not act.lost_group("gone")
    for pid in pids:                                             # the admin: tasks to the root, rmdir
        with open(os.path.join(CPU, "cgroup.procs"), "w") as f:
            f.write(str(pid))
    os.rmdir(os.path.join(subtree, "gone"))
    os.rmdir(subtree)
    assert act.lost_group("gone")
    assert act.apply(stats("gone", pids), alloc).ok              # what the controller does then
    assert not act.lost_group("gone")
    with open(os.path.join(subtree, "cpu.shares")) as f:
        assert f.read().strip() == "2048"
    assert {cgroup_of(p, "cpu") for p in pids} == {f"/{SUBTREE}/gone"}
    act.restore()
    assert not os.path.exists(subtree)
    assert {cgroup_of(p, "cpu") for p in pids} == {"/"}
