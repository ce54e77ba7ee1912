"""A hostile ordinary user against the agent, run as its own process by the security tier
(tests/test_security_tier.py) and the security benchmark (``evaluation.security_bench``):
``python -m evaluation.attacks ENDPOINT UID ATTACK [ARG...]``. As root it first drops to UID. Each
attack runs for a bounded time and prints one JSON object with what it did and what it got back.

Attacks:
    messages K SECONDS       K connections sending small valid messages round-robin, as fast as
                             libzmq takes them (each is answered: an unknown connection's report)
    churn SECONDS            open and close raw connections one after the other, as fast as it can
    expensive SECONDS        ``register`` messages of 200 live pids of its own each (a /proc read per
                             pid), as fast as it can
    connections N HOLD_S     open N raw unix connections to the agent's socket and hold them
    register N [PIDS]        N ``register`` messages for distinct job ids (PIDS: "dup" = 1024 copies of
                             its own pid, "own" = the pids of 200 children it starts, default none)
    bigframes CONNS SECONDS  CONNS connections each sending ~60 KB frames as fast as libzmq takes them
    squat JOB...             ``register`` each JOB for itself (before the real owner's prolog)
    impostor SECONDS         (ENDPOINT is where to bind) pose as the agent: bind a ROUTER there
                             (creating its directory), answer every hello with a welcome and a
                             directive of 0 workers; report what it heard (SIGTERM: the caller is
                             done; it listens one more second, for what is on its way, and reports)
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import zmq

from adloader import env, protocol


QUIET_S = 1.2       # no reply for this long: ask whether the agent has read everything (_ask)


def _ask(ctx, endpoint: str, msgs: list, timeout_s: float = 5.0) -> dict:
    """Send each message on one connection; count the replies by type/code, until every message is
    answered or the agent has read them all, at most ``timeout_s``.

    A message the agent drops (over a rate limit) gets no reply, so a count of replies alone cannot
    end: after ``QUIET_S`` without a reply a ``status`` request goes out on the same connection, and
    its answer ends the count. The agent handles one connection's messages in the order sent and
    answers them in that order, so by then every reply to the messages before it has arrived.
    (``QUIET_S`` is over a second, so the connection's token bucket has refilled for the request; one
    the agent drops all the same is asked again after another ``QUIET_S``. Status answers are not
    counted.)"""
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 100000)
    s.connect(endpoint)
    got: dict[str, int] = {}
    for m in msgs:
        s.send(m if isinstance(m, bytes) else protocol.encode(m))
        while s.poll(0):
            _count(got, s.recv())
    deadline = time.monotonic() + timeout_s
    heard = time.monotonic()
    while sum(got.values()) < len(msgs) and time.monotonic() < deadline:
        if s.poll(200):
            if _count(got, s.recv()) == "status":
                break
            heard = time.monotonic()
        elif time.monotonic() - heard >= QUIET_S:
            s.send(protocol.encode(protocol.make("status")))
            heard = time.monotonic()
    s.close(0)
    return got


def _count(got: dict, data: bytes) -> str:
    """Count one reply by type/code (a ``status`` answer is not counted); returns its key."""
    m = protocol.decode(data, max_bytes=None)
    key = m["type"] if m["type"] != "error" else f"error:{m['code']}"
    if key != "status":
        got[key] = got.get(key, 0) + 1
    return key


def connections(endpoint: str, n: int, hold_s: float) -> dict:
    path = env.ipc_path(endpoint)
    socks, failed = [], 0
    t0 = time.monotonic()
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        deadline = time.monotonic() + 5.0
        while True:
            try:
                s.connect(path)
                socks.append(s)
                break
            except BlockingIOError:      # the listen backlog is full: as fast as the agent accepts
                if time.monotonic() > deadline:
                    failed += 1
                    s.close()
                    break
                time.sleep(0.001)
            except OSError:
                failed += 1
                s.close()
                break
    connect_s = time.monotonic() - t0
    time.sleep(hold_s)
    closed_by_agent = 0
    for s in socks:        # a connection the agent shut down reads EOF (or a reset) after its greeting bytes
        try:
            while True:
                if s.recv(4096) == b"":
                    closed_by_agent += 1
                    break
        except BlockingIOError:
            pass
        except OSError:
            closed_by_agent += 1
        s.close()
    return {"opened": len(socks), "failed": failed, "closed_by_agent": closed_by_agent,
            "connect_s": round(connect_s, 3), "per_s": round(len(socks) / max(connect_s, 1e-6))}


def register(endpoint: str, n: int, pids: str = "none") -> dict:
    ctx = zmq.Context()
    children = []
    if pids == "dup":
        plist = [os.getpid()] * 1024
    elif pids == "own":
        children = [subprocess.Popen(["sleep", "60"]) for _ in range(200)]
        plist = [c.pid for c in children]
    else:
        plist = []
    msgs = [protocol.make("register", job=f"atk-{i}", uid=os.getuid(), pids=plist) for i in range(n)]
    t0 = time.monotonic()
    got = _ask(ctx, endpoint, msgs, timeout_s=20)
    out = {"sent": n, "replies": got, "seconds": round(time.monotonic() - t0, 3)}
    for c in children:
        c.kill()
        c.wait()
    ctx.destroy(0)
    return out


def bigframes(endpoint: str, conns: int, seconds: float) -> dict:
    ctx = zmq.Context()
    socks = []
    for _ in range(conns):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 1000)
        s.connect(endpoint)
        socks.append(s)
    frame = b'{"v":"1.0","type":"status","pad":"' + b"x" * (protocol.MAX_MESSAGE_BYTES - 64) + b'"}'
    sent = 0
    t_end = time.monotonic() + seconds
    while time.monotonic() < t_end:
        for s in socks:
            try:
                s.send(frame, zmq.NOBLOCK)
                sent += 1
            except zmq.Again:
                pass
    ctx.destroy(0)
    return {"sent": sent, "bytes": sent * len(frame)}


def messages(endpoint: str, k: int, seconds: float) -> dict:
    ctx = zmq.Context()
    socks = []
    for _ in range(k):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 1000)
        s.setsockopt(zmq.RCVHWM, 10)        # replies pile up unread beyond this: dropped by libzmq
        s.connect(endpoint)
        socks.append(s)
    msg = protocol.encode(protocol.make("report", job="atk", rank=0, pid=os.getpid(), stats={}))
    sent = 0
    t0 = time.monotonic()
    t_end = t0 + seconds
    while time.monotonic() < t_end:
        for s in socks:
            try:
                s.send(msg, zmq.NOBLOCK)
                sent += 1
            except zmq.Again:
                pass
            while s.poll(0):
                s.recv()
    ctx.destroy(0)
    return {"sent": sent, "per_s": round(sent / (time.monotonic() - t0))}


def churn(endpoint: str, seconds: float) -> dict:
    path = env.ipc_path(endpoint)
    n = failed = 0
    t0 = time.monotonic()
    t_end = t0 + seconds
    while time.monotonic() < t_end:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect(path)
            n += 1
        except OSError:
            failed += 1
        s.close()
    return {"connections": n, "failed": failed, "per_s": round(n / (time.monotonic() - t0))}


def expensive(endpoint: str, seconds: float) -> dict:
    ctx = zmq.Context()
    children = [subprocess.Popen(["sleep", str(int(seconds) + 30)]) for _ in range(200)]
    plist = [c.pid for c in children]
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 1000)
    s.connect(endpoint)
    got: dict = {}
    sent = 0
    t0 = time.monotonic()
    t_end = t0 + seconds
    i = 0
    while time.monotonic() < t_end:
        try:
            s.send(protocol.encode(protocol.make("register", job=f"exp-{i % 4}", uid=os.getuid(), pids=plist)),
                   zmq.NOBLOCK)
            sent += 1
            i += 1
        except zmq.Again:
            time.sleep(0.001)
        while s.poll(0):
            _count(got, s.recv())
    for c in children:
        c.kill()
        c.wait()
    ctx.destroy(0)
    return {"sent": sent, "per_s": round(sent / (time.monotonic() - t0)), "replies": got}


IMPOSTOR_DRAIN_S = 1.0     # after SIGTERM: a message already sent to the impostor is still heard


def impostor(endpoint: str, seconds: float) -> dict:
    path = env.ipc_path(endpoint)
    t_end = time.monotonic() + seconds

    def done(*_):
        nonlocal t_end
        t_end = min(t_end, time.monotonic() + IMPOSTOR_DRAIN_S)

    signal.signal(signal.SIGTERM, done)     # (before the bind: a caller may signal once it sees the socket)
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    s.setsockopt(zmq.LINGER, 0)
    s.bind(endpoint)
    os.chmod(path, 0o666)
    heard: list = []
    while time.monotonic() < t_end:
        if not s.poll(100):
            continue
        ident, data = s.recv_multipart()
        try:
            m = protocol.decode(data)
        except protocol.ProtocolError:
            continue
        heard.append({k: m.get(k) for k in ("type", "job", "pid", "uid", "hostname", "worker_pids")})
        if m["type"] == "hello":
            s.send_multipart([ident, protocol.encode(protocol.make("welcome", job=m["job"], heartbeat_s=2.0))])
            s.send_multipart([ident, protocol.encode(protocol.make("directive", job=m["job"], seq=1, workers=0,
                                                                   cpus=None, cpuset=None, reason="impostor"))])
    ctx.destroy(0)
    return {"heard": heard}


def squat(endpoint: str, jobs: list) -> dict:
    """``register`` each job for itself, one connection each; the reply to each, and all counted."""
    ctx = zmq.Context()
    by_job, total = {}, {}
    for job in jobs:
        # built by hand: protocol.make would not let a malformed job id leave (the agent must refuse it)
        msg = json.dumps({"v": protocol.VERSION, "type": "register", "job": job, "uid": os.getuid(),
                          "pids": []}).encode()
        got = _ask(ctx, endpoint, [msg])
        by_job[job] = got
        for k, n in got.items():
            total[k] = total.get(k, 0) + n
    ctx.destroy(0)
    return {"replies": total, "by_job": by_job}


def main() -> None:
    endpoint, uid, attack, args = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
    if uid != os.getuid():
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    if attack == "connections":
        out = connections(endpoint, int(args[0]), float(args[1]))
    elif attack == "register":
        out = register(endpoint, int(args[0]), args[1] if len(args) > 1 else "none")
    elif attack == "bigframes":
        out = bigframes(endpoint, int(args[0]), float(args[1]))
    elif attack == "messages":
        out = messages(endpoint, int(args[0]), float(args[1]))
    elif attack == "churn":
        out = churn(endpoint, float(args[0]))
    elif attack == "expensive":
        out = expensive(endpoint, float(args[0]))
    elif attack == "impostor":
        out = impostor(endpoint, float(args[0]))
    elif attack == "squat":
        out = squat(endpoint, args)
    else:
        raise SystemExit(f"unknown attack {attack!r}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
