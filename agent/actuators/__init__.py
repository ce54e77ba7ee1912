"""Actuators: what turns a desired ``JobAllocation`` into the system's state, one narrow interface each.

    class Actuator(Protocol):
        name: str
        def apply(self, job: JobStats, desired: JobAllocation) -> ApplyResult: ...
        def release(self, job_id: str) -> None: ...      # job left: remove what we made for it
        def restore(self) -> None: ...                   # agent stops: put back every original value

Only the controller calls them, and only with the difference between desired and applied state.
An actuator never raises out of ``apply``: failures come back as ``ApplyResult(ok=False, error=...)``.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from agent.model import ApplyResult, JobAllocation, JobStats


@runtime_checkable
class Actuator(Protocol):
    name: str

    def apply(self, job: JobStats, desired: JobAllocation) -> ApplyResult: ...

    def release(self, job_id: str) -> None: ...

    def restore(self) -> None: ...


from agent.actuators.directive import DirectiveActuator  # noqa: E402  (re-exported)

MODES = ("auto", "v1", "v2", "cooperative", "off")
CPU_KNOBS = ("shares", "quota", "cpuset")


def build(mode: str, *, sink, cgroup_root: str = "/sys/fs/cgroup", cpu_knob: str = "shares",
          io: bool = True, subtree: str = "adloader") -> list:
    """The actuators for a cgroup mode; the directive actuator (worker counts) always comes first.

    ``off``: worker counts only. (The cgroup modes land with the cgroup actuators.)
    """
    if mode not in MODES:
        raise ValueError(f"unknown cgroup mode {mode!r}; choose one of: {', '.join(MODES)}")
    if cpu_knob not in CPU_KNOBS:
        raise ValueError(f"unknown cpu_knob {cpu_knob!r}; choose one of: {', '.join(CPU_KNOBS)}")
    actuators: list = [DirectiveActuator(sink)]
    if mode == "off":
        return actuators
    raise NotImplementedError(f"cgroup mode {mode!r} is not available in this build yet; use mode='off'")
