"""The agent client (adloader.client) in-process, against a fake agent: a real ZeroMQ ROUTER bound by
the test. Checks what the client sends (hello fields, reports, bye), how it applies directives (seq
order, max_workers bound, autotune detached first), that it never raises into training, reconnects
after the agent goes silent, and stays silent without an agent."""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import socket as _real_socket
import types

import pytest
import zmq

from adloader import client, env, protocol
from tests.conftest import wait_for

pytestmark = pytest.mark.component


class Loader:
    """The loader surface the client uses."""

    def __init__(self, workers=2, max_workers=None, fail=False):
        self.num_workers = workers
        self.requested_workers = workers
        self.max_workers = max_workers
        self.batch_size = 16
        self.resizes = []
        self.fail = fail
        self.samples = 0

    def resize(self, n):
        if self.fail:
            raise RuntimeError("resize exploded")
        self.resizes.append(n)
        self.num_workers = n

    def worker_pids(self):
        if self.fail:
            raise RuntimeError("worker_pids exploded")
        return [os.getpid()]

    def stats(self):
        if self.fail:
            raise RuntimeError("stats exploded")
        self.samples += 16
        return {"samples": self.samples, "steps": self.samples // 16, "data_wait_s": float("nan"),
                "workers": self.num_workers, "rates": {"samples_per_s": float("inf")}}


class FakeAgent:
    def __init__(self, path: str):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"ipc://{path}")
        self.endpoint = f"ipc://{path}"

    def recv(self, type_: str, timeout_s: float = 10.0):
        """Next message of ``type_`` -> (identity, msg); other types are skipped."""
        def one():
            if self.sock.poll(50):
                ident, data = self.sock.recv_multipart()
                m = protocol.decode(data)
                if m["type"] == type_:
                    return ident, m
            return None
        return wait_for(one, timeout_s, interval=0, what=f"a {type_} from the client")

    def send(self, ident: bytes, msg: dict) -> None:
        self.sock.send_multipart([ident, protocol.encode(msg)])

    def close(self):
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def endpoint_env(base, monkeypatch):
    ep = f"ipc://{base}/agent.sock"
    monkeypatch.setenv("ADLOADER_ENDPOINT", ep)
    monkeypatch.setenv("ADLOADER_JOB_ID", "unit-job")
    monkeypatch.delenv("ADLOADER_DISABLE", raising=False)
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3")
    # each test gets the client of its own endpoint: loaders of earlier tests in this process (made
    # without an agent, not closed) may still hold one pointed at the default socket
    monkeypatch.setattr(client, "_client", None)
    yield ep


@pytest.fixture
def agent(base, endpoint_env, monkeypatch):
    """The fake agent on the socket ``endpoint_env`` names. At teardown, whether the test passed or
    failed: every loader still attached to each client the test made is detached, and each client is
    stopped even where none of its loaders is alive any more (a test's loaders die with its frame
    before the teardown runs; a client left so kept its thread, which a later test that counts the
    client threads, tests/test_client_misbehaving_agent.py, found); its thread says bye and ends; then
    the agent's socket closes."""
    made = []

    class Recorded(client._Client):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(client, "_Client", Recorded)
    fake = FakeAgent(f"{base}/agent.sock")
    yield fake
    for c in made:
        _detach_all(*(ref() for ref in c._live_loaders()))
        c._stop.set()
        c.join(client.DETACH_WAIT_S)
    fake.close()


@pytest.fixture
def autotune(monkeypatch):
    calls = []
    mod = types.ModuleType("adloader.autotune")
    mod.detach = lambda loader: calls.append(loader)
    monkeypatch.setitem(sys.modules, "adloader.autotune", mod)
    return calls


def _welcomed(agent, lo) -> bytes:
    """Attach ``lo``; the fake agent takes its hello and welcomes it as job "unit-job" (heartbeat 5 s);
    the client's identity at the agent."""
    client.attach(lo)
    ident, _ = agent.recv("hello")
    agent.send(ident, protocol.make("welcome", job="unit-job", heartbeat_s=5.0, challenge=None))
    return ident


def _detach_all(*loaders):
    for lo in loaders:
        client.detach(lo)


def _attach_after_the_verdict(first, second) -> None:
    """Attach ``first``, wait for the client's verdict on its endpoint (``last_error``), then attach
    ``second``: a second loader meets a client that has already judged the endpoint."""
    client.attach(first)
    wait_for(lambda: client.state().get("last_error"), what="the client's verdict on its endpoint")
    client.attach(second)


def test_hello_reports_directives_bye(agent, autotune, monkeypatch):
    monkeypatch.setattr(client, "REPORT_S", 0.1)
    lo = Loader(workers=2, max_workers=5)
    lo.dataset_kind = "iterable"               # adloader.DataLoader's: its workers change only at an epoch
    client.attach(lo)
    client.attach(lo)                      # idempotent
    ident, hello = agent.recv("hello")
    assert ident.startswith(b"unit-job:0:%d:" % os.getpid())
    assert hello["job"] == "unit-job" and hello["rank"] == 0 and hello["pid"] == os.getpid()
    assert hello["gpus"] == ["1", "3"] and hello["uid"] == os.getuid() and hello["worker_pids"] == [os.getpid()]
    assert (hello["workers"], hello["requested_workers"], hello["max_workers"], hello["batch_size"]) == (2, 2, 5, 16)
    assert hello["dataset_kind"] == "iterable"
    agent.send(ident, protocol.make("welcome", job="unit-job", heartbeat_s=1.0, challenge=None))
    _, report = agent.recv("report")
    assert report["stats"]["samples"] > 0
    assert report["stats"]["data_wait_s"] is None and report["stats"]["rates"]["samples_per_s"] is None
    # directives: applied in seq order, bounded by max_workers, autotune detached first
    agent.send(ident, protocol.make("directive", job="unit-job", seq=2, workers=9, cpus=1.5, cpuset=None,
                                    reason="more"))
    wait_for(lambda: lo.resizes == [5], what="resize bounded by max_workers")
    assert autotune == [lo]
    agent.send(ident, protocol.make("directive", job="unit-job", seq=1, workers=1, reason="stale"))
    agent.send(ident, protocol.make("directive", job="unit-job", seq=3, workers=3, reason="fewer"))
    wait_for(lambda: lo.resizes == [5, 3], what="stale seq ignored, next applied")
    st = client.state()
    assert st["connected"] and st["directives"] == 2 and st["last_directive"]["reason"] == "fewer"
    assert autotune == [lo]                # only before the first directive
    client.detach(lo)
    _, bye = agent.recv("bye")
    assert bye["job"] == "unit-job" and bye["pid"] == os.getpid()
    assert client.state() == {"active": False}


def test_a_directive_for_another_job_is_ignored(agent, monkeypatch, caplog):
    """A directive whose job is not this process's (an agent that mixed up its connections) was
    applied, counted, and its seq held back this job's own directives. Now it is ignored (not applied,
    not counted, seq unchanged) and logged once, naming both jobs."""
    import logging

    monkeypatch.setattr(client, "REPORT_S", 0.1)
    monkeypatch.setattr(client, "_warned", set())
    lo = Loader(workers=2, max_workers=8)
    with caplog.at_level(logging.DEBUG, logger="adloader.client"):
        ident = _welcomed(agent, lo)
        agent.send(ident, protocol.make("directive", job="other-job", seq=5, workers=7, reason="not yours"))
        agent.send(ident, protocol.make("directive", job="other-job", seq=6, workers=6, reason="not yours"))
        agent.send(ident, protocol.make("directive", job="unit-job", seq=1, workers=3, reason="yours"))
        wait_for(lambda: lo.resizes == [3], what=f"only this job's directive applied (resizes {lo.resizes})")
        st = client.state()
        assert st["directives"] == 1 and st["last_directive"]["seq"] == 1
    foreign = [r.getMessage() for r in caplog.records if "other-job" in r.getMessage()]
    assert len(foreign) == 1 and "unit-job" in foreign[0], foreign
    assert [r.levelno for r in caplog.records if "other-job" in r.getMessage()] == [logging.WARNING]


def test_a_welcome_for_another_job_is_refused_with_one_warning_and_hello_is_said_again(agent, monkeypatch,
                                                                                         caplog):
    """A ``welcome`` naming another job than the one this process said hello for (an agent that mixed up
    its connections) was taken: the client counted itself connected, sent that agent its reports and
    took its directives. Now it is refused with one WARNING naming both jobs: the client stays
    unwelcomed, takes no directive on that connection (directives before any welcome are ignored too)
    and says hello again after its back-off; a welcome for its own job then works as before."""
    import logging

    monkeypatch.setattr(client, "REPORT_S", 0.1)
    monkeypatch.setattr(client, "HELLO_RETRY_S", 0.05)
    monkeypatch.setattr(client, "_warned", set())
    lo = Loader(workers=2, max_workers=8)
    with caplog.at_level(logging.DEBUG, logger="adloader.client"):
        client.attach(lo)
        ident, _ = agent.recv("hello")
        for _ in range(3):
            agent.send(ident, protocol.make("welcome", job="other-job", heartbeat_s=5.0, challenge=None))
        agent.send(ident, protocol.make("directive", job="unit-job", seq=1, workers=7, reason="before welcome"))
        ident2, _ = agent.recv("hello")              # said hello again: the welcome was not taken
        st = client.state()
        assert not st["connected"] and st["welcomes"] == 0 and st["reports_sent"] == 0
        assert "other-job" in st["last_error"] and lo.resizes == []
        agent.send(ident2, protocol.make("welcome", job="unit-job", heartbeat_s=5.0, challenge=None))
        agent.recv("report")
        agent.send(ident2, protocol.make("directive", job="unit-job", seq=1, workers=3, reason="yours"))
        wait_for(lambda: lo.resizes == [3], what=f"the directive after the right welcome (resizes {lo.resizes})")
        assert client.state()["connected"] and client.state()["welcomes"] == 1
    foreign = [r for r in caplog.records if "other-job" in r.getMessage() and r.levelno >= logging.WARNING]
    assert len(foreign) == 1 and "unit-job" in foreign[0].getMessage(), [r.getMessage() for r in foreign]


