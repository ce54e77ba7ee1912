"""How the agent and the loader's own tuner behave on training loops unlike the bench's steady ones.

    python -m evaluation.workload_audit [--scenarios a,b,...] [--seconds 400] [--warmup 60] [--seed 1]
                                        [--release-away-s 10] [--out DIR]

Each scenario is a job under test (``x``) beside a CPU-hungry neighbour on an 8-CPU node (7.2 loader
cores), both simulated event by event in simulated time: a training loop whose step i takes
``step(i)`` (plus a pause before it, where the scenario has one), batch i costs a worker ``cpu(i)``
CPU seconds and ``blocked(i)`` seconds of waiting, its workers share the cores the agent gave the job,
and two batches per worker are in flight. What the agent sees is what a real loader would report: the
loop's totals are kept by the tree's own ``adloader.stats.LoaderCounters`` (so its pause rule is the
one measured), reported once a second into the real ``agent.registry.Registry`` and
``agent.collector.Collector``, and the real ``agent.controller.Controller`` with the ``adaptive``
policy and a ``predictor.bank.PredictorBank`` decides each tick; its allocation is in force at once
(a new worker starts 0.3 s later). No /proc, cgroup or socket is touched, and no clock is read:
a run is deterministic for its seed.

Per scenario, for the job under test, after the warm-up: re-plans (ticks at which its allocation,
workers or cores, changed), worker-count changes, samples/s, the median workers and cores it was
given; the windows the predictor was fed and how many of them were fed while the loop stood still (a
stop of 5 s or more between two steps, from 5 s after the stop to the resume: a window there is
made of figures that only decay); the neighbour's samples/s and worker-count changes (a loop away from
its loader for ``release_away_s`` lends it its cores). A change of a job's cores re-times its batches
in flight from then on (``TrainingLoop._retime``). Then the same job alone under ``num_workers="auto"`` (the loader's
own tuner, ``adloader.autotune.AutoTuner``, 4 CPUs, no agent), fed its 2-s windows as the loader's
tuner thread does: its moves (worker-count changes after the warm-up), final workers, samples/s.

Scenarios (``x``'s step 0.1 s, 0.2 s CPU and 0.02 s blocked per batch unless said):
    steady      nothing moves
    lognormal   step and CPU per batch lognormal (sigma 0.8 and 0.5) around those means
    validation  every 300 steps (~30 s) an 8-s validation pause, every 1200 a 25-s checkpoint
    gradaccum   gradient accumulation: every 4th step 0.25 s, the others 0.05 s
    gpubound    0.3-s step, 0.02 s CPU per batch, started with 4 workers
    shift       CPU per batch 0.05 s -> 0.3 s at t = 120 s
    slowdisk    blocked per batch 0.01 s -> 0.4 s at t = 120 s
    fast        4-ms step, 8 ms CPU per batch of 8 samples
    slow        4-s step, 6 s CPU per batch
    paused      the loop stands still for 150 s at step 1000 (~100 s)

What it cannot show: the real processes' costs (a worker's start-up, the training process's own CPU
beyond a fixed 0.01 s a step, contention beyond a fair share of the job's cores, memory), the kernel's
scheduling, or a real loader's report timing; it shows what the agent's and the tuner's decisions do
with figures shaped like these loops', not the throughput a real node would get.
"""
from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

from adloader import autotune, protocol
from adloader.stats import LoaderCounters
from agent.collector import Collector
from agent.controller import Controller
from agent.model import ApplyResult
from agent.policies import PolicyConfig, get_policy
from agent.registry import Registry
from agent.security import Peer
from evaluation.flags import at_least, comma_list, finite_float, path_arg, plain_int
from predictor.bank import PredictorBank

