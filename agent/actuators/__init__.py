"""Actuators: what turns a desired ``JobAllocation`` into the system's state, one narrow interface each.

    class Actuator(Protocol):
        name: str
        def apply(self, job: JobStats, desired: JobAllocation) -> ApplyResult: ...
        def release(self, job_id: str) -> None: ...      # job left: remove what we made for it
        def restore(self) -> None: ...                   # agent stops: put back every original value

Only the controller calls them, and only with the difference between desired and applied state.
An actuator with ``tracks_pids = True`` (cgroup, affinity) is also called when the job's loader worker
pids changed since its last apply (resizes, restarts), so new workers join the job's group; one with
``tracks_ranks = True`` (the directive) when the job's training processes changed (ranks joined or left).
One with a ``lost_group(job_id) -> bool`` method (cgroup) is called again with the same allocation when
that says what it made for the job is gone (its group removed by an admin or a systemd reset).

Implementations: ``DirectiveActuator`` (worker count, to the job's clients), ``cgroup.CgroupActuator``
(v1 through cgroupspy, v2 through interface files), ``cgroup.AffinityActuator`` (cooperative mode).
An actuator never raises out of ``apply``: failures come back as ``ApplyResult(ok=False, error=...)``.
A call that may block (a cgroup write on a wedged kernel path) is bounded by the controller: each
actuator is called on a thread of its own and waited for at most ``actuator_timeout_s``
(``agent.controller.ActuatorLane``), never from two threads at once; one that never blocks and must stay
on the service loop's thread says ``may_block = False`` (the directive actuator).
"""
from __future__ import annotations

import logging
import os
from typing import Optional, Protocol, runtime_checkable

from agent.model import ApplyResult, JobAllocation, JobStats


@runtime_checkable
class Actuator(Protocol):
    name: str

    def apply(self, job: JobStats, desired: JobAllocation) -> ApplyResult: ...

    def release(self, job_id: str) -> None: ...

    def restore(self) -> None: ...


from agent.actuators.directive import DirectiveActuator  # noqa: E402  (re-exported)

class SubtreeInUse(RuntimeError):
    """Another live agent on this node holds the same cgroup subtree (``cgroup.SubtreeClaim``). Not a
    ``CgroupError``: ``cgroup_mode = "auto"`` must not fall back to ``off`` because of it. (Here, not in
    ``cgroup``: the daemon catches it in every mode, and mode ``off`` imports nothing of the cgroups.)"""


# the one list of each: config validation and every command's argparse choices read these
MODES = ("auto", "v1", "v2", "cooperative", "off")
CPU_KNOBS = ("shares", "quota", "cpuset")


def build(mode: str, *, sink, cgroup_root: str = "/sys/fs/cgroup", cpu_knob: str = "shares",
          io: bool = True, subtree: str = "adloader", state_dir: Optional[str] = None,
          sys_root: str = "/sys", proc_root: str = "/proc", problems: Optional[list] = None,
          lock_dir: Optional[str] = None) -> list:
    """The actuators for a cgroup mode; the directive actuator (worker counts) always comes first.

    - ``off``: worker counts only.
    - ``v1`` / ``v2``: plus a ``CgroupActuator`` on that hierarchy (cooperative jobs get CPU affinity).
    - ``cooperative``: plus an ``AffinityActuator`` (Slurm owns the cgroups; no cgroup writes).
    - ``auto``: the layout as systemd documents it: unified -> v2 (when its cpu controller is there),
      hybrid or legacy -> v1 (when the v1 cpu hierarchy is writable), else worker counts only.

    ``cpu_knob`` (default ``shares``, work-conserving; ``quota`` caps hard; ``cpuset`` pins, with
    ``PolicyConfig.pin_cpusets``). With ``state_dir`` the journal of originals lives in
    ``<state_dir>/cgroup-originals.json``, so a restarted agent restores what a dead one changed.
    A journal of originals that cannot be trusted (``StateFileError``: corrupt, truncated, wrong types)
    is set aside (``statefile.quarantine``) and its last good copy ``.prev`` adopted where that one
    loads (``_recover_originals``), said in ``problems``; the subtree and the groups found in it that
    the adopted journal does not list are taken as the dead agent's (``CgroupActuator.adopt_orphans``),
    so they are emptied (their processes to the hierarchy's root, where the journal does not say where
    they came from) and removed as jobs leave or on stop; a subtree that cannot be removed gets a new
    group's CPU values back (no cap). The mode is never changed because of it: ``auto`` does not fall
    back to ``off``.

    ``lock_dir`` (the agent: ``adloader.env.runtime_dir()``): the cgroup actuator claims its subtree
    there (``cgroup.SubtreeClaim``) before it reads or writes a group; another live agent holding the
    same subtree raises ``SubtreeInUse`` naming both (whatever the mode: ``auto`` does not fall
    back to ``off``). Without it (tests, the simulator) nothing is claimed.
    """
    if mode not in MODES:
        raise ValueError(f"unknown cgroup mode {mode!r}; choose one of: {', '.join(MODES)}")
    if cpu_knob not in CPU_KNOBS:
        raise ValueError(f"unknown cpu_knob {cpu_knob!r}; choose one of: {', '.join(CPU_KNOBS)}")
    actuators: list = [DirectiveActuator(sink)]
    if mode == "off":
        return actuators             # worker counts only: nothing that touches cgroups is even imported
    from agent import cgroupfs
    from agent.actuators.cgroup import AffinityActuator, CgroupActuator
    from agent.actuators.originals import Originals

    from agent import statefile

    problems = problems if problems is not None else []
    orig_path = os.path.join(state_dir, "cgroup-originals.json") if state_dir else None
    orphans = False
    try:
        originals = Originals(orig_path)
    except statefile.StateFileError as e:
        originals = _recover_originals(orig_path, e, problems)
        orphans = True
    affinity = AffinityActuator(originals, proc_root=proc_root)
    if mode == "cooperative":
        return actuators + [affinity]
    if mode == "auto":
        mode = resolve_auto(cgroup_root, proc_root)
        if mode == "off":
            return actuators
    version = 2 if mode == "v2" else 1
    if version == 2 and not os.path.isfile(os.path.join(cgroup_root, "cgroup.controllers")):
        raise cgroupfs.NotSupported(f"{cgroup_root} is not a cgroup v2 hierarchy (no cgroup.controllers there); "
                                    f"use cgroup_mode auto, v1 or off, or set cgroup_root to the cgroup2 mount")
    hierarchies = cgroupfs.open_hierarchies(cgroup_root, version, proc_root=proc_root)
    act = CgroupActuator(hierarchies, version=version, cpu_knob=cpu_knob, io=io, subtree=subtree,
                         originals=originals, sys_root=sys_root, proc_root=proc_root, affinity=affinity)
    if lock_dir:
        try:
            act.claim_subtree(lock_dir, owner=state_dir or "(none)")
        except OSError as e:       # a runtime directory this agent cannot write: run, unguarded, and say so
            problems.append(f"cgroup subtree not claimed (another agent on {subtree!r} would not be "
                            f"refused): {lock_dir}: {e.strerror or e}")
    try:
        if orphans:
            found = act.adopt_orphans()
            if found:
                problems.append(f"found {len(found)} group(s) of a previous agent: {', '.join(found[:10])}")
    except BaseException:
        act.release_subtree()
        raise
    actuators.append(act)
    return actuators


