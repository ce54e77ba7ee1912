"""What runs inside one elastic-loader worker process (and the pieces the in-process mode shares).

Importable at top level so that ``spawn``/``forkserver`` children can unpickle ``worker_main``.
The messages a worker exchanges with the main process are described once, in ``adloader._pool``.

Invariants kept here:
- a task's randomness depends only on its seed (``task_seed(base_seed, epoch, seq)``): torch's,
  Python's and NumPy's global generators are reseeded before every task, so the result of a random
  augmentation does not depend on which worker ran the task, nor on how many workers there were;
- ``current_task[wid]`` holds ``iter_id << 32 | seq`` of the task this worker runs (-1 when idle);
  it is set right after a task is taken and cleared only after its result was written, so the main
  process can tell, after a worker died, which task died with it;
- a worker never exits on its own while the main process lives (except on ``exit``): retiring is a
  handshake (``retire`` -> ``retired`` -> ``resume``/``exit``) so the main process has unpickled every
  result (and fetched every shared-memory file descriptor, which the worker serves) before it goes;
- no ZeroMQ socket is ever created here.
"""
from __future__ import annotations

import array
import hashlib
import io
import os
import pickle
import random
import select
import signal
import socket
import struct
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable

import torch

# Largest task message that goes through the shared task socket; larger ones (huge batches of
# indices) go to one worker's control pipe instead. Workers receive into a buffer this big.
MAX_TASK_BYTES = 128 * 1024

_MASK63 = (1 << 63) - 1

# ---- result channel: one AF_UNIX SOCK_SEQPACKET socket pair per worker --------------------------
# A logical message is one or more packets: a flag byte (1 = last packet) and up to _CHUNK bytes
# of pickle; file descriptors ride along as SCM_RIGHTS ancillary data (at most _MAX_FDS a packet).
#
# Why not torch's own path (ForkingPickler + multiprocessing.resource_sharer): there a tensor's
# shared-memory fd is fetched by the receiver over a fresh authenticated connection to a thread in
# the sending worker, which must win the worker's GIL from the batch being computed (up to the 5 ms
# switch interval, several times per fetch). Profiled here: ~5 ms per storage, more than half of the
# main process's time. Passing the fd with the message costs one sendmsg/recvmsg and no round trip.
# It uses the storage methods torch.multiprocessing.reductions itself uses (``_share_fd_cpu_``,
# ``_new_shared_fd_cpu``; torch/multiprocessing/reductions.py reduce_storage/rebuild_storage_fd);
# where they are missing, or the sharing strategy is not file_descriptor, storages go torch's way.
_CHUNK = 60 * 1024
_MAX_FDS = 250          # SCM_MAX_FD is 253
_FD_TAG = "adloader-fd"
_ANC_SIZE = socket.CMSG_LEN(_MAX_FDS * 4)
_RECV_FLAGS = int(socket.MSG_DONTWAIT | getattr(socket, "MSG_CMSG_CLOEXEC", 0))
_TRUNC_FLAGS = int(socket.MSG_CTRUNC | socket.MSG_TRUNC)


def _fd_passing_supported() -> bool:
    import torch.multiprocessing as tmp

    return (hasattr(torch.UntypedStorage, "_share_fd_cpu_") and hasattr(torch.UntypedStorage, "_new_shared_fd_cpu")
            and hasattr(socket, "send_fds") and tmp.get_sharing_strategy() == "file_descriptor")


class _FdPickler(ForkingPickler):
    """ForkingPickler that sends CPU storages as file descriptors alongside the message."""

    def __init__(self, file):
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self.fds: list[int] = []
        self._index: dict[int, int] = {}
        self._sizes: dict[int, int] = {}

    def persistent_id(self, obj):
        if type(obj) is not torch.UntypedStorage or obj.device.type != "cpu":
            return None
        if obj.nbytes() == 0:
            return None                     # cannot be mapped; torch's reduction rebuilds it empty
        # moves the storage into shared memory if it is not there yet (in place), then returns
        # the same fd for every view of it: one fd per storage, so aliasing survives the trip
        fd, size = obj._share_fd_cpu_()
        idx = self._index.get(fd)
        if idx is None:
            idx = self._index[fd] = len(self.fds)
            self.fds.append(fd)
            self._sizes[idx] = size
        return (_FD_TAG, idx, self._sizes[idx])


class _FdUnpickler(pickle.Unpickler):
    def __init__(self, file, fds: list[int]):
        super().__init__(file)
        self.fds = fds
        self.storages: dict[int, torch.UntypedStorage] = {}

    def persistent_load(self, pid):
        tag, idx, size = pid
        if tag != _FD_TAG:
            raise pickle.UnpicklingError(f"unknown persistent id {tag!r}")
        st = self.storages.get(idx)
        if st is None:
            st = self.storages[idx] = torch.UntypedStorage._new_shared_fd_cpu(self.fds[idx], size)
        return st