UNDER_TEST = "x"            # the job whose figures the table gives; its neighbour is "hungry"
NODE_CPUS = 8
LOADER_CPUS = 7.2
TICK_S = 1.0                # the agent's tick and each job's report period
OBSERVE_INTERVAL_S = 3.0
WORKER_START_S = 0.3        # a new worker takes its first batch this long after it was asked for
TRAINER_CPU_S = 0.01        # the training process's CPU per step
STALL_S = 5.0               # a stop between two steps this long is one the predictor should not be fed
STALL_GRACE_S = 5.0         # ... from this long after its start (the window due then may end at its last step)
TUNER_CPUS = 4.0

Draw = Callable[[int, float, random.Random], float]    # (step or batch index, sim time, rng) -> seconds


def const(v: float) -> Draw:
    return lambda i, t, rng: v


def lognormal(mean: float, sigma: float) -> Draw:
    mu = math.log(mean) - sigma * sigma / 2
    return lambda i, t, rng: rng.lognormvariate(mu, sigma)


class TrainingLoop:
    """One job's training loop on a loader, event by event in simulated time.

    Step i asks for batch i ``pause(i) + step(i)`` after batch i-1 was returned; batch i is dispatched
    to the worker free first once batch i - 2 x workers was taken (two in flight per worker), and costs
    ``cpu(i)`` CPU seconds and ``blocked(i)`` seconds of waiting; the busy workers share the job's
    cores (a worker's CPU time stretches by workers x its busy fraction / cores where that exceeds 1,
    the stretch counted as run-queue delay). Totals go through ``LoaderCounters`` as the loader's do.
    ``advance(t)`` and ``report(t)`` move forward only (t never decreases)."""

    def __init__(self, name: str, step: Draw, cpu: Draw, blocked: Draw, *,
                 pause: Callable[[int], float] = lambda i: 0.0, batch_size: int = 32, workers: int = 2,
                 seed: int = 1) -> None:
        self.name, self.step, self.cpu, self.blocked, self.pause = name, step, cpu, blocked, pause
        self.batch_size, self.workers, self.cores = batch_size, workers, float(workers)
        self.rng = random.Random(seed)
        self.free = [0.0] * workers        # when each worker is free
        self.req: list[float] = []         # when next() was called for batch i
        self.ret: list[float] = []         # when next() returned batch i
        self.ready: list[tuple] = []       # batch i: (ready at, cpu s, wall s, run-queue s)
        self._next_req: Optional[float] = None   # the pending next() call, drawn once
        self._done: list[tuple[float, int]] = []  # batches not yet counted: (ready at, index), a heap
        self.counters = LoaderCounters()
        self._n_req = self._n_ret = 0      # next() calls and returns counted into the totals

    def set_alloc(self, workers: int, cores: float, t: float) -> None:
        cores = max(0.05, cores)
        if workers > self.workers:
            self.free += [t + WORKER_START_S] * (workers - self.workers)
        elif workers < self.workers:
            self.free = sorted(self.free)[:workers]
        if cores != self.cores:
            self._retime(t, cores)
        self.workers, self.cores = workers, cores

    def _retime(self, t: float, cores: float) -> None:
        """The batches in flight at ``t`` finish at the new cores' pace from ``t`` on: the CPU part of what
        is left of each runs ``old share / new share`` as long (a batch started on a job's least cores
        while it was away from its loader would otherwise keep that pace to its end, long after the
        agent gave the cores back). A next() waiting for such a batch returns when it is ready."""
        for k, (ready_at, i) in enumerate(self._done):
            _, c, wall, runq = self.ready[i]
            cpu_wall = c + runq                      # its CPU part: c / the old share
            if ready_at <= t or c <= 0 or wall <= 0:
                continue
            blocked = max(0.0, wall - cpu_wall)
            busy = self.workers * c / (c + blocked)
            new_cpu_wall = c / min(1.0, cores / busy)
            left = ready_at - t
            new_ready = t + left * (blocked + new_cpu_wall) / wall
            for j, f in enumerate(self.free):
                if f == ready_at:
                    self.free[j] = new_ready
                    break
            self._done[k] = (new_ready, i)
            new_wall = new_ready - (ready_at - wall)
            self.ready[i] = (new_ready, c, new_wall, max(0.0, new_wall - c - blocked))
            if i < len(self.ret) and self.ret[i] > t:
                self.ret[i] = max(self.req[i], new_ready)
                if i == len(self.ret) - 1:
                    self._next_req = None            # drawn from the old return: drawn again
        heapq.heapify(self._done)

    def _dispatch(self, i: int) -> tuple:
        k = i - 2 * self.workers
        gate = self.ret[k] if k >= 0 else 0.0
        j = min(range(len(self.free)), key=lambda x: self.free[x])
        start = max(self.free[j], gate)
        c, b = self.cpu(i, start, self.rng), self.blocked(i, start, self.rng)
        busy = self.workers * c / (c + b) if c + b > 0 else 0.0
        share = min(1.0, self.cores / busy) if busy > 0 else 1.0
        wall = c / share + b
        self.free[j] = start + wall
        heapq.heappush(self._done, (start + wall, i))
        return (start + wall, c, wall, c / share - c)

    def advance(self, t: float) -> None:
        """Run the loop until its next call of next() lies past ``t``."""
        while True:
            i = len(self.ret)
            if self._next_req is None:
                last = self.ret[-1] if self.ret else 0.0
                self._next_req = last + self.pause(i) + self.step(i, last, self.rng)
            if self._next_req > t:
                return
            treq, self._next_req = self._next_req, None
            if len(self.ready) <= i:
                self.ready.append(self._dispatch(i))
            self.req.append(treq)
            self.ret.append(max(treq, self.ready[i][0]))

    def report(self, t: float) -> dict:
        """The loader's totals at ``t`` (its ``stats()`` fields that the agent reads)."""
        c = self.counters
        while self._n_req < len(self.req) and self.req[self._n_req] <= t:
            if self._n_req > 0:      # the time between two next() calls: a step, or a step and a pause
                c.add_step(self.req[self._n_req] - self.ret[self._n_req - 1], TRAINER_CPU_S)
            self._n_req += 1
        while self._n_ret < len(self.ret) and self.ret[self._n_ret] <= t:
            c.data_wait_s += self.ret[self._n_ret] - self.req[self._n_ret]
            c.steps += 1
            c.samples += self.batch_size
            self._n_ret += 1
        while self._done and self._done[0][0] <= t:
            _, i = heapq.heappop(self._done)
            _, cpu, wall, runq = self.ready[i]
            c.add_batch_timing(cpu, wall, int(runq * 1e9))
        # away: out of next() since its last return (0 inside a call: its batch is not ready yet)
        away = t - self.ret[-1] if self.ret and self.ret[-1] <= t else 0.0
        return {"steps": c.steps, "samples": c.samples, "batches": c.batches, "data_wait_s": c.data_wait_s,
                "compute_s": c.compute_s, "worker_cpu_s": c.worker_cpu_s, "worker_wall_s": c.worker_wall_s,
                "worker_runq_s": c.worker_runq_s, "worker_blocked_s": c.worker_blocked_s, "uptime_s": t,
                "batch_size": self.batch_size, "workers": self.workers, "live_workers": self.workers,
                "main_cpu_s": c.step_cpu_s, "main_runq_s": 0.0, "paused_s": c.paused_s, "away_s": away,
                "dataset_kind": "map"}

    def stalls(self, t_end: float) -> list[tuple[float, float]]:
        """(from, to): the stops of ``STALL_S`` or more between two returns of next(), up to ``t_end``
        (a stop still going at the end runs to it)."""
        out = [(a, b) for a, b in zip(self.ret, self.ret[1:]) if b - a >= STALL_S and a < t_end]
        if self.ret and t_end - self.ret[-1] >= STALL_S:
            out.append((self.ret[-1], t_end))
        return out