def test_a_directive_with_a_negative_worker_count_is_ignored(agent, autotune, monkeypatch, caplog):
    """A directive with workers < 0 was clamped to 0 workers (in-process loading, the biggest change a
    directive can make). Now nothing changes: no resize, autotune left attached, not counted, the seq
    not advanced; one WARNING however many such directives come."""
    import logging

    monkeypatch.setattr(client, "REPORT_S", 0.1)
    monkeypatch.setattr(client, "_warned", set())
    lo = Loader(workers=2, max_workers=8)
    with caplog.at_level(logging.DEBUG, logger="adloader.client"):
        ident = _welcomed(agent, lo)
        agent.send(ident, protocol.make("directive", job="unit-job", seq=1, workers=-1, reason="bad"))
        agent.send(ident, protocol.make("directive", job="unit-job", seq=2, workers=-3, reason="bad"))
        agent.recv("report")
        assert lo.resizes == [] and autotune == [] and client.state()["directives"] == 0
        agent.send(ident, protocol.make("directive", job="unit-job", seq=1, workers=3, reason="good"))
        wait_for(lambda: lo.resizes == [3], what=f"the next valid directive applied (resizes {lo.resizes})")
        assert client.state()["directives"] == 1 and autotune == [lo]
    bad = [r for r in caplog.records if "workers=" in r.getMessage() and "ignoring" in r.getMessage()]
    assert [r.levelno for r in bad] == [logging.WARNING], [r.getMessage() for r in bad]


