"""What ``adloader bench`` and ``adloader demo`` share: node facts, calibration, one run end to end."""
from __future__ import annotations

import os
import shlex
import sys
import time
from pathlib import Path

from evaluation import harness, plots, report
from evaluation.catalog import calibrate, load_catalog


def node_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_loader_cpus() -> float:
    """The agent's own default (``agent.config.auto_loader_cpus``): node CPUs minus a 10% reserve."""
    try:
        from agent.config import auto_loader_cpus

        return float(auto_loader_cpus())
    except ImportError:
        return max(0.5, round(node_cores() * 0.9, 2))


def default_cgroup_mode() -> str:
    """The agent's ``auto`` when we are root (v1 on a cgroup v1 cpu hierarchy, v2 on a unified one with the
    cpu controller; the agent works in its own subtree), else off."""
    try:
        if os.geteuid() != 0:
            return "off"
        from agent.actuators import resolve_auto

        return resolve_auto()
    except (ImportError, OSError):
        return "off"


def run(*, out_dir: Path, scenarios: list[str], policies: list[str], reps: int, quick: bool,
        catalog_path: str | None, loader_cpus: float, cgroup_mode: str, tick_s: float, device: str,
        sweep_segment_s: float, progress: report.Progress, warmup_s: float | None = None,
        measure_s: float | None = None, title: str = "bench", loader_memory: int | None = None,
        oracle_source: str = "colocated", oracle_probe_reps: int = 2, agent_log_level: str = "info",
        loader_cpus_auto: bool = False, steps_known: bool = False, calibration_processes: int = 1,
        foreign_cores: float = 0.0, foreign_bursts: tuple[float, float] | None = None) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    catalog = load_catalog(catalog_path)
    kinds = sorted({k for s in scenarios for k in catalog.mixes.get(s, [])})
    where = f", the least of {calibration_processes} fresh processes" if calibration_processes > 1 else ""
    progress.note(f"calibrating {len(kinds)} job kinds on this machine ({', '.join(kinds)}){where}")
    try:
        calib = calibrate(catalog, loader_cpus, kinds, processes=calibration_processes)
    except RuntimeError as e:
        raise harness.BenchError(str(e)) from None
    cfg = harness.BenchConfig(catalog=catalog, calib=calib, loader_cpus=loader_cpus, node_cores=node_cores(),
                              out_dir=out_dir, cgroup_mode=cgroup_mode, tick_s=tick_s, device=device,
                              sweep_segment_s=sweep_segment_s, loader_memory=loader_memory,
                              oracle_source=oracle_source, oracle_probe_reps=oracle_probe_reps,
                              agent_log_level=agent_log_level, loader_cpus_auto=loader_cpus_auto,
                              steps_known=steps_known, foreign_cores=foreign_cores,
                              foreign_bursts=foreign_bursts)
    scs = harness.build_scenarios(cfg, scenarios, quick)
    for sc in scs:
        if warmup_s is not None:
            sc.warmup_s = warmup_s
        if measure_s is not None and sc.kind != "dynamic":
            sc.measure_s = measure_s
    for note in harness.apply_mix_windows(scs, catalog):
        progress.note(note)
    t0, started = time.time(), time.strftime("%Y-%m-%d %H:%M:%S")
    result = harness.run_bench(cfg, scs, policies, reps, progress)
    for ph in result["phases"]:
        if ph.get("jobs"):
            ph["series"] = harness.job_series(ph)
    summary = report.summarise(result["phases"])
    goal_rows = report.goals(summary)
    command = shlex.join([os.path.basename(sys.argv[0])] + sys.argv[1:])
    meta = {"title": title, "command": command, "node_cores": cfg.node_cores, "loader_cpus": loader_cpus,
            "loader_cpus_auto": loader_cpus_auto, "steps_known": steps_known, "foreign_cores": foreign_cores,
            "foreign_bursts": list(foreign_bursts) if foreign_bursts else None,
            "cgroup_mode": cgroup_mode, "tick_s": tick_s, "device": device, "reps": reps, "quick": quick,
            "catalog": catalog.path, "calibration": calib, "started": started,
            "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
            "wall_s": time.time() - t0, "loader": _loader_kind(result["phases"]),
            "oracle": ("GPU-weighted exact knapsack over each job's points measured co-located (the whole mix "
                       f"under fixed probe plans, {oracle_probe_reps} repeats each; scenarios with arrivals: "
                       "each kind swept alone)" if oracle_source == "colocated" else
                       "GPU-weighted exact knapsack over each job kind's curve measured alone on this node "
                       "(worker sweeps)") + ", replayed by the real agent and actuators; in a scenario with a loader "
                      "memory budget, worker counts and cores together within it (each worker at the most "
                      "memory it held in its sweep)"}
    workload = report.workload_check(result["phases"])
    costs = report.cost_index(result["phases"])
    delivered = report.delivery(result["phases"])
    result.update(meta=meta, summary=summary, goals=goal_rows, workload_check=workload, cost_index=costs,
                  delivery=delivered)
    result["markdown"] = report.markdown(summary, goal_rows, meta, workload, costs, delivered)
    paths = report.write_outputs(result, out_dir)
    try:
        paths["plots"] = plots.write_plots(result, out_dir)
    except Exception as e:  # plots are a convenience; the table and JSON are the record
        progress.note(f"plots failed: {type(e).__name__}: {e}")
        paths["plots"] = []
    result["paths"] = paths
    return result


def _loader_kind(phases) -> str:
    kinds = set()
    for ph in phases:
        for j in (ph.get("jobs") or {}).values():
            if j.get("start"):
                kinds.add(j["start"].get("loader"))
    return ",".join(sorted(k for k in kinds if k)) or "unknown"


__all__ = ["run", "node_cores", "default_loader_cpus", "default_cgroup_mode"]
