"""agent/registry.py: adoption from the journal, the sweep that notices dead ranks (real processes),
ownership and idempotence of register/release."""
from __future__ import annotations

import contextlib
import json
import os

import pytest

from agent.registry import Refused, Registry
from agent.security import Peer

pytestmark = pytest.mark.component


def test_registry_adopts_live_and_drops_dead():
    me = os.getpid()
    reg = Registry()
    reg.hello(Peer(os.getuid(), 0, me), b"a", {"job": "live", "rank": 0, "pid": me, "worker_pids": [me]}, 0.0)
    doc = reg.to_doc()
    doc["dead"] = json.loads(json.dumps(doc["live"]))
    doc["dead"]["ranks"]["0"]["pid"] = 2 ** 22 + 17          # no such process
    doc["reg-only"] = {"uid": 0, "registered": True, "reg_pids": {}, "ranks": {}}
    doc["garbage"] = {"ranks": "x"}
    fresh = Registry()
    adopted, dead = fresh.adopt(doc, 100.0)
    assert sorted(adopted) == ["live", "reg-only"] and sorted(dead) == ["dead", "garbage"]
    assert fresh.jobs["live"].ranks[0].pid == me and fresh.jobs["live"].source == "journal"


def test_sweep_notices_a_dead_rank_within_two_ticks():
    """A rank heard from since the previous sweep is not re-read from /proc; one that died is dropped
    on the first sweep after its last message, and one that died silently on the next sweep."""
    import subprocess
    import sys

    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    try:
        reg = Registry(heartbeat_s=100.0)
        for i, p in enumerate(procs):
            reg.hello(Peer(os.getuid(), 0, p.pid), b"r%d" % i, {"job": f"j{i}", "rank": 0, "pid": p.pid}, 0.0)
        reg.sweep(1.0)                                   # both alive
        assert sorted(reg.jobs) == ["j0", "j1"]
        reg.report(b"r0", Peer(os.getuid(), 0, procs[0].pid),
                   {"job": "j0", "rank": 0, "pid": procs[0].pid, "stats": {}}, 1.5)   # j0 reports, then dies
        for p in procs:
            p.kill()
            p.wait()
        reg.sweep(2.0)      # tick 1 after the deaths: j1 (silent since the last sweep) is read and gone
        assert sorted(reg.jobs) == ["j0"]
        reg.sweep(3.0)      # tick 2: j0's last message is older than the previous sweep -> read, gone
        assert reg.jobs == {}
        assert sorted(reg.take_departed()) == [("j0", "process gone"), ("j1", "process gone")]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_registry_ownership_and_idempotence():
    me = os.getpid()
    reg = Registry()
    root, user = Peer(0, 0, 1), Peer(1000, 1000, 4242)
    reg.register(root, {"job": "s1", "uid": 1000, "gpus": ["0"], "cpus": 4, "pids": []}, 0.0)
    reg.register(root, {"job": "s1", "uid": 1000, "gpus": ["0"], "cpus": 4, "pids": []}, 0.0)
    assert reg.jobs["s1"].uid == 1000 and reg.jobs["s1"].registered
    with pytest.raises(Refused) as e:
        reg.register(user, {"job": "s2", "uid": 0}, 0.0)
    assert e.value.code == "not_permitted"
    with pytest.raises(Refused):
        reg.release(Peer(1001, 1001, 5), {"job": "s1", "uid": 1001})
    with pytest.raises(Refused, match="only speak for itself"):
        reg.hello(user, b"x", {"job": "s1", "rank": 0, "pid": me}, 0.0)
    assert reg.release(user, {"job": "s1", "uid": 1000}) is True
    assert reg.release(user, {"job": "s1", "uid": 1000}) is False
    assert reg.take_departed() == [("s1", "released")]
    with pytest.raises(Refused, match="no peer credentials"):
        reg.register(None, {"job": "s3", "uid": 0}, 0.0)



