"""`adloader bench`: co-located real training jobs under each policy, side by side, on this node.

Default: the quick run (heterogeneous mix, every policy, one repeat; a few minutes). ``--full``:
every scenario, three repeats (long; on request). Prints a markdown table; writes bench.json,
bench.md and PNG plots under --out.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

from agent.commands import names_arg, path_arg, plain_float, plain_int

NAME = "bench"


def register(sub) -> None:
    from evaluation.harness import POLICIES_ALL, SCENARIOS_ALL

    p = sub.add_parser(NAME, description=__doc__.split("\n\n", 1)[1] if __doc__ else None)
    length = p.add_mutually_exclusive_group()
    length.add_argument("--quick", action="store_true", help="the bounded run (default unless --full)")
    length.add_argument("--full", action="store_true", help="every scenario, 3 repeats, longer phases")
    p.add_argument("--scenarios", default=None, metavar="LIST", type=names_arg,
                   help=f"comma-separated, from: {','.join(SCENARIOS_ALL)} (quick: heterogeneous; full: all)")
    p.add_argument("--policies", default=",".join(POLICIES_ALL), metavar="LIST", type=names_arg,
                   help=f"comma-separated policies to compare (default: all, {','.join(POLICIES_ALL)}); an agent policy may be a variant with agent "
                        "config keys, e.g. 'adaptive[loaders_yield=never]' (an A/B in one interleaved run); "
                        "'plan:FILE' runs the agent with a fixed plan per scenario from FILE "
                        "(python -m evaluation.best_plan --out, or {\"plans\": {scenario: {job: "
                        "{\"workers\": w, \"cpus\": c}}}})")
    p.add_argument("--reps", type=plain_int, default=None, metavar="N", help="repeats (quick: 1, full: 3)")
    p.add_argument("--catalog", default=None, metavar="PATH", type=path_arg,
                   help="job catalogue TOML (default: the packaged catalog.toml)")
    p.add_argument("--out", default="bench-out", metavar="DIR", type=path_arg,
                   help="output directory (JSON, markdown, plots, logs; default bench-out)")
    p.add_argument("--loader-cpus", default="auto", metavar="CORES",
                   help="cores for all loaders (default: auto, as the agent's)")
    add_cgroup_mode(p)
    p.add_argument("--loader-memory", default=None, metavar="BYTES",
                   help="the agent's loader memory budget in the memory scenario (bytes or a size; default 1GiB)")
    p.add_argument("--tick-s", type=plain_float, default=1.0, metavar="S", help="the agent's tick, seconds (default 1)")
    p.add_argument("--agent-log-level", choices=("debug", "info", "warning"), default="info", metavar="LEVEL",
                   help="the agents' log level, debug|info|warning (default info; runs/<scenario>/<policy>-repN/agent.log); debug adds an "
                        "'observation' event per window the predictor got, with the curve it made")
    p.add_argument("--steps-known", action="store_true",
                   help="jobs with a fixed amount of work (the dynamic scenario's) tell their loaders their steps "
                        "(total_steps), as a job that knows its length does: what adaptive's finish guard uses")
    p.add_argument("--foreign-cores", type=plain_float, default=0.0, metavar="CORES",
                   help="CPU load outside every job for each whole phase, in cores (default 0): ceil(CORES) "
                        "processes busy in 50-ms duty cycles, as daemons or a neighbour's work are")
    p.add_argument("--foreign-bursts", default=None, metavar="ON_S,OFF_S",
                   help="with --foreign-cores: the load comes and goes, ON_S seconds on and OFF_S off (all its "
                        "processes together, from the phase's start), as a neighbour's bursts of work do "
                        "(default: steady for the whole phase)")
    p.add_argument("--device", choices=("emulated", "cuda"), default="emulated",
                   help="emulated GPU step (sleep; the default) or a real small model step on CUDA")
    p.add_argument("--warmup-s", type=plain_float, default=None, metavar="S",
                   help="seconds before measuring each phase (default: quick 4, full 6; a mix the catalogue's "
                        "[windows] gives a longer minimum gets that)")
    p.add_argument("--measure-s", type=plain_float, default=None, metavar="S",
                   help="seconds measured per static phase (default: quick 12, full 24; raised to a mix's "
                        "[windows] minimum)")
    p.add_argument("--sweep-segment-s", type=plain_float, default=None, metavar="S",
                   help="oracle sweep: seconds per worker count (default: quick 2.5, full 4)")
    p.add_argument("--oracle", choices=("colocated", "solo"), default="colocated",
                   help="the oracle's curves: probes of the whole mix under fixed plans (default; scenarios "
                        "with arrivals use solo) or each job kind swept alone on the node")
    p.add_argument("--oracle-probe-reps", type=plain_int, default=2, metavar="N",
                   help="repeats of each co-located oracle probe (default 2)")
    p.add_argument("--calibration-processes", type=plain_int, default=3, metavar="N",
                   help="fresh processes the job kinds' CPU per sample is measured in, the least taken "
                        "(default 3; on a VM one process can run a kind 1.5-2x slower than another); 1 = in "
                        "this process")
    p.set_defaults(func=run)


def add_cgroup_mode(p) -> None:
    """``--cgroup-mode`` of the agents a bench or demo starts (both)."""
    from agent.actuators import MODES

    p.add_argument("--cgroup-mode", default=None, choices=MODES, metavar="MODE",
                   help=f"the agent's cgroup mode, {'|'.join(MODES)} (default: v1 when root on cgroup v1, else off)")


def _check_cuda() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    return None


def seconds_error(name: str, v, zero_ok: bool = False) -> str | None:
    """What is wrong with a duration option's value (None: unset or fine); bench and demo."""
    import math

    if v is None or (math.isfinite(v) and (v > 0 or (zero_ok and v == 0))):
        return None
    return f"{name} must be {'0 or more' if zero_ok else 'positive'}, got {v:g}"


