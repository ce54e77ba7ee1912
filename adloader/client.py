"""The agent client inside a training process: hello, reports, directives. Stdlib + pyzmq only.

``adloader.DataLoader`` calls ``attach(loader)`` at its first ``__iter__`` (main process only) and
``detach(loader)`` from ``close()``. Everything else happens on one background daemon thread that
owns the ZeroMQ context and DEALER socket (a zmq socket is not thread-safe; it is never touched from
the training thread).

Invariants (STYLE 8):
- Never blocks a training step: ``attach``/``detach`` only start/signal the thread (``detach`` waits
  at most ``DETACH_WAIT_S``); sends are non-blocking with a small SNDHWM and IMMEDIATE, so a report
  that cannot go out now is dropped, never queued behind a slow or absent agent.
- Never raises into training: every failure of the client itself is caught and logged at DEBUG
  (a version mismatch or a refusal is logged once at WARNING; so is a message from the agent that
  ``protocol.decode`` refuses, once per kind of problem; an agent of another major version stops the
  client). The socket takes no frame over ``protocol.MAX_MESSAGE_BYTES`` (``MAXMSGSIZE``: libzmq drops
  the connection instead, which ``_ConnectionWatch`` notices: one WARNING naming the limit, and the
  client connects again at once) and at most ``RCVHWM`` are queued; a burst is read ``MESSAGES_PER_PASS`` at
  a time, so an agent that floods never holds up ``detach``, reports or the silence check. Errors raised by the loader's own
  ``resize``/``stats`` are caught too; the loader surfaces its dataset errors on the training thread.
  A ``Warning`` that ``resize`` raises (the warning filters make its notice an error, ``-W error``)
  comes after the resize is done: the directive counts as applied.
- A failure of the thread's own loop (an exception the client did not expect: a bug) is one WARNING
  with the job, the endpoint and the traceback; the loader the agent directed goes back to its own
  count (``requested_workers``) at once, and the loop starts again, on a new context and socket, after
  ``RESTART_S`` (doubling up to ``RESTART_MAX_S``), at most ``MAX_RESTARTS`` times; then the client
  stops (one more WARNING; ``state()`` says ``gave_up``), its loaders train on at their own counts,
  and the next ``attach`` (a loader's first iteration) starts a new one that takes over its loaders.
- Silent without an agent: if the endpoint's socket file does not exist, nothing is created and the
  file is re-checked every ``RECHECK_S`` (growing to ``RECHECK_MAX_S``). ``ADLOADER_DISABLE=1``: nothing.
- Fork-safe: the client remembers the pid that created it; a forked child (a loader worker) never
  uses the parent's context or socket and never creates its own (``attach`` in a non-main pid after
  fork starts a fresh client only if called there, which the loader never does), and closes its
  copies of the connection to the agent at once (``close_inherited_agent_connections``, which says
  what a child keeps and why that is harmless).
- The job's CPU: every report's stats carry ``job_cpu_s``: the CPU this process and every process it
  started have used (``adloader.proctree.tree_cpu_s``: every thread, the workers of every loader, an
  A-Dloader one or torch's, and any other child: compile workers, a checkpoint writer). The primary's
  stats count the process's CPU during training steps only and its own workers'; a validation pass
  (its forward steps, a validation loader's workers) or a checkpoint save is neither, and the agent
  read it as other processes' load (``agent.collector``: ``job_cpu_cores``).
- The memory of the loaders the agent does not size: every report's stats also carry
  ``other_loader_memory_bytes``, what the workers of the process's other loaders hold now: the other
  attached loaders' (``DataLoader.held_memory_bytes``: their workers' unique memory and batches in
  flight) and the unique memory of the daemon multiprocessing children listed with them
  (``_other_loader_workers``: torch's own loaders' workers, a process pool's), sampled here as a loader
  samples its own (``adloader.memory.WorkerMemorySampler``: at most every 2 s and 1% of a core). The
  agent counts it in the job's loader memory and plans the primary's workers within the budget that it
  leaves (``agent.policies.adaptive``).
- One client per process: it reports ``loader.stats()`` of the primary loader every ``REPORT_S`` (and
  at once, ``NEW_WORKERS_REPORT_S`` after the last at least, when a worker runs that the last report
  did not list: ``_new_workers``) and applies directives to it through ``loader.resize(n)``, bounded
  by ``loader.max_workers`` and, for growth, by what the process's memory holds
  (``DataLoader.memory_bound_workers``, in every report; ``last_directive.applied_workers`` is the
  count the loader took). The primary is the attached loader with the longest epoch
  (``_epoch_batches``): its ``len()`` where it has one,
  else the most batches one epoch's iterator has handed out (its longest so far or the one running),
  counted only once it has handed out a batch (the current primary, else the first attached, on a
  tie). That is the training loader, whose epoch is longer than a validation pass: also where a
  validation loader is iterated first (Lightning's sanity check runs two validation batches before
  training starts: the validation loader leads until the training loader's first batch), during each
  validation pass, and where the training script builds a new training loader every epoch beside one
  long-lived validation loader (the new one takes the role at its first batch; by lifetime batches,
  an earlier rule, the validation loader won for good once its total passed one training epoch, and
  by the longest pass alone the new one took it only once past the validation pass's length, so the
  directive went to the validation loader at the start of every epoch). When another loader
  overtakes it, the session's last directive moves to the new primary and the old one goes back to
  its own count (``requested_workers``). Before it first applies a directive to a loader it calls
  ``adloader.autotune.detach(loader)`` if that module exists: the agent wins over local autotuning.
- Directives are applied in ``seq`` order; a directive with a seq not above the last one accepted in
  this session (since the last welcome) is ignored. So is a directive whose ``job`` is not this
  process's job, or whose ``workers`` is negative (each logged once at WARNING): it is not applied,
  not counted and does not move the seq. A directive before the session's welcome is ignored (DEBUG),
  and so is a ``welcome`` for another job than this process's (one WARNING naming both): the client
  stays unwelcomed and says hello again after its hello back-off. At most one directive is applied per ``DIRECTIVE_MIN_S``:
  one that comes sooner waits, and a newer one that comes meanwhile replaces it (an agent in a resize
  loop applied thousands a second, starting and retiring workers, and training slowed sixfold; the
  agent sees a count's effect only in the next report, ``REPORT_S`` later, anyway).
- Identity: ``protocol.client_identity(job, rank, pid)`` plus ``:<random>`` per socket, so a new
  socket after a reconnect never collides with the old one still known to the agent's ROUTER.
- The agent is authenticated before the client says anything (``adloader.trust.agent_untrusted``):
  the endpoint must be ipc://; the socket's directory (symlinks resolved) must be owned by root or
  by this process's uid and writable by nobody else, the socket file owned by one of those two, and
  the process listening on it (``SO_PEERCRED`` of a probe connection) must run as root or as this uid.
  Anything else (a socket another user bound first at the predictable ``/tmp/adloader-<uid>`` path,
  a tcp:// endpoint nobody can authenticate) is refused and logged once per reason at WARNING;
  training goes on without the agent, the check is repeated with the missing-socket backoff.
- The job id must satisfy ``protocol.check_job_id``; if not, one WARNING and no agent contact. So must
  ADLOADER_ENDPOINT, where it is set, ``protocol.endpoint_problem`` (``env.endpoint_problem``: one
  WARNING naming the variable and value, and no agent contact, not even at the default socket).
"""
from __future__ import annotations