def test_a_worker_that_exited_before_the_agent_read_the_report_is_left_out_not_refused():
    """A loader lists its workers when it writes a report; a worker it retired may exit before the
    agent reads it. That pid is left out (nothing to control) and the rank stays connected; before,
    the whole report was refused (not_permitted) and the job went a minute without the agent."""
    import subprocess

    from adloader import protocol

    me = os.getpid()
    live = subprocess.Popen(["sleep", "60"])
    gone = subprocess.Popen(["true"])
    gone.wait()                                   # reaped: no such process any more
    try:
        reg = Registry()
        peer = Peer(os.getuid(), os.getgid(), me)
        r = reg.hello(peer, b"a", protocol.make("hello", job="j", rank=0, pid=me, uid=os.getuid(),
                                                worker_pids=[live.pid, gone.pid]), 0.0)
        assert r.worker_pids == (live.pid,)
        r = reg.report(b"a", peer, protocol.make("report", job="j", rank=0, pid=me,
                                                 worker_pids=[live.pid, gone.pid], stats={}), 1.0)
        assert r.worker_pids == (live.pid,) and r.reports == 1
        assert reg.jobs["j"].worker_pids() == (live.pid,)
        with pytest.raises(Refused, match="positive integers") as e:    # what is no pid at all: refused
            reg.report(b"a", peer, protocol.make("report", job="j", rank=0, pid=me, worker_pids=[0], stats={}), 2.0)
        assert e.value.code == "malformed"
    finally:
        live.kill()
        live.wait()


def test_a_hello_without_a_batch_size_keeps_what_the_rank_had_and_a_bad_one_is_malformed():
    """batch_size null in a hello (a batch_sampler's loader before its first batch) is accepted: 1 for a
    new rank until a report carries the size; a hello again from the same process (a reconnect) keeps
    the size its reports gave, where it was set back to 1. Anything but an integer >= 1 or null is
    refused as malformed."""
    from adloader import protocol

    me = os.getpid()
    reg = Registry()
    peer = Peer(os.getuid(), os.getgid(), me)

    def hello(batch_size):
        return reg.hello(peer, b"a", protocol.make("hello", job="j", rank=0, pid=me, uid=os.getuid(),
                                                   batch_size=batch_size), 0.0)

    assert hello(None).batch_size == 1
    reg.report(b"a", peer, protocol.make("report", job="j", rank=0, pid=me, stats={"batch_size": None}), 1.0)
    assert reg.jobs["j"].ranks[0].batch_size == 1
    reg.report(b"a", peer, protocol.make("report", job="j", rank=0, pid=me, stats={"batch_size": 24}), 2.0)
    assert hello(None).batch_size == 24
    assert hello(32).batch_size == 32
    for bad in (0, -4, True, 2.5, "16", [16]):
        with pytest.raises(Refused, match="batch_size") as e:
            hello(bad)
        assert e.value.code == "malformed"
    assert reg.jobs["j"].ranks[0].batch_size == 32


def test_a_journaled_worker_pid_now_held_by_another_process_is_not_adopted():
    """A worker that exited while no agent ran may leave its pid to another process. Adopted as the
    rank's worker, the restarted agent's first tick moved that process (a root daemon, another user's)
    into the job's cgroup (found by killing an agent, giving a journaled worker pid to a uid-65534
    process and restarting it). Kept: the worker still running with the start time journaled for it,
    and a live one of the rank's uid from a journal written before start times were kept."""
    import subprocess

    me = os.getpid()
    kept, reused = (subprocess.Popen(["sleep", "60"]) for _ in range(2))
    other_uid = None
    if os.geteuid() == 0:
        from agent.security import pid_uid
        from tests.conftest import wait_for

        other_uid = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "sleep", "60"])
        wait_for(lambda: pid_uid(other_uid.pid) == 65534, 10, what="the process as uid 65534")
    try:
        reg = Registry()
        reg.hello(Peer(os.getuid(), 0, me), b"a", {"job": "j", "rank": 0, "pid": me,
                                                    "worker_pids": [kept.pid, reused.pid]}, 0.0)
        doc = json.loads(json.dumps(reg.to_doc()))
        rank = doc["j"]["ranks"]["0"]
        assert rank["worker_start_ticks"][str(kept.pid)] is not None
        rank["worker_start_ticks"][str(reused.pid)] += 1      # the pid is another process now
        if other_uid is not None:                            # a journaled worker pid held by another uid
            rank["worker_pids"].append(other_uid.pid)
        fresh = Registry()
        assert fresh.adopt(doc, 10.0) == (["j"], [])
        assert fresh.jobs["j"].ranks[0].worker_pids == (kept.pid,)
        # a journal without start times (an older agent's): the rank's uid still decides
        del rank["worker_start_ticks"]
        older = Registry()
        older.adopt(doc, 10.0)
        assert older.jobs["j"].ranks[0].worker_pids == (kept.pid, reused.pid)
    finally:
        for p in (kept, reused, other_uid):
            if p is not None:
                p.kill()
                p.wait()


