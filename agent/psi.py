"""Node pressure from Linux PSI (/proc/pressure/{cpu,io}), when the kernel has it.

``read(proc_root="/proc") -> Pressure``: the ``some avg10`` figure (percent of the last 10 s in which
at least one task waited for the resource). None for a file that is absent or unreadable: PSI needs
CONFIG_PSI and may be disabled with psi=0 (Documentation/accounting/psi.rst).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional


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