def _hungry(seed: int) -> TrainingLoop:
    return TrainingLoop("hungry", const(0.1), const(0.6), const(0.0), workers=2, seed=seed + 1)


def _x(seed: int, step: Draw = const(0.1), cpu: Draw = const(0.2), blocked: Draw = const(0.02), **kw) -> TrainingLoop:
    return TrainingLoop(UNDER_TEST, step, cpu, blocked, seed=seed, **kw)


def _validation_pause(i: int) -> float:
    if i == 0 or i % 300:
        return 0.0
    return 25.0 if i % 1200 == 0 else 8.0


SCENARIOS: dict[str, Callable[[int], TrainingLoop]] = {
    "steady": lambda s: _x(s),
    "lognormal": lambda s: _x(s, step=lognormal(0.1, 0.8), cpu=lognormal(0.2, 0.5)),
    "validation": lambda s: _x(s, pause=_validation_pause),
    "gradaccum": lambda s: _x(s, step=lambda i, t, r: 0.25 if i % 4 == 3 else 0.05),
    "gpubound": lambda s: _x(s, step=const(0.3), cpu=const(0.02), blocked=const(0.0), workers=4),
    "shift": lambda s: _x(s, cpu=lambda i, t, r: 0.05 if t < 120 else 0.3, blocked=const(0.01)),
    "slowdisk": lambda s: _x(s, cpu=const(0.05), blocked=lambda i, t, r: 0.01 if t < 120 else 0.4),
    "fast": lambda s: _x(s, step=const(0.004), cpu=const(0.008), blocked=const(0.0), batch_size=8),
    "slow": lambda s: _x(s, step=const(4.0), cpu=const(6.0), blocked=const(0.0)),
    "paused": lambda s: _x(s, pause=lambda i: 150.0 if i == 1000 else 0.0),
}


