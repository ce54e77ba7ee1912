"""Random nodes for the policies: snapshots no one chose, with the curves a policy would be handed.

``random_node(rng)`` -> (NodeSnapshot, curves, PolicyConfig): 2-96 CPUs, 1-8 jobs of 1-4 GPUs, CPU-light to
16x a step of worker CPU, some blocked on IO, trainers idle to busy 90% of a step, habits of 1-16
workers, some with a worker bound, a memory cost, a narrower cpuset, their steps left, no curve yet
(cold); some nodes with a loader memory budget or other tenants' CPU; one of four policy configs.
Used by tests/test_policies.py (invariants over 400 of them) and ``evaluation.hold_noise``.
"""
from __future__ import annotations

import dataclasses
import random

from agent.model import JobStats, NodeSnapshot
from agent.policies import PolicyConfig
from predictor.curve import ThroughputCurve

CONFIGS = (PolicyConfig(), PolicyConfig(fairness_floor=False), PolicyConfig(floor_reference="share"),
           PolicyConfig(cpu_weights=False))


def job(name: str, compute_s_per_step: float, cpu_s_per_batch: float, blocked_s_per_batch: float = 0.0,
        **kw) -> JobStats:
    """A job observed for one window (32 samples a batch, 100 samples/s, no data wait)."""
    fields = dict(uid=1000, ranks=1, gpus=1, batch_size=32, workers=2, requested_workers=4, max_workers=None,
                  samples_per_s=100.0, compute_s_per_step=compute_s_per_step, data_wait_s_per_step=0.0,
                  data_wait_frac=0.0, cpu_s_per_batch=cpu_s_per_batch,
                  wall_s_per_batch=cpu_s_per_batch + blocked_s_per_batch, runq_s_per_batch=0.0,
                  blocked_s_per_batch=blocked_s_per_batch, worker_cpu_cores=0.5, window_s=2.0, worker_pids=())
    fields.update(kw)
    return JobStats(job=name, **fields)


def curve_for(j: JobStats, **kw) -> ThroughputCurve:
    """The first-principles curve of what the job's window measured (``kw``: more curve fields)."""
    return ThroughputCurve(job=j.job, batch_size=j.batch_size, compute_s_per_step=j.compute_s_per_step,
                           cpu_s_per_batch=j.cpu_s_per_batch, blocked_s_per_batch=j.blocked_s_per_batch,
                           confidence=0.5, observed_configs=2, **kw)


def random_node(rng: random.Random) -> tuple[NodeSnapshot, dict, PolicyConfig]:
    ncpu = rng.choice([2, 4, 8, 16, 48, 96])
    jobs = []
    for i in range(rng.randint(1, 8)):
        g, comp = rng.choice([1, 1, 2, 4]), rng.choice([0.05, 0.1, 0.3])
        c = rng.uniform(0.005, 1.0) * comp * rng.choice([1, 4, 16])
        b = rng.choice([0.0, 0.0, 0.2 * comp])
        kw = dict(gpus=g, ranks=g, trainer_cpu_s_per_step=rng.choice([0.0, rng.uniform(0, 0.9) * comp]) * g,
                  requested_workers=rng.choice([1, 2, 4, 8, 16]), max_workers=rng.choice([None, None, 2, 8]),
                  worker_memory_bytes=rng.choice([0, 2 ** 28, 2 ** 30]),
                  steps_left=rng.choice([None, float(rng.choice([1, 50, 1000, 10000]))]))
        if rng.random() < 0.15 and ncpu > 2:
            kw["allowed_cpus"] = tuple(range(rng.randint(1, ncpu - 1)))
        jobs.append(job(f"j{i}", comp, c, b, **kw))
    if rng.random() < 0.5:      # every job says its steps: the finish guard's case
        jobs = [dataclasses.replace(j, steps_left=j.steps_left or 100.0) for j in jobs]
    extra = {}
    if rng.random() < 0.3:
        extra["loader_memory_bytes"] = float(rng.choice([2 ** 30, 4 * 2 ** 30, 16 * 2 ** 30]))
    if rng.random() < 0.3:
        extra.update(foreign_cpu_cores=rng.uniform(0, ncpu / 2), busy_cpu_cores=rng.uniform(0, ncpu))
    s = NodeSnapshot(now=0.0, loader_cpus=0.9 * ncpu, cpu_ids=tuple(range(ncpu)), jobs={j.job: j for j in jobs},
                     **extra)
    cold = [j.job for j in jobs if rng.random() < 0.15]
    curves = {j: curve_for(s.jobs[j]) for j in s.jobs if j not in cold}
    return s, curves, rng.choice(CONFIGS)
