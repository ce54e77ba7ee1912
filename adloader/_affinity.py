"""The CPU affinity that worker processes start with, for the loader's own background threads.

Linux keeps a CPU mask per thread: ``os.sched_setaffinity(0, ...)`` (what a training script calls to
pin itself) sets the calling thread's mask only (sched_setaffinity(2): "pid 0 ... the calling thread"),
a thread created later inherits its creator's mask, and a worker process is forked from the thread
that starts it and inherits that thread's mask. So a thread of ours that starts workers (the
autotune thread, the agent client's directive thread) gives itself the main thread's mask first, or
the workers it starts run on the CPUs the process had when that thread was created. Stdlib only: the
agent client imports this without torch.
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger("adloader")


def follow_process_affinity() -> None:
    """Give the calling thread the CPU affinity of its process's main thread (the training process's;
    its thread id is the pid), before it starts worker processes. Never raises."""
    try:
        mask = os.sched_getaffinity(os.getpid())
        if os.sched_getaffinity(0) != mask:
            os.sched_setaffinity(0, mask)
    except (AttributeError, OSError) as e:
        log.debug("adloader: affinity not followed: %s", e)