import json
import logging
import math
import operator
import os
import secrets
import socket as _socket
import sys
import threading
import time
import weakref
from typing import Any, Optional

from adloader import env, proctree, protocol, trust
from adloader.trust import agent_untrusted  # noqa: F401 (re-exported: the check the client makes)

log = logging.getLogger("adloader.client")

REPORT_S = 1.0            # report period
NEW_WORKERS_REPORT_S = 0.25   # a worker not in the last report's list: report at once, this long after it at least
RECHECK_S = 0.5           # first re-check of a missing socket file; doubles up to RECHECK_MAX_S
RECHECK_MAX_S = 5.0
HELLO_RETRY_S = 1.0       # hello without welcome: resend after this, doubling up to HELLO_RETRY_MAX_S
HELLO_RETRY_MAX_S = 10.0
CONNECT_POLL_S = 0.05     # hello not sent because the connection is not up yet: retry this soon
DEFAULT_HEARTBEAT_S = 2.0
LOST_AFTER_BEATS = 3      # no message from the agent for this many heartbeat periods: reconnect
SNDHWM = 4
RCVHWM = 64               # messages libzmq queues from the agent; each at most protocol.MAX_MESSAGE_BYTES
MESSAGES_PER_PASS = RCVHWM  # messages read before the loop looks at its clock again (stop, reports)
DIRECTIVE_MIN_S = 0.25    # at most one directive applied per this period (the newest when the time comes)
HEARTBEAT_RANGE_S = (0.1, 300.0)   # the agent's own bounds on heartbeat_s (agent.config); else the default
DETACH_WAIT_S = 1.0
RESTART_S = 1.0           # the client thread's loop raised: start it again after this, doubling up to RESTART_MAX_S
RESTART_MAX_S = 30.0
MAX_RESTARTS = 5          # then the client stops for good (the next loader's attach starts a new one)
REFUSED_BACKOFF_S = 60.0

_lock = threading.Lock()
_client: Optional["_Client"] = None
_warned: set = set()
PROBE_TIMEOUT_S = 1.0


def _taking_tasks(loader) -> list[int]:
    """A loader's worker pids that take tasks (``worker_pids(retiring=False)``, or ``worker_pids()`` where it
    takes no argument); [] where it has none or fails."""
    try:
        try:
            pids = loader.worker_pids(retiring=False)
        except TypeError:           # a loader whose worker_pids takes no argument
            pids = loader.worker_pids()
        return [int(p) for p in pids]
    except Exception:
        return []


def _other_loader_workers() -> list[int]:
    """Daemon processes this process started through multiprocessing, other than A-Dloader's own workers,
    not known to have exited: torch's own DataLoader workers (a validation loader a script left as
    torch's: torch starts every worker as a daemon, any start method) and a process pool's workers.
    Non-daemon children (ranks a launcher such as Lightning's ``ddp_spawn`` started from a process that
    iterated a loader first) are left out: they are training processes, not loader workers. Read, never
    polled: a poll from this thread (``multiprocessing.active_children``) would reap a worker that its
    owner's join then cannot. [] where multiprocessing's internals are not what this reads."""
    try:
        from multiprocessing import process as mp_process

        from adloader._pool import pool_processes

        children, ours = list(getattr(mp_process, "_children", ())), pool_processes()
    except Exception:
        return []
    out = []
    for proc in children:
        try:
            popen = getattr(proc, "_popen", None)
            if proc not in ours and proc.daemon and popen is not None and popen.returncode is None:
                out.append(int(proc.pid))
        except Exception:
            continue
    return sorted(out)


def _warn_once(key: str, text: str, *args: Any) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(text, *args)


def attach(loader: Any) -> None:
    """Start reporting ``loader`` to the node agent (idempotent, returns at once, never raises)."""
    global _client
    try:
        if env.disabled():
            return
        with _lock:
            if _client is None or _client.pid != os.getpid() or _client.stopped():
                # a client inherited through fork is abandoned untouched (its thread does not exist
                # here); a stopped one (its loaders were all dropped without close()) is replaced, and
                # the new one lets the old thread finish its bye before saying hello
                previous = _client if _client is not None and _client.pid == os.getpid() else None
                _client = _Client(previous)
            _client.add(loader)
    except Exception:  # never into training
        log.debug("adloader client: attach failed", exc_info=True)


def detach(loader: Any) -> None:
    """Stop reporting ``loader``; the last detach says bye and stops the thread (never raises)."""
    global _client
    try:
        with _lock:
            c = _client
            if c is None or c.pid != os.getpid():
                return
            if c.remove(loader):
                _client = None
        if c is not None and c.stopped():
            c.join(DETACH_WAIT_S)
    except Exception:
        log.debug("adloader client: detach failed", exc_info=True)


