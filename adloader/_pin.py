"""Pinning batches for ``pin_memory=True``: torch's own ``pin_memory()``, and the thread that runs it
ahead of the training thread for batches that come from workers.

torch's multiprocessing iterator pins in a background thread (``_pin_memory_loop`` in
torch/utils/data/_utils/pin_memory.py, started in ``_MultiProcessingDataLoaderIter.__init__``,
torch/utils/data/dataloader.py), so on a GPU node a large batch's copy into page-locked memory (tens
of ms for a 150 MB image batch) overlaps the training step instead of adding to the data wait. Without
workers torch pins inline at ``next()`` (``_SingleProcessDataLoaderIter._next_data``), and so does the
loader.

Invariants of ``PinThread`` (one per epoch of an iterator that pins, started at its first batch):
- every job submitted is pinned at most once, on the pin thread only, and its result (the pinned
  batch, or the error as torch's ``ExceptionWrapper``) is taken at most once, by ``PinJob.take``;
- it holds only the jobs not pinned yet; a pinned job holds the pinned batch and no longer the
  worker's copy. The caller bounds the number of jobs (the loader: the batches received and not yet
  delivered, within the prefetch window), so pinning ahead adds no batches in memory beyond that window;
- with ``in_order`` the lowest seq waiting is pinned first (the next one ``next()`` returns, also when
  a re-run batch arrives late), otherwise the first to arrive;
- it holds no reference to the iterator: an iterator dropped mid-epoch is collected, and its
  finalizer stops the thread; ``stop()`` ends and joins it (idempotent), and a ``take`` waiting on a
  job it did not pin raises ``StopIteration`` (the epoch was ended, e.g. by ``close()`` from another thread).
"""
from __future__ import annotations

import logging
import threading

import torch
from torch._utils import ExceptionWrapper

log = logging.getLogger("adloader")

# How long stop() waits for the pin thread to finish the copy it is in (one batch's pin takes tens of
# ms; torch's ``_shutdown_workers`` joins its pin thread without a bound, a close() here never hangs).
STOP_WAIT_S = 5.0
_CHECK_S = 1.0          # longest single wait in take() before checking that the thread is alive


def pin_batch(data, device=None):
    """Pin a batch as torch's DataLoader does, with torch's own ``pin_memory``
    (torch/utils/data/_utils/pin_memory.py, what its pin thread and single-process iterator call): an
    object with its own ``pin_memory()`` pins itself (a TensorDict, a mapping, is not rebuilt), a
    mutable mapping or sequence is copied and updated so that its type and extra state survive (a
    defaultdict's factory, transformers' ``BatchEncoding``), a tuple keeps its type. A walk of our own
    had rebuilt each container from its items and lost all three."""
    from torch.utils.data._utils.pin_memory import pin_memory

    return pin_memory(data, device)


class PinJob:
    """One batch handed to a ``PinThread``: the worker's copy until it is pinned, then the pinned one."""

    __slots__ = ("data", "error", "done", "pinner")

    def __init__(self, data, pinner: "PinThread") -> None:
        self.data = data
        self.error: ExceptionWrapper | None = None
        self.done = False
        self.pinner = pinner

    def take(self):
        """The pinned batch, once the pin thread has it (raises what pinning raised, as torch does)."""
        return self.pinner.take(self)


class PinThread:
    """Pins submitted batches on one daemon thread (see the module docstring)."""

    def __init__(self, device: str | None, device_id: int | None, in_order: bool) -> None:
        self._device = device           # torch's ``_pin_memory_device``: the accelerator's type
        self._device_id = device_id     # the creating thread's current device index (torch's ``device_id``)
        self._in_order = in_order
        self._cond = threading.Condition()
        self._waiting: dict[int, PinJob] = {}     # seq -> job, not pinned yet, in arrival order
        self._stopped = False
        self._thread: threading.Thread | None = None

    def submit(self, seq: int, data) -> PinJob:
        """Queue batch ``seq`` to be pinned; the thread starts with the first one."""
        job = PinJob(data, self)
        with self._cond:
            if self._stopped:
                raise RuntimeError("adloader: batch submitted to a stopped pin thread")
            self._waiting[seq] = job
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="adloader-pin", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return job

    def take(self, job: PinJob):
        with self._cond:
            while not job.done:
                if self._stopped:
                    raise StopIteration
                if not self._thread.is_alive():     # torch's words (_MultiProcessingDataLoaderIter._get_data)
                    raise RuntimeError("Pin memory thread exited unexpectedly")
                self._cond.wait(_CHECK_S)
            data, error, job.data, job.error = job.data, job.error, None, None
        if error is not None:
            error.reraise()
        return data

    def stop(self, timeout_s: float = STOP_WAIT_S) -> None:
        """End the thread (after the copy it is in) and join it; drop what was not pinned. Idempotent."""
        with self._cond:
            self._stopped = True
            self._waiting.clear()
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
            if thread.is_alive():
                log.warning("adloader: the pin thread is still copying a batch after %.0f s; left to finish "
                            "on its own (a daemon thread)", timeout_s)

    # ---- the thread --------------------------------------------------------------------------
    def _run(self) -> None:
        setup_error = None
        try:
            # as torch's _pin_memory_loop (torch/utils/data/_utils/pin_memory.py): one intra-op thread
            # ("prevents the copy in pin_memory from consuming all CPU cores"; thread-local), and the
            # device that was current in the thread that created the iterator
            torch.set_num_threads(1)
            if self._device_id is not None:
                torch.accelerator.set_device_index(self._device_id)
        except Exception:   # noqa: BLE001 — raised at each batch's next(), with its cause (torch's thread
            # dies there, and its iterator says only "Pin memory thread exited unexpectedly")
            setup_error = ExceptionWrapper(where=f"in pin memory thread for device {self._device_id}")
        while True:
            with self._cond:
                while not self._waiting and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                seq = min(self._waiting) if self._in_order else next(iter(self._waiting))
                job = self._waiting.pop(seq)
            self._pin(job, setup_error)
            del job     # keep nothing of one batch while waiting for the next (as torch's loop does)

    def _pin(self, job: PinJob, setup_error: ExceptionWrapper | None) -> None:
        data, error = None, setup_error
        if error is None:
            try:
                data = pin_batch(job.data, self._device)
            except Exception:   # noqa: BLE001 — raised in the training thread at this batch's next()
                error = ExceptionWrapper(where=f"in pin memory thread for device {self._device_id}")
        with self._cond:
            job.data, job.error, job.done = data, error, True
            self._cond.notify_all()
