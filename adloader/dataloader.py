"""``adloader.DataLoader``: a drop-in ``torch.utils.data.DataLoader`` whose parallelism can change
between any two batches.

    from adloader import DataLoader
    loader = DataLoader(dataset, batch_size=64, shuffle=True, num_workers=4)
    ...
    loader.resize(6)          # from any thread, at any time: 6 workers from the next batch on

Same constructor, same batches in the same order as torch's DataLoader; in addition:

- ``resize(n)`` / ``num_workers = n``: growing starts workers (a started worker takes queued tasks at
  once), shrinking retires the highest ids after their current task. ``num_workers`` reports the
  target, bounded by ``max_workers``. ``resize(0)`` switches to loading in the main process.
  A node agent's directive (``_resize(own=False)``) never grows the workers past what this process's
  memory holds (``memory_bound_workers``: its cgroup limit or MemAvailable, whichever is tighter, at
  the workers' measured cost); it never shrinks them for it.
- one shared task queue, sequence numbers and a reorder buffer: every batch is delivered exactly once
  and in sampler order (``in_order=False``: as they finish), whatever the worker count and however
  often it changes. The loader owns its pool; torch's iterator internals are not used.
- a worker that dies (SIGKILL, OOM killer, segfault) is replaced and its batches are re-dispatched;
  the event is logged on the ``adloader`` logger. A dataset exception reaches the caller with the
  worker's traceback in its message, as in torch.
- ``stats()``: step and worker timing, always on (see ``stats`` for the keys).
- ``state_dict()`` / ``load_state_dict()``: resume mid-epoch with any worker count.
- ``total_steps=`` / ``set_total_steps(n)``: the batches the job has left, when it knows them (a hint
  for the node agent, reported as ``steps_left`` in ``stats()``; never a limit).

Invariants:
- the index sampler is torch's own (``RandomSampler``/``SequentialSampler``/``BatchSampler`` built by
  torch's constructor, which this class calls), and each epoch draws from ``generator`` (or torch's
  global generator) exactly what torch's iterator draws, in its order, before the sampler's first draw
  (a new iterator: an IterDataPipe's shared seed, the base seed, with workers a second shared seed; a
  persistent iterator's later epochs: the shared seed only, keeping its base seed); so for one seed
  the sequence of batches equals torch's, with or without persistent workers.
- batch ``seq`` of epoch ``e`` is computed with torch, ``random`` and NumPy seeded from
  ``task_seed(base_seed, e, seq)``, in a worker or in the main process alike (in the main process the
  caller's generator states are saved and restored around it), so random augmentation does not depend
  on which worker ran the batch, nor on the number of workers.
- a batch is delivered at most once: results are keyed by (iterator id, seq); duplicates (a batch
  re-dispatched after a worker died while its first copy was still running) and results of an
  abandoned epoch are dropped.

Deviations from torch (by design, documented):
- IterableDataset: each worker iterates its own copy (shard via ``get_worker_info()``), dispatched
  round-robin like torch, so batches come in torch's order for the same worker count. Built with
  ``num_workers`` 0 or 1 and no ``max_workers``, it gets no more workers, with "auto" at most one
  (``ITERABLE_HELD_NOTE``: a dataset that does not shard would be yielded whole by each). The shard
  layout is fixed for an epoch: ``resize()`` during an epoch takes effect at the next epoch (a warning
  says so, once per loader; then DEBUG); a persistent pool with a ``worker_init_fn`` is restarted at an
  epoch whose count differs (``_drop_workers_set_up_for_another_count``). A worker that dies mid-epoch
  cannot be replayed: the epoch raises ``RuntimeError``.
  ``load_state_dict`` resumes an IterableDataset only at an epoch boundary: a mid-epoch state restarts
  its epoch from the beginning, with a warning (Lightning loads it on every resume), unless Lightning
  loads it as an ended epoch's (``limit_train_batches``): then the next epoch starts.
- Seeding is per batch: before every batch torch's, ``random``'s and NumPy's global generators are
  seeded from ``task_seed(base_seed, epoch, seq)``, so a seed set in ``worker_init_fn`` is overwritten
  before ``__getitem__`` runs, and ``torch.initial_seed()`` in a worker is the batch's seed (torch:
  ``base_seed + worker_id`` for the worker's life). ``get_worker_info().seed`` is torch's
  ``base_seed + worker_id``.
- ``num_workers=0``: per-batch seeding is done in the main process too (caller's RNG state restored
  after each batch), so the dataset's random draws differ from torch's (which uses the caller's
  stream directly); ``timeout`` is ignored there (torch asserts it is 0 at iteration).
- DataPipes as torch: ``apply_sharding`` over the workers (times the ranks of torch.distributed)
  before ``worker_init_fn``, ``apply_random_seed`` from the epoch's shared seed at every epoch, in the
  workers and (``num_workers=0``) in the main process; an IterDataPipe is resharded at the next epoch
  when the worker count changed.
- Errors use torch's words where people search for them: "DataLoader timed out after {timeout}
  seconds", "DataLoader worker (pid(s) N) exited unexpectedly" / "DataLoader worker (pid N) is killed
  by signal: Killed.", and torch's ``ulimit -n`` / ``set_sharing_strategy('file_system')`` advice
  when a batch cannot cross for lack of file descriptors. A death the loader recovers from (map-style)
  is a warning on the ``adloader`` logger, not an error.
- ``persistent_workers=False`` stops the workers at the end of each epoch, as torch does (so changes
  made to the dataset between epochs reach fresh workers); ``True`` keeps them, except workers that a
  ``resize()`` started in an epoch begun without workers: torch's loader creates its persistent worker
  iterator (new workers, a new base seed) at the next epoch with workers, and so does this one
  (``_drop_workers_seeded_for_another_base``).
- ``get_worker_info().num_workers`` is the target when the worker started (map-style) or the epoch's
  worker count (iterable).
- A ``worker_init_fn`` error is raised at the batch torch raises it at (``_init_error_due``), or
  later when it is read after that batch was made by another worker; then the epoch ends, where
  torch's iterator goes on (each batch it gave the failed worker raising ``UnboundLocalError``). A
  persistent pool keeps the failure: every later epoch raises it again at its batch (torch's failed
  worker runs later epochs without its ``worker_init_fn``).
- A worker runs on the CPU mask of the training process's main thread as it is when the worker starts,
  set before ``worker_init_fn``, whichever thread started it and with any start method
  (``adloader._affinity``); torch's workers inherit the starting thread's mask, or the fork server's.
- The first batch of indices is drawn from the sampler when the epoch's iterator is created where torch
  does (with workers), and at the first ``next()`` where torch does (``num_workers=0``), except for an
  epoch resumed from ``load_state_dict`` with ``num_workers=0``: its sampler is replayed under the
  saved RNG state when the iterator is created.
- An epoch left mid-way leaves the generator where torch's loader with the worker count in effect
  then leaves it (the prefetch window, ``prefetch_factor`` times that count, decides whether the
  sampler ran out and a ``RandomSampler`` drew again): after a resize in that epoch, not the count
  the loader was built with.
- ``timeout`` bounds one ``next()`` call's wait for its batch (torch: one queue read).
  ``prefetch_factor=0`` behaves as 2. The IterableDataset "more samples than len()" warning is not
  emitted.
- ``pin_memory=True`` (with an accelerator) pins as torch does, with torch's ``pin_memory()``: with
  workers on a background thread (``adloader._pin``), so that the copy overlaps the training step;
  without workers, and for a batch run in this process after ``resize(0)``, inline at ``next()``. A
  batch is handed to the thread when a ``next()`` takes it in from the workers (each ``next()`` takes
  in those that arrived during the step before it; torch's thread reads the workers' results itself,
  as they arrive), so at most the prefetch window is pinned ahead. A worker's error is not pinned; an
  error while pinning is raised at that batch's ``next()`` in torch's words ("Caught ValueError in pin
  memory thread for device 0.") and the epoch goes on. The thread lives for one epoch (torch's
  persistent iterator keeps one for its life): started at the epoch's first batch, joined when the
  epoch ends, its iterator is dropped or the loader closed; a ``next()`` waiting on a pin when
  ``close()`` is called from another thread raises ``StopIteration``.
- Batches travel from workers as one message per batch with the tensors' shared-memory file
  descriptors attached (SCM_RIGHTS), not through torch's ``resource_sharer`` round trips (see
  ``adloader._transport``); the tensors the caller gets are the same shared-memory tensors.
"""
from __future__ import annotations

import inspect
import itertools
import logging
import multiprocessing
import operator
import os
import sys
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional, TypeVar

import torch
import torch.utils.data as tud

from adloader._affinity import training_cpu_mask
from adloader._messages import Batch, ShardEnd, ShardTask, Task, WorkerDied
from adloader._pin import PinJob, PinThread
from adloader._pin import pin_batch as _pin
from adloader._pool import WorkerPool, worker_exit_reason
from adloader._sequencer import Sequencer
from adloader._worker import (IterableFetcher, RemoteError, RngGuard, RunQueueClock, WorkerSpec, fetch_map,
                              is_datapipe, reseed_datapipe, seed_all, shard_datapipe, task_seed)
from adloader.autotune import default_max_workers
from adloader.memory import WorkerMemorySampler, batch_nbytes, format_bytes
from adloader.stats import LoaderCounters, RateWindow

log = logging.getLogger("adloader")

# An IterableDataset is copied into every worker, and each copy yields the whole stream unless the
# dataset splits it by ``torch.utils.data.get_worker_info()`` (torch's docs: "the replicas must be
# configured differently to avoid duplicated data"). A loader built with num_workers 0 or 1 says nothing
# about whether it does, so it never gets more (``max_workers`` defaults to that count; with "auto", 1):
# neither a directive of the agent nor the autotuner duplicates its samples. A user who passes
# ``max_workers`` (or builds it with ``num_workers`` >= 2, as torch would run it) says it shards itself.
ITERABLE_HELD_NOTE = ("an IterableDataset built with num_workers 0, 1 or 'auto' is not given more workers than "
                      "that (auto: 1), which would each yield it whole unless it shards itself by "
                      "get_worker_info(); pass max_workers to allow them")

__all__ = ["DataLoader", "STATE_VERSION"]

STATE_VERSION = 1
_ITER_IDS = itertools.count(1)
_WAIT_SLICE_S = 1.0     # longest single wait on the pool (deaths and resizes wake it earlier)
# the name torch's iterators give each next() in a profiler trace, without workers and with them
_PROFILE_NAMES = {False: "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__",
                  True: "enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__"}
T_co = TypeVar("T_co", covariant=True)

# Frameworks that copy a loader's attributes into a torch DataLoader of their own (so A-Dloader's
# workers, elastic state and agent hook silently drop out), and where to go instead.
_FOREIGN_COPIERS = {
    "accelerate.": "use adloader.integrations.accelerate.prepare(accelerator, loader) instead of "
                   "accelerator.prepare(loader)",
}
_foreign_copy_warned = False
_foreign_copy_allowed = threading.local()   # set by adloader.integrations while they copy on purpose


def _warn_if_foreign_copy(frame) -> None:
    """Warn once per process when a framework's code reads ``num_workers`` to build its own torch
    DataLoader from this one (``accelerate.data_loader.prepare_data_loader`` does so)."""
    global _foreign_copy_warned
    if getattr(_foreign_copy_allowed, "on", False):
        return
    if frame is not None and frame.f_code.co_name == "__getattr__":
        frame = frame.f_back    # a wrapper forwarding the attribute (accelerate's DataLoaderAdapter): who asked?
    module = frame.f_globals.get("__name__", "") if frame is not None else ""
    for prefix, advice in _FOREIGN_COPIERS.items():
        if module.startswith(prefix):
            _foreign_copy_warned = True
            warnings.warn(f"adloader: {module} is rebuilding an adloader.DataLoader as torch's "
                          "DataLoader: its batches will not come from A-Dloader's workers, resize() and "
                          f"the agent will not reach it; {advice}", stacklevel=3)
            return


