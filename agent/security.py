"""Who is talking, and how much: peer credentials, pid ownership, per-identity token buckets.

Who: on an ipc:// socket libzmq reads ``SO_PEERCRED`` when the peer connects and exposes it as the
message property ``Peer-Address`` = ``"<host>:<uid>:<gid>:<pid>"`` (libzmq src/stream_engine_base.cpp,
``ZMQ_HAVE_SO_PEERCRED``). The kernel fills it in, so a client cannot lie about its uid or pid. The agent:
- takes the caller's uid from the peer credentials, never from the message (the message's ``uid``
  must agree, else ``not_permitted``);
- accepts a ``hello``/``report`` only when the claimed pid is the connecting process itself, and the
  claimed worker pids belong to the caller's uid (a claimed worker that is no live process any more is
  left out: a retired worker may exit between the loader's report and the agent's check);
- lets root (the Slurm prolog/epilog) register/release any job and claim any uid there; a hello
  is always from the process itself, root or not.
Without peer credentials (tcp://, or a platform without SO_PEERCRED) every request that claims a job
is refused with ``not_permitted`` and a message saying why; ``status`` is still answered.

Containers (a pid namespace of their own, e.g. Kubernetes without ``hostPID``): the training process
knows itself and its workers by namespace-local pids, while SO_PEERCRED gives the agent the peer's pid
in the agent's own namespace (the host's; the agent runs with host pids). ``host_pid`` accepts a claimed
pid that differs from the peer's only when the last field of the ``NSpid`` line of
``<proc_root>/<peer pid>/status`` (proc(5): the pid in each nested namespace, outermost first, the
process's own last) equals it, and the agent then uses the peer's (host) pid. ``map_ns_pids`` turns the
worker pids such a process claims into host pids through its own descendants only: each descendant's
``NSpid`` field at the peer's namespace depth is its pid as the peer sees it. A claimed pid that maps
to no descendant is refused as before. Both read only files under ``proc_root`` (a parameter: tests
use fake trees); the kernel writes ``NSpid`` (Linux >= 4.1), so a client cannot forge it.

How much: a token bucket per ZeroMQ identity (``RATE_PER_S`` sustained, ``BURST``) and one per uid
(``UID_RATE_PER_S``, ``UID_BURST``; root exempt); a caller over either gets one ``rate_limited``
reply per second and its messages are dropped unparsed. A third bucket per uid counts the agent's own
CPU seconds spent on that uid's messages (``CpuBuckets``: ``uid_cpu_share`` seconds per second, a few
seconds of burst): a user whose messages are expensive (hundreds of pids each) is cut off by what they
cost, not by how many they are.

Connections (``ConnectionGuard``): libzmq accepts every connection on its own I/O thread and keeps a
file descriptor for each; at the open-files limit it cannot make the descriptors it needs and aborts
the process. The guard watches the ROUTER's monitor events (``ZMQ_EVENT_ACCEPTED`` carries the new
connection's fd, ``DISCONNECTED``/``CLOSED`` its end), reads the peer's uid from that fd with
``SO_PEERCRED`` on a duplicate of it, and shuts down (``shutdown(2)`` on the duplicate reaches the
shared socket; libzmq then closes its own fd) every connection over ``connections_per_uid`` for its
uid or over ``max_connections`` for all ordinary users together. Root is not counted. It runs on its
own thread, so a busy service loop does not delay it; the agent raises its soft open-files limit to
the hard one at start and lowers ``max_connections`` to fit under it with a reserve for its own files.
A descriptor is only touched when ``getsockname`` says it is a connection to the agent's own socket
(an fd number reused by the time the event is read is left alone).
"""
from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import zmq
from zmq.utils.monitor import parse_monitor_message

from agent.psi import pid_stat

log = logging.getLogger("agent.security")


RATE_PER_S = 50.0          # per ZeroMQ identity (a training process reports about once a second)
BURST = 100.0
UID_RATE_PER_S = 500.0     # per uid over all its connections (hundreds of ranks of one user are fine)
UID_BURST = 2000.0
MAX_BUCKETS = 8192


