"""A job of several ranks under the real agent: each rank its own training process and loader, as a
data-parallel job runs (torchrun, Slurm tasks), beside a one-rank neighbour.

    python -m evaluation.multirank_check [--against TREE] [--reps 3] [--warmup-s 8] [--measure-s 16]
                                         [--policy adaptive] [--agent-log-level info] [--out FILE.json]

The bench's multi-GPU kinds are one process driving several GPUs; this one is R processes of one job
(``ADLOADER_JOB_ID`` shared, ``RANK`` / ``LOCAL_RANK`` / ``WORLD_SIZE`` set, one GPU each), so the agent
sees R ranks, each reporting its own loader. The ranks step in lockstep (``evaluation.jobproc
--lockstep``: a gloo all-reduce after every step, as a data-parallel job's gradient all-reduce), so
the job runs at its slowest rank's pace, as a real one does. The mix: a 2-rank job whose ranks each
need about half a core (the catalogue's ResNet-50-like kind, its trainer busy 20% of a step) and a
1-GPU AlexNet-like neighbour that would take every core it is given. Calibrated figures are the bench's on the 2-core VM
(``evaluation/results/bench_issue11_fortieth_all_baselines.json``): on another machine the ratios hold
less well than the bench's own calibration would make them.

Each phase starts the agent (``--policy``) from one source tree and the three job processes (always
this checkout's jobproc and loader: the comparison is of agents), waits ``--warmup-s``, and measures
``--measure-s``. ``--against TREE``: a checkout of other code (another commit's worktree, with the same
interpreter) whose agent's phases alternate with this tree's, repeat by repeat (ABBA order), so the two
are compared side by side. The 2-rank job's throughput is R x its slowest rank's samples/s (the ranks
are in lockstep: they agree to a step), normalised by one rank's ceiling (batch / step time), and it
counts once per GPU.

Prints, per tree, the GPU-weighted aggregate (median [range] over repeats), each job's normalised
throughput, and what the agent's status said of each job at the end (workers, cores, useful cores);
per repeat the ratio of this tree's aggregate to the other's. Writes JSON with ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from evaluation import metrics as M
from evaluation.harness import Proc, ProgressReader, child_env, query_status
from evaluation.slurm_cluster import free_port

HERE = Path(__file__).resolve().parent.parent


def _spec(kind: str, workload: str, batch_size: int, step_s: float, demand_cores: float, cpu_s_per_sample: float,
          aug_multiplier: int, trainer_cpu_frac: float, seed: int) -> dict:
    """A ``evaluation.catalog.JobSpec`` as JSON fields (no job id yet), one GPU, 2 workers by habit."""
    return {"kind": kind, "batch_size": batch_size, "step_s": step_s, "demand_cores": demand_cores,
            "cpu_s_per_sample": cpu_s_per_sample,
            "workload": {"name": workload, "num_images": 48, "length": 1048576, "image_px": 256, "crop_px": 64,
                         "aug_multiplier": aug_multiplier, "io_sleep_s": 0.0, "cost_spread": 1.0, "seed": seed},
            "samples": None, "arrival_s": 0.0, "gpus": 1, "trainer_cpu_frac": trainer_cpu_frac, "num_workers": 2,
            "worker_ram_mb": 48, "phases": []}


RANK_SPEC = _spec("resnet50[trainer_cpu_frac=0.2]", "resnet50", 64, 0.1324, 0.45, 0.000931, 1, 0.2, 101)
NEIGHBOUR_SPEC = _spec("alexnet", "alexnet", 64, 0.0659, 1.8, 0.001855, 2, 0.25, 102)
RANKS = 2


def _env(tree: Path, **extra: str) -> dict:
    env = child_env(**extra)
    env["PYTHONPATH"] = str(tree)
    return env


def imports_from(tree: Path) -> Path:
    """Where a child started as this script starts its agent and jobs (``tree``'s environment and working
    directory) imports ``agent`` from: it must be ``tree``'s own, or the comparison compares nothing."""
    out = subprocess.run([sys.executable, "-c", "import agent, os; print(os.path.dirname(agent.__file__))"],
                         env=_env(tree), cwd=tree, capture_output=True, text=True, timeout=60)
    return Path(out.stdout.strip()).resolve().parent