def _available_cpus() -> int:
    """CPUs in the training process's mask, its main thread's (``training_cpu_mask``), whichever thread
    builds the loader: ``os.sched_getaffinity(0)`` is the calling thread's own mask, which a pin the
    script put on its main thread after the thread was created does not change."""
    mask = training_cpu_mask()
    return len(mask) if mask else (os.cpu_count() or 1)


@dataclass(frozen=True)
class _Config:
    """What an epoch's iterator needs from the loader (captured at ``iter()``, like torch)."""
    dataset: Any
    iterable: bool
    index_sampler: Any
    auto_collation: bool
    batch_size: Any
    drop_last: bool
    collate_fn: Any
    generator: Any
    pin: bool
    pin_device: Optional[str]   # the accelerator's type when pinning (torch's ``_pin_memory_device``)
    timeout_s: float
    timeout: Any                # as given, for torch's wording of the timeout error
    datapipe: bool              # an IterDataPipe or MapDataPipe: sharded and seeded as torch does
    worker_init_fn: Any
    mp_context: Any
    in_order: bool
    persistent: bool
    prefetch_factor: int


def _as_count(value) -> Optional[int]:
    """``value`` as an int if it is an integer other than a bool: an int, a NumPy integer, a one-element
    integer tensor (what torch's loader takes for ``num_workers``: it compares it and ``range()``s over
    it, through ``__index__``); None otherwise."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except (TypeError, ValueError, RuntimeError):
        return None


def _torch_worker_count(value) -> Optional[int]:
    """``num_workers`` as torch's DataLoader takes it (the constructor's argument, the attribute): any
    integer ``_as_count`` takes, and a bool, which is an int to torch (its checks compare it, and
    ``_MultiProcessingDataLoaderIter`` starts ``range(num_workers)`` workers:
    torch/utils/data/dataloader.py), so ``True`` is one worker and ``False`` none. None otherwise.
    ``loader.num_workers`` then reads the live count (1, where torch's attribute keeps ``True``);
    ``vars(loader)["num_workers"]`` keeps the argument. ``resize()`` and ``max_workers``, ours only,
    still refuse a bool."""
    if isinstance(value, bool):
        return int(value)
    return _as_count(value)


def _check_total_steps(total_steps) -> None:
    if total_steps is not None and (isinstance(total_steps, bool) or not isinstance(total_steps, int)
                                    or total_steps < 0):
        raise ValueError(f"total_steps must be an int >= 0 or None, got {total_steps!r}")


class _Core:
    """State shared by a loader and its iterators. Holds no reference to the loader or to an
    iterator (only weak ones): worker pools are owned by iterators (the persistent one is held by
    the loader), and a pool is shut down when its owner is garbage-collected (``weakref.finalize``)
    or at interpreter exit; an iterator outliving its loader keeps working, as in torch."""

    def __init__(self, target: int, max_workers: int) -> None:
        self.lock = threading.RLock()
        self.target = target
        self.max_workers = max_workers
        self.counters = LoaderCounters()
        self.rates = RateWindow(self.counters)
        self.next_epoch = 0
        self.epoch = 0
        self.iters: weakref.WeakSet = weakref.WeakSet()
        self.auto = False           # num_workers="auto"
        self.requested = target     # the job's own count: num_workers, then its own resize()/auto moves
        self.hooks_attached = False     # agent client / autotune: once per state, not per loader
        self.owner = None       # weakref to the loader that created this state (the user's object)
        # persistent workers: one pool per loader object sharing this state (a framework's rebuilt
        # copy may carry another dataset); held by their iterators, listed here for resize and close
        self.persistent_pools: weakref.WeakSet = weakref.WeakSet()
        self.closed = False
        self.warned_iterable_resize = False
        self.warned_memory_bound = False    # a directive was clamped to what memory holds (one WARNING)
        self.memory_bound: Optional[int] = None   # the last memory_bound_workers (its band: memory_cap's previous)
        self.worker_cost_peak = 0.0              # the most one worker was measured to cost (stats' worker_cost_peak_bytes)
        self.iterable_held = False  # max_workers is the count of an IterableDataset's loader (ITERABLE_HELD_NOTE)
        self.memory = WorkerMemorySampler()      # workers' USS/PSS, sampled from stats() (every 2 s at most)
        self.batch_bytes = 0                     # size of a delivered batch, sampled every 16th step
        self.prefetch_factor = 2
        self.steps_goal: Optional[tuple[int, int]] = None   # (steps still to hand out, counters.steps then)
        self.pass_start_steps = 0       # counters.steps when the latest pass (an epoch's iterator) began
        self.longest_pass_steps = 0     # the most batches one earlier pass handed out (finished or abandoned)

    def __reduce__(self):
        """A deep or pickled copy of a loader (``copy.deepcopy``, ``pickle``: a loader sent to another
        process) gets a state of its own with the same settings: worker target, ``max_workers``, auto
        mode, epoch numbering, steps left; fresh counters, no workers, no hooks attached yet."""
        with self.lock:
            goal = self.steps_goal
            left = None if goal is None else max(0, goal[0] - (self.counters.steps - goal[1]))
            return (_copied_core, (self.target, self.max_workers, self.auto, self.requested, self.epoch,
                                   self.next_epoch, left, self.closed))

    def pass_steps(self) -> int:
        """The most batches one pass of this state handed out: its longest earlier pass, or the one
        running if that is longer (the agent client's choice of the training loader). Read without the
        lock: ``_start_epoch`` writes ``longest_pass_steps`` before ``pass_start_steps``, and this reads
        them the other way round, so a pass that just ended is counted in one of the two."""
        start = self.pass_start_steps
        return max(self.longest_pass_steps, self.counters.steps - start)

    def pools(self) -> list[WorkerPool]:
        with self.lock:
            pools = [it._pool for it in list(self.iters) if it._pool is not None]
            pools.extend(self.persistent_pools)
        uniq = []
        for p in pools:
            if all(p is not q for q in uniq):
                uniq.append(p)
        return uniq

    def close(self) -> None:
        with self.lock:
            self.closed = True
            iters = list(self.iters)
        for it in iters:
            it._close()
        for pool in list(self.persistent_pools):
            pool.shutdown()


def _copied_core(target, max_workers, auto, requested, epoch, next_epoch, steps_left, closed) -> _Core:
    core = _Core(target, max_workers)
    core.auto, core.requested, core.epoch, core.next_epoch, core.closed = auto, requested, epoch, next_epoch, closed
    if steps_left is not None:
        core.steps_goal = (steps_left, 0)
    return core


class DataLoader(tud.DataLoader[T_co]):
    """Elastic drop-in for ``torch.utils.data.DataLoader`` (see the module docstring). Generic like
    torch's: ``DataLoader[list[Tensor]]`` is a valid annotation.

    Extra arguments: ``num_workers="auto"`` (initial count from ``adloader.autotune``, which then
    resizes the loader from its own measurements unless an agent takes over), ``max_workers``
    (upper bound for ``resize``; default: the larger of ``num_workers`` and the CPUs this process
    may run on; with ``"auto"``, 4 per such CPU, the tuner's own bound ``autotune.worker_cap``),
    ``elastic_state`` (another loader's ``elastic_state``: see below).

    Rebuilt by a framework. Lightning (``_update_dataloader``), Accelerate and others re-create a
    loader from the instance: either from the arguments the user passed (Lightning records and
    replays them) or from attributes named like the constructor's arguments. So:
    - every argument is recoverable from the instance: torch's attributes, ``max_workers``, and
      ``vars(loader)["num_workers"]`` holds the argument as given (``"auto"`` included) while the
      ``num_workers`` property reads the live target;
    - ``elastic_state`` is a public attribute (an opaque handle) and a keyword argument: a loader
      built with another's ``elastic_state`` shares its worker target, ``max_workers``, auto mode,
      counters, epoch numbering and agent/autotune attachment. ``stats()``, ``resize()`` and the
      agent's directives on either object act on both, so the user's object stays the live handle
      when a framework trains on its rebuilt copy. Each object keeps its own sampler, dataset and
      (persistent) worker pool; iterate one of them at a time.
    - where a framework records the constructor's arguments to replay them (Lightning's
      ``__pl_saved_kwargs``), ``elastic_state`` is added to that record, so the replayed loader
      shares the state too.
    - torch's constructor is called with keyword arguments only (Lightning records the positional
      arguments of the outermost patched ``__init__`` and replays them with its own keywords)."""

    def __init__(self, dataset, batch_size=1, shuffle=None, sampler=None, batch_sampler=None,
                 num_workers=0, collate_fn=None, pin_memory=False, drop_last=False, timeout=0,
                 worker_init_fn=None, multiprocessing_context=None, generator=None, *,
                 prefetch_factor=None, persistent_workers=False, pin_memory_device="",
                 in_order=True, max_workers=None, elastic_state=None, total_steps=None):
        auto = isinstance(num_workers, str)
        _check_total_steps(total_steps)
        if auto and num_workers != "auto":
            raise ValueError(f"num_workers must be an int >= 0 or 'auto', got {num_workers!r}")
        count = None if auto else _torch_worker_count(num_workers)
        if not auto and count is None:
            raise TypeError(f"num_workers must be an int >= 0 or 'auto', got {num_workers!r}")
        if elastic_state is not None and not isinstance(elastic_state, _Core):
            raise TypeError("elastic_state must be another adloader.DataLoader's .elastic_state, got "
                            f"{type(elastic_state).__name__}")
        if elastic_state is not None and elastic_state.closed:
            raise ValueError("elastic_state belongs to a closed adloader.DataLoader")
        self._elastic_ready = False
        self._target_init = 1 if auto else count        # read by torch's __init__ via the property
        super().__init__(
            dataset=dataset, batch_size=batch_size, shuffle=shuffle, sampler=sampler,
            batch_sampler=batch_sampler, num_workers=self._target_init, collate_fn=collate_fn,
            pin_memory=pin_memory, drop_last=drop_last, timeout=timeout, worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context, generator=generator,
            prefetch_factor=prefetch_factor, persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device, in_order=in_order)
        if elastic_state is not None:
            core = elastic_state
            if max_workers is not None and max_workers != core.max_workers:
                log.info("adloader: max_workers=%s ignored: the shared elastic state has max_workers=%d",
                         max_workers, core.max_workers)
        else:
            held = False
            if max_workers is None:
                max_workers = max(default_max_workers(_available_cpus(), auto=auto), 0 if auto else count)
                held = (auto or count <= 1) and self.dataset_kind == "iterable"
                if held:
                    max_workers = 1 if auto else count      # ITERABLE_HELD_NOTE: the user's 0 or 1, "auto" 1
            elif _as_count(max_workers) is None:
                raise TypeError(f"max_workers must be an int >= 0 (the most workers resize() and the agent may "
                                f"give), got {max_workers!r} ({type(max_workers).__name__})")
            elif _as_count(max_workers) < 0:
                raise ValueError(f"max_workers must be an int >= 0 (the most workers resize() and the agent may "
                                 f"give), got {_as_count(max_workers)}")
            else:
                max_workers = _as_count(max_workers)
                if not auto and count > max_workers:
                    raise ValueError(f"num_workers={count} exceeds max_workers={max_workers}")
            core = _Core(min(self._target_init, max_workers), max_workers)
            core.iterable_held = held
            core.auto = auto
            core.requested = core.target
            core.owner = weakref.ref(self)
        self._core = core
        if total_steps is not None and (elastic_state is None or core.steps_goal is None):
            self.set_total_steps(total_steps)
        # a copy keeps the state's first loader alive: the agent client and autotune hold that one
        # (weakly), so they keep working while any copy trains, even if the user dropped theirs
        self._owner = core.owner() if elastic_state is not None else None
        self._resume: dict | None = None
        self._persistent_iter = None
        self._last_iter = None
        # the constructor's arguments, recoverable from the instance's attributes (the properties
        # of the same names shadow these entries when read)
        self.__dict__["num_workers"] = num_workers
        self.__dict__["max_workers"] = core.max_workers
        self.elastic_state = core
        self._elastic_ready = True
        self._share_state_with_recorded_args()
        if auto and elastic_state is None:
            n = self._initial_auto_workers()
            core.target = core.requested = n

    def _share_state_with_recorded_args(self) -> None:
        """Lightning's ``_wrap_init_method`` records the outermost ``__init__``'s arguments in
        ``__pl_saved_kwargs`` (lightning/fabric/utilities/data.py) and replays them to rebuild the
        loader with a distributed sampler; add ``elastic_state`` so that the rebuilt loader shares
        this one's. Only where the class being built accepts the argument (a user's subclass with its
        own signature may not)."""
        saved = self.__dict__.get("__pl_saved_kwargs")
        if not isinstance(saved, dict) or "elastic_state" in saved:
            return
        try:
            params = inspect.signature(type(self).__init__).parameters
        except (TypeError, ValueError):
            return
        if "elastic_state" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
            saved["elastic_state"] = self._core

    # ---- torch's private iterator slot ---------------------------------------------------------
    @property
    def _iterator(self):
        """torch's name for a persistent loader's live iterator (``DataLoader._iterator``, set by its
        ``__iter__`` only with ``persistent_workers``); here the persistent ``_ElasticIter`` or None."""
        return self.__dict__.get("_persistent_iter")

    @_iterator.setter
    def _iterator(self, value) -> None:
        """Frameworks drop a loader's iterator by assigning None: Lightning's teardown of every fit,
        validate and test run (``_shutdown_workers_and_reset_iterator``, lightning/pytorch/utilities/
        combined_loader.py) shuts down torch's multiprocessing iterator's workers, then sets
        ``_iterator = None``. Here that stops this loader's persistent workers and forgets the
        iterator, so they do not outlive ``trainer.fit()``; the next ``iter()`` starts new ones, with a
        new base seed, as torch's would. torch's own ``__init__`` assigns None before any iterator
        exists. Assigning an iterator is refused: only this loader makes its iterators."""
        if value is not None:
            raise TypeError("adloader.DataLoader._iterator can only be reset to None")
        it = self.__dict__.get("_persistent_iter")
        self.__dict__["_persistent_iter"] = None
        if it is not None:
            it._close()

    # ---- copies --------------------------------------------------------------------------------
    def __copy__(self):
        """``copy.copy``: the same attributes, so the copy shares the elastic state (and, as torch's
        shallow copy does, the persistent iterator)."""
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    def __getstate__(self):
        """``copy.deepcopy`` and ``pickle`` (which torch's loader allows): the arguments and sampler
        state, with a fresh elastic state (``_Core.__reduce__``); iterators and worker pools are not
        copied (torch refuses to pickle a persistent loader's live iterator; the copy starts its own)."""
        state = self.__dict__.copy()
        state["_persistent_iter"] = None
        state["_last_iter"] = None
        return state

    def __setstate__(self, state) -> None:
        self.__dict__.update(state)     # not setattr: torch's __setattr__ refuses some after __init__
        core = self._core
        if core.owner is None:
            core.owner = weakref.ref(self)

    # ---- drop-in attributes ------------------------------------------------------------------
    @property
    def num_workers(self) -> int:
        """The target number of workers (what ``resize`` last asked for). The constructor's argument
        as given (``"auto"`` included) is ``vars(loader)["num_workers"]``."""
        if not self.__dict__.get("_elastic_ready"):
            return self.__dict__.get("_target_init", 0)
        if not _foreign_copy_warned:
            _warn_if_foreign_copy(sys._getframe(1))
        return self._core.target

    @num_workers.setter
    def num_workers(self, n) -> None:
        if not self.__dict__.get("_elastic_ready"):
            self.__dict__["_target_init"] = n     # torch's constructor assigns it
        else:
            count = _torch_worker_count(n)
            self._resize(n if count is None else count, own=True, name="num_workers")

    @property
    def max_workers(self) -> int:
        return self._core.max_workers

    @property
    def requested_workers(self) -> int:
        """The job's own worker count: ``num_workers`` as given, then the last ``resize()`` the job made
        itself (the user's code, or ``num_workers="auto"``'s tuner). An agent's directive does not change
        it: this is the count an observe-only agent (policy ``none``) leaves the job at."""
        return self._core.requested

    @property
    def dataset_kind(self) -> str:
        """"map": a resize takes effect between two batches; "iterable" (an ``IterableDataset``): at the
        next epoch, as the epoch's worker shards are fixed. In ``stats()`` and the agent client's hello."""
        return "iterable" if isinstance(self.dataset, tud.IterableDataset) else "map"

    def set_epoch(self, epoch: int) -> None:
        """Tell the sampler which epoch comes next, as Accelerate's loaders do: forwarded to the
        batch sampler if it has ``set_epoch``, else to the sampler (``DistributedSampler`` reshuffles
        from ``seed + epoch``), else to the dataset (Hugging Face datasets, custom IterableDatasets).
        The loader's own per-batch seeding does not depend on it."""
        for target in (self.batch_sampler, getattr(self.batch_sampler, "sampler", None), self.sampler,
                       self.dataset):
            if target is not None and callable(getattr(target, "set_epoch", None)):
                target.set_epoch(epoch)
                return

    # ---- elasticity ------------------------------------------------------------------------
    def resize(self, n: int) -> int:
        """Set the number of workers to ``n`` (an int from 0 to ``max_workers``; a larger one is clamped
        to ``max_workers``, a negative one raises ``ValueError``, anything but an int, a bool included,
        ``TypeError``); returns the target. ``0``: the batches from the next one on are loaded in this
        process (tasks queued for the workers come back; a worker finishes the batch it is making).

        Callable from any thread at any time. Map-style datasets: takes effect between two batches
        (new workers take queued batches at once; retired ones finish their current batch first).
        IterableDataset: at the next epoch (a warning says so). The count becomes the job's own
        (``requested_workers``), which an observe-only agent keeps."""
        return self._resize(n, own=True)

    def _resize(self, n: int, own: bool, name: str = "resize(n): n") -> int:
        """``resize``; ``own=False`` for the agent's directives, which leave ``requested_workers``.
        ``name``: what the caller set, for the error (``loader.num_workers = n`` says so)."""
        core = self._core
        count = _as_count(n)
        if count is None or count < 0:
            allowed = (f"an int from 0 (load in the main process) to max_workers={core.max_workers} (a larger "
                       "one is clamped to it)")
            if count is not None:
                raise ValueError(f"{name} must be {allowed}, got {count}")
            if isinstance(n, str) and n == "auto":
                raise TypeError(f"{name} must be {allowed}, got 'auto': \"auto\" is taken only when the "
                                "loader is built (DataLoader(..., num_workers=\"auto\"))")
            raise TypeError(f"{name} must be {allowed}, got {n!r} ({type(n).__name__})")
        n = count
        if n > core.max_workers:
            if own and core.iterable_held:
                log.warning("adloader: resize(%d) clamped to max_workers=%d: %s", n, core.max_workers,
                            ITERABLE_HELD_NOTE)
            else:
                log.info("adloader: resize(%d) clamped to max_workers=%d", n, core.max_workers)
            n = core.max_workers
        if not own and n > core.target:
            n = self._memory_clamp(n)
        with core.lock:
            if core.closed:
                return core.target
            if own:
                core.requested = n
            if n == core.target:
                return n
            core.target = n
            core.counters.resizes += 1
            iters = [it for it in list(core.iters) if not it._done]
            idle = [p for p in core.persistent_pools if not any(it._pool is p for it in iters)]
        log.debug("adloader: resize to %d workers", n)
        notices = [it._on_resize(n) for it in iters]
        for pool in idle:
            pool.resize(n)      # persistent workers between epochs
        for msg in filter(None, notices):
            # after every iterator and pool has the new target: where the warning filters make this an
            # exception (python -W error), the resize is done all the same, and callers that did not ask
            # for it (autotune, the agent client) catch ``Warning`` and go on
            warnings.warn(msg, stacklevel=3)
        return n

    def memory_bound_workers(self, memory_stats: Optional[dict] = None) -> Optional[int]:
        """The most workers this loader's memory holds, by the ``num_workers="auto"`` tuner's rule
        (``adloader.autotune.memory_cap``): its workers' measured memory now plus the room left to this
        process (``adloader.memory.memory_room``: the least of MemAvailable and its cgroup's limit less
        usage), less a reserve, over one worker's measured cost (its USS plus its batches in flight, never
        less than the most one worker cost so far: ``worker_cost_peak_bytes`` in ``stats()``).
        None where nothing is known (no worker measured yet, no room readable). Never raises.
        It holds its last value while MemAvailable moves by noise (page cache): it tightens on a real
        shortage and loosens with a margin (``memory_cap``'s ``previous``), so an agent's plan does not
        move the workers up and down with the page cache.
        ``memory_stats``: ``_memory_stats()`` where the caller has it (``stats``), not sampled again."""
        from adloader import autotune

        core = self._core
        try:
            stats = dict(memory_stats or self._memory_stats(), workers=core.target)
            bound = autotune.memory_cap(stats, *autotune.memory_limits(), previous=core.memory_bound)
            if bound is not None:
                core.memory_bound = bound
            return bound
        except Exception:   # noqa: BLE001 — measurement never hurts training
            log.debug("adloader: memory bound failed", exc_info=True)
            return None

    def _memory_clamp(self, n: int) -> int:
        """A directive's growth to ``n`` workers, at most to what memory holds (``memory_bound_workers``),
        never below the workers it has: an agent plans a node-wide memory budget and cannot see this
        process's own limit (a pod's ``limits.memory``, Slurm's ConstrainRAMSpace); a worker started past
        it meets the OOM killer, which may take the training process. Unmeasured: growth is allowed."""
        core = self._core
        bound = self.memory_bound_workers()
        if bound is None or n <= bound:
            return n
        clamped = max(core.target, bound)
        if not core.warned_memory_bound:
            core.warned_memory_bound = True
            from adloader import autotune

            room, limit = autotune.memory_limits()
            log.warning("adloader: the agent asked for %d workers; this process's memory holds %d "
                        "(room %s under a limit of %s, %s per worker measured): keeping %d. The agent sees "
                        "memory_bound_workers in the loader's reports (logged once per loader)", n, bound,
                        format_bytes(room), format_bytes(limit),
                        format_bytes(autotune.worker_cost(dict(self._memory_stats(), workers=core.target))),
                        clamped)
        return clamped

    def worker_pids(self, retiring: bool = True) -> list[int]:
        """PIDs of this loader's live worker processes (including ones finishing before retiring; a
        retired one leaves as soon as it is told to exit, whether or not the loader is being iterated).
        ``retiring=False``: only the workers taking tasks (what the agent client reports: a retiring one
        may exit before the agent reads the report)."""
        pids: list[int] = []
        for pool in self._core.pools():
            pids.extend(pool.worker_pids(retiring))
        return pids

    def held_memory_bytes(self) -> int:
        """The memory this loader's live workers hold now: their unique memory (sampled as ``stats()``
        samples it, at most every 2 s) and the batches in flight in shared memory for them (``prefetch_factor``
        x live workers x ``batch_bytes``); 0 where no worker runs (between the epochs of a loader without
        ``persistent_workers``). The agent client reports it, summed, for the loaders of the process that
        the agent does not size (a validation loader's: ``other_loader_memory_bytes``)."""
        core = self._core
        try:
            pids = self.worker_pids()
            if not pids:
                return 0
            served = [pid for pool in core.pools() for pid in pool.served_pids()]
            m = core.memory.sample(pids, ready=served)
            return int(m.uss + core.prefetch_factor * len(pids) * core.batch_bytes)
        except Exception:   # noqa: BLE001 — measurement never hurts training
            log.debug("adloader: memory sample failed", exc_info=True)
            return 0

    def stats(self) -> dict:
        """Rolling totals and rates, as a plain dict. Totals are monotonic since creation.

        steps              batches handed to the caller
        samples            samples in them
        batches            batches finished by workers (or in-process), duplicates included
        epoch              index of the current (latest started) epoch, 0-based
        workers            target worker count (``num_workers``)
        live_workers       worker processes that currently take tasks (not retiring)
        dataset_kind       "map": a resize takes effect between two batches; "iterable" (an
                           ``IterableDataset``): at the next epoch, as the epoch's worker shards are fixed
                           (for an endless stream, never: ``live_workers`` stays the epoch's count)
        max_workers, requested_workers   (requested_workers: the job's own count, see ``requested_workers``)
        batch_size         samples per batch, what ``samples`` is counted in and what the agent and the
                           tuner divide it by to count steps (``_stats_batch_size``): torch's
                           ``batch_size``, else (a custom ``batch_sampler``, ``batch_size=None``) the mean
                           of what the delivered batches held; None before the first batch
        data_wait_s        time the caller spent blocked in ``next()``
        compute_s          time between two ``next()`` calls (the training step), pauses left out
        paused_s           time between two ``next()`` calls that was no step: a step of
                           ``adloader.stats.PAUSE_FACTOR`` (10) times the loop's pace and at least 1 s (a
                           validation pass or checkpoint save every N steps, a debugger stop) counts the
                           pace's worth as compute and the rest here (``LoaderCounters.add_step``)
        away_s             seconds since the training loop last left ``next()`` (a batch returned, the
                           epoch's end), 0 while a ``next()`` call waits for data and before the first:
                           long while the loop validates, saves a checkpoint or stands in a debugger, as it
                           happens (``paused_s`` counts a pause once it is over). Not a total
        worker_cpu_s       CPU seconds spent on batches (``time.process_time`` in the worker)
        worker_wall_s      wall seconds spent on batches
        worker_runq_s      of which runnable but waiting for a CPU (/proc/self/schedstat field 2;
                           0 where the kernel does not provide it)
        worker_blocked_s   wall - cpu - runq (clamped at 0 per batch): sleeping, mostly IO
        steps_left         only when the job said how many steps it has left (``total_steps``,
                           ``set_total_steps``): that count less the batches handed out since, at least 0
        resizes            number of effective resize() calls
        worker_restarts    workers started to replace one that died
        redispatched       batches handed out again because their worker died
        uptime_s           seconds since the loader was created
        main_cpu_s         CPU seconds the training process itself (all its threads, not the workers)
                           spent during its steps, i.e. between next() calls (``time.process_time``):
                           what its step needs on the CPU (background threads' CPU while it waits
                           for data is not counted)
        main_runq_s        seconds the training process's main thread waited for a CPU while runnable
                           (/proc/self/schedstat field 2, monotonic since the process started; 0 where
                           the kernel does not provide it): how much of ``compute_s`` is the trainer
                           starved of CPU rather than computing
        memory (bytes, ``adloader.memory``; the workers are sampled at most every 2 s, from
        ``/proc/<pid>/smaps_rollup``, by this process; 0 before the first sample):
            worker_uss_bytes       unique memory of the live workers (``worker_pids()``), summed (what
                                   retiring them frees); a retired worker leaves it when it leaves
                                   ``worker_pids()``, without waiting for the next sample
            worker_pss_bytes       proportional memory of the live workers, summed (shared pages divided)
            worker_uss_per_worker  mean USS of a worker
            worker_growth_bytes    mean growth of a worker's USS since its first sample: private pages it
                                   copied as it ran (copy-on-read of a dataset of Python objects)
            memory_workers         workers in the sample
            batch_bytes            bytes of tensors/arrays in one delivered batch (sampled)
            shm_inflight_bytes     batches in flight in shared memory: prefetch_factor x workers x batch_bytes
            memory_sample_cost_s   CPU seconds the last sample cost this process
            last_worker_death      the last worker that died unexpectedly: its last measured memory and
                                   the likely cause (OOM killer: SIGKILL with much memory held); "" if none
            worker_cost_peak_bytes the most one worker was measured to cost (its USS plus its part of the
                                   batches in flight) since this loader's workers first ran: what
                                   ``memory_bound_workers`` counts a worker at when the workers now cost
                                   less (workers just started, by a new epoch or a resize, have not
                                   copied the dataset's objects they will read yet). 0 before a sample
            memory                 the same sample per worker: {pid: {uss, pss, growth}} (a dict)
            memory_bound_workers   the most workers this process's memory holds
                                   (``memory_bound_workers``; None before a worker was measured): an
                                   agent's directive never grows the workers past it
        rates              over the last ``window_s`` seconds (about 5 s):
            window_s, samples_per_s, steps_per_s, data_wait_frac (wait / (wait + compute)),
            compute_s_per_step, data_wait_s_per_step, cpu_s_per_batch, wall_s_per_batch,
            runq_s_per_batch, blocked_s_per_batch, worker_cpu_cores (worker CPU s per second)
        """
        core = self._core
        c = core.counters
        now = time.perf_counter()
        live = sum(p.live_workers() for p in core.pools())
        out = {
            "steps": c.steps, "samples": c.samples, "batches": c.batches, "epoch": core.epoch,
            "workers": core.target, "live_workers": live, "max_workers": core.max_workers,
            "requested_workers": core.requested, "batch_size": self._stats_batch_size(c),
            "data_wait_s": c.data_wait_s, "compute_s": c.compute_s, "worker_cpu_s": c.worker_cpu_s,
            "worker_wall_s": c.worker_wall_s, "worker_runq_s": c.worker_runq_s,
            "worker_blocked_s": c.worker_blocked_s, "resizes": c.resizes,
            "worker_restarts": c.worker_restarts, "redispatched": c.redispatched,
            "uptime_s": time.monotonic() - c.created_mono, "main_cpu_s": c.step_cpu_s,
            "main_runq_s": self._main_runq_s(), "paused_s": c.paused_s, "away_s": c.away_s(now),
            "dataset_kind": self.dataset_kind,
            "rates": core.rates.rates(now),
        }
        goal = core.steps_goal
        if goal is not None:
            out["steps_left"] = max(0, goal[0] - (c.steps - goal[1]))
        mem = self._memory_stats()
        out.update(mem)
        out["memory_bound_workers"] = self.memory_bound_workers(mem)
        return out

    def set_total_steps(self, total_steps: Optional[int]) -> None:
        """How many more batches this loader will hand out, over all epochs to come (the training
        loop's remaining steps: ``max_steps`` less the steps done, ``len(loader) * epochs`` left), or
        None to forget it. Counted down as batches are handed out and reported as ``steps_left`` in
        ``stats()``: the node agent's ``finish_guard`` uses it so that the job whose remaining work
        sets the node's finishing time is not starved (docs/users.md). A hint, never a limit: the
        loader hands out batches past it as before."""
        _check_total_steps(total_steps)
        core = self._core
        with core.lock:
            core.steps_goal = None if total_steps is None else (int(total_steps), core.counters.steps)

    def _stats_batch_size(self, c) -> Optional[int]:
        """Samples per batch as ``stats()`` reports it: consistent with ``samples``, which counts what
        each delivered batch held (``_deliver``): its indices with auto-batching, one per dataset item
        without (``batch_size=None``: an item may be a ready-made batch or one sample, a [3, H, W]
        image is not 3 samples, and nothing tells the two apart; counted as one, the agent still counts
        steps right). torch's ``batch_size`` where it has one; else (a custom ``batch_sampler``, whose
        loader's ``batch_size`` torch sets to None, or ``batch_size=None``) the mean over the batches
        delivered so far, at least 1, None before the first. Read as 1, a batch sampler's None made the
        agent and the tuner count each sample as a step."""
        if self.batch_size is not None:
            return self.batch_size
        steps, samples = c.steps, c.samples
        return max(1, round(samples / steps)) if steps > 0 else None

    def _main_runq_s(self) -> float:
        core = self._core
        clock = getattr(core, "main_runq_clock", None)
        if clock is None:
            from adloader._worker import RunQueueClock

            clock = core.main_runq_clock = RunQueueClock()   # opened here: /proc/self is this process
        return clock.read_ns() * 1e-9

    def _memory_stats(self) -> dict:
        core = self._core
        try:
            served = [pid for pool in core.pools() for pid in pool.served_pids()]
            m = core.memory.sample(self.worker_pids(), ready=served)
        except Exception:   # noqa: BLE001 — measurement never hurts training
            log.debug("adloader: memory sample failed", exc_info=True)
            m = core.memory.summary
        from adloader import autotune

        workers = max(core.target, m.workers)
        out = {
            "worker_uss_bytes": m.uss, "worker_pss_bytes": m.pss, "worker_uss_per_worker": m.uss_per_worker,
            "worker_growth_bytes": m.growth_per_worker, "memory_workers": m.workers,
            "batch_bytes": core.batch_bytes,
            "shm_inflight_bytes": core.prefetch_factor * workers * core.batch_bytes,
            "memory_sample_cost_s": m.sample_cost_s, "last_worker_death": core.memory.last_death,
        }
        now = autotune.worker_cost(dict(out, workers=workers))
        if now is not None and now > core.worker_cost_peak:
            core.worker_cost_peak = now
        out["worker_cost_peak_bytes"] = core.worker_cost_peak
        out["memory"] = {str(p): dict(v) for p, v in m.per_worker.items()}
        return out

    # ---- iteration -------------------------------------------------------------------------
    def __iter__(self):
        core = self._core
        if core.closed:
            raise RuntimeError("this adloader.DataLoader was closed")
        self._attach_hooks()
        cfg = self._config()
        with core.lock:
            resume, self._resume = self._resume, None
            if self.persistent_workers:
                it = self._persistent_iter
                if it is None:
                    it = self._persistent_iter = _new_iter(core, cfg)
                else:
                    it._cfg = cfg
            else:
                it = _new_iter(core, cfg)
            core.iters.add(it)
            self._last_iter = weakref.ref(it)
        it._start_epoch(resume)
        return it

    def _config(self) -> _Config:
        iterable = isinstance(self.dataset, tud.IterableDataset)    # torch's own test
        pin = False
        pin_device = None
        if self.pin_memory:
            if self.pin_memory_device:
                warnings.warn("pin_memory_device is deprecated, the current accelerator will be used as "
                              f"the device,ignore pin_memory_device='{self.pin_memory_device}'.", stacklevel=3)
            if torch.accelerator.is_available():
                pin = True
                acc = torch.accelerator.current_accelerator()
                pin_device = acc.type if acc is not None else None
            else:
                warnings.warn("'pin_memory' argument is set as true but no accelerator is found, "
                              "then device pinned memory won't be used.", stacklevel=3)
        self._core.prefetch_factor = max(1, self.prefetch_factor or 2)
        ctx = self.multiprocessing_context
        if ctx is None:
            ctx = multiprocessing.get_context()
        elif isinstance(ctx, str):
            ctx = multiprocessing.get_context(ctx)
        return _Config(
            dataset=self.dataset, iterable=iterable, index_sampler=self._index_sampler,
            auto_collation=self._auto_collation, batch_size=self.batch_size, drop_last=self.drop_last,
            collate_fn=self.collate_fn, generator=self.generator, pin=pin, pin_device=pin_device,
            timeout_s=float(self.timeout),
            timeout=self.timeout, datapipe=is_datapipe(self.dataset), worker_init_fn=self.worker_init_fn, mp_context=ctx, in_order=self.in_order,
            persistent=self.persistent_workers, prefetch_factor=max(1, self.prefetch_factor or 2))

    # ---- checkpointing -----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Position in the epoch: ``{"version", "dataset_kind", "epoch", "batches_delivered",
        "delivered_ahead", "base_seed", "base_seed_drawn", "rng_source", "rng_state"}``, mid-epoch also
        ``"sampler_drawn"``, and ``"persistent_base_seed"`` (plain values and one CPU tensor, fit for
        ``torch.save``; ``base_seed_drawn`` False: the epoch reuses the base seed of a persistent
        iterator, as torch's does, and a state without it counts as True; ``sampler_drawn``: ``[items the
        sampler gave, whether it ran out]``, map-style, None for an IterableDataset: how far the sampler's
        RNG moved, for a state resumed as an ended epoch; ``persistent_base_seed``: the base seed of the
        persistent worker iterator, None before the first epoch with workers or without persistent
        workers, kept through an epoch run without workers). Between epochs it describes the start of
        the next one.

        Resuming (``load_state_dict`` on a fresh loader with the same dataset and sampler
        arguments, any worker count) yields every batch not yet delivered exactly once, in the same
        order and with the same per-batch seeds. The sampler is replayed from the recorded RNG state
        and the delivered prefix skipped (indices only: no sample is loaded for it); a custom sampler
        must therefore be deterministic given that state (e.g. DistributedSampler after set_epoch).
        A map-style state taken after the epoch's last batch, before its ``StopIteration``, resumes
        at the start of the next epoch (``_ElasticIter._past_spent_epoch``), and so does any state that
        Lightning's fit loop loads as an ended epoch's (``limit_train_batches``:
        ``_lightning_resume_at``)."""
        it = self._last_iter() if self._last_iter is not None else None
        if it is not None and not it._done and it._started:
            return it._state_dict()
        gen = self.generator
        # a persistent iterator keeps its base seed into the next epoch (as torch's does): say so
        kept = it is not None and it._persistent_base is not None
        return {
            "version": STATE_VERSION,
            "dataset_kind": self.dataset_kind,
            "epoch": self._core.next_epoch, "batches_delivered": 0, "delivered_ahead": [],
            "base_seed": it._persistent_base if kept else None, "base_seed_drawn": not kept,
            "rng_source": "generator" if gen is not None else "global",
            "rng_state": gen.get_state() if gen is not None else torch.get_rng_state(),
            "persistent_base_seed": it._persistent_base if it is not None else None,
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume from ``state_dict()`` output at the next ``iter()`` (see ``state_dict``). An
        IterableDataset's state from mid-epoch restarts that epoch from its beginning, with a warning.
        Loaded by Lightning's fit loop from a checkpoint taken at the last batch of an epoch (Lightning's,
        which ``limit_train_batches`` ends before the sampler does), it resumes at the next epoch."""
        if not isinstance(state, Mapping):
            raise ValueError(f"not an adloader.DataLoader state (a dict with 'version' {STATE_VERSION} "
                             f"expected): {type(state)}")
        version = state.get("version")
        # the integer itself: == took True and 1.0 for 1 (a state no state_dict() wrote)
        if type(version) is not int or version != STATE_VERSION:
            raise ValueError(f"not an adloader.DataLoader state: its 'version' is {version!r}, the integer "
                             f"{STATE_VERSION} expected")
        kind = self.dataset_kind
        if state["dataset_kind"] != kind:
            raise ValueError(f"state is for a {state['dataset_kind']}-style dataset, this loader has a "
                             f"{kind}-style one")
        if (state["rng_source"] == "generator") != (self.generator is not None):
            raise ValueError("state was saved with generator=" +
                             ("a torch.Generator" if state["rng_source"] == "generator" else "None") +
                             "; this loader differs")
        state = dict(state)
        if state["batches_delivered"] or state["delivered_ahead"]:
            state = _lightning_resume_at(state)     # (an ended epoch: ``_ElasticIter._past_spent_epoch``)
        if kind == "iterable" and not state.get("epoch_ended") and (state["batches_delivered"]
                                                                    or state["delivered_ahead"]):
            # Lightning loads this on every resume, mid-epoch checkpoints included (torch's loader, which
            # has no state, starts the epoch again there): restart, never refuse
            warnings.warn(f"adloader: an IterableDataset cannot resume mid-epoch (its workers' shards cannot "
                          f"be replayed to a position): epoch {state['epoch']} restarts from its beginning, "
                          f"its first {state['batches_delivered']} batch(es) come again", stacklevel=2)
            state["batches_delivered"], state["delivered_ahead"] = 0, []
        self._resume = state

    # ---- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        """Stop every worker of this loader and detach from the agent/autotune. Idempotent."""
        if self._core.closed:
            return
        handle = self._core.owner() if self._core.owner is not None else None
        handle = handle if handle is not None else self      # the loader the hooks were given
        for modname, fn in (("adloader.client", "detach"), ("adloader.autotune", "detach")):
            if modname == "adloader.autotune" and not self._core.auto:
                continue
            handle._call_hook(modname, fn)
        self._core.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    # ---- hooks (never raise into training) --------------------------------------------------
    def _call_hook(self, modname: str, fn: str, *args):
        try:
            import importlib

            mod = importlib.import_module(modname)
            return getattr(mod, fn)(self, *args)
        except ImportError:
            return None
        except Exception:       # a hook must never break training
            log.warning("adloader: %s.%s failed", modname, fn, exc_info=True)
            return None

    def _initial_auto_workers(self) -> int:
        n = self._call_hook("adloader.autotune", "initial_workers")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            n = max(1, min(2, self._core.max_workers))
        return max(0, min(n, self._core.max_workers))

    def _attach_hooks(self) -> None:
        with self._core.lock:
            if self._core.hooks_attached:
                return
            self._core.hooks_attached = True
        if tud.get_worker_info() is not None:
            return          # a loader used inside a loader worker: not a training process
        try:
            import importlib

            disabled = bool(importlib.import_module("adloader.env").disabled())
        except Exception:       # never break training over the hook
            disabled = False
        handle = self._core.owner() if self._core.owner is not None else None
        handle = handle if handle is not None else self
        if not disabled:
            handle._call_hook("adloader.client", "attach")
        if self._core.auto:
            handle._call_hook("adloader.autotune", "attach")


def _lightning_fit_loop():
    """Lightning's fit loop when it is ``load_state_dict``'s caller, else None. Lightning loads every
    train loader's state in ``_FitLoop._load_combined_loader_states`` (through
    ``CombinedLoader._load_state_dicts``; lightning/pytorch/loops/fit_loop.py), after restoring its own
    progress counters, which say what the loader cannot see (``_lightning_resume_at``)."""
    frame = sys._getframe(2)        # (1: load_state_dict)
    for _ in range(6):
        if frame is None:
            return None
        if frame.f_code.co_name == "_load_combined_loader_states":
            loop = frame.f_locals.get("self")
            if type(loop).__module__.startswith(("lightning.pytorch.loops", "pytorch_lightning.loops")):
                return loop
            return None
        frame = frame.f_back
    return None


def _lightning_resume_at(state: dict) -> dict:
    """A mid-epoch ``state`` as Lightning's fit loop will use it, when it is the loader's caller:
    - ``epoch_ended``: the checkpoint was taken at the epoch's last batch by Lightning's count
      (``epoch_loop.batch_progress.is_last_batch``, on which the loop's ``reset()`` counts the epoch
      done and starts the next); ``limit_train_batches`` puts that batch before the sampler's end;
    - ``batches_delivered`` lowered to the batches Lightning trained this epoch
      (``batch_progress.current.ready``) where it took more: for a loader without ``len()`` (a custom
      ``batch_sampler`` or ``sampler`` without ``__len__``) its ``_PrefetchDataFetcher`` fetches one
      batch ahead, which the checkpoint's run never trained and the resumed one starts with. Only for
      a fit with this loader alone (several are interleaved or cycled) and in-order delivery.
    Any other state, caller or Lightning version without these attributes: ``state`` unchanged."""
    loop = _lightning_fit_loop()
    if loop is None:
        return state
    try:
        progress = loop.epoch_loop.batch_progress
        if progress.is_last_batch is True:
            return dict(state, epoch_ended=True)
        trained = progress.current.ready
        alone = len(loop._combined_loader.flattened) == 1
    except (AttributeError, TypeError):
        return state
    if (alone and not state["delivered_ahead"] and type(trained) is int
            and 0 <= trained < int(state["batches_delivered"])):
        return dict(state, batches_delivered=trained)
    return state


def _distributed() -> tuple[int, int]:
    """(world size, rank) of torch.distributed, (1, 0) when it is not running (torch's
    ``_get_distributed_settings``)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _stop_pool(fin: Optional[weakref.finalize], pool: Optional[WorkerPool]) -> None:
    """Stop an iterator's ``pool`` now, from the code that ends its epoch or closes its loader: what
    its shutdown raises reaches that caller. The pool's finalizer (``shutdown_unraised``, for an
    iterator collected with its pool running) is detached first, so it never runs as well; a
    finalizer that already ran (at exit) leaves nothing to stop."""
    if fin is not None and fin.detach() is not None and pool is not None:
        pool.shutdown()


def _new_iter(core: _Core, cfg: _Config) -> _ElasticIter:
    return (_IterableIter if cfg.iterable else _MapIter)(core, cfg)


class _ElasticIter:
    """One epoch at a time over a loader (the same object is reset per epoch with persistent workers,
    as torch does). See the module docstring for the invariants.

    What both dataset kinds share lives here: epoch numbering and seeding, the worker pool, step
    timing, waiting on the pool, delivery and the end of an epoch. Which batch is where (exactly once,
    in order) is the epoch's ``Sequencer``; how batches are produced is ``_MapIter`` (a sampler's
    indices, resizable mid-epoch, re-dispatched when a worker dies) or ``_IterableIter`` (one shard per
    worker, round-robin, fixed for the epoch)."""

    def __init__(self, core: _Core, cfg: _Config) -> None:
        self._core = core
        self._cfg = cfg
        self._counters = core.counters
        self._lock = threading.RLock()
        self._pool: WorkerPool | None = None
        self._pool_finalizer = None
        self._done = True
        self._started = False
        self._runq = RunQueueClock()
        self._seq = Sequencer(cfg.in_order)
        self._shared_seed: int | None = None
        self._pg = None                 # gloo group for the DataPipe seed (torch.distributed runs)
        self._base_seed = 0
        self._base_drawn = True         # this epoch drew its base seed (False: a persistent iterator's)
        self._persistent_base: int | None = None    # base seed of torch's persistent worker iterator,
                                                    # once an epoch with workers created it
        self._pinner: PinThread | None = None       # this epoch's pin thread (``_pin_ahead``)
        self._pinner_finalizer = None
        self._pin_device_id: int | None = None
        self._first_seq = 0                         # this epoch's first batch (``_init_error_due``)
        self._init_turns: dict[int, int] = {}       # worker id -> the batch its init error stands for

    def __iter__(self):
        return self

    def __len__(self) -> int:
        return len(self._cfg.index_sampler)

    # ---- epoch start -------------------------------------------------------------------------
    def _start_epoch(self, resume: dict | None) -> None:
        cfg, core = self._cfg, self._core
        self._stop_pinning()        # a persistent iterator's abandoned epoch (not ended by _finish)
        # torch's pin thread uses the device that was current where the iterator was created
        # (``current_device_id`` in _MultiProcessingDataLoaderIter.__init__): this thread, now
        self._pin_device_id = (torch.accelerator.current_device_index()
                               if cfg.pin and cfg.pin_device is not None else None)
        with self._lock:
            if resume is not None:
                resume = self._past_spent_epoch(resume)
            self._iter_id = next(_ITER_IDS)
            with core.lock:
                if resume is not None:
                    core.next_epoch = resume["epoch"]
                self._epoch = core.epoch = core.next_epoch
                core.next_epoch += 1
                steps = core.counters.steps     # (this order: ``_Core.pass_steps``)
                core.longest_pass_steps = max(core.longest_pass_steps, steps - core.pass_start_steps)
                core.pass_start_steps = steps
            self._seq = Sequencer(cfg.in_order)
            self._error: BaseException | None = None
            self._t_last: float | None = None
            self._cpu_last = 0.0
            self._done = False
            self._started = True

            gen = cfg.generator
            user_global = None
            if resume is not None:
                if gen is not None:
                    gen.set_state(resume["rng_state"])
                else:
                    user_global = torch.get_rng_state()
                    torch.set_rng_state(resume["rng_state"])
                self._rng_state = resume["rng_state"].clone()
            else:
                self._rng_state = gen.get_state() if gen is not None else torch.get_rng_state()
            try:
                self._draw_seeds(gen, resume)
                self._begin(resume)
            finally:
                if user_global is not None:
                    torch.set_rng_state(user_global)
            self._first_seq = self._seq.delivered_below
            self._init_turns = {}
            self._start_workers()

    def _past_spent_epoch(self, resume: dict) -> dict:
        """A state whose epoch is over though its iterator did not raise ``StopIteration`` resumes as
        the start of the next epoch, with the RNG where that epoch's draws left it, as a state saved
        after the ``StopIteration`` would:
        - a map-style state saved after its epoch's last batch (Lightning's checkpoint at the last
          ``on_train_batch_end`` of an epoch: its fetcher knows the length and does not call ``next()``
          again). Resuming it as saved gave an empty epoch, which Lightning counts as the next one: a
          whole epoch lost. torchdata's StatefulDataLoader does the same (meta-pytorch/data#1437).
        - a state that the framework loading it counts as its epoch's end (``epoch_ended``, set by
          ``load_state_dict``: Lightning's ``limit_train_batches`` ends an epoch before the sampler
          does). Resumed as saved, the next epoch began with the rest of the ended one.
        The sampler is replayed as far as the state says it was drawn (``sampler_drawn``: torch's
        loader, and this one, leave an epoch with the sampler drawn that far; a ``RandomSampler``
        that ran out drew again); a state without it (older) is replayed to the sampler's end.
        Any other state, and one whose sampler has no length, is returned as it is."""
        cfg = self._cfg
        try:
            spent = (resume.get("epoch_ended", False)
                     or not cfg.iterable and int(resume["batches_delivered"]) >= len(cfg.index_sampler) > 0)
        except TypeError:
            spent = False
        if not spent:
            return resume
        gen = cfg.generator
        user_global = None
        if gen is not None:
            gen.set_state(resume["rng_state"])
        else:
            user_global = torch.get_rng_state()
            torch.set_rng_state(resume["rng_state"])
        try:
            self._draw_seeds(gen, resume)
            if not cfg.iterable:        # the sampler's draws for the spent epoch, as torch's iterator
                drawn = resume.get("sampler_drawn")
                items = iter(cfg.index_sampler)
                if drawn is None:
                    for _ in items:
                        pass
                else:
                    for _ in itertools.islice(items, int(drawn[0]) + bool(drawn[1])):
                        pass
            after = gen.get_state() if gen is not None else torch.get_rng_state()
        finally:
            if user_global is not None:
                torch.set_rng_state(user_global)
        kept = cfg.persistent and self._persistent_base is not None   # as ``DataLoader.state_dict``
        return dict(resume, epoch=int(resume["epoch"]) + 1, batches_delivered=0, delivered_ahead=[],
                    base_seed=self._persistent_base if kept else None, base_seed_drawn=not kept,
                    rng_state=after, epoch_ended=False, sampler_drawn=None)

    def _draw_seeds(self, gen, resume: dict | None) -> None:
        """Draw from the loader's generator exactly what torch's iterator draws, in its order, so the
        sampler's draws that follow (and so the batches) equal torch's (torch/utils/data/dataloader.py):

        - a new iterator (every epoch without persistent workers): an IterDataPipe's shared seed, the
          base seed, and with workers a second shared seed (``_reset(first_iter=True)``; its workers
          already got the first one);
        - a persistent iterator's later epochs (``_reset``): the shared seed only; the base seed is
          the one drawn when it was created;
        - an epoch of a persistent loader that starts with no workers (``resize(0)``, torch's
          ``num_workers = 0``): a new in-process iterator's draws; torch keeps its persistent worker
          iterator, and that iterator's base seed, for the next epoch with workers (``__iter__``).
        """
        cfg, core = self._cfg, self._core
        workers = core.target > 0
        if resume is not None:
            keep_base = resume.get("base_seed") is not None and not resume.get("base_seed_drawn", True)
            if keep_base:
                self._base_seed = resume["base_seed"]
        else:
            keep_base = cfg.persistent and workers and self._persistent_base is not None
            if keep_base:
                self._base_seed = self._persistent_base
        if cfg.iterable and cfg.datapipe:
            self._shared_seed = self._share_seed(gen)
            reseed_datapipe(cfg.dataset, self._shared_seed)
        if not keep_base:
            base_seed = int(torch.empty((), dtype=torch.int64).random_(generator=gen).item())
            if resume is not None and resume.get("base_seed") is not None:
                if resume["base_seed"] != base_seed:
                    warnings.warn("adloader: the restored RNG state does not reproduce the saved base "
                                  "seed; the sampler order may differ from the original run", stacklevel=4)
                base_seed = resume["base_seed"]
            self._base_seed = base_seed
            if cfg.iterable and cfg.datapipe and workers:
                self._share_seed(gen)
        self._base_drawn = not keep_base
        # torch's persistent worker iterator: created by the first epoch with workers, kept after; a
        # state says its base seed (``persistent_base_seed``), also from an epoch run without workers
        if cfg.persistent and resume is not None and resume.get("persistent_base_seed") is not None:
            self._persistent_base = int(resume["persistent_base_seed"])
        elif cfg.persistent and (keep_base or (workers and (self._persistent_base is None or resume is not None))):
            self._persistent_base = self._base_seed

    def _share_seed(self, gen) -> int:
        """torch's ``_share_dist_seed``: one draw from the loader's generator, broadcast from rank 0 over
        a gloo group (created once per iterator, as torch does) when torch.distributed is running."""
        seed = torch.empty((), dtype=torch.int64).random_(generator=gen)
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            if self._pg is None:
                self._pg = dist.new_group(backend="gloo")
            dist.broadcast(seed, src=0, group=self._pg)
        return int(seed.item())

    def _begin(self, resume: dict | None) -> None:
        """The kind's own epoch state (a resumed epoch's sampler is replayed here, under the restored
        RNG; an epoch with workers draws the sampler's first batch here too, as torch's iterator)."""
        raise NotImplementedError

    def _shard_in_process(self) -> None:
        """An epoch loaded in this process: a DataPipe is sharded over the ranks only, as torch's
        ``_SingleProcessDataLoaderIter`` does (workers shard their own copies)."""
        if self._cfg.datapipe:
            world_size, rank = _distributed()
            shard_datapipe(self._cfg.dataset, 1, world_size, 0, rank)

    def _start_workers(self) -> None:
        """Start (or reuse) the pool for this epoch and dispatch the first tasks."""
        raise NotImplementedError

    def _drop_workers_seeded_for_another_base(self) -> None:
        """A persistent pool whose workers were started with another base seed than this epoch's is
        stopped, so that this epoch's workers start afresh from it: ``get_worker_info().seed`` and the
        RNG ``worker_init_fn`` runs under are torch's ``base_seed + worker_id`` of the worker iterator.
        That happens when an epoch that began with no workers (its own base seed, as torch's
        in-process iterator) was resized up mid-epoch before the loader's first epoch with workers:
        torch's loader creates its persistent worker iterator, with new workers and a new base seed,
        at that next epoch (``DataLoader.__iter__``), and so does this one."""
        pool = self._pool
        if pool is None or not self._cfg.persistent or pool.spec.base_seed == self._base_seed:
            return
        self._drop_pool(pool)

    def _drop_pool(self, pool: WorkerPool) -> None:
        """Stop this iterator's persistent ``pool`` now; the next ``_ensure_pool`` starts another."""
        fin, self._pool_finalizer, self._pool = self._pool_finalizer, None, None
        with self._core.lock:           # (``_resize`` reads the set under it)
            self._core.persistent_pools.discard(pool)
        _stop_pool(fin, pool)

    def _ensure_pool(self, target: int) -> WorkerPool:
        cfg, core = self._cfg, self._core
        if self._pool is not None:
            return self._pool
        spec = WorkerSpec(
            wid=0, num_workers=core.target, base_seed=self._base_seed, dataset=cfg.dataset,
            iterable=cfg.iterable, auto_collation=cfg.auto_collation, batch_size=cfg.batch_size,
            drop_last=cfg.drop_last, collate_fn=cfg.collate_fn, worker_init_fn=cfg.worker_init_fn,
            **dict(zip(("world_size", "rank"), _distributed())))
        pool = WorkerPool(ctx=cfg.mp_context, spec=spec, target=target, max_workers=core.max_workers,
                          counters=self._counters)
        pool.describe_death = core.memory.describe_death
        self._pool = pool
        if cfg.persistent:
            core.persistent_pools.add(pool)
        # workers stop when this iterator is collected (abandoned mid-epoch, or the persistent
        # iterator together with its loader) or at interpreter exit (finalize's atexit); there an error
        # is logged (no caller to take it), at an epoch's end or close() it is raised (_stop_pool)
        self._pool_finalizer = weakref.finalize(self, pool.shutdown_unraised)
        return pool

    # ---- resize ------------------------------------------------------------------------------
    def _on_resize(self, n: int) -> Optional[str]:
        """Take the new target ``n`` into this epoch; a notice for the caller of ``resize``, else None."""
        raise NotImplementedError

    # ---- delivery ----------------------------------------------------------------------------
    def __next__(self):
        # torch's iterators name every next() in a profiler trace (_BaseDataLoaderIter.__next__,
        # torch/utils/data/dataloader.py): TensorBoard's profiler plugin and other trace tools count the
        # "enumerate(DataLoader)#...__next__" ranges as DataLoader time
        with torch.autograd.profiler.record_function(_PROFILE_NAMES[self._uses_workers()]):
            return self._next_timed()

    def _uses_workers(self) -> bool:
        """Whether this epoch's batches come from worker processes (the profiler range's name)."""
        raise NotImplementedError

    def _next_timed(self):
        t0 = time.perf_counter()
        cpu0 = time.process_time()
        c = self._counters
        c.left_t = None                          # in next(): the loop waits for data, it is not away
        if self._t_last is not None:
            # the step, and the training process's CPU during it (a pause of the loop is not compute)
            c.add_step(t0 - self._t_last, cpu0 - self._cpu_last)
        try:
            data = self._next_batch()
        except StopIteration:
            self._t_last = None
            c.left_t = time.perf_counter()
            raise
        except BaseException:
            self._t_last = c.left_t = time.perf_counter()
            self._cpu_last = time.process_time()
            c.data_wait_s += self._t_last - t0
            raise
        t1 = c.left_t = time.perf_counter()
        c.data_wait_s += t1 - t0
        c.steps += 1
        self._t_last = t1
        self._cpu_last = time.process_time()
        self._core.rates.maybe_record(t1)
        if c.steps & 15 == 1:                    # batch size in shared memory, sampled (cheap walk)
            try:
                self._core.batch_bytes = batch_nbytes(data)
            except Exception:   # noqa: BLE001 — a measurement never hurts training (a user's batch type)
                log.debug("adloader: batch size not measured", exc_info=True)
        return data

    def _next_batch(self):
        raise NotImplementedError

    def _deliver(self, ok: bool, payload, n_samples: int):
        self._counters.samples += n_samples
        if not ok:
            if isinstance(payload, RemoteError):
                payload.reraise()
            raise payload
        if self._cfg.pin:
            payload = _pin(payload, self._cfg.pin_device)
        return payload

    def _deliver_batch(self, batch: Batch):
        """Hand over a batch from a worker; called without ``self._lock`` held: it may wait for the pin
        thread (a ``resize()`` from another thread does not wait with it)."""
        r = batch.result
        if type(batch.payload) is PinJob:          # pinned ahead (``_pin_ahead``)
            self._counters.samples += r.n_samples
            return batch.payload.take()
        return self._deliver(r.ok, batch.payload, r.n_samples)

    def _pin_ahead(self, seq: int, payload) -> PinJob:
        """Start pinning batch ``seq`` on this epoch's pin thread (started here, at its first batch) as
        soon as it is received, so that the copy overlaps the training step, as torch's pin thread does.
        Only batches received and not delivered are pinned, so at most the prefetch window is pinned
        ahead (``_fill`` counts them); the thread stops with the epoch (``_finish``, ``_stop_pinning``)
        or when this iterator is collected."""
        if self._pinner is None:
            pinner = PinThread(self._cfg.pin_device, self._pin_device_id, self._cfg.in_order)
            self._pinner = pinner
            self._pinner_finalizer = weakref.finalize(self, pinner.stop)
        return self._pinner.submit(seq, payload)

    def _stop_pinning(self) -> None:
        """Stop this epoch's pin thread, if it started, and join it (the pin thread never takes
        ``self._lock``, so this may be called with it held)."""
        with self._lock:
            fin, self._pinner_finalizer, self._pinner = self._pinner_finalizer, None, None
        if fin is not None:
            fin()

    def _check(self) -> None:
        if self._done:
            raise StopIteration
        if self._error is not None:
            err, self._error = self._error, None
            self._finish()
            raise err
        pool = self._pool
        if pool is None:
            return
        fatal = pool.fatal if pool.fatal is not None else self._init_error_due(pool)
        if fatal is not None:
            self._finish()
            if isinstance(fatal, RemoteError):
                fatal.reraise()
            raise fatal

    def _init_error_due(self, pool: WorkerPool) -> RemoteError | None:
        """The error of a worker whose ``worker_init_fn`` raised, once it is that error's turn; else None.

        torch 2.13 (torch/utils/data/_utils/worker.py, ``_worker_loop``) sends a worker's init error as
        the result of the first batch that worker is given, which is batch ``w`` of the epoch for worker
        ``w`` (round-robin from worker 0, ``_try_put_index``), and raises it in order at that batch's
        turn (``_next_data``): the batches before it come first, and the worker named is the failed one
        whose first batch comes first. Here that batch is the error's turn, or the next batch to deliver
        when the error is read only after that batch was delivered (another worker made it: workers
        share one queue; a worker started mid-epoch), and the earliest turn is raised. Sooner where
        torch raises sooner, or nothing else would come: ``in_order=False`` (torch raises it as it
        arrives: the first read), or no worker left to make the batches before it. Called with
        ``self._lock`` held, before any batch is delivered, so a turn is set before it passes."""
        if not pool.init_failed:       # (the common case, on every next(): no lock taken)
            return None
        failed = pool.init_failures()
        if not self._cfg.in_order:
            return next(iter(failed.values()))
        below = self._seq.delivered_below
        for wid in failed:
            self._init_turns.setdefault(wid, max(self._first_seq + wid, below))
        turn, wid = min((self._init_turns[w], w) for w in failed)
        if turn <= below or (pool.live_workers() == 0 and self._uses_workers()):
            return failed[wid]
        return None

    def _deadline(self):
        t = self._cfg.timeout_s
        return time.monotonic() + t if t > 0 else float("inf")

    def _receive_arrived(self) -> None:
        """Take in, without waiting, the results that arrived while the caller was busy, so that the
        prefetch window counts them and refills one batch per batch taken, as torch's does (its
        ``_tasks_outstanding`` drops as each result is read). Left unread until the ready batches ran
        out, they were all received at once and a whole window was dispatched in one go: every worker
        busy at the same moment every ``prefetch_factor * workers`` steps, the training process's CPU
        part competing with them, and under a CFS quota the group throttled (measured, issue 11: a
        BERT-like job at 0.3 cores of a 0.67-core quota ran 8% slower, its trainer waiting 17 ms a step
        for a CPU instead of 5)."""
        pool = self._pool
        if pool is None:
            return
        events = pool.poll(0)
        if events:
            with self._lock:
                self._handle(events)

    def _wait(self, pool: WorkerPool | None, deadline: float) -> None:
        if pool is None:
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"DataLoader timed out after {self._cfg.timeout} seconds")
        events = pool.poll(min(_WAIT_SLICE_S, left))
        if events:
            with self._lock:
                self._handle(events)

    def _handle(self, events) -> None:
        c = self._counters
        seq = self._seq
        iter_id = self._iter_id
        for ev in events:
            kind = type(ev)
            if kind is Batch:
                r = ev.result
                c.add_batch_timing(r.cpu_s, r.wall_s, r.runq_ns)
                if r.iter_id == iter_id:
                    if self._cfg.pin and r.ok and r.seq in seq.pending:     # a worker's error is not pinned
                        ev = Batch(r, self._pin_ahead(r.seq, ev.payload))
                    seq.receive(r.seq, ev)     # refused: a duplicate
            elif kind is ShardEnd:
                if ev.iter_id == iter_id:
                    self._on_shard_end(ev.seq)
            elif kind is WorkerDied:
                if not self._done:
                    self._on_worker_death(ev)

    def _on_shard_end(self, seq: int) -> None:
        pass

    def _on_worker_death(self, ev: WorkerDied) -> None:
        raise NotImplementedError

    def _death_reason(self, ev: WorkerDied) -> str:
        """torch's words for the death, with what ``adloader.memory`` knows (memory, likely cause)."""
        how = worker_exit_reason(ev.pid, ev.exitcode)
        last = self._core.memory.last_death
        if last.startswith(f"worker pid {ev.pid}:"):
            how += f" ({last.partition(': ')[2]})"
        return how

    def _timed_local(self, fn):
        """Run ``fn()`` in this process seeded like a worker task (the caller's RNG states restored),
        counting its timing like a worker's batch."""
        t0 = time.perf_counter()
        c0 = time.process_time()
        r0 = self._runq.read_ns()
        try:
            with RngGuard():
                return fn()
        finally:
            self._counters.add_batch_timing(time.process_time() - c0, time.perf_counter() - t0,
                                            max(0, self._runq.read_ns() - r0))

    # ---- end ---------------------------------------------------------------------------------
    def _finish(self) -> None:
        """End of this epoch (exhausted, failed or abandoned): non-persistent workers stop."""
        with self._lock:
            self._done = True
            self._seq.clear()
            self._stop_pinning()        # with _done, under the lock: no batch is submitted after it
            fin = pool = None
            if not self._cfg.persistent:
                fin, pool, self._pool_finalizer, self._pool = self._pool_finalizer, self._pool, None, None
        _stop_pool(fin, pool)

    def _close(self) -> None:
        """``loader.close()``: end the epoch and stop the workers, persistent ones too."""
        self._finish()
        with self._lock:
            fin, pool, self._pool_finalizer, self._pool = self._pool_finalizer, self._pool, None, None
        _stop_pool(fin, pool)

    def _state_dict(self) -> dict:
        with self._lock:
            delivered, ahead = self._seq.state()
            return {
                "version": STATE_VERSION,
                "dataset_kind": "iterable" if self._cfg.iterable else "map",
                "epoch": self._epoch, "batches_delivered": delivered,
                "delivered_ahead": ahead,
                "base_seed": self._base_seed, "base_seed_drawn": self._base_drawn,
                "rng_source": "generator" if self._cfg.generator is not None else "global",
                "rng_state": self._rng_state.clone(),
                "sampler_drawn": self._sampler_drawn(),
                "persistent_base_seed": self._persistent_base,
            }

    def _sampler_drawn(self) -> Optional[list]:
        """``[items the sampler gave this epoch, whether it ran out]`` (map-style), else None."""
        return None


