"""The agent's journal: applied allocations and the job registry, so a restarted agent can adopt.

One JSON file, ``<state_dir>/journal.json``, replaced atomically (write a temp file in the same
directory, fsync it, rename over the old one, fsync the directory): a reader sees the old or the new
journal, never a torn one, even if the agent is killed with SIGKILL mid-write.

Document (``JOURNAL_VERSION`` 1):
    {"version": 1, "written_at": <UNIX s>, "agent_pid": <pid>,
     "applied": {job: JobAllocation fields}, "jobs": Registry.to_doc()}

``load`` returns None for a missing journal. Every field is checked by type (``_check_alloc``,
``_check_job``): an entry that fails is dropped and named in ``problems``; a file that cannot be
parsed at all (corrupt, torn by an old agent, newer major version, wrong types at the top) is
quarantined (``statefile.quarantine``: renamed ``journal.json.bad-<time>``) and the last good copy
``journal.json.prev`` (kept by every write) is tried instead. What was set aside is returned in
``problems`` (the daemon reports it in ``status`` as ``agent.state_problems``); the agent starts
in every case.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from typing import Optional

from adloader import protocol
from agent import logs, statefile
from agent.model import JobAllocation
from agent.statefile import StateFileError, is_int, is_num, need

JOURNAL_VERSION = 1
FILENAME = "journal.json"
log = logging.getLogger("agent.journal")


def path_in(state_dir: str) -> str:
    return os.path.join(state_dir, FILENAME)


write_atomic = statefile.write_atomic


_ALLOC_FIELDS = tuple(f.name for f in dataclasses.fields(JobAllocation))


def alloc_to_dict(a: JobAllocation) -> dict:
    # (not dataclasses.asdict: its deep copy was most of a journal write's cost with many jobs)
    d = {k: getattr(a, k) for k in _ALLOC_FIELDS}
    if d.get("cpuset") is not None:
        d["cpuset"] = list(d["cpuset"])
    return d


def alloc_from_dict(d: dict) -> JobAllocation:
    names = {f.name for f in dataclasses.fields(JobAllocation)}
    kw = {k: v for k, v in d.items() if k in names}
    if kw.get("cpuset") is not None:
        kw["cpuset"] = tuple(kw["cpuset"])
    return JobAllocation(**kw)


def _check_alloc(p: str, job: str, a) -> JobAllocation:
    w = f"applied[{str(job)[:64]!r}]"
    need(protocol.check_job_id(job) is None, p, "a job id", "valid (protocol.check_job_id)", job)
    need(isinstance(a, dict), p, w, "an object", a)
    need(a.get("job", job) == job, p, f"{w}.job", f"{job!r}", a.get("job"))
    need(is_int(a.get("workers"), 0, 1_000_000), p, f"{w}.workers", "an integer >= 0", a.get("workers"))
    need(is_num(a.get("cpus")) and a["cpus"] >= 0, p, f"{w}.cpus", "a number >= 0", a.get("cpus"))
    cs = a.get("cpuset")
    need(cs is None or (isinstance(cs, list) and all(is_int(c, 0, 1 << 20) for c in cs)), p, f"{w}.cpuset",
         "null or a list of CPU numbers", cs)
    need(a.get("io_weight") is None or is_int(a.get("io_weight"), 1, 10000), p, f"{w}.io_weight",
         "null or an integer", a.get("io_weight"))
    need(a.get("cpu_weight") is None or (is_num(a.get("cpu_weight")) and a["cpu_weight"] > 0), p,
         f"{w}.cpu_weight", "null or a number > 0", a.get("cpu_weight"))
    need(isinstance(a.get("reason", ""), str), p, f"{w}.reason", "a string", a.get("reason"))
    need(isinstance(a.get("enforce_cpu", True), bool), p, f"{w}.enforce_cpu", "true or false", a.get("enforce_cpu"))
    need(a.get("budget") is None or (is_num(a.get("budget")) and a["budget"] >= 0), p, f"{w}.budget",
         "null or a number >= 0", a.get("budget"))
    need(is_num(a.get("delivery", 1.0)) and a.get("delivery", 1.0) >= 1.0, p, f"{w}.delivery", "a number >= 1",
         a.get("delivery"))
    need(is_int(a.get("extra_workers", 0), 0, 1_000_000), p, f"{w}.extra_workers", "an integer >= 0",
         a.get("extra_workers"))
    return alloc_from_dict(dict(a, job=job))


_DIRECTIVE_FIELDS = ("workers", "cpus", "cpuset", "reason", "ranks")   # Job.last_directive (agent.server.send_directive)
_RANK_INTS = {"pid": (1, 2 ** 31), "uid": (0, 2 ** 32), "batch_size": (1, 10 ** 9), "workers": (0, 10 ** 6),
              "requested_workers": (0, 10 ** 6), "world_size": (1, 10 ** 9), "local_rank": (0, 10 ** 9)}


def _check_job(p: str, job: str, j) -> dict:
    """A registry entry (``Registry.to_doc``) with every field the registry reads checked by type."""
    w = f"jobs[{job[:64]!r}]"
    need(protocol.check_job_id(job) is None, p, "a job id", "valid (protocol.check_job_id)", job)
    need(isinstance(j, dict), p, w, "an object", j)
    need(is_int(j.get("uid"), 0, 2 ** 32), p, f"{w}.uid", "a uid", j.get("uid"))
    for key in ("registered", "by_root"):
        need(isinstance(j.get(key, False), bool), p, f"{w}.{key}", "true or false", j.get(key))
    need(is_int(j.get("seq", 0), 0), p, f"{w}.seq", "an integer >= 0", j.get("seq"))
    need(isinstance(j.get("reg_gpus") or [], list) and all(isinstance(g, str) for g in j.get("reg_gpus") or []),
         p, f"{w}.reg_gpus", "a list of strings", j.get("reg_gpus"))
    need(j.get("reg_cpus") is None or is_int(j.get("reg_cpus"), 1, 10 ** 6), p, f"{w}.reg_cpus",
         "null or a positive integer", j.get("reg_cpus"))
    rp = j.get("reg_pids") or {}
    need(isinstance(rp, dict) and all(statefile.int_key(k) and (v is None or is_int(v, 0)) for k, v in rp.items()),
         p, f"{w}.reg_pids", "an object of pid -> start ticks", rp)
    ld = j.get("last_directive")
    need(ld is None or isinstance(ld, dict), p, f"{w}.last_directive", "null or an object", ld)
    if ld is not None:   # (sent as it is, a directive's fields, to each rank that says hello)
        dw = f"{w}.last_directive"
        need(set(ld) <= set(_DIRECTIVE_FIELDS), p, dw, f"an object of {', '.join(_DIRECTIVE_FIELDS)}", ld)
        need(is_int(ld.get("workers"), 0, 1_000_000), p, f"{dw}.workers", "an integer >= 0", ld.get("workers"))
        need(ld.get("cpus") is None or (is_num(ld["cpus"]) and ld["cpus"] >= 0), p, f"{dw}.cpus",
             "null or a number >= 0", ld.get("cpus"))
        cs = ld.get("cpuset")
        need(cs is None or (isinstance(cs, list) and all(is_int(c, 0, 1 << 20) for c in cs)), p, f"{dw}.cpuset",
             "null or a list of CPU numbers", cs)
        need(isinstance(ld.get("reason", ""), str), p, f"{dw}.reason", "a string", ld.get("reason"))
        need(is_int(ld.get("ranks", 0), 0, 1_000_000), p, f"{dw}.ranks", "an integer >= 0", ld.get("ranks"))
    ranks = j.get("ranks") or {}
    need(isinstance(ranks, dict), p, f"{w}.ranks", "an object", ranks)
    for rk, r in ranks.items():
        rw = f"{w}.ranks[{rk[:16]!r}]"
        need(statefile.int_key(rk), p, rw, "keyed by a rank number", rk)
        need(isinstance(r, dict), p, rw, "an object", r)
        for key, (lo, hi) in _RANK_INTS.items():
            if key in ("pid", "uid") or r.get(key) is not None:
                need(is_int(r.get(key), lo, hi), p, f"{rw}.{key}", f"an integer in [{lo}, {hi}]", r.get(key))
        need(r.get("start_ticks") is None or is_int(r.get("start_ticks"), 0), p, f"{rw}.start_ticks",
             "null or an integer", r.get("start_ticks"))
        need(r.get("max_workers") is None or is_int(r.get("max_workers"), 0, 10 ** 6), p, f"{rw}.max_workers",
             "null or an integer", r.get("max_workers"))
        wp = r.get("worker_pids") or []
        need(isinstance(wp, list) and all(is_int(x, 1, 2 ** 31) for x in wp), p, f"{rw}.worker_pids",
             "a list of pids", wp)
        ws = r.get("worker_start_ticks") or {}
        need(isinstance(ws, dict) and all(statefile.int_key(k) and (v is None or is_int(v, 0)) for k, v in ws.items()),
             p, f"{rw}.worker_start_ticks", "an object of pid -> start ticks", ws)
        g = r.get("gpus") or []
        need(isinstance(g, list) and all(isinstance(x, str) for x in g), p, f"{rw}.gpus", "a list of strings", g)
    return j


def save(state_dir: str, applied: dict, jobs_doc: dict) -> None:
    doc = {"version": JOURNAL_VERSION, "written_at": time.time(), "agent_pid": os.getpid(),
           "applied": {j: alloc_to_dict(a) for j, a in applied.items()}, "jobs": jobs_doc}
    write_atomic(path_in(state_dir), json.dumps(doc, separators=(",", ":")).encode())


def _read(p: str) -> dict:
    """Parse and check one journal file; raises StateFileError (naming the file) or OSError."""
    try:
        with open(p, "rb") as f:
            doc = json.loads(f.read())
    except (ValueError, RecursionError) as e:
        raise StateFileError(f"{p}: not valid JSON ({e})") from None
    need(isinstance(doc, dict), p, "the document", "an object", type(doc).__name__)
    need(is_int(doc.get("version")) and doc["version"] == JOURNAL_VERSION, p, "version", f"{JOURNAL_VERSION}",
         doc.get("version"))     # (is_int: JSON's true and 1.0 equal 1 in Python, and are no version)
    for key in ("applied", "jobs"):
        need(doc.get(key) is None or isinstance(doc.get(key), dict), p, key, "an object", doc.get(key))
    need(doc.get("agent_pid") is None or is_int(doc.get("agent_pid"), 1), p, "agent_pid", "a pid", doc.get("agent_pid"))
    return doc


def agent_pid(state_dir: str) -> Optional[int]:
    """The pid of the agent that last wrote the journal, read only (nothing is set aside): None if there
    is none or it cannot be read. For messages only: the pid may be another process's by now."""
    try:
        with open(path_in(state_dir), "rb") as f:
            pid = json.loads(f.read()).get("agent_pid")
    except (OSError, ValueError, RecursionError, AttributeError):
        return None
    return pid if is_int(pid, 1) else None


