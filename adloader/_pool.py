"""The elastic loader's worker pool: processes that can be added and retired between any two batches.

What the pool and its workers say to each other, and over which channel, is ``adloader._messages``;
how it travels is ``adloader._transport``. The pool turns what workers write into events for the
iterator (``Batch``, ``ShardEnd``, ``WorkerDied``), in the order they were written.

Invariants:
- worker ids are stable: a worker keeps its id for life; after ``resize(n)`` the workers that take
  new tasks are exactly ids ``0..n-1`` once retiring ones finished their current task;
- a worker is retired, never killed, while the main process lives: ``RETIRE`` -> (finishes its
  current task and any task handed to it personally) -> ``Retired`` -> ``EXIT`` or ``RESUME``;
- a retired worker exits and is reaped promptly whether or not anyone polls (between epochs of a
  persistent pool, or while the caller spends long between two ``next()``): while some worker is
  retiring or exiting, a reaper thread waits on those workers' channels and handles them as ``poll``
  would (reads what they wrote, answers ``Retired``, joins the exited process); what it read is
  returned, in the order read, before anything newer by the next ``poll`` (``drain_results`` returns
  its messages too but leaves a death it saw to ``poll``: it is called while handling a death);
- one thread at a time waits on and handles worker events (``poll`` or the reaper, holding
  ``_poll_lock``): a worker's fds are closed, and their numbers reused, only by that thread (or by
  ``shutdown``), so an event is never read as one of a newer worker's;
- a worker runs on the training process's CPU mask (its main thread's) as it was when the worker was
  started, whichever thread started it and however (``adloader._affinity``);
- a worker whose ``worker_init_fn`` raised is told to exit, and its error kept in ``init_failed``
  (worker id -> error, in the order read, for the pool's life; the iterator decides when to raise
  it); from then on no worker is started (a new one would run that function again);
- a worker that dies otherwise is reported once (``WorkerDied``) after every message it wrote was
  read, and is replaced if its id is still below the target;
- ``shutdown()`` leaves no process behind (exit, then terminate, then kill, each bounded);
- a process forked from the owner (the user's ``os.fork()``) neither shuts the pool down
  (``shutdown`` is a no-op there) nor counts its workers among its own children
  (``_disown_workers_after_fork``), so nothing it does at its exit reaches the owner's workers.
"""
from __future__ import annotations

import errno
import gc
import logging
import multiprocessing.process as _mp_process
import os
import select
import signal
import threading
import time
import weakref
from collections import deque
from dataclasses import replace
from multiprocessing.reduction import ForkingPickler

from adloader._affinity import take_cpu_mask, training_cpu_mask
from adloader._messages import (IDLE, Batch, Control, InitError, Result, Retired, ShardEnd, WorkerDied, from_wire,
                                running_task, to_wire)
from adloader._transport import (MAX_TASK_BYTES, TOO_MANY_FILES, MessageReader, PayloadError, out_of_file_descriptors,
                                 result_channel, take_tasks, task_channel)
from adloader._worker import RemoteError, WorkerSpec, worker_main
from adloader.stats import LoaderCounters

log = logging.getLogger("adloader")

# A slot that keeps dying before finishing any batch (a dataset that cannot even be unpickled in a
# spawned worker, a segfault at import) is not restarted forever.
MAX_DEATHS_WITHOUT_PROGRESS = 4
# How long shutdown() waits for its workers to exit after telling them to, before terminating them: a
# worker finishes the ``__getitem__`` it is in first (a dataset writing a cache file is not cut off
# mid-write). torch's own DataLoader waits as long (``_utils.MP_STATUS_CHECK_INTERVAL``, 5 s, in
# ``_shutdown_workers``); a worker between two tasks exits at once, so shutdown is only this slow when a
# fetch really takes that long.
SHUTDOWN_GRACE_S = 5.0
# The reaper's longest single wait (it is woken by its workers' fds and by shutdown; this is a backstop).
_REAP_WAIT_S = 5.0


def worker_exit_reason(pid: int, exitcode: int | None) -> str:
    """torch's words for a worker's death (torch/csrc/DataLoader.cpp, _error_if_any_worker_fails):
    "DataLoader worker (pid 123) is killed by signal: Killed." or "... exited unexpectedly with exit
    code 1."."""
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.strsignal(-exitcode) or f"signal {-exitcode}"
        except ValueError:
            name = f"signal {-exitcode}"
        how = f"DataLoader worker (pid {pid}) is killed by signal: {name}."
        if -exitcode == signal.SIGBUS:
            how += (" It is possible that dataloader's workers are out of shared memory. Please try to raise "
                    "your shared memory limit.")
        return how
    return f"DataLoader worker (pid {pid}) exited unexpectedly with exit code {exitcode}."


