"""What runs inside one elastic-loader worker process: seeding, fetching, the task loop (and the
pieces the in-process mode shares).

Importable at top level so that ``spawn``/``forkserver`` children can unpickle ``worker_main``.
The messages a worker exchanges with the main process are described once, in ``adloader._messages``;
how they travel is ``adloader._transport``.

Invariants kept here:
- a task's randomness depends only on its seed (``task_seed(base_seed, epoch, seq)``): torch's,
  Python's and NumPy's global generators are reseeded before every task, so the result of a random
  augmentation does not depend on which worker ran the task, nor on how many workers there were;
- ``current_task[wid]`` holds ``running_key(iter_id, seq)`` of the task this worker runs (``IDLE``
  when idle); it is set right after a task is taken and cleared only after its result was written, so
  the main process can tell, after a worker died, which task died with it;
- a worker never exits on its own while the main process lives (except on ``EXIT``): retiring is a
  handshake (``RETIRE`` -> ``Retired`` -> ``RESUME``/``EXIT``) so the main process has unpickled every
  result (and fetched every shared-memory file descriptor, which the worker serves where storages go
  torch's way) before it goes;
- a worker runs on the training process's CPU mask, read when it was started, from its first line
  (before ``worker_init_fn``), whichever thread or start method started it (``adloader._affinity``);
- no ZeroMQ socket is ever created here, and a copy of the agent client's connection inherited
  through ``fork`` is closed (``_close_agent_connections``);
- no Python signal handler of the training process runs here (``drop_inherited_handlers``).
"""
from __future__ import annotations

import hashlib
import os
import random
import select
import signal
import socket
import struct
import sys
import time
import traceback
import weakref
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable

import torch

from adloader._affinity import take_cpu_mask
from adloader._messages import (IDLE, Control, InitError, Result, Retired, ShardEnd, ShardTask, from_wire,
                                running_key, to_wire)
from adloader._transport import (MAX_TASK_BYTES, TOO_MANY_FILES, fd_passing_supported, out_of_file_descriptors,
                                 send_message)

_MASK63 = (1 << 63) - 1