def test_a_refused_hello_leaves_no_job_behind():
    """A hello refused for one of its fields (world_size 0, gpus not a list, a host name that is an
    object) made its job first and then refused: the job stayed with no rank for good (never swept,
    journaled, holding the id, counted against the uid's jobs_per_uid, so that 32 such hellos locked
    the user out: found by sending malformed hellos and reading the registry). Each is now refused
    before anything changes, naming the field, and the uid's bound is untouched."""
    from agent.registry import Limits

    me = os.getpid()
    peer = Peer(os.getuid(), 0, me)
    reg = Registry(limits=Limits(jobs_per_uid=2))
    bad = [({"world_size": 0}, "world_size"), ({"gpus": "0"}, "gpus"), ({"hostname": {"a": 1}}, "hostname"),
           ({"batch_size": 0}, "batch_size"), ({"uid": "0"}, "'uid' must be an integer"),
           ({"max_workers": -1}, "max_workers")]
    for i, (field, named) in enumerate(bad):
        with pytest.raises(Refused, match=named) as e:
            reg.hello(peer, b"c%d" % i, {"job": f"ghost{i}", "rank": 0, "pid": me, **field}, 0.0)
        assert e.value.code == "malformed"
    assert reg.jobs == {} and reg.by_identity == {} and reg.version == 0
    # a connection whose rank is in one job and whose next hello, for another job, is refused keeps its rank
    reg.hello(peer, b"c", {"job": "real", "rank": 0, "pid": me}, 0.0)
    with pytest.raises(Refused):
        reg.hello(peer, b"c", {"job": "other", "rank": 0, "pid": me, "world_size": 0}, 0.0)
    assert list(reg.jobs) == ["real"] and reg.by_identity[b"c"] == ("real", 0)
    reg.hello(peer, b"d", {"job": "second", "rank": 0, "pid": me}, 0.0)     # the bound of 2 is still free


def test_a_registration_for_a_uid_no_process_can_have_is_refused_naming_it():
    """root's register with uid 2**32 or more was accepted, and the job's journal entry refused at the
    next start (a uid beyond uid_t), so a restart lost it; uid (uid_t)-1 is no uid either. A source
    that is not a short string went into the log line as it came."""
    from agent.registry import MAX_UID

    root = Peer(0, 0, 1)
    reg = Registry()
    for uid in (2 ** 32 - 1, 12345678901, -1):
        with pytest.raises(Refused, match=f"uid must be 0 to {MAX_UID}") as e:
            reg.register(root, {"job": "s", "uid": uid}, 0.0)
        assert e.value.code == "malformed"
    for source in ({"x": 1}, "s" * 65):
        with pytest.raises(Refused, match="source must be a string") as e:
            reg.register(root, {"job": "s", "uid": 1000, "source": source}, 0.0)
    assert reg.jobs == {}
    reg.register(root, {"job": "s", "uid": MAX_UID, "source": "slurm"}, 0.0)
    from agent import journal

    entry = json.loads(json.dumps(reg.to_doc()))["s"]
    assert journal._check_job("journal.json", "s", entry) == entry


