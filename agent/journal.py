"""The agent's journal: applied allocations and the job registry, so a restarted agent can adopt.

One JSON file, ``<state_dir>/journal.json``, replaced atomically (write a temp file in the same
directory, fsync it, rename over the old one, fsync the directory): a reader sees the old or the new
journal, never a torn one, even if the agent is killed with SIGKILL mid-write.

Document (``JOURNAL_VERSION`` 1):
    {"version": 1, "written_at": <UNIX s>, "agent_pid": <pid>,
     "applied": {job: JobAllocation fields}, "jobs": Registry.to_doc()}

``load`` returns None for a missing journal, and None with one log line for an unreadable, corrupt
or newer-major one (the agent then starts empty; live clients say hello again by themselves).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from typing import Optional

from agent import logs
from agent.model import JobAllocation

JOURNAL_VERSION = 1
FILENAME = "journal.json"
log = logging.getLogger("agent.journal")


def path_in(state_dir: str) -> str:
    return os.path.join(state_dir, FILENAME)


def write_atomic(path: str, data: bytes, mode: int = 0o600) -> None:
    d = os.path.dirname(path) or "."
    tmp = os.path.join(d, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


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


def save(state_dir: str, applied: dict, jobs_doc: dict) -> None:
    doc = {"version": JOURNAL_VERSION, "written_at": time.time(), "agent_pid": os.getpid(),
           "applied": {j: alloc_to_dict(a) for j, a in applied.items()}, "jobs": jobs_doc}
    write_atomic(path_in(state_dir), json.dumps(doc, separators=(",", ":")).encode())


def load(state_dir: str) -> Optional[dict]:
    """The journal as ``{"applied": {job: JobAllocation}, "jobs": {...}}``, or None."""
    p = path_in(state_dir)
    try:
        with open(p, "rb") as f:
            doc = json.loads(f.read())
        if not isinstance(doc, dict) or int(doc.get("version", 0)) != JOURNAL_VERSION:
            raise ValueError(f"journal version {doc.get('version') if isinstance(doc, dict) else '?'} "
                             f"is not {JOURNAL_VERSION}")
        applied = {}
        for j, a in (doc.get("applied") or {}).items():
            try:
                applied[j] = alloc_from_dict(a)
            except (TypeError, ValueError):
                logs.event(log, "journal_entry_skipped", logging.WARNING, job=j, path=p)
        return {"applied": applied, "jobs": doc.get("jobs") or {}, "agent_pid": doc.get("agent_pid")}
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, AttributeError) as e:
        logs.event(log, "journal_unreadable", logging.WARNING, path=p, error=str(e),
                   detail="starting with no jobs; live clients will say hello again")
        return None
