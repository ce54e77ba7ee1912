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
