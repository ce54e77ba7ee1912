"""The status document (``adloader status --json``, the ``status`` reply, the metrics source).

Fields (``STATUS_VERSION`` 1; readers ignore unknown fields, new fields may be added):

    version             1
    agent               {pid, uid, version, protocol, endpoint, state_dir, policy, tick_s, heartbeat_s,
                         uptime_s, ticks, last_tick_ms, loader_cpus (configured), loader_cpus_auto,
                         loader_cpus_in_force (the budget the last plan used: an "auto" budget grows into
                         the reserve the training processes leave), cpu_ids[], max_jobs, cgroup_mode,
                         actuators[], gpu_source ("nvml" | "client"), nvml_error, cpu_pressure,
                         io_pressure (PSI some avg10 %, null where absent), metrics_port, errors{code: n},
                         messages{type: n}, recent_ticks{n, wall_ms_p50, wall_ms_p95, wall_ms_max,
                         cpu_ms_p50, cpu_ms_p95, controller_ms_p50, phases_ms_p50{snapshot, predict,
                         policy, apply}} over the last 60 ticks, journal_ms (last write),
                         unseen_job_timeout_s, job_scans (/proc scans for registered jobs' processes,
                         ``agent.jobprocs``),
                         memory {budget_bytes (loader memory budget in force, null = none),
                         configured_bytes, used_bytes (all loaders' workers + batches in flight),
                         available_bytes (MemAvailable), pressure_pct (PSI memory some over the last
                         tick), under_pressure, note (why the budget in force is below the
                         configured one, "" if it is not)} (null before the first tick),
                         state_problems [str] (state files set aside, or not writable: the file named),
                         connections {open, max_connections, per_uid, accepted, by_uid_top{uid: n},
                         refused_by_uid{uid: n}} (ordinary users' connections; null without ipc),
                         open_files_limit, message_budget_hits (message handling that yielded to the
                         loop), tick_late_ms {p50, max_recent (last 60 ticks), max (since start)}}
    node                the loaders together against the node: {loaders_yield (bool: the loaders' subtree
                         runs only on CPU the training processes leave idle), reason, busy_cpu_cores (the
                         node's CPU use), foreign_cpu_cores (of it, what the jobs' trainers, loaders and
                         the agent did not use), foreign_held_cpu_cores (the least of that over the last
                         3 s: what lasted)} (null before the first plan or under ``none``)
    predicted_total     GPU-weighted normalised throughput the last plan predicts (null if unknown)
    unsatisfied         {job: what it wanted and did not get}
    tick_errors         [str] tick-level failures of the last tick
    jobs                [one object per job, sorted by job id]:
        job                 job id
        uid                 owner
        source              "hello" | "register" | "journal" (how it arrived)
        registered          true if `adloader job register` (Slurm prolog) announced it
        ranks               training processes connected on this node
        pids[]              their pids
        worker_pids[]       loader worker pids (all ranks)
        gpus[]              GPU ids (registration, else what the ranks see)
        weight              GPUs the policy weighs the job by (JobStats.gpus)
        workers             loader workers now (reported by the clients, max over ranks)
        requested_workers   the user's num_workers
        max_workers         the loader's bound, null if none
        cpus                CPU cores in force for the job's loader workers (null before any apply)
        cpu_weight          cores the job's CPU group weighs when not ``cpus`` (adaptive with the shares
                            knob: a job planned all the cores it can use weighs the loader CPUs), else null
        delivery            the factor its CPU weight carries over ``cpus`` so that it receives them (adaptive's
                            ``delivery_correction``; 1 = none), null before any apply
        cpuset[]            exclusive CPUs in force, null if not pinned
        desired_workers     what the last plan wants (may differ from workers while a directive travels)
        desired_cpus
        data_wait_frac      share of step time blocked on data (max over ranks), 0..1
        gpu_idle_frac       GPU idle share, 0..1, null before data
        gpu_idle_source     "nvml" (driver) or "client" (data_wait_frac stands in)
        samples_per_s       summed over ranks
        compute_s_per_step  mean over ranks
        worker_cpu_cores    CPU cores the job's workers used
        trainer_cpu_cores   CPU cores the job's training processes themselves used
        trainer_cores_needed  what they need at full speed (CPU per step / compute per step), kept
                            out of the loaders' budget by adaptive
        max_useful_workers  the predictor's estimate (null before its first curve)
        max_useful_cores
        curve_confidence    0..1
        phase_changes       how often the predictor found a new pipeline in the job's windows and dropped
                            its earlier ones (``predictor.bank``), 0 before its first curve
        steps_left          the steps the job said it has left (its loader's ``total_steps`` counted down,
                            the most over ranks), null if it did not say
        steps_left_refused  true while a rank's steps_left is not taken: it does not count down as the
                            job steps (``agent.collector``; the agent's log names the rank)
        reason              why the job has its current allocation (the policy's words)
        unsatisfied         what it wanted and did not get, null if nothing
        apply_ok            last apply result (null if nothing applied in the last tick)
        apply_error         its error text, "" if none
        breaker             why the job's breaker is open, null if closed
        age_s, observed_s   since arrival; seconds of reports
        loader_memory_bytes the job's loader memory: its workers' unique memory + batches in flight
        worker_memory_bytes one worker's cost (mean USS + its share of the batches in flight)
        worker_growth_bytes mean growth of a worker's unique memory since it started (copy-on-read)
"""
from __future__ import annotations

