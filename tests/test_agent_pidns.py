"""Training processes in their own pid namespace (a container without hostPID): the agent maps the
pids they claim to host pids through NSpid (agent.security.host_pid / map_ns_pids) and accepts only
the caller itself and its own descendants.

Unit tier: fake /proc trees in tmp_path for the mapping; the registry against fake NSpid files whose
host pids are real processes of this test (the uid check reads the real ones). Component tier (root,
`unshare`): a real client in a real pid namespace against a real agent."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import psutil
import pytest

from agent import security
from agent.registry import Refused, Registry
from agent.security import Peer
from adloader import protocol
from tests.agentd_support import AgentProc, Trainer
from tests.conftest import wait_for


HOST_NS, BOX_NS = "pid:[4026531836]", "pid:[4026532001]"


def fake_proc(root, procs: dict[int, tuple[int, tuple[int, ...]]], ns: dict[int, str] | None = None) -> str:
    """A /proc tree: host pid -> (parent pid, NSpid fields). Only status, stat and the ns/pid link, as the
    kernel writes them; the namespace is ``ns[pid]``, else the host's for one NSpid field and one container's
    (BOX_NS) for more."""
    for pid, (ppid, nspid) in procs.items():
        d = root / str(pid)
        d.mkdir(parents=True, exist_ok=True)
        (d / "ns").mkdir(exist_ok=True)
        link = d / "ns" / "pid"
        if link.is_symlink():
            link.unlink()
        link.symlink_to((ns or {}).get(pid, HOST_NS if len(nspid) == 1 else BOX_NS))   # dangling, as readlink sees it
        (d / "status").write_text(f"Name:\tpy (x)\nState:\tS (sleeping)\nTgid:\t{pid}\nPid:\t{pid}\nPPid:\t{ppid}\n"
                                  f"NSpid:\t{chr(9).join(map(str, nspid))}\nUid:\t0\t0\t0\t0\n")
        (d / "stat").write_text(f"{pid} (py (x)) S {ppid} " + " ".join(["0"] * 18) + " 12345 0\n")
    (root / "self").mkdir(exist_ok=True)   # non-pid entries are skipped
    return str(root)


@pytest.mark.component
def test_host_pid_accepts_only_the_callers_own_namespace_pid(tmp_path):
    proc = fake_proc(tmp_path, {500: (1, (500, 1)), 600: (1, (600,))})
    assert security.host_pid(500, 500, proc) == 500          # the agent's namespace: itself
    assert security.host_pid(1, 500, proc) == 500            # its own namespace: itself, as the host knows it
    assert security.host_pid(2, 500, proc) is None           # someone else in its namespace
    assert security.host_pid(600, 500, proc) is None         # someone else on the host
    assert security.host_pid(1, 600, proc) is None           # not namespaced: no second field to match
    assert security.host_pid(1, 999, proc) is None           # gone


@pytest.mark.component
def test_worker_pids_map_through_descendants_only(tmp_path):
    proc = fake_proc(tmp_path, {
        500: (1, (500, 1)),                 # the training process, pid 1 in its container
        501: (500, (501, 7)),               # a worker
        502: (501, (502, 8)),               # a worker's child (forkserver-style): still a descendant
        503: (500, (503, 9, 1)),            # a descendant in a nested namespace: 9 as the caller sees it
        700: (1, (700, 10)),                # pid 10 in some other container: not the caller's
        701: (1, (701,)),
    })
    assert sorted(security.descendants(500, proc)) == [501, 502, 503]
    found, missing = security.map_ns_pids([7, 8, 9, 10, 11], 500, proc)
    assert found == {7: 501, 8: 502, 9: 503} and missing == [10, 11]
    assert security.map_ns_pids([7], 999, proc) == ({}, [7])    # caller gone


@pytest.fixture
def children():
    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(3)]
    yield [p.pid for p in procs]
    for p in procs:
        p.kill()
        p.wait()


@pytest.mark.component
def test_registry_takes_namespace_pids_and_keeps_host_pids(tmp_path, children):
    me, (w1, w2, stranger) = os.getpid(), children
    tree = {me: (1, (me, 1)), w1: (me, (w1, 5)), stranger: (1, (stranger, 6))}
    proc = fake_proc(tmp_path, tree)
    reg = Registry(proc_root=proc)
    peer = Peer(os.getuid(), os.getgid(), me)

    def hello(**kw):
        return reg.hello(peer, b"id", protocol.make("hello", job="j", rank=0, uid=os.getuid(), **kw), 0.0)

    with pytest.raises(Refused, match="hello for pid 2 came from pid"):
        hello(pid=2)
    with pytest.raises(Refused, match="pid 6 .* another process, not a descendant"):
        hello(pid=1, worker_pids=[5, 6])
    r = hello(pid=1, worker_pids=[5])
    assert (r.pid, r.claimed_pid, r.worker_pids) == (me, 1, (w1,))
    assert reg.jobs["j"].pids() == (me,)

    # a resize: a new worker appears in the container; reports speak with the container's pids
    fake_proc(tmp_path, {w2: (me, (w2, 9))})
    r = reg.report(b"id", peer, protocol.make("report", job="j", rank=0, pid=1, worker_pids=[5, 9], stats={}), 1.0)
    assert r.worker_pids == (w1, w2) and r.ns_workers == {5: w1, 9: w2}
    r = reg.report(b"id", peer, protocol.make("report", job="j", rank=0, pid=1, worker_pids=[9], stats={}), 2.0)
    assert r.worker_pids == (w2,) and r.ns_workers == {9: w2}
    with pytest.raises(Refused, match="pid 6 .* another process, not a descendant"):
        reg.report(b"id", peer, protocol.make("report", job="j", rank=0, pid=1, worker_pids=[9, 6], stats={}), 3.0)
    with pytest.raises(Refused, match="speaks for job 'j' rank 0 pid 1"):
        reg.report(b"id", peer, protocol.make("report", job="j", rank=0, pid=me, worker_pids=[], stats={}), 3.0)
    assert reg.jobs["j"].worker_pids() == (w2,)


@pytest.mark.component
def test_a_claimed_pid_held_by_no_process_of_the_namespace_is_left_out(tmp_path, children):
    """A worker that exited between the loader's listing and the agent's reading (a retired one, a crash)
    is left out, as on the host path; a pid that another process of the caller's namespace holds is still
    refused, and one held only in another container names nothing in the caller's: left out."""
    me, (w1, w2, stranger) = os.getpid(), children
    other = stranger + 100000          # a host pid no test process has: a process of another container
    proc = fake_proc(tmp_path, {me: (1, (me, 1)), w1: (me, (w1, 5)), stranger: (1, (stranger, 6)),
                                other: (1, (other, 7))}, ns={other: "pid:[4026532999]"})
    assert security.ns_pids_held([5, 6, 7, 8], me, proc) == [5, 6]
    assert security.ns_pids_held([6], 999, proc) == []                 # the caller gone: nothing held
    reg = Registry(proc_root=proc)
    peer = Peer(os.getuid(), os.getgid(), me)
    r = reg.hello(peer, b"id", protocol.make("hello", job="j", rank=0, pid=1, uid=os.getuid(),
                                             worker_pids=[5, 8, 7]), 0.0)
    assert r.worker_pids == (w1,) and r.ns_workers == {5: w1}
    fake_proc(tmp_path, {w2: (me, (w2, 9))})
    r = reg.report(b"id", peer, protocol.make("report", job="j", rank=0, pid=1, worker_pids=[5, 9, 11],
                                              stats={}), 1.0)
    assert r.worker_pids == (w1, w2) and r.ns_workers == {5: w1, 9: w2}
    with pytest.raises(Refused, match="pid 6 .* another process, not a descendant"):
        reg.report(b"id", peer, protocol.make("report", job="j", rank=0, pid=1, worker_pids=[5, 6], stats={}), 2.0)
    assert reg.jobs["j"].worker_pids() == (w1, w2)


