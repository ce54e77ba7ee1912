"""`adloader simulate`: trace-driven simulation of the policies over many nodes (see evaluation.simulate).

Without --trace, a generated trace: --nodes nodes with --jobs-per-node jobs each (Poisson arrivals,
lognormal work). Prints a markdown table per policy and writes JSON with --out. With --loader-memory
the oracle plans worker counts and cores within the budget (the budget oracle), and every policy is
also reported as a fraction of it.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time

from agent.commands import names_arg, path_arg, plain_float, plain_int

NAME = "simulate"


def _part(text: str) -> float:
    """--steps-known's PART: a fraction 0-1."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r} (a part of the jobs, 0-1)") from None
    if not 0.0 <= x <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not a part of the jobs (0-1)")
    return x


def _steps_note(part: float) -> str:
    if part >= 1.0:
        return ", steps left known"
    return f", steps left known for {part:.0%} of the jobs" if part > 0 else ""


def register(sub) -> None:
    p = sub.add_parser(NAME, description=__doc__.split("\n\n", 1)[1])
    p.add_argument("--trace", default=None, metavar="PATH", type=path_arg,
                   help="trace file (CSV with header or JSON lines: node, job, kind, arrival_s, work_s[, gpus]"
                        "[, phases]; default: a generated one)")
    p.add_argument("--nodes", type=plain_int, default=1000, metavar="N", help="nodes of a generated trace (default 1000)")
    p.add_argument("--jobs-per-node", type=plain_int, default=8, metavar="N",
                   help="jobs per node of a generated trace (default 8)")
    p.add_argument("--mean-gap-s", type=plain_float, default=30.0, metavar="S",
                   help="mean gap between arrivals on a node (default 30)")
    p.add_argument("--mean-work-s", type=plain_float, default=300.0, metavar="S",
                   help="mean work per job, seconds at its ceiling (default 300)")
    p.add_argument("--seed", type=plain_int, default=0, metavar="N", help="random seed (default 0)")
    p.add_argument("--curves", choices=("auto", "corpus", "builtin"), default="auto",
                   help="job models: the predictor's measured corpus, or first-principles catalogue kinds "
                        "(default auto: corpus when present)")
    p.add_argument("--catalog", default=None, metavar="PATH", type=path_arg,
                   help="catalogue TOML for --curves builtin (with --curves auto it means builtin)")
    p.add_argument("--policies", default="even-static,even,none,autotune,static-cores,adaptive,oracle", metavar="LIST",
                   type=names_arg,
                   help="policies to compare, comma-separated (default: "
                        "even-static,even,none,autotune,static-cores,adaptive,oracle)")
    p.add_argument("--predictor", choices=("agent", "first-principles", "perfect"), default="first-principles",
                   help="what adaptive sees: the agent's PredictorBank with its prior (agent), the bank "
                        "without its prior (first-principles, the default), or the true curves (perfect)")
    p.add_argument("--cores", type=plain_float, default=48.0, metavar="N", help="CPUs per node (default 48)")
    p.add_argument("--gpus", type=plain_int, default=8, metavar="N", help="GPUs per node (default 8)")
    p.add_argument("--loader-cpus", type=plain_float, default=None, metavar="CORES",
                   help="loader CPU budget per node (default: cores minus 10%%)")
    p.add_argument("--loader-memory", default=None, metavar="BYTES",
                   help="loader memory budget per node (bytes or a size such as 16GiB; default: none)")
    p.add_argument("--worker-memory", default=None, metavar="BYTES",
                   help="memory one worker holds, for every kind (default: the catalogue's worker_ram_mb; 0 for corpus curves)")
    p.add_argument("--cpu-knob", choices=("shares", "quota"), default="shares",
                   help="the agent's cpu_knob (default shares)")
    p.add_argument("--tick-s", type=plain_float, default=2.0, metavar="S", help="the controller's tick (default 2)")
    p.add_argument("--settle-ticks", type=plain_int, default=2, metavar="N",
                   help="after each event or move, ticks the plan must hold (plus one observation interval) "
                        "before a learning node stops ticking (default 2)")
    p.add_argument("--steps-known", nargs="?", const=1.0, default=0.0, type=_part, metavar="PART",
                   help="the jobs tell the agent the steps they have left (the loader's total_steps), as a job "
                        "that knows its length does: adaptive's finish guard uses it; the agent decides every "
                        "tick. PART (0-1, default 1: every job): the part of the jobs that tell, a fixed draw "
                        "by job id")
    p.add_argument("--processes", type=plain_int, default=None, metavar="N", help="worker processes (default: CPUs)")
    p.add_argument("--list-kinds", action="store_true", help="list the job kinds (of --curves) and exit")
    p.add_argument("--out", default=None, metavar="PATH", type=path_arg, help="write the JSON result here")
    p.set_defaults(func=run)


