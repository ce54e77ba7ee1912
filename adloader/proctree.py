"""The CPU a training process and every process it started have used: the job's own CPU, however it
spends it.

A training process's CPU is not only its loop's and its A-Dloader loaders' workers'. A plain
``torch.utils.data.DataLoader`` for validation, torch.compile's compile workers, a process that writes
checkpoints, a tokenizer's process pool are its descendants too; counted by loader, the client left
them out, and the agent read their CPU as other tenants' load (its loaders yielded the node to the
job's own validation pass). ``tree_cpu_s`` counts:

- this process's CPU, every thread (``time.process_time``);
- what the children it has reaped used, theirs and their own reaped children's (``os.times``:
  ``children_user`` + ``children_system``);
- every live descendant's CPU, its own and its reaped children's (``/proc/<pid>/stat`` fields 14-17).

A child's CPU moves from the live sum to the reaped one when its parent reaps it, all of it: the total
does not fall. It falls only where a descendant leaves the tree unreaped (a daemon that forked twice
and was adopted by init): the agent reads a counter that went down as 0 for that report
(``predictor.observation.counter_deltas``). The reaped part is read first, so that a child reaped
during the walk is missed for one report rather than counted twice.

Descendants come from ``/proc/<pid>/task/<tid>/children`` of each thread (a child belongs to the thread
that forked it), a few small reads a process; a kernel without those files (``CONFIG_PROC_CHILDREN``
off) is served by psutil, which reads every process's parent on the node. Nothing here raises: a
process that ends meanwhile is skipped.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Optional

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01
_children_files: Optional[bool] = None      # whether the kernel has /proc/<pid>/task/<tid>/children


def _has_children_files() -> bool:
    global _children_files
    if _children_files is None:
        _children_files = os.path.exists(f"/proc/self/task/{threading.get_native_id()}/children")
    return _children_files


def _children(pid: int) -> list[int]:
    """The children of ``pid`` from its threads' ``children`` files ([] where it is gone)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    out: list[int] = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                out.extend(int(x) for x in f.read().split())
        except (OSError, ValueError):      # the thread ended meanwhile
            continue
    return out


def descendants(pid: Optional[int] = None) -> list[int]:
    """The live descendants of ``pid`` (this process by default), parents before their children; []
    where it has none or is gone."""
    pid = os.getpid() if pid is None else pid
    if not _has_children_files():
        try:
            import psutil

            return [p.pid for p in psutil.Process(pid).children(recursive=True)]
        except Exception:   # noqa: BLE001 — psutil.Error, or no psutil: nothing to count
            return []
    out: list[int] = []
    seen = {pid}
    todo = [pid]
    while todo:
        for child in _children(todo.pop()):
            if child not in seen:
                seen.add(child)
                out.append(child)
                todo.append(child)
    return out


def pid_stat(pid: int, proc_root: str = "/proc") -> Optional[list[bytes]]:
    """``/proc/<pid>/stat`` from field 3 (state) on: ``[0]`` state, ``[1]`` parent pid, ``[11]`` utime,
    ``[12]`` stime, ``[13]`` cutime, ``[14]`` cstime, ``[19]`` start time (clock ticks since boot). The
    command name may hold spaces and parentheses: split at the last ')' (proc(5)). None if gone or
    unreadable. (The agent reads it too: ``agent.psi.pid_stat``.)"""
    try:
        with open(f"{proc_root}/{pid}/stat", "rb") as f:
            data = f.read()
        return data[data.rindex(b")") + 2:].split()
    except (OSError, ValueError):
        return None


def process_cpu_s(pid: int) -> Optional[float]:
    """``pid``'s CPU, its own (every thread) and its reaped children's (``/proc/<pid>/stat`` utime, stime,
    cutime, cstime), in seconds; None where it is gone or unreadable."""
    fields = pid_stat(pid)
    try:
        return sum(int(x) for x in fields[11:15]) * _TICK_S if fields is not None else None
    except ValueError:
        return None


def tree_cpu_s() -> float:
    """The CPU seconds this process and every process it started have used (module docstring)."""
    t = os.times()
    total = time.process_time() + t.children_user + t.children_system
    for pid in descendants():
        total += process_cpu_s(pid) or 0.0
    return total
