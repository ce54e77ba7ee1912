"""Who is talking, and how much: peer credentials, pid ownership, per-identity token buckets.

Who: on an ipc:// socket libzmq reads ``SO_PEERCRED`` when the peer connects and exposes it as the
message property ``Peer-Address`` = ``"<host>:<uid>:<gid>:<pid>"`` (libzmq src/stream_engine_base.cpp,
``ZMQ_HAVE_SO_PEERCRED``). The kernel fills it in, so a client cannot lie about its uid or pid. The agent:
- takes the caller's uid from the peer credentials, never from the message (the message's ``uid``
  must agree, else ``not_permitted``);
- accepts a ``hello``/``report`` only when the claimed pid is the connecting process itself, and the
  claimed worker pids belong to the caller's uid;
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
reply per second and its messages are dropped unparsed.
"""
from __future__ import annotations

import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import psutil

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
    """``"host:uid:gid:pid"`` -> Peer; None when the transport gave no credentials."""
    if not value:
        return None
    parts = value.rsplit(":", 3)
    if len(parts) != 4:
        return None
    try:
        uid, gid, pid = int(parts[1]), int(parts[2]), int(parts[3])
    except ValueError:
        return None
    if uid < 0 or pid <= 0:
        return None
    return Peer(uid, gid, pid)


def peer_of(frame) -> Optional[Peer]:
    try:
        return parse_peer_address(frame.get("Peer-Address"))
    except Exception:
        return None


def pid_uid(pid: int) -> Optional[int]:
    """Real uid of a live process, None if it is gone or cannot be read."""
    try:
        return psutil.Process(pid).uids().real
    except (psutil.Error, ValueError, OverflowError):
        return None


def _stat(pid: int, proc_root: str = "/proc") -> Optional[tuple[str, int, int]]:
    """(state, parent pid, start time in clock ticks since boot) from /proc/<pid>/stat, None if gone.
    The command name may hold spaces and parentheses: split at the last ')' (proc(5))."""
    try:
        with open(f"{proc_root}/{pid}/stat", "rb") as f:
            data = f.read()
    except (OSError, ValueError):
        return None
    try:
        rest = data[data.rindex(b")") + 2:].split()
        return rest[0].decode(), int(rest[1]), int(rest[19])
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


def pids_owned_by(pids, uid: int) -> tuple[bool, str]:
    """All ``pids`` are live processes of ``uid`` (root callers are checked by the caller)."""
    for p in pids:
        if not isinstance(p, int) or isinstance(p, bool) or p <= 0:
            return False, f"pid {p!r} is not a process id"
        owner = pid_uid(p)
        if owner is None:
            return False, f"pid {p} is not a live process"
        if owner != uid:
            return False, f"pid {p} belongs to uid {owner}, not {uid}"
    return True, ""


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