def state() -> dict:
    """A snapshot of this process's client, for tests and ``adloader profile``: connected, endpoint,
    job, rank, directives applied, last directive, reports sent/dropped. ``{"active": False}`` where
    there is none; a client that gave up after its restarts (``MAX_RESTARTS``) says so until the next
    ``attach`` replaces it: ``{"active": False, "gave_up": True, "restarts": ..., "last_error": ...}``
    (its loaders run at their own worker counts); one that stopped because the agent speaks another major
    protocol version (its ``version`` error, or a message of that version) says
    ``{"active": False, "stopped": "version", "last_error": ...}``."""
    c = _client
    if c is None or c.pid != os.getpid():
        return {"active": False}
    if c.stopped():
        st = c.snapshot()
        if st.get("gave_up"):
            return {"active": False, **{k: st[k] for k in ("gave_up", "restarts", "last_error")}}
        if st.get("stopped"):
            return {"active": False, **{k: st[k] for k in ("stopped", "last_error")}}
        return {"active": False}
    return c.snapshot()


def _finite(obj: Any) -> Any:
    """JSON-safe copy: non-finite floats become None (the wire forbids NaN/Infinity); other numbers
    (a NumPy scalar in a loader subclass's stats) become int or float; anything else json cannot
    encode becomes None."""
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    try:
        return operator.index(obj)
    except Exception:
        pass
    try:
        return _finite(float(obj))
    except Exception:
        return None


def _period_s(value: Any, default: float) -> float:
    """A period the agent gives (``heartbeat_s``): a number of seconds within ``HEARTBEAT_RANGE_S``, the
    range the agent's own config allows, else ``default``. (A period of a nanosecond made the client drop
    every connection before its first report and say hello again, for good; one of years would leave a
    hung agent undetected.)"""
    try:
        v = float(value)
    except (TypeError, ValueError, OverflowError):
        return default
    low, high = HEARTBEAT_RANGE_S
    return v if math.isfinite(v) and low <= v <= high else default


