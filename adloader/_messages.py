"""What the elastic loader's main process and its workers say to each other (described here, once).

Channels (all created by the main process; a worker only ever reads tasks and control messages and
writes results; how bytes and file descriptors move is ``adloader._transport``):

- task socket, main -> any worker of a map-style pool (one ``AF_UNIX``/``SOCK_SEQPACKET`` pair shared by
  every worker): one pickled ``Task`` per message; any idle worker takes the next one.
- control pipe, main -> one worker (``multiprocessing.Pipe``): a ``Control`` (``RETIRE``, ``RESUME``,
  ``EXIT``) or a task meant for that worker only: every ``ShardTask`` of an IterableDataset (each
  worker iterates its own shard, dispatched round-robin in torch's order) and a ``Task`` too large for
  the task socket (``adloader._transport.MAX_TASK_BYTES``).
- result socket, one worker -> main (one ``SOCK_SEQPACKET`` pair per worker, so a dying worker can
  corrupt nothing but its own channel): ``Result`` with the batch as payload in the same message,
  ``ShardEnd``, ``Retired``, ``InitError``.

A worker answers every task it takes with exactly one ``Result`` or ``ShardEnd`` carrying the task's
``(iter_id, seq)``, on its own result socket, in the order it took them. ``iter_id`` names one epoch of
one iterator (a process-wide counter), so anything left over from an abandoned epoch is recognised and
dropped; ``seq`` is the batch's position in that epoch's sampler order, from 0.

The pool turns what it reads into events for the iterator: ``Batch`` (a ``Result`` and its payload),
``ShardEnd`` (passed through) and ``WorkerDied`` (made by the pool when a worker process exits without
being told to, after everything it wrote was read).

Every record is a ``NamedTuple``, read by field name. On the wire it is a plain tuple, its kind's
code then its fields (``to_wire``/``from_wire``): pickle takes a NamedTuple through
``copyreg.__reduce_ex__`` and rebuilds it through its Python ``__new__``, which measured 3-5x the
cost of a plain tuple per message (~20 us more per batch over both processes); as plain tuples the
records cost about 1 us more per message than the bare tuples used before them.
"""
from __future__ import annotations

import enum
from typing import Any, NamedTuple


class Task(NamedTuple):
    """Map-style batch ``seq`` of epoch ``iter_id``: fetch ``index`` (a list of indices with automatic
    batching, else one index) after seeding every global generator with ``seed``."""
    iter_id: int
    seq: int
    seed: int
    index: Any


class ShardTask(NamedTuple):
    """The next batch of this worker's IterableDataset shard. A task with a new ``iter_id`` starts a new
    pass over the worker's copy, sharded for ``num_shards`` workers (the epoch's worker count);
    ``shared_seed`` reseeds an ``IterDataPipe``'s random operations for that pass (torch's
    ``apply_random_seed``; None for other datasets)."""
    iter_id: int
    seq: int
    seed: int
    num_shards: int
    shared_seed: int | None


class Result(NamedTuple):
    """A worker finished a task. ``ok`` False: the payload is a ``RemoteError``. Timing of the batch
    inside the worker: CPU seconds (``time.process_time``), wall seconds, run-queue delay in ns."""
    iter_id: int
    seq: int
    ok: bool
    n_samples: int
    cpu_s: float
    wall_s: float
    runq_ns: int


class ShardEnd(NamedTuple):
    """The worker's shard was exhausted before task ``seq``: that task, and every later one handed to
    the same worker in this epoch, has no batch."""
    iter_id: int
    seq: int


class Retired(NamedTuple):
    """The worker finished everything handed to it after ``RETIRE`` and waits for ``RESUME``/``EXIT``."""


class InitError(NamedTuple):
    """``worker_init_fn`` raised (a ``RemoteError``); the worker waits for ``EXIT``."""
    error: Any


class Control(enum.Enum):
    """Control messages, main -> one worker; looked at only between two tasks."""
    RETIRE = "retire"       # finish the current task and those handed to you, then answer Retired
    RESUME = "resume"       # (after Retired) take tasks again
    EXIT = "exit"           # leave now


# ---- events the pool hands to the iterator --------------------------------------------------------
class Batch(NamedTuple):
    """A ``Result`` and its payload: the batch, a ``RemoteError`` (``result.ok`` False)."""
    result: Result
    payload: Any


class WorkerDied(NamedTuple):
    """Worker ``wid`` exited without being told to (``exitcode`` < 0: killed by that signal).
    ``running``: ``(iter_id, seq)`` of the task it had started and not answered, or None."""
    wid: int
    pid: int
    exitcode: int | None
    running: tuple[int, int] | None


# ---- the task a worker is running, in one shared int64 slot per worker ---------------------------
IDLE = -1


def running_key(iter_id: int, seq: int) -> int:
    """What a worker stores in its ``current_task`` slot while it runs task ``(iter_id, seq)``."""
    return (iter_id << 32) | seq


def running_task(key: int) -> tuple[int, int] | None:
    """``(iter_id, seq)`` from a ``current_task`` slot; None when the worker is idle."""
    return (key >> 32, key & 0xFFFFFFFF) if key >= 0 else None


# ---- wire form: (code, *fields), a plain tuple ------------------------------------------------------
_KINDS = (Task, ShardTask, Result, ShardEnd, Retired, InitError)
_CODE = {kind: code for code, kind in enumerate(_KINDS)}
_tuple_new = tuple.__new__


def to_wire(record) -> tuple:
    """The plain tuple a record travels as (pickled by the transport)."""
    return (_CODE[type(record)], *record)


def from_wire(wire: tuple):
    """The record a wire tuple stands for."""
    return _tuple_new(_KINDS[wire[0]], wire[1:])