def _recover_originals(path: str, error: Exception, problems: list):
    """The journal of originals at ``path`` failed to load (``error``): set it aside and adopt the last
    good copy ``<path>.prev`` (kept by every save, ``statefile.write_atomic``), itself set aside if it
    fails too; with neither, an empty journal. Each step is said in ``problems`` and logged. Raises
    ``error`` when the file cannot even be set aside (it would be read, and fail, at every start).

    The copy is one save behind at most: a group made or a process moved by that last save is not in
    it, so the caller still takes what it finds in the subtree and the copy does not list
    (``CgroupActuator.adopt_orphans``); what the copy holds (where each moved process came from, the
    original values) is put back as the dead agent would have. Before, the whole journal was lost:
    every process went back to the hierarchy's root."""
    from agent import logs, statefile
    from agent.actuators.originals import Originals

    log = logging.getLogger("agent.actuators")
    moved = statefile.quarantine(path)
    logs.event(log, "originals_unusable", logging.ERROR, path=path, error=str(error), quarantined=moved)
    if moved is None:
        problems.append(f"{error}; it could not be set aside")
        raise error
    prev = path + ".prev"
    if os.path.exists(prev):
        try:
            originals = Originals(path, read_from=prev)
        except statefile.StateFileError as e2:
            moved_prev = statefile.quarantine(prev)
            logs.event(log, "originals_unusable", logging.ERROR, path=prev, error=str(e2), quarantined=moved_prev)
            problems.append(f"{error}; set aside as {moved}; the previous copy is unusable too ({e2}"
                            + (f"; set aside as {moved_prev}" if moved_prev else "")
                            + "); the subtree and the groups still in it are emptied and removed")
        else:
            originals.save()          # the adopted copy becomes the journal (and its own .prev)
            logs.event(log, "originals_previous_adopted", logging.WARNING, path=path, previous=prev)
            problems.append(f"{error}; set aside as {moved}; the previous copy {prev} was adopted instead "
                            f"(one save behind at most: groups it does not list are emptied and removed)")
            return originals
    else:
        problems.append(f"{error}; set aside as {moved}; the subtree and the groups still in it are emptied and removed")
    return Originals(path)


def resolve_auto(cgroup_root: str = "/sys/fs/cgroup", proc_root: str = "/proc") -> str:
    """'v1', 'v2' or 'off' for mode ``auto`` (see ``build``)."""
    from agent import cgroupfs

    try:
        layout = cgroupfs.detect_layout(cgroup_root)
    except cgroupfs.CgroupError:
        return "off"
    if layout == "unified":
        h = cgroupfs.V2Hierarchy(cgroup_root)
        return "v2" if "cpu" in h.controllers() and os.access(cgroup_root, os.W_OK) else "off"
    return "v1" if cgroupfs.v1_controller_available(cgroup_root, "cpu", proc_root) is None else "off"
