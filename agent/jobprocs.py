"""Is a registered job still on this node? Find its processes in /proc, without asking Slurm.

The Slurm prolog registers a job before any of its processes exist, with no pids; the epilog releases
it. When the release never reaches the agent (agent down or hung while the epilog ran, which the
prolog/epilog contract allows), nothing else would ever tell the agent that the job has gone. Once a
rank has said hello the agent knows that rank's pid; before (and after the last rank has gone) it looks
for the job's processes here. A process belongs to Slurm job ``J`` when (any of):

- it is ``slurmstepd`` (``comm``) and its process title, which slurmstepd rewrites to
  ``slurmstepd: [J.batch]`` / ``[J.extern]`` / ``[J.0]`` (Slurm src/slurmd/slurmstepd/slurmstepd.c,
  ``_process_cmdline`` -> ``setproctitle("%s", step id)``), names ``J``; any owner: slurmstepd runs as root;
- it is owned by the job's uid and its cgroup path (``/proc/<pid>/cgroup``) has a component
  ``job_J`` (Slurm's cgroup plugins, v1 ``/slurm/uid_U/job_J/...`` and v2 ``.../job_J/...``; the name
  is matched, the path never built: Slurm 26.05 renames the v2 directories);
- it is owned by the job's uid and its initial environment (``/proc/<pid>/environ``, readable by root
  and by the owner) has ``SLURM_JOB_ID=J`` or ``ADLOADER_JOB_ID=J`` (what the TaskProlog exports).

Only processes of the job's own uid count for the last two (another user cannot keep someone's
registration alive by setting a variable), so a job registered for root (uid 0) also matches root's
processes. Non-Slurm job ids (``pid-...``, ``torchrun-...``, anything the ``register`` command was given)
match through ``ADLOADER_JOB_ID`` only in practice.

Cost: one ``stat`` per process, one ``comm`` read per root process, a ``cgroup`` and an ``environ``
read per process of a wanted uid; ``find_jobs`` is called at most once per ``SCAN_EVERY_S`` by the
registry, and only while some registered job has no live process it knows of. The pure parsers take
bytes/text so tests feed them without a /proc; ``find_jobs`` takes ``proc_root`` (a fake tree in tests).
"""
from __future__ import annotations

import os
import re
from typing import Mapping, Optional

SCAN_EVERY_S = 5.0

_STEPD_TITLE = re.compile(rb"^slurmstepd: \[([0-9]+)[.\]]")
_CGROUP_JOB = re.compile(r"(?:^|/)job_([0-9]+)(?=/|$)")
_ENV_KEYS = (b"SLURM_JOB_ID=", b"ADLOADER_JOB_ID=")


def slurmstepd_job(cmdline: bytes) -> Optional[str]:
    """The job id in a slurmstepd process title (``/proc/<pid>/cmdline``), else None.
    ``b"slurmstepd: [42.batch]\\0..."`` -> ``"42"``; ``b"slurmstepd: [42.extern]"`` -> ``"42"``."""
    m = _STEPD_TITLE.match(cmdline)
    return m.group(1).decode() if m else None


def cgroup_job_ids(text: str) -> set[str]:
    """Slurm job ids named by ``job_<id>`` path components in ``/proc/<pid>/cgroup`` (one line per
    hierarchy: ``hier-id:controllers:path``)."""
    out: set[str] = set()
    for line in text.splitlines():
        path = line.split(":", 2)[-1]
        out.update(_CGROUP_JOB.findall(path))
    return out


def environ_job_ids(environ: bytes) -> set[str]:
    """The values of ``SLURM_JOB_ID`` and ``ADLOADER_JOB_ID`` in ``/proc/<pid>/environ`` (NUL-separated)."""
    out: set[str] = set()
    for item in environ.split(b"\0"):
        for key in _ENV_KEYS:
            if item.startswith(key):
                value = item[len(key):].decode(errors="replace")
                if value:
                    out.add(value)
    return out


def _read(path: str, limit: int = 1 << 16) -> Optional[bytes]:
    try:
        with open(path, "rb") as f:
            return f.read(limit)
    except OSError:
        return None


def find_jobs(wanted: Mapping[str, int], proc_root: str = "/proc") -> set[str]:
    """Of ``wanted`` (job id -> owner uid), the jobs that have at least one process on this node (the
    rules in the module docstring). Never raises for a process that vanishes or cannot be read."""
    if not wanted:
        return set()
    uids = set(wanted.values())
    found: set[str] = set()
    try:
        entries = os.listdir(proc_root)
    except OSError:
        return found
    for name in entries:
        if not name.isdigit():
            continue
        base = os.path.join(proc_root, name)
        try:
            uid = os.stat(base).st_uid
        except OSError:
            continue
        if uid == 0:
            comm = _read(os.path.join(base, "comm"), 64)
            if comm is not None and comm.strip() == b"slurmstepd":
                job = slurmstepd_job(_read(os.path.join(base, "cmdline"), 4096) or b"")
                if job is not None and job in wanted:
                    found.add(job)
        if uid not in uids:
            continue
        ids: set[str] = set()
        cg = _read(os.path.join(base, "cgroup"))
        if cg is not None:
            ids |= cgroup_job_ids(cg.decode(errors="replace"))
        env = _read(os.path.join(base, "environ"), 1 << 20)
        if env is not None:
            ids |= environ_job_ids(env)
        found.update(j for j in ids if wanted.get(j) == uid)
        if len(found) == len(wanted):
            break
    return found
