"""The agent's own files (issue 16.9): written whole or not at all, validated by type on load with the
file named, set aside when they cannot be trusted, reported in status, never a silent downgrade of the
cgroup mode; a full or read-only state directory opens no breaker and SIGTERM still exits 0.
Unit tests (pure, tmp_path) first; then real agents (root: a tmpfs or read-only bind mount as the state
directory, real cgroup v1 groups in a subtree of their own)."""
from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import time

import pytest

from agent import journal, statefile
from agent.actuators.originals import Originals
from tests.agentd_support import AgentProc, Trainer
from tests.cgroup_support import CPU
from tests.conftest import wait_for


@pytest.mark.unit
def test_write_atomic_writes_every_byte_when_os_write_writes_less(tmp_path, monkeypatch):
    real = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real(fd, bytes(data[:7])))
    p = str(tmp_path / "f.json")
    statefile.write_atomic(p, b"x" * 1000)
    assert open(p, "rb").read() == b"x" * 1000


@pytest.mark.unit
def test_a_failed_write_keeps_the_good_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    p = str(tmp_path / "f.json")
    statefile.write_atomic(p, b"good")
    real = os.write
    calls = []

    def full(fd, data):
        calls.append(1)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, bytes(data[:3]))

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError):
        statefile.write_atomic(p, b"a newer and longer document")
    assert open(p, "rb").read() == b"good"
    assert sorted(os.listdir(tmp_path)) == ["f.json", "f.json.prev"] or sorted(os.listdir(tmp_path)) == ["f.json"]


@pytest.mark.unit
def test_write_atomic_keeps_the_last_good_copy(tmp_path):
    p = str(tmp_path / "f.json")
    statefile.write_atomic(p, b"one")
    statefile.write_atomic(p, b"two")
    assert open(p).read() == "two" and open(p + ".prev").read() == "one"


def _journal(tmp_path, doc) -> str:
    p = journal.path_in(str(tmp_path))
    with open(p, "w") as f:
        f.write(doc if isinstance(doc, str) else json.dumps(doc))
    return p


@pytest.mark.unit
def test_a_corrupt_journal_is_set_aside_named_and_the_previous_copy_adopted(tmp_path):
    journal.save(str(tmp_path), {}, {"older": {"uid": 5, "registered": True}})
    journal.save(str(tmp_path), {}, {"newer": {"uid": 5, "registered": True}})
    p = journal.path_in(str(tmp_path))
    with open(p, "w") as f:
        f.write('{"version": 1, "jobs": {"torn')
    doc = journal.load(str(tmp_path))
    assert list(doc["jobs"]) == ["older"]
    assert any(p in x and "not valid JSON" in x and ".bad-" in x for x in doc["problems"]), doc["problems"]
    assert any(n.startswith("journal.json.bad-") for n in os.listdir(tmp_path))


@pytest.mark.unit
@pytest.mark.parametrize("doc, where", [
    ({"version": 1, "jobs": [], "applied": {}}, "jobs must be an object"),
    ({"version": "1", "jobs": {}, "applied": {}}, "version must be 1"),
    ([1, 2], "the document must be an object"),
])
def test_a_journal_with_wrong_types_at_the_top_is_set_aside(tmp_path, doc, where):
    p = _journal(tmp_path, doc)
    got = journal.load(str(tmp_path))
    assert got["jobs"] == {} and got["applied"] == {}
    assert any(p in x and where in x for x in got["problems"]), got["problems"]