@pytest.mark.component
def test_a_container_pid_equal_to_its_host_pid_still_maps_workers_through_the_namespace(tmp_path, children):
    """A process in its own pid namespace whose pid there happens to be its host pid too (NSpid "N N")
    claims that pid: its worker pids are still its namespace's, mapped through its descendants. Before,
    the claim equal to the peer's pid sent it down the host path, where a worker claimed as 6 (its own
    worker's pid in the container) was taken as host pid 6: another process, pinned or moved as this
    job's worker when it was the same uid's (every root pod's, on Kubernetes)."""
    me, (w1, stranger, _) = os.getpid(), children
    proc = fake_proc(tmp_path, {me: (1, (me, me)), w1: (me, (w1, stranger)), stranger: (1, (stranger,))})
    reg = Registry(proc_root=proc)
    peer = Peer(os.getuid(), os.getgid(), me)
    r = reg.hello(peer, b"id", protocol.make("hello", job="j", rank=0, pid=me, uid=os.getuid(),
                                             worker_pids=[stranger]), 0.0)
    assert (r.pid, r.claimed_pid, r.worker_pids, r.ns_workers) == (me, me, (w1,), {stranger: w1})
    r = reg.report(b"id", peer, protocol.make("report", job="j", rank=0, pid=me, worker_pids=[stranger],
                                              stats={}), 1.0)
    assert r.worker_pids == (w1,)
    assert reg.jobs["j"].worker_pids() == (w1,)


