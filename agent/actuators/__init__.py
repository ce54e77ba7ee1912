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
