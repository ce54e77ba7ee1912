"""The agent's side of the wire: one ZeroMQ ROUTER, protocol decode, requests -> registry, replies.

Socket: ROUTER bound on the configured endpoint with ROUTER_MANDATORY (a send to a vanished client
fails at once instead of vanishing), LINGER=0, MAXMSGSIZE=protocol.MAX_MESSAGE_BYTES (libzmq drops
the connection of a peer that sends more; it never reaches us), RCVHWM=``RCVHWM`` messages per
connection (what libzmq may hold for us from one peer before it stops reading that peer's socket, so
queued bytes are at most connections x (RCVHWM + 1) x MAXMSGSIZE, and connections are bounded per uid
and in all by ``security.ConnectionGuard``), SNDHWM bounded, sends non-blocking:
a directive or reply that cannot go out now is dropped (the client re-asks; directives are resent on
hello). The ipc socket's directory is created 0755; the socket is made 0666 when the agent runs as
root (any user's training process may connect; peer credentials decide what each may do) and 0600
otherwise (only the agent's user). ``close(refused=True)`` (a start refused after ``bind``) also
removes what this bind made: the lock file beside the socket, then the directories (empty only; one
that existed before is kept, and so is another agent's socket: only the holder of the lock touches it). An ipc path that holds anything but a socket is refused (libzmq
unlinks whatever is there before it binds), and so is an endpoint libzmq cannot bind: both are
``EndpointUnusable``, raised with the socket closed (an open one would hang the context's ``term``).

Per message (``handle_ready``, which stops after ``budget_s`` of wall time, however many messages wait:
the service loop's ticks, heartbeats and watchdog pings are due by the clock, not by a message
count): token bucket per identity, then one per uid (root exempt) so that rotating identities does
not help a flood, then the uid's agent-CPU bucket (``security.CpuBuckets``; each message's CPU time
is charged to its uid) (over any: dropped unparsed, one ``rate_limited`` reply per second and one log
line per period) -> exactly one frame -> ``protocol.decode``
(size, JSON, version, schema; a ``ProtocolError`` becomes an ``error`` reply with its code) ->
peer credentials (``agent.security``) -> the registry. A ``Refused`` from the registry becomes an
``error`` reply; any other exception is logged and answered ``internal``: one bad message never
takes the agent down or touches another job.

Replies: hello -> ``welcome`` (+ the job's current directive, if any); report/heartbeat -> nothing
(reports are the client's heartbeats); bye/register/release -> ``ok``; status -> ``status``.
The agent sends every connected client a ``heartbeat`` each ``heartbeat_s`` (``heartbeat(now)``).
"""
from __future__ import annotations

import json
import logging
import os
import resource
import stat
import time
from dataclasses import dataclass
from typing import Callable, Optional

import zmq

from adloader import env, protocol
from agent import logs, security, statefile
from agent.registry import Refused, Registry

log = logging.getLogger("agent.server")
CLIENT_TO_AGENT = frozenset({"hello", "report", "heartbeat", "bye", "register", "release", "status"})
BUDGET_S = 0.05       # wall time one handle_ready may spend before the loop gets its turn
RCVHWM = 8            # messages libzmq queues per connection for us
RESERVED_FDS = 256    # open files kept for the agent itself (journal, /proc, cgroup files, metrics)


@dataclass(frozen=True)
class ServerLimits:
    max_connections: int = 1024
    connections_per_uid: int = 64
    uid_cpu_share: float = 0.1


class EndpointBusy(RuntimeError):
    pass


class EndpointUnsafe(EndpointBusy):
    """The socket's directory is controlled by another user: clients would (rightly) refuse it."""


class EndpointUnusable(EndpointBusy):
    """The endpoint cannot be bound: a malformed address, a port in use, or a path that holds something
    other than a socket (libzmq unlinks whatever is at an ipc:// path before it binds: a file there
    would be lost, so the agent refuses instead)."""


