"""Agent overhead with many clients: tick time, agent CPU, and request round-trip latency.

    python -m evaluation.agent_bench [--clients 64] [--seconds 60] [--policies adaptive,even]
                                     [--repeats 1] [--out bench-out/agent_bench.json]

For each policy: start a real `adloader agent` (tick 1 s, cgroup mode off, loader CPUs 60 so the
node is sized for 64 jobs), connect N simulated clients from this process (one DEALER each, one job
each, hello then a report every second with loader-like totals whose rates drift), wait for every
job to be allocated, then measure over --seconds:
- tick wall and CPU time (the agent's own per-tick figures over its last 60 ticks, from status: with
  the default 60 s window that is the window), and the controller's share of the wall time;
- agent CPU: the agent process's user+system CPU over the window / wall, in % of one core
  (everything: socket IO thread, message handling, ticks);
- round trips through the agent under that load, measured after the CPU window: hello -> welcome
  for a probe client (200 samples, 20 ms apart) and status -> status document (20 samples).
Then, in this process, the agent's own share of a tick without the controller (registry sweep +
collector snapshot for the same number of jobs).
Targets (issue 4): tick under 5 ms, agent under 1% of a core at a 1 s tick.
Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import psutil  # noqa: E402
import zmq  # noqa: E402

from adloader import protocol  # noqa: E402
from evaluation.flags import above, at_least, finite_float, names_arg, path_arg, plain_int  # noqa: E402


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


class SimClient:
    """One simulated training process (rank 0 of its own job)."""

    def __init__(self, ctx, endpoint: str, i: int, rng: random.Random):
        self.job = f"sim-{i:03d}"
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, protocol.client_identity(self.job, 0) + b":bench")
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.rng = rng
        self.t = 0.0
        self.tot = dict.fromkeys(("steps", "samples", "batches", "data_wait_s", "compute_s", "worker_cpu_s",
                                  "worker_wall_s", "worker_runq_s", "worker_blocked_s"), 0.0)
        self.compute = rng.uniform(0.05, 0.5)
        self.cpu = self.compute * rng.uniform(0.2, 3.0)
        self.workers = 2
        self.welcomed = False
        self.directives = 0

    def hello(self) -> None:
        self.sock.send(protocol.encode(protocol.make(
            "hello", job=self.job, rank=0, pid=os.getpid(), worker_pids=[], gpus=["0"], batch_size=32,
            workers=self.workers, requested_workers=2, max_workers=16, uid=os.getuid())))

    def report(self) -> None:
        dt = 1.0
        self.t += dt
        step = self.compute + max(0.0, self.cpu / max(1, self.workers) - self.compute) * self.rng.uniform(0.9, 1.1)
        steps = dt / step
        wait = max(0.0, step - self.compute) * steps
        for k, v in (("steps", steps), ("samples", steps * 32), ("batches", steps), ("data_wait_s", wait),
                     ("compute_s", self.compute * steps), ("worker_cpu_s", self.cpu * steps),
                     ("worker_wall_s", self.cpu * steps * 1.2), ("worker_runq_s", self.cpu * steps * 0.1),
                     ("worker_blocked_s", self.cpu * steps * 0.1)):
            self.tot[k] += v
        stats = {**{k: round(v, 6) for k, v in self.tot.items()}, "steps": int(self.tot["steps"]),
                 "samples": int(self.tot["samples"]), "batches": int(self.tot["batches"]),
                 "workers": self.workers, "max_workers": 16, "requested_workers": 2, "batch_size": 32,
                 "uptime_s": self.t, "epoch": 0}
        try:
            self.sock.send(protocol.encode(protocol.make("report", job=self.job, rank=0, pid=os.getpid(),
                                                         worker_pids=[], stats=stats)), zmq.NOBLOCK)
        except zmq.Again:
            pass

    def drain(self) -> None:
        while self.sock.poll(0):
            m = protocol.decode(self.sock.recv())
            if m["type"] == "welcome":
                self.welcomed = True
            elif m["type"] == "directive":
                self.workers = max(1, m["workers"])
                self.directives += 1


def _status(ctx, endpoint: str) -> tuple[dict, float]:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    t0 = time.perf_counter()
    s.send(protocol.encode(protocol.make("status")))
    if not s.poll(10000):
        raise RuntimeError("agent did not answer status")
    doc = json.loads(s.recv())["doc"]
    rtt = time.perf_counter() - t0
    s.close(0)
    return doc, rtt


def _pcts(xs: list[float]) -> dict:
    xs = sorted(xs)
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "p50": round(statistics.median(xs), 3), "p95": round(xs[int(0.95 * (len(xs) - 1))], 3),
            "max": round(xs[-1], 3)}


def run_one(policy: str, clients: int, seconds: float, seed: int, profile: str | None = None) -> dict:
    base = tempfile.mkdtemp(prefix="adlb")
    endpoint = f"ipc://{base}/agent.sock"
    log = open(f"{base}/agent.log", "w")
    prof = []
    if profile:   # the agent's main thread (socket handling and ticks) under cProfile, stats kept
        Path(profile).mkdir(parents=True, exist_ok=True)
        prof = ["-m", "cProfile", "-o", str(Path(profile, f"agent-{policy}-{seed}.prof"))]
    agent = subprocess.Popen([sys.executable, *prof, "-m", "agent", "agent", "--endpoint", endpoint, "--state-dir",
                              f"{base}/state", "--policy", policy, "--tick-s", "1", "--loader-cpus", "60",
                              "--max-jobs", str(clients), "--cgroup-mode", "off", "--log-level", "warning"],
                             env=_env(), stdout=log, stderr=subprocess.STDOUT)
    ctx = zmq.Context()
    sims: list[SimClient] = []
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(f"{base}/agent.sock"):
            if time.monotonic() > deadline or agent.poll() is not None:
                raise RuntimeError(f"agent did not start: {Path(base, 'agent.log').read_text()[-2000:]}")
            time.sleep(0.05)
        rng = random.Random(seed)
        sims = [SimClient(ctx, endpoint, i, rng) for i in range(clients)]
        time.sleep(0.2)
        for c in sims:
            c.hello()

        def pump(until: float) -> None:
            next_report = time.monotonic()
            while time.monotonic() < until:
                now = time.monotonic()
                if now >= next_report:
                    for c in sims:
                        if c.welcomed:
                            c.report()
                        else:
                            c.hello()
                    next_report += 1.0
                for c in sims:
                    c.drain()
                time.sleep(0.01)

        # warm up: every client welcomed and directed, the predictor has a few windows
        t_warm = time.monotonic() + 60
        while time.monotonic() < t_warm:
            pump(time.monotonic() + 1.0)
            if all(c.welcomed and c.directives for c in sims):
                break
        pump(time.monotonic() + 5.0)
        doc0, _ = _status(ctx, endpoint)
        assert len(doc0["jobs"]) == clients, f"{len(doc0['jobs'])} jobs registered, expected {clients}"
        proc = psutil.Process(agent.pid)
        c0, w0, ticks0 = proc.cpu_times(), time.monotonic(), doc0["agent"]["ticks"]
        pump(time.monotonic() + seconds)
        c1, w1 = proc.cpu_times(), time.monotonic()
        doc1, _ = _status(ctx, endpoint)
        cpu_pct = ((c1.user + c1.system) - (c0.user + c0.system)) / (w1 - w0) * 100.0
        ticks = doc1["agent"]["ticks"] - ticks0
        msgs = sum(doc1["agent"]["messages"].values()) - sum(doc0["agent"]["messages"].values())
        # latency under the same load
        probe = ctx.socket(zmq.DEALER)
        probe.setsockopt(zmq.LINGER, 0)
        probe.connect(endpoint)
        hello_rtt = []
        hello = protocol.encode(protocol.make("hello", job="probe", rank=0, pid=os.getpid(), worker_pids=[]))
        next_report = time.monotonic() + 1.0
        for _ in range(200):
            t0 = time.perf_counter()
            probe.send(hello)
            while True:
                if not probe.poll(5000):
                    raise RuntimeError("no welcome")
                if protocol.decode(probe.recv())["type"] == "welcome":
                    break
            hello_rtt.append((time.perf_counter() - t0) * 1000)
            for c in sims:
                c.drain()
            if time.monotonic() >= next_report:
                for c in sims:
                    c.report()
                next_report += 1.0
            time.sleep(0.02)
        probe.close(0)
        status_rtt = []
        for _ in range(20):
            _, rtt = _status(ctx, endpoint)
            status_rtt.append(rtt * 1000)
            pump(time.monotonic() + 0.1)
        rt = doc1["agent"]["recent_ticks"]
        assert agent.poll() is None, "agent died"
        return {"policy": policy, "clients": clients, "seconds": round(w1 - w0, 1), "ticks": ticks,
                "messages_per_s": round(msgs / (w1 - w0), 1), "agent_cpu_pct_of_core": round(cpu_pct, 3),
                "tick_wall_ms": {"n": rt["n"], "p50": rt["wall_ms_p50"], "p95": rt["wall_ms_p95"], "max": rt["wall_ms_max"]},
                "tick_cpu_ms": {"p50": rt["cpu_ms_p50"], "p95": rt["cpu_ms_p95"]},
                "controller_ms_p50": rt["controller_ms_p50"], "phases_ms_p50": rt.get("phases_ms_p50", {}),
                "hello_rtt_ms": _pcts(hello_rtt), "status_rtt_ms": _pcts(status_rtt),
                "directives_received": sum(c.directives for c in sims)}
    finally:
        for c in sims:
            c.sock.close(0)
        ctx.term()
        if agent.poll() is None:
            agent.terminate()
            try:
                agent.wait(15)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait()
        log.close()
        shutil.rmtree(base, ignore_errors=True)


def collector_only(clients: int, ticks: int = 200) -> dict:
    """The agent's own share of a tick without the controller: registry sweep (a /proc read per
    rank) + collector snapshot (rates -> JobStats, PSI, NVML probe), in this process, for ``clients``
    jobs with fresh reports each tick. Wall and CPU (thread) milliseconds per tick."""
    from agent.collector import Collector
    from agent.nvml import GpuSampler
    from agent.registry import Registry
    from agent.security import Peer

    import logging

    logging.getLogger("agent").setLevel(logging.ERROR)    # "no NVIDIA driver" is expected here
    reg = Registry()
    col = Collector(reg, loader_cpus=60.0, cpu_ids=tuple(range(os.cpu_count() or 1)), gpu_sampler=GpuSampler())
    me = os.getpid()
    rng = random.Random(7)
    for i in range(clients):
        reg.hello(Peer(os.getuid(), 0, me), b"c%d" % i, {"job": f"sim-{i}", "rank": 0, "pid": me, "gpus": ["0"],
                                                         "batch_size": 32, "workers": 2}, 0.0)
    walls, cpus = [], []
    for t in range(1, ticks + 1):
        for i in range(clients):
            up = float(t)
            reg.jobs[f"sim-{i}"].ranks[0].last_seen = up     # what Registry.report does on arrival
            col.on_report(f"sim-{i}", 0, me, {"uptime_s": up, "steps": 10 * t, "samples": 320 * t, "batches": 10 * t,
                                              "data_wait_s": 0.2 * up * rng.uniform(0.9, 1.1), "compute_s": 0.8 * up,
                                              "worker_cpu_s": 0.5 * up, "worker_wall_s": up, "worker_runq_s": 0.1 * up,
                                              "worker_blocked_s": 0.1 * up}, up)
        w0, c0 = time.perf_counter(), time.thread_time()
        reg.sweep(float(t))
        col.snapshot(float(t))
        walls.append((time.perf_counter() - w0) * 1000)
        cpus.append((time.thread_time() - c0) * 1000)
    assert len(reg.jobs) == clients and len(col.last.jobs) == clients
    return {"clients": clients, "ticks": ticks, "wall_ms": _pcts(walls), "cpu_ms": _pcts(cpus)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m evaluation.agent_bench", description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=at_least(plain_int, 1), default=64, help="simulated clients, one job each (default 64)")
    ap.add_argument("--seconds", type=above(finite_float, 0), default=60.0, help="measured window per policy (default 60)")
    ap.add_argument("--policies", type=names_arg, default="adaptive,even", help="agent policies, comma-separated (default adaptive,even)")
    ap.add_argument("--repeats", type=at_least(plain_int, 1), default=1, help="runs of each policy (default 1)")
    ap.add_argument("--seed", type=plain_int, default=1, help="clients' seed of the first repeat (repeat r uses seed + r)")
    ap.add_argument("--out", type=path_arg, default="bench-out/agent_bench.json",
                    help="write the JSON result here (default bench-out/agent_bench.json)")
    ap.add_argument("--profile", type=path_arg, metavar="DIR", help="run the agent under cProfile and write its stats to DIR "
                    "(figures then include the profiler's overhead: for finding hot spots, not for reporting)")
    args = ap.parse_args(argv)
    from agent.policies import POLICIES

    bad = [p for p in args.policies.split(",") if p not in POLICIES]
    if bad:   # (refused by the first agent it started, as a traceback)
        ap.error(f"--policies: unknown {', '.join(map(repr, bad))}; choose from: {', '.join(sorted(POLICIES))}")
    rows = []
    for rep in range(args.repeats):
        for policy in args.policies.split(","):
            r = run_one(policy, args.clients, args.seconds, seed=args.seed + rep, profile=args.profile)
            r["repeat"] = rep + 1
            rows.append(r)
            print(f"  {policy} repeat {rep + 1}: tick p50 {r['tick_wall_ms']['p50']} ms, agent {r['agent_cpu_pct_of_core']}% "
                  f"of a core", file=sys.stderr)
    own = collector_only(args.clients)
    load = os.getloadavg()
    out = {"collector_only": own, "command": "python -m evaluation.agent_bench " + " ".join(sys.argv[1:] if argv is None else argv),
           "cpus": os.cpu_count(), "loadavg_1m_end": round(load[0], 2), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    hdr = ("policy", "clients", "rep", "tick p50 ms", "tick p95 ms", "tick CPU p50 ms", "controller p50 ms",
           "snapshot/predict/policy/apply p50 ms",
           "agent %core", "msgs/s",
           "hello RTT p50/p95 ms", "status RTT p50/p95 ms")
    print(" | ".join(hdr))
    print(" | ".join("---" for _ in hdr))
    for r in rows:
        print(" | ".join(str(x) for x in (
            r["policy"], r["clients"], r["repeat"], r["tick_wall_ms"]["p50"], r["tick_wall_ms"]["p95"],
            r["tick_cpu_ms"]["p50"], r["controller_ms_p50"],
            "/".join(str(r["phases_ms_p50"].get(k, "-")) for k in ("snapshot", "predict", "policy", "apply")),
            r["agent_cpu_pct_of_core"], r["messages_per_s"],
            f"{r['hello_rtt_ms']['p50']}/{r['hello_rtt_ms']['p95']}",
            f"{r['status_rtt_ms']['p50']}/{r['status_rtt_ms']['p95']}")))
    print(f"agent's own share of a tick (registry sweep + collector snapshot, {own['clients']} jobs, in-process, "
          f"{own['ticks']} ticks): wall p50 {own['wall_ms']['p50']} ms p95 {own['wall_ms']['p95']} ms, "
          f"CPU p50 {own['cpu_ms']['p50']} ms")
    print(f"(wrote {args.out}; 1-minute load average at the end: {load[0]:.1f} on {os.cpu_count()} CPUs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
