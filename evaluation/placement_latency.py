"""How soon the agent places a job's new loader workers in the job's group (a command, not a test).

    sudo python -m evaluation.placement_latency [--tree NAME=DIR ...] [--passes 12] [--rounds 2] [--out F.json]

A real agent (``--cgroup-mode v1``, its default policy and 1-s tick) and a real training process: an
``adloader.DataLoader`` for training (one worker) and torch's own ``DataLoader`` for validation (one
worker, started afresh at every pass, as torch does without ``persistent_workers``). Each pass the
script writes the moment it called ``iter()`` on the validation loader and its worker's pid; this
command polls the job's v1 cpu group (``cgroup.procs``, every 10 ms) and records when the pid appears
there. Until then the worker runs in the training process's group, at its priority, outside the
job's plan. Reported per tree: the seconds from ``iter()`` to placed, median and range over every pass
of every round, and the passes whose worker was never placed (the pass lasts 3 s).

Each ``--tree NAME=DIR`` is a checkout (``git worktree add DIR REV``) whose agent and client run (the
default: this one). Trees run one after the other in rounds whose order alternates, so a load swing
on a shared machine hits both alike. Needs root and a writable cgroup v1 cpu hierarchy (it says why
not and exits 2). Writes JSON; prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from evaluation.flags import at_least, path_arg, plain_int
from evaluation.slurm_cluster import terminate

PASS_S = 3.0

TRAINER = r'''
import json, sys, time
import torch.utils.data as tud
from adloader import DataLoader

out, passes, pass_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])


class Slow(tud.Dataset):
    def __len__(self):
        return 10 ** 7

    def __getitem__(self, i):
        time.sleep(0.002)
        return i


train = DataLoader(list(range(10 ** 7)), batch_size=4, num_workers=1)
it = iter(train)


def train_for(s):
    end = time.monotonic() + s
    while time.monotonic() < end:
        next(it)
        time.sleep(0.01)


train_for(3.0)                    # hello, welcome, the first reports: the job is known and placed
val = tud.DataLoader(Slow(), batch_size=2, num_workers=1)
with open(out, "w") as f:
    for p in range(passes):
        t0 = time.monotonic()
        vit = iter(val)               # torch starts the pass's worker here
        f.write(json.dumps({"pass": p, "pid": vit._workers[0].pid, "t_iter": t0}) + "\n")
        f.flush()
        end = t0 + pass_s
        while time.monotonic() < end:
            next(vit)
        vit._shutdown_workers()
        del vit
        train_for(1.5)
'''


def _cpu_mount() -> str | None:
    from agent import cgroupfs

    if os.geteuid() != 0:
        return None
    if cgroupfs.v1_controller_available("/sys/fs/cgroup", "cpu"):
        return None
    return cgroupfs.v1_mount("/sys/fs/cgroup", "cpu")


def _procs(group: str) -> set[int]:
    try:
        with open(f"{group}/cgroup.procs") as f:
            return {int(x) for x in f.read().split()}
    except OSError:
        return set()


def run_tree(name: str, tree: str, passes: int, cpu_mount: str) -> dict:
    """One agent and one training process from ``tree``; the seconds to placement of each pass's worker."""
    base = tempfile.mkdtemp(prefix="adlpl")
    os.chmod(base, 0o755)
    job = f"adlpl-{os.getpid()}-{time.monotonic_ns() % 10 ** 6}"
    group = f"{cpu_mount}/adloader/{job}"
    env = {**os.environ, "PYTHONPATH": tree}
    endpoint = f"ipc://{base}/agent.sock"
    agent_log = open(f"{base}/agent.log", "w")
    agent = subprocess.Popen([sys.executable, "-m", "agent.cli", "agent", "--endpoint", endpoint, "--state-dir",
                              f"{base}/state", "--cgroup-mode", "v1", "--tick-s", "1.0"],
                             cwd=tree, env=env, stdout=agent_log, stderr=subprocess.STDOUT)
    trainer = None
    seen: dict[int, float] = {}
    rows: list[dict] = []
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(f"{base}/agent.sock"):
            if agent.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the agent of tree {name} did not start: see {base}/agent.log")
            time.sleep(0.05)
        with open(f"{base}/trainer.py", "w") as f:
            f.write(TRAINER)
        out = f"{base}/passes.jsonl"
        trainer = subprocess.Popen([sys.executable, f"{base}/trainer.py", out, str(passes), str(PASS_S)], cwd=tree,
                                   env={**env, "ADLOADER_ENDPOINT": endpoint, "ADLOADER_JOB_ID": job},
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while trainer.poll() is None:
            now = time.monotonic()
            for pid in _procs(group):
                seen.setdefault(pid, now)
            time.sleep(0.01)
        if trainer.returncode != 0:
            raise RuntimeError(f"the training process of tree {name} exited with {trainer.returncode}")
        with open(out) as f:
            for line in f:
                r = json.loads(line)
                t = seen.get(r["pid"])
                rows.append({**r, "placed_s": None if t is None else round(t - r["t_iter"], 4)})
    finally:
        for p in (trainer, agent):
            if p is not None:
                terminate(p)
        agent_log.close()
        deadline = time.monotonic() + 15
        while os.path.isdir(group) and time.monotonic() < deadline:
            if not _procs(group):
                try:
                    os.rmdir(group)
                except OSError:
                    pass
            time.sleep(0.1)
        shutil.rmtree(base, ignore_errors=True)
    return {"tree": name, "passes": rows}


def summarize(runs: list[dict]) -> dict:
    """Per tree: the seconds to placement over every pass of every round."""
    out: dict[str, dict] = {}
    for run in runs:
        d = out.setdefault(run["tree"], {"placed_s": [], "never": 0, "passes": 0})
        for r in run["passes"]:
            d["passes"] += 1
            if r["placed_s"] is None:
                d["never"] += 1
            else:
                d["placed_s"].append(r["placed_s"])
    for d in out.values():
        xs = d["placed_s"]
        d["median_s"] = statistics.median(xs) if xs else None
        d["range_s"] = [min(xs), max(xs)] if xs else None
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m evaluation.placement_latency", description=__doc__.split("\n")[0])
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                    help="a checkout to run the agent and client from (repeat; default: this one)")
    ap.add_argument("--passes", type=at_least(plain_int, 1), default=12,
                    help="validation passes per run (default 12)")
    ap.add_argument("--rounds", type=at_least(plain_int, 1), default=2,
                    help="runs per tree, the order alternating (default 2)")
    ap.add_argument("--out", type=path_arg, default="placement_latency.json", help="JSON written here")
    a = ap.parse_args(argv)
    trees = []
    for t in a.tree or [f"this={os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}"]:
        name, sep, path = t.partition("=")
        if not sep or not name or not all(os.path.isdir(os.path.join(path, d)) for d in ("agent", "adloader")):
            ap.error(f"--tree {t!r}: expected NAME=DIR, DIR a checkout holding agent/ and adloader/")
        if name in {n for n, _ in trees}:
            ap.error(f"--tree {t!r}: the name {name!r} is given twice")
        trees.append((name, os.path.abspath(path)))
    cpu = _cpu_mount()
    if cpu is None:
        print("placement_latency: needs root and a writable cgroup v1 cpu hierarchy", file=sys.stderr)
        return 2
    runs = []
    for r in range(a.rounds):
        for name, path in (trees if r % 2 == 0 else trees[::-1]):
            print(f"round {r + 1}/{a.rounds}: {name} ({a.passes} passes)", file=sys.stderr, flush=True)
            runs.append({**run_tree(name, path, a.passes, cpu), "round": r + 1})
    summary = summarize(runs)
    print("| tree | passes | never placed | iter() to placed, s: median [range] |")
    print("|---|---|---|---|")
    for name, _ in trees:
        d = summary[name]
        rng = d["range_s"]
        print(f"| {name} | {d['passes']} | {d['never']} | "
              + (f"{d['median_s']:.3f} [{rng[0]:.3f}-{rng[1]:.3f}] |" if rng else "- |"))
    with open(a.out, "w") as f:
        json.dump({"pass_s": PASS_S, "runs": runs, "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
