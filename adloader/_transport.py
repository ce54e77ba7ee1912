"""How messages move between the elastic loader's main process and its workers: framing, file
descriptor passing, the sockets. What the messages say is ``adloader._messages``.

- ``task_channel()``: the task socket a map-style pool shares (one task per ``SOCK_SEQPACKET``
  message, any idle worker takes the next). Why not ``multiprocessing.Queue``: its readers share a
  lock (a semaphore) that an idle worker holds while it blocks in ``get()``, so one worker killed by
  SIGKILL or the OOM killer would deadlock every other worker. A SEQPACKET socket keeps message
  boundaries in the kernel: each ``recv`` returns one whole task to one reader, with no user-space
  lock that a dead process could keep.
- ``result_channel()``, ``send_message`` (worker side), ``MessageReader`` (main side): one result
  socket per worker; a message is a small header and an optional payload (the batch), whose tensors
  travel as shared-memory file descriptors attached to the message.

Running out of file descriptors (each tensor of a batch in flight holds one while it crosses) is
reported with torch's own advice (``TOO_MANY_FILES``), where users and tools search for it.
"""
from __future__ import annotations

import array
import errno
import io
import os
import pickle
import socket
import struct
from multiprocessing.reduction import ForkingPickler

import torch

# Largest task message that goes through the shared task socket; larger ones (huge batches of
# indices) go to one worker's control pipe instead. Workers receive into a buffer this big.
MAX_TASK_BYTES = 128 * 1024

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

# torch's own words (torch/utils/data/dataloader.py, _MultiProcessingDataLoaderIter._try_get_data)
TOO_MANY_FILES = (
    "Too many open files. Communication with the workers is no longer possible. Please increase the "
    "limit using `ulimit -n` in the shell or change the sharing strategy by calling "
    "`torch.multiprocessing.set_sharing_strategy('file_system')` at the beginning of your code")


def out_of_file_descriptors(exc: BaseException) -> bool:
    """Whether ``exc`` says this process (or a worker) ran out of file descriptors while a batch
    crossed: ``EMFILE``/``ENFILE``, or torch's storage errors that wrap them in a RuntimeError."""
    if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and (
        "Too many open files" in text or "could not duplicate a shared memory file descriptor" in text)


def fd_passing_supported() -> bool:
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

    __slots__ = ("sock", "parts", "fds", "fds_dropped")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.parts: list[bytes] = []
        self.fds: list[int] = []
        self.fds_dropped = False

    def read_available(self) -> list:
        """Every complete message now readable, as (header, payload) pairs; payload is NO_PAYLOAD,
        the rebuilt object, or a PayloadError (also when the kernel dropped the message's file
        descriptors because this process has too many open: ``MSG_CTRUNC``). Raises EOFError when the worker's end is closed and no
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
            if flags & socket.MSG_TRUNC:    # cannot happen with our own sender; never trust it
                self._discard()
                raise EOFError("truncated message from worker")
            if flags & socket.MSG_CTRUNC:
                # the kernel could not install the passed descriptors here (EMFILE: unix(7)); the
                # header still arrives, the batch cannot be rebuilt
                self.fds_dropped = True
            if data[0] != 1:
                continue
            raw, fds, dropped = b"".join(self.parts), self.fds, self.fds_dropped
            self.parts, self.fds, self.fds_dropped = [], [], False
            try:
                (hlen,) = struct.unpack_from("<I", raw)
                header = pickle.loads(raw[4:4 + hlen])
                body = memoryview(raw)[4 + hlen:]
                if dropped:
                    payload = PayloadError(OSError(errno.EMFILE, "the file descriptors passed with this "
                                                   "batch were dropped: too many open files"))
                elif not len(body):
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
        self.parts, self.fds, self.fds_dropped = [], [], False


def task_channel() -> tuple[socket.socket, socket.socket]:
    """(write end for the main process, read end shared by the workers) of a map-style pool's task
    socket. The write end is non-blocking with a large send buffer (tasks wait in the kernel)."""
    task_w, task_r = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    for opt in (getattr(socket, "SO_SNDBUFFORCE", None), socket.SO_SNDBUF):
        if opt is None:
            continue
        try:
            task_w.setsockopt(socket.SOL_SOCKET, opt, 4 * 1024 * 1024)
            break
        except OSError:
            continue
    task_w.setblocking(False)
    return task_w, task_r


def result_channel() -> tuple[socket.socket, socket.socket]:
    """(main process's end, worker's end) of one worker's result socket."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


def take_tasks(task_r: socket.socket) -> list:
    """Every task still waiting in a task socket (no worker took it), unpickled, without waiting."""
    out = []
    while True:
        try:
            data = task_r.recv(MAX_TASK_BYTES + 1, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return out
        out.append(ForkingPickler.loads(data))