def test_a_resize_warning_made_an_error_is_no_failure_of_the_directive(agent, monkeypatch):
    """Under ``python -W error`` the loader's warning that an IterableDataset resizes at the next epoch
    is an exception, raised after the resize is done: the client counted the directive as failed. It
    is applied and counted, and the client goes on with the next one."""
    import warnings

    class WarnsOnResize(Loader):
        def resize(self, n):
            super().resize(n)
            warnings.warn(f"adloader: resize({n}) on an IterableDataset takes effect at the next epoch")

    monkeypatch.setattr(client, "REPORT_S", 0.1)
    lo = WarnsOnResize(workers=2, max_workers=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ident = _welcomed(agent, lo)
        agent.send(ident, protocol.make("directive", job="unit-job", seq=1, workers=3, reason="r"))
        agent.send(ident, protocol.make("directive", job="unit-job", seq=2, workers=4, reason="r"))
        wait_for(lambda: client.state().get("directives") == 2, what="both directives applied and counted")
        assert lo.resizes == [3, 4] and client.state()["last_directive"]["applied_workers"] == 4


def test_a_loader_dropped_without_close_does_not_silence_the_next_one(agent, monkeypatch):
    # a loader garbage-collected without close(): the client thread finds no loader, says bye and
    # stops. A loader made afterwards in the same process must get a client that works (it used to be
    # added to the stopped one and never said hello: the agent never saw that job again).
    import gc

    monkeypatch.setattr(client, "REPORT_S", 0.1)
    first, second = Loader(), Loader(workers=3)
    client.attach(first)
    ident, _ = agent.recv("hello")
    agent.send(ident, protocol.make("welcome", job="unit-job", heartbeat_s=1.0, challenge=None))
    agent.recv("report")
    del first
    gc.collect()
    agent.recv("bye")
    client.attach(second)
    ident2, hello = agent.recv("hello")
    assert hello["workers"] == 3 and ident2 != ident
    agent.send(ident2, protocol.make("welcome", job="unit-job", heartbeat_s=1.0, challenge=None))
    agent.send(ident2, protocol.make("directive", job="unit-job", seq=1, workers=2, reason="r"))
    wait_for(lambda: second.resizes == [2], what="the new loader's directive applied")


@contextlib.contextmanager
def _a_real_loader_grown_by_the_agent(base):
    """A fake agent and a real ``adloader.DataLoader`` (1 worker of its own, at most 4), iterated once;
    the agent welcomes its hello and directs 3 workers. Yields (agent, loader, iterator, the client's
    identity); closes both."""
    from adloader import DataLoader

    agent = FakeAgent(f"{base}/agent.sock")
    loader = DataLoader(list(range(100000)), batch_size=4, num_workers=1, max_workers=4, persistent_workers=True)
    try:
        it = iter(loader)
        next(it)
        ident, _ = agent.recv("hello")
        agent.send(ident, protocol.make("welcome", job="unit-job", heartbeat_s=5.0, challenge=None))
        agent.send(ident, protocol.make("directive", job="unit-job", seq=1, workers=3, reason="grow"))
        yield agent, loader, it, ident
    finally:
        loader.close()
        agent.close()


def test_a_client_thread_that_fails_hands_the_loader_back_its_own_count_and_starts_again(base, endpoint_env,
                                                                                          monkeypatch, caplog):
    """The client thread's loop raised (a bug of the client's own; injected here in the report it builds
    after a directive) and the thread ended: one line of WARNING without the traceback, a real loader
    left for good at the count the agent had set (3 workers where the job asked for 1, which nobody
    managed any more), and the training loader, which attaches once, never reported again. Now the
    failure is one WARNING with the job, the endpoint and the traceback; the loader goes back to its
    own count at once and keeps loading; the client starts again after its back-off, says hello and
    takes the agent's directives again."""
    pytest.importorskip("torch")
    import logging

    monkeypatch.setattr(client, "REPORT_S", 0.05)
    monkeypatch.setattr(client, "RESTART_S", 0.05)
    monkeypatch.setattr(client, "_warned", set())
    real, failed = client._Client._report, []

    def report(self, loader):
        if self.snapshot()["directives"] and not failed:
            failed.append(True)
            raise RuntimeError("a bug in the client")
        return real(self, loader)

    monkeypatch.setattr(client._Client, "_report", report)
    with caplog.at_level(logging.DEBUG, logger="adloader.client"), \
            _a_real_loader_grown_by_the_agent(base) as (agent, loader, it, ident):
        ident2, hello = agent.recv("hello")          # the client started again, on a new socket
        assert failed and ident2 != ident
        assert loader.num_workers == 1 and hello["workers"] == 1    # handed back its own count
        st = client.state()
        assert st["active"] and st["restarts"] == 1 and "a bug in the client" in st["last_error"]
        next(it)                                     # the loader went on loading
        agent.send(ident2, protocol.make("welcome", job="unit-job", heartbeat_s=5.0, challenge=None))
        agent.send(ident2, protocol.make("directive", job="unit-job", seq=1, workers=2, reason="again"))
        wait_for(lambda: loader.num_workers == 2, what="the directive after the restart applied")
        next(it)
    died = [r for r in caplog.records if r.levelno >= logging.WARNING and "a bug in the client" in r.getMessage()]
    assert len(died) == 1 and "\n" not in died[0].getMessage(), [r.getMessage() for r in caplog.records]
    assert "unit-job" in died[0].getMessage() and endpoint_env in died[0].getMessage()
    assert died[0].exc_info and died[0].exc_info[0] is RuntimeError     # the traceback, once


def test_a_client_thread_that_keeps_failing_stops_and_the_next_attach_replaces_it_with_its_loaders(
        agent, monkeypatch, caplog):
    """A client whose loop fails every time it starts (a bug: here its session raises until a flag is
    cleared) is started again at most ``MAX_RESTARTS`` times, then stops with one more WARNING saying so;
    ``state()`` says it is not active. The next attach starts a fresh client that takes over the
    loaders already attached (the training loader attaches only once) and serves them."""
    import logging

    monkeypatch.setattr(client, "REPORT_S", 0.1)
    monkeypatch.setattr(client, "RESTART_S", 0.01)
    monkeypatch.setattr(client, "MAX_RESTARTS", 2)
    monkeypatch.setattr(client, "_warned", set())
    real, calls, broken = client._Client._session, [], [True]

    def session(self, zmq, ctx):
        calls.append(self)
        if broken:
            raise RuntimeError("a bug in the client")
        return real(self, zmq, ctx)

    monkeypatch.setattr(client._Client, "_session", session)
    first, second = Loader(), Loader(workers=3)
    with caplog.at_level(logging.DEBUG, logger="adloader.client"):
        client.attach(first)
        wait_for(lambda: calls and not calls[0]._thread.is_alive(), what="the client thread to stop")
        assert len(calls) == 3 and all(c is calls[0] for c in calls)      # the first try and 2 restarts
        assert client.state() == {"active": False, "gave_up": True, "restarts": 2,
                                  "last_error": "client thread failed: RuntimeError: a bug in the client"}
        broken.clear()
        client.attach(second)                      # never raises; a fresh client
        ident, hello = agent.recv("hello")
        assert calls[-1] is not calls[0] and client.state()["active"]
        agent.send(ident, protocol.make("welcome", job="unit-job", heartbeat_s=1.0, challenge=None))
        agent.send(ident, protocol.make("directive", job="unit-job", seq=1, workers=4, reason="r"))
        wait_for(lambda: first.resizes == [4], what="the directive applied to the loader attached first")
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 2 and "a bug in the client" in warned[0] and "starts again" in warned[0], warned
    assert "stops after 3 failures" in warned[1], warned


def test_a_loader_whose_client_gave_up_trains_at_its_own_count_and_the_state_says_so(base, endpoint_env, monkeypatch,
                                                                                      caplog):
    """A client that fails past ``MAX_RESTARTS`` stops until the next attach, which the training loader
    (attached once, at its first iteration) never makes. The loader it directed trains on at the
    worker count its user chose, not at the agent's; the log says it once (a WARNING that the client
    stops, after the one for the first failure); and ``state()`` says the client gave up, after how
    many restarts and on what (before: ``{"active": False}``, as with no client at all)."""
    pytest.importorskip("torch")
    import logging

    monkeypatch.setattr(client, "REPORT_S", 0.05)
    monkeypatch.setattr(client, "RESTART_S", 0.01)
    monkeypatch.setattr(client, "MAX_RESTARTS", 2)
    monkeypatch.setattr(client, "_warned", set())
    real_report, real_session, broken = client._Client._report, client._Client._session, []

    def report(self, loader):
        if broken:
            raise RuntimeError("a bug in the client")
        return real_report(self, loader)

    def session(self, zmq, ctx):
        if broken:
            raise RuntimeError("a bug in the client")
        return real_session(self, zmq, ctx)

    monkeypatch.setattr(client._Client, "_report", report)
    monkeypatch.setattr(client._Client, "_session", session)
    with caplog.at_level(logging.DEBUG, logger="adloader.client"), \
            _a_real_loader_grown_by_the_agent(base) as (agent, loader, it, ident):
        wait_for(lambda: loader.num_workers == 3, what="the agent's directive applied")
        broken.append(True)
        st = wait_for(lambda: (s := client.state()).get("gave_up") and s, what="the client to give up")
        assert st["active"] is False and st["restarts"] == 2 and "a bug in the client" in st["last_error"]
        assert loader.num_workers == 1 and loader.requested_workers == 1
        wait_for(lambda: len(loader.worker_pids()) == 1, what="the loader back at its own worker")
        for _ in range(20):                      # and it trains on
            next(it)
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 2 and "starts again" in warned[0] and "stops after 3 failures" in warned[1], warned
    assert client.state() == {"active": False}      # closed: no client at all


def test_reports_and_directives_follow_the_training_loader_not_the_first_one_iterated(agent, monkeypatch):
    """A validation loader iterated before the training loader (Lightning's sanity check runs two
    validation batches before training starts) was the client's loader for good: its idle stats were
    reported and the agent's directives resized it, while the training loader kept its own count. The
    loader whose longest pass handed out the most batches is the one reported and directed; when the
    training loader overtakes, it gets the agent's last count and the other goes back to its own."""
    pytest.importorskip("torch")
    from adloader import DataLoader

    monkeypatch.setattr(client, "REPORT_S", 0.05)
    val = DataLoader(list(range(64)), batch_size=4, num_workers=0, max_workers=3)
    train = DataLoader(list(range(4000)), batch_size=4, num_workers=0, max_workers=3)
    try:
        val_it = iter(val)
        next(val_it), next(val_it)                  # the sanity check: val attaches first
        ident, hello = agent.recv("hello")
        agent.send(ident, protocol.make("welcome", job="unit-job", heartbeat_s=5.0, challenge=None))
        agent.send(ident, protocol.make("directive", job="unit-job", seq=1, workers=2, reason="cold start"))
        wait_for(lambda: client.state().get("directives") == 1, what="the first directive applied")
        del val_it
        it = iter(train)
        for _ in range(5):
            next(it)
        wait_for(lambda: train.num_workers == 2 and val.num_workers == 0,
                 what=f"the agent's count on the training loader (train {train.num_workers}, val {val.num_workers})")
        wait_for(lambda: agent.recv("report")[1]["stats"]["steps"] >= 5, what="a report of the training loader")
        agent.send(ident, protocol.make("directive", job="unit-job", seq=2, workers=3, reason="more"))
        wait_for(lambda: train.num_workers == 3, what="the next directive on the training loader")
        assert val.num_workers == 0 and val.requested_workers == 0 and train.requested_workers == 0
        assert sorted(int(x) for b in it for x in b) == list(range(20, 4000))
    finally:
        for lo in (train, val):
            lo.close()


@pytest.mark.parametrize("val_loader", ["adloader", "torch"])
def test_reports_count_every_process_the_training_process_started_as_the_jobs_cpu(agent, monkeypatch, val_loader):
    """``job_cpu_s`` in every report: the process's CPU and every process it started
    (``adloader.proctree``). A validation pass whose loader's one real worker burns 0.6 s of CPU while the
    training loader (the primary, reported) stands still: the reports' count rises by all of that
    worker's CPU, and by no more than it and what this process used meanwhile; the same whether the
    validation loader is an A-Dloader one (attached to the client) or torch's own (which the client
    never sees)."""
    import time

    pytest.importorskip("torch")
    import torch.utils.data as tud

    from adloader import DataLoader
    from tests.agentd_support import BurningDataset

    monkeypatch.setattr(client, "REPORT_S", 0.05)
    train = DataLoader(list(range(4000)), batch_size=4, num_workers=0)
    val = (DataLoader if val_loader == "adloader" else tud.DataLoader)(BurningDataset(12, 0.05), batch_size=2,
                                                                       num_workers=1)

    def mine():                                  # this process's CPU and its reaped children's
        t = os.times()
        return time.process_time() + t.children_user + t.children_system

    try:
        m0 = mine()                              # (every report's count of this process is past it)
        it = iter(train)
        for _ in range(5):
            next(it)
        ident, _ = agent.recv("hello")
        agent.send(ident, protocol.make("welcome", job="unit-job", heartbeat_s=5.0, challenge=None))
        r0 = wait_for(lambda: (lambda m: m["stats"] if m["stats"].get("steps") == 5 else None)(agent.recv("report")[1]),
                      what="a report of the training loader")["job_cpu_s"]
        c0 = os.times().children_user + os.times().children_system
        assert sorted(x for b in val for x in b.tolist()) == list(range(12))     # the validation pass
        if val_loader == "adloader":
            val.close()                          # (torch's worker exits at the end of its epoch)
        # the worker, reaped: its CPU is this process's children's
        wait_for(lambda: os.times().children_user + os.times().children_system - c0 >= 0.55, 30,
                 what="the validation worker's CPU among this process's reaped children's")
        reaped = train.stats()["uptime_s"]       # a report made after the worker was reaped (reports queue)
        r1 = wait_for(lambda: (lambda m: m if m["uptime_s"] > reaped else None)(agent.recv("report")[1]["stats"]),
                      what="a report after the validation pass")
        m1 = mine()
        assert r1["steps"] == 5                  # the training loader's stats: it took no step meanwhile
        assert 0.55 <= r1["job_cpu_s"] - r0 <= m1 - m0 + 0.02      # (0.02: /proc's clock ticks)
    finally:
        for lo in (train, val):
            if hasattr(lo, "close"):
                lo.close()


@pytest.mark.parametrize("val_loader", ["adloader", "torch"])
def test_reports_carry_what_the_other_loaders_workers_hold(agent, monkeypatch, val_loader):
    """``other_loader_memory_bytes`` in every report: what the workers of the loaders other than the
    primary hold (the agent does not size them; it plans the primary's within the budget they leave).
    A validation loader whose one real worker holds 64 MiB of its own: 0 before the pass, at least that
    while the worker lives (its start-up's copied pages aside, not much more), 0 again once it stopped;
    the same whether the validation loader is an A-Dloader one or torch's own. The primary's own memory
    figures are the training loader's."""
    pytest.importorskip("torch")
    import torch.utils.data as tud

    from adloader import DataLoader
    from tests.agentd_support import HoldingDataset

    MiB = 1 << 20
    monkeypatch.setattr(client, "REPORT_S", 0.05)
    train = DataLoader(list(range(4000)), batch_size=4, num_workers=0)
    val = (DataLoader if val_loader == "adloader" else tud.DataLoader)(HoldingDataset(400, 64), batch_size=2,
                                                                       num_workers=1)

    def other():
        return agent.recv("report")[1]["stats"]

    try:
        it = iter(train)
        next(it)
        ident, _ = agent.recv("hello")
        agent.send(ident, protocol.make("welcome", job="unit-job", heartbeat_s=5.0, challenge=None))
        assert wait_for(lambda: "other_loader_memory_bytes" in (s := other()) and s,
                        what="a report")["other_loader_memory_bytes"] == 0
        vit = iter(val)
        next(vit)                                # the worker holds its 64 MiB from its first sample on
        got = wait_for(lambda: (s := other())["other_loader_memory_bytes"] >= 64 * MiB and s,
                       what="a report counting the validation worker's memory")
        assert got["other_loader_memory_bytes"] < 64 * MiB + 48 * MiB
        assert got["memory_workers"] == 0 and got["worker_uss_bytes"] == 0     # the primary's: no workers
        for _ in vit:                            # the pass's end: torch stops its worker
            pass
        del vit
        if val_loader == "adloader":
            val.close()
        wait_for(lambda: other()["other_loader_memory_bytes"] == 0, what="a report once the worker stopped")
    finally:
        for lo in (train, val):
            if hasattr(lo, "close"):
                lo.close()


def test_reports_list_torchs_own_loaders_workers_after_the_attached_loaders(agent, monkeypatch):
    """A validation loader left as torch's own never attaches; its workers are listed in the reports'
    ``worker_pids`` after the attached loaders' (the primary's first, once), while they live, so the agent
    places them with the job's loader workers; once its epoch ends they are no longer listed. A
    non-daemon multiprocessing child (a rank a launcher started) is never listed."""
    import multiprocessing

    pytest.importorskip("torch")
    import torch.utils.data as tud

    from adloader import DataLoader

    monkeypatch.setattr(client, "REPORT_S", 0.05)
    train = DataLoader(list(range(4000)), batch_size=4, num_workers=1)
    val = tud.DataLoader(list(range(400)), batch_size=2, num_workers=2)
    other = multiprocessing.get_context("fork").Process(target=time_sleep, args=(60,), daemon=False)
    other.start()
    try:
        it = iter(train)
        next(it)
        ident, _ = agent.recv("hello")
        agent.send(ident, protocol.make("welcome", job="unit-job", heartbeat_s=5.0, challenge=None))
        vit = iter(val)
        next(vit)
        torch_pids = sorted(w.pid for w in vit._workers)
        mine = train.worker_pids(retiring=False)
        got = wait_for(lambda: (lambda m: m["worker_pids"] if set(torch_pids) <= set(m["worker_pids"]) else None)(
            agent.recv("report")[1]), what="a report listing torch's loader's workers")
        assert got == mine + torch_pids and other.pid not in got
        for _ in vit:                            # the epoch's end: torch stops its workers
            pass
        del vit
        wait_for(lambda: (lambda m: m["worker_pids"] == mine)(agent.recv("report")[1]),
                 what="a report without them once they stopped")
    finally:
        other.kill()
        other.join()
        train.close()


def test_new_workers_are_reported_at_once_not_a_report_period_later(agent, monkeypatch):
    """A worker that the last report did not list (a validation pass's torch loader starting its worker)
    is listed in a report sent at once, not at the next period: with an hour's period no report of the
    test is a periodic one, and each new worker (the welcome's loader's, a torch validation loader's, a
    resize's) is listed in the next report all the same."""
    pytest.importorskip("torch")
    import torch.utils.data as tud

    from adloader import DataLoader

    monkeypatch.setattr(client, "REPORT_S", 3600.0)
    train = DataLoader(list(range(4000)), batch_size=4, num_workers=1)
    val = tud.DataLoader(list(range(400)), batch_size=2, num_workers=1)
    try:
        it = iter(train)
        next(it)
        ident, _ = agent.recv("hello")
        agent.send(ident, protocol.make("welcome", job="unit-job", heartbeat_s=30.0, challenge=None))
        mine = train.worker_pids(retiring=False)
        assert agent.recv("report")[1]["worker_pids"] == mine        # (the welcome's: its workers unlisted yet)
        vit = iter(val)
        next(vit)
        torch_pids = [w.pid for w in vit._workers]
        assert agent.recv("report")[1]["worker_pids"] == mine + torch_pids
        train.resize(2)
        next(it)
        wait_for(lambda: len(train.worker_pids(retiring=False)) == 2, 30, what="the resize's new worker")
        assert agent.recv("report")[1]["worker_pids"] == train.worker_pids(retiring=False) + torch_pids
    finally:
        train.close()


def time_sleep(s):
    import time

    time.sleep(s)


def _choose(c, *loaders):
    """The primary of ``loaders`` (attached in this order) by ``c``'s rule."""
    import weakref

    c._loaders = [weakref.ref(lo) for lo in loaders]
    return c._primary()


def test_a_training_loader_rebuilt_every_epoch_stays_the_primary_beside_a_long_lived_validation_loader(
        endpoint_env, monkeypatch):
    """Some training scripts build a new DataLoader for every epoch. By lifetime batches the long-lived
    validation loader (here 4 batches a pass, 12 after three epochs) won over every later epoch's
    training loader (10 batches) for good: its idle stats were reported and the directives resized it.
    By the longest pass alone, the new training loader took the role only once past the validation
    loader's 4 batches, so every epoch began with the directive on the validation loader. By its
    length (10 batches), the new one takes the role at its first batch, keeps it through the validation
    pass, and Lightning's sanity check (two validation batches before training) does not win either."""
    pytest.importorskip("torch")
    from adloader import DataLoader

    monkeypatch.setenv("ADLOADER_DISABLE", "1")      # the test's own client, nothing attached by the loaders
    c = client._Client()
    val = DataLoader(list(range(16)), batch_size=4, num_workers=0)
    sanity = iter(val)
    next(sanity), next(sanity)
    del sanity
    for epoch in range(5):
        train = DataLoader(list(range(40)), batch_size=4, num_workers=0)
        assert _choose(c, val, train) is val         # not iterated yet: the validation loader leads
        primary = [_choose(c, val, train) is train for _ in train]
        assert all(primary), (epoch, primary)        # from its first batch on
        assert [_choose(c, val, train) is train for _ in val] == [True] * 4, epoch
        train.close()
    val.close()


def test_a_validation_loader_iterated_within_every_epoch_does_not_take_the_role(endpoint_env, monkeypatch):
    """Validation twice an epoch (Lightning's ``val_check_interval=0.5``), 6 batches a pass, beside a
    training loader of 10 batches an epoch: by lifetime batches the validation loader (12 an epoch) won
    from the first epoch on. By the longest pass the training loader is the primary from its first
    full epoch on, through every validation pass."""
    pytest.importorskip("torch")
    from adloader import DataLoader

    monkeypatch.setenv("ADLOADER_DISABLE", "1")
    c = client._Client()
    train = DataLoader(list(range(40)), batch_size=4, num_workers=0)
    val = DataLoader(list(range(24)), batch_size=4, num_workers=0)
    for epoch in range(4):
        seen = []
        for i, _ in enumerate(train):
            seen.append(_choose(c, train, val) is train)
            if i in (4, 9):
                seen += [_choose(c, train, val) is train for _ in val]
        if epoch:
            assert all(seen), (epoch, seen)
    train.close()
    val.close()


def test_workers_a_directive_starts_get_the_training_threads_affinity_not_the_client_threads(agent, monkeypatch):
    """``os.sched_setaffinity(0, ...)`` in a training script sets its main thread's mask only; the
    client's thread, started at the loader's first ``iter()``, kept the mask it was created with, and a
    worker process is forked from the thread that starts it and inherits that thread's mask: the workers
    a directive started ran on CPUs the script had left. The pool gives every worker it starts the main
    thread's mask, whichever thread starts it (adloader._affinity), so a real worker started by a
    directive runs where the training script pinned itself."""
    pytest.importorskip("torch")
    from adloader import DataLoader

    mask = os.sched_getaffinity(0)
    if len(mask) < 2:
        pytest.skip("needs at least 2 CPUs in this process's affinity mask")
    one = {min(mask)}
    monkeypatch.setattr(client, "REPORT_S", 0.05)
    loader = DataLoader(list(range(4000)), batch_size=4, num_workers=0, max_workers=2)
    try:
        it = iter(loader)
        next(it)                                    # attaches: the client's thread starts with the whole mask
        ident, _ = agent.recv("hello")
        agent.send(ident, protocol.make("welcome", job="unit-job", heartbeat_s=5.0, challenge=None))
        os.sched_setaffinity(0, one)                # the training script pins itself (its main thread)
        agent.send(ident, protocol.make("directive", job="unit-job", seq=1, workers=1, reason="start one"))
        pids = wait_for(loader.worker_pids, what="a worker started by the directive")
        assert [os.sched_getaffinity(p) for p in pids] == [one]
        next(it)                                    # and the loader goes on with it
    finally:
        loader.close()
        os.sched_setaffinity(0, mask)


def test_reconnects_and_says_hello_again_after_agent_silence(agent, monkeypatch):
    monkeypatch.setattr(client, "REPORT_S", 0.05)
    monkeypatch.setattr(client, "HELLO_RETRY_S", 0.1)
    lo = Loader()
    client.attach(lo)
    ident, _ = agent.recv("hello")
    agent.send(ident, protocol.make("welcome", job="unit-job", heartbeat_s=0.1, challenge=None))
    agent.recv("report")
    # the agent says nothing more: after 3 heartbeats the client drops the socket and says hello anew
    ident2, _ = agent.recv("hello", timeout_s=10)
    assert ident2 != ident and ident2.startswith(b"unit-job:0:")
    # an error unknown_job (agent restarted and forgot us) also brings a new hello
    agent.send(ident2, protocol.make("welcome", job="unit-job", heartbeat_s=5.0, challenge=None))
    agent.recv("report")
    agent.send(ident2, protocol.error("unknown_job", "send hello first"))
    agent.recv("hello")


def test_hello_sends_the_batch_size_stats_reports_none_before_a_batch_samplers_first_batch(agent, monkeypatch):
    """A loader with a custom batch_sampler has torch's ``batch_size`` None; ``stats()`` reports the mean
    delivered batch, None before the first. Its hello says the same: null at first (it said 1, a batch
    of one sample), then, in the hello after a reconnect, the mean (4 here, as the reports say)."""
    from adloader import DataLoader

    monkeypatch.setattr(client, "REPORT_S", 0.05)
    dl = DataLoader(list(range(16)), batch_sampler=[[0, 1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11]], num_workers=0)
    try:
        client.attach(dl)
        ident, hello = agent.recv("hello")
        assert dl.batch_size is None and dl.stats()["batch_size"] is None and hello["batch_size"] is None
        assert [len(b) for b in dl] == [6, 2, 4]
        agent.send(ident, protocol.make("welcome", job="unit-job", heartbeat_s=5.0, challenge=None))
        _, report = agent.recv("report")
        assert report["stats"]["batch_size"] == 4
        agent.send(ident, protocol.error("unknown_job", "send hello first"))
        _, hello = agent.recv("hello")
        assert hello["batch_size"] == 4
    finally:
        dl.close()


def test_hello_and_reports_say_the_processs_cgroup_cpu_quota(agent, monkeypatch):
    """The process's cgroup CPU quota (a container's CPU limit) goes in the hello and in every report,
    read again each time (an in-place resize moves it); the agent, outside the container's cgroup
    namespace, cannot read it itself. None where there is no quota, and a failing read is no quota."""
    from adloader import DataLoader, autotune

    quota = [1.5]

    def read(*_a, **_k):
        if quota[0] == "boom":
            raise OSError("unreadable")
        return quota[0]

    monkeypatch.setattr(autotune, "cgroup_cpu_quota", read)
    monkeypatch.setattr(client, "REPORT_S", 0.05)
    dl = DataLoader(list(range(16)), batch_size=4, num_workers=0)
    try:
        client.attach(dl)
        ident, hello = agent.recv("hello")
        assert hello["cpu_quota"] == 1.5
        agent.send(ident, protocol.make("welcome", job="unit-job", heartbeat_s=5.0, challenge=None))
        assert list(dl)
        _, report = agent.recv("report")
        assert report["cpu_quota"] == 1.5
        quota[0] = None
        wait_for(lambda: agent.recv("report")[1]["cpu_quota"] is None, 10, what="a report without a quota")
        quota[0] = "boom"
        wait_for(lambda: agent.recv("report")[1]["cpu_quota"] is None, 10, what="a report after a failed read")
    finally:
        dl.close()


@pytest.mark.parametrize("heartbeat_s", ["soon", [1], -1.0, 1e-9, 1e9])
def test_a_welcome_with_a_bad_heartbeat_period_neither_stops_nor_churns_the_client(agent, monkeypatch,
                                                                                    heartbeat_s):
    """A welcome whose heartbeat_s is not a positive number (the schema does not type it): the client
    thread died on float() of a string or a list (the process had no agent contact again, and its state
    still said active and connected), and a negative period made it drop every connection at once and
    say hello again. The default period is used instead."""
    monkeypatch.setattr(client, "REPORT_S", 0.05)
    lo = Loader()
    client.attach(lo)
    ident, _ = agent.recv("hello")
    welcome = protocol.make("welcome", job="unit-job", challenge=None)
    welcome["heartbeat_s"] = heartbeat_s
    agent.send(ident, welcome)
    for _ in range(3):
        assert agent.recv("report")[0] == ident      # reports on the same connection
    agent.send(ident, protocol.make("directive", job="unit-job", seq=1, workers=3, reason="x"))
    wait_for(lambda: lo.resizes == [3], what="the directive applied")
    assert client.state()["welcomes"] == 1


def test_stats_that_json_cannot_encode_are_reported_as_numbers_or_left_out(agent, monkeypatch):
    """A loader whose stats() holds a value json cannot encode (a NumPy integer from a subclass's own
    figures): building the report raised TypeError and the client thread died (no report, no directive
    for the rest of the process). Numbers go as numbers, anything else as null."""
    np = pytest.importorskip("numpy")
    monkeypatch.setattr(client, "REPORT_S", 0.05)

    class Extra(Loader):
        def stats(self):
            return {**super().stats(), "queued": np.int64(3), "ratio": np.float32(0.5), "tag": object(),
                    "nested": {"n": np.int32(7), "bad": np.float64("nan")}}

    lo = Extra()
    ident = _welcomed(agent, lo)
    _, report = agent.recv("report")
    st = report["stats"]
    assert (st["queued"], st["ratio"], st["tag"], st["nested"]) == (3, 0.5, None, {"n": 7, "bad": None})
    assert st["samples"] > 0
    agent.send(ident, protocol.make("directive", job="unit-job", seq=1, workers=3, reason="x"))
    wait_for(lambda: lo.resizes == [3], what="the directive applied")


def test_failing_loader_and_refusals_never_raise(agent, monkeypatch):
    monkeypatch.setattr(client, "REPORT_S", 0.05)
    lo = Loader(fail=True)
    client.attach(lo)
    ident, hello = agent.recv("hello")
    assert hello["worker_pids"] == []
    agent.send(ident, protocol.make("welcome", job="unit-job", heartbeat_s=5.0, challenge=None))
    _, report = agent.recv("report")
    assert report["stats"] == {}
    agent.send(ident, protocol.make("directive", job="unit-job", seq=1, workers=3, reason="x"))
    agent.send(ident, protocol.make("heartbeat"))
    agent.sock.send_multipart([ident, b"\xff garbage"])
    agent.recv("report")                       # still alive and reporting
    assert client.state()["directives"] == 0   # resize raised: not counted, not raised
    agent.send(ident, protocol.error("not_permitted", "job 'unit-job' belongs to uid 7"))
    wait_for(lambda: "not_permitted" in (client.state().get("last_error") or ""), what="refusal noted")


def test_a_refusal_is_logged_once_however_often_the_client_tries_again(agent, monkeypatch, caplog):
    """An agent that refuses this process (not_permitted, over_limit) is asked again after a back-off;
    each refusal was logged at WARNING again (every 60 s for the whole run, in the user's log). Once per
    distinct refusal; the client's state keeps the last one."""
    import logging

    monkeypatch.setattr(client, "REFUSED_BACKOFF_S", 0.05)
    monkeypatch.setattr(client, "_warned", set())
    lo = Loader()
    with caplog.at_level(logging.WARNING, logger="adloader.client"):
        client.attach(lo)
        for _ in range(3):
            ident, _ = agent.recv("hello")
            agent.send(ident, protocol.error("not_permitted", "rank 0 of job 'unit-job' is held by live pid 1"))
        ident, _ = agent.recv("hello")
        agent.send(ident, protocol.error("over_limit", "uid 0 has 64 jobs (agent key max_jobs_per_uid)"))
        wait_for(lambda: "over_limit" in (client.state().get("last_error") or ""), what="the second refusal")
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 2 and "not_permitted" in refusals[0] and "over_limit" in refusals[1], refusals


@pytest.mark.parametrize("value", ["ipc://", "ipc://agent.sock", "bogus", "carrier-pigeon://x", "ipc:///" + "x" * 120,
                                   "ipc:///" + "\u00e9" * 60])
def test_a_malformed_adloader_endpoint_is_one_warning_naming_it_and_no_agent_contact(base, agent, monkeypatch,
                                                                                    caplog, value):
    """ADLOADER_ENDPOINT is checked as the agent checks its own endpoint (``protocol.endpoint_problem``):
    a malformed one is one warning naming the variable, its value and why, for every loader, and the
    client contacts no agent; training goes on. Before, the relative 'ipc://agent.sock', run where an
    agent listens at ./agent.sock, said hello to it (another working directory: another file); 'ipc://'
    was taken, silently, for an agent not there yet; 'bogus' was warned about as an untrusted agent,
    without the variable's name."""
    import logging

    monkeypatch.setattr(env, "_reported", set())
    monkeypatch.chdir(base)
    monkeypatch.setenv("ADLOADER_ENDPOINT", value)
    lo, lo2 = Loader(), Loader()
    with caplog.at_level(logging.WARNING):
        _attach_after_the_verdict(lo, lo2)
        client._client._thread.join(10)
    st = client.state()
    assert st["active"] and not st["connected"] and st["reports_sent"] == 0
    assert st["last_error"] == f"ADLOADER_ENDPOINT: {protocol.endpoint_problem(value)}"
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(said) == 1 and f"ADLOADER_ENDPOINT={value!r}" in said[0], said
    assert protocol.endpoint_problem(value) in said[0] and "training goes on" in said[0]
    assert not agent.sock.poll(0)                       # no hello reached the agent


def test_an_agent_socket_whose_resolved_path_is_too_long_for_a_unix_address_is_one_warning_naming_it(
        base, endpoint_env, monkeypatch, caplog):
    """ADLOADER_ENDPOINT names a short path through a symlink to a directory whose own path is long: the
    agent binds there (the kernel resolves the link), but the client checks and connects to the
    resolved path (a link could be re-pointed after the check), which is over the 107 bytes a unix
    socket address holds. The probe connection failed with "AF_UNIX path too long", taken for "nobody
    listening": no word, no agent, for the whole run. Now it is one WARNING naming the resolved path
    and the limit, and training goes on without the agent."""
    import logging

    monkeypatch.setattr(client, "RECHECK_S", 0.01)
    monkeypatch.setattr(client, "RECHECK_MAX_S", 0.02)
    monkeypatch.setattr(client, "_warned", set())
    deep = os.path.join(base, "d" * 60, "e" * 60)
    os.makedirs(deep, mode=0o700)
    os.symlink(deep, f"{base}/l")
    ep = f"ipc://{base}/l/agent.sock"
    monkeypatch.setenv("ADLOADER_ENDPOINT", ep)
    agent = FakeAgent(f"{base}/l/agent.sock")
    lo = Loader()
    try:
        with caplog.at_level(logging.WARNING, logger="adloader.client"):
            client.attach(lo)
            wait_for(lambda: "bytes" in (client.state().get("last_error") or ""), what="the client's verdict")
            assert not agent.sock.poll(300), "the client said something to the agent"
        warned = [r.getMessage() for r in caplog.records]
        real = os.path.join(deep, "agent.sock")
        assert len(warned) == 1 and real in warned[0] and "107" in warned[0], warned
    finally:
        _detach_all(lo)
        agent.close()


def test_a_tcp_endpoint_whose_host_does_not_resolve_is_one_warning_and_no_lookup(base, endpoint_env, monkeypatch,
                                                                                  caplog):
    """ADLOADER_ENDPOINT=tcp://nohost:5555 passes the syntax check (``protocol.endpoint_problem``); the
    client refuses tcp:// before any contact (nothing authenticates it, ``adloader.trust``), so it never
    looks the host up (the loader must never block on the network): one warning naming the endpoint, and
    training goes on. (``adloader job``/``status`` resolve the host themselves: ``agent.rpc``.)"""
    import logging

    lookups = []
    monkeypatch.setattr(_real_socket, "getaddrinfo", lambda *a, **k: lookups.append(a) or [])
    monkeypatch.setattr(client, "_warned", set())
    monkeypatch.setenv("ADLOADER_ENDPOINT", "tcp://nohost.invalid:5555")
    lo, lo2 = Loader(), Loader()
    try:
        with caplog.at_level(logging.WARNING):
            _attach_after_the_verdict(lo, lo2)
        st = client.state()
        assert st["active"] and not st["connected"] and st["reports_sent"] == 0
        assert st["last_error"].startswith("untrusted agent: ") and "tcp://" in st["last_error"]
        said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(said) == 1 and "tcp://nohost.invalid:5555" in said[0] and "training goes on" in said[0], said
        assert lookups == []
    finally:
        _detach_all(lo, lo2)


def test_silent_without_agent_and_disabled(base, endpoint_env, monkeypatch):
    lo = Loader()
    client.attach(lo)
    try:
        st = client.state()
        assert st["active"] and not st["connected"] and st["reports_sent"] == 0
        assert not os.path.exists(env.ipc_path(endpoint_env))
    finally:
        client.detach(lo)
    assert client.state() == {"active": False}
    monkeypatch.setenv("ADLOADER_DISABLE", "1")
    client.attach(lo)
    assert client.state() == {"active": False}
    client.detach(lo)


def test_without_an_agent_the_client_thread_ends_when_its_loaders_are_dropped(base, endpoint_env, monkeypatch):
    import gc

    monkeypatch.setattr(client, "RECHECK_S", 0.05)
    monkeypatch.setattr(client, "RECHECK_MAX_S", 0.1)
    def client_threads():
        return {t for t in threading.enumerate() if t.name == "adloader-client" and t.is_alive()}

    before = client_threads()
    lo = Loader()
    client.attach(lo)
    ours = client_threads() - before
    assert len(ours) == 1 and client.state()["active"]
    del lo
    gc.collect()
    wait_for(lambda: client.state() == {"active": False}, what="the client to stop after its loader went")
    ours.pop().join(2.0)
    assert not (client_threads() - before)


def test_forked_child_never_uses_the_parents_client(base, endpoint_env):
    lo = Loader()
    client.attach(lo)
    try:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:   # the child: what a loader worker would see
            ok = client.state() == {"active": False}
            client.detach(lo)          # must not touch the parent's thread or socket
            os.write(w, b"1" if ok else b"0")
            os._exit(0)
        os.close(w)
        assert os.read(r, 1) == b"1"
        os.waitpid(pid, 0)
        assert client.state()["active"] and any(t.name == "adloader-client" for t in threading.enumerate())
    finally:
        client.detach(lo)


def _fd_targets() -> dict:
    """This process's descriptors -> what each is (``socket:[...]``, ``anon_inode:[eventfd]``, a path)."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass
    return out


def _connected_to(path: str) -> set:
    """Descriptors of this process that are unix stream sockets connected to ``path``."""
    return {fd for fd in _fd_targets() if client._unix_stream_peer(fd) == path}


def test_a_forked_child_closes_only_its_copies_of_the_agent_connection(base, agent):
    """``close_inherited_agent_connections`` in a child of ``os.fork()`` (what a loader worker is): its
    copy of the client's connection to the agent is closed (told by the peer's address); a connection
    to another unix socket and a socket pair (a worker's result channel) are left open, and so is the
    parent's connection."""
    other = _real_socket.socket(_real_socket.AF_UNIX, _real_socket.SOCK_STREAM)
    other.bind(f"{base}/other.sock")
    other.listen(1)
    conn = _real_socket.socket(_real_socket.AF_UNIX, _real_socket.SOCK_STREAM)
    conn.connect(f"{base}/other.sock")
    pair = _real_socket.socketpair()
    lo = Loader()
    try:
        _welcomed(agent, lo)
        agent.recv("report")
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:   # the at-fork hook already ran; a second call finds nothing more to close
            ok = client.close_inherited_agent_connections() == 0
            for s in (conn, pair[0], pair[1]):
                try:
                    os.fstat(s.fileno())
                except OSError:
                    ok = False
            os.write(w, b"1" if ok and not _connected_to(f"{base}/agent.sock") else b"0")
            os._exit(0)
        os.close(w)
        assert os.read(r, 1) == b"1"
        os.waitpid(pid, 0)
        os.close(r)
        assert agent.recv("report")       # the parent's connection carries on
    finally:
        client.detach(lo)
        for s in (other, conn, *pair):
            s.close()


def _open_connections(mon, accepted: set) -> int:
    """Connections the fake agent's ROUTER holds open now, from its monitor's events (``accepted``: the
    fds of those accepted so far and not yet closed, updated)."""
    from zmq.utils.monitor import parse_monitor_message

    while mon.poll(0):
        ev = parse_monitor_message(mon.recv_multipart())
        if ev["event"] == zmq.EVENT_ACCEPTED:
            accepted.add(ev["value"])
        elif ev["event"] in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED):
            accepted.discard(ev["value"])
    return len(accepted)


