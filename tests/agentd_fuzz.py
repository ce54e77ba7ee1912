"""Fuzzer for the agent's socket, run as its own process (``python -m tests.agentd_fuzz ENDPOINT UID SECONDS``)
by tests/test_agent_security.py: random and mutated frames from many identities, an oversized frame,
and a flood from one identity. As root it first drops to UID (an unprivileged attacker). Prints one
JSON object: sent, replies, limited (the rate_limited reply of the flood)."""
from __future__ import annotations

import json
import os
import random
import sys
import time

import zmq

import agent  # noqa: F401  (declares this process torch-free: importing adloader then skips torch)
from adloader import protocol


def _mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 6)):
        op = rng.random()
        if op < 0.4 and b:
            b[rng.randrange(len(b))] = rng.randrange(256)
        elif op < 0.6 and b:
            del b[rng.randrange(len(b))]
        elif op < 0.8:
            b.insert(rng.randrange(len(b) + 1), rng.randrange(256))
        else:
            i = rng.randrange(len(b) + 1)
            b[i:i] = rng.choice([b'"', b"{", b"}", b"[", b"null", b"1e999", b"-1", b"\xff\xfe", b"\\u0000"])
    return bytes(b)


def _templates(rng: random.Random) -> list[dict]:
    pid = os.getpid()
    job = f"fz-{rng.randrange(1000)}"
    return [
        {"v": "1.0", "type": "hello", "job": job, "rank": rng.randrange(3), "pid": pid, "worker_pids": [pid],
         "gpus": ["0"], "batch_size": 32, "workers": 2, "uid": os.getuid()},
        {"v": "1.0", "type": "report", "job": job, "rank": 0, "pid": pid, "worker_pids": [],
         "stats": {"steps": rng.randrange(10**6), "samples": -5, "data_wait_s": 1e308, "uptime_s": "x"}},
        {"v": "1.0", "type": "heartbeat", "job": job, "rank": 0, "pid": pid},
        {"v": "1.0", "type": "bye", "job": job, "rank": 0, "pid": pid},
        {"v": "1.0", "type": "register", "job": job, "uid": os.getuid(), "gpus": ["0"], "cpus": 2, "pids": []},
        {"v": "1.0", "type": "release", "job": job, "uid": os.getuid()},
        {"v": "1.0", "type": "status"},
        {"v": rng.choice(["2.0", "0.1", "x", "", "1"]), "type": "hello", "job": job, "rank": 0, "pid": pid},
        {"v": "1.0", "type": rng.choice(["welcome", "directive", "ok", "error", "nope", ""]), "job": job},
        {"v": "1.0", "type": "hello", "job": "victim", "rank": rng.randrange(4), "pid": rng.randrange(1, 10**6)},
        {"v": "1.0", "type": "release", "job": "victim", "uid": 12345},
    ]



def main():
    endpoint, uid, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    if uid != os.getuid():
        os.setgroups([]); os.setgid(uid); os.setuid(uid)
    rng = random.Random(1234)
    ctx = zmq.Context()
    socks, sent, replies = [], 0, 0
    t_end = time.monotonic() + seconds
    sock = None
    while sent < 5000 and time.monotonic() < t_end:
        if sent % 60 == 0:   # a fresh identity now and then (each gets its own token bucket)
            if len(socks) >= 8:   # the agent holds at most connections_per_uid (64) of one uid open
                socks.pop(0).close(0)
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 100000)
            sock.connect(endpoint)
            socks.append(sock)
        kind = rng.random()
        if kind < 0.15:
            frames = [rng.randbytes(rng.randrange(0, 300))]
        elif kind < 0.55:
            frames = [_mutate(rng, json.dumps(rng.choice(_templates(rng))).encode())]
        elif kind < 0.8:
            frames = [json.dumps(rng.choice(_templates(rng))).encode()]
        elif kind < 0.9:
            frames = [b"", json.dumps({"v": "1.0", "type": "status"}).encode()][: rng.randint(1, 2)] + [b"x"] * rng.randint(0, 3)
        elif kind < 0.95:
            frames = [json.dumps(rng.choice([[], "s", 1, None, {"a": [1] * 50}, [[[[[]]]]] * 3])).encode()]
        else:
            frames = [b"[" * 5000 + b"]" * 5000]
        sock.send_multipart(frames)
        sent += 1
        while sock.poll(0):
            sock.recv_multipart()
            replies += 1
    # oversized: libzmq drops the connection (MAXMSGSIZE); the agent never sees it
    big = ctx.socket(zmq.DEALER)
    big.setsockopt(zmq.LINGER, 0)
    big.connect(endpoint)
    big.send(b"{" + b" " * (protocol.MAX_MESSAGE_BYTES + 100) + b"}")
    # a flood from one identity: the token bucket answers rate_limited and drops the rest unparsed
    flood = ctx.socket(zmq.DEALER)
    flood.setsockopt(zmq.LINGER, 0)
    flood.setsockopt(zmq.SNDHWM, 100000)
    flood.connect(endpoint)
    hb = protocol.encode(protocol.make("heartbeat"))
    for _ in range(3000):
        flood.send(hb)
    limited = None
    deadline = time.monotonic() + 10
    while limited is None and time.monotonic() < deadline:
        if flood.poll(100):
            m = protocol.decode(flood.recv())
            if m["type"] == "error":
                limited = m
    print(json.dumps({"sent": sent, "replies": replies, "limited": limited}))
    for s in socks + [big, flood]:
        s.close(0)
    ctx.term()


if __name__ == "__main__":
    main()