_POOLS: "weakref.WeakSet[WorkerPool]" = weakref.WeakSet()


def _disown_workers_after_fork() -> None:
    """In a process forked from one that has pools (the user's ``os.fork()``: an asynchronous
    checkpoint writer, a helper): their workers are not its children. multiprocessing's list of
    children is inherited through fork, and its atexit function (``multiprocessing.util._exit_function``)
    terminates every daemon process in that list, so such a child ending by the interpreter's own exit
    (``sys.exit``, the end of its script) sent SIGTERM to the parent's workers. Take them out of the
    child's list, as multiprocessing does with the whole list in the processes it starts itself
    (``BaseProcess._bootstrap``). Runs in every forked child (``os.register_at_fork``): cheap, never raises."""
    try:
        children = getattr(_mp_process, "_children", None)
        if not children:
            return
        for proc in pool_processes():
            children.discard(proc)
    except Exception:   # noqa: BLE001 — a hook in someone else's fork must never fail it
        pass


def pool_processes() -> set:
    """The worker processes (multiprocessing ``Process`` objects) of every pool in this process, in any
    state, retiring ones included."""
    return {slot.proc for pool in list(_POOLS) for slot in list(pool.slots.values())}


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_disown_workers_after_fork)


class _Slot:
    __slots__ = ("wid", "proc", "pid", "ctrl", "result", "reader", "sentinel", "state", "served", "num_workers")

    def __init__(self, wid, proc, ctrl, result, num_workers):
        self.wid = wid
        self.num_workers = num_workers      # the target it was started for (its WorkerInfo.num_workers)
        self.proc = proc
        self.pid = proc.pid
        self.ctrl = ctrl          # main's write end of the control pipe
        self.result = result      # main's end of the result socket
        self.reader = MessageReader(result)
        self.sentinel = proc.sentinel
        self.state = "running"    # running | retiring (RETIRE sent) | exiting (EXIT sent); see _set_state
        self.served = False       # a task's result (or shard end) was read from it: it finished starting


_starting_workers = 0     # > 0 while a pool forks a worker (``_start_process``): read in the child
_starting_lock = threading.Lock()     # for the count only; never held across the fork


def _freeze_in_worker_after_fork() -> None:
    """In a child forked while a pool starts a worker (``_start_process``): ``gc.freeze()``, first
    thing, before the child allocates. Every object the worker inherited then sits in the child's
    permanent generation, and no collection in the worker walks it. Only a few list links are written,
    so only a few pages are copied. Other forks of the process are left alone, unless another thread
    forks at that very moment, which is harmless. Never raises."""
    if _starting_workers > 0:
        try:
            gc.freeze()
        except Exception:   # noqa: BLE001 — a hook in a fork must never fail it
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_freeze_in_worker_after_fork)


def _start_process(ctx, proc) -> None:
    """``proc.start()``; with ``fork``, the worker freezes every object it inherits from the training
    process first thing after the fork (``_freeze_in_worker_after_fork``), so its garbage collector
    never walks them. The training process's own collector is not touched.

    Without it a worker's first full collection writes the GC header of every container it inherited
    (torch's modules, the dataset) and so copies each page that holds one: about 38 MiB per worker with
    torch alone, more with a dataset of Python objects, whatever the dataset is read with (BENCHMARKS.md,
    fortieth pass: ``python -m evaluation.memory_bench --gc-collect``). The fork's gc counters decide
    when that collection comes (a fork at gen1 count 11 of 10 ran it at the worker's first allocations,
    0.45 s of CPU), so its copy landed before or after the worker's first memory sample depending on
    the scheduling, and a loaded node showed a numpy dataset's workers "growing" 20-35 MiB as they read
    (``adloader.memory``: copy-on-read). CPython's documentation of ``gc.freeze`` suggests freezing in
    the parent before ``fork()``, and an earlier form of this did that (freeze, fork, unfreeze). The
    unfreeze moved every object that was young at the fork into the training process's oldest
    generation, and with workers started every epoch the cyclic garbage among them waited for a full
    collection that the promotion does not count towards. Freezing in the child leaves the training
    process as it was, a process that froze objects itself included."""
    global _starting_workers
    if ctx.get_start_method() != "fork":
        proc.start()
        return
    with _starting_lock:
        _starting_workers += 1
    try:
        proc.start()
    finally:
        with _starting_lock:
            _starting_workers -= 1