def test_forked_loader_workers_do_not_hold_the_clients_connection_to_the_agent(agent, monkeypatch):
    """Loader workers forked after the client connected (here: started by the agent's directive) inherited
    the file descriptor of the client's connection to the agent (fork copies every fd; libzmq's
    close-on-exec helps only where a child execs). No worker used it, but while any worker lived the
    connection stayed open at the agent after the training process's client had closed it (a reconnect,
    here after a frame over the limit): the agent counted it against the user's ``connections_per_uid`` and never saw it
    end. Now a forked child closes its copies at once (``close_inherited_agent_connections``, at
    fork), so the agent sees the old connection close while the workers run on, and the parent's own
    socket is untouched (its client goes on being served)."""
    pytest.importorskip("torch")
    from adloader import DataLoader

    monkeypatch.setattr(client, "REPORT_S", 0.1)
    mon, accepted = agent.sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED), set()
    loader = DataLoader(list(range(100000)), batch_size=4, num_workers=1, max_workers=2, persistent_workers=True,
                        multiprocessing_context="fork")
    try:
        it = iter(loader)
        next(it)
        ident, _ = agent.recv("hello")
        agent.send(ident, protocol.make("welcome", job="unit-job", heartbeat_s=5.0, challenge=None))
        agent.send(ident, protocol.make("directive", job="unit-job", seq=1, workers=2, reason="fork one more"))
        pids = wait_for(lambda: len(loader.worker_pids()) == 2 and loader.worker_pids(), what="two forked workers")
        next(it)
        while sorted(agent.recv("report")[1]["worker_pids"]) != sorted(pids):
            pass                  # the parent's connection still carries its reports after the worker closed its copy
        # a frame over the limit: libzmq closes the client's connection and the client connects again
        agent.sock.send_multipart([ident, b" " * (protocol.MAX_MESSAGE_BYTES + 1)])
        ident2 = wait_for(lambda: (i := agent.recv("hello")[0]) != ident and i, what="a hello on a new socket")
        agent.send(ident2, protocol.make("welcome", job="unit-job", heartbeat_s=5.0, challenge=None))
        wait_for(lambda: _open_connections(mon, accepted) == 1,
                 what="the agent to hold only the new connection")
        assert sorted(loader.worker_pids()) == sorted(pids) and all(os.path.exists(f"/proc/{p}") for p in pids)
        agent.send(ident2, protocol.make("directive", job="unit-job", seq=1, workers=1, reason="the parent's socket"))
        wait_for(lambda: loader.num_workers == 1, what="the directive on the new connection applied")
        next(it)
    finally:
        loader.close()
        agent.sock.disable_monitor()
        mon.close(0)