class _MapIter(_ElasticIter):
    """A map-style dataset's epochs: the sampler's batches of indices become ``Task``s in one shared
    queue; the worker count can change between any two batches; a dead worker's tasks run again."""

    # ---- epoch start -------------------------------------------------------------------------
    def _begin(self, resume: dict | None) -> None:
        if self._core.target == 0:
            self._shard_in_process()
        self._peeked: deque = deque()
        self._exhausted = False
        self._drawn = 0         # items the sampler gave this epoch (``_state_dict``: how far its RNG moved)
        self._sampler_iter = iter(self._cfg.index_sampler)
        if self._core.target == 0 and resume is None:
            # torch's in-process iterator draws the sampler's first batch at the first next(): a draw
            # from the generator in between (Lightning's on_train_epoch_start hook, with the global
            # generator) comes before the sampler's, as there
            return
        try:
            self._peeked.append(next(self._sampler_iter))   # the sampler's first draw
            self._drawn = 1
        except StopIteration:
            self._exhausted = True
        if resume is not None:
            k = int(resume["batches_delivered"])
            for _ in range(k):
                if self._pull_index() is None:
                    break
            self._seq.resume_at(k, resume.get("delivered_ahead", ()))

    def _start_workers(self) -> None:
        core = self._core
        if core.target > 0:
            self._drop_workers_seeded_for_another_base()
            pool = self._ensure_pool(core.target)
            if self._cfg.persistent:
                pool.resize(core.target)
                pool.take_queued()      # tasks of an abandoned epoch
            self._fill()

    def _uses_workers(self) -> bool:
        return self._core.target > 0

    def _sampler_drawn(self) -> Optional[list]:
        return [self._drawn, self._exhausted]

    # ---- dispatch ----------------------------------------------------------------------------
    def _pull_index(self):
        if self._peeked:
            return self._peeked.popleft()
        if self._exhausted:
            return None
        try:
            index = next(self._sampler_iter)
        except StopIteration:
            self._exhausted = True
            return None
        self._drawn += 1
        return index

    def _next_task(self) -> Task | None:
        """The next batch of the sampler as a pending task, or None when the sampler is exhausted."""
        while True:
            index = self._pull_index()
            if index is None and self._exhausted:
                return None
            seq = self._seq.issue()
            if seq is None:             # delivered before the checkpoint
                continue
            task = Task(self._iter_id, seq, task_seed(self._base_seed, self._epoch, seq), index)
            self._seq.dispatch(seq, task)
            return task

    def _fill(self) -> None:
        """Top up tasks in flight (dispatched, result not received) plus results received and not
        yet delivered to prefetch_factor * target, torch's bound (its ``_tasks_outstanding``); called
        when a batch is delivered, so a stuck head-of-line batch stops dispatch and the reorder buffer
        stays bounded (as in torch)."""
        target = self._core.target
        pool = self._pool
        if target == 0 or pool is None:
            return
        bound = self._cfg.prefetch_factor * target
        seq = self._seq
        while seq.in_flight + len(seq.ready) < bound:
            task = self._next_task()
            if task is None:
                break
            pool.submit(task)

    def _redispatch(self, tasks) -> None:
        for task in sorted(tasks, key=lambda t: t.seq):
            if self._core.target > 0 and self._pool is not None:
                self._pool.submit(task)
            else:
                self._seq.run_locally(task)

    def _on_resize(self, n: int) -> None:
        with self._lock:
            if self._done:
                return
            if n > 0:
                pool = self._ensure_pool(n)
                pool.resize(n)
                self._redispatch(self._seq.reclaim_local())
                self._fill()
            elif self._pool is not None:
                self._pool.resize(0)
                for task in self._pool.take_queued():
                    if task.iter_id == self._iter_id:
                        self._seq.run_locally(task)
            if self._pool is not None:
                self._pool.wake()

    def _on_worker_death(self, ev: WorkerDied) -> None:
        pool = self._pool
        iter_id = self._iter_id
        seq = self._seq
        # order matters: a task is either running (snapshot first), still queued, or finished
        # (results read last); only a task in none of these died with the worker
        running = {s for it, s in pool.running_tasks() if it == iter_id}
        queued = {t.seq: t for t in pool.take_queued() if t.iter_id == iter_id and t.seq in seq.pending}
        self._handle(pool.drain_results())
        lost = seq.lost(running, set(queued))
        self._counters.redispatched += len(lost)
        self._redispatch(lost + [t for s, t in queued.items() if s in seq.pending])
        log.warning("adloader: worker %d died (%s); re-dispatched %d batch(es): %s",
                    ev.wid, self._death_reason(ev), len(lost), [t.seq for t in lost][:16])

    # ---- delivery ----------------------------------------------------------------------------
    def _next_batch(self):
        deadline = None
        seq = self._seq
        self._receive_arrived()
        while True:
            with self._lock:
                self._check()
                batch = seq.take_ready()
                task = None
                if batch is not None:
                    self._fill()
                else:
                    task = self._take_local()
                    if task is None and not seq.in_flight:
                        self._fill()
                        if not seq.in_flight:
                            if self._exhausted:
                                self._finish()
                                raise StopIteration
                            task = self._take_local()
                pool = self._pool
            if batch is not None:
                return self._deliver_batch(batch)
            if task is not None:
                return self._run_local(task)
            self._wait(pool, deadline := deadline or self._deadline())

    def _take_local(self) -> Task | None:
        """A task this process should run now: one taken back from the pool, or (num_workers=0)
        the next one from the sampler."""
        task = self._seq.take_local()
        if task is not None:
            return task
        if self._core.target == 0 and (not self._cfg.in_order or self._seq.caught_up):
            return self._next_task()
        return None

    def _run_local(self, task: Task):
        cfg = self._cfg
        error = None

        def fetch():
            seed_all(task.seed)
            return fetch_map(cfg.dataset, task.index, cfg.auto_collation, cfg.collate_fn)

        try:
            data = self._timed_local(fetch)
        except Exception as e:   # num_workers=0: the caller gets the exception itself, as in torch
            error, data = e, None
        with self._lock:
            if not self._seq.complete_local(task.seq):
                return self._next_batch()         # a worker delivered it meanwhile
            self._fill()
        if error is not None:
            raise error
        return self._deliver(True, data, len(task.index) if cfg.auto_collation else 1)