@pytest.mark.unit
def test_journal_entries_with_wrong_types_are_dropped_one_by_one_and_named(tmp_path):
    p = _journal(tmp_path, {"version": 1, "applied": {
        "a": {"job": "a", "workers": 2, "cpus": "two"},
        "b": {"job": "b", "workers": 1, "cpus": 0.5, "reason": "ok"},
        "c": {"job": "c", "workers": 1, "cpus": 0.5, "cpu_weight": -1},
        "d": {"job": "d", "workers": 1, "cpus": 0.5, "budget": "all"},
        "e": {"job": "e", "workers": 1, "cpus": 0.5, "delivery": 0.5},
        "f": {"job": "f", "workers": 2, "cpus": 0.5, "extra_workers": -1}},
        "jobs": {
            "x": {"uid": 5, "registered": True, "reg_cpus": "two"},
            "y": {"uid": 5, "registered": True, "reg_cpus": 2},
            "..": {"uid": 5, "registered": True},
            "z": {"uid": 5, "ranks": {"0": {"pid": "1", "uid": 5}}}}})
    doc = journal.load(str(tmp_path))
    assert list(doc["applied"]) == ["b"] and doc["applied"]["b"].cpus == 0.5
    assert list(doc["jobs"]) == ["y"]
    text = "\n".join(doc["problems"])
    for what in ("applied['a'].cpus", "applied['c'].cpu_weight", "applied['d'].budget", "applied['e'].delivery",
                 "applied['f'].extra_workers", "jobs['x'].reg_cpus", "a job id", "jobs['z'].ranks['0'].pid"):
        assert what in text, (what, text)
    assert text.count(p) == 8


@pytest.mark.unit
def test_journal_applied_ids_and_last_directives_are_checked_too(tmp_path):
    # (before: an applied entry under a job id the protocol refuses was adopted, and its release failed
    # at every tick; a last_directive without its fields was adopted and every hello of the job was
    # answered "internal": ProtocolError "directive message is missing field 'workers'")
    p = _journal(tmp_path, {"version": 1, "applied": {
        "../x": {"workers": 1, "cpus": 0.5},
        "ok": {"workers": 1, "cpus": 0.5}},
        "jobs": {
            "d1": {"uid": 5, "registered": True, "last_directive": {"cpus": 1.0}},
            "d2": {"uid": 5, "registered": True, "last_directive": {"workers": 2, "job": "other"}},
            "d3": {"uid": 5, "registered": True, "last_directive": {"workers": 2, "cpus": "x"}},
            "d4": {"uid": 5, "registered": True, "last_directive": {"workers": 2, "cpuset": "0-3"}},
            "good": {"uid": 5, "registered": True,
                     "last_directive": {"workers": 2, "cpus": 1.5, "cpuset": None, "reason": "r"}}}})
    doc = journal.load(str(tmp_path))
    assert list(doc["applied"]) == ["ok"] and list(doc["jobs"]) == ["good"]
    text = "\n".join(doc["problems"])
    for what in ("'../x'", "jobs['d1'].last_directive.workers", "jobs['d2'].last_directive must be an object of",
                 "jobs['d3'].last_directive.cpus", "jobs['d4'].last_directive.cpuset"):
        assert what in text, (what, text)
    assert text.count(p) == 5


@pytest.mark.unit
def test_a_last_directives_ranks_are_kept_and_checked(tmp_path):
    """``ranks`` (the ranks a job's directive was split over when it was made: agent.server.rank_directive)
    is journaled with it, so a rank that says hello after a restart gets its peers' part."""
    p = _journal(tmp_path, {"version": 1, "applied": {}, "jobs": {
        "r1": {"uid": 5, "registered": True, "last_directive": {"workers": 2, "ranks": -1}},
        "good": {"uid": 5, "registered": True,
                 "last_directive": {"workers": 4, "cpus": 1.5, "cpuset": None, "reason": "r", "ranks": 2}}}})
    doc = journal.load(str(tmp_path))
    assert list(doc["jobs"]) == ["good"] and doc["jobs"]["good"]["last_directive"]["ranks"] == 2
    assert "jobs['r1'].last_directive.ranks" in "\n".join(doc["problems"]) and p


@pytest.mark.unit
def test_originals_with_wrong_types_raise_naming_the_file_and_field(tmp_path):
    p = str(tmp_path / "cgroup-originals.json")
    with open(p, "w") as f:
        json.dump({"version": 1, "files": {}, "created": "cpu|adloader/x", "pids": {}}, f)
    with pytest.raises(statefile.StateFileError) as e:
        Originals(p)
    assert p in str(e.value) and "created" in str(e.value)