@pytest.mark.parametrize("connected", [False, True], ids=["before-connect", "after-connect"])
def test_a_child_forked_while_the_client_probes_the_agent_holds_no_connection_to_it(base, endpoint_env, monkeypatch,
                                                                                    connected):
    """The client checks who listens on the agent's socket with a probe connection (``trust.peer_uid``)
    before every session. A child forked between the probe's ``socket()`` and its ``connect()`` (a
    user's ``os.fork()`` or a torch worker, at a GIL switch in the client thread) got an unconnected
    copy, which the at-fork hook could not tell from any other socket; the parent's connect then
    connected the child's copy too (one open file), and the child held that connection to the agent
    for its whole life after the parent closed the probe: the agent counted it against the user's
    ``connections_per_uid``. A child forked after the connect, before the first session, kept its copy
    too: the hook knew no agent path before a session had connected. Now a fork waits until the probe
    is connected (``trust``'s at-fork lock) and the hook knows the agent's path from the endpoint, so
    the child closes its copy at once. The fork is made to land at each point by a probe socket that
    waits there for it (at most 2 s: with the lock, a fork before the connect waits for the probe
    instead, and the probe goes on)."""
    from adloader import trust

    path = f"{base}/agent.sock"
    agent = FakeAgent(path)
    mon, accepted = agent.sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED), set()
    in_window, forked = threading.Event(), threading.Event()

    class Probe(_real_socket.socket):
        def connect(self, address):
            if connected:
                super().connect(address)
            if not in_window.is_set():
                in_window.set()
                forked.wait(2.0)
            if not connected:
                super().connect(address)

    shim = types.SimpleNamespace(**{k: getattr(_real_socket, k) for k in dir(_real_socket) if not k.startswith("__")})
    shim.socket = Probe
    monkeypatch.setattr(trust, "socket", shim)
    lo = Loader()
    check_r, check_w = os.pipe()
    said_r, said_w = os.pipe()
    pid = None
    try:
        client.attach(lo)
        assert in_window.wait(10.0), "the client's probe"
        pid = os.fork()
        if pid == 0:   # a long-lived non-worker child: looks at its descriptors once the parent says so
            try:
                os.read(check_r, 1)
                os.write(said_w, str(len(_connected_to(path))).encode())
            finally:
                os._exit(0)
        forked.set()
        ident, _ = agent.recv("hello")   # the probe is done and closed in the parent
        agent.send(ident, protocol.make("welcome", job="unit-job", heartbeat_s=5.0, challenge=None))
        assert agent.recv("report")
        wait_for(lambda: _open_connections(mon, accepted) == 1, what="the agent to hold the client's connection only")
        os.write(check_w, b"1")
        assert os.read(said_r, 16) == b"0"      # the child holds no connection to the agent
    finally:
        forked.set()
        client.detach(lo)
        if pid:
            os.write(check_w, b"1")
            os.waitpid(pid, 0)
        for fd in (check_r, check_w, said_r, said_w):
            os.close(fd)
        agent.sock.disable_monitor()
        mon.close(0)
        agent.close()