class _IterableIter(_ElasticIter):
    """An IterableDataset's epochs: each worker iterates its own copy (its shard, via
    ``get_worker_info()``), asked for one batch at a time by ``ShardTask``s dispatched round-robin over
    the epoch's workers, like torch. The shard layout is fixed for the epoch: a resize waits for the
    next one, and a worker that dies mid-epoch aborts it (its shard cannot be replayed exactly once),
    unless it died before it started this epoch's shard (between epochs of a persistent loader, where
    nobody polls): that death is looked for before the epoch's first task, and a worker found dead
    later that had still answered none of this epoch's tasks and was running none has its tasks
    handed, in order, to its replacement, which iterates the whole shard."""

    # ---- epoch start -------------------------------------------------------------------------
    def _begin(self, resume: dict | None) -> None:
        cfg = self._cfg
        n = self._core.target
        self._epoch_workers = n
        self._active = [True] * n
        self._worker_of: dict[int, int] = {}
        self._next_worker = 0
        self._fetcher = None
        if n == 0:
            self._shard_in_process()
            self._fetcher = IterableFetcher(cfg.dataset, cfg.auto_collation, cfg.batch_size,
                                            cfg.collate_fn, cfg.drop_last)

    def _start_workers(self) -> None:
        n = self._epoch_workers
        if n > 0:
            self._drop_workers_seeded_for_another_base()
            self._drop_workers_set_up_for_another_count(n)
            pool = self._ensure_pool(n)
            pool.resize(n)
            # a persistent pool's worker that died between epochs is noticed (and replaced by the pool)
            # before it is handed a task of this epoch
            self._handle(pool.poll(0))
            self._fill()

    def _drop_workers_set_up_for_another_count(self, n: int) -> None:
        """A persistent pool whose workers ran ``worker_init_fn`` for another worker count is stopped,
        so that this epoch's ``n`` workers start afresh and run it for ``n``, as torch's loader with
        ``num_workers=n`` does. torch's docs shard an IterableDataset there, by
        ``get_worker_info().num_workers`` (``torch.utils.data.IterableDataset``, example 2): a worker
        kept from an epoch with another count yields its old shard, so samples came twice or never.
        Without a ``worker_init_fn`` the workers are kept (with their dataset copies, as torch's
        persistent workers are): a dataset that shards in ``__iter__`` reads the new count there."""
        pool = self._pool
        if pool is None or self._cfg.worker_init_fn is None or pool.started_for(n) <= {n}:
            return
        self._drop_pool(pool)

    def _uses_workers(self) -> bool:
        return self._epoch_workers > 0

    # ---- dispatch ----------------------------------------------------------------------------
    def _fill(self) -> None:
        """Top up tasks in flight plus batches waiting to prefetch_factor * the epoch's workers,
        round-robin over the workers whose shard has not ended, like torch."""
        pool = self._pool
        n = self._epoch_workers
        if pool is None or n == 0:
            return
        seq = self._seq
        bound = self._cfg.prefetch_factor * n
        while seq.in_flight + len(seq.ready) < bound and any(self._active):
            for _ in range(n):
                wid = self._next_worker
                self._next_worker = (wid + 1) % n
                if self._active[wid]:
                    break
            s = seq.issue()
            task = ShardTask(self._iter_id, s, task_seed(self._base_seed, self._epoch, s), n, self._shared_seed)
            self._worker_of[s] = wid
            seq.dispatch(s, task)
            if not pool.submit_to(wid, task):
                if not pool.has_worker(wid) and wid not in pool.init_failures():
                    self._error = RuntimeError(f"DataLoader worker {wid} is gone mid-epoch")
                # else it exited and a poll reports it: its tasks go to its replacement or the epoch ends;
                # or its worker_init_fn raised, which is raised at its first task's turn (``_check``)
                return

    def _on_resize(self, n: int) -> Optional[str]:
        with self._lock:
            if self._done or n == self._epoch_workers:
                return None
            msg = (f"adloader: resize({n}) on an IterableDataset takes effect at the next epoch "
                   f"(this epoch's {self._epoch_workers} worker shards are fixed)")
            if not self._core.warned_iterable_resize:
                self._core.warned_iterable_resize = True
                log.warning(msg)
                return msg      # warned by ``_resize`` once the resize is done
            # once per loader: an agent that changes its count every second (or a resize loop) logged
            # a WARNING for each directive of an endless stream's one epoch
            log.debug(msg)
            return None

    def _on_shard_end(self, s: int) -> None:
        """Worker ``w``'s shard ended at task ``s``: that task and every later one handed to ``w``
        carry no batch (``w`` answers them in order; everything before ``s`` was already received)."""
        seq = self._seq
        if s not in seq.pending:
            return
        wid = self._worker_of[s]
        self._active[wid] = False
        for later in [p for p in seq.pending if self._worker_of.get(p) == wid]:
            seq.void(later)

    def _on_worker_death(self, ev: WorkerDied) -> None:
        wid = ev.wid
        if wid >= len(self._active) or not self._active[wid]:
            return
        seq = self._seq
        handed = sorted(s for s, w in self._worker_of.items() if w == wid)
        started = (any(s not in seq.pending for s in handed)
                   or (ev.running is not None and ev.running[0] == self._iter_id))
        if not started:
            # nothing of its shard was read, by it or by us: its replacement iterates the whole shard
            pool = self._pool
            if pool is not None and pool.has_worker(wid) and all(pool.submit_to(wid, seq.pending[s]) for s in handed):
                return
            self._error = RuntimeError(
                f"DataLoader worker (pid(s) {ev.pid}) exited unexpectedly: {self._death_reason(ev)} It died "
                f"before it started its shard of this epoch of an IterableDataset and could not be replaced, "
                "so this epoch is aborted")
            return
        self._error = RuntimeError(
            f"DataLoader worker (pid(s) {ev.pid}) exited unexpectedly: "
            f"{self._death_reason(ev)} It was iterating its shard of an IterableDataset, "
            "which cannot be replayed exactly once, so this epoch is aborted (worker "
            f"{wid} is replaced for the next epoch)")

    # ---- delivery ----------------------------------------------------------------------------
    def _next_batch(self):
        deadline = None
        seq = self._seq
        self._receive_arrived()
        while True:
            with self._lock:
                self._check()
                if self._epoch_workers == 0:
                    return self._run_local()
                batch = seq.take_ready()
                self._fill()
                if batch is None and not seq.in_flight and not seq.ready:
                    self._finish()
                    raise StopIteration
                pool = self._pool
            if batch is not None:
                return self._deliver_batch(batch)
            self._wait(pool, deadline := deadline or self._deadline())

    def _run_local(self):
        s = self._seq.issue()
        seed = task_seed(self._base_seed, self._epoch, s)

        def fetch():
            seed_all(seed)
            return self._fetcher.fetch()

        try:
            data, n = self._timed_local(fetch)
        except StopIteration:
            self._finish()
            raise
        self._seq.dispatch(s, None)
        self._seq.complete_local(s)
        return self._deliver(True, data, n)