@dataclass(frozen=True)
class Peer:
    uid: int
    gid: int
    pid: int

    @property
    def root(self) -> bool:
        return self.uid == 0


def parse_peer_address(value: Optional[str]) -> Optional[Peer]:
    """``"host:uid:gid:pid"`` -> Peer; None when the transport gave no credentials. A pid of 0 is kept:
    the kernel gives 0 for a peer whose process is not in the reader's pid namespace or below it (an agent
    without the host's pid namespace: ``hostPID`` on Kubernetes), and the uid is still the caller's."""
    if not value:
        return None
    parts = value.rsplit(":", 3)
    if len(parts) != 4:
        return None
    try:
        uid, gid, pid = int(parts[1]), int(parts[2]), int(parts[3])
    except ValueError:
        return None
    if uid < 0 or pid < 0:
        return None
    return Peer(uid, gid, pid)


def peer_of(frame) -> Optional[Peer]:
    try:
        return parse_peer_address(frame.get("Peer-Address"))
    except Exception:
        return None


def pid_uid(pid: int, proc_root: str = "/proc") -> Optional[int]:
    """Real uid of a live process (the first field of the ``Uid:`` line of /proc/<pid>/status, proc(5)),
    None if it is gone or cannot be read. One open and read: a register with the most pids a message
    may carry costs milliseconds, not the 0.2 s it took through psutil."""
    if not isinstance(pid, int) or isinstance(pid, bool) or not 0 < pid < 2 ** 31:
        return None
    try:
        with open(f"{proc_root}/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _stat(pid: int, proc_root: str = "/proc") -> Optional[tuple[str, int, int]]:
    """(state, parent pid, start time in clock ticks since boot) from /proc/<pid>/stat, None if gone."""
    rest = pid_stat(pid, proc_root)
    try:
        return (rest[0].decode(), int(rest[1]), int(rest[19])) if rest is not None else None
    except (ValueError, IndexError):
        return None


def pid_start_ticks(pid: int, proc_root: str = "/proc") -> Optional[int]:
    """The process's start time (clock ticks since boot): with the pid, a process identity that
    survives pid reuse. None if the process is gone."""
    st = _stat(pid, proc_root)
    return st[2] if st is not None else None


def alive(pid: int, start_ticks: Optional[int], proc_root: str = "/proc") -> bool:
    """True if ``pid`` is the same live process as when first seen (not a zombie, not a reused pid).
    One read of <proc_root>/<pid>/stat: cheap enough for every rank on every tick."""
    st = _stat(pid, proc_root)
    if st is None or st[0] in ("Z", "X", "x"):
        return False
    return start_ticks is None or st[2] == start_ticks


def same_process(pid: int, start_ticks: Optional[int], uid: Optional[int], proc_root: str = "/proc") -> bool:
    """True if ``pid`` is still the process recorded as (pid, ``start_ticks``) and, with ``uid``, still
    that uid's (``alive``, then ``pid_uid``: two reads of ``<proc_root>/<pid>``). What a worker pid is
    checked by before anything is written to it: a pid reused since it was recorded is another process,
    possibly another user's. ``start_ticks`` None (not recorded): any live process of ``uid``."""
    return alive(pid, start_ticks, proc_root) and (uid is None or pid_uid(pid, proc_root) == uid)


def ns_pids(pid: int, proc_root: str = "/proc") -> Optional[tuple[int, ...]]:
    """The ``NSpid`` line of ``<proc_root>/<pid>/status``: the process's pid in each pid namespace it is
    in, from the one of ``proc_root``'s mount (the agent's) to its own. None if the process is gone or
    the kernel has no NSpid line."""
    try:
        with open(f"{proc_root}/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"NSpid:"):
                    return tuple(int(x) for x in line.split()[1:]) or None
    except (OSError, ValueError):
        return None
    return None


def in_child_pid_namespace(pid: int, proc_root: str = "/proc") -> bool:
    """True if ``pid`` is in a pid namespace below the agent's (``proc_root``'s): more than one
    ``NSpid`` field. Such a process numbers itself and its workers in its own namespace, even where its
    pid there happens to equal its host pid (then the claim alone cannot tell)."""
    ns = ns_pids(pid, proc_root)
    return ns is not None and len(ns) > 1


def host_pid(claimed: int, peer_pid: int, proc_root: str = "/proc") -> Optional[int]:
    """The (host) pid of the process that claims to be ``claimed`` and connected as ``peer_pid``
    (SO_PEERCRED): ``peer_pid`` when the claim is that process itself, in the agent's pid namespace or
    in its own (the last NSpid field; a container), else None."""
    if claimed == peer_pid:
        return peer_pid
    ns = ns_pids(peer_pid, proc_root)
    if ns is not None and len(ns) > 1 and ns[-1] == claimed:
        return peer_pid
    return None


def descendants(pid: int, proc_root: str = "/proc") -> list[int]:
    """Every live descendant of ``pid`` (children, their children, ...), from the parent pids in
    ``<proc_root>/*/stat`` (what psutil's ``children(recursive=True)`` reads, with the root a parameter)."""
    try:
        names = os.listdir(proc_root)
    except OSError:
        return []
    children: dict[int, list[int]] = {}
    for name in names:
        if name.isdigit():
            st = _stat(int(name), proc_root)
            if st is not None:
                children.setdefault(st[1], []).append(int(name))
    out, todo, seen = [], [pid], {pid}
    while todo:
        for c in children.get(todo.pop(), ()):
            if c not in seen:
                seen.add(c)
                out.append(c)
                todo.append(c)
    return out


def map_ns_pids(claimed, peer_pid: int, proc_root: str = "/proc") -> tuple[dict[int, int], list[int]]:
    """Pids as the peer's own pid namespace numbers them -> host pids, through the peer's descendants.
    Returns (mapping for every claimed pid found, the claimed pids that map to none)."""
    ns = ns_pids(peer_pid, proc_root)
    wanted = set(claimed)
    found: dict[int, int] = {}
    if ns is not None and wanted:
        depth = len(ns)
        for d in descendants(peer_pid, proc_root):
            d_ns = ns_pids(d, proc_root)
            if d_ns is not None and len(d_ns) >= depth and d_ns[depth - 1] in wanted:
                found[d_ns[depth - 1]] = d
    return found, [p for p in claimed if p not in found]


def pid_namespace(pid: int, proc_root: str = "/proc") -> Optional[str]:
    """The pid namespace ``pid`` is in: the target of ``<proc_root>/<pid>/ns/pid`` ("pid:[inode]"), or
    None if it cannot be read (the process is gone)."""
    try:
        return os.readlink(f"{proc_root}/{pid}/ns/pid")
    except OSError:
        return None


def ns_pids_held(claimed, peer_pid: int, proc_root: str = "/proc") -> list[int]:
    """Those of ``claimed`` (pids as the peer's pid namespace numbers them) that a live process of the
    peer's own namespace holds (same ``ns/pid``; one scan of ``proc_root``). A claimed pid that no
    descendant holds is either another process of the container (refuse the claim) or one that exited
    since the loader listed it (leave it out): this tells them apart. Where the peer's namespace cannot
    be read, or a process's cannot, nothing is counted held: leaving a pid out grants nothing."""
    mine, ns = pid_namespace(peer_pid, proc_root), ns_pids(peer_pid, proc_root)
    wanted = set(claimed)
    if mine is None or ns is None or not wanted:
        return []
    depth, held = len(ns), set()
    try:
        names = os.listdir(proc_root)
    except OSError:
        return []
    for name in names:
        if not name.isdigit():
            continue
        p_ns = ns_pids(int(name), proc_root)
        if p_ns is not None and len(p_ns) == depth and p_ns[-1] in wanted \
                and pid_namespace(int(name), proc_root) == mine:
            held.add(p_ns[-1])
    return [p for p in claimed if p in held]


def live_pids_owned_by(pids, uid: int) -> tuple[list[int], str]:
    """(the live ones of ``pids``, "") when every live one is a process of ``uid``, else ([], why). A
    pid that is no live process is left out, not refused: a loader lists its workers when it writes a
    report, and one it retired may exit before the agent reads it (nothing there to control; refusing
    the report cut the job off the agent for a minute, its CPU counted as another tenant's)."""
    live = []
    for p in pids:
        if not isinstance(p, int) or isinstance(p, bool) or p <= 0:
            return [], f"pid {p!r} is not a process id"
        owner = pid_uid(p)
        if owner is None:
            continue
        if owner != uid:
            return [], f"pid {p} belongs to uid {owner}, not {uid}"
        live.append(p)
    return live, ""


def pids_owned_by(pids, uid: int) -> tuple[bool, str]:
    """All ``pids`` are live processes of ``uid`` (root callers are checked by the caller)."""
    pids = list(pids)
    live, why = live_pids_owned_by(pids, uid)
    if why:
        return False, why
    alive = set(live)
    gone = next((p for p in pids if p not in alive), None)
    return (False, f"pid {gone} is not a live process") if gone is not None else (True, "")


class TokenBuckets:
    """One token bucket per key, LRU-bounded. ``take(key, now)`` -> True if allowed."""

    def __init__(self, rate_per_s: float = RATE_PER_S, burst: float = BURST, max_keys: int = MAX_BUCKETS):
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.max_keys = max_keys
        self._b: "OrderedDict[bytes, list[float]]" = OrderedDict()

    def take(self, key: bytes, now: Optional[float] = None) -> bool:
        now = time.monotonic() if now is None else now
        b = self._b.get(key)
        if b is None:
            if len(self._b) >= self.max_keys:
                self._b.popitem(last=False)
            b = self._b[key] = [self.burst, now]
        else:
            self._b.move_to_end(key)
        tokens = min(self.burst, b[0] + (now - b[1]) * self.rate_per_s)
        b[1] = now
        if tokens >= 1.0:
            b[0] = tokens - 1.0
            return True
        b[0] = tokens
        return False


class CpuBuckets:
    """Agent CPU seconds per uid: ``allowed(uid, now)`` before handling a message, ``charge(uid, s)``
    after. A uid may spend ``share`` CPU-seconds per second, with ``burst_s`` in hand; once its bucket
    is empty its messages are dropped until it refills."""

    def __init__(self, share: float = 0.1, burst_s: Optional[float] = None, max_keys: int = MAX_BUCKETS):
        self.share = share
        self.burst_s = burst_s if burst_s is not None else max(0.25, 5.0 * share)
        self.max_keys = max_keys
        self._b: "OrderedDict[int, list[float]]" = OrderedDict()

    def _refill(self, uid: int, now: float) -> list[float]:
        b = self._b.get(uid)
        if b is None:
            if len(self._b) >= self.max_keys:
                self._b.popitem(last=False)
            b = self._b[uid] = [self.burst_s, now]
        else:
            self._b.move_to_end(uid)
            b[0] = min(self.burst_s, b[0] + max(0.0, now - b[1]) * self.share)
            b[1] = now
        return b

    def allowed(self, uid: int, now: float) -> bool:
        return self._refill(uid, now)[0] > 0.0

    def charge(self, uid: int, cpu_s: float, now: float) -> None:
        self._refill(uid, now)[0] -= max(0.0, cpu_s)


_UCRED = struct.Struct("3i")     # struct ucred {pid_t pid; uid_t uid; gid_t gid;}


def socket_peer(sock: socket.socket) -> Optional[Peer]:
    """The credentials of the other end of a connected AF_UNIX socket (SO_PEERCRED), None if unknown."""
    try:
        pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    except OSError:
        return None
    if pid <= 0 or uid < 0:
        return None
    return Peer(uid, gid, pid)


class ConnectionGuard:
    """Per-uid and global bounds on the connections an ipc ROUTER holds (module docstring)."""

    def __init__(self, sock, path: str, *, max_connections: int, per_uid: int,
                 on_refused=None):
        self._zmq = zmq
        self._parse = parse_monitor_message
        self.path = path
        self.max_connections = max_connections
        self.per_uid = per_uid
        self.on_refused = on_refused
        self.by_fd: dict[int, Optional[int]] = {}      # fd -> uid counted (None: root, refused or unknown)
        self.by_uid: dict[int, int] = {}
        self.total = 0
        self.refused: dict[int, int] = {}
        self.accepted = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        events = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
        self._mon = sock.get_monitor_socket(events)
        self._sock = sock
        self._thread = threading.Thread(target=self._run, name="adloader-connection-guard", daemon=True)
        self._thread.start()

    def snapshot(self) -> dict:
        with self._lock:
            top = sorted(self.by_uid.items(), key=lambda kv: -kv[1])[:5]
            return {"open": self.total, "max_connections": self.max_connections, "per_uid": self.per_uid,
                    "accepted": self.accepted, "by_uid_top": {str(u): n for u, n in top},
                    "refused_by_uid": {str(u): n for u, n in sorted(self.refused.items())[:20]}}

    def _run(self) -> None:
        zmq = self._zmq
        while not self._stop.is_set():
            try:
                if not self._mon.poll(200):
                    continue
                while True:
                    try:
                        frames = self._mon.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    ev = self._parse(frames)
                    self._event(ev["event"], ev["value"])
            except zmq.ContextTerminated:
                return
            except Exception as e:   # never let the guard die silently: log and keep going
                log.error("connection guard: %s: %s", type(e).__name__, e)
                time.sleep(0.05)

    def _event(self, event: int, fd: int) -> None:
        zmq = self._zmq
        if event == zmq.EVENT_ACCEPTED:
            self._accepted(fd)
        elif event in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED):
            with self._lock:
                uid = self.by_fd.pop(fd, None)
                if uid is not None:
                    self.total -= 1
                    left = self.by_uid.get(uid, 1) - 1
                    if left > 0:
                        self.by_uid[uid] = left
                    else:
                        self.by_uid.pop(uid, None)

    def _accepted(self, fd: int) -> None:
        try:
            dup = socket.socket(fileno=os.dup(fd))
        except OSError:
            return            # already closed by libzmq
        try:
            try:
                if dup.family != socket.AF_UNIX or dup.getsockname() != self.path:
                    return    # the fd number was reused for something else by now
            except OSError:
                return
            peer = socket_peer(dup)
            with self._lock:
                self.accepted += 1
                if fd in self.by_fd:       # a missed close of the same number: forget the old one
                    old = self.by_fd.pop(fd)
                    if old is not None:
                        self.total -= 1
                        self.by_uid[old] = self.by_uid.get(old, 1) - 1
                if peer is None or peer.uid == 0:
                    self.by_fd[fd] = None
                    return
                uid = peer.uid
                over = None
                if self.by_uid.get(uid, 0) >= self.per_uid:
                    over = f"uid {uid} has {self.by_uid.get(uid, 0)} connections open (connections_per_uid {self.per_uid})"
                elif self.total >= self.max_connections:
                    over = f"{self.total} connections open from ordinary users (max_connections {self.max_connections})"
                if over is None:
                    self.by_fd[fd] = uid
                    self.by_uid[uid] = self.by_uid.get(uid, 0) + 1
                    self.total += 1
                    return
                self.by_fd[fd] = None
                self.refused[uid] = self.refused.get(uid, 0) + 1
                if len(self.refused) > 4096:
                    self.refused.clear()
            try:
                dup.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            if self.on_refused is not None:
                self.on_refused(uid, peer.pid, over)
        finally:
            dup.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        try:
            self._sock.disable_monitor()
        except Exception:
            pass
        try:
            self._mon.close(0)
        except Exception:
            pass