def run_phase(tree: Path, policy: str, warmup_s: float, measure_s: float, run_dir: Path,
              log_level: str = "info") -> dict:
    """One phase: the agent and the jobs from ``tree``; the jobs' throughput and the agent's view."""
    run_dir.mkdir(parents=True, exist_ok=True)
    sock = tempfile.mkdtemp(prefix="adl-mr-")
    endpoint = f"ipc://{sock}/agent.sock"
    agent = Proc([sys.executable, "-m", "agent", "agent", "--policy", policy, "--endpoint", endpoint,
                  "--state-dir", f"{sock}/state", "--tick-s", "1", "--loader-cpus", "auto", "--max-jobs", "8",
                  "--cgroup-mode", "v1" if os.geteuid() == 0 else "off", "--loader-memory", "off",
                  "--log-level", log_level],
                 _env(tree), run_dir / "agent.log", cwd=tree)
    procs: dict[str, tuple[Proc, ProgressReader]] = {}
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(f"{sock}/agent.sock"):
            if not agent.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the agent from {tree} did not start: {agent.log_tail()}")
            time.sleep(0.05)
        port = str(free_port())
        launches = [(f"mr-rank{r}", dict(RANK_SPEC, job_id="mr-2rank"),
                     {"ADLOADER_JOB_ID": "mr-2rank", "RANK": str(r), "LOCAL_RANK": str(r),
                      "WORLD_SIZE": str(RANKS), "CUDA_VISIBLE_DEVICES": str(r), "MASTER_ADDR": "127.0.0.1",
                      "MASTER_PORT": port}) for r in range(RANKS)]
        launches.append(("mr-neighbour", dict(NEIGHBOUR_SPEC, job_id="mr-neighbour"),
                         {"ADLOADER_JOB_ID": "mr-neighbour", "CUDA_VISIBLE_DEVICES": str(RANKS)}))
        for name, spec, extra in launches:
            prog = run_dir / f"{name}.jsonl"
            prog.unlink(missing_ok=True)
            argv = [sys.executable, "-m", "evaluation.jobproc", "--spec", json.dumps(spec), "--progress", str(prog),
                    "--workers", str(spec["num_workers"]), "--device", "emulated",
                    *(["--lockstep"] if "RANK" in extra else [])]
            procs[name] = (Proc(argv, _env(HERE, ADLOADER_ENDPOINT=endpoint, **extra), run_dir / f"{name}.log",
                                cwd=HERE), ProgressReader(prog))
        start = time.monotonic()
        while time.monotonic() < start + warmup_s + measure_s:
            time.sleep(0.5)
            for p, rd in procs.values():
                rd.poll()
                if not p.alive():
                    raise RuntimeError(f"a job process from {tree} exited: {p.log_tail()}")
        t0, t1 = start + warmup_s, start + warmup_s + measure_s
        status = query_status(_Cfg(), endpoint, run_dir) or {}
    finally:
        for p, _ in procs.values():
            p.stop()
        agent.stop()
        shutil.rmtree(sock, ignore_errors=True)     # the agent's socket and state: the run's records are in run_dir
    rates = {name: M.rate_between([r for r in rd.records if "samples" in r], "samples", t0, t1)
             for name, (_, rd) in procs.items()}
    rank_ceiling = RANK_SPEC["batch_size"] / RANK_SPEC["step_s"]
    job_norm = min(rates[f"mr-rank{r}"] for r in range(RANKS)) / rank_ceiling
    neigh_norm = rates["mr-neighbour"] / (NEIGHBOUR_SPEC["batch_size"] / NEIGHBOUR_SPEC["step_s"])
    seen = {job: {k: j.get(k) for k in ("workers", "desired_workers", "cpus", "max_useful_cores", "worker_cpu_cores",
                                      "reason")} for job, j in (status.get("jobs") or {}).items()}
    return {"tree": str(tree), "rates": rates, "job_normalised": job_norm, "neighbour_normalised": neigh_norm,
            "gpu_weighted": RANKS * job_norm + neigh_norm, "status": seen}