def rank_directive(directive: dict, ranks: int) -> dict:
    """One rank's part of a job's directive (``workers`` and ``cpus`` the job's, all its ranks' together):
    the workers spread evenly, rounded up (a data-parallel job steps at its slowest rank's pace, so a
    rank short of its part would hold every rank back), and the cores divided. The ranks are the most the
    job has had since the directive was made (its ``ranks``, recorded by ``Server.send_directive`` and
    raised by ``Server._hello`` when a rank joins; ``ranks`` where it has none: a journal from before):
    until the next plan, the job's ranks together never run more than its plan (rounded up to whole
    ranks), and every rank runs the same part. A rank that joins late gets the plan's total over the
    ranks now known at its hello, and its peers are sent their new part with it (before, it was sent
    the part its peers had, the plan for fewer ranks, so a 2-rank job planned 3 workers for its first
    rank ran 3 on each until the next tick re-split the plan); a lone rank reconnecting after its peer
    died is sent its part of the plan made for both, not both ranks' workers. A rank that leaves (bye,
    or found gone by the tick's sweep) changes nothing sent then: its peers keep their part, fewer
    workers in all than the plan, until the next tick sends the job's count again over the ranks left
    (``DirectiveActuator.tracks_ranks``; a rank found gone by the sweep is in that same tick's plan).
    Not re-split at the leave: its peers are often leaving too (the end of a run, a torchrun restart),
    and would fork workers only to exit. With one rank (or none said hello yet), the directive as it
    is."""
    out = {k: v for k, v in directive.items() if k != "ranks"}
    ranks = directive.get("ranks") or ranks
    if ranks <= 1:
        return out
    out["workers"] = -(-int(directive["workers"]) // ranks)
    if directive.get("cpus") is not None:
        out["cpus"] = directive["cpus"] / ranks
    return out


class Server:
    def __init__(self, endpoint: str, registry: Registry, *, heartbeat_s: float,
                 on_report: Callable[[str, int, int, dict, float], None],
                 status_doc: Callable[[], dict], ctx: Optional[zmq.Context] = None,
                 buckets: Optional[security.TokenBuckets] = None, limits: Optional[ServerLimits] = None):
        self.endpoint = endpoint
        self.registry = registry
        self.heartbeat_s = heartbeat_s
        self.on_report = on_report
        self.status_doc = status_doc
        self.ctx = ctx or zmq.Context.instance()
        self.buckets = buckets or security.TokenBuckets()
        self.uid_buckets = security.TokenBuckets(security.UID_RATE_PER_S, security.UID_BURST)
        self.limits = limits or ServerLimits()
        self.cpu_buckets = security.CpuBuckets(self.limits.uid_cpu_share)
        self.guard: Optional[security.ConnectionGuard] = None
        self.fd_limit: Optional[int] = None
        self.budget_hits = 0          # handle_ready calls that stopped on the time budget
        self.sock: Optional[zmq.Socket] = None
        self._lock_fd: Optional[int] = None
        self._made_lock = False                 # this bind created <path>.lock
        self._made_dirs: list[str] = []         # the socket directory levels this bind created
        self._last_heartbeat = 0.0
        self._limited_log = logs.RateLimitedLog(log, period_s=10.0)
        self._limited_reply: dict[bytes, float] = {}
        self.counts: dict[str, int] = {}
        self.errors: dict[str, int] = {}
        self.now = 0.0

    # --- socket lifecycle -------------------------------------------------------------------------
    def bind(self) -> None:
        path = env.ipc_path(self.endpoint)
        if path is not None:
            d = os.path.dirname(path)
            self._made_dirs += statefile.make_dir(d, mode=0o755)
            st = os.stat(d)
            if st.st_uid not in (0, os.getuid()) or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                raise EndpointUnsafe(
                    f"the socket directory {d} belongs to uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):o}: "
                    f"another user could replace the socket, and clients refuse such an agent; remove it or "
                    f"set endpoint to a directory owned by uid {os.getuid()} (or root) that only it can write")
            # what is at the path is refused before the lock file beside it is made: a refused start
            # leaves nothing behind (the lock was made first, and <path>.lock stayed next to the file)
            try:
                kind = stat.S_IFMT(os.lstat(path).st_mode)
            except FileNotFoundError:
                kind = None
            if kind is not None and kind != stat.S_IFSOCK:
                raise EndpointUnusable(
                    f"cannot bind {self.endpoint}: {path} exists and is not a socket ("
                    f"{'a directory' if kind == stat.S_IFDIR else 'a file, which binding would delete'}): "
                    f"move it away or set endpoint to another path")
            self._lock(path + ".lock")
        s = self.ctx.socket(zmq.ROUTER)
        try:
            s.setsockopt(zmq.ROUTER_MANDATORY, 1)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
            s.setsockopt(zmq.SNDHWM, 100)
            s.setsockopt(zmq.RCVHWM, RCVHWM)
            try:
                s.bind(self.endpoint)
            except zmq.ZMQError as e:
                raise EndpointUnusable(f"cannot bind {self.endpoint}: {e.strerror}") from None
            if path is not None:
                os.chmod(path, 0o666 if os.getuid() == 0 else 0o600)
                max_conn = self._fit_fd_limit(self.limits.max_connections)
                self.guard = security.ConnectionGuard(
                    s, path, max_connections=max_conn, per_uid=min(self.limits.connections_per_uid, max_conn),
                    on_refused=self._connection_refused)
        except BaseException:
            # a socket left open here would block the context's term() for ever (the agent hung
            # after its traceback instead of exiting)
            s.close(linger=0)
            raise
        self.sock = s

    def _fit_fd_limit(self, wanted: int) -> int:
        """Raise the soft open-files limit to the hard one, and keep the connection bound under it."""
        try:
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            if hard == resource.RLIM_INFINITY or hard > soft:
                target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                soft = target
        except (OSError, ValueError):
            soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        self.fd_limit = soft
        # each connection holds one fd; root's connections and the agent's own files use the reserve
        fit = max(1, soft - 2 * RESERVED_FDS)
        if fit < wanted:
            logs.event(log, "connections_bounded_by_fd_limit", logging.WARNING, max_connections=wanted,
                       open_files_limit=soft, used=fit,
                       detail="raise LimitNOFILE in the unit to allow more connections")
        return min(wanted, fit)

    def _connection_refused(self, uid: int, pid: int, why: str) -> None:
        self.errors["connection_refused"] = self.errors.get("connection_refused", 0) + 1
        self._limited_log.event(f"conn:{uid}", "connection_refused", logging.WARNING, uid=uid, pid=pid, why=why)

    def _lock(self, lock_path: str) -> None:
        """One agent per endpoint: libzmq would silently unlink a live agent's socket on bind.

        A refused start unlinks the lock file it made (while holding it), so a lock taken on a file
        that is no longer the one at ``lock_path`` proves nothing: it is let go and taken again."""
        import fcntl

        for _ in range(10):
            try:
                fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                made = True
            except FileExistsError:
                try:
                    fd = os.open(lock_path, os.O_RDWR)
                except FileNotFoundError:   # unlinked meanwhile by a refused start: again
                    continue
                made = False
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                try:
                    other = os.read(fd, 32).decode().strip()
                except OSError:
                    other = "?"
                os.close(fd)
                raise EndpointBusy(f"another agent (pid {other or '?'}) is serving {self.endpoint} "
                                   f"(lock {lock_path} is held)") from None
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(lock_path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        else:
            raise EndpointBusy(f"cannot take the lock {lock_path} for {self.endpoint}: it keeps being replaced")
        self._made_lock = made
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

    def close(self, *, refused: bool = False) -> None:
        """Close the socket, and unlink it if this agent holds the lock. ``refused``: the start did not
        go through, so the lock file and the directories this bind made are removed as well (empty
        directories only)."""
        if self.guard is not None:
            self.guard.close()
            self.guard = None
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None
        path = env.ipc_path(self.endpoint)
        if path is not None and self._lock_fd is not None:
            try:
                if stat.S_ISSOCK(os.lstat(path).st_mode):
                    os.unlink(path)
            except OSError:
                pass
        if path is not None and self._lock_fd is not None and refused and self._made_lock:
            try:   # unlinked while still held: an agent that opened it meanwhile sees it replaced (_lock)
                os.unlink(path + ".lock")
            except OSError:
                pass
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        self._made_lock = False
        if refused:
            statefile.remove_made(self._made_dirs)
        self._made_dirs = []

    # --- sending ----------------------------------------------------------------------------------
    def _send(self, identity: bytes, msg) -> bool:
        """Send ``msg`` (a message dict, or its encoded bytes) to one connection; False if it would block."""
        if isinstance(msg, bytes):
            data = msg
        else:
            try:
                data = protocol.encode(msg)
            except protocol.ProtocolError:
                data = json.dumps(msg, separators=(",", ":"), default=str).encode()   # a big status doc
        try:
            self.sock.send_multipart([identity, data], zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                return False
            raise

    def _error(self, identity: bytes, code: str, message: str, re: Optional[str] = None) -> None:
        self.errors[code] = self.errors.get(code, 0) + 1
        self._send(identity, protocol.error(code, message, re))

    def send_directive(self, job_id: str, workers: int, cpus: Optional[float], cpuset: Optional[list],
                       reason: str) -> bool:
        """DirectiveActuator's sink: send to every connected rank of the job. True if at least one
        rank was sent it, or if the job has no rank connected yet (registered by the Slurm prolog,
        or re-adopted after a restart): the directive is kept on the job and every rank that says
        hello gets it with its welcome. False when ranks are connected and none could be sent it.

        ``workers`` and ``cpus`` are the job's (all its ranks' together, as the collector counts them);
        each rank is sent its part (``rank_directive``)."""
        job = self.registry.jobs.get(job_id)
        if job is None:
            return False
        job.last_directive = {"workers": int(workers), "cpus": cpus, "cpuset": list(cpuset) if cpuset else None,
                              "reason": reason, "ranks": len(job.ranks)}
        connected = [r for r in job.ranks.values() if r.identity]
        if not connected:
            return True
        msg = protocol.make("directive", job=job_id, seq=self.registry.next_seq(job_id),
                            **rank_directive(job.last_directive, len(job.ranks)))
        sent = False
        for r in connected:
            if self._send(r.identity, msg):
                sent = True
        return sent

    def heartbeat(self, now: float) -> None:
        if now - self._last_heartbeat < self.heartbeat_s:
            return
        self._last_heartbeat = now
        hb = protocol.encode(protocol.make("heartbeat"))   # once for every connection
        for identity in list(self.registry.by_identity):
            if identity:
                self._send(identity, hb)

    # --- receiving --------------------------------------------------------------------------------
    def handle_ready(self, now: float, budget_s: float = BUDGET_S) -> int:
        """Handle the messages waiting now, for at most ``budget_s`` seconds of wall time; returns
        how many. Messages left over stay queued (libzmq's fair queue serves every connection in
        turn) for the next call."""
        self.now = now
        n = 0
        t_end = time.monotonic() + budget_s
        while True:
            if n and time.monotonic() >= t_end:
                self.budget_hits += 1
                break
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            n += 1
            try:
                self._handle(frames, now)
            except Exception as e:   # never let one message take the agent down
                logs.event(log, "message_failed", logging.ERROR, error=f"{type(e).__name__}: {e}")
                try:
                    self._error(frames[0].bytes, "internal", "the agent failed on this message; it is logged")
                except Exception:
                    pass
        return n

    def _handle(self, frames, now: float) -> None:
        identity = frames[0].bytes
        if not self.buckets.take(identity, now):
            self._limited(identity, now, f"more than {security.RATE_PER_S:g} messages/s from this connection")
            return
        peer = security.peer_of(frames[-1])   # (after the per-connection bucket: a flood pays for no parse)
        # a second bucket per uid: one user rotating identities cannot flood either (root exempt)
        if peer is not None and not peer.root:
            if not self.uid_buckets.take(b"uid:%d" % peer.uid, now):
                self._limited(identity, now, f"more than {security.UID_RATE_PER_S:g} messages/s from uid {peer.uid}")
                return
            if not self.cpu_buckets.allowed(peer.uid, now):
                self._limited(identity, now, f"messages from uid {peer.uid} cost the agent more than "
                                             f"{self.limits.uid_cpu_share:g} CPU seconds per second (uid_cpu_share)")
                return
            c0 = time.thread_time()
            try:
                self._dispatch(identity, peer, frames, now)
            finally:
                self.cpu_buckets.charge(peer.uid, time.thread_time() - c0, now)
            return
        self._dispatch(identity, peer, frames, now)

    def _dispatch(self, identity: bytes, peer, frames, now: float) -> None:
        if len(frames) != 2:
            self._bad(identity, "malformed", f"expected one frame per message, got {len(frames) - 1}")
            return
        frame = frames[1]
        try:
            msg = protocol.decode(frame.bytes)
        except protocol.ProtocolError as e:
            self._bad(identity, e.code, str(e))
            return
        t = msg["type"]
        self.counts[t] = self.counts.get(t, 0) + 1
        if t not in CLIENT_TO_AGENT:
            self._bad(identity, "unknown_type", f"{t!r} is sent by the agent, not to it", t)
            return
        try:
            if t == "hello":
                self._hello(identity, peer, msg, now)
            elif t == "report":
                r = self.registry.report(identity, peer, msg, now)
                self.on_report(r.job, r.rank, r.pid, msg["stats"], now)
            elif t == "heartbeat":
                if "job" in msg:
                    self.registry.touch(identity, peer, msg, now)
            elif t == "bye":
                self.registry.bye(identity, peer, msg)
                logs.event(log, "rank_left", job=msg["job"], rank=msg["rank"], pid=msg["pid"])
                self._send(identity, protocol.make("ok", re="bye"))
            elif t == "register":
                job = self.registry.register(peer, msg, now)
                logs.event(log, "job_registered", job=job.job, uid=job.uid, gpus=list(job.reg_gpus),
                           cpus=job.reg_cpus, source=msg.get("source"))
                self._send(identity, protocol.make("ok", re="register"))
            elif t == "release":
                was = self.registry.release(peer, msg)
                self._send(identity, protocol.make("ok", re="release",
                                                   detail="released" if was else "not known (already released)"))
            elif t == "status":
                self._send(identity, {"v": protocol.VERSION, "type": "status", "doc": self.status_doc()})
        except Refused as e:
            self._bad(identity, e.code, str(e), t)

    def _limited(self, identity: bytes, now: float, why: str) -> None:
        self.errors["rate_limited"] = self.errors.get("rate_limited", 0) + 1
        last = self._limited_reply.get(identity, -1e9)
        if now - last >= 1.0:
            if len(self._limited_reply) > 4096:
                self._limited_reply.clear()
            self._limited_reply[identity] = now
            self._send(identity, protocol.error("rate_limited", f"{why}; messages are dropped"))
        self._limited_log.event(identity.hex()[:64], "rate_limited", identity=identity[:64].decode("utf-8", "replace"),
                                why=why)

    def _bad(self, identity: bytes, code: str, message: str, re: Optional[str] = None) -> None:
        self._error(identity, code, message, re)
        self._limited_log.event(f"{code}:{identity.hex()[:64]}", "request_refused", code=code, message=message[:300],
                                identity=identity[:64].decode("utf-8", "replace"))

    def _hello(self, identity: bytes, peer, msg: dict, now: float) -> None:
        new_job = msg["job"] not in self.registry.jobs
        r = self.registry.hello(peer, identity, msg, now)
        job = self.registry.jobs[r.job]
        if new_job:
            logs.event(log, "job_arrived", job=r.job, uid=r.uid, rank=r.rank, pid=r.pid, via="hello")
        logs.event(log, "rank_hello", job=r.job, rank=r.rank, pid=r.pid, workers=r.workers,
                   worker_pids=len(r.worker_pids))
        self._send(identity, protocol.make("welcome", job=r.job, heartbeat_s=self.heartbeat_s, challenge=None))
        d = job.last_directive
        if d is None:
            return
        to = [r]
        if d.get("ranks") is not None and len(job.ranks) > d["ranks"]:
            # a rank joined since the plan: the plan's total over the ranks now known, to every connected
            # rank at once, not only at the next tick (``rank_directive``)
            d["ranks"] = len(job.ranks)
            to = [x for x in job.ranks.values() if x.identity]
        msg = protocol.make("directive", job=r.job, seq=self.registry.next_seq(r.job),
                            **rank_directive(d, len(job.ranks)))
        for x in to:
            self._send(x.identity, msg)
