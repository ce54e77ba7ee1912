"""The CPU mask a loader worker runs on: the training process's, whichever thread started the worker.

Linux keeps a CPU mask per thread: ``os.sched_setaffinity(0, ...)`` (what a training script calls to
pin itself) sets the calling thread's mask only (sched_setaffinity(2): "pid 0 ... the calling thread"),
a thread created later inherits its creator's mask, and a new process inherits the mask of the thread
that forked it. So what a worker inherits depends on where it comes from: ``fork`` and ``spawn``, the
thread that started it (the main thread at ``iter()``, a user's thread calling ``resize()``, the
autotune thread, the agent client's thread, the pool's reaper starting a replacement); ``forkserver``,
the fork server process, whatever mask it was created with. None of these need be the mask the script
set on itself.

So the pool reads the training process's mask, its main thread's (``training_cpu_mask``: the main
thread's id is the pid), each time it starts a worker, and the worker gets it twice over:

- the pool sets it on the new process (``take_cpu_mask(mask, pid)``) before the worker's pid is
  published (``WorkerPool.worker_pids``, which the agent client reports): whatever the node agent
  then does to a worker's affinity (cooperative mode) comes after, and the original it records is
  this mask;
- the worker sets it on itself first thing (``adloader._worker.worker_main``), before
  ``worker_init_fn``, unless the pool already did (a flag per worker in shared memory): a worker that
  runs ahead of the pool's call still starts its own code with the mask, and one that reaches its
  code late (spawn, forkserver: after imports and unpickling the dataset) never overwrites what the
  agent set in the meantime (the only window left is between the worker's reading that flag and its
  own call, two system calls, against a report and an agent tick).

Neither raises: a mask that cannot be read or set (not Linux, a CPU outside the cpuset of a fork
server in another cgroup) is logged at debug and the worker keeps the mask it inherited. Stdlib only.
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger("adloader")


def training_cpu_mask() -> frozenset[int] | None:
    """The CPU mask of this process's main thread (the training process's), or None if unreadable."""
    try:
        return frozenset(os.sched_getaffinity(os.getpid()))
    except (AttributeError, OSError) as e:
        log.debug("adloader: the training process's CPU mask cannot be read: %s", e)
        return None


def take_cpu_mask(mask: frozenset[int] | None, pid: int = 0) -> None:
    """Give process ``pid`` (0: the calling thread) the CPU mask ``mask``; None: leave it. Never raises."""
    if not mask:
        return
    try:
        if os.sched_getaffinity(pid) != mask:
            os.sched_setaffinity(pid, mask)
    except (AttributeError, OSError) as e:
        log.debug("adloader: CPU mask %s not set on %s: %s", sorted(mask), pid or "this worker", e)
