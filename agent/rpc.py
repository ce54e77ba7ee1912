"""One request to the node agent from a short-lived command (``adloader job``, ``adloader status``).

``request(endpoint, msg, timeout_s)`` opens its own DEALER, sends ``msg`` once and returns the reply
that answers it, or raises a ``RequestError`` subclass whose message says what went wrong:

    AgentDown     no socket file behind an ipc:// endpoint, nobody listening on it (a stale socket file
                  left by a dead agent), bad endpoint, a tcp:// host that does not resolve (``_unresolved``:
                  ZeroMQ resolves it in its I/O thread and says nothing, so it read as "nobody accepts
                  connections" after the whole timeout)
    AgentTimeout  no answer came before the deadline: the message went out and was not answered, or
                  (ipc://) the socket has a listener that never completed the ZeroMQ handshake -- the
                  kernel queues connections for a stopped or hung process (``_listening``), so that is
                  a hung agent, not a missing one
    BadReply      the reply could not be read (not JSON, wrong protocol major, over the size limit)
    AgentRefused  the agent answered ``error``; ``.code`` is its code (``adloader.protocol.ERROR_CODES``)
    AgentUntrusted  the socket is not one a process of this uid may trust (``adloader.trust``: another
                  user's file, directory or listening process): nothing is sent

Invariants:
- Bounded: every call is NOBLOCK or polled against one monotonic deadline ``timeout_s`` from the
  start, and the socket has ``LINGER=0``, ``IMMEDIATE=1`` (queue only to a completed connection, so
  "nobody listens" is seen rather than queued forever) and ``SNDTIMEO``/``RCVTIMEO`` as a backstop.
  A Slurm prolog relies on this: a hung agent must never hang the caller (DESIGN "Slurm").
- Own context, closed before returning: never shared with the caller (fork safety, DESIGN "ZeroMQ").
- The answer to a request of type T is a reply of type ``expect`` (``"ok"`` by default) whose ``re`` is
  absent or T, or an ``error`` whose ``re`` is absent or T; anything else arriving meanwhile is ignored.
- Nothing heavier than pyzmq, ``adloader.protocol`` and ``adloader.trust`` (stdlib) is imported (the
  prolog pays for every import).
"""
from __future__ import annotations

import math
import os
import time
from typing import Optional

from adloader import protocol

_MAX_SOCKOPT_MS = 2 ** 31 - 1   # SNDTIMEO/RCVTIMEO and zmq_poll's timeout are C ints: a longer wait loops to the deadline


class RequestError(RuntimeError):
    """The request did not get an accepted answer; the message says why, naming the endpoint."""


class AgentDown(RequestError):
    """Nothing to talk to: no socket file, nobody accepts connections, or the endpoint is malformed."""


class AgentTimeout(RequestError):
    """The request was sent but the agent did not answer in time (hung, or far behind)."""


class BadReply(RequestError):
    """The agent's reply could not be read (malformed, incompatible protocol version, too large)."""


class AgentUntrusted(RequestError):
    """The endpoint's socket is not the agent's (``adloader.trust.agent_untrusted``); nothing was sent."""


class AgentRefused(RequestError):
    """The agent answered with an ``error`` message."""

    def __init__(self, message: str, code: str, detail: str):
        super().__init__(message)
        self.code = code
        self.detail = detail


