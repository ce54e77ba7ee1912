"""Worker count (and the CPU figure it was sized for) sent to the job's clients as a directive.

The sink is the agent's server: ``send_directive(job_id, workers, cpus, cpuset, reason) -> bool``,
True when at least one rank of the job was sent it. Nothing to restore on stop: a client whose agent
goes away keeps its last worker count (the loader's own autotune may take over again).
"""
from __future__ import annotations

from agent.model import ApplyResult, JobAllocation, JobStats


class DirectiveActuator:
    name = "directive"
    tracks_pids = False

    def __init__(self, sink) -> None:
        self._sink = sink

    def apply(self, job: JobStats, desired: JobAllocation) -> ApplyResult:
        try:
            sent = self._sink.send_directive(
                job.job, int(desired.workers), float(desired.cpus),
                list(desired.cpuset) if desired.cpuset else None, desired.reason)
        except Exception as e:   # noqa: BLE001 — never raise out of apply
            return ApplyResult(job=job.job, ok=False, applied=None,
                               error=f"directive to job {job.job!r} failed: {type(e).__name__}: {e}")
        if not sent:
            return ApplyResult(job=job.job, ok=False, applied=None,
                               error=f"directive to job {job.job!r} reached no rank (no connected client)")
        return ApplyResult(job=job.job, ok=True, applied=desired)

    def release(self, job_id: str) -> None:
        pass

    def restore(self) -> None:
        pass