import math
from typing import Any, Optional

STATUS_VERSION = 1


def trainer_need(st) -> float:
    from agent.policies import trainer_cores_needed

    return trainer_cores_needed(st)


def _r(x: Optional[float], nd: int = 4) -> Optional[float]:
    if x is None or not isinstance(x, (int, float)) or isinstance(x, bool) or not math.isfinite(x):
        return None
    return round(float(x), nd)


def build(*, agent_info: dict, registry, snapshot, record, applied: dict) -> dict:
    """Assemble the document from the daemon's parts (pure: no sockets, no clocks)."""
    jobs = []
    plan = record.plan if record is not None else None
    unsatisfied = dict(plan.unsatisfied) if plan is not None else {}
    for job_id in sorted(registry.jobs):
        job = registry.jobs[job_id]
        st = snapshot.jobs.get(job_id) if snapshot is not None else None
        a = applied.get(job_id)
        desired = plan.allocations.get(job_id) if plan is not None else None
        curve = (record.curves.get(job_id) if record is not None else None) or {}
        result = record.results.get(job_id) if record is not None else None
        breaker = record.breakers.get(job_id) if record is not None else None
        if not job.ranks:
            reason = "registered: no loader share until one of its ranks says hello"
        elif desired is not None:
            reason = desired.reason
        elif a is not None:
            reason = a.reason
        else:
            reason = "waiting for the first tick" if st is None else "no allocation yet"
        jobs.append({
            "job": job_id, "uid": job.uid, "source": job.source, "registered": job.registered,
            "ranks": len(job.ranks), "pids": list(job.pids()), "worker_pids": list(job.worker_pids()),
            "gpus": list(job.gpus),
            "weight": st.gpus if st is not None else None,
            "workers": max((r.workers for r in job.ranks.values()), default=0),
            "requested_workers": max((r.requested_workers for r in job.ranks.values()), default=0),
            "max_workers": st.max_workers if st is not None else None,
            "cpus": _r(a.cpus) if a is not None else None,
            "cpu_weight": _r(a.cpu_weight) if a is not None and a.cpu_weight is not None else None,
            "delivery": _r(a.delivery) if a is not None else None,
            "cpuset": list(a.cpuset) if a is not None and a.cpuset else None,
            "desired_workers": desired.workers if desired is not None else None,
            "desired_cpus": _r(desired.cpus) if desired is not None else None,
            "data_wait_frac": _r(st.data_wait_frac) if st is not None else None,
            "gpu_idle_frac": _r(st.gpu_idle_frac) if st is not None else None,
            "gpu_idle_source": st.gpu_idle_source if st is not None else "client",
            "samples_per_s": _r(st.samples_per_s, 2) if st is not None else None,
            "compute_s_per_step": _r(st.compute_s_per_step) if st is not None else None,
            "worker_cpu_cores": _r(st.worker_cpu_cores, 3) if st is not None else None,
            "trainer_cpu_cores": _r(st.trainer_cpu_cores, 3) if st is not None else None,
            "trainer_cores_needed": _r(trainer_need(st), 3) if st is not None else None,
            "max_useful_workers": curve.get("max_useful_workers"),
            "max_useful_cores": _r(curve.get("max_useful_cores")),
            "curve_confidence": _r(curve.get("confidence"), 3),
            "phase_changes": int(curve.get("phase_changes") or 0),
            "steps_left": _r(st.steps_left, 0) if st is not None and st.steps_left is not None else None,
            "steps_left_refused": bool(st is not None and st.steps_left_refused),
            "reason": reason,
            "unsatisfied": unsatisfied.get(job_id),
            "apply_ok": result.ok if result is not None else None,
            "apply_error": result.error if result is not None else "",
            "breaker": breaker,
            "age_s": _r(st.age_s, 1) if st is not None else None,
            "observed_s": _r(st.observed_s, 1) if st is not None else None,
            "loader_memory_bytes": _r(st.loader_memory_bytes, 0) if st is not None else None,
            "worker_memory_bytes": _r(st.worker_memory_bytes, 0) if st is not None else None,
            "worker_growth_bytes": _r(st.worker_growth_bytes, 0) if st is not None else None,
        })
    node = None
    if plan is not None and plan.node is not None:
        node = {"loaders_yield": plan.node.loaders_yield, "reason": plan.node.reason,
                "busy_cpu_cores": _r(snapshot.busy_cpu_cores, 3) if snapshot is not None else None,
                "foreign_cpu_cores": _r(snapshot.foreign_cpu_cores, 3) if snapshot is not None else None,
                "foreign_held_cpu_cores": _r(snapshot.foreign_held_cpu_cores, 3) if snapshot is not None else None}
    return {
        "version": STATUS_VERSION,
        "agent": agent_info,
        "node": node,
        "predicted_total": _r(plan.predicted_total) if plan is not None else None,
        "unsatisfied": unsatisfied,
        "tick_errors": list(record.errors) if record is not None else [],
        "jobs": jobs,
    }