@contextlib.contextmanager
def _server_and_a_peer():
    """A ``Server`` on a fresh ``Registry`` whose sends are recorded instead of sent, and a live process
    to stand for a second rank: (server, registry, sent [(identity, message)], the peer's Popen)."""
    import subprocess

    from agent.server import Server

    peer = subprocess.Popen(["sleep", "60"])
    try:
        reg = Registry()
        s = Server("ipc:///nonexistent/agent.sock", reg, heartbeat_s=1.0, on_report=lambda *a: None, status_doc=dict)
        sent = []
        s._send = lambda identity, msg: sent.append((identity, msg)) or True
        yield s, reg, sent, peer
    finally:
        peer.kill()
        peer.wait()


def test_a_rank_that_joins_late_gets_the_plan_over_the_ranks_now_and_one_that_comes_back_its_part():
    """A job's directive is split over the most ranks it has had since it was made. Rank 1 joining a job
    planned 2 workers for its rank 0 alone is welcomed with 1 (the plan over 2 ranks), and rank 0 is sent
    its new part, 1, in the same message: the job runs its plan's 2, not 2 on each rank until the next
    tick (the split once made, before: rank 1 welcomed with rank 0's 2). Earlier still, rank 1 was
    welcomed with 1 while rank 0 kept 2, so the job stepped at the pace of a rank with half the workers.
    After rank 1 died, rank 0 reconnecting is sent its part of the 6 planned for both, not all 6."""
    with _server_and_a_peer() as (s, reg, sent, peer):
        me, uid = os.getpid(), os.getuid()

        def hello(identity, rank, pid):
            s._hello(identity, Peer(uid, 0, pid), {"job": "j", "rank": rank, "pid": pid, "world_size": 2}, 0.0)
            return [m for i, m in sent if i == identity and m["type"] == "directive"][-1]

        # (the hello of another pid is taken as that pid's: its peer credentials are the test's to give)
        s._hello(b"r0", Peer(uid, 0, me), {"job": "j", "rank": 0, "pid": me, "world_size": 2}, 0.0)
        assert s.send_directive("j", 2, 1.0, None, "rank 0 alone")
        d = hello(b"r1", 1, peer.pid)
        assert d["workers"] == 1 and d["cpus"] == 0.5                  # the plan over the 2 ranks now
        assert [i for i, m in sent if m is d] == [b"r0", b"r1"]       # and rank 0 its new part, at once
        assert reg.jobs["j"].last_directive["ranks"] == 2
        d = hello(b"r1", 1, peer.pid)                                 # a reconnect: to it alone
        assert d["workers"] == 1 and [i for i, m in sent if m is d] == [b"r1"]
        assert s.send_directive("j", 6, 2.0, None, "both ranks")
        assert [m["workers"] for _, m in sent[-2:]] == [3, 3] and sent[-1][1]["cpus"] == 1.0
        assert "ranks" not in sent[-1][1]
        reg._drop_rank(reg.jobs["j"], 1, "process gone")
        d = hello(b"r0-again", 0, me)
        assert d["workers"] == 3 and d["cpus"] == 1.0                 # its part of the 6, not all 6
        # a journal written before the directive recorded its ranks: the ranks connected stand in
        reg.jobs["j"].last_directive = {"workers": 6, "cpus": 2.0, "cpuset": None, "reason": "old"}
        assert hello(b"r1-again", 1, peer.pid)["workers"] == 3