class _Client:
    def __init__(self, previous: Optional["_Client"] = None) -> None:
        self._previous = previous
        self.pid = os.getpid()
        self.endpoint, self.endpoint_problem = env.endpoint(), env.endpoint_problem()
        self.job = env.job_id()
        self.rank = env.rank()
        self.local_rank = env.local_rank()
        self.world_size = env.world_size()
        self.gpus = env.gpus()
        # a client that stopped with loaders still attached (its thread died, or the agent refused this
        # version) hands them on: a loader attaches once, and would otherwise never be reported again
        self._loaders: list[weakref.ref] = previous._live_loaders() if previous is not None else []
        self._current: Optional[weakref.ref] = None     # the primary loader (``_primary``)
        self._oversize_drops = 0                        # connections libzmq ended on a frame over the limit
        self._directed: Any = _dead_ref                 # (a weak reference to) the loader last directed
        self._others_memory = None                      # WorkerMemorySampler of _other_loader_workers()
        self._listed: frozenset = frozenset()           # the worker pids the last report listed
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._info = {
            "active": True, "connected": False, "endpoint": self.endpoint, "job": self.job,
            "rank": self.rank, "pid": self.pid, "directives": 0, "last_directive": None,
            "reports_sent": 0, "reports_dropped": 0, "welcomes": 0, "last_error": None, "restarts": 0,
        }
        self._thread = threading.Thread(target=self._run, name="adloader-client", daemon=True)

    # --- called from the training thread (under the module lock) ---------------------------------
    def add(self, loader: Any) -> None:
        with self._lock:
            if not any(r() is loader for r in self._loaders):
                self._loaders.append(weakref.ref(loader))
            start = not self._thread.is_alive() and not self._stop.is_set() and self._thread.ident is None
        if start:   # only once a loader is there: the thread stops when it finds none
            self._thread.start()

    def remove(self, loader: Any) -> bool:
        """Drop ``loader``; True when no loader is left (the thread then says bye and exits)."""
        with self._lock:
            self._loaders = [r for r in self._loaders if r() is not None and r() is not loader]
            empty = not self._loaders
        if empty:
            self._stop.set()
        return empty

    def _live_loaders(self) -> list:
        with self._lock:
            return [r for r in self._loaders if r() is not None]

    def _attached(self) -> list:
        """The attached loaders still alive (the objects, not their references)."""
        return [lo for lo in (r() for r in self._live_loaders()) if lo is not None]

    def stopped(self) -> bool:
        return self._stop.is_set()

    def join(self, timeout: float) -> None:
        if threading.current_thread() is not self._thread and self._thread.ident is not None:
            self._thread.join(timeout)

    def snapshot(self) -> dict:
        with self._lock:
            return dict(self._info)

    def _primary(self) -> Any:
        """The loader to report and direct (module docstring): of the attached loaders, the one with the
        longest epoch (``_epoch_batches``); the current one, else the first attached, on a tie."""
        with self._lock:
            self._loaders = [r for r in self._loaders if r() is not None]
            alive = [r() for r in self._loaders]
            current = self._current() if self._current is not None else None
        alive = [lo for lo in alive if lo is not None]
        if not alive:
            return None
        best = current if any(lo is current for lo in alive) else alive[0]
        most = _epoch_batches(best)
        for lo in alive:
            n = _epoch_batches(lo)
            if n > most:
                best, most = lo, n
        if best is not current:
            with self._lock:
                self._current = weakref.ref(best)
        return best

    def _set(self, **kw: Any) -> None:
        with self._lock:
            self._info.update(kw)

    # --- the background thread ---------------------------------------------------------------------
    def _run(self) -> None:
        if self._previous is not None:       # its bye goes out before our hello
            self._previous.join(DETACH_WAIT_S)
            self._previous = None
        try:
            import zmq
        except Exception:
            log.debug("adloader client: pyzmq not importable; no agent contact")
            return
        failures, pause_s = 0, RESTART_S
        while not self._stop.is_set():
            try:
                self._contact(zmq)
                return
            except Exception as e:   # a bug of the client's own: training goes on without the agent
                failures += 1
                self._failed(e, failures, pause_s)
            if failures > MAX_RESTARTS:
                self._set(gave_up=True)
                self._stop.set()     # stopped for good: ``attach`` replaces it, ``state`` says so
                return
            self._stop.wait(pause_s)
            pause_s = min(RESTART_MAX_S, pause_s * 2)

    def _contact(self, zmq) -> None:
        """The client's life with one ZeroMQ context (``_loop``); the context is gone when it returns."""
        ctx = zmq.Context()
        try:
            self._loop(zmq, ctx)
        finally:
            try:
                ctx.destroy(linger=0)
            except Exception:
                pass

    def _failed(self, e: Exception, failures: int, pause_s: float) -> None:
        """The thread's loop raised (a bug of the client's own): log it once at WARNING with its
        traceback (later ones at DEBUG), and hand the loader the agent directed back to its own worker
        count, so that no loader runs for good at a count nobody manages any more."""
        last = failures > MAX_RESTARTS
        then = (f"it stops after {failures} failures" if last else
                f"it starts again in {pause_s:g} s (at most {MAX_RESTARTS} times)")
        self._set(connected=False, restarts=failures - 1 if last else failures,
                  last_error=f"client thread failed: {type(e).__name__}: {str(e)[:200]}")
        key = f"failed:{type(e).__name__}" if not last else "failed:stopped"
        traced = key not in _warned and not last
        if key not in _warned:
            _warned.add(key)
            log.warning("adloader: the agent client (job %s, endpoint %s) failed with an unexpected error "
                        "(%s: %s); loaders go back to their own worker counts and training goes on; %s",
                        self.job, self.endpoint, type(e).__name__, str(e)[:200], then, exc_info=traced)
        if not traced:
            log.debug("adloader client: thread failed (%s)", then, exc_info=True)
        directed, self._directed = self._directed(), _dead_ref
        self._release(directed)
        directed = None

    def _loop(self, zmq, ctx) -> None:
        why = protocol.check_job_id(self.job)
        if why is not None:
            _warn_once(f"job:{self.job}", "adloader: not contacting the node agent: %s (set ADLOADER_JOB_ID); "
                       "training goes on without it", why)
            self._set(last_error=f"job id: {why}")
            return
        why = self.endpoint_problem
        if why is not None:             # (warned once by env, naming the variable and value)
            self._set(last_error=f"ADLOADER_ENDPOINT: {why}")
            return
        path = env.ipc_path(self.endpoint)
        recheck_s = RECHECK_S
        while not self._stop.is_set():
            untrusted = trust.NO_SOCKET if path is not None and not os.path.exists(path) else \
                trust.agent_untrusted(self.endpoint, timeout_s=PROBE_TIMEOUT_S)
            if untrusted is not None:
                if untrusted != trust.NO_SOCKET and not untrusted.startswith(trust.UNCHECKED):
                    _warn_once(f"trust:{untrusted}", "adloader: not talking to the agent at %s: %s; training goes "
                               "on without it", self.endpoint, untrusted)
                    self._set(last_error=f"untrusted agent: {untrusted}")
                if self._primary() is None:     # every loader dropped while no agent was there
                    self._stop.set()
                    break
                self._stop.wait(recheck_s)
                recheck_s = min(RECHECK_MAX_S, recheck_s * 2)
                continue
            recheck_s = RECHECK_S
            # connect to the path just checked, symlinks resolved (a link cannot be re-pointed after the check)
            self._connect_to = "ipc://" + os.path.realpath(path) if path is not None else self.endpoint
            pause_s = self._session(zmq, ctx)
            if pause_s:
                self._stop.wait(pause_s)

    def _session(self, zmq, ctx) -> float:
        """One connection: hello until welcome, then reports; returns a pause before the next try."""
        sock = ctx.socket(zmq.DEALER)
        ident = protocol.client_identity(self.job, self.rank, self.pid)[:240] + b":" + secrets.token_hex(4).encode()
        sock.setsockopt(zmq.IDENTITY, ident)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, SNDHWM)
        sock.setsockopt(zmq.RCVHWM, RCVHWM)
        # libzmq drops a connection that brings a bigger frame: it never lands in this process's memory
        sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)
        said_bye = False
        watch = None
        try:
            watch = _ConnectionWatch(zmq, sock)
            poller = zmq.Poller()
            poller.register(sock, zmq.POLLIN)
            if watch.mon is not None:
                poller.register(watch.mon, zmq.POLLIN)
            sock.connect(getattr(self, "_connect_to", self.endpoint))
            heartbeat_s = DEFAULT_HEARTBEAT_S
            welcomed = False
            hello_retry_s = HELLO_RETRY_S
            next_hello = 0.0
            next_report = 0.0
            last_heard = time.monotonic()
            last_seq = -1
            directive: Optional[dict] = None     # the last directive applied in this session
            pending: Optional[dict] = None       # the newest directive accepted, waiting for next_directive
            next_directive = 0.0
            while True:
                now = time.monotonic()
                if self._stop.is_set():
                    if welcomed:
                        self._send(zmq, sock, protocol.make("bye", job=self.job, rank=self.rank, pid=self.pid))
                        sock.setsockopt(zmq.LINGER, 200)   # let the bye leave before close
                        said_bye = True
                    return 0.0
                loader = self._primary()
                if loader is None:
                    self._stop.set()
                    continue
                if directive is not None and self._directed() is not loader:
                    # another loader became the primary (the training loader overtook one iterated
                    # first): the agent's count is its count now; the old one goes back to its own
                    self._direct(loader, directive)
                if not welcomed:
                    if now >= next_hello:
                        if self._send(zmq, sock, self._hello(loader)):
                            next_hello = now + hello_retry_s
                            hello_retry_s = min(HELLO_RETRY_MAX_S, hello_retry_s * 2)
                        else:   # not connected yet (IMMEDIATE): try again shortly, no backoff
                            next_hello = now + CONNECT_POLL_S
                        if hello_retry_s >= HELLO_RETRY_MAX_S and not os.path.exists(env.ipc_path(self.endpoint) or "/"):
                            return 0.0   # the socket file went away: back to silent re-checking
                elif now >= next_report or (now >= next_report - REPORT_S + NEW_WORKERS_REPORT_S
                                            and self._new_workers(loader)):
                    if self._send(zmq, sock, self._report(loader)):
                        self._bump("reports_sent")
                    else:
                        self._bump("reports_dropped")
                    next_report = now + REPORT_S
                elif now - last_heard > LOST_AFTER_BEATS * heartbeat_s:
                    log.debug("adloader client: agent silent for %.1fs; reconnecting", now - last_heard)
                    self._set(connected=False)
                    return hello_retry_s
                if pending is not None and now >= next_directive:
                    self._direct(loader, pending)
                    directive, pending = pending, None
                    next_directive = now + DIRECTIVE_MIN_S
                # hold the loader only while using it: the client keeps weak references, so a loader
                # the training script drops (without close()) can be collected and its workers stop
                loader = None
                wait_s = (next_hello if not welcomed else next_report) - time.monotonic()
                if pending is not None:
                    wait_s = min(wait_s, next_directive - time.monotonic())
                ready = dict(poller.poll(max(0, min(int(wait_s * 1000), 200))))
                if watch.mon is not None and watch.mon in ready:
                    watch.read()
                if watch.dropped():
                    self._oversize_drops += 1
                    _warn_once("oversize", "adloader: the node agent at %s sent a message over the client's "
                               "limit of %d bytes (MAXMSGSIZE) and libzmq closed the connection; the client "
                               "connects again and says hello, training goes on (logged once)",
                               self.endpoint, protocol.MAX_MESSAGE_BYTES)
                    self._set(connected=False, last_error=f"connection closed by libzmq: a message over "
                              f"{protocol.MAX_MESSAGE_BYTES} bytes (MAXMSGSIZE)")
                    return min(HELLO_RETRY_MAX_S, HELLO_RETRY_S * 2 ** (self._oversize_drops - 1))
                if sock in ready:
                    for _ in range(MESSAGES_PER_PASS):   # an agent that floods never holds up stop and reports
                        try:
                            data = sock.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        last_heard = time.monotonic()
                        try:
                            msg = protocol.decode(data)
                        except protocol.ProtocolError as e:
                            if self._unreadable(e):
                                self._set(connected=False)
                                return 0.0
                            continue
                        t = msg["type"]
                        if t == "welcome" and msg["job"] != self.job:
                            # a welcome for another job (an agent that mixed up its connections): not
                            # taken; hello again after the back-off, as after an error reply
                            _warn_once("welcome-job", "adloader: ignoring a welcome from the node agent for "
                                       "job %r (this process said hello as job %r); it says hello again "
                                       "later, training goes on", msg["job"][:128], self.job)
                            self._set(last_error=f"welcome for another job: {msg['job'][:128]!r}")
                            welcomed = False
                            next_hello = max(next_hello, time.monotonic() + hello_retry_s)
                        elif t == "welcome":
                            welcomed = True
                            last_seq = -1
                            heartbeat_s = _period_s(msg.get("heartbeat_s"), DEFAULT_HEARTBEAT_S)
                            hello_retry_s = HELLO_RETRY_S
                            next_report = time.monotonic() + REPORT_S
                            self._set(connected=True)
                            self._bump("welcomes")
                        elif t == "directive":
                            if not welcomed:
                                # before this session's welcome (or after an error reply): the agent
                                # does not know this connection as ours yet; its seq would not survive
                                # the welcome either
                                log.debug("adloader client: ignoring a directive before a welcome (seq %s)",
                                          msg["seq"])
                            elif msg["job"] != self.job:
                                # not ours (an agent that mixed up its connections): not applied, not
                                # counted, and its seq says nothing about ours
                                _warn_once("directive-job", "adloader: ignoring a directive for job %r "
                                           "(this process is job %r)", msg["job"][:128], self.job)
                            elif msg["seq"] > last_seq and _workers_ok(msg):
                                last_seq = msg["seq"]
                                pending = msg     # applied at once, or replaced by a newer one before its time
                                if time.monotonic() >= next_directive:
                                    break         # at once: at the top of the loop
                        elif t == "error":
                            pause = self._on_error(msg)
                            if pause is not None:
                                self._set(connected=False)
                                return pause
                            # e.g. unknown_job after an agent restart: hello again, after the hello back-off
                            # (at once, an agent that answered every hello with an error had ~4,000
                            # hellos a second from this process, a core busy on it)
                            welcomed = False
                            next_hello = time.monotonic() + hello_retry_s
        finally:
            if watch is not None:
                watch.close(sock)
            try:
                sock.close(linger=200 if said_bye else 0)
            except Exception:
                pass

    def _unreadable(self, e: protocol.ProtocolError) -> bool:
        """A message from the agent that ``protocol.decode`` refused: one WARNING per kind of problem
        (a directive with workers 1.5, a frame that is not JSON), the message ignored; another major
        version (a newer agent): the WARNING says which side to upgrade and the client stops, as on the
        agent's own ``version`` error. True when the client stops. A type this version does not know
        (a newer minor's) is left alone quietly."""
        if e.code == "unknown_type":
            log.debug("adloader client: ignoring a message from the agent: %s", e)
            return False
        self._set(last_error=f"message from the agent: {e.code}: {e}")
        if e.code == "version":
            _warn_once(f"refused:version:{e}", "adloader: cannot understand the node agent (%s); training goes "
                       "on without it", e)
            self._set(stopped="version")
            self._stop.set()
            return True
        _warn_once(f"unreadable:{e.code}", "adloader: ignoring a message from the node agent that breaks the "
                   "protocol (%s: %s); training goes on, later messages are still read (logged once)",
                   e.code, str(e)[:200])
        return False

    def _on_error(self, msg: dict) -> Optional[float]:
        code, text = msg.get("code"), msg.get("message")
        self._set(last_error=f"{code}: {text}")
        if code in ("version", "not_permitted", "over_limit"):
            _warn_once(f"refused:{code}:{text}", "adloader: the node agent refused this process (%s): %s; "
                       "training goes on without it", code, str(text)[:200])
            if code == "version":
                self._set(stopped="version")
                self._stop.set()
                return 0.0
            return REFUSED_BACKOFF_S
        if code == "rate_limited":
            return 1.0
        if code == "unknown_job":       # the agent restarted and forgot this connection: nothing wrong
            log.debug("adloader client: agent error %s: %s", code, text)
        else:   # once per code of the protocol's (any other code is one more: the agent chooses them)
            known = code if code in protocol.ERROR_CODES else "other"
            _warn_once(f"error:{known}", "adloader: the node agent answered with an error (%s: %s); the client "
                       "says hello again later, training goes on (logged once)", str(code)[:40], str(text)[:200])
        return None

    def _bump(self, key: str) -> None:
        with self._lock:
            self._info[key] += 1

    @staticmethod
    def _send(zmq, sock, msg: dict) -> bool:
        try:
            sock.send(protocol.encode(msg), zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False
        except (protocol.ProtocolError, zmq.ZMQError, TypeError, ValueError):
            log.debug("adloader client: send failed", exc_info=True)
            return False

    def _pids(self, loader, others_started: Optional[list[int]] = None) -> list[int]:
        """The workers taking tasks of ``loader`` (the primary), then of every other loader attached here (a
        validation loader's: they are the job's loader workers too, and the agent places them with the
        primary's, so that a validation pass's workers neither run at the training process's priority nor
        outside the job's share), then the other loader-like workers this process started, which never attach
        (``_other_loader_workers``: a validation loader left as torch's, a process pool), at most
        ``protocol.MAX_PIDS_PER_MESSAGE``. Taking tasks: one retiring may exit before the agent reads the
        report; the agent leaves a pid that no process holds any more out, and refuses one that another
        process of the caller's pid namespace holds (a claim about another process). ``others_started``:
        ``_other_loader_workers()`` as read already for this report."""
        out: list[int] = []
        others = [lo for lo in self._attached() if lo is not loader]
        started = _other_loader_workers() if others_started is None else others_started
        for p in [p for lo in [loader] + others for p in _taking_tasks(lo)] + started:
            if p not in out:
                out.append(p)
        return out[:protocol.MAX_PIDS_PER_MESSAGE]

    def _hello(self, loader) -> dict:
        def attr(name, default=None):
            try:
                v = getattr(loader, name, default)
                return v if isinstance(v, int) and not isinstance(v, bool) else default
            except Exception:
                return default

        return protocol.make(
            "hello", job=self.job, rank=self.rank, local_rank=self.local_rank, world_size=self.world_size,
            pid=self.pid, worker_pids=self._pids(loader), gpus=self.gpus, batch_size=self._batch_size(loader),
            workers=attr("num_workers", 0), requested_workers=attr("requested_workers", attr("num_workers", 0)),
            max_workers=attr("max_workers"), dataset_kind=self._dataset_kind(loader),
            hostname=_socket.gethostname(), uid=os.getuid(), cpu_quota=_cpu_quota(),
        )

    @staticmethod
    def _dataset_kind(loader) -> Optional[str]:
        """The hello's ``dataset_kind`` (``adloader.DataLoader.dataset_kind``), None where the loader does
        not say: the agent knows from the first plan on that an IterableDataset's count waits for its
        next epoch, before the first report (a second later) says so."""
        try:
            kind = getattr(loader, "dataset_kind", None)
        except Exception:
            return None
        return kind if kind in ("map", "iterable") else None

    @staticmethod
    def _batch_size(loader) -> Optional[int]:
        """The hello's ``batch_size``, as ``loader.stats()`` reports it: torch's ``batch_size`` where
        the loader has one, else (a custom ``batch_sampler``, ``batch_size=None``: torch's attribute is
        None) the ``batch_size`` of its stats, the mean delivered batch, else None (unknown: nothing
        delivered yet; the agent keeps what it knew, or 1, until a report carries it)."""
        def count(v):
            return v if isinstance(v, int) and not isinstance(v, bool) and v >= 1 else None

        try:
            size = count(getattr(loader, "batch_size", None))
            if size is None and callable(getattr(loader, "stats", None)):
                size = count(dict(loader.stats()).get("batch_size"))
            return size
        except Exception:
            log.debug("adloader client: the loader's batch size cannot be read", exc_info=True)
            return None

    def _report(self, loader) -> dict:
        try:
            stats = _finite(dict(loader.stats()))
        except Exception:
            log.debug("adloader client: loader.stats() failed", exc_info=True)
            stats = {}
        try:
            if stats:                   # (a loader whose stats() failed: nothing, as before)
                stats["job_cpu_s"] = proctree.tree_cpu_s()
        except Exception:
            log.debug("adloader client: the job's CPU cannot be counted", exc_info=True)
        started = _other_loader_workers()        # (read once: the memory and the pid list)
        if stats:
            stats["other_loader_memory_bytes"] = self._others_memory_bytes(loader, started)
        pids = self._pids(loader, started)
        self._listed = frozenset(pids)
        msg = protocol.make("report", job=self.job, rank=self.rank, pid=self.pid,
                            worker_pids=pids, stats=stats, cpu_quota=_cpu_quota())
        if len(json.dumps(msg)) > protocol.MAX_MESSAGE_BYTES:   # never send what the agent refuses
            msg["stats"] = {k: v for k, v in stats.items() if not isinstance(v, (dict, list))}
        return msg

    def _new_workers(self, loader) -> bool:
        """Whether a worker runs that the last report did not list (a validation pass's loader started its
        workers, a resize grew the primary's): the report goes out then, not up to ``REPORT_S`` later, so
        the agent places the new workers with the job's at its next tick instead of leaving them up to a
        report period longer at the training process's priority. Checked at every wake of the client's
        loop (at most every 200 ms; a few list reads); a report at most every ``NEW_WORKERS_REPORT_S``."""
        try:
            return not self._listed.issuperset(self._pids(loader))
        except Exception:
            return False

    def _others_memory_bytes(self, loader, started: list[int]) -> int:
        """The report's ``other_loader_memory_bytes`` (module docstring): what the workers of every loader
        but the primary ``loader`` hold now (``started``: ``_other_loader_workers()``). 0 where there are
        none or nothing can be read."""
        total = 0
        for lo in self._attached():
            if lo is not loader:
                try:
                    total += int(lo.held_memory_bytes())
                except Exception:       # (a loader without the method, or one that failed: not counted)
                    continue
        try:
            pids = started
            if pids or self._others_memory is not None:
                if self._others_memory is None:
                    from adloader.memory import WorkerMemorySampler

                    self._others_memory = WorkerMemorySampler()
                total += int(self._others_memory.sample(pids).uss)
        except Exception:
            log.debug("adloader client: the other loaders' workers' memory cannot be read", exc_info=True)
        return total

    def _direct(self, loader, msg: dict) -> None:
        """Apply a directive to the primary ``loader``; the loader directed before, if another one, goes
        back to its own count; autotune is detached from a loader before its first directive."""
        previous = self._directed()
        if previous is not loader:
            self._release(previous)
            _detach_autotune(loader)
            self._directed = weakref.ref(loader)
        previous = None
        self._apply(loader, msg)

    @staticmethod
    def _release(loader) -> None:
        """A loader that is no longer the primary goes back to the job's own count for it."""
        if loader is None:
            return
        try:
            own = getattr(loader, "requested_workers", None)
            resize = getattr(loader, "_resize", None)
            if resize is not None and isinstance(own, int) and not isinstance(own, bool):
                resize(own, own=False)
        except Exception:
            log.debug("adloader client: releasing a loader failed", exc_info=True)

    def _apply(self, loader, msg: dict) -> None:
        n = msg["workers"]
        if not _workers_ok(msg):    # (the session loop drops such a directive before it gets here)
            return
        try:
            cap = getattr(loader, "max_workers", None)
            if isinstance(cap, int) and not isinstance(cap, bool):
                n = min(n, cap)
            # an agent's directive is not the job's own choice: requested_workers stays
            resize = getattr(loader, "_resize", None)
            try:
                got = resize(n, own=False) if resize is not None else loader.resize(n)
            except Warning as w:   # made an exception by the warning filters (-W error): the loader
                # warns once the resize is done (an IterableDataset's takes effect at the next epoch)
                log.debug("adloader client: loader.resize(%s) warned: %s", n, w)
                got = getattr(loader, "num_workers", n)
            if isinstance(got, int) and not isinstance(got, bool):
                n = got     # what the loader took: less where its memory holds fewer workers
            with self._lock:
                self._info["directives"] += 1
                self._info["last_directive"] = {k: msg.get(k) for k in ("seq", "workers", "cpus", "cpuset", "reason")}
                self._info["last_directive"]["applied_workers"] = n
        except Exception:
            log.debug("adloader client: loader.resize(%s) failed", n, exc_info=True)


def close_inherited_agent_connections() -> int:
    """In a process forked from a training process (a loader worker started with ``fork``, a user's
    ``os.fork()``): close this process's copies of the client's connections to the agent; how many.
    Runs in every forked child (``os.register_at_fork``); never raises.

    fork copies every file descriptor (close-on-exec, which libzmq sets, helps only a child that
    execs). The child never uses the parent's context or socket (no libzmq thread runs there; pyzmq
    closes nothing in a pid other than its creator's), but its copy of the connection kept it open at
    the agent after the parent's client closed it (a reconnect), for as long as the worker lived: the
    agent counted it against the user's ``connections_per_uid`` and never saw it end. Closing the copy
    leaves the parent's own descriptor, and so its connection, untouched (``close``, never
    ``shutdown``). A descriptor is closed only when it is a unix stream socket whose peer is the
    agent's socket file (the peer's address, symlinks resolved, as the client connected to it or as
    the endpoint names it now: the probe before the first session has no session path yet), found
    through /proc/self/fd: no number recorded in the parent, which another thread may have reused
    by the time of the fork.

    What a child keeps, and why it does no harm:
    - a socket the parent had made and not yet connected at the fork: an unconnected socket cannot be
      told from any other, and the parent's connect, later, connects the child's copy too (one open
      file). The client's own probe (``trust.peer_uid``) holds a lock that a fork waits for, so no
      fork lands there. libzmq makes and connects the DEALER's socket in its own I/O thread, in C,
      socket() then connect() at once, which no Python lock can hold: a child keeps that connection
      only if the thread is preempted between the two for longer than the fork and the child's way
      to this hook take. Loader workers close their copies once more when they start
      (``adloader._worker``). A copy kept costs one of the user's ``connections_per_uid`` at the agent
      while the child lives, nothing else: the agent departs a rank whose process is gone (its
      registry checks /proc/<pid> each tick), whoever holds its socket, and the child never writes
      on it (tests/test_agent_component.py).
    - the ZeroMQ context's eventfds and epoll descriptors (about eight a context). They lead nowhere
      outside this process, and nothing in the child writes to them (no libzmq thread runs here;
      pyzmq never closes or terminates a socket or context in another pid than its creator's, not
      even from a finaliser; ``attach``, ``detach`` and ``state`` check the pid and leave the
      inherited client alone), so the parent's I/O thread never hears from the child. They are copied once a
      fork and do not add up: a child of a child has exactly its parent's. They are not closed: they
      cannot be told from a dataset's own (asyncio, torch), and closing them would free numbers the
      inherited libzmq objects still name."""
    c = _client
    if c is None or c.pid == os.getpid():
        return 0
    # the path the last session connected to, and the one the endpoint names now (symlinks resolved):
    # the probe before the first session (``trust.peer_uid``) connects to that one
    paths = {env.ipc_path(t) for t in (getattr(c, "_connect_to", None), c.endpoint) if t}
    paths = {os.path.realpath(p) for p in paths if p}
    if not paths:           # tcp://
        return 0
    closed = 0
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return 0
    for name in names:
        try:
            fd = int(name)
        except ValueError:
            continue
        peer = _unix_stream_peer(fd)
        if peer is not None and os.path.realpath(peer) in paths:
            try:
                os.close(fd)
                closed += 1
            except OSError:
                pass
    return closed


def _unix_stream_peer(fd: int) -> Optional[str]:
    """The address of the peer of ``fd`` where it is a connected unix stream socket (a path, or an
    abstract name starting with NUL), else None: another file, another kind of socket, not connected,
    or closed meanwhile. ``fd`` itself is left open. Never raises."""
    try:
        if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
            return None
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        probe = _socket.socket(fileno=dup)
    except OSError:         # a family Python does not know
        os.close(dup)
        return None
    with probe:
        try:
            if probe.family == _socket.AF_UNIX and probe.type == _socket.SOCK_STREAM:
                peer = probe.getpeername()
                return peer if isinstance(peer, str) and peer else None
        except OSError:
            pass
    return None


def _after_fork_in_child() -> None:
    try:
        close_inherited_agent_connections()
    except Exception:   # noqa: BLE001 — a hook in someone else's fork must never fail it
        pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _dead_ref() -> None:
    return None


class _ConnectionWatch:
    """Watches a DEALER's connection through its monitor socket, to tell the one way libzmq ends it
    without a word: a frame over ``MAXMSGSIZE`` is a protocol error, on which libzmq closes the
    connection and, unlike after a connection error (the agent stopped or restarted), does not connect
    again (session_base.cpp ``engine_error``: reconnect only for connection and timeout errors). So a
    connection that succeeded its handshake and was then closed with no reconnect attempt following
    (``EVENT_CONNECT_RETRIED``, which libzmq emits at once when it schedules one) within ``GRACE_S`` was
    ended for a frame over the limit (the only protocol error an agent built on libzmq can cause after
    the handshake). Without this the client heard nothing more and reconnected only after three silent
    heartbeat periods, with no word in the log."""

    GRACE_S = 1.0

    def __init__(self, zmq, sock) -> None:
        self._zmq = zmq
        self._handshaken = False
        self._closed_at: Optional[float] = None
        try:
            self.mon = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
                                               | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_CONNECTED)
        except Exception:   # no monitor: such a close is found as silence, after three heartbeat periods
            log.debug("adloader client: no monitor on the agent connection", exc_info=True)
            self.mon = None

    def read(self) -> None:
        zmq = self._zmq
        while self.mon is not None:
            try:
                frames = self.mon.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            # zmq_socket_monitor(3): frame 1 is a 16-bit event and a 32-bit value, frame 2 the endpoint.
            # (Not zmq.utils.monitor: it imports asyncio, which a training process need not be able to.)
            event = int.from_bytes(frames[0][:2], sys.byteorder) if frames and len(frames[0]) >= 2 else 0
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._handshaken, self._closed_at = True, None
            elif event == zmq.EVENT_DISCONNECTED and self._handshaken:
                self._handshaken, self._closed_at = False, time.monotonic()
            elif event in (zmq.EVENT_CONNECT_RETRIED, zmq.EVENT_CONNECTED):
                self._closed_at = None      # libzmq connects again: the agent went away, not a frame

    def dropped(self) -> bool:
        """Whether libzmq closed the connection for good (a frame over the limit)."""
        return self._closed_at is not None and time.monotonic() - self._closed_at >= self.GRACE_S

    def close(self, sock) -> None:
        if self.mon is None:
            return
        try:
            sock.disable_monitor()
        except Exception:
            pass
        try:
            self.mon.close(linger=0)
        except Exception:
            pass