class WorkerPool:
    """Worker processes for one loader (persistent workers) or one epoch (otherwise).

    Thread safety: ``resize``, ``submit*``, ``take_queued``, ``worker_pids`` may be called from any
    thread (they take ``self.lock``); ``poll`` is called by the one thread that iterates. Lock order:
    ``_poll_lock`` before ``lock``."""

    def __init__(self, *, ctx, spec: WorkerSpec, target: int, max_workers: int,
                 counters: LoaderCounters) -> None:
        self.ctx = ctx
        self.spec = spec
        self.iterable = spec.iterable
        self.counters = counters
        self.lock = threading.RLock()
        self.target = 0
        self.slots: dict[int, _Slot] = {}
        self.fatal: BaseException | RemoteError | None = None     # raised at the caller's next next()
        self.init_failed: dict[int, RemoteError] = {}             # see the module docstring
        self._closed = False
        self._owner_pid = os.getpid()       # shutdown acts only here, never in a forked copy
        _POOLS.add(self)
        self._backlog: deque[bytes] = deque()
        self._deaths_without_progress = 0
        self._rr = 0
        self.describe_death = None          # (pid, exit code) -> text: memory and likely cause (adloader.memory)
        self.max_workers = max(1, max_workers)
        self._current = ctx.RawArray("q", self.max_workers)
        for i in range(len(self._current)):
            self._current[i] = IDLE
        self._mask_taken = ctx.RawArray("b", self.max_workers)    # worker wid's CPU mask was set by us
        if self.iterable:
            self._task_w = self._task_r = None
        else:
            self._task_w, self._task_r = task_channel()
        self._epoll = select.epoll()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._fds: dict[int, tuple[str, int]] = {self._wake_r: ("wake", -1)}
        self._epoll.register(self._wake_r, select.EPOLLIN)
        # the reaper: its own epoll over the fds of retiring/exiting workers (see _set_state)
        self._poll_lock = threading.Lock()
        self._events: list = []             # read by the reaper, not yet returned by poll
        self._reaper: threading.Thread | None = None
        self._reap_epoll = select.epoll()
        self._reap_wake_r, self._reap_wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._reap_fds: dict[int, tuple[str, int]] = {self._reap_wake_r: ("wake", -1)}
        self._reap_epoll.register(self._reap_wake_r, select.EPOLLIN)
        try:
            self.resize(target)
        except BaseException:
            # a worker that cannot start (spawn: a dataset that cannot be pickled; fork: EAGAIN) raises
            # to the caller, as torch's does; the ones started before it and every channel go with it
            self.shutdown()
            raise

    # ---- size -------------------------------------------------------------------------------
    def resize(self, n: int) -> None:
        """Make ids 0..n-1 the working set: start missing workers, ask the rest to retire."""
        with self.lock:
            if self._closed:
                return
            self.target = min(n, self.max_workers)
            self._reconcile()
        self.wake()

    def _reconcile(self) -> None:
        for wid, slot in list(self.slots.items()):
            if wid >= self.target and slot.state == "running":
                self._send_ctrl(slot, Control.RETIRE)
                self._set_state(slot, "retiring")
            # a retiring one back under the target is resumed when its Retired arrives (_drain)
        if (self.fatal is not None or self.init_failed
                or self._deaths_without_progress >= MAX_DEATHS_WITHOUT_PROGRESS):
            return
        for wid in range(self.target):
            if wid not in self.slots:
                self._start(wid)

    def _start(self, wid: int) -> None:
        """Start worker ``wid`` on the training process's CPU mask, from whichever thread calls (see
        ``adloader._affinity``: set here before its pid is published, and by the worker first thing
        unless we already had)."""
        ctx = self.ctx
        ctrl_r, ctrl_w = ctx.Pipe(duplex=False)
        res_r, res_w = result_channel()
        mask = training_cpu_mask()
        spec = replace(self.spec, wid=wid, num_workers=self.target, cpu_mask=mask)
        self._current[wid] = IDLE
        self._mask_taken[wid] = 0
        proc = ctx.Process(target=worker_main,
                           args=(spec, self._task_r, ctrl_r, res_w, self._current, self._mask_taken),
                           name=f"adloader-worker-{wid}", daemon=True)
        _start_process(ctx, proc)
        self._give_cpu_mask(wid, proc.pid, mask)
        ctrl_r.close()
        res_w.close()
        slot = _Slot(wid, proc, ctrl_w, res_r, spec.num_workers)
        self.slots[wid] = slot
        self._fds[res_r.fileno()] = ("result", wid)
        self._fds[slot.sentinel] = ("sentinel", wid)
        self._epoll.register(res_r.fileno(), select.EPOLLIN)
        self._epoll.register(slot.sentinel, select.EPOLLIN)
        log.debug("adloader worker %d started (pid %d)", wid, proc.pid)

    def _give_cpu_mask(self, wid: int, pid: int, mask) -> None:
        """Set the new worker's CPU mask, and tell it so (it then leaves its mask alone); before its pid
        is published (``adloader._affinity``)."""
        take_cpu_mask(mask, pid)
        self._mask_taken[wid] = 1

    def _set_state(self, slot: _Slot, state: str) -> None:
        """Every change of ``slot.state``. The reaper watches a retiring worker's result channel and
        sentinel, an exiting worker's sentinel (its last message was read), a running one's nothing
        (``poll`` does); it is started when it gets something to watch and ends when it has none."""
        slot.state = state
        want = {"retiring": ("result", "sentinel"), "exiting": ("sentinel",)}.get(state, ())
        for kind, fd in (("result", slot.result.fileno()), ("sentinel", slot.sentinel)):
            if kind in want and fd not in self._reap_fds:
                self._reap_fds[fd] = (kind, slot.wid)
                self._reap_epoll.register(fd, select.EPOLLIN)
            elif kind not in want and fd in self._reap_fds:
                self._unwatch(fd)
        if len(self._reap_fds) > 1 and self._reaper is None and not self._closed:
            self._reaper = threading.Thread(target=self._reap, name="adloader-reaper", daemon=True)
            self._reaper.start()

    def _unwatch(self, fd: int) -> None:
        if self._reap_fds.pop(fd, None) is not None:
            try:
                self._reap_epoll.unregister(fd)
            except (OSError, ValueError):
                pass
            if len(self._reap_fds) <= 1 and self._reaper is not None:
                try:
                    os.write(self._reap_wake_w, b"x")     # nothing left to watch: let it end now
                except OSError:
                    pass

    def _send_ctrl(self, slot: _Slot, msg) -> bool:
        try:
            slot.ctrl.send(msg)
            return True
        except (OSError, ValueError):   # the worker is gone; its sentinel will tell
            return False

    # ---- tasks ------------------------------------------------------------------------------
    def submit(self, task) -> None:
        """Queue a map-style task for whichever worker is free first."""
        payload = ForkingPickler.dumps(to_wire(task))
        with self.lock:
            if len(payload) > MAX_TASK_BYTES:
                self._send_direct(task, payload)
                return
            self._backlog.append(payload)
            self._flush()

    def _send_direct(self, task, payload) -> None:
        running = [s for s in self.slots.values() if s.state == "running"]
        if not running:
            self._backlog.append(payload)
            return
        self._rr = (self._rr + 1) % len(running)
        if not self._send_ctrl(running[self._rr], to_wire(task)):
            self._backlog.append(payload)

    def _flush(self) -> None:
        while self._backlog:
            payload = self._backlog[0]
            if len(payload) > MAX_TASK_BYTES:
                running = [s for s in self.slots.values() if s.state == "running"]
                if not running:
                    return
                self._backlog.popleft()
                self._send_direct(from_wire(ForkingPickler.loads(payload)), payload)
                continue
            try:
                self._task_w.send(payload)
            except (BlockingIOError, InterruptedError):
                return              # socket buffer full: retried on the next poll
            except OSError as e:
                if e.errno == errno.EMSGSIZE:
                    self._backlog.popleft()
                    self._send_direct(from_wire(ForkingPickler.loads(payload)), payload)
                    continue
                raise
            self._backlog.popleft()

    def submit_to(self, wid: int, task) -> bool:
        """Hand a task to worker ``wid`` (IterableDataset shards). False if that worker is gone."""
        with self.lock:
            slot = self.slots.get(wid)
            if slot is None:
                return False
            return self._send_ctrl(slot, to_wire(task))

    def take_queued(self) -> list:
        """Take back every task still waiting in the shared queue (none was started)."""
        out = []
        with self.lock:
            while self._backlog:
                out.append(from_wire(ForkingPickler.loads(self._backlog.popleft())))
            if self._task_r is not None:
                out.extend(from_wire(t) for t in take_tasks(self._task_r))
        return out

    def running_tasks(self) -> set[tuple[int, int]]:
        """(iter_id, seq) of the tasks that live workers say they are running now."""
        with self.lock:
            cur = [self._current[w] for w in self.slots]
        return {running_task(c) for c in cur if c != IDLE}

    # ---- events -----------------------------------------------------------------------------
    def wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass

    def poll(self, timeout_s: float) -> list:
        """Wait up to ``timeout_s`` for worker messages; return ``Batch``/``ShardEnd``/``WorkerDied``
        events in order, except that deaths come last: the caller has every result read so far before
        it works out which tasks died with a worker (the reaper may have read many after one)."""
        with self._poll_lock:
            with self.lock:
                if self._events:            # the reaper read some: return them now
                    timeout_s = 0
            try:
                ready = self._epoll.poll(timeout_s)
            except InterruptedError:
                ready = []
            except (ValueError, OSError):    # closed under us
                return []
            with self.lock:
                if self._closed:
                    return []
                out, self._events = self._events, []
                self._handle_ready(ready, self._fds, self._wake_r, out)
                self._flush()
            deaths = [ev for ev in out if type(ev) is WorkerDied]
            if deaths:
                out = [ev for ev in out if type(ev) is not WorkerDied] + deaths
            return out

    def _handle_ready(self, ready, fds: dict, wake_r: int, out: list) -> None:
        """Handle one ``epoll.poll`` answer (``fds``: that epoll's fd -> (kind, wid)); called with
        ``_poll_lock`` and ``lock`` held."""
        # Resolve every ready fd to its slot *before* handling any: handling a death closes that
        # worker's fds and starts a replacement, which may reuse the same fd numbers; an event
        # of this batch must never be read as one of the new worker's.
        resolved = []
        for fd, _ in ready:
            kind, wid = fds.get(fd, (None, -1))
            resolved.append((kind, self.slots.get(wid) if kind != "wake" else None, fd))
        for kind, slot, fd in resolved:
            if kind == "wake":
                try:
                    while os.read(wake_r, 4096):
                        pass
                except (BlockingIOError, OSError):
                    pass
            elif kind == "result" and slot is not None and self.slots.get(slot.wid) is slot:
                self._drain(slot, out)
        for kind, slot, fd in resolved:
            if (kind == "sentinel" and slot is not None and self.slots.get(slot.wid) is slot
                    and slot.sentinel == fd):
                self._on_exit(slot, out)

    def _reap(self) -> None:
        """The reaper thread (module docstring): handles retiring and exiting workers when ``poll``
        does not; what it reads waits in ``_events`` for the next ``poll`` (woken at once)."""
        while True:
            try:
                self._reap_epoll.poll(_REAP_WAIT_S)     # only to wake: handled below, under the locks
            except InterruptedError:
                pass
            except (ValueError, OSError):               # closed: shut down
                return
            with self._poll_lock, self.lock:
                if self._closed or len(self._reap_fds) <= 1:
                    self._reaper = None
                    return
                out: list = []
                try:
                    # polled again now: poll() may have handled what woke us while we waited
                    self._handle_ready(self._reap_epoll.poll(0), self._reap_fds, self._reap_wake_r, out)
                except Exception:   # noqa: BLE001 — the next poll() handles these workers as before
                    log.warning("adloader: the worker reaper failed; retired workers now wait for the "
                                "loader's next poll", exc_info=True)
                    self._reaper = None
                    return
                finally:
                    self._events.extend(out)
            if out:
                self.wake()

    def _drain(self, slot: _Slot, out: list) -> None:
        try:
            msgs = slot.reader.read_available()
        except EOFError:
            return                  # the worker is gone: its sentinel reports it
        for wire, payload in msgs:
            msg = from_wire(wire)
            kind = type(msg)
            if kind is Result:
                if isinstance(payload, PayloadError):
                    # Tensors arrive as file descriptors with the message; anything else that
                    # cannot be rebuilt here is the caller's error for that batch.
                    e = payload.error
                    where = f"while receiving a batch from DataLoader worker {slot.wid}"
                    if out_of_file_descriptors(e):
                        where += f" ({TOO_MANY_FILES})"
                    payload = RemoteError((type(e), e, e.__traceback__), where=where)
                    msg = msg._replace(ok=False)
                self._deaths_without_progress = 0
                slot.served = True
                out.append(Batch(msg, payload))
            elif kind is ShardEnd:
                self._deaths_without_progress = 0
                slot.served = True
                out.append(msg)
            elif kind is Retired:
                if slot.wid < self.target and self.fatal is None and not self._closed:
                    self._send_ctrl(slot, Control.RESUME)
                    self._set_state(slot, "running")
                else:
                    self._send_ctrl(slot, Control.EXIT)
                    self._set_state(slot, "exiting")
            elif kind is InitError:
                self.init_failed.setdefault(slot.wid, msg.error)
                self._send_ctrl(slot, Control.EXIT)
                self._set_state(slot, "exiting")

    def drain_results(self) -> list:
        """Read every message already written by any worker, without waiting (what the reaper read
        first; a death it saw stays for the next ``poll``, see the module docstring)."""
        with self.lock:
            out = [ev for ev in self._events if type(ev) is not WorkerDied]
            self._events = [ev for ev in self._events if type(ev) is WorkerDied]
            for slot in list(self.slots.values()):
                self._drain(slot, out)
        return out

    def _on_exit(self, slot: _Slot, out: list) -> None:
        # read everything it wrote before it went (also from the others: fewer duplicate re-runs)
        for other in list(self.slots.values()):
            self._drain(other, out)
        wid = slot.wid
        self._forget(slot)
        slot.proc.join(timeout=1.0)
        running = running_task(self._current[wid])
        self._current[wid] = IDLE
        if slot.state != "exiting":
            code = slot.proc.exitcode
            how = worker_exit_reason(slot.pid, code)
            if self.describe_death is not None:        # last measured memory and the likely cause
                try:
                    how += f" ({self.describe_death(slot.pid, code)})"
                except Exception:   # noqa: BLE001 — a report never hurts the recovery
                    pass
            self._deaths_without_progress += 1
            restart = wid < self.target and not self._closed
            if self._deaths_without_progress >= MAX_DEATHS_WITHOUT_PROGRESS and self.fatal is None:
                self.fatal = RuntimeError(
                    f"DataLoader worker (pid(s) {slot.pid}) exited unexpectedly: {how} Workers died "
                    f"{self._deaths_without_progress} times in a row without finishing a batch, giving up")
                restart = False
            log.warning("adloader: worker %d exited unexpectedly: %s%s", wid, how,
                        " Starting a replacement." if restart else "")
            out.append(WorkerDied(wid, slot.pid, code, running))
            if restart:
                self.counters.worker_restarts += 1
        self._reconcile()

    def _forget(self, slot: _Slot) -> None:
        for fd in (slot.result.fileno(), slot.sentinel):
            self._unwatch(fd)
            self._fds.pop(fd, None)
            try:
                self._epoll.unregister(fd)
            except (OSError, ValueError):
                pass
        self.slots.pop(slot.wid, None)
        for conn in (slot.ctrl, slot.result):
            try:
                conn.close()
            except OSError:
                pass

    # ---- introspection ----------------------------------------------------------------------
    def worker_pids(self, retiring: bool = True) -> list[int]:
        """Workers not told to exit; ``retiring=False``: only those taking tasks (not finishing one before
        they retire, which most then do within a task's time)."""
        with self.lock:
            return [s.pid for s in self.slots.values()
                    if s.state == "running" or (retiring and s.state == "retiring")]

    def served_pids(self) -> list[int]:
        """Workers that finished a task (a result or a shard end was read from them): started, their
        ``worker_init_fn`` run; what ``adloader.memory`` measures a worker's growth from."""
        with self.lock:
            return [s.pid for s in self.slots.values() if s.served]

    def has_worker(self, wid: int) -> bool:
        """Worker ``wid`` has a slot: a process started and not yet reported gone (it may have exited: its
        ``WorkerDied`` then follows from a later ``poll``)."""
        with self.lock:
            return wid in self.slots

    def started_for(self, n: int) -> set[int]:
        """The worker counts that the workers ``0..n-1`` it has were started for (the
        ``get_worker_info().num_workers`` their ``worker_init_fn`` saw)."""
        with self.lock:
            return {s.num_workers for wid, s in self.slots.items() if wid < n}

    def init_failures(self) -> dict[int, RemoteError]:
        """``init_failed``, copied (the reaper may add to it)."""
        with self.lock:
            return dict(self.init_failed)

    def live_workers(self) -> int:
        with self.lock:
            return sum(1 for s in self.slots.values() if s.state == "running")

    # ---- shutdown ---------------------------------------------------------------------------
    def shutdown(self, timeout_s: float = SHUTDOWN_GRACE_S) -> None:
        """Stop every worker: ask (each finishes the task it is in, within ``timeout_s`` for them all),
        then terminate, then kill; close every channel. Idempotent.
        A no-op in a process forked from the owner (a worker of another loader, a user's subprocess)
        that drops its copy of the pool: the workers and channels are the owner's, not its own."""
        if os.getpid() != self._owner_pid:
            return
        with self.lock:
            if self._closed:
                return
            self._closed = True
            slots = list(self.slots.values())
            for slot in slots:
                self._send_ctrl(slot, Control.EXIT)
        # Each step runs to the end even when something raises out of a wait: a signal handler does
        # (torch's SIGCHLD handler raises "DataLoader worker ... is killed by signal" for a worker of
        # a torch DataLoader of this process, torch/utils/data/_utils/signal_handling.py). _closed is
        # already set, so a shutdown cut short there would never be retried: its workers would be left
        # running and its channels open. The first error is raised once everything is stopped.
        interrupted: BaseException | None = None

        def step(fn, *args, **kw) -> None:
            nonlocal interrupted
            try:
                fn(*args, **kw)
            except Exception as e:   # noqa: BLE001 — raised again below, after the cleanup
                if interrupted is None:
                    interrupted = e

        deadline = time.monotonic() + timeout_s
        for slot in slots:
            step(slot.proc.join, timeout=max(0.0, deadline - time.monotonic()))
        for slot in slots:
            if slot.proc.is_alive():
                step(slot.proc.terminate)
        for slot in slots:
            step(slot.proc.join, timeout=1.0)
            if slot.proc.is_alive():
                step(slot.proc.kill)
                step(slot.proc.join, timeout=1.0)
        try:
            self._close_channels(slots)
        finally:
            if interrupted is not None:
                raise interrupted

    def shutdown_unraised(self) -> None:
        """``shutdown`` as its owner's ``weakref.finalize`` runs it (the iterator collected mid-epoch, or
        the interpreter exiting). What shutdown raises after stopping every worker (an error torch's
        SIGCHLD handler raised inside it, see ``shutdown``) has no caller there to reach: Python only
        prints "Exception ignored in: <finalize object ...>" (pytest: PytestUnraisableExceptionWarning).
        It is logged as a warning, with its traceback and cause, instead. A ``close()`` or epoch end
        the user's code runs calls ``shutdown`` itself and raises it."""
        try:
            self.shutdown()
        except Exception as e:  # noqa: BLE001 — logged: nothing above a finalizer can take it
            log.warning("adloader: stopping the workers of a loader iterator that was garbage-collected (or "
                        "left at exit) was interrupted by %s: %s (logged, not raised: no caller to raise it "
                        "to)", type(e).__name__, e, exc_info=e)

    def _close_channels(self, slots: list) -> None:
        """shutdown's last part: forget ``slots``, close the task queue, stop the reaper, close the fds
        (these last whatever interrupts the reaper's join)."""
        with self.lock:
            for slot in slots:
                self._forget(slot)
            for s in (self._task_w, self._task_r):
                if s is not None:
                    s.close()
            reaper = self._reaper
        if reaper is not None and reaper is not threading.current_thread():
            try:
                os.write(self._reap_wake_w, b"x")
            except OSError:
                pass
        try:
            if reaper is not None and reaper is not threading.current_thread():
                reaper.join(timeout=2.0)    # it takes _poll_lock: a poll() waits 1 s at most
        finally:
            with self.lock:
                for fd in (self._wake_r, self._wake_w, self._reap_wake_r, self._reap_wake_w):
                    try:
                        os.close(fd)
                    except OSError:
                        pass
                self._epoll.close()
                self._reap_epoll.close()

