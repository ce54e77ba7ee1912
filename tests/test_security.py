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
    tb = TokenBuckets(rate_per_s=10, burst=5)
    assert [tb.take(b"a", 0.0) for _ in range(7)] == [True] * 5 + [False] * 2
    assert tb.take(b"b", 0.0)                      # other identities unaffected
    assert tb.take(b"a", 0.2) and tb.take(b"a", 0.2) and not tb.take(b"a", 0.2)