def test_forked_children_keep_the_contexts_inner_descriptors_only_and_the_parent_serves_on(base, endpoint_env):
    """What a forked child keeps of the client, pinned (``close_inherited_agent_connections``): every
    descriptor but its copies of the agent connection, the ZeroMQ context's eventfds and epoll
    descriptors included. Those lead nowhere outside the process and nothing in the child uses them,
    so the parent's client is served on; and their count does not grow from fork to fork: a child of
    the child has no more of them than the child, and after twenty forks the parent keeps its own
    connection to the agent and its context's descriptors."""
    agent = FakeAgent(f"{base}/agent.sock")
    lo = Loader()
    try:
        ident = _welcomed(agent, lo)
        agent.recv("report")
        parent = _fd_targets()
        to_agent = _connected_to(f"{base}/agent.sock")
        agent_path = f"{base}/agent.sock"

        def kept(fds: dict) -> set:        # the context's inner descriptors among ``fds``
            return {fd for fd, t in fds.items() if t in ("anon_inode:[eventfd]", "anon_inode:[eventpoll]")}

        inner = kept(parent)
        assert to_agent and inner

        # Only the client's descriptors are compared: in a whole test run other threads and finalisers
        # of this process (earlier tests' sockets, torch's) open and close their own at any time, in
        # the children too.
        for _ in range(20):
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                try:
                    mine = _fd_targets()
                    ok = not _connected_to(agent_path) and inner <= kept(mine)
                    rr, ww = os.pipe()
                    grandchild = os.fork()
                    if grandchild == 0:
                        theirs = _fd_targets()
                        os.write(ww, b"1" if not _connected_to(agent_path) and inner <= kept(theirs)
                                 and len(kept(theirs)) <= len(kept(mine)) else b"0")
                        os._exit(0)
                    ok = ok and os.read(rr, 1) == b"1"
                    os.waitpid(grandchild, 0)
                    os.write(w, b"1" if ok else b"0")
                finally:
                    os._exit(0)
            os.close(w)
            assert os.read(r, 1) == b"1"
            os.close(r)
            os.waitpid(pid, 0)
        assert _connected_to(agent_path) == to_agent and inner <= kept(_fd_targets())
        agent.send(ident, protocol.make("directive", job="unit-job", seq=1, workers=5, reason="after the forks"))
        wait_for(lambda: lo.resizes == [5], what="the directive applied after the children went")
        assert agent.recv("report")
    finally:
        client.detach(lo)
        agent.close()


def test_job_identity_from_the_environment():
    assert env.job_id({"ADLOADER_JOB_ID": "a", "SLURM_JOB_ID": "7"}) == "a"
    assert env.job_id({"SLURM_JOB_ID": "7", "TORCHELASTIC_RUN_ID": "r"}) == "7"
    assert env.job_id({"TORCHELASTIC_RUN_ID": "r"}) == "torchrun-r"
    assert env.job_id({"TORCHELASTIC_RUN_ID": "none"}) == f"torchrun-{os.getppid()}"
    assert env.job_id({}, pid=42) == "pid-42"
    assert env.rank({"SLURM_PROCID": "3"}) == 3 and env.rank({"RANK": "1", "SLURM_PROCID": "3"}) == 1
    assert env.gpus({"CUDA_VISIBLE_DEVICES": "-1", "SLURM_JOB_GPUS": "2,3"}) == ["2", "3"]
    assert env.default_endpoint(0) == "ipc:///run/adloader/agent.sock"
    assert env.default_endpoint(1000, {"XDG_RUNTIME_DIR": "/nonexistent"}) == "ipc:///tmp/adloader-1000/agent.sock"
    assert env.endpoint({"ADLOADER_ENDPOINT": "ipc:///x.sock"}) == "ipc:///x.sock"


