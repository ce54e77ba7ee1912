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
                         ``agent.jobprocs``), pids_skipped (worker pids the actuators left alone since
                         start: the pid was no longer the worker the client reported, see
                         ``security.same_process``),
                         memory {budget_bytes (loader memory budget in force, null = none),
                         configured_bytes, used_bytes (all loaders' workers + batches in flight),
                         available_bytes (MemAvailable), pressure_pct (PSI memory some over the last
                         tick), under_pressure, note (why the budget in force is below the
                         configured one, "" if it is not)} (null before the first tick),
                         state_problems [str] (state files set aside, not writable, or a save of them
                         stuck: the file named),
                         connections {open, max_connections, per_uid, accepted, by_uid_top{uid: n},
                         refused_by_uid{uid: n}} (ordinary users' connections; null without ipc),
                         open_files_limit, message_budget_hits (message handling that yielded to the
                         loop), tick_late_ms {p50, max_recent (last 60 ticks), max (since start)}}
    node                the loaders together against the node: {loaders_yield (bool: the loaders' subtree
                         runs only on CPU the training processes leave idle), reason, busy_cpu_cores (the
                         node's CPU use), foreign_cpu_cores (of it, what the jobs' trainers, loaders and
                         the agent did not use), foreign_held_cpu_cores (the least of that over the last
                         3 s: what lasted), intermittent (bool: that load comes and goes and the subtree
                         keeps weighing through its gaps, ``foreign_intermittent``)} (null before the first
                         plan or under ``none``)
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
        workers             the job's loader worker target (reported by the clients, summed over its ranks)
        live_workers        the workers taking tasks at the ranks' latest reports (summed), null where a rank
                            does not say: below ``workers`` while a resize is under way, and until the next
                            epoch for an IterableDataset (its epoch's shards are fixed)
        requested_workers   the user's num_workers (summed over the ranks)
        max_workers         the loaders' bound (summed over the ranks), null if none
        cpus                CPU cores in force for the job's loader workers (null before any apply)
        cpu_weight          cores the job's CPU group weighs when not ``cpus`` (adaptive with the shares
                            knob: a job planned all the cores it can use weighs the loader CPUs), else null
        delivery            the factor its CPU weight carries over ``cpus`` so that it receives them (adaptive's
                            ``delivery_correction``; 1 = none), null before any apply
        extra_workers       of ``workers``, those over the plan's thread split because the job's workers received
                            less of its cores than the other CPU-bound jobs' (adaptive's ``delivery_workers``;
                            0 = none), null before any apply
        cpuset[]            exclusive CPUs in force, null if not pinned
        desired_workers     what the last plan wants (may differ from workers while a directive travels)
        desired_cpus
        data_wait_frac      share of step time blocked on data (max over ranks), 0..1
        gpu_idle_frac       GPU idle share, 0..1, null before data
        gpu_idle_source     "nvml" (driver) or "client" (data_wait_frac stands in)
        samples_per_s       summed over ranks
        compute_s_per_step  mean over ranks
        away_s              how long its training loop has been out of its loader's next() (a validation
                            pass, a checkpoint save; 0 while it steps or waits for data), the least over its
                            ranks by their latest reports: adaptive plans it its least cores from
                            ``release_away_s`` (10 s) on, until it steps again
        samples_per_step    the job's batch size in its last window: the samples its loaders delivered over
                            the steps they took (``agent.collector``, the ranks' together), null where the
                            window's own figure is not taken (the reported batch size stands) or before a window
        batch_size_note     why that window's batch size is not taken (``predictor.bank.window_batch_size``: no
                            step in the window, under one sample a step, more than ``BATCH_SIZE_DISAGREE``
                            times off the reported batch size, ...), "" where it is taken or before a window
        worker_cpu_cores    CPU cores the job's workers used
        trainer_cpu_cores   CPU cores the job's training processes themselves used
        job_cpu_cores       CPU cores the job used in all, as its clients count it: its processes' CPU
                            whatever they run (a validation pass, a checkpoint save) and every process
                            they started (every loader's workers, torch's too); 0 where a client does
                            not count it
        away_cpu_cores      while its loop is away: that figure from the reports inside the pause only, the
                            most over any 3 s of them (null when not away or not known yet): what a
                            validation pass uses; adaptive lends an away job's cores only under 0.1
                            beyond its trainers' reserve
        trainer_cores_needed  what they need at full speed (CPU per step / compute per step), kept
                            out of the loaders' budget by adaptive
        max_useful_workers  the predictor's estimate (null before its first curve)
        max_useful_cores
        curve_confidence    0..1
        phase_changes       how often the predictor found a new pipeline in the job's windows and dropped
                            its earlier ones (``predictor.bank``), 0 before its first curve
        supply_cap_samples_per_s  what the job's data source was measured to give at most, however many
                            workers read it (``predictor.bank``, "Supply cap"): its curve stops there;
                            null where none was seen
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
        loader_memory_bytes the job's loader memory: its workers' unique memory + batches in flight, every
                            loader's (its validation loaders' too)
        other_loader_memory_bytes  of that, what the loaders the agent does not size hold (a validation
                            loader's workers, A-Dloader's or torch's own): the policy plans the sized
                            loaders' workers within the budget less it (each job's counted up to its
                            share of the budget)
        worker_memory_bytes one worker's cost (mean USS + its share of the batches in flight; never below the
                            most one cost since the job's loaders started: workers grow as they read)
        worker_growth_bytes mean growth of a worker's unique memory since it started (copy-on-read)