def _fmt(v: Any, spec: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and spec:
        return format(v, spec)
    return str(v)


def render_table(doc: dict) -> str:
    """The human view: one header block for the agent, one row per job."""
    a = doc.get("agent", {})
    lines = [
        f"agent pid {a.get('pid')}  policy {a.get('policy')}  tick {a.get('tick_s')}s "
        f"(last {_fmt(a.get('last_tick_ms'), '.2f')} ms)  loader CPUs {_fmt(a.get('loader_cpus'), 'g')}"
        + (f" (in force {_fmt(a.get('loader_cpus_in_force'), 'g')})"
           if a.get("loader_cpus_in_force") not in (None, a.get("loader_cpus")) else "") + "  "
        f"cgroups {a.get('cgroup_mode')}  GPU figures from {a.get('gpu_source')}  "
        f"uptime {_fmt(a.get('uptime_s'), '.0f')}s",
    ]
    m = a.get("memory") or {}
    if m:
        from adloader.memory import format_bytes

        lines.append(f"loader memory {format_bytes(m.get('used_bytes'))} of budget "
                     f"{format_bytes(m.get('budget_bytes')) if m.get('budget_bytes') is not None else 'none'}  "
                     f"MemAvailable {format_bytes(m.get('available_bytes'))}  "
                     f"PSI memory {_fmt(m.get('pressure_pct'), '.0f')}%"
                     + (f"  {m['note']}" if m.get("note") else ""))
    n = doc.get("node") or {}
    if n:
        lines.append(f"loaders {'yield to the training processes' if n.get('loaders_yield') else 'weighted'}: "
                     f"{n.get('reason', '')}  (node CPU {_fmt(n.get('busy_cpu_cores'), '.2f')}, "
                     f"other processes {_fmt(n.get('foreign_cpu_cores'), '.2f')})")
    cols = [("JOB", 14), ("UID", 6), ("RANKS", 5), ("WORKERS", 7), ("CPUS", 5), ("MEM", 9), ("WAIT", 5),
            ("GPU-IDLE", 8), ("SAMPLES/S", 9), ("MAX-USEFUL", 10), ("REASON", 0)]
    lines.append("  ".join(name.ljust(w) if w else name for name, w in cols))
    for j in doc.get("jobs", []):
        workers = f"{j['workers']}" + (f"->{j['desired_workers']}" if j.get("desired_workers") not in (None, j["workers"]) else "")
        idle = _fmt(j.get("gpu_idle_frac"), ".0%")
        if j.get("gpu_idle_frac") is not None and j.get("gpu_idle_source") == "client":
            idle += "*"
        mem = j.get("loader_memory_bytes")
        row = [j["job"][:14], str(j["uid"]), str(j["ranks"]), workers, _fmt(j.get("cpus"), ".2f"),
               f"{mem / (1 << 20):.0f}M" if mem else "-", _fmt(j.get("data_wait_frac"), ".0%"), idle, _fmt(j.get("samples_per_s"), ".1f"),
               _fmt(j.get("max_useful_workers")), (j.get("reason") or "") + (
                   f" [unsatisfied: {j['unsatisfied']}]" if j.get("unsatisfied") else "") + (
                   f" [breaker: {j['breaker']}]" if j.get("breaker") else "")]
        lines.append("  ".join(c.ljust(w) if w else c for c, (_, w) in zip(row, cols)))
    if not doc.get("jobs"):
        lines.append("(no jobs)")
    elif any(j.get("gpu_idle_source") == "client" and j.get("gpu_idle_frac") is not None for j in doc["jobs"]):
        lines.append("* GPU idle estimated from the job's data wait (no NVML figure)")
    return "\n".join(lines)


def query(endpoint: str, timeout_s: float = 3.0) -> dict:
    """Ask the agent at ``endpoint`` for its status document. Raises ``RuntimeError`` (an
    ``agent.rpc.RequestError``) with a message that says what went wrong (no agent, no answer, refused)."""
    from adloader import protocol
    from agent import rpc

    # the status document may exceed MAX_MESSAGE_BYTES (many jobs): read it without the limit
    reply = rpc.request(endpoint, protocol.make("status"), timeout_s, expect="status", max_reply_bytes=None)
    return reply.get("doc") or {}