@pytest.mark.unit
def test_an_unwritable_originals_file_is_not_an_apply_failure(tmp_path, monkeypatch):
    o = Originals(str(tmp_path / "cgroup-originals.json"))
    o.created.append("cpu|adloader/a")

    def erofs(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(statefile, "write_atomic", erofs)
    o.save()                                 # does not raise
    assert "Read-only file system" in o.save_error and o.created == ["cpu|adloader/a"]
    monkeypatch.undo()
    o.save()
    assert o.save_error is None and Originals(o.path).created == ["cpu|adloader/a"]


# --- real agents ------------------------------------------------------------------------------------

def needs_root(fn):
    return pytest.mark.system(pytest.mark.security(pytest.mark.skipif(
        os.getuid() != 0, reason="needs root (mount a tmpfs / read-only bind, cgroup v1)")(fn)))


def _mount(*args: str) -> None:
    r = subprocess.run(["mount", *args], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount here (mount {' '.join(args)}: {r.stderr.strip()[:200]})")


@needs_root
def test_a_full_state_dir_never_leaves_a_torn_journal(base, trainers):
    """Issue 16.9: on a full state dir the journal was written torn and renamed over the good one."""
    state = f"{base}/state"
    os.makedirs(state)
    _mount("-t", "tmpfs", "-o", "size=12k", "tmpfs", state)
    try:
        agent = AgentProc(base, "--policy", "even", "--tick-s", "0.2", state_dir=state).start()
        try:
            t = Trainer(base, agent.endpoint, job="keep-me", workers=1)
            trainers.append(t)
            wait_for(lambda: (j := agent.job("keep-me")) and j["cpus"], 20, what="job journaled")
            wait_for(lambda: "keep-me" in (journal.load(state) or {}).get("jobs", {}), 10, what="journal has the job")
            filler = os.path.join(state, "filler")
            fd = os.open(filler, os.O_WRONLY | os.O_CREAT)   # fill the disk: later journal writes fail part-way
            try:
                while True:
                    os.write(fd, b"\0" * 512)
            except OSError:
                pass
            finally:
                os.close(fd)
            for i in range(30):              # registry changes: each tries a journal write
                trainers.append(Trainer(base, agent.endpoint, job=f"churn-{i}", workers=0, run_s=0.5))
            wait_for(lambda: any("journal not saved" in p for p in agent.status()["agent"]["state_problems"]), 20,
                     what="the failed writes reported in status")
            doc = journal.load(state)         # the last good journal is intact
            assert "keep-me" in doc["jobs"] and not doc["problems"], doc
            assert agent.stop() == 0
        finally:
            agent.stop()
        assert "keep-me" in journal.load(state)["jobs"]
    finally:
        subprocess.run(["umount", state], capture_output=True)


@needs_root
def test_a_read_only_state_dir_opens_no_breaker_and_sigterm_exits_cleanly(base, trainers):
    """Issue 16.9: a read-only state dir opened every job's breaker; SIGTERM then exited 1."""
    if not os.access(f"{CPU}/cgroup.procs", os.W_OK):
        pytest.skip(f"no writable cgroup v1 cpu hierarchy (looked at {CPU})")
    subtree = f"adlsec{os.getpid()}"
    state = f"{base}/state"
    os.makedirs(state)
    _mount("--bind", state, state)
    _mount("-o", "remount,bind,ro", state)
    agent = None
    try:
        agent = AgentProc(base, "--policy", "even", "--tick-s", "0.2", "--cgroup-mode", "v1", state_dir=state,
                          env={"ADLOADER_CGROUP_SUBTREE": subtree}).start()
        t = Trainer(base, agent.endpoint, job="ro", workers=2)
        trainers.append(t)
        j = wait_for(lambda: (x := agent.job("ro")) and x["apply_ok"] is not None and x, 20, what="applied")
        for _ in range(10):                   # several ticks: no breaker opens
            time.sleep(0.2)
            j = agent.job("ro")
            assert j["breaker"] is None and j["apply_ok"] is not False, j
        assert os.path.isdir(f"{CPU}/{subtree}/ro")
        wait_for(lambda: set(t.state().get("worker_pids") or []) <= set(
            int(x) for x in open(f"{CPU}/{subtree}/ro/cgroup.procs").read().split()) and t.state()["worker_pids"],
            10, what="workers in the job's group")
        problems = agent.status()["agent"]["state_problems"]
        assert any("Read-only file system" in p for p in problems), problems
        assert agent.stop() == 0                          # restores from memory, exits 0
        assert not os.path.exists(f"{CPU}/{subtree}")
    finally:
        if agent is not None and agent.proc is not None and agent.proc.poll() is None:
            agent.stop()
        subprocess.run(["umount", state], capture_output=True)
        if os.path.isdir(f"{CPU}/{subtree}"):
            for d in sorted((os.path.join(r, x) for r, ds, _ in os.walk(f"{CPU}/{subtree}") for x in ds),
                            key=lambda d: -d.count("/")):
                os.rmdir(d)
            os.rmdir(f"{CPU}/{subtree}")


@needs_root
def test_corrupt_originals_are_quarantined_the_mode_kept_and_found_groups_restored(base, trainers):
    """Issue 16.9: a corrupt cgroup-originals.json gave a traceback (v1) or a silent fall back to
    off (auto), so a dead agent's groups were never restored."""
    if not os.access(f"{CPU}/cgroup.procs", os.W_OK):
        pytest.skip(f"no writable cgroup v1 cpu hierarchy (looked at {CPU})")
    subtree = f"adlsec{os.getpid()}"
    env = {"ADLOADER_CGROUP_SUBTREE": subtree}
    state = f"{base}/state"
    agent = again = None
    try:
        agent = AgentProc(base, "--policy", "even", "--tick-s", "0.2", "--cgroup-mode", "auto", env=env).start()
        t = Trainer(base, agent.endpoint, job="left", workers=1)
        trainers.append(t)
        wait_for(lambda: os.path.isdir(f"{CPU}/{subtree}/left") and open(f"{CPU}/{subtree}/left/cgroup.procs").read().strip(),
                 40, what="worker in the job's group")
        agent.kill9()                                     # dies with its group in place
        t.kill()
        orig = f"{state}/cgroup-originals.json"
        with open(orig, "w") as f:
            f.write('{"version": 1, "files": {}, "created": [')
        for p in (orig + ".prev",):
            if os.path.exists(p):
                os.unlink(p)
        again = AgentProc(base, "--policy", "even", "--tick-s", "0.2", "--cgroup-mode", "auto", env=env).start()
        doc = again.status()["agent"]
        assert "cgroup-v1" in doc["actuators"], doc["actuators"]        # not silently "off"
        assert any(orig in p and "not valid JSON" in p for p in doc["state_problems"]), doc["state_problems"]
        assert any("left" in p for p in doc["state_problems"])
        assert any(n.startswith("cgroup-originals.json.bad-") for n in os.listdir(state))
        assert again.stop() == 0
        assert not os.path.exists(f"{CPU}/{subtree}/left")           # the dead agent's group is gone
        assert not again.events("agent_failed")
    finally:
        for a in (agent, again):
            if a is not None and a.proc is not None and a.proc.poll() is None:
                a.stop()
        if os.path.isdir(f"{CPU}/{subtree}"):
            for d in sorted((os.path.join(r, x) for r, ds, _ in os.walk(f"{CPU}/{subtree}") for x in ds),
                            key=lambda d: -d.count("/")):
                for pid in open(f"{d}/cgroup.procs").read().split():
                    with open(f"{CPU}/cgroup.procs", "w") as f:
                        f.write(pid)
                os.rmdir(d)
            os.rmdir(f"{CPU}/{subtree}")
        shutil.rmtree(state, ignore_errors=True)