"""
from __future__ import annotations

import math
from typing import Any, Optional

from agent.model import live_workers

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
            "workers": sum(r.workers for r in job.ranks.values()),            # the job's: all its ranks'
            "live_workers": live_workers(st) if st is not None else None,
            "requested_workers": sum(r.requested_workers for r in job.ranks.values()),
            "max_workers": st.max_workers if st is not None else None,
            "cpus": _r(a.cpus) if a is not None else None,
            "cpu_weight": _r(a.cpu_weight) if a is not None and a.cpu_weight is not None else None,
            "delivery": _r(a.delivery) if a is not None else None,
            "extra_workers": a.extra_workers if a is not None else None,
            "cpuset": list(a.cpuset) if a is not None and a.cpuset else None,
            "desired_workers": desired.workers if desired is not None else None,
            "desired_cpus": _r(desired.cpus) if desired is not None else None,
            "data_wait_frac": _r(st.data_wait_frac) if st is not None else None,
            "gpu_idle_frac": _r(st.gpu_idle_frac) if st is not None else None,
            "gpu_idle_source": st.gpu_idle_source if st is not None else "client",
            "samples_per_s": _r(st.samples_per_s, 2) if st is not None else None,
            "compute_s_per_step": _r(st.compute_s_per_step) if st is not None else None,
            "away_s": _r(st.away_s, 1) if st is not None else None,
            "samples_per_step": _r(st.samples_per_step, 3) if st is not None else None,
            "batch_size_note": st.samples_per_step_note if st is not None else "",
            "worker_cpu_cores": _r(st.worker_cpu_cores, 3) if st is not None else None,
            "trainer_cpu_cores": _r(st.trainer_cpu_cores, 3) if st is not None else None,
            "job_cpu_cores": _r(st.job_cpu_cores, 3) if st is not None else None,
            "away_cpu_cores": _r(st.away_cpu_cores, 3) if st is not None and st.away_cpu_cores is not None else None,
            "trainer_cores_needed": _r(trainer_need(st), 3) if st is not None else None,
            "max_useful_workers": curve.get("max_useful_workers"),
            "max_useful_cores": _r(curve.get("max_useful_cores")),
            "curve_confidence": _r(curve.get("confidence"), 3),
            "phase_changes": int(curve.get("phase_changes") or 0),
            "supply_cap_samples_per_s": _r(curve.get("supply_cap_samples_per_s"), 2),
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
            "other_loader_memory_bytes": _r(st.other_loader_memory_bytes, 0) if st is not None else None,
            "worker_memory_bytes": _r(st.worker_memory_bytes, 0) if st is not None else None,
            "worker_growth_bytes": _r(st.worker_growth_bytes, 0) if st is not None else None,
        })
    node = None
    if plan is not None and plan.node is not None:
        node = {"loaders_yield": plan.node.loaders_yield, "reason": plan.node.reason,
                "intermittent": plan.node.intermittent,
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


MISSING = object()   # a field the document does not have: shown as "?" ("-" is a field that is null)


def _get(d: Any, key: str) -> Any:
    return d.get(key, MISSING) if isinstance(d, dict) else MISSING


def _number(v: Any) -> Optional[float]:
    """``v`` as a number if it is one, or text that is one (an agent of another version); else None."""
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return v
    if isinstance(v, str):
        try:
            x = float(v)
        except ValueError:
            return None
        return x if math.isfinite(x) else None
    return None


def _fmt(v: Any, spec: str = "") -> str:
    """One cell: "?" for a missing field or a value of the wrong kind, "-" for null, else the value
    (formatted with ``spec`` when it is a number)."""
    if v is MISSING:
        return "?"
    if v is None:
        return "-"
    if spec:
        x = _number(v)
        if x is None:
            return "?"
        return format(float(x), spec)
    return str(v)


def _job_cell(v: Any) -> str:
    """The JOB cell: the id whole, on one line (an id from a broken or other agent that holds a control
    character, a newline, shows it escaped, as ``repr`` writes it, rather than breaking the table)."""
    text = _fmt(v)
    return text if text.isprintable() else repr(text)[1:-1]


def _count(v: Any) -> str:
    """A count (uid, ranks, workers): an integer, or "?"."""
    x = _number(v)
    if v is None:
        return "-"
    if x is None or x != int(x):
        return "?"
    return str(int(x))


def version_note(doc: Any) -> str:
    """One line when the document's version (``STATUS_VERSION``) or its agent's protocol major is not the
    one this client knows ("" when both are): the table may then miss fields or misread them."""
    from adloader import protocol

    version = _get(doc, "version")
    proto = _get(_get(doc, "agent"), "protocol")
    major = str(proto).split(".")[0] if isinstance(proto, str) else None
    if version == STATUS_VERSION and (proto is MISSING or major == str(protocol.MAJOR)):
        return ""
    return (f"note: status document version {_fmt(version)}, agent protocol {_fmt(proto)}; this adloader reads "
            f"status version {STATUS_VERSION}, protocol {protocol.VERSION}: fields shown ? are missing or "
            f"unreadable (run the same adloader version as the agent)")


def render_table(doc: dict) -> str:
    """The human view: one header block for the agent, one row per job. A document from an agent of
    another version, or a broken one, is rendered as far as it goes: a missing or unusable field is "?"."""
    a = _get(doc, "agent")
    a = a if isinstance(a, dict) else {}
    g = lambda key: _get(a, key)   # noqa: E731
    lines = [
        f"agent pid {_fmt(g('pid'))}  policy {_fmt(g('policy'))}  tick {_fmt(g('tick_s'))}s "
        f"(last {_fmt(g('last_tick_ms'), '.2f')} ms)  loader CPUs {_fmt(g('loader_cpus'), 'g')}"
        + (f" (in force {_fmt(g('loader_cpus_in_force'), 'g')})"
           if g("loader_cpus_in_force") not in (None, MISSING, g("loader_cpus")) else "") + "  "
        f"cgroups {_fmt(g('cgroup_mode'))}  GPU figures from {_fmt(g('gpu_source'))}  "
        f"uptime {_fmt(g('uptime_s'), '.0f')}s",
    ]
    note = version_note(doc)
    if note:
        lines.append(note)
    m = g("memory")
    if isinstance(m, dict) and m:
        from adloader.memory import format_bytes

        def size(key: str) -> str:
            v = _get(m, key)
            return "?" if v is MISSING or (v is not None and _number(v) is None) else format_bytes(_number(v))

        lines.append(f"loader memory {size('used_bytes')} of budget "
                     f"{size('budget_bytes') if _get(m, 'budget_bytes') is not None else 'none'}  "
                     f"MemAvailable {size('available_bytes')}  "
                     f"PSI memory {_fmt(_get(m, 'pressure_pct'), '.0f')}%"
                     + (f"  {m['note']}" if m.get("note") else ""))
    n = _get(doc, "node")
    if isinstance(n, dict) and n:
        lines.append(f"loaders {'yield to the training processes' if n.get('loaders_yield') else 'weighted'}: "
                     f"{n.get('reason', '')}  (node CPU {_fmt(_get(n, 'busy_cpu_cores'), '.2f')}, "
                     f"other processes {_fmt(_get(n, 'foreign_cpu_cores'), '.2f')})")
    jobs = _get(doc, "jobs")
    jobs = jobs if isinstance(jobs, list) else []
    # the JOB column as wide as the longest id (up to 128 characters, protocol.check_job_id): cut to 14,
    # torchrun-4012345 and torchrun-4012399 (two jobs of one node) were both "torchrun-40123"
    ids = {id(j): _job_cell(_get(j, "job")) for j in jobs if isinstance(j, dict)}
    cols = [("JOB", max([14, *map(len, ids.values())])), ("UID", 6), ("RANKS", 5), ("WORKERS", 7), ("CPUS", 5), ("MEM", 9), ("WAIT", 5),
            ("GPU-IDLE", 8), ("SAMPLES/S", 9), ("MAX-USEFUL", 10), ("REASON", 0)]
    lines.append("  ".join(name.ljust(w) if w else name for name, w in cols))
    shown = 0
    for j in jobs:
        if not isinstance(j, dict):
            continue
        shown += 1
        g = lambda key: _get(j, key)   # noqa: E731
        workers = _count(g("workers"))
        if g("desired_workers") not in (None, MISSING, g("workers")):
            workers += f"->{_count(g('desired_workers'))}"
        if g("live_workers") not in (None, MISSING, g("workers")):     # a resize not (yet) in force
            workers += f" (live {_count(g('live_workers'))})"
        idle = _fmt(g("gpu_idle_frac"), ".0%")
        if g("gpu_idle_frac") not in (None, MISSING) and g("gpu_idle_source") == "client":
            idle += "*"
        mem = g("loader_memory_bytes")
        mem_cell = "-" if mem in (None, 0) else "?" if _number(mem) is None else f"{_number(mem) / (1 << 20):.0f}M"
        reason = g("reason")
        row = [ids[id(j)], _count(g("uid")), _count(g("ranks")), workers, _fmt(g("cpus"), ".2f"),
               mem_cell, _fmt(g("data_wait_frac"), ".0%"), idle, _fmt(g("samples_per_s"), ".1f"),
               _fmt(g("max_useful_workers")), ("" if reason in (None, MISSING) else str(reason)) + (
                   f" [unsatisfied: {j['unsatisfied']}]" if j.get("unsatisfied") else "") + (
                   f" [breaker: {j['breaker']}]" if j.get("breaker") else "")]
        lines.append("  ".join(c.ljust(w) if w else c for c, (_, w) in zip(row, cols)))
    if not shown:
        lines.append("(no jobs)")
    elif any(isinstance(j, dict) and j.get("gpu_idle_source") == "client" and j.get("gpu_idle_frac") is not None
             for j in jobs):
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
