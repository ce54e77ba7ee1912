"""Is the process behind an agent endpoint one this process may talk to? Stdlib only.

``agent_untrusted(endpoint, uid=None, timeout_s=1.0)`` returns None when it is, else why not:
- the endpoint must be ipc:// (nothing can be authenticated over tcp://);
- the socket's directory (symlinks resolved) must belong to root or to ``uid`` and be writable by
  nobody else (so nobody else can replace the socket between this check and the connect);
- the socket file must belong to root or to ``uid``;
- the process listening on it must run as root or as ``uid``: ``SO_PEERCRED`` of a probe connection
  (for a listening unix socket, the credentials its owner had when it called ``listen()``, unix(7));
- the resolved path (what is probed and connected to) must fit a unix socket address
  (``UNIX_PATH_MAX_BYTES``), else no connection can be made: that is said, not taken for "no agent".
``NO_SOCKET`` and reasons starting with ``UNCHECKED`` mean there is nothing to judge yet (no file,
nobody listening, a probe that timed out): callers treat them as "no agent", not as an impostor.

Used by the client in training processes (``adloader.client``, before it says anything) and by the
agent's short-lived commands (``agent.rpc``: ``adloader job``, ``adloader status``).
"""
from __future__ import annotations

import os
import socket
import stat
import struct
import threading
from typing import Optional

from adloader import env

NO_SOCKET = "no socket"
UNCHECKED = "cannot check"
# sun_path holds 108 bytes with the terminating NUL (unix(7)); libzmq refuses a path of 108 (ipc_address.cpp)
UNIX_PATH_MAX_BYTES = 107


# Held from the probe's socket() until its connect() returned; a fork waits for it (register_at_fork
# below). A child forked in between got an unconnected copy of the probe, which nothing told from any
# other socket; the parent's connect then connected the child's copy too (one open file, fork(2)),
# and the child held a connection to the agent for its whole life. Forked after the connect, the
# child's hook (``adloader.client.close_inherited_agent_connections``) finds it by its peer and closes
# it. An RLock: a finalizer that forks in the probing thread itself does not deadlock. The wait is
# short: a unix stream connect never waits with a timeout set (a full backlog fails at once, EAGAIN).
_no_fork_mid_connect = threading.RLock()


def _release_after_fork() -> None:
    try:
        _no_fork_mid_connect.release()
    except RuntimeError:    # noqa: BLE001 — never fail someone else's fork
        pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_no_fork_mid_connect.acquire, after_in_parent=_release_after_fork,
                        after_in_child=_release_after_fork)


def peer_uid(path: str, timeout_s: float = 1.0) -> int:
    """The uid of the process listening on the unix socket ``path`` (SO_PEERCRED of a connection).
    No fork lands between the probe socket's creation and its connect (``_no_fork_mid_connect``)."""
    with _no_fork_mid_connect:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(timeout_s)
            s.connect(path)
        except BaseException:
            s.close()
            raise
    try:
        creds = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        return struct.unpack("3i", creds)[1]
    finally:
        s.close()


def agent_untrusted(endpoint: str, uid: Optional[int] = None, timeout_s: float = 1.0) -> Optional[str]:
    """None if the agent at ``endpoint`` may be trusted by a process of ``uid`` (module docstring),
    else why not. Never raises."""
    uid = os.getuid() if uid is None else uid
    trusted = {0, uid}
    path = env.ipc_path(endpoint)
    if path is None:
        return f"endpoint {endpoint!r} is not ipc://: the agent behind it cannot be authenticated"
    try:
        real = os.path.realpath(path)
        d = os.path.dirname(real) or "/"
        st_d = os.stat(d)
        if st_d.st_uid not in trusted:
            return f"the agent's directory {d} belongs to uid {st_d.st_uid}, not to root or uid {uid}"
        if st_d.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return f"the agent's directory {d} is writable by other users (mode {stat.S_IMODE(st_d.st_mode):o})"
        st = os.lstat(real)
        if not stat.S_ISSOCK(st.st_mode):
            return f"{real} is not a socket"
        if st.st_uid not in trusted:
            return f"the agent's socket {real} belongs to uid {st.st_uid}, not to root or uid {uid}"
    except FileNotFoundError:
        return NO_SOCKET
    except OSError as e:
        return f"{UNCHECKED} the agent's socket {path}: {e.strerror or e}"
    size = len(os.fsencode(real))
    if size > UNIX_PATH_MAX_BYTES:
        # the connect would fail with "AF_UNIX path too long", which reads like nobody listening; the
        # agent can bind the short path it was given (the kernel resolves the link), so the socket is there
        return (f"the agent's socket {path} resolves to {real}, {size} bytes, over the {UNIX_PATH_MAX_BYTES} "
                f"bytes a unix socket address holds (unix(7)); give the agent an endpoint whose path resolves "
                f"to a shorter one")
    try:
        peer = peer_uid(real, timeout_s)
    except OSError as e:   # nobody listening (a dead agent's file), or a full backlog: no agent now
        return f"{UNCHECKED} the agent's socket {path}: {e.strerror or e}"
    if peer not in trusted:
        return f"the process serving {real} runs as uid {peer}, not as root or uid {uid}"
    return None
