"""The agent's decision loop with clients that lie: a real Collector, the real PredictorBank (with and
without its prior) and the adaptive policy, fed reports from random jobs, a third of which corrupt
their figures now and then (no or enormous compute, worker or trainer CPU, samples, steps, steps left; a
clock that jumps back; absurd worker counts; the memory their other loaders hold, enormous or not a
number, on nodes with a loader memory budget or none). Every tick must run without a recorded error,
every plan must stay within the node (finite cores, at least one worker, the loader CPUs in all, the
loader memory budget as the policy counts it where each rank's one worker fits), and a job that never
lies must never have its steps left refused. (This loop found the prior's None for windows that
say a job costs nothing: a TypeError on every tick.)"""
from __future__ import annotations

import json
import math
import os
import random

import pytest

from adloader.memory import NodeMemory
from agent.collector import Collector
from agent.controller import Controller
from agent.memory import MemoryGuard
from agent.policies import PolicyConfig, get_policy, held_loader_memory
from agent.registry import Registry
from agent.security import Peer
from predictor.bank import PredictorBank
from tests.fakes import RecordingActuator

pytestmark = pytest.mark.unit

COUNTERS = ("steps", "samples", "batches", "data_wait_s", "compute_s", "worker_cpu_s", "worker_wall_s",
            "worker_runq_s", "worker_blocked_s", "main_cpu_s", "main_runq_s", "uptime_s")


def _lie(rng: random.Random, st: dict, total: dict) -> None:
    r = rng.random()
    if r < 0.2:
        st["worker_cpu_s"] = rng.choice([0.0, 1e12, total["worker_cpu_s"] * 100])
    elif r < 0.4:
        st["compute_s"] = rng.choice([0.0, 1e9])
    elif r < 0.5:
        st["steps_left"] = 1e15
    elif r < 0.6:
        st["samples"] = 1e18
    elif r < 0.7:
        st["uptime_s"] = rng.choice([-1.0, 0.0, 1e9])
    elif r < 0.8:
        st["main_cpu_s"] = 1e9
    elif r < 0.9:
        st["workers"] = rng.choice([0, 10 ** 6])
    elif r < 0.95:      # steps that disagree with the samples (the window's own batch size: under one, huge)
        st["steps"] = rng.choice([total["steps"] * 1000, total["steps"] / 1000 + 1, 1e15])
    else:               # a validation loader said to hold a petabyte, or a figure that is none
        st["other_loader_memory_bytes"] = rng.choice([1e15, -5, "x", float("nan")])


def _node(rng: random.Random) -> None:
    me = os.getpid()
    reg = Registry()
    jobs = {}
    for j in range(rng.randint(1, 4)):
        spec = dict(ranks=rng.randint(1, 2), bs=rng.choice([8, 32, 128]), g=rng.uniform(0.01, 0.5),
                    c=rng.uniform(0.001, 2.0), busy=rng.uniform(0.0, 0.9), liar=rng.random() < 0.3,
                    steps=rng.choice([None, 500, 50000]), mem=rng.choice([50, 400]) << 20,
                    held=rng.choice([0, 300 << 20]))
        jobs[f"j{j}"] = spec
        for rank in range(spec["ranks"]):
            reg.hello(Peer(os.getuid(), 0, me), b"%d-%d" % (j, rank),
                      {"job": f"j{j}", "rank": rank, "pid": me, "gpus": [str(rank)], "batch_size": spec["bs"],
                       "workers": 2, "requested_workers": rng.choice([1, 4, 16])}, 0.0)
    ncpu = rng.choice([2, 8, 48])
    budget = rng.choice([None, 1 << 30, 16 << 30])
    guard = None if budget is None else MemoryGuard(budget, source=lambda: NodeMemory(64 << 30, 48 << 30))
    col = Collector(reg, loader_cpus=0.9 * ncpu, cpu_ids=tuple(range(ncpu)), memory_guard=guard)
    ctl = Controller(snapshot_source=col.snapshot, policy=get_policy("adaptive"), policy_config=PolicyConfig(),
                     predictor=PredictorBank(prior=rng.choice([None, "default"])), actuators=[RecordingActuator()])
    totals: dict = {}
    warm = 0
    for tick in range(1, rng.randint(6, 30)):
        t = float(tick)
        for job, spec in jobs.items():
            a = ctl.applied().get(job)
            w, x = (a.workers, a.cpus) if a is not None else (2, 1.0)
            # a step takes its compute or what the loader's workers and cores allow, whichever is longer
            n = max(1, int(1.0 / max(spec["g"], spec["c"] / max(0.1, min(w, x)))))
            for rank in range(spec["ranks"]):
                tot = totals.setdefault((job, rank), dict.fromkeys(COUNTERS, 0.0))
                for k, v in (("steps", n), ("batches", n), ("samples", n * spec["bs"]), ("compute_s", n * spec["g"]),
                             ("data_wait_s", max(0.0, 1.0 - n * spec["g"])), ("worker_cpu_s", n * spec["c"]),
                             ("worker_wall_s", 1.1 * n * spec["c"]), ("main_cpu_s", n * spec["g"] * spec["busy"]),
                             ("uptime_s", 1.0)):
                    tot[k] += v
                st = dict(tot, workers=w, live_workers=w, batch_size=spec["bs"], memory_workers=w,
                          worker_uss_bytes=w * spec["mem"], shm_inflight_bytes=0,
                          other_loader_memory_bytes=spec["held"])
                if spec["steps"]:
                    st["steps_left"] = max(0, spec["steps"] - int(tot["steps"]))
                if spec["liar"]:
                    _lie(rng, st, tot)
                col.on_report(job, rank, os.getpid(), st, t)
        rec = ctl.tick(t)
        assert not rec.errors, rec.errors
        node = col.snapshot(t)
        assert set(rec.plan.allocations) == set(jobs)
        total = 0.0
        for job, a in rec.plan.allocations.items():
            assert a.workers >= 1 and math.isfinite(a.cpus) and a.cpus > 0, a
            total += a.cpus
            warm += not a.cold
        assert total <= node.loader_cpus + 1e-6
        budget = node.loader_memory_bytes
        if budget is not None:       # (a liar's held memory counts up to its share: held_loader_memory)
            held = sum(held_loader_memory(node, budget).values())
            if held + sum(j.ranks * j.worker_memory_bytes for j in node.jobs.values()) <= budget:
                used = held + sum(a.workers * node.jobs[j].worker_memory_bytes for j, a in rec.plan.allocations.items())
                assert used <= budget + 1, (used, budget)
        json.dumps(rec.to_dict())                     # what the agent logs and serves
        for (job, _, _), rr in col.rank_rates.items():
            assert not rr.steps_left_refused or jobs[job]["liar"], job
    return warm


def test_the_decision_loop_survives_lying_clients():
    rng = random.Random(5)
    warm = sum(_node(rng) for _ in range(120))
    assert warm > 1000          # curves formed: the policy planned from estimates, not only cold starts