def calibration_processes_error(v: int) -> str | None:
    """What is wrong with ``--calibration-processes`` (None: fine); bench and demo."""
    return None if v >= 1 else f"--calibration-processes must be >= 1, got {v}"


def out_dir_error(path: str) -> str | None:
    """What makes ``path`` unusable as the output directory (None: it is one now, created if it was not);
    bench and demo, before the calibration (minutes): a probe file is made and removed (``_probe_write``)."""
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        return "not a directory"
    except OSError as e:
        return f"cannot create the directory: {e.strerror or e}"
    if not p.is_dir():
        return "not a directory"
    try:
        _probe_write(str(p))
    except OSError as e:
        return f"cannot write in it: {e.strerror or e}"
    return None


def _probe_write(directory: str) -> None:
    """Make and remove a file in ``directory`` (``OSError`` if that cannot be done): neither ``os.access``
    nor the mode bits say whether root can write in /proc or on a read-only mount."""
    import os
    import tempfile

    fd, probe = tempfile.mkstemp(dir=directory, prefix=".adloader-probe-")
    os.close(fd)
    os.unlink(probe)


def out_file_error(path: str) -> str | None:
    """What makes ``path`` unusable as an output file (None: it can be written); nothing is created or
    changed. ``adloader simulate --out``, before the simulation."""
    import os

    if os.path.isdir(path):
        return "is a directory"
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        return f"no such directory {parent}"
    try:
        if os.path.lexists(path):   # (O_NONBLOCK: a FIFO without a reader is refused, not waited on)
            os.close(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK | os.O_CLOEXEC))
        else:
            _probe_write(parent)
    except OSError as e:
        return f"cannot write {'it' if os.path.lexists(path) else 'in ' + parent}: {e.strerror or e}"
    return None


def foreign_bursts(text: str) -> tuple[float, float] | None:
    """``--foreign-bursts ON_S,OFF_S`` read: (on, off) seconds, both finite and positive; None if not."""
    parts = text.split(",")
    if len(parts) != 2:
        return None
    try:
        on, off = (float(x) for x in parts)
    except ValueError:
        return None
    return (on, off) if all(0 < x < math.inf for x in (on, off)) else None


def _check_numbers(args, node_cores: int) -> str | None:
    """What is wrong with the numeric options, or None (checked before any job starts)."""
    if args.reps is not None and args.reps < 1:
        return f"--reps must be at least 1, got {args.reps}"
    for name, v, zero_ok in (("--warmup-s", args.warmup_s, True), ("--measure-s", args.measure_s, False),
                             ("--sweep-segment-s", args.sweep_segment_s, False), ("--tick-s", args.tick_s, False)):
        why = seconds_error(name, v, zero_ok)
        if why:
            return why
    if not 0 <= args.foreign_cores < node_cores:
        return f"--foreign-cores must be in [0, {node_cores}) (this node's CPUs), got {args.foreign_cores:g}"
    if args.foreign_bursts is not None:
        if not args.foreign_cores:
            return "--foreign-bursts needs --foreign-cores (the load that comes and goes)"
        if foreign_bursts(args.foreign_bursts) is None:
            return (f"--foreign-bursts must be ON_S,OFF_S, two positive numbers of seconds (e.g. 5,10), "
                    f"got {args.foreign_bursts!r}")
    if args.loader_cpus != "auto":
        try:
            c = float(args.loader_cpus)
        except ValueError:
            return f"--loader-cpus must be 'auto' or a number of cores, got {args.loader_cpus!r}"
        if not (0 < c <= node_cores):
            return f"--loader-cpus must be in (0, {node_cores}] (this node's CPUs), got {args.loader_cpus}"
    return None