class InForceActuator:
    """The node side of an apply: the allocation is in force at once (the loop reads the controller's
    applied allocations after each tick). Called on the tick's thread."""
    name = "sim"
    tracks_pids = False
    may_block = False

    def apply(self, job, desired):
        return ApplyResult(job=job.job, ok=True, applied=desired)

    def release(self, job_id) -> None:
        pass

    def restore(self) -> None:
        pass


class FedBank(PredictorBank):
    """The agent's predictor bank, noting when each window was fed: (tick time, job, samples/s)."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.fed: list[tuple[float, str, float]] = []

    def observe(self, job_id, obs) -> None:
        self.fed.append((self.now, job_id, obs.samples_per_s))
        super().observe(job_id, obs)


def run_agent(scenario: str, seconds: float, warmup: float, seed: int,
              config: Optional[PolicyConfig] = None) -> dict:
    """The job under test beside the hungry one under the agent's real pieces; its figures."""
    jobs = {j.name: j for j in (SCENARIOS[scenario](seed), _hungry(seed))}
    reg = Registry()
    me = os.getpid()        # a live pid for the registry's checks; nothing reads its figures (below)
    peer = Peer(os.getuid(), 0, me)
    bank = FedBank()
    with tempfile.TemporaryDirectory(prefix="workload_audit-") as empty:
        # proc_root: an empty folder, so that no figure of this machine (node CPU, PSI) enters a plan
        col = Collector(reg, loader_cpus=LOADER_CPUS, cpu_ids=tuple(range(NODE_CPUS)), proc_root=empty,
                        own_cpu_s=lambda: 0.0)

        def snapshot(now):
            s = col.snapshot(now)
            return dataclasses.replace(s, jobs={k: dataclasses.replace(v, allowed_cpus=()) for k, v in s.jobs.items()})

        ctl = Controller(snapshot_source=snapshot, policy=get_policy("adaptive"),
                         policy_config=config or PolicyConfig(),
                         predictor=bank, actuators=[InForceActuator()], observe_interval_s=OBSERVE_INTERVAL_S)
        for j in jobs.values():
            reg.hello(peer, j.name.encode(), protocol.make(
                "hello", job=j.name, rank=0, pid=me, gpus=["0"], batch_size=j.batch_size, workers=j.workers,
                requested_workers=j.workers, max_workers=64, dataset_kind="map"), 0.0)
        given: list[tuple[float, int, float]] = []     # the job under test: (t, workers, cores) after each tick
        given_n: list[tuple[float, int]] = []          # its neighbour: (t, workers)
        errors: list[str] = []
        at_warmup = None
        t = 0.0
        while t < seconds - 1e-9:
            t += TICK_S
            for name, j in jobs.items():
                j.advance(t)
                st = j.report(t)
                r = reg.report(name.encode(), peer, protocol.make("report", job=name, rank=0, pid=me,
                                                                  worker_pids=[], stats=st), t)
                col.on_report(r.job, r.rank, r.pid, st, t)
            if at_warmup is None and t >= warmup:
                at_warmup = {name: j.counters.samples for name, j in jobs.items()}
            bank.now = t
            errors += ctl.tick(t + 0.01).errors
            for name, a in ctl.applied().items():
                j = jobs[name]
                if a.workers != j.workers or abs(a.cpus - j.cores) > 0.01:
                    j.set_alloc(a.workers, a.cpus, t)
            a = ctl.applied().get(UNDER_TEST)
            if a is not None:
                given.append((t, a.workers, round(a.cpus, 2)))
            a = ctl.applied().get("hungry")
            if a is not None:
                given_n.append((t, a.workers))
    x, hungry = jobs[UNDER_TEST], jobs["hungry"]
    at_warmup = at_warmup or {}
    after = [g for g in given if g[0] > warmup]
    replans = sum(1 for p, q in zip(given, given[1:]) if q[0] > warmup and p[1:] != q[1:])
    worker_changes = sum(1 for p, q in zip(given, given[1:]) if q[0] > warmup and p[1] != q[1])
    fed = [f for f in bank.fed if f[1] == UNDER_TEST]
    stalls = x.stalls(seconds)
    in_stalls = [f for f in fed if any(a + STALL_GRACE_S <= f[0] < b for a, b in stalls)]
    return {"replans": replans, "worker_changes": worker_changes,
            "samples_per_s": round((x.counters.samples - at_warmup.get(x.name, 0)) / max(seconds - warmup, 1e-9), 1),
            "neighbour_worker_changes": sum(1 for p, q in zip(given_n, given_n[1:]) if q[0] > warmup and p[1] != q[1]),
            "neighbour_samples_per_s": round((hungry.counters.samples - at_warmup.get(hungry.name, 0))
                                             / max(seconds - warmup, 1e-9), 1),
            "median_workers": statistics.median(g[1] for g in after) if after else None,
            "median_cores": round(statistics.median(g[2] for g in after), 2) if after else None,
            "windows": len(fed), "windows_in_stalls": len(in_stalls),
            "windows_in_stalls_at": [f[0] for f in in_stalls],
            "stalls": [(round(a, 2), round(b, 2)) for a, b in stalls],
            "allocations": [g for p, g in zip([None] + given, given) if p is None or p[1:] != g[1:]],
            "errors": errors}