@pytest.mark.component
def test_a_caller_the_agent_cannot_see_is_refused_saying_why(tmp_path):
    """An agent outside the host's pid namespace (a DaemonSet without hostPID) gets pid 0 from the kernel
    for a caller in another namespace. Refused, naming that and hostPID; before, it was told the transport
    had no peer credentials and to use the ipc:// endpoint it was on."""
    reg = Registry(proc_root=fake_proc(tmp_path, {}))
    with pytest.raises(Refused, match="cannot see this process .* hostPID: true"):
        reg.hello(Peer(0, 0, 0), b"id", protocol.make("hello", job="j", rank=0, pid=1, uid=0), 0.0)
    assert not reg.jobs
    job = reg.register(Peer(0, 0, 0), {"job": "k", "uid": 1000, "gpus": [], "cpus": 1, "pids": []}, 0.0)
    assert job.uid == 1000          # register and release need only the uid, which the kernel still gives


@pytest.mark.component
def test_the_pid_namespace_link_is_read_from_the_real_proc():
    assert security.pid_namespace(os.getpid()) == os.readlink("/proc/self/ns/pid")
    assert security.pid_namespace(2 ** 22 + 1) is None


@pytest.mark.component
def test_registry_without_namespaces_is_unchanged(tmp_path, children):
    me, (w1, _, _) = os.getpid(), children
    reg = Registry(proc_root=fake_proc(tmp_path, {me: (1, (me,))}))
    peer = Peer(os.getuid(), os.getgid(), me)
    r = reg.hello(peer, b"id", protocol.make("hello", job="j", rank=0, pid=me, uid=os.getuid(), worker_pids=[w1]), 0.0)
    assert (r.pid, r.claimed_pid, r.worker_pids, r.ns_workers) == (me, None, (w1,), {})
    with pytest.raises(Refused, match="hello for pid 1 came from pid"):
        reg.hello(peer, b"id2", protocol.make("hello", job="k", rank=0, pid=1, uid=os.getuid()), 0.0)


def _unshare_works() -> bool:
    tool = shutil.which("unshare")
    if tool is None or os.getuid() != 0:
        return False
    p = subprocess.run([tool, "--pid", "--fork", "true"], capture_output=True, timeout=30)
    return p.returncode == 0


@pytest.mark.system
@pytest.mark.skipif(not _unshare_works(), reason="needs root and a working `unshare --pid` for a real pid namespace")
def test_client_in_its_own_pid_namespace_is_accepted_with_host_pids(base):
    agent = AgentProc(base, "--policy", "even", "--loader-cpus", "2", "--tick-s", "0.2").start()
    trainer = Trainer(base, agent.endpoint, job="boxed", workers=2,
                      wrap=("unshare", "--pid", "--fork", "--kill-child"))
    try:
        def host_view():
            """(training process, its loader workers) as the host numbers them."""
            kids = psutil.Process(trainer.pid).children()
            py = [k for k in kids if k.name().startswith("python")]
            if not py:
                return None
            return py[0].pid, sorted(c.pid for c in py[0].children())
        try:
            job = wait_for(lambda: (j := agent.job("boxed")) and j["worker_pids"] and j, 30, what="boxed job")
        except AssertionError:
            raise AssertionError(trainer.dump() + agent.log()[-3000:])
        st = trainer.state()
        assert st.get("worker_pids") and max(st["worker_pids"]) < 100, st   # the container's own pids
        py_pid, _ = host_view()
        assert job["pids"] == [py_pid]
        # workers the agent tracks are the host pids of the process's children (after any resize)
        wait_for(lambda: agent.job("boxed")["worker_pids"] == host_view()[1], 20, what="host worker pids")
        assert not agent.events("request_refused"), agent.events("request_refused")
    finally:
        trainer.kill()
        agent.stop()


@pytest.mark.system
@pytest.mark.skipif(not _unshare_works(), reason="needs root and a working `unshare --pid` for a real pid namespace")
def test_agent_in_its_own_pid_namespace_tells_the_client_it_needs_the_host_pids(base):
    """The agent in a pid namespace of its own (no hostPID), the client on the host: the kernel gives the
    agent pid 0 for the caller. The client's refusal names the cause."""
    os.chmod(base, 0o755)
    agent = AgentProc(base, "--policy", "even", "--loader-cpus", "2", "--tick-s", "0.2",
                      wrap=("unshare", "--pid", "--fork", "--mount-proc", "--kill-child")).start()
    trainer = Trainer(base, agent.endpoint, job="unseen", workers=1)
    try:
        why = wait_for(lambda: trainer.state().get("last_error"), 30, what="the client's refusal")
        assert "cannot see this process" in why and "hostPID" in why, why
        assert "no peer credentials" not in why
        assert agent.job("unseen") is None
    finally:
        trainer.kill()
        agent.stop()