def task_seed(base_seed: int, epoch: int, seq: int) -> int:
    """The seed of one batch: a 63-bit hash of (base seed, epoch, batch index)."""
    digest = hashlib.blake2b(struct.pack("<qqq", base_seed, epoch, seq), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MASK63


def seed_all(seed: int) -> None:
    """Seed torch's CPU generator, ``random`` and NumPy's legacy global generator (if imported)."""
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(seed & 0xFFFFFFFF)


class RngGuard:
    """In-process (num_workers=0) tasks are seeded like worker tasks; this saves the caller's global
    generator states first and restores them after, so the training loop's own random stream is not
    disturbed by per-batch seeding."""

    __slots__ = ("_torch", "_py", "_np")

    def __enter__(self):
        self._torch = torch.get_rng_state()
        self._py = random.getstate()
        np = sys.modules.get("numpy")
        self._np = np.random.get_state() if np is not None else None
        return self

    def __exit__(self, *exc):
        torch.set_rng_state(self._torch)
        random.setstate(self._py)
        if self._np is not None:
            sys.modules["numpy"].random.set_state(self._np)
        return False


class _KeyErrorMessage(str):
    """KeyError's str() is its repr(); this keeps the multi-line traceback readable (as torch does)."""

    def __repr__(self):
        return self


class RemoteError:
    """An exception raised in a worker, carried to the main process with its formatted traceback and
    re-raised there as the same type (or RuntimeError if that type cannot take one message), with
    the worker's traceback in the message: the pattern of torch's ExceptionWrapper."""

    def __init__(self, exc_info=None, where: str = "in background") -> None:
        if exc_info is None:
            exc_info = sys.exc_info()
        self.exc_type = exc_info[0]
        self.exc_msg = "".join(traceback.format_exception(*exc_info))
        self.where = where

    def __reduce__(self):
        # the exception's class must be importable in the main process; fall back to RuntimeError
        try:
            ForkingPickler.dumps(self.exc_type)
            exc_type = self.exc_type
        except Exception:
            exc_type = RuntimeError
        return (_rebuild_remote_error, (exc_type, self.exc_msg, self.where))

    def reraise(self):
        msg = f"Caught {self.exc_type.__name__} {self.where}.\nOriginal {self.exc_msg}"
        if self.exc_type is KeyError:
            msg = _KeyErrorMessage(msg)
        elif getattr(self.exc_type, "message", None):
            raise self.exc_type(message=msg)
        try:
            exception = self.exc_type(msg)
        except Exception:
            raise RuntimeError(msg) from None
        raise exception


def _rebuild_remote_error(exc_type, exc_msg, where):
    err = RemoteError.__new__(RemoteError)
    err.exc_type, err.exc_msg, err.where = exc_type, exc_msg, where
    return err


def fetch_map(dataset, index, auto_collation: bool, collate_fn: Callable):
    """What torch's map-style fetcher does: ``__getitems__`` when the dataset has it, else one
    ``dataset[i]`` per index, then ``collate_fn``; without auto-collation one ``dataset[index]``."""
    if auto_collation:
        getitems = getattr(dataset, "__getitems__", None)
        if getitems:
            data = getitems(index)
        else:
            data = [dataset[i] for i in index]
    else:
        data = dataset[index]
    return collate_fn(data)


class IterableFetcher:
    """One pass over an IterableDataset copy, batch by batch (torch's iterable fetcher semantics:
    a short last batch is returned unless drop_last; an empty one ends the pass)."""

    def __init__(self, dataset, auto_collation: bool, batch_size, collate_fn, drop_last: bool) -> None:
        self.it = iter(dataset)
        self.auto_collation = auto_collation
        self.batch_size = batch_size
        self.collate_fn = collate_fn
        self.drop_last = drop_last
        self.ended = False

    def fetch(self):
        """Return (batch, n_samples); raise StopIteration when the pass is over."""
        if self.ended:
            raise StopIteration
        if self.auto_collation:
            data = []
            for _ in range(self.batch_size):
                try:
                    data.append(next(self.it))
                except StopIteration:
                    self.ended = True
                    break
            if not data or (self.drop_last and len(data) < self.batch_size):
                self.ended = True
                raise StopIteration
            return self.collate_fn(data), len(data)
        try:
            item = next(self.it)
        except StopIteration:
            self.ended = True
            raise
        return self.collate_fn(item), 1


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


class RunQueueClock:
    """Run-queue delay of this process from ``/proc/self/schedstat`` (second field, nanoseconds:
    time spent runnable but waiting for a CPU; see Documentation/scheduler/sched-stats.rst). Opened
    once; ``read_ns()`` returns 0 forever if the file is missing (no CONFIG_SCHED_INFO, not Linux).
    The file is closed by ``close()`` or when the clock is garbage-collected (every loader iterator
    holds one: an epoch must not leave a file descriptor behind)."""

    def __init__(self) -> None:
        self._fd = None
        self._closer = None
        try:
            fd = os.open("/proc/self/schedstat", os.O_RDONLY)
        except OSError:
            return
        self._fd = fd
        self._closer = weakref.finalize(self, _close_quietly, fd)
        self._closer.atexit = False

    def read_ns(self) -> int:
        if self._fd is None:
            return 0
        try:
            return int(os.pread(self._fd, 128, 0).split()[1])
        except (OSError, ValueError, IndexError):
            return 0

    def close(self) -> None:
        self._fd = None
        if self._closer is not None:
            self._closer()


# ---- DataPipes: what torch's own iterators do to them (torch/utils/data/dataloader.py) ----------
def is_datapipe(dataset) -> bool:
    """An ``IterDataPipe`` or ``MapDataPipe`` (torch's DataLoader wraps an IterDataPipe in
    ``_IterDataPipeSerializationWrapper``, which still is one)."""
    from torch.utils.data import IterDataPipe, MapDataPipe

    return isinstance(dataset, (IterDataPipe, MapDataPipe))


def shard_datapipe(dataset, num_shards: int, world_size: int, wid: int, rank: int) -> None:
    """torch's ``_sharding_worker_init_fn``: shard over processes first, then over their workers
    (``num_shards * world_size`` instances, this one ``wid * world_size + rank``)."""
    from torch.utils.data.graph_settings import apply_sharding

    apply_sharding(dataset, max(1, num_shards) * world_size, wid * world_size + rank)


def reseed_datapipe(dataset, shared_seed: int) -> None:
    """torch's ``apply_random_seed`` with a generator seeded from the epoch's shared seed: every
    worker (and every rank) shuffles the same way, so ``sharding_filter`` splits one order."""
    from torch.utils.data import IterDataPipe
    from torch.utils.data.graph_settings import apply_random_seed

    if isinstance(dataset, IterDataPipe):
        rng = torch.Generator()
        rng.manual_seed(shared_seed)
        apply_random_seed(dataset, rng)


def set_worker_info(wid: int, num_workers: int, seed: int, dataset) -> None:
    # One of two private touches (the other: torch's own pin_memory, dataloader._pin):
    # torch.utils.data.get_worker_info() returns the module global
    # ``torch.utils.data._utils.worker._worker_info``, which torch's own worker loop
    # sets the same way (torch/utils/data/_utils/worker.py, _worker_loop). default_collate also reads
    # it to allocate batches directly in shared memory inside workers.
    from torch.utils.data._utils import worker as _torch_worker

    _torch_worker._worker_info = _torch_worker.WorkerInfo(
        id=wid, num_workers=num_workers, seed=seed, dataset=dataset)


@dataclass
class WorkerSpec:
    """Everything a worker needs (pickled for spawn/forkserver; inherited with fork)."""
    wid: int
    num_workers: int            # the loader's target when this worker started (WorkerInfo.num_workers)
    base_seed: int              # WorkerInfo.seed = base_seed + wid, like torch
    dataset: Any
    iterable: bool
    auto_collation: bool
    batch_size: Any
    drop_last: bool
    collate_fn: Callable
    worker_init_fn: Callable | None
    world_size: int = 1         # torch.distributed's, when initialised (DataPipe sharding)
    rank: int = 0
    cpu_mask: frozenset[int] | None = None  # the training process's CPUs when this worker started


class _ShardPasses:
    """This worker's passes over its own copy of an IterableDataset: a task of a new epoch (a new
    ``iter_id``) starts a fresh pass, sharded for that epoch's worker count, which the task carries.
    A DataPipe is resharded for that count (if it changed) and reseeded from the epoch's shared seed,
    as torch's worker loop does at each epoch (``_ResumeIteration``)."""

    def __init__(self, spec: WorkerSpec, seed: int, sharded_for: int | None) -> None:
        self.spec = spec
        self.seed = seed
        self.sharded_for = sharded_for      # the worker count the DataPipe is sharded for
        self.iter_id: int | None = None
        self.fetcher: IterableFetcher | None = None

    def fetch(self, task: ShardTask):
        """(batch, n_samples) of this worker's shard; StopIteration when the shard is exhausted."""
        spec = self.spec
        if task.iter_id != self.iter_id:
            set_worker_info(spec.wid, task.num_shards, self.seed, spec.dataset)
            if self.sharded_for is not None and task.num_shards != self.sharded_for:
                shard_datapipe(spec.dataset, task.num_shards, spec.world_size, spec.wid, spec.rank)
                self.sharded_for = task.num_shards
            if task.shared_seed is not None:
                reseed_datapipe(spec.dataset, task.shared_seed)
            self.iter_id = task.iter_id
            self.fetcher = IterableFetcher(spec.dataset, spec.auto_collation, spec.batch_size,
                                           spec.collate_fn, spec.drop_last)
        return self.fetcher.fetch()


def drop_inherited_handlers() -> None:
    """Undo the Python signal handlers a forked worker inherited from the training process. They are the
    trainer's: Lightning's SIGTERM handler, run here, broadcasts over the process group the fork copied
    and returns, so the pool's ``terminate()`` would not stop the worker; its Slurm SIGUSR1 handler
    would save a checkpoint from the worker. SIGTERM and SIGCHLD go back to the default (a terminated
    worker dies, as torch's does; a dataset's own subprocesses can be waited for); any other signal the
    trainer catches is ignored here (the trainer acts on it; Slurm signals every process of a step).
    Handlers installed outside Python (``faulthandler.register``) are kept: ``getsignal`` does not
    return them as callables."""
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
            if callable(handler):
                signal.signal(sig, signal.SIG_DFL if sig in (signal.SIGTERM, signal.SIGCHLD) else signal.SIG_IGN)
        except (OSError, ValueError):       # a signal Python cannot set (SIGKILL, SIGSTOP, RT ones)
            pass


def _close_agent_connections() -> None:
    """With ``fork``: close this worker's copies of the agent client's connections once more
    (``adloader.client.close_inherited_agent_connections``; the client's at-fork hook did it at the fork).
    A connection the training process was making at the very moment of the fork (a socket made, not yet
    connected: nothing told it from any other socket then) is connected by now, and the agent would
    otherwise see it open for as long as this worker lives. Not imported where the client never was."""
    client = sys.modules.get("adloader.client")
    if client is None:
        return
    try:
        client.close_inherited_agent_connections()
    except Exception:   # noqa: BLE001 — never stop a worker over it
        pass


def worker_main(spec: WorkerSpec, task_sock: socket.socket | None, ctrl, result, current_task,
                mask_taken) -> None:
    """Worker process entry point. See the module docstring and ``adloader._messages`` for the protocol.
    ``mask_taken[wid]``: the pool already gave this process ``spec.cpu_mask`` (``adloader._affinity``)."""
    # first, so that worker_init_fn and every thread started here run on the training process's CPUs
    if not mask_taken[spec.wid]:
        take_cpu_mask(spec.cpu_mask)
    _close_agent_connections()
    # The main process turns Ctrl-C into KeyboardInterrupt and shuts the pool down; workers in the
    # same process group must not die half-way through a message.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    drop_inherited_handlers()
    # Orphan check: the parent is the main process (fork, spawn) or the fork server (which exits
    # when the main process does); when it goes, this process is re-parented and leaves.
    parent = os.getppid()
    torch.set_num_threads(1)
    wid = spec.wid
    seed = spec.base_seed + wid
    seed_all(seed & _MASK63)
    set_worker_info(wid, spec.num_workers, seed, spec.dataset)
    where = f"in DataLoader worker process {wid}"
    sharded_for = None
    try:
        if is_datapipe(spec.dataset):       # before worker_init_fn, as torch's sharding init fn does
            shard_datapipe(spec.dataset, spec.num_workers, spec.world_size, wid, spec.rank)
            sharded_for = spec.num_workers
        if spec.worker_init_fn is not None:
            spec.worker_init_fn(wid)
    except Exception:
        send_message(result, to_wire(InitError(RemoteError(where=where))))
        _wait_for_exit(ctrl, parent)
        return

    runq = RunQueueClock()
    fd_passing = fd_passing_supported()
    buf = bytearray(MAX_TASK_BYTES + 1)
    poller = select.poll()
    ctrl_fd = ctrl.fileno()
    poller.register(ctrl_fd, select.POLLIN)
    if task_sock is not None:
        poller.register(task_sock.fileno(), select.POLLIN)
    shard = _ShardPasses(spec, seed, sharded_for) if spec.iterable else None
    local_tasks: list = []

    def run(task) -> None:
        current_task[wid] = running_key(task.iter_id, task.seq)
        t0 = time.perf_counter()
        c0 = time.process_time()
        r0 = runq.read_ns()
        n_samples = 0
        ended = False
        try:
            seed_all(task.seed)
            if shard is not None:
                try:
                    data, n_samples = shard.fetch(task)
                except StopIteration:
                    data, ended = None, True
            else:
                data = fetch_map(spec.dataset, task.index, spec.auto_collation, spec.collate_fn)
                n_samples = len(task.index) if spec.auto_collation else 1
            ok = True
        except Exception:
            data, ok = RemoteError(where=where), False
        if ended:
            send_message(result, to_wire(ShardEnd(task.iter_id, task.seq)))
        else:
            header = Result(task.iter_id, task.seq, ok, n_samples, time.process_time() - c0,
                            time.perf_counter() - t0, max(0, runq.read_ns() - r0))
            # header and batch travel in one message but are pickled apart: the main process can
            # always tell which task a batch belongs to, even if rebuilding the batch fails there
            try:
                send_message(result, to_wire(header), data, fd_passing)
            except (BrokenPipeError, ConnectionResetError):
                raise
            except Exception as e:
                why = f"{where} while pickling the batch for the main process"
                if out_of_file_descriptors(e):
                    why += f" ({TOO_MANY_FILES})"
                send_message(result, to_wire(header._replace(ok=False)), RemoteError(where=why))
            del data
        current_task[wid] = IDLE

    retiring = False
    while True:
        # control messages first: they are only looked at between two tasks
        while ctrl.poll():
            try:
                msg = ctrl.recv()
            except EOFError:
                return
            if msg is Control.RETIRE:
                retiring = True
            elif msg is Control.EXIT:
                return
            elif type(msg) is tuple:
                local_tasks.append(from_wire(msg))     # a task for this worker only
        if local_tasks:
            run(local_tasks.pop(0))
            continue
        if retiring:
            # everything handed to this worker personally is done: hand the slot back and wait
            send_message(result, to_wire(Retired()))
            while True:
                msg = _recv_or_orphaned(ctrl, parent)
                if msg is None or msg is Control.EXIT:
                    return
                if msg is Control.RESUME:
                    retiring = False
                    break
                if type(msg) is tuple:     # a task: not sent to a retiring worker; kept for safety
                    local_tasks.append(from_wire(msg))
            continue
        events = poller.poll(1000)
        if not events:
            if os.getppid() != parent:   # orphaned: the main process is gone (SIGKILL, crash)
                return
            continue
        if task_sock is not None and any(fd != ctrl_fd for fd, _ in events):
            if ctrl.poll():
                continue           # a control message (e.g. retire) wins over a new task
            try:
                n = task_sock.recv_into(buf, len(buf), socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                continue           # another worker took it
            if n == 0:
                return             # socket closed: the main process is gone
            run(from_wire(ForkingPickler.loads(memoryview(buf)[:n])))


def _recv_or_orphaned(ctrl, parent: int):
    while not ctrl.poll(1.0):
        if os.getppid() != parent:
            return None
    try:
        return ctrl.recv()
    except EOFError:
        return None


def _wait_for_exit(ctrl, parent: int) -> None:
    while True:
        msg = _recv_or_orphaned(ctrl, parent)
        if msg is None or msg is Control.EXIT:
            return