def run_tuner(scenario: str, seconds: float, warmup: float, seed: int, cpus: float = TUNER_CPUS) -> dict:
    """The job under test alone under ``num_workers="auto"``, fed as the loader's tuner thread feeds it
    (``adloader.autotune._Thread.run``); its figures."""
    job = SCENARIOS[scenario](seed)
    start = int(cpus)
    job.set_alloc(start, cpus, 0.0)
    tuner = autotune.AutoTuner(cpus=cpus, cap=autotune.worker_cap(cpus, None), current=start)
    moves: list[tuple[float, int]] = []
    t, prev, at_warmup = 0.0, None, None
    while t < seconds - 1e-9:
        t += autotune.WINDOW_S
        job.advance(t)
        cur = job.report(t)
        if at_warmup is None and t >= warmup:
            at_warmup = cur["samples"]
        if prev is not None:
            obs = autotune.observation_from_totals(prev, cur, cpus)
            step_cpu = autotune.trainer_cpu_s_per_step(prev, cur)
            if step_cpu is not None:
                old = tuner.trainer_cpu_s_per_step
                tuner.trainer_cpu_s_per_step = step_cpu if old <= 0 else old + (step_cpu - old) / 3.0
            span = cur["uptime_s"] - prev["uptime_s"]
            tuner.cpu_used = (cur["worker_cpu_s"] - prev["worker_cpu_s"] + cur["main_cpu_s"] - prev["main_cpu_s"]) / span
            tuner.current = job.workers
            want = tuner.window(obs)
            if want is not None:
                moves.append((t, want))
                job.set_alloc(want, cpus, t)
        prev = cur
    return {"moves": sum(1 for m in moves if m[0] > warmup), "moves_at": moves, "final_workers": job.workers,
            "samples_per_s": round((job.counters.samples - (at_warmup or 0)) / max(seconds - warmup, 1e-9), 1)}