def test_an_adloader_disable_value_that_is_neither_on_nor_off_is_one_warning_naming_it(monkeypatch, caplog):
    """ADLOADER_DISABLE=1/true/yes/on (any case) opts out; unset, 0/false/no/off do not. Anything else
    ('y', '2', 'disabled') left the client on without a word, so a user who meant to opt out was
    connected to the agent all the same: now one warning names the variable and its value."""
    import logging

    monkeypatch.setattr(env, "_reported", set(), raising=False)
    with caplog.at_level(logging.WARNING, logger="adloader.env"):
        for on in ("1", "true", "YES", " on "):
            assert env.disabled({"ADLOADER_DISABLE": on})
        for off in ("", "0", "False", "no", "off"):
            assert not env.disabled({"ADLOADER_DISABLE": off})
        assert not env.disabled({})
        assert caplog.records == []
        assert not env.disabled({"ADLOADER_DISABLE": "y"})
        assert not env.disabled({"ADLOADER_DISABLE": "y"})       # read at every loader: said once
        assert not env.disabled({"ADLOADER_DISABLE": "2"})
    said = [r.getMessage() for r in caplog.records if r.name == "adloader.env"]
    assert len(said) == 2, said
    assert "ADLOADER_DISABLE='y'" in said[0] and "the agent client stays on" in said[0]
    assert "ADLOADER_DISABLE='2'" in said[1]


def test_a_rank_or_count_not_in_ascii_digits_is_skipped_with_one_warning_naming_the_variable(monkeypatch, caplog):
    """int() reads '1_0' as 10 and '١٠' (Arabic-Indic) as 10: such a RANK or WORLD_SIZE is skipped as an
    unset one is (the next variable, else the default) and reported once, by name, with what is used."""
    import logging

    monkeypatch.setattr(env, "_reported", set(), raising=False)     # (reported once per process)
    with caplog.at_level(logging.WARNING, logger="adloader.env"):
        assert env.rank({"RANK": "1_0", "SLURM_PROCID": "3"}) == 3
        assert env.rank({"RANK": "1_0", "SLURM_PROCID": "3"}) == 3      # read again: not reported again
        assert env.world_size({"WORLD_SIZE": "\u0661\u0660"}) == 1
        assert env.local_rank({"LOCAL_RANK": "-1", "SLURM_LOCALID": "+2"}) == 0
        assert env.local_world_size({"LOCAL_WORLD_SIZE": "\uff12", "SLURM_NTASKS_PER_NODE": "4"}) == 4
        assert env.watchdog_interval_s({"WATCHDOG_USEC": "1_000_000"}) is None
        assert env.rank({"RANK": " 7 "}) == 7 and env.world_size({"WORLD_SIZE": "08"}) == 8   # plain: no word
    said = [r.getMessage() for r in caplog.records if r.name == "adloader.env"]
    assert len(said) == 6, said
    for name, value, instead in (("RANK", "1_0", "using SLURM_PROCID=3"),
                                 ("WORLD_SIZE", "\u0661\u0660", "using the default 1"),
                                 ("LOCAL_RANK", "-1", "using the default 0"),
                                 ("SLURM_LOCALID", "+2", "using the default 0"),
                                 ("LOCAL_WORLD_SIZE", "\uff12", "using SLURM_NTASKS_PER_NODE=4"),
                                 ("WATCHDOG_USEC", "1_000_000", "no watchdog keep-alive")):
        assert any(f"{name}={value!r}" in m and instead in m for m in said), (name, said)


def test_a_process_count_of_zero_is_skipped_with_one_warning_naming_the_variable(monkeypatch, caplog):
    """WORLD_SIZE=0 (or SLURM_NTASKS, LOCAL_WORLD_SIZE, SLURM_NTASKS_PER_NODE) is refused as '1_0' is:
    skipped as an unset one is and reported once, by name and value. (Before: WORLD_SIZE=0 was read
    as 0 and sent in hello, which the agent refuses as malformed; LOCAL_WORLD_SIZE=0 became 1 without
    a word.) A rank of 0 is a rank."""
    import logging

    monkeypatch.setattr(env, "_reported", set(), raising=False)     # (reported once per process)
    with caplog.at_level(logging.WARNING, logger="adloader.env"):
        assert env.world_size({"WORLD_SIZE": "0"}) == 1
        assert env.world_size({"WORLD_SIZE": "0", "SLURM_NTASKS": "4"}) == 4
        assert env.world_size({"SLURM_NTASKS": "00"}) == 1
        assert env.local_world_size({"LOCAL_WORLD_SIZE": "0", "SLURM_NTASKS_PER_NODE": "2"}) == 2
        assert env.rank({"RANK": "0", "SLURM_PROCID": "3"}) == 0 and env.local_rank({"LOCAL_RANK": "0"}) == 0
    said = [r.getMessage() for r in caplog.records if r.name == "adloader.env"]
    assert len(said) == 3, said
    for name, value, instead in (("WORLD_SIZE", "0", "using the default 1"),
                                 ("SLURM_NTASKS", "00", "using the default 1"),
                                 ("LOCAL_WORLD_SIZE", "0", "using SLURM_NTASKS_PER_NODE=2")):
        want = f"{name}={value!r}: a count of processes must be at least 1; {instead}"
        assert any(want in m for m in said), (name, said)


def test_the_client_reports_the_workers_taking_tasks(endpoint_env):
    """A loader that can leave its retiring workers out is asked to (they may exit before the agent
    reads the report); one whose ``worker_pids`` takes no argument is asked plainly; one that fails
    reports none. The primary's come first, then every other attached loader's (a validation loader's:
    the agent places them with the job's loader workers), each pid once, at most the protocol's bound."""
    import weakref

    calls = []

    class Retiring(Loader):
        def __init__(self, pids=(11, 12)):
            super().__init__()
            self.pids = list(pids)

        def worker_pids(self, retiring=True):
            calls.append(retiring)
            return self.pids if retiring else self.pids[:-1]

    c = client._Client()
    assert c._pids(Retiring()) == [11] and calls == [False]
    assert c._pids(Loader()) == [os.getpid()]
    assert c._pids(Loader(fail=True)) == []
    train, val, broken = Retiring((11, 12)), Retiring((21, 22, 23)), Loader(fail=True)
    c._loaders = [weakref.ref(lo) for lo in (val, broken, train)]
    assert c._pids(train) == [11, 21, 22]
    many = Retiring(range(1000, 1000 + client.protocol.MAX_PIDS_PER_MESSAGE + 50))
    c._loaders.append(weakref.ref(many))
    out = c._pids(train)
    assert out[:3] == [11, 21, 22] and len(out) == client.protocol.MAX_PIDS_PER_MESSAGE


def test_a_newer_agent_is_one_warning_saying_what_to_upgrade_and_the_client_stops(agent, monkeypatch,
                                                                                    caplog):
    """An agent of another major version answers in a format this client cannot read. Every message was
    dropped at DEBUG: the client said hello again and again, for the whole run, and the user saw nothing.
    Now one WARNING names both versions and what to upgrade, the client stops (as on the agent's own
    ``version`` error) and the loader is left alone."""
    import json
    import logging

    monkeypatch.setattr(client, "HELLO_RETRY_S", 0.05)
    monkeypatch.setattr(client, "_warned", set())
    lo = Loader()
    with caplog.at_level(logging.WARNING, logger="adloader.client"):
        client.attach(lo)
        ident, _ = agent.recv("hello")
        for m in ({"type": "welcome", "job": "unit-job"}, {"type": "directive", "job": "unit-job", "seq": 1,
                                                          "workers": 0}):
            agent.sock.send_multipart([ident, json.dumps({"v": "2.0", **m}).encode()])
        st = wait_for(lambda: (s := client.state())["active"] is False and s, what="the client stops")
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "2.0" in warned[0] and "1.0" in warned[0] and "upgrade" in warned[0], warned
    assert lo.resizes == []
    assert st["stopped"] == "version" and "version" in st["last_error"] and "gave_up" not in st, st


def test_the_agents_version_error_stops_the_client_and_the_state_says_why(agent, monkeypatch, caplog):
    """The agent refuses a client of another major version with an ``error`` of code ``version``: the
    client stops. ``state()`` said only ``{"active": False}``, the same as no client at all, so a user
    (or ``adloader profile``) could not tell a stopped client from one never started. Now it says it
    stopped for the version and what the agent said."""
    import logging

    monkeypatch.setattr(client, "_warned", set())
    lo = Loader()
    with caplog.at_level(logging.WARNING, logger="adloader.client"):
        client.attach(lo)
        ident, _ = agent.recv("hello")
        agent.send(ident, protocol.error("version", "agent speaks 2.0; upgrade the client"))
        st = wait_for(lambda: (s := client.state())["active"] is False and s, what="the client stops")
    assert st == {"active": False, "stopped": "version",
                  "last_error": "version: agent speaks 2.0; upgrade the client"}, st
    assert [r.getMessage() for r in caplog.records if "refused" in r.getMessage()], caplog.text
    assert lo.resizes == []


def test_directives_of_the_wrong_types_are_ignored_with_one_warning(agent, autotune, monkeypatch, caplog):
    """A directive whose ``workers`` is 1.5, true, "3", null or NaN (the schema refuses each) was dropped at
    DEBUG: the agent's decisions went unheeded and the user's log said nothing. Now: one WARNING naming the
    problem however many come, nothing applied, and the next valid directive is applied as usual."""
    import logging

    monkeypatch.setattr(client, "REPORT_S", 0.05)
    monkeypatch.setattr(client, "_warned", set())
    lo = Loader(workers=2, max_workers=8)
    with caplog.at_level(logging.WARNING, logger="adloader.client"):
        ident = _welcomed(agent, lo)
        for seq, workers in enumerate(["1.5", "true", '"3"', "null", "NaN", "[4]"], 1):
            agent.sock.send_multipart([ident, (f'{{"v":"1.0","type":"directive","job":"unit-job","seq":{seq},'
                                               f'"workers":{workers},"reason":"bad"}}').encode()])
        agent.sock.send_multipart([ident, b"\xff not json"])
        for _ in range(3):
            agent.recv("report")
        assert lo.resizes == [] and autotune == [] and client.state()["directives"] == 0
        agent.send(ident, protocol.make("directive", job="unit-job", seq=1, workers=3, reason="good"))
        wait_for(lambda: lo.resizes == [3], what=f"the next valid directive applied (resizes {lo.resizes})")
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "workers" in warned[0] and "1.5" in warned[0], warned