def _workers_ok(msg: dict) -> bool:
    """Whether a directive's ``workers`` is a count (an int >= 0); else it is ignored, with one WARNING
    (never clamped to 0: that would be in-process loading, the biggest change a directive can make)."""
    n = msg.get("workers")
    if isinstance(n, int) and not isinstance(n, bool) and n >= 0:
        return True
    _warn_once("directive-workers", "adloader: ignoring a directive with workers=%r (seq %r): a worker count "
               "is at least 0", n, msg.get("seq"))
    return False


def _epoch_batches(loader: Any) -> int:
    """The batches of one epoch of ``loader``, for the choice of the primary: ``len(loader)`` where it has
    one (a map-style dataset's sampler), else or if more its longest pass (``_pass_steps``); 0 until it
    has handed out a batch (a loader built and not iterated yet is not training, whatever its length)."""
    steps = _pass_steps(loader)
    if steps <= 0:
        return 0
    try:
        n = len(loader)
    except Exception:           # an IterableDataset without __len__ (TypeError), or a user's __len__ failing
        return steps
    return max(steps, n) if isinstance(n, int) and not isinstance(n, bool) else steps


def _pass_steps(loader: Any) -> int:
    """The most batches one pass (epoch) of ``loader`` has handed out (its elastic state's
    ``pass_steps()``, cheap, unlike ``stats()``); 0 for a loader without one."""
    try:
        n = loader.elastic_state.pass_steps()
    except Exception:
        return 0
    return n if isinstance(n, int) and not isinstance(n, bool) else 0