def run(args) -> int:
    from evaluation import report, setup
    from evaluation.harness import (POLICIES_ALL, SCENARIOS_ALL, BenchError, parse_policy, plan_file, scenario_plans,
                                    split_policies)

    quick = not args.full
    scenarios = args.scenarios.split(",") if args.scenarios else (
        ["heterogeneous"] if quick else list(SCENARIOS_ALL))
    policies = split_policies(args.policies)
    try:
        bases = [parse_policy(p)[0] for p in policies]
    except BenchError as e:
        print(f"adloader bench: {e}", file=sys.stderr)
        return 2
    bad = [s for s in scenarios if s not in SCENARIOS_ALL] + [
        p for p in bases if p not in POLICIES_ALL and plan_file(p) is None]
    if bad:
        print(f"adloader bench: unknown scenario/policy: {', '.join(bad)}; scenarios: {', '.join(SCENARIOS_ALL)}; "
              f"policies: {', '.join(POLICIES_ALL)}, plan:FILE", file=sys.stderr)
        return 2
    try:
        scenario_plans(scenarios, policies)         # plan:FILE policies' files, before the calibration
    except BenchError as e:
        print(f"adloader bench: {e}", file=sys.stderr)
        return 2
    if args.device == "cuda":
        why = _check_cuda()
        if why:
            print(f"adloader bench: --device cuda needs a CUDA GPU: {why}. Use --device emulated.", file=sys.stderr)
            return 2
    why = _check_numbers(args, setup.node_cores())
    if why:
        print(f"adloader bench: {why}", file=sys.stderr)
        return 2
    import signal

    # SIGTERM (timeout, kill) ends the run through the harness's cleanup (its finally blocks stop every
    # job, agent and hog it started, and remove its cgroups), as Ctrl-C does
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    loader_cpus = setup.default_loader_cpus() if args.loader_cpus == "auto" else float(args.loader_cpus)
    loader_memory = None
    if args.loader_memory:
        from adloader.memory import parse_bytes

        try:
            loader_memory = parse_bytes(args.loader_memory)
        except ValueError as e:
            print(f"adloader bench: --loader-memory: {e}", file=sys.stderr)
            return 2
    why = calibration_processes_error(args.calibration_processes)
    if why:
        print(f"adloader bench: {why}", file=sys.stderr)
        return 2
    if args.oracle_probe_reps < 1:
        print(f"adloader bench: --oracle-probe-reps must be >= 1, got {args.oracle_probe_reps}", file=sys.stderr)
        return 2
    why = out_dir_error(args.out)
    if why:
        print(f"adloader bench: --out {args.out}: {why}", file=sys.stderr)
        return 2
    reps = args.reps or (1 if quick else 3)
    progress = report.Progress()
    bursts = foreign_bursts(args.foreign_bursts) if args.foreign_bursts else None     # (checked above)
    progress.note(f"adloader bench ({'quick' if quick else 'full'}): {len(scenarios)} scenario(s) x "
                  f"{len(policies)} policies x {reps} repeat(s); {setup.node_cores()} cores, "
                  f"{loader_cpus:g} for loaders"
                  + (f"; {args.foreign_cores:g} cores of foreign load" if args.foreign_cores else "")
                  + (" ({:g} s on, {:g} s off)".format(*bursts) if bursts else ""))
    try:
        result = setup.run(out_dir=Path(args.out), scenarios=scenarios, policies=policies, reps=reps, quick=quick,
                           catalog_path=args.catalog, loader_cpus=loader_cpus,
                           cgroup_mode=args.cgroup_mode or setup.default_cgroup_mode(), tick_s=args.tick_s,
                           device=args.device, sweep_segment_s=args.sweep_segment_s or (2.5 if quick else 4.0),
                           progress=progress, warmup_s=args.warmup_s, measure_s=args.measure_s,
                           loader_memory=loader_memory, oracle_source=args.oracle,
                           oracle_probe_reps=args.oracle_probe_reps, agent_log_level=args.agent_log_level,
                           loader_cpus_auto=args.loader_cpus == "auto", steps_known=args.steps_known,
                           calibration_processes=args.calibration_processes, foreign_cores=args.foreign_cores,
                           foreign_bursts=bursts)
    except (BenchError, ValueError) as e:
        print(f"adloader bench: {e}", file=sys.stderr)
        return 1
    print(result["markdown"])
    paths = result["paths"]
    print(f"JSON: {paths['json']}\nmarkdown: {paths['markdown']}")
    for p in paths.get("plots", []):
        print(f"plot: {p}")
    failed = [ph for ph in result["phases"] if "agg_normalised" not in (ph.get("metrics") or {})]
    return 1 if failed and len(failed) == len(result["phases"]) else 0