def test_a_frame_over_the_message_limit_never_reaches_the_client(agent, monkeypatch):
    """The client's socket took frames of any size from the agent (libzmq had no MAXMSGSIZE on it), up to
    RCVHWM of them queued: an agent sending huge frames filled the training process's memory. Now libzmq
    drops the connection that brings one; the client notices the silence and says hello again."""
    seen = []
    decode = protocol.decode

    def recording(data, *a, **kw):
        seen.append(len(data))
        return decode(data, *a, **kw)

    monkeypatch.setattr(client.protocol, "decode", recording)
    monkeypatch.setattr(client, "HELLO_RETRY_S", 0.05)
    lo = Loader()
    client.attach(lo)
    ident, _ = agent.recv("hello")
    agent.send(ident, protocol.make("welcome", job="unit-job", heartbeat_s=0.1, challenge=None))
    agent.sock.send_multipart([ident, b" " * (protocol.MAX_MESSAGE_BYTES + 1)])
    ident2, _ = agent.recv("hello")         # after 3 silent heartbeat periods: a new connection
    agent.send(ident2, protocol.make("welcome", job="unit-job", heartbeat_s=5.0, challenge=None))
    agent.send(ident2, protocol.make("directive", job="unit-job", seq=1, workers=3, reason="r"))
    wait_for(lambda: lo.resizes == [3], what="the client still served after the oversized frame")
    assert seen and max(seen) <= protocol.MAX_MESSAGE_BYTES, max(seen)


def test_a_frame_over_the_limit_is_one_warning_naming_it_and_the_client_connects_again_at_once(
        agent, monkeypatch, caplog):
    """libzmq closes a connection that brings a frame over MAXMSGSIZE and does not connect again; the
    client heard nothing more, said nothing in the log, and reconnected only after three silent
    heartbeat periods (15 s at a heartbeat of 5 s; at the agent's largest, 15 minutes without the
    agent). Now the client's monitor sees the connection end with no reconnect following: one WARNING
    naming the limit, hello again on a new socket at once, and the job is served again."""
    import logging

    monkeypatch.setattr(client, "REPORT_S", 0.1)
    monkeypatch.setattr(client, "_warned", set())
    lo = Loader()
    with caplog.at_level(logging.WARNING, logger="adloader.client"):
        for _ in range(2):                          # twice: one warning all the same
            client.attach(lo)
            ident, _ = agent.recv("hello")
            agent.send(ident, protocol.make("welcome", job="unit-job", heartbeat_s=5.0, challenge=None))
            agent.recv("report")
            agent.sock.send_multipart([ident, b" " * (protocol.MAX_MESSAGE_BYTES + 1)])
        ident3, _ = agent.recv("hello")
        agent.send(ident3, protocol.make("welcome", job="unit-job", heartbeat_s=5.0, challenge=None))
        agent.send(ident3, protocol.make("directive", job="unit-job", seq=1, workers=3, reason="r"))
        wait_for(lambda: lo.resizes == [3], what="the client served again after the oversized frames")
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and str(protocol.MAX_MESSAGE_BYTES) in warned[0] and "MAXMSGSIZE" in warned[0], warned


def test_an_agent_that_restarts_is_no_oversized_frame_and_keeps_the_connection(base, endpoint_env, monkeypatch,
                                                                                caplog):
    """The other way a connection ends (the agent stops and binds again): libzmq connects again by
    itself; the client neither warns about a frame over the limit nor drops its socket."""
    import logging

    monkeypatch.setattr(client, "REPORT_S", 0.1)
    monkeypatch.setattr(client, "_warned", set())
    agent = FakeAgent(f"{base}/agent.sock")
    lo = Loader()
    try:
        with caplog.at_level(logging.WARNING, logger="adloader.client"):
            ident = _welcomed(agent, lo)
            agent.recv("report")
            agent.close()
            agent = FakeAgent(f"{base}/agent.sock")
            # reports for well over the watch's grace period, all on the first socket
            for _ in range(int(3 * client._ConnectionWatch.GRACE_S / client.REPORT_S)):
                assert agent.recv("report")[0] == ident
        assert [r.getMessage() for r in caplog.records] == []
    finally:
        _detach_all(lo)
        agent.close()


def test_a_flood_of_directives_is_applied_at_most_once_a_period_and_the_newest_wins(agent, monkeypatch):
    """An agent that sends directives as fast as it can (a resize loop): each was applied as it came,
    thousands of resizes a second, starting and retiring worker processes (training ran six times slower
    here) and starving the client's own reports. Now at most one directive per ``DIRECTIVE_MIN_S`` is
    applied, the newest one when its time comes, and the last one sent is the one that stays."""
    import time

    monkeypatch.setattr(client, "REPORT_S", 0.05)
    monkeypatch.setattr(client, "DIRECTIVE_MIN_S", 0.5)
    lo = Loader(workers=2)
    ident = _welcomed(agent, lo)
    t0 = time.monotonic()
    for seq in range(1, 501):
        agent.send(ident, protocol.make("directive", job="unit-job", seq=seq, workers=seq % 5, reason="churn"))
    agent.send(ident, protocol.make("directive", job="unit-job", seq=501, workers=7, reason="last"))
    wait_for(lambda: lo.resizes[-1:] == [7], what=f"the last directive applied (resizes {lo.resizes[-5:]})")
    periods = (time.monotonic() - t0) / client.DIRECTIVE_MIN_S
    assert len(lo.resizes) <= periods + 2, (len(lo.resizes), periods)
    agent.recv("report")
    assert client.state()["last_directive"]["seq"] == 501


@pytest.mark.parametrize("code", ["internal", "unknown_job"])
def test_an_agent_that_answers_each_hello_with_an_error_gets_hellos_at_the_back_off_not_at_once(
        agent, monkeypatch, caplog, code):
    """After an error reply (other than a refusal) the client said hello again at once: an agent that
    answered every hello with one (``internal``, or ``unknown_job`` from an agent that forgets at once)
    had about 4,000 hellos a second from the training process, a core busy on them, and the user's log
    said nothing. Now the next hello waits for the hello back-off, and an error other than
    ``unknown_job`` (the normal one after an agent restart) is one WARNING naming it."""
    import logging

    monkeypatch.setattr(client, "HELLO_RETRY_S", 3600.0)
    monkeypatch.setattr(client, "_warned", set())
    lo = Loader()
    with caplog.at_level(logging.WARNING, logger="adloader.client"):
        client.attach(lo)
        ident, _ = agent.recv("hello")
        agent.send(ident, protocol.error(code, "no such thing"))
        wait_for(lambda: code in (client.state().get("last_error") or ""), what="the error read")
        assert not agent.sock.poll(1000), "a hello right after the error"
        # errors of codes the protocol does not have, in a burst: one more warning, not one each
        for i in range(20):
            agent.send(ident, protocol.error("internal", "x") | {"code": f"made-up-{i}"})
        wait_for(lambda: "made-up-19" in (client.state().get("last_error") or ""), what="the burst read")
    warned = [r.getMessage() for r in caplog.records]
    if code == "unknown_job":
        assert len(warned) == 1 and "made-up-" in warned[0], warned
    else:
        assert len(warned) == 2 and code in warned[0] and "no such thing" in warned[0], warned


def test_a_directive_past_the_jobs_own_memory_is_clamped_and_the_agent_sees_the_bound(agent, monkeypatch,
                                                                                      caplog):
    """The agent's loader memory budget is node-wide; a job's own limit (a pod's ``limits.memory``,
    Slurm's ConstrainRAMSpace) it cannot see. A directive for 6 workers to a real loader whose 2
    workers hold 1 GiB each, with 2.5 GiB left under its 8 GiB limit, started all 6 and the OOM killer
    followed. The loader keeps 3 (what its memory holds, less the reserve), says so once at WARNING,
    and its reports carry workers 3 and ``memory_bound_workers`` 3, which the agent's worker bound takes."""
    pytest.importorskip("torch")
    from adloader import DataLoader, memory

    gib = 1 << 30
    monkeypatch.setattr(memory, "process_memory", lambda pid, proc_root="/proc": memory.ProcessMemory(
        pid=pid, rss=gib, pss=gib, uss=gib))
    room = lambda: 9 * gib // 2 - gib * len(loader.worker_pids())     # noqa: E731 — each worker takes 1 GiB
    monkeypatch.setattr(memory, "memory_room", lambda *a, **k: room())
    monkeypatch.setattr(memory, "cgroup_memory", lambda *a, **k: memory.CgroupMemory(8 * gib, 8 * gib - room(), "/x"))
    monkeypatch.setattr(client, "REPORT_S", 0.05)
    loader = DataLoader(list(range(4000)), batch_size=4, num_workers=2, max_workers=8)
    try:
        it = iter(loader)
        next(it)
        ident, _ = agent.recv("hello")
        agent.send(ident, protocol.make("welcome", job="unit-job", heartbeat_s=5.0, challenge=None))
        wait_for(lambda: next(it) is not None and loader.stats()["memory_bound_workers"] == 3,
                 what="both workers measured")
        with caplog.at_level("WARNING", logger="adloader"):
            agent.send(ident, protocol.make("directive", job="unit-job", seq=1, workers=6, reason="grow"))
            wait_for(lambda: client.state().get("last_directive"), what="the directive applied")
        assert client.state()["last_directive"]["applied_workers"] == 3
        assert loader.num_workers == 3
        warned = [r.getMessage() for r in caplog.records if "memory holds" in r.getMessage()]
        assert len(warned) == 1 and "asked for 6 workers" in warned[0]
        _, rep = agent.recv("report")
        _, rep = agent.recv("report")       # one sent after the directive
        assert rep["stats"]["workers"] == 3 and rep["stats"]["memory_bound_workers"] == 3
        next(it)
    finally:
        loader.close()