class _Cfg:
    """What ``query_status`` reads of a bench config: the interpreter."""
    python = sys.executable


def main(argv=None) -> int:
    from evaluation.flags import above, at_least, finite_float, names_arg, path_arg, plain_int

    ap = argparse.ArgumentParser(prog="python -m evaluation.multirank_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", type=path_arg, default=None, metavar="TREE",
                    help="a checkout of other code to compare with, phase by phase (default: none)")
    ap.add_argument("--reps", type=at_least(plain_int, 1), default=3, help="repeats per tree (default 3)")
    ap.add_argument("--warmup-s", type=above(finite_float, 0), default=8.0, help="seconds before measuring (default 8)")
    ap.add_argument("--measure-s", type=above(finite_float, 0), default=16.0, help="seconds measured (default 16)")
    ap.add_argument("--policy", type=names_arg, default="adaptive", help="the agent's policy (default adaptive)")
    ap.add_argument("--agent-log-level", choices=("debug", "info", "warning"), default="info",
                    help="the agents' log level (debug: every window the predictor got; default info)")
    ap.add_argument("--out", type=path_arg, default=None, help="write the JSON result here")
    args = ap.parse_args(argv)
    trees = {"this": HERE}
    if args.against:
        other = Path(args.against).resolve()
        if not (other / "agent" / "__main__.py").is_file():
            ap.error(f"--against {args.against}: not a checkout of this project (no agent/__main__.py)")
        trees["against"] = other
    for name, tree in trees.items():
        got = imports_from(tree)
        if got != tree:
            ap.error(f"the {name} tree {tree} imports its agent from {got}: not a comparison of the two")
    out_dir = Path(tempfile.mkdtemp(prefix="adl-mr-runs-"))
    phases: dict[str, list[dict]] = {k: [] for k in trees}
    for rep in range(args.reps):
        order = list(trees) if rep % 2 == 0 else list(reversed(trees))
        for name in order:
            print(f"rep {rep + 1}/{args.reps}: {name} ({trees[name]})", file=sys.stderr, flush=True)
            ph = run_phase(trees[name], args.policy, args.warmup_s, args.measure_s, out_dir / f"{name}-rep{rep + 1}",
                           args.agent_log_level)
            phases[name].append(ph)
            print(f"  GPU-weighted {ph['gpu_weighted']:.3f} (2-rank job {ph['job_normalised']:.3f} x {RANKS}, "
                  f"neighbour {ph['neighbour_normalised']:.3f})", file=sys.stderr, flush=True)
    print(f"| tree | GPU-weighted agg. (median [range]) | 2-rank job norm. | neighbour norm. | "
          f"agent at the end: 2-rank job workers / cores / useful cores | neighbour cores |")
    print("|---|---|---|---|---|---|")
    summary = {}
    for name, phs in phases.items():
        agg = [p["gpu_weighted"] for p in phs]
        last = phs[-1]["status"]
        mj, nb = last.get("mr-2rank", {}), last.get("mr-neighbour", {})
        summary[name] = {"median": statistics.median(agg), "min": min(agg), "max": max(agg)}
        print(f"| {name} | {statistics.median(agg):.3f} [{min(agg):.3f}-{max(agg):.3f}] | "
              f"{statistics.median(p['job_normalised'] for p in phs):.3f} | "
              f"{statistics.median(p['neighbour_normalised'] for p in phs):.3f} | "
              f"{mj.get('workers')} / {mj.get('cpus')} / {mj.get('max_useful_cores')} | {nb.get('cpus')} |")
    if "against" in phases:
        ratios = [a["gpu_weighted"] / b["gpu_weighted"] for a, b in zip(phases["this"], phases["against"])
                  if b["gpu_weighted"] > 0]
        summary["ratio"] = {"median": statistics.median(ratios), "per_repeat": ratios}
        print(f"\nthis / against, per repeat: {', '.join(f'{r:.3f}' for r in ratios)}; "
              f"median {statistics.median(ratios):.3f}")
    print(f"\nrun directories: {out_dir}")
    if args.out:
        Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "summary": summary, "phases": phases,
                                              "started": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