def load(state_dir: str) -> Optional[dict]:
    """``{"applied": {job: JobAllocation}, "jobs": {...}, "agent_pid", "problems": [str]}``, or None when
    there is no journal (module docstring: what is checked, what is set aside)."""
    p = path_in(state_dir)
    problems: list[str] = []
    doc = None
    statefile.remove_stale_temps(p)     # (the agent holds the state directory's lock: no writer but itself)
    for candidate in (p, p + ".prev"):
        try:
            doc = _read(candidate)
        except FileNotFoundError:
            continue
        except (OSError, StateFileError) as e:
            moved = statefile.quarantine(candidate) if isinstance(e, StateFileError) else None
            problems.append(f"{e}" + (f"; set aside as {moved}" if moved else ""))
            logs.event(log, "journal_unusable", logging.ERROR, path=candidate, error=str(e), quarantined=moved)
            continue
        if candidate != p:
            problems.append(f"{p} was unusable; the previous copy {candidate} was adopted instead")
        break
    if doc is None:
        return {"applied": {}, "jobs": {}, "agent_pid": None, "problems": problems} if problems else None
    applied, jobs = {}, {}
    for j, a in (doc.get("applied") or {}).items():
        try:
            applied[j] = _check_alloc(p, j, a)
        except (StateFileError, TypeError, ValueError) as e:
            problems.append(str(e))
            logs.event(log, "journal_entry_skipped", logging.WARNING, job=str(j)[:64], path=p, error=str(e))
    for j, entry in (doc.get("jobs") or {}).items():
        try:
            jobs[j] = _check_job(p, j, entry)
        except StateFileError as e:
            problems.append(str(e))
            logs.event(log, "journal_entry_skipped", logging.WARNING, job=str(j)[:64], path=p, error=str(e))
    return {"applied": applied, "jobs": jobs, "agent_pid": doc.get("agent_pid"), "problems": problems}