def test_a_rank_that_leaves_changes_nothing_sent_until_the_next_tick_resends_the_plan():
    """The behaviour at a leave, kept on purpose (``agent.server.rank_directive``): rank 1 of a job
    planned 6 (3 a rank) says bye, and rank 0 is sent nothing then: it keeps its 3, fewer than the plan
    in all, never more, until the next tick, which re-sends the job's count for its one rank (the
    directive tracks the job's ranks: test_controller). A split at the leave would have rank 0 fork 3
    more workers when its peers are often leaving too (the end of a run, a torchrun restart)."""
    from types import SimpleNamespace

    from adloader import protocol

    with _server_and_a_peer() as (s, reg, sent, peer):
        me, uid = os.getpid(), os.getuid()
        for identity, rank, pid in ((b"r0", 0, me), (b"r1", 1, peer.pid)):
            s._hello(identity, Peer(uid, 0, pid), {"job": "j", "rank": rank, "pid": pid, "world_size": 2}, 0.0)
        assert s.send_directive("j", 6, 2.0, None, "both ranks")
        assert [(i, m["workers"]) for i, m in sent if m["type"] == "directive"] == [(b"r0", 3), (b"r1", 3)]
        before = len(sent)
        bye = protocol.encode(protocol.make("bye", job="j", rank=1, pid=peer.pid))
        s._dispatch(b"r1", Peer(uid, 0, peer.pid), [SimpleNamespace(bytes=b"r1"), SimpleNamespace(bytes=bye)], 1.0)
        assert sorted(reg.jobs["j"].ranks) == [0]
        assert [m["type"] for _, m in sent[before:]] == ["ok"]         # nothing to rank 0 at the leave
        assert s.send_directive("j", 6, 2.0, None, "one rank")          # the next tick's
        assert sent[-1][0] == b"r0" and sent[-1][1]["workers"] == 6 and sent[-1][1]["cpus"] == 2.0


def test_two_jobs_under_one_job_id_are_refused_by_their_world_sizes_and_a_restart_is_not():
    """Two jobs started with the same ADLOADER_JOB_ID by mistake, of 2 and 4 ranks: the second's rank 0
    was refused (rank 0 held), but its ranks 2 and 3 joined the first, which was then planned as one job
    of both's ranks. A hello whose world size differs from a live rank's is refused, naming both; one
    that says none (1) is taken; a torchrun restart with a new WORLD_SIZE joins once its old ranks died."""
    import subprocess

    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(3)]
    try:
        uid = os.getuid()
        reg = Registry()

        def hello(identity, rank, pid, ws):
            return reg.hello(Peer(uid, 0, pid), identity, {"job": "j", "rank": rank, "pid": pid, "world_size": ws}, 0.0)

        hello(b"a0", 0, procs[0].pid, 2)
        with pytest.raises(Refused, match=r"rank 0 of world size 2 \(live pid \d+\), and this hello says world "
                                          r"size 4: two jobs share the job id"):
            hello(b"b2", 2, procs[1].pid, 4)
        assert sorted(reg.jobs["j"].ranks) == [0]
        hello(b"a1", 1, procs[1].pid, 2)
        hello(b"x", 3, os.getpid(), 1)                                # says no world size: taken
        reg._drop_rank(reg.jobs["j"], 3, "bye")
        procs[0].kill(), procs[1].kill()
        procs[0].wait(), procs[1].wait()
        hello(b"n0", 0, procs[2].pid, 3)                              # the restart: old ranks are dead
        assert reg.jobs["j"].ranks[0].world_size == 3
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_hello_whose_rank_is_not_below_its_world_size_is_refused_and_one_that_says_none_is_taken():
    """Rank 3 of a world of 2 joined its job as a third rank (its directive then split three ways).
    Refused ``malformed`` before the registry changes, naming both values; a hello that does not say
    its world size, or says 1 (what a client sends when neither WORLD_SIZE nor SLURM_NTASKS is set),
    is taken as before."""
    me = os.getpid()
    peer = Peer(os.getuid(), 0, me)
    reg = Registry()
    with pytest.raises(Refused, match=r"rank 3 is not below world_size 2 \(ranks are numbered 0 to "
                                      r"world_size - 1: check RANK and WORLD_SIZE") as e:
        reg.hello(peer, b"a", {"job": "j", "rank": 3, "pid": me, "world_size": 2}, 0.0)
    assert e.value.code == "malformed"
    assert reg.jobs == {} and reg.version == 0
    assert reg.hello(peer, b"a", {"job": "j", "rank": 3, "pid": me}, 0.0).world_size == 1
    assert reg.hello(peer, b"a", {"job": "j", "rank": 3, "pid": me, "world_size": 1}, 0.0).rank == 3