def run(args) -> int:
    from evaluation import simulate as S
    from evaluation.catalog import CatalogError

    try:
        source = args.curves
        if args.catalog is not None and source == "corpus":
            print("adloader simulate: --catalog is for --curves builtin (the catalogue's kinds), not corpus",
                  file=sys.stderr)
            return 2
        if source == "auto":     # a catalogue given says which: its kinds (it was ignored for the corpus)
            source = "builtin" if args.catalog is not None or not S.CORPUS_PATH.exists() else "corpus"
        curves = S.corpus_curves() if source == "corpus" else S.builtin_curves(args.catalog)
        if args.list_kinds:
            for k, cv in curves.items():
                gpus = max(1, int((cv.extra or {}).get("gpus", 1)))
                # the loader cores that keep it at its ceiling (first principles: CPU per batch over the step)
                cores = cv.cpu_s_per_batch / max(cv.compute_s_per_step + cv.overhead_s_per_step, 1e-9)
                print(f"{k}: {cores / gpus:.2f} loader cores per GPU at the ceiling, {gpus} GPU(s), "
                      f"step {cv.compute_s_per_step:.3f}s, batch {cv.batch_size}")
            return 0
        if args.out:
            from agent.commands.bench import out_file_error

            why = out_file_error(args.out)
            if why:
                raise S.SimError(f"--out {args.out}: {why}")
        if args.trace:
            trace = S.read_trace(args.trace)
        else:
            trace = S.generate_trace(S.trace_kinds(curves), args.nodes, args.jobs_per_node, args.mean_gap_s,
                                     args.mean_work_s, args.seed,
                                     gpus_of={k: (cv.extra or {}).get("gpus", 1) for k, cv in curves.items()})
        policies = [p for p in args.policies.split(",") if p]
        from agent.policies import POLICIES

        extra = ["oracle", *S.NO_AGENT_POLICIES]
        bad = [p for p in policies if p not in POLICIES and p not in extra]
        if bad:
            raise S.SimError(f"unknown policies: {', '.join(bad)}; choose from: "
                             f"{', '.join(sorted(set(POLICIES) | set(extra)))}")
        from adloader.memory import parse_bytes

        try:
            mem = {k: parse_bytes(v) if v is not None else None
                   for k, v in (("loader_memory", args.loader_memory), ("worker_memory_bytes", args.worker_memory))}
        except ValueError as e:
            raise S.SimError(f"--loader-memory/--worker-memory: {e}") from None
        if args.processes is not None and args.processes < 1:
            raise S.SimError(f"--processes must be at least 1, got {args.processes}")
        cfg = S.SimConfig(cores=args.cores, gpus=args.gpus, loader_cpus=args.loader_cpus, cpu_knob=args.cpu_knob,
                          tick_s=args.tick_s, settle_ticks=args.settle_ticks, predictor=args.predictor, steps_known=args.steps_known, **mem)
        t0 = time.perf_counter()
        result = S.simulate(trace, curves, policies, cfg, source=source, processes=args.processes)
    except (S.SimError, CatalogError) as e:   # (a --catalog that cannot be read was a traceback)
        print(f"adloader simulate: {e}", file=sys.stderr)
        return 2
    wall = time.perf_counter() - t0
    print(f"{result['nodes']} nodes, {result['jobs']} jobs, curves: {source}, predictor: {args.predictor}, "
          f"{cfg.cores:g} cores / {cfg.gpus} GPUs per node ({cfg.loader:g} for loaders), "
          f"{result['processes']} processes{_steps_note(cfg.steps_known)}: {wall:.1f}s")
    print(S.markdown(result))
    s = result["summary"]
    if cfg.loader_memory is not None and "oracle" in s:
        # under a budget the oracle is the budget oracle: the best static plan the CPU and memory allow
        ratios = "; ".join(f"{p} {r['ratio_oracle']:.3f}x" + (f" (but over the budget {r['memory_over_budget_frac']:.0%} "
                                                            f"of node-time)" if r["memory_over_budget_frac"] > 0 else "")
                           for p, r in s.items() if "ratio_oracle" in r)
        print(f"\nWithin the loader memory budget ({cfg.loader_memory / (1 << 30):.2f} GiB per node), against the "
              f"budget oracle (the best static plan of worker counts and cores the budget allows): {ratios}")
    if args.out:
        result["meta"] = {"argv": sys.argv[1:], "curves": source, "wall_s": wall}
        try:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1, default=lambda o: None if isinstance(o, float) and math.isnan(o) else str(o))
        except OSError as e:   # (checked before the simulation; a full disk or /proc/version still end here)
            print(f"adloader simulate: --out {args.out}: cannot write it: {e.strerror or e}", file=sys.stderr)
            return 1
        print(f"JSON: {args.out}")
    return 0