class _NoPayload:
    __slots__ = ()

    def __repr__(self):
        return "NO_PAYLOAD"


NO_PAYLOAD = _NoPayload()       # a message without a payload part (None is a valid batch)


class PayloadError:
    """A payload that arrived but could not be rebuilt in the main process (its header is known)."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def send_message(sock: socket.socket, header, payload=NO_PAYLOAD, fd_passing: bool = False) -> None:
    """Send one logical message: a small header (plain pickle) and an optional payload (the batch;
    ForkingPickler, storages as passed file descriptors when ``fd_passing``). Usually one packet, so
    one wakeup of the main process per batch. Layout: u32 header length, header, payload."""
    h = pickle.dumps(header, pickle.HIGHEST_PROTOCOL)
    fds: list[int] = []
    if payload is NO_PAYLOAD:
        body = memoryview(b"")
    elif fd_passing:
        buf = io.BytesIO()
        pickler = _FdPickler(buf)
        pickler.dump(payload)
        body, fds = buf.getbuffer(), pickler.fds
    else:
        body = memoryview(ForkingPickler.dumps(payload))
    segments = [memoryview(struct.pack("<I", len(h))), memoryview(h), body]
    total = sum(len(x) for x in segments)
    sent, fd_pos, seg, off = 0, 0, 0, 0
    while True:
        parts, room = [], _CHUNK
        while room and seg < len(segments):
            piece = segments[seg][off:off + room]
            parts.append(piece)
            room -= len(piece)
            off += len(piece)
            if off >= len(segments[seg]):
                seg, off = seg + 1, 0
        sent += _CHUNK - room
        batch = fds[fd_pos:fd_pos + _MAX_FDS]
        fd_pos += len(batch)
        last = sent >= total and fd_pos >= len(fds)
        parts.insert(0, b"\x01" if last else b"\x00")
        if batch:
            socket.send_fds(sock, parts, batch)
        else:
            sock.sendmsg(parts)
        if last:
            return


class MessageReader:
    """Reassembles logical messages from one worker's result socket (main process side)."""

    __slots__ = ("sock", "parts", "fds")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.parts: list[bytes] = []
        self.fds: list[int] = []

    def read_available(self) -> list:
        """Every complete message now readable, as (header, payload) pairs; payload is NO_PAYLOAD,
        the rebuilt object, or a PayloadError. Raises EOFError when the worker's end is closed and no
        complete message came before the close in this call (those are returned first: a worker that
        sent its last results and exited loses none of them; the next call raises)."""
        out = []
        while True:
            try:
                # (socket.recv_fds ignores its flags argument before Python 3.12)
                data, ancdata, flags, _ = self.sock.recvmsg(_CHUNK + 1, _ANC_SIZE, _RECV_FLAGS)
            except (BlockingIOError, InterruptedError):
                return out
            except ConnectionResetError:
                self._discard()
                if out:
                    return out
                raise EOFError("worker socket reset") from None
            fds = []
            for level, kind, anc in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    arr = array.array("i")
                    arr.frombytes(anc[:len(anc) - len(anc) % arr.itemsize])
                    fds.extend(arr)
            if not data:
                for fd in fds:
                    os.close(fd)
                self._discard()
                if out:
                    return out
                raise EOFError("worker socket closed")
            self.parts.append(data[1:])
            self.fds.extend(fds)
            if flags & _TRUNC_FLAGS:        # cannot happen with our own sender; never trust it
                self._discard()
                raise EOFError("truncated message from worker")
            if data[0] != 1:
                continue
            raw, fds = b"".join(self.parts), self.fds
            self.parts, self.fds = [], []
            try:
                (hlen,) = struct.unpack_from("<I", raw)
                header = pickle.loads(raw[4:4 + hlen])
                body = memoryview(raw)[4 + hlen:]
                if not len(body):
                    payload = NO_PAYLOAD
                else:
                    try:
                        payload = _FdUnpickler(io.BytesIO(body), fds).load() if fds else pickle.loads(body)
                    except Exception as e:
                        payload = PayloadError(e)
                out.append((header, payload))
            finally:
                for fd in fds:
                    os.close(fd)

    def _discard(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.parts, self.fds = [], []



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


class RunQueueClock:
    """Run-queue delay of this process from ``/proc/self/schedstat`` (second field, nanoseconds:
    time spent runnable but waiting for a CPU; see Documentation/scheduler/sched-stats.rst). Opened
    once; ``read_ns()`` returns 0 forever if the file is missing (no CONFIG_SCHED_INFO, not Linux)."""

    def __init__(self) -> None:
        try:
            self._fd = os.open("/proc/self/schedstat", os.O_RDONLY)
            self.read_ns()
        except (OSError, ValueError, IndexError):
            self._fd = None

    def read_ns(self) -> int:
        if self._fd is None:
            return 0
        try:
            return int(os.pread(self._fd, 128, 0).split()[1])
        except (OSError, ValueError, IndexError):
            return 0

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def set_worker_info(wid: int, num_workers: int, seed: int, dataset) -> None:
    # The one private touch (allowed by DESIGN.md): torch.utils.data.get_worker_info() returns the
    # module global ``torch.utils.data._utils.worker._worker_info``, which torch's own worker loop
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


def worker_main(spec: WorkerSpec, task_sock: socket.socket | None, ctrl, result, current_task) -> None:
    """Worker process entry point. See the module docstring and ``adloader._pool`` for the protocol."""
    # The main process turns Ctrl-C into KeyboardInterrupt and shuts the pool down; workers in the
    # same process group must not die half-way through a message.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Orphan check: the parent is the main process (fork, spawn) or the fork server (which exits
    # when the main process does); when it goes, this process is re-parented and leaves.
    parent = os.getppid()
    torch.set_num_threads(1)
    wid = spec.wid
    seed = spec.base_seed + wid
    seed_all(seed & _MASK63)
    set_worker_info(wid, spec.num_workers, seed, spec.dataset)
    where = f"in DataLoader worker process {wid}"
    try:
        if spec.worker_init_fn is not None:
            spec.worker_init_fn(wid)
    except Exception:
        send_message(result, ("init_error", RemoteError(where=where)))
        _wait_for_exit(ctrl, parent)
        return

    runq = RunQueueClock()
    fd_passing = _fd_passing_supported()
    buf = bytearray(MAX_TASK_BYTES + 1)
    poller = select.poll()
    ctrl_fd = ctrl.fileno()
    poller.register(ctrl_fd, select.POLLIN)
    if task_sock is not None:
        poller.register(task_sock.fileno(), select.POLLIN)
    fetcher: IterableFetcher | None = None
    fetcher_iter_id = None
    local_tasks: list = []

    def run(task) -> None:
        nonlocal fetcher, fetcher_iter_id
        _, iter_id, seq, tseed, index, epoch_workers = task
        current_task[wid] = (iter_id << 32) | seq
        t0 = time.perf_counter()
        c0 = time.process_time()
        r0 = runq.read_ns()
        n_samples = 0
        stopped = False
        try:
            seed_all(tseed)
            if spec.iterable:
                if fetcher_iter_id != iter_id:
                    # a new epoch: fresh pass over this worker's copy; sharding follows the epoch's
                    # worker count, which the task carries
                    set_worker_info(wid, epoch_workers, seed, spec.dataset)
                    fetcher_iter_id = iter_id
                    fetcher = IterableFetcher(spec.dataset, spec.auto_collation, spec.batch_size,
                                              spec.collate_fn, spec.drop_last)
                try:
                    data, n_samples = fetcher.fetch()
                except StopIteration:
                    data, stopped = None, True
            else:
                data = fetch_map(spec.dataset, index, spec.auto_collation, spec.collate_fn)
                n_samples = len(index) if spec.auto_collation else 1
            ok = True
        except Exception:
            data, ok = RemoteError(where=where), False
        if stopped:
            send_message(result, ("stop", iter_id, seq))
        else:
            header = ("result", iter_id, seq, ok, n_samples, time.process_time() - c0,
                      time.perf_counter() - t0, max(0, runq.read_ns() - r0))
            # header and batch travel in one message but are pickled apart: the main process can
            # always tell which task a batch belongs to, even if rebuilding the batch fails there
            try:
                send_message(result, header, data, fd_passing)
            except (BrokenPipeError, ConnectionResetError):
                raise
            except Exception:
                header = header[:3] + (False,) + header[4:]
                send_message(result, header, RemoteError(where=f"{where} while pickling the batch for the main process"))
            del data
        current_task[wid] = -1

    retiring = False
    while True:
        # control messages first: they are only looked at between two tasks
        while ctrl.poll():
            try:
                msg = ctrl.recv()
            except EOFError:
                return
            if msg[0] == "task":
                local_tasks.append(msg)
            elif msg[0] == "retire":
                retiring = True
            elif msg[0] == "exit":
                return
        if local_tasks:
            run(local_tasks.pop(0))
            continue
        if retiring:
            # everything handed to this worker personally is done: hand the slot back and wait
            send_message(result, ("retired",))
            while True:
                msg = _recv_or_orphaned(ctrl, parent)
                if msg is None or msg[0] == "exit":
                    return
                if msg[0] == "resume":
                    retiring = False
                    break
                if msg[0] == "task":   # not sent to a retiring worker; kept for safety
                    local_tasks.append(msg)
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
            run(ForkingPickler.loads(memoryview(buf)[:n]))


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
        if msg is None or msg[0] == "exit":
            return
