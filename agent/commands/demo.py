"""`adloader demo`: three co-located training jobs on this node under what an operator runs today
(``none``: no agent, each job at its user's habitual ``num_workers``, the kernel arbitrates), under an
even split of the loader CPUs (``even-static``, the A-Dloader paper's baseline) and under A-Dloader's
adaptive policy, and a table of the three.

The jobs are the catalogue's ``demo`` mix (a realistic one: a 2-GPU job beside two 1-GPU jobs, every
training process busy part of its step on the CPU, users' habitual worker counts; ``--mix`` picks
another).

Needs nothing configured: it starts its own agent as a child process on a temporary endpoint and state
directory (cgroup mode v1 in the agent's own subtree when run as root on cgroup v1, else off: worker
counts only), real job processes on ``adloader.DataLoader`` over generated JPEGs with an emulated GPU
step, and stops everything at the end. About 1-2 minutes on a 2-core machine.
"""
from __future__ import annotations

import sys
from pathlib import Path

from agent.commands import names_arg, path_arg, plain_float, plain_int

NAME = "demo"


def register(sub) -> None:
    from agent.commands.bench import add_cgroup_mode

    p = sub.add_parser(NAME, description=__doc__.split("\n\n", 1)[1] if __doc__ else None)
    p.add_argument("--out", default="bench-out/demo", metavar="DIR", type=path_arg,
                   help="where the table, JSON and plots go (default bench-out/demo)")
    p.add_argument("--measure-s", type=plain_float, default=20.0, metavar="S",
                   help="measured seconds per policy (default 20)")
    p.add_argument("--warmup-s", type=plain_float, default=6.0, metavar="S",
                   help="seconds before measuring, while the agent settles (default 6)")
    add_cgroup_mode(p)
    p.add_argument("--catalog", default=None, metavar="PATH", type=path_arg,
                   help="job catalogue TOML (its --mix is used; default: the packaged catalog.toml)")
    p.add_argument("--mix", default="demo", metavar="NAME", type=names_arg, help="which catalogue mix runs (default: demo)")
    p.add_argument("--calibration-processes", type=plain_int, default=3, metavar="N",
                   help="fresh processes the job kinds' CPU per sample is measured in, the least taken "
                        "(default 3); 1 = in this process")
    p.set_defaults(func=run)


def _table(result: dict, policies: list[str]) -> str:
    phases = {ph["policy"]: ph for ph in result["phases"]}
    jobs = []
    for p in policies:
        for j in ((phases.get(p) or {}).get("metrics") or {}).get("jobs", {}):
            if j not in jobs:
                jobs.append(j)
    head = ["policy", "GPU-weighted agg. normalised throughput", "samples/s", "GPU idle"] \
        + [f"{j} (norm.)" for j in jobs] \
        + ["workers at end"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in policies:
        ph = phases.get(p) or {}
        m = ph.get("metrics") or {}
        if "agg_normalised" not in m:
            lines.append(f"| {p} | failed: {(ph.get('error') or 'no data').splitlines()[0][:120]} |")
            continue
        per = [f"{m['jobs'][j]['normalised']:.2f}" if j in m["jobs"] else "–" for j in jobs]
        workers = "/".join(str(m["jobs"][j]["workers_end"]) for j in jobs if j in m["jobs"])
        lines.append(f"| {p} | {m['agg_normalised']:.3f} | {m['samples_per_s']:.0f} | {m['gpu_idle_frac']:.1%} | "
                     + " | ".join(per) + f" | {workers} |")
    return "\n".join(lines)


def run(args) -> int:
    from agent.commands.bench import calibration_processes_error, out_dir_error, seconds_error
    from evaluation import report, setup
    from evaluation.harness import BenchError

    for name, v, zero_ok in (("--measure-s", args.measure_s, False), ("--warmup-s", args.warmup_s, True)):
        why = seconds_error(name, v, zero_ok)
        if why:
            print(f"adloader demo: {why}", file=sys.stderr)
            return 2
    why = calibration_processes_error(args.calibration_processes)
    if why:
        print(f"adloader demo: {why}", file=sys.stderr)
        return 2
    why = out_dir_error(args.out)
    if why:
        print(f"adloader demo: --out {args.out}: {why}", file=sys.stderr)
        return 2
    policies = ["none", "even-static", "adaptive"]
    what = "none (habitual num_workers, no agent), even-static, then adaptive"
    progress = report.Progress()
    loader_cpus = setup.default_loader_cpus()
    mode = args.cgroup_mode or setup.default_cgroup_mode()
    progress.note(f"adloader demo: three co-located jobs, {what}; {setup.node_cores()} cores, "
                  f"{loader_cpus:g} for loaders, agent cgroup mode {mode}")
    try:
        result = setup.run(out_dir=Path(args.out), scenarios=[args.mix], policies=policies, reps=1,
                           quick=True, catalog_path=args.catalog, loader_cpus=loader_cpus, cgroup_mode=mode,
                           tick_s=1.0, device="emulated", sweep_segment_s=2.0, progress=progress,
                           warmup_s=args.warmup_s, measure_s=args.measure_s, title="demo", loader_cpus_auto=True,
                           calibration_processes=args.calibration_processes)
    except (BenchError, ValueError) as e:
        print(f"adloader demo: {e}", file=sys.stderr)
        return 1
    print()
    print(_table(result, policies))
    m = {ph["policy"]: (ph.get("metrics") or {}).get("agg_normalised") for ph in result["phases"]}
    after = m.get(policies[-1])
    for before_p in policies[:-1]:
        before = m.get(before_p)
        if before and after:
            print(f"\n{policies[-1]} vs {before_p}: {after / before - 1:+.1%} GPU-weighted aggregate normalised "
                  f"throughput (one run each on this machine; `adloader bench` repeats and adds the other baselines)")
    print("\nnormalised throughput = a job's samples/s over its samples/s with data always ready; "
          "GPU idle = time the (emulated) GPU waited for data")
    paths = result["paths"]
    print(f"table/JSON: {paths['markdown']}, {paths['json']}")
    for p in paths.get("plots", []):
        print(f"plot: {p}")
    failed = [ph for ph in result["phases"] if "agg_normalised" not in (ph.get("metrics") or {})]
    return 1 if failed else 0
