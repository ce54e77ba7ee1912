"""agent.rpc.request: one request to the agent from a short-lived command, against a real ROUTER on an
ipc socket that answers with scripted frames. Component tier (real ZeroMQ sockets, a thread)."""
from __future__ import annotations

import json

import pytest

from adloader import protocol
from agent import rpc
from tests.agentd_support import FakeRouter

pytestmark = pytest.mark.component


class ScriptedAgent(FakeRouter):
    """Answers each request with the next list of raw frames from ``script`` (an empty list: no
    answer at all)."""

    def __init__(self, path: str, script: list[list[bytes]]):
        self.script = list(script)
        super().__init__(path)

    @property
    def requests(self) -> list[dict]:
        return self.received

    def reply(self, msg: dict) -> list[bytes]:
        return self.script.pop(0) if self.script else []


@pytest.fixture
def scripted(tmp_path):
    made = []

    def make(*script):
        made.append(ScriptedAgent(str(tmp_path / "agent.sock"), list(script)))
        return made[-1]

    yield make
    for a in made:
        a.close()


def test_returns_the_reply_that_answers_and_skips_others(scripted):
    agent = scripted([protocol.encode(protocol.make("ok", re="bye")),
                      protocol.encode(protocol.make("ok", re="register", detail="already registered"))])
    reply = rpc.request(agent.endpoint, protocol.make("register", job="7", uid=0, gpus=[], cpus=None, pids=[],
                                                      source="cli"), 5)
    assert reply["re"] == "register" and reply["detail"] == "already registered"
    assert agent.requests[0]["type"] == "register"


def test_status_reply_may_exceed_the_message_limit(scripted):
    doc = {"jobs": [{"job": str(i), "reason": "x" * 100} for i in range(1000)]}
    big = json.dumps({"v": protocol.VERSION, "type": "status", "doc": doc}).encode()
    assert len(big) > protocol.MAX_MESSAGE_BYTES
    agent = scripted([big])
    reply = rpc.request(agent.endpoint, protocol.make("status"), 5, expect="status", max_reply_bytes=None)
    assert reply["doc"] == doc


def test_error_reply_raises_refused_with_its_code(scripted):
    agent = scripted([protocol.encode(protocol.error("not_permitted", "uid 5 may not status", re="status"))])
    with pytest.raises(rpc.AgentRefused, match="agent refused status: not_permitted: uid 5") as e:
        rpc.request(agent.endpoint, protocol.make("status"), 5, expect="status")
    assert e.value.code == "not_permitted" and isinstance(e.value, RuntimeError)


def test_unreadable_reply_is_bad_reply(scripted):
    agent = scripted([b"not json"])
    with pytest.raises(rpc.BadReply, match="unreadable reply"):
        rpc.request(agent.endpoint, protocol.make("status"), 5, expect="status")


def test_absent_agent_and_silent_agent(tmp_path, scripted):
    with pytest.raises(rpc.AgentDown, match="no socket at .*absent.sock"):
        rpc.request(f"ipc://{tmp_path}/absent.sock", protocol.make("status"), 5)
    agent = scripted([])
    with pytest.raises(rpc.AgentTimeout, match="did not answer status within 0.3s"):
        rpc.request(agent.endpoint, protocol.make("status"), 0.3, expect="status")
    with pytest.raises(rpc.AgentDown, match="bad endpoint"):
        rpc.request("carrier-pigeon://x", protocol.make("status"), 1)


def test_a_timeout_longer_than_a_c_int_of_milliseconds_is_bounded_by_the_deadline(scripted):
    # (before: OverflowError from setsockopt(SNDTIMEO) and zmq_poll, whose timeouts are C ints)
    agent = scripted([protocol.encode(protocol.make("ok", re="status"))])
    assert rpc.request(agent.endpoint, protocol.make("status"), 1e12)["type"] == "ok"


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0, -1])
def test_a_timeout_that_is_not_positive_and_finite_is_a_value_error(scripted, bad):
    agent = scripted([protocol.encode(protocol.make("ok", re="status"))])
    with pytest.raises(ValueError, match="timeout_s must be a positive finite number"):
        rpc.request(agent.endpoint, protocol.make("status"), bad)


def test_status_refuses_a_timeout_that_is_not_positive_and_finite(scripted):
    # (before, with an agent listening: a traceback, ValueError/OverflowError from int(nan or inf))
    import subprocess

    from tests.conftest import adloader_cmd, repo_env

    agent = scripted(*[[protocol.encode({"v": protocol.VERSION, "type": "status", "doc": {}})]] * 4)
    for bad in ("nan", "inf", "0", "-2"):
        out = subprocess.run(adloader_cmd("status", "--endpoint", agent.endpoint, "--timeout-s", bad),
                             env=repo_env(), capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and "--timeout-s" in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_the_host_of_a_tcp_endpoint():
    assert rpc.tcp_host("tcp://nohost:5555") == "nohost"
    assert rpc.tcp_host("tcp://[::1]:5555") == "::1"
    assert rpc.tcp_host("tcp://eth0;agent.example:5555") == "agent.example"   # (ZeroMQ's source;host:port)
    assert rpc.tcp_host("tcp://nohost") is None and rpc.tcp_host("tcp://:5555") is None


def test_a_tcp_host_that_does_not_resolve_is_agent_down_naming_it_at_once():
    # ``.invalid`` never resolves (RFC 6761). Before: "agent down: nobody accepts connections at
    # tcp://nohost.invalid:5555 within 5s", after the whole timeout (ZeroMQ resolves in its I/O thread
    # and says nothing)
    with pytest.raises(rpc.AgentDown, match=r"^cannot reach tcp://nohost\.invalid:5555: cannot resolve host "
                                            r"'nohost\.invalid': "):
        rpc.request("tcp://nohost.invalid:5555", protocol.make("status"), 5)


def test_a_resolver_that_never_answers_is_bounded_by_the_deadline(monkeypatch):
    import socket
    import threading
    import time

    release = threading.Event()
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: release.wait(30) and [])
    t0 = time.monotonic()
    try:
        with pytest.raises(rpc.AgentDown, match="cannot resolve host 'slow.example': no answer from the resolver"):
            rpc.request("tcp://slow.example:5555", protocol.make("status"), 0.3)
    finally:
        release.set()
    assert time.monotonic() - t0 < 5.0


def test_a_tcp_endpoint_with_a_host_name_that_resolves_is_served():
    """The lookup refuses only what does not resolve: an agent at tcp://localhost answers as before."""
    import zmq

    from evaluation.slurm_cluster import free_port

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = free_port()
    router.bind(f"tcp://127.0.0.1:{port}")
    try:
        import threading

        def answer():
            if router.poll(10_000):
                ident, _ = router.recv_multipart()
                router.send_multipart([ident, protocol.encode(protocol.make("ok", re="status"))])

        t = threading.Thread(target=answer, daemon=True)
        t.start()
        assert rpc.request(f"tcp://localhost:{port}", protocol.make("status"), 5)["type"] == "ok"
        t.join(5)
    finally:
        router.close(0)
        ctx.term()