def markdown(result: dict) -> str:
    lines = [f"job `{UNDER_TEST}` beside a CPU-hungry one, {result['seconds']:g} s simulated, figures after "
             f"{result['warmup']:g} s (seed {result['seed']}); tuner: `{UNDER_TEST}` alone, {TUNER_CPUS:g} CPUs",
             "",
             "| scenario | re-plans | worker changes | samples/s | median workers | median cores | windows "
             "(in stalls) | neighbour samples/s | neighbour worker changes | tuner moves | tuner workers | "
             "tuner samples/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in result["scenarios"].items():
        a, u = r["agent"], r["tuner"]
        lines.append(f"| {name} | {a['replans']} | {a['worker_changes']} | {a['samples_per_s']:.1f} | "
                     f"{a['median_workers']} | {a['median_cores']} | {a['windows']} ({a['windows_in_stalls']}) | "
                     f"{a['neighbour_samples_per_s']:.1f} | {a['neighbour_worker_changes']} | "
                     f"{u['moves']} | {u['final_workers']} | {u['samples_per_s']:.1f} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m evaluation.workload_audit", description=__doc__.split("\n\n")[0])
    p.add_argument("--scenarios", type=comma_list(str), default=",".join(SCENARIOS),
                   help=f"scenarios to run, comma-separated (default all: {','.join(SCENARIOS)})")
    p.add_argument("--seconds", type=at_least(finite_float, 10), default=400.0,
                   help="simulated seconds per scenario (at least 10; default 400)")
    p.add_argument("--warmup", type=at_least(finite_float, 0), default=60.0,
                   help="simulated seconds left out of the figures (default 60)")
    p.add_argument("--seed", type=plain_int, default=1, help="the jobs' random seed (default 1)")
    p.add_argument("--release-away-s", type=at_least(finite_float, 0), default=PolicyConfig().release_away_s,
                   help="the agent's release_away_s: a loop away from its loader this long is planned its least "
                        f"cores until it steps again; 0: never (default {PolicyConfig().release_away_s:g})")
    p.add_argument("--out", type=path_arg, help="write workload_audit.json into this directory")
    args = p.parse_args(argv)
    unknown = [s for s in args.scenarios if s not in SCENARIOS]
    if unknown:
        p.error(f"--scenarios: unknown {', '.join(map(repr, unknown))}; choose from: {', '.join(SCENARIOS)}")
    if args.warmup >= args.seconds:
        p.error(f"--warmup ({args.warmup:g}) must be below --seconds ({args.seconds:g})")
    t0 = time.perf_counter()
    result = {"benchmark": "workload_audit", "seconds": args.seconds, "warmup": args.warmup, "seed": args.seed,
              "release_away_s": args.release_away_s, "scenarios": {}}
    config = PolicyConfig(release_away_s=args.release_away_s)
    for name in args.scenarios:
        result["scenarios"][name] = {"agent": run_agent(name, args.seconds, args.warmup, args.seed, config),
                                     "tuner": run_tuner(name, args.seconds, args.warmup, args.seed)}
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    result["argv"] = sys.argv
    print(markdown(result))
    errors = {n: r["agent"]["errors"] for n, r in result["scenarios"].items() if r["agent"]["errors"]}
    if errors:
        print(f"controller errors: {errors}", file=sys.stderr)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        path = Path(args.out) / "workload_audit.json"
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
