"""Node pressure from Linux PSI (/proc/pressure/{cpu,io}), when the kernel has it, and the node's CPU
time (/proc/stat).

``read(proc_root="/proc") -> Pressure``: the ``some avg10`` figure (percent of the last 10 s in which
at least one task waited for the resource). None for a file that is absent or unreadable: PSI needs
CONFIG_PSI and may be disabled with psi=0 (Documentation/accounting/psi.rst).

``busy_cpu_s(proc_root, cpu_ids) -> float | None``: CPU seconds the given CPUs spent busy since boot
(a counter; the collector turns it into a rate). Busy is user + nice + system + irq + softirq + steal
of each ``cpuN`` line (guest time is already inside user and nice; idle and iowait are not busy),
in USER_HZ ticks (proc(5)). None when the file cannot be read or lists none of the CPUs.

``pid_stat(pid, proc_root) -> list[bytes] | None``: the fields of ``/proc/<pid>/stat`` after the command
name (index 0 is the state, field 3 of proc(5)), None if the process is gone.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from adloader.proctree import pid_stat  # noqa: F401 (re-exported: the one /proc/<pid>/stat reader)


@dataclass(frozen=True)
class Pressure:
    cpu_some_avg10: Optional[float]
    io_some_avg10: Optional[float]


def _some_avg10(path: str) -> Optional[float]:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("some "):
                    for part in line.split()[1:]:
                        k, _, v = part.partition("=")
                        if k == "avg10":
                            return float(v)
    except (OSError, ValueError):
        return None
    return None


def read(proc_root: str = "/proc") -> Pressure:
    base = os.path.join(proc_root, "pressure")
    return Pressure(_some_avg10(os.path.join(base, "cpu")), _some_avg10(os.path.join(base, "io")))


CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def busy_cpu_s(proc_root: str = "/proc", cpu_ids=()) -> Optional[float]:
    want = {f"cpu{i}" for i in cpu_ids}
    ticks, seen = 0, False
    try:
        with open(os.path.join(proc_root, "stat")) as f:
            for line in f:
                if not line.startswith("cpu") or line.startswith("cpu "):
                    continue
                parts = line.split()
                if want and parts[0] not in want:
                    continue
                v = [int(x) for x in parts[1:9]]
                if len(v) < 8:
                    v += [0] * (8 - len(v))
                ticks += v[0] + v[1] + v[2] + v[5] + v[6] + v[7]
                seen = True
    except (OSError, ValueError):
        return None
    return ticks / CLK_TCK if seen else None


