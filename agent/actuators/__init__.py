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

# the one list of each: config validation and every command's argparse choices read these
MODES = ("auto", "v1", "v2", "cooperative", "off")
CPU_KNOBS = ("shares", "quota", "cpuset")


def build(mode: str, *, sink, cgroup_root: str = "/sys/fs/cgroup", cpu_knob: str = "shares",
          io: bool = True, subtree: str = "adloader", state_dir: Optional[str] = None,
          sys_root: str = "/sys", proc_root: str = "/proc", problems: Optional[list] = None) -> list:
    """The actuators for a cgroup mode; the directive actuator (worker counts) always comes first.

    - ``off``: worker counts only.
    - ``v1`` / ``v2``: plus a ``CgroupActuator`` on that hierarchy (cooperative jobs get CPU affinity).
    - ``cooperative``: plus an ``AffinityActuator`` (Slurm owns the cgroups; no cgroup writes).
    - ``auto``: the layout as systemd documents it: unified -> v2 (when its cpu controller is there),
      hybrid or legacy -> v1 (when the v1 cpu hierarchy is writable), else worker counts only.

    ``cpu_knob`` (default ``shares``, work-conserving; ``quota`` caps hard; ``cpuset`` pins, with
    ``PolicyConfig.pin_cpusets``). With ``state_dir`` the journal of originals lives in
    ``<state_dir>/cgroup-originals.json``, so a restarted agent restores what a dead one changed.
    A journal of originals that cannot be trusted (``StateFileError``: corrupt, wrong types) is set
    aside (``statefile.quarantine``), said in ``problems``, and the subtree and the groups still found
    in it are taken as the dead agent's (``CgroupActuator.adopt_orphans``), so they are emptied (their
    processes to the hierarchy's root: where they came from is lost) and removed as jobs leave or on
    stop; a subtree that cannot be removed gets a new group's CPU values back (no cap). The mode is
    never changed because of it: ``auto`` does not fall back to ``off``.
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

    from agent import logs, statefile

    problems = problems if problems is not None else []
    orig_path = os.path.join(state_dir, "cgroup-originals.json") if state_dir else None
    orphans = False
    try:
        originals = Originals(orig_path)
    except statefile.StateFileError as e:
        moved = statefile.quarantine(orig_path)
        problems.append(f"{e}; set aside as {moved}; the subtree and the groups still in it are emptied and removed"
                        if moved else f"{e}; it could not be set aside")
        logs.event(logging.getLogger("agent.actuators"), "originals_unusable", logging.ERROR, path=orig_path,
                   error=str(e), quarantined=moved)
        if moved is None:
            raise
        originals = Originals(orig_path)
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
    if orphans:
        found = act.adopt_orphans()
        if found:
            problems.append(f"found {len(found)} group(s) of a previous agent: {', '.join(found[:10])}")
    actuators.append(act)
    return actuators


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