def _cpu_quota() -> Optional[float]:
    """Cores this process's cgroup CPU quota allows (``adloader.autotune.cgroup_cpu_quota``: a container's
    CPU limit, e.g. Kubernetes' ``limits.cpu`` without exclusive cores), None when there is none or it
    cannot be read. Sent in the hello and every report: the agent cannot read it itself where the
    container has its own cgroup namespace, and would plan the job cores the kernel throttles.
    Read afresh each time, on purpose not cached: an in-place resize moves the quota, and a read costs
    about 0.07 ms (0.3 ms through a 7-level cgroup v1 tree; timeit, this project's 2-vCPU machine),
    under 0.05% of one core at a report a second, on the client's thread."""
    try:
        from adloader.autotune import cgroup_cpu_quota

        q = cgroup_cpu_quota()
    except Exception:
        log.debug("adloader client: reading the cgroup CPU quota failed", exc_info=True)
        return None
    return round(q, 3) if q is not None and math.isfinite(q) and q > 0 else None


def _detach_autotune(loader: Any) -> None:
    try:
        import importlib

        autotune = importlib.import_module("adloader.autotune")
    except ImportError:
        return
    except Exception:
        log.debug("adloader client: importing adloader.autotune failed", exc_info=True)
        return
    try:
        fn = getattr(autotune, "detach", None)
        if fn is not None:
            fn(loader)
    except Exception:
        log.debug("adloader client: autotune.detach failed", exc_info=True)
