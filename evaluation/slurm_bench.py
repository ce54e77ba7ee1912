"""Prolog and epilog wall times under a real Slurm, with the agent up, down and hung (SIGSTOP).

    python -m evaluation.slurm_bench [--repeats N] [--out DIR]

Starts the Slurm tier's single-node cluster (``evaluation.slurm_cluster``; root and Debian's slurmctld,
slurmd, slurm-client and munge needed), the agent as root from a config file on a non-default endpoint,
and for each condition runs N short ``sbatch`` jobs (the DataLoader training loop as uid 65534, 2 s)
one after another. A job's prolog (epilog) time is the wall time from the first to the last program of
the ``Prolog=`` (``Epilog=``) glob, our script between them. Also times one ``agent.jobprocs.find_jobs``
scan of this machine's /proc (what the agent does once per ``unseen_job_timeout_s`` while a registered
job has no rank). Prints a table and writes ``slurm_bench.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from evaluation.slurm_cluster import Cluster, terminate, wait_for, why_not
from evaluation.flags import at_least, path_arg, plain_int


def _agent(cluster: Cluster) -> subprocess.Popen:
    endpoint = f"ipc://{cluster.dir}/run/agent.sock"
    cluster.agent_config.write_text(f'endpoint = "{endpoint}"\nstate_dir = "{cluster.dir}/state"\n'
                                    'policy = "even"\ntick_s = 0.25\ncgroup_mode = "off"\n')
    cluster.agent_config.chmod(0o644)
    log = open(cluster.dir / "log" / "agent.log", "a")
    p = subprocess.Popen([sys.executable, "-m", "agent", "agent", "--config", str(cluster.agent_config)],
                         stdout=log, stderr=subprocess.STDOUT)
    wait_for(lambda: (cluster.dir / "run" / "agent.sock").exists() or p.poll() is not None, 60, what="the agent")
    return p


def _spread(xs: list[float]) -> dict:
    return {"median": round(statistics.median(xs), 3), "min": round(min(xs), 3), "max": round(max(xs), 3), "n": len(xs)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m evaluation.slurm_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=at_least(plain_int, 1), default=3, help="sbatch jobs per condition (default 3)")
    ap.add_argument("--out", type=path_arg, default="bench-out/slurm",
                    help="directory slurm_bench.json is written to (default bench-out/slurm)")
    args = ap.parse_args(argv)
    why = why_not()
    if why:
        print(f"slurm_bench: cannot run: {why}", file=sys.stderr)
        return 2
    from agent import jobprocs

    scans = []
    for _ in range(20):
        t0 = time.perf_counter()
        jobprocs.find_jobs({"999999999": 65534, "999999998": 1000})
        scans.append((time.perf_counter() - t0) * 1000)
    nproc = sum(1 for n in os.listdir("/proc") if n.isdigit())

    cluster = Cluster()
    agent = None
    rows: dict[str, dict] = {}
    try:
        cluster.start()
        agent = _agent(cluster)
        for cond in ("up", "down", "hung"):
            if cond == "down":
                agent.send_signal(signal.SIGTERM)
                agent.wait(30)
            if cond == "hung":
                agent = _agent(cluster)
                agent.send_signal(signal.SIGSTOP)
            pro, epi = [], []
            for i in range(args.repeats):
                job = cluster.submit(f"bench-{cond}-{i}", max_s=2)
                job.wait_done(180)
                pro.append(cluster.hook_seconds(job.id, "prolog"))
                epi.append(cluster.hook_seconds(job.id, "epilog"))
            rows[cond] = {"prolog_s": _spread(pro), "epilog_s": _spread(epi), "node_state": cluster.node_state()}
            if cond == "hung":
                agent.send_signal(signal.SIGCONT)
    finally:
        if agent is not None:
            terminate(agent, 30)
        cluster.stop()

    doc = {"date": time.strftime("%Y-%m-%d"), "host_cpus": os.cpu_count(), "repeats": args.repeats, "conditions": rows,
           "proc_scan_ms": _spread(scans), "processes": nproc}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "slurm_bench.json").write_text(json.dumps(doc, indent=2))
    print(f"{'agent':6} {'prolog s (median [min-max])':30} {'epilog s (median [min-max])':30} node")
    for cond, r in rows.items():
        p, e = r["prolog_s"], r["epilog_s"]
        print(f"{cond:6} {p['median']:.3f} [{p['min']:.3f}-{p['max']:.3f}]{'':12} "
              f"{e['median']:.3f} [{e['min']:.3f}-{e['max']:.3f}]{'':12} {r['node_state']}")
    s = doc["proc_scan_ms"]
    print(f"/proc scan for registered jobs: {s['median']:.1f} ms [{s['min']:.1f}-{s['max']:.1f}] over {nproc} processes")
    print(f"wrote {out / 'slurm_bench.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