def request(endpoint: str, msg: dict, timeout_s: float, *, expect: str = "ok",
            max_reply_bytes: Optional[int] = protocol.MAX_MESSAGE_BYTES) -> dict:
    """Send ``msg`` to the agent at ``endpoint``; return the reply that answers it (see the module
    docstring) within ``timeout_s``. ``max_reply_bytes=None`` lifts the size limit for replies that may
    exceed it (the status document); the limit guards the agent's socket, not a command's.
    ``timeout_s`` must be finite and positive (``ValueError`` otherwise: the commands check their
    ``--timeout-s`` first, ``timeout_arg``)."""
    import zmq

    from adloader import env

    if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a positive finite number of seconds, got {timeout_s!r}")
    deadline = time.monotonic() + timeout_s
    want = msg["type"]
    path = env.ipc_path(endpoint)
    if path is not None and not os.path.exists(path):
        raise AgentDown(f"agent down: no socket at {path} (is `adloader agent` running?)")
    from adloader import trust

    why = None if path is None else trust.agent_untrusted(  # (tcp://: the operator's explicit choice)
        endpoint, timeout_s=max(0.05, min(1.0, deadline - time.monotonic())))
    if why is not None and why != trust.NO_SOCKET and not why.startswith(trust.UNCHECKED):
        raise AgentUntrusted(f"not talking to {endpoint}: {why}")
    why = _unresolved(endpoint, deadline) if endpoint.startswith("tcp://") else None
    if why is not None:
        raise AgentDown(f"cannot reach {endpoint}: {why}")
    ctx = zmq.Context()  # our own: never share a context with the caller (fork safety)
    sock = ctx.socket(zmq.DEALER)
    try:
        bounded_ms = max(1, min(_MAX_SOCKOPT_MS, int(timeout_s * 1000)))
        sock.setsockopt(zmq.LINGER, 0)     # close() never waits for an unsent message
        sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only to a completed connection: no listener -> EAGAIN
        # Every call below is NOBLOCK or polled against the deadline; these bound any that is not.
        sock.setsockopt(zmq.SNDTIMEO, bounded_ms)
        sock.setsockopt(zmq.RCVTIMEO, bounded_ms)
        if max_reply_bytes is not None:
            sock.setsockopt(zmq.MAXMSGSIZE, max_reply_bytes)
        try:
            sock.connect(endpoint)
        except zmq.ZMQError as e:
            raise AgentDown(f"bad endpoint {endpoint!r}: {e}") from None
        if not _send_by(sock, protocol.encode(msg), deadline):
            if path is not None and _listening(path):
                raise AgentTimeout(f"timeout: agent at {endpoint} accepts connections but did not answer "
                                   f"within {timeout_s:g}s (hung or stopped?)")
            raise AgentDown(f"agent down: nobody accepts connections at {endpoint} within {timeout_s:g}s")
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not sock.poll(min(left_ms, _MAX_SOCKOPT_MS), zmq.POLLIN):
                raise AgentTimeout(f"timeout: agent at {endpoint} did not answer {want} within {timeout_s:g}s (hung?)")
            try:
                raw = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                continue
            try:
                reply = protocol.decode(raw, max_bytes=max_reply_bytes)
            except protocol.ProtocolError as e:
                raise BadReply(f"unreadable reply from agent at {endpoint}: {e}") from None
            if reply.get("re") not in (None, want):
                continue  # meant for another request
            if reply["type"] == expect:
                return reply
            if reply["type"] == "error":
                raise AgentRefused(f"agent refused {want}: {reply['code']}: {reply['message']}",
                                   reply["code"], reply["message"])
            # anything else (a heartbeat) is not our answer
    finally:
        sock.close(0)
        ctx.term()


def tcp_host(endpoint: str) -> Optional[str]:
    """The host a ``tcp://[source;]HOST:PORT`` endpoint connects to (an IPv6 address without its
    brackets), or None when there is no ``HOST:`` to read (ZeroMQ's connect says what is wrong then)."""
    rest = endpoint[len("tcp://"):].rpartition(";")[2]
    host, colon, _ = rest.rpartition(":")
    if not colon or not host:
        return None
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def _unresolved(endpoint: str, deadline: float) -> Optional[str]:
    """Why the host of a tcp:// ``endpoint`` cannot be resolved (``socket.getaddrinfo``), or None.
    The lookup runs in a daemon thread waited for until ``deadline`` (getaddrinfo has no timeout of its
    own, and a hung resolver must not hang a Slurm prolog); one not done by then is a reason too."""
    import socket
    import threading

    host = tcp_host(endpoint)
    if host is None:
        return None
    result: list[Optional[str]] = []

    def lookup() -> None:
        try:
            socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
            result.append(None)
        except (OSError, UnicodeError) as e:
            result.append(f"cannot resolve host {host!r}: {getattr(e, 'strerror', None) or e}")

    t = threading.Thread(target=lookup, name="adloader-resolve", daemon=True)
    t.start()
    t.join(max(0.0, deadline - time.monotonic()))
    if not result:
        return f"cannot resolve host {host!r}: no answer from the resolver in time"
    return result[0]


def _listening(path: str) -> bool:
    """Whether a process listens on the unix socket ``path``: a non-blocking connect succeeds (the
    kernel queues it even while the listener is stopped) or finds the backlog full (EAGAIN); refused
    or missing means nobody (unix(7)). The connection is closed at once, before any byte is sent."""
    import errno
    import socket

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
    try:
        s.connect(path)
        return True
    except OSError as e:
        return e.errno in (errno.EAGAIN, errno.EINPROGRESS)
    finally:
        s.close()


def _send_by(sock, data: bytes, deadline: float) -> bool:
    """Send one frame, retrying until ``deadline`` while no connection is complete (IMMEDIATE)."""
    import zmq

    while True:
        try:
            sock.send(data, zmq.NOBLOCK)
            return True
        except zmq.Again:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)


def timeout_arg(text: str) -> float:
    """argparse ``type`` of a command's ``--timeout-s``: a positive, finite number of seconds (NaN,
    inf, 0 and negatives are refused with exit status 2 and a line that names the value)."""
    import argparse

    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"must be a positive, finite number of seconds, got {text!r}")
    return v
