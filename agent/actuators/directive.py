"""Worker count (and the CPU figure it was sized for) sent to the job's clients as a directive.

The sink is the agent's server: ``send_directive(job_id, workers, cpus, cpuset, reason) -> bool``,
True when at least one rank of the job was sent it. The server keeps the job's last directive and
sends it to every rank that says hello later, so a False (no rank connected yet, e.g. a job the
Slurm prolog registered before its training started) is not a failure: the result is ok and says
"not delivered yet" in ``not_enforced``. Only an exception from the sink is a failure.

Observe-only allocations (``enforce_cpu=False``, the ``none`` policy) whose worker count is what the
job runs already send nothing: the job keeps its own num_workers (and its own autotune, if any).

``tracks_ranks = True``: the controller calls it again when the job's training processes change (a
rank joined, left, or was restarted by torchrun), even where the job's count did not: the count is the
job's, all its ranks' together, and each rank is sent its part (``agent.server.rank_directive``), so a
2-rank job planned 4 that lost a rank ran 2 while its plan (and ``adloader status``) said 4, for as long
as the plan held; and a rank that joined between plans kept the part it was welcomed with.

Nothing to restore on stop: a client whose agent goes away keeps its last worker count.

``may_block = False``: the controller calls it on the tick's own thread, not on an actuator lane
(``agent.controller.ActuatorLane``): its sink is the server, whose ZMQ socket and registry belong to the
service loop's thread, and its sends never block (``zmq.NOBLOCK``).
"""
from __future__ import annotations

from agent.model import ApplyResult, JobAllocation, JobStats


class DirectiveActuator:
    name = "directive"
    tracks_pids = False
    tracks_ranks = True
    may_block = False

    def __init__(self, sink) -> None:
        self._sink = sink

    def apply(self, job: JobStats, desired: JobAllocation) -> ApplyResult:
        if not desired.enforce_cpu and desired.workers == job.workers:
            return ApplyResult(job=job.job, ok=True, applied=desired)
        try:
            sent = self._sink.send_directive(
                job.job, int(desired.workers), float(desired.cpus),
                list(desired.cpuset) if desired.cpuset else None, desired.reason)
        except Exception as e:   # noqa: BLE001 — never raise out of apply
            return ApplyResult(job=job.job, ok=False, applied=None,
                               error=f"directive to job {job.job!r} failed: {type(e).__name__}: {e}")
        if not sent:
            return ApplyResult(job=job.job, ok=True, applied=desired,
                               not_enforced=(f"workers: directive to job {job.job!r} not delivered yet "
                                             "(no rank connected); the server resends it at the rank's hello",))
        return ApplyResult(job=job.job, ok=True, applied=desired)

    def release(self, job_id: str) -> None:
        pass

    def restore(self) -> None:
        pass
