"""agent/security.py (units): peer addresses, per-identity token buckets. The agent's security
behaviour end to end is in test_agent_security.py."""
from __future__ import annotations

import pytest

from agent import security
from agent.security import Peer, TokenBuckets

pytestmark = pytest.mark.unit


def test_peer_address_parsing_and_token_bucket():
    assert security.parse_peer_address("localhost:1000:100:4242") == Peer(1000, 100, 4242)
    assert security.parse_peer_address("127.0.0.1:5555") is None
    assert security.parse_peer_address("") is None
    # the kernel's pid for a peer outside the reader's pid namespace: kept, so the refusal can say so
    assert security.parse_peer_address("localhost:1000:100:0") == Peer(1000, 100, 0)
    assert security.parse_peer_address("localhost:1000:100:-1") is None
    tb = TokenBuckets(rate_per_s=10, burst=5)
    assert [tb.take(b"a", 0.0) for _ in range(7)] == [True] * 5 + [False] * 2
    assert tb.take(b"b", 0.0)                      # other identities unaffected
    assert tb.take(b"a", 0.2) and tb.take(b"a", 0.2) and not tb.take(b"a", 0.2)



def test_alive_and_start_ticks_read_the_given_proc_root(tmp_path):
    """A process identity (pid + start ticks) read under ``proc_root``, not always the host's /proc."""
    def stat(pid, state, start):
        d = tmp_path / str(pid)
        d.mkdir()
        (d / "stat").write_text(f"{pid} (a b) c) {state} 1 " + "0 " * 17 + f"{start} 0 0\n")

    stat(42, "S", 12345)
    stat(43, "Z", 777)
    root = str(tmp_path)
    assert security.pid_start_ticks(42, root) == 12345
    assert security.alive(42, 12345, root) and security.alive(42, None, root)
    assert not security.alive(42, 999, root)                  # the pid was reused
    assert not security.alive(43, 777, root)                  # a zombie
    assert not security.alive(44, None, root)                 # gone
    assert security.pid_start_ticks(44, root) is None
