"""The node agent: the composition root and the service loop (``adloader agent``).

``Agent(config)`` builds every part from the typed config and hands each its collaborators:

    registry  = Registry(heartbeat_s)
    collector = Collector(registry, loader_cpus, cpu_ids, gpu_sampler=GpuSampler())
    server    = Server(endpoint, registry, on_report=collector.on_report, status_doc=self.status_doc)
    controller = Controller(snapshot_source=collector.snapshot, policy=policy or get_policy(config.policy),
                            policy_config=PolicyConfig(...), predictor=predictor or PredictorBank(),
                            actuators=agent.actuators.build(config.cgroup_mode, sink=server, ...))

Data flows one way: server -> collector (reports) -> controller (snapshot, plus its own applied state)
-> policy -> actuators. The predictor and the policy can be injected (the bench's oracle, tests).

The loop (``run``) is the only place that sleeps: it polls the ROUTER socket and a signal wake-up
pipe until the next tick is due, then calls ``tick(now)``: sweep the registry (departures: silent,
dead or released jobs) -> ``controller.forget`` each departed job -> ``controller.tick(now)`` ->
heartbeats to clients -> journal (only when something changed) -> metrics -> systemd watchdog.
A tick never raises out of the loop.

Signals: SIGTERM/SIGINT stop cleanly (``controller.stop()`` restores every original value the
actuators changed, the socket file is removed, the journal is kept for the next start); SIGHUP
reloads the config file (policy, tick_s, heartbeat_s, loader_cpus, max_jobs, hysteresis, min_confidence,
fairness_floor, floor_fraction, floor_reference, floor_allotment, delivery_correction, delivery_workers, observed_cores,
cpu_bound_min_workers, finish_guard, log_level,
unseen_job_timeout_s, actuator_timeout_s
take effect at once; endpoint, state_dir, cgroup settings and metrics_port need a restart and are reported as such).

A refused start (a config the actuators or the socket cannot serve, a busy metrics port) exits with one
line naming the key, and removes the state directory and the ipc socket's directory (with the lock
file beside the socket) if that start made them (empty only; one that existed before is kept).

Restart: the journal (``agent.journal``) is written whenever the registry or the applied state
changed — after each batch of messages (so a job is journaled before any tick acts on it, and a
SIGKILL between an actuator's write and the end of that tick cannot orphan the job's cgroup) and
after each tick. It is read at start. Jobs whose processes are still alive are
re-adopted with their applied allocations (their clients reconnect by themselves and say hello
again); jobs whose processes are gone are forgotten through the controller, so the actuators
release what was made for them.

systemd: with NOTIFY_SOCKET set, READY=1 after the socket is bound and the journal adopted,
WATCHDOG=1 every half WATCHDOG_USEC, STOPPING=1 on stop (``sd_notify``).
"""
from __future__ import annotations

import collections
import dataclasses
import fcntl
import logging
import os
import re
import signal
import socket
import time
from typing import Any, Mapping, Optional

import zmq

from adloader import __version__, env, protocol
from agent import config as configmod
from agent import journal, logs, statefile
from agent import status as statusmod
from adloader import memory as adl_memory
from agent.collector import Collector
from agent.memory import MemoryGuard
from agent.config import AgentConfig
from agent.nvml import GpuSampler
from agent.registry import Limits, Registry
from agent.server import Server, ServerLimits

log = logging.getLogger("agent.daemon")
# the keys whose change rebuilds the controller (its policy and what the policy is told)
POLICY_KEYS = ("policy", "hysteresis", "min_confidence", "fairness_floor", "floor_fraction", "floor_reference",
               "floor_allotment", "delivery_correction",
               "observed_cores", "cpu_bound_min_workers", "delivery_workers", "finish_guard")
RELOADABLE = POLICY_KEYS + ("tick_s", "heartbeat_s", "loader_cpus", "max_jobs", "log_level", "unseen_job_timeout_s",
                            "actuator_timeout_s",
                            "loader_memory", "memory_pressure_psi", "memory_min_available")


NODE_REFRESH_S = 10.0   # the agent's own CPUs (its affinity) and memory budget are read again after this long


class CannotStart(RuntimeError):
    """The agent cannot start with this config; the message names the key (no traceback)."""


def _ancestors(path: str) -> list[str]:
    """``path`` and every directory above it, outermost first: '/a/b' -> ['/', '/a', '/a/b']."""
    out = [path]
    while os.path.dirname(out[-1]) != out[-1]:
        out.append(os.path.dirname(out[-1]))
    return out[::-1]


def sd_notify(state: str, environ: Optional[Mapping[str, str]] = None) -> bool:
    """Send ``state`` (e.g. "READY=1") to systemd's NOTIFY_SOCKET; False when not under systemd.
    An address starting with '@' is in the abstract namespace (sd_notify(3))."""
    addr = env.notify_socket(environ)
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall(state.encode())
        return True
    except OSError as e:
        logs.once("sd_notify_failed", log, "sd_notify_failed", logging.WARNING, error=str(e))
        return False


def _policy_config(cfg: AgentConfig):
    from agent.policies import PolicyConfig

    return PolicyConfig(hysteresis=cfg.hysteresis, min_confidence=cfg.min_confidence,
                        fairness_floor=cfg.fairness_floor, floor_fraction=cfg.floor_fraction,
                        floor_reference=cfg.floor_reference, floor_allotment=cfg.floor_allotment,
                        delivery_correction=cfg.delivery_correction,
                        pin_cpusets=cfg.cpu_knob == "cpuset", loaders_yield=cfg.loaders_yield,
                        yield_foreign_max_cores=cfg.loaders_yield_foreign_cores, foreign_weight=cfg.foreign_weight,
                        foreign_intermittent=cfg.foreign_intermittent, foreign_return_s=cfg.foreign_return_s,
                        cpu_bound_min_workers=cfg.cpu_bound_min_workers, delivery_workers=cfg.delivery_workers,
                        finish_guard=cfg.finish_guard, release_away_s=cfg.release_away_s)


_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def _error_kind(error: Optional[str]) -> str:
    """An apply error with its numbers blanked: the same failure still going on (a hung call's
    "running for 3.0 s", "running for 4.0 s", ...) reads the same, so it is logged once, not every tick."""
    return _NUMBER.sub("#", error or "")


def _pct(xs: list, q: float) -> Optional[float]:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3)


def _tick_summary(ticks) -> dict:
    """The last ticks: wall and CPU (tick thread) milliseconds, the controller's share of the wall
    time (snapshot + predictor + policy + actuators; the rest is the registry sweep and the heartbeats),
    and the median of each controller phase."""
    wall = [t[0] for t in ticks]
    cpu = [t[1] for t in ticks]
    ctl = [t[2] for t in ticks]
    names = sorted({k for t in ticks for k in t[3]})
    return {"n": len(wall), "wall_ms_p50": _pct(wall, 0.5), "wall_ms_p95": _pct(wall, 0.95),
            "wall_ms_max": round(max(wall), 3) if wall else None, "cpu_ms_p50": _pct(cpu, 0.5),
            "cpu_ms_p95": _pct(cpu, 0.95), "controller_ms_p50": _pct(ctl, 0.5),
            "phases_ms_p50": {k: _pct([t[3][k] for t in ticks if k in t[3]], 0.5) for k in names}}


class Agent:
    def __init__(self, config: AgentConfig, *, config_path: Optional[str] = None,
                 cli: Optional[Mapping[str, Any]] = None, gpu_module: Any = None, proc_root: str = "/proc",
                 predictor: Any = None, policy: Any = None, memory_source: Any = None):
        """``predictor``: default ``PredictorBank()``. ``policy``: a policy function
        (``agent.policies.Policy``) used instead of ``config.policy`` (the bench's oracle); its
        ``__name__`` is the name status shows, and a reload keeps it. ``memory_source``: a callable
        returning ``adloader.memory.NodeMemory`` (tests inject pressure); default: this node's
        /proc/meminfo and /proc/pressure/memory under ``proc_root``."""
        self.config = config
        self.config_path = config_path
        self.cli = dict(cli or {})
        self.started_at = time.monotonic()
        self.ticks = 0
        self._logged_yield: Optional[tuple[bool, bool]] = None   # (loaders_yield, intermittent) last logged
        self._apply_error: dict[str, str] = {}       # job -> the apply error last logged for it (_error_kind)
        self._node_read_at: Optional[float] = None   # when the agent's CPUs and memory were last read
        self.last_tick_ms: Optional[float] = None
        self.last_journal_ms: Optional[float] = None
        self.recent_ticks: collections.deque = collections.deque(maxlen=60)   # (wall ms, CPU ms, controller ms, phases)
        self.recent_late_ms: collections.deque = collections.deque(maxlen=60)  # how late each tick started
        self.max_tick_late_ms = 0.0
        self._stop = False
        self._hup = False
        self._journal_key: Any = None
        self.registry = Registry(heartbeat_s=config.heartbeat_s, proc_root=proc_root,
                                 unseen_timeout_s=config.unseen_job_timeout_s,
                                 limits=Limits(jobs_per_uid=config.jobs_per_uid,
                                               idle_jobs_per_uid=config.idle_jobs_per_uid))
        self.gpu = GpuSampler(gpu_module)
        self._memory_source = memory_source or (lambda: adl_memory.node_memory(proc_root))
        self.collector = Collector(self.registry, loader_cpus=config.resolved_loader_cpus(),
                                   loader_cpus_auto=config.loader_cpus == "auto",
                                   cpu_ids=configmod.agent_cpu_ids(), max_jobs=config.max_jobs,
                                   gpu_sampler=self.gpu, proc_root=proc_root,
                                   memory_guard=self._build_memory_guard())
        self.ctx = zmq.Context()
        self.server = Server(config.endpoint, self.registry, heartbeat_s=config.heartbeat_s,
                             on_report=self.collector.on_report, status_doc=self.status_doc, ctx=self.ctx,
                             limits=ServerLimits(max_connections=config.max_connections,
                                                 connections_per_uid=config.connections_per_uid,
                                                 uid_cpu_share=config.uid_cpu_share))
        if predictor is None:
            from predictor.bank import PredictorBank

            predictor = PredictorBank()
        self.predictor = predictor
        self.policy = policy
        # the directories this start made for state_dir: a refused start removes them again (empty only)
        self._made_state_dirs: list[str] = []
        self._state_lock_fd: Optional[int] = None
        self._make_state_dir()
        self.journal_error: Optional[str] = None
        self.state_problems: list[str] = []   # state files set aside or not writable (status: state_problems)
        try:
            self._lock_state_dir()
            self.actuators, self.cgroup_mode = self._build_actuators()
            self.controller = self._build_controller()
        except BaseException:
            self._release_subtrees()
            self.unlock_state_dir()
            self._remove_made_state_dir()
            raise
        self.metrics = None

    def _make_state_dir(self) -> None:
        """Make ``state_dir`` where it is missing; one that cannot be made is ``CannotStart`` naming the
        key and the path (an ``OSError`` alone read "cannot start: [Errno 17] File exists: '/x'", with
        '/x' a file somewhere above the directory asked for)."""
        path = self.config.state_dir
        try:
            self._made_state_dirs += statefile.make_dir(path, mode=0o700 if os.getuid() else 0o755)
        except OSError as e:
            blocker = next((p for p in _ancestors(os.path.abspath(path)) if os.path.lexists(p) and not os.path.isdir(p)),
                           None)
            why = (f"{blocker} is not a directory" if blocker is not None
                   else f"cannot make it: {e.strerror or e}{f' ({e.filename})' if e.filename else ''}")
            raise CannotStart(f"state_dir {path!r}: {why}; set state_dir (or --state-dir) to a directory "
                              f"the agent may create and write") from None

    def _lock_state_dir(self) -> None:
        """One agent per state directory: an exclusive ``flock`` on the directory itself (no file to leave
        behind), taken before anything reads or writes the journals or a cgroup, held until ``stop`` and let
        go by the kernel when the process dies (SIGKILL included). A second agent started by mistake on the
        same state directory (another endpoint: the socket's lock did not stop it) is refused with
        ``CannotStart``; before, it adopted the first one's jobs and both wrote the same groups and journals."""
        path = self.config.state_dir
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise CannotStart(f"state_dir {path!r}: cannot open it: {e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            holder = journal.agent_pid(path)
            raise CannotStart(f"state_dir {path!r} is in use by another agent on this node"
                              + (f" (its journal names pid {holder})" if holder else "")
                              + "; stop that one first (systemctl stop adloader-agent), or give this one a "
                              "state_dir, endpoint and cgroup_subtree of its own") from None
        self._state_lock_fd = fd

    def _release_subtrees(self) -> None:
        """Let go of the cgroup subtree's claim (``cgroup.SubtreeClaim``; a refused start, stop)."""
        for a in getattr(self, "actuators", ()):
            release = getattr(a, "release_subtree", None)
            if release is not None:
                release()

    def unlock_state_dir(self) -> None:
        """Let go of the state directory (``stop``, a refused start; tests, to play a killed agent)."""
        if self._state_lock_fd is not None:
            os.close(self._state_lock_fd)
            self._state_lock_fd = None

    def _remove_made_state_dir(self) -> None:
        """A refused start leaves no state directory that it made itself (one that existed before is
        kept, and so is any file written in it)."""
        statefile.remove_made(self._made_state_dirs)
        self._made_state_dirs = []

    @property
    def policy_name(self) -> str:
        """The policy in force: the configured one, or an injected policy's ``__name__``."""
        return self.config.policy if self.policy is None else getattr(self.policy, "__name__", "custom")

    # --- composition ------------------------------------------------------------------------------
    def _build_actuators(self):
        from agent import actuators

        cfg = self.config
        kw = dict(sink=self.server, cgroup_root=cfg.cgroup_root, cpu_knob=cfg.cpu_knob, io=cfg.io_weights,
                  state_dir=cfg.state_dir, proc_root=self.collector.proc_root, subtree=cfg.cgroup_subtree,
                  problems=self.state_problems, lock_dir=env.runtime_dir())
        from agent import cgroupfs

        try:
            return actuators.build(cfg.cgroup_mode, **kw), cfg.cgroup_mode
        except actuators.SubtreeInUse as e:       # (whatever the mode: auto does not fall back to off over it)
            raise CannotStart(f"config key 'cgroup_subtree' = {cfg.cgroup_subtree!r}: {e}") from None
        except cgroupfs.CgroupError as e:
            if cfg.cgroup_mode != "auto":
                raise CannotStart(f"config key 'cgroup_mode' = {cfg.cgroup_mode!r} (cgroup_root "
                                  f"{cfg.cgroup_root!r}): {e}") from None
            logs.event(log, "cgroups_unavailable", logging.WARNING, error=f"{type(e).__name__}: {e}",
                       detail="cgroup_mode auto: running with worker-count directives only (mode off)")
            return actuators.build("off", **kw), "off"
        except (OSError, ValueError) as e:   # a state file that could not be set aside, a bad root...
            raise CannotStart(f"cgroup_mode {cfg.cgroup_mode!r} (cgroup_root {cfg.cgroup_root!r}, state_dir "
                              f"{cfg.state_dir!r}): {type(e).__name__}: {e}") from None

    def _build_memory_guard(self) -> MemoryGuard:
        cfg = self.config
        return MemoryGuard(cfg.resolved_loader_memory(), psi_threshold=cfg.memory_pressure_psi,
                           min_available=cfg.resolved_memory_min_available(), source=self._memory_source)

    def _build_controller(self, applied: Optional[dict] = None):
        from agent.controller import Controller
        from agent.policies import get_policy

        pconf = _policy_config(self.config)
        # per-job CPU weights in force: a cgroup actuator with the shares knob (not off, not cooperative)
        weights = any(getattr(a, "name", "").startswith("cgroup") and getattr(a, "cpu_knob", "") == "shares"
                      for a in self.actuators)
        if weights:
            pconf = dataclasses.replace(pconf, cpu_weights=True)
        c = Controller(snapshot_source=self.collector.snapshot,
                       policy=self.policy if self.policy is not None else get_policy(self.config.policy),
                       policy_config=pconf, predictor=self.predictor,
                       actuators=self.actuators, observed_cores=self.config.observed_cores,
                       actuator_timeout_s=self.config.actuator_timeout_s,
                       # (a rebuilt controller takes over the lanes: a call its predecessor left hung
                       # still holds its actuator)
                       lanes=getattr(getattr(self, "controller", None), "lanes", None))
        if applied:
            c.adopt(applied)
        return c

    # --- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        cfg = self.config
        self._make_state_dir()
        self.server.bind()
        self._adopt_journal(time.monotonic())
        self._warm_predictor()
        if cfg.metrics_port:
            from agent.metrics import Metrics

            self.metrics = Metrics(cfg.metrics_port)
            try:
                self.metrics.start()
            except OSError as e:
                raise CannotStart(f"config key 'metrics_port' = {cfg.metrics_port}: cannot serve metrics on "
                                  f"127.0.0.1:{cfg.metrics_port}: {e.strerror or e}") from None
        logs.event(log, "agent_started", pid=os.getpid(), uid=os.getuid(), endpoint=cfg.endpoint,
                   state_dir=cfg.state_dir, policy=self.policy_name, tick_s=cfg.tick_s,
                   loader_cpus=self.collector.loader_cpus, cgroup_mode=self.cgroup_mode,
                   loader_memory_bytes=self.collector.memory_guard.configured if self.collector.memory_guard else None,
                   actuators=[getattr(a, "name", type(a).__name__) for a in self.actuators],
                   metrics_port=cfg.metrics_port, version=__version__, protocol=protocol.VERSION)
        sd_notify("READY=1\nSTATUS=serving " + cfg.endpoint)

    def _warm_predictor(self) -> None:
        """Load the predictor's prior now (it imports scikit-learn and fits once, seconds), so the first
        tick with a job does not take that long; failures are the predictor's to report in ticks."""
        t0 = time.perf_counter()
        try:
            getattr(self.predictor, "prior", None)
        except Exception as e:
            logs.event(log, "predictor_prior_failed", logging.WARNING, error=f"{type(e).__name__}: {e}")
            return
        logs.event(log, "predictor_ready", seconds=round(time.perf_counter() - t0, 3))

    def _adopt_journal(self, now: float) -> None:
        """Adopt the journal's live jobs; forget its dead ones, and every job an actuator still holds
        something for (a group, a moved process, an affinity: ``held_jobs``) that the journal does not
        adopt. Before, such a job (the journal lost, or a release still being retried when the agent was
        killed) kept its group and its workers there until the agent stopped."""
        loaded = journal.load(self.config.state_dir)
        doc = loaded or {"applied": {}, "jobs": {}, "agent_pid": None}
        self.state_problems.extend(doc.get("problems") or [])
        adopted, dead = self.registry.adopt(doc["jobs"], now)
        self.controller.adopt(doc["applied"])
        held = set().union(*(a.held_jobs() for a in self.actuators if hasattr(a, "held_jobs")))
        forgotten = sorted(set(dead) | ((set(doc["applied"]) | held) - set(adopted)))
        for job in forgotten:
            self.controller.forget(job)
        if not (loaded or forgotten):
            return
        logs.event(log, "journal_adopted", adopted=adopted, forgotten=forgotten,
                   previous_agent_pid=doc.get("agent_pid"))
        try:
            self._write_journal(force=True)
        except OSError as e:
            self.journal_error = str(e)
            logs.event(log, "journal_write_failed", logging.ERROR, error=str(e))

    def request_stop(self, *_: Any) -> None:
        self._stop = True

    def request_reload(self, *_: Any) -> None:
        self._hup = True

    def stop(self) -> None:
        sd_notify("STOPPING=1")
        try:
            self.controller.stop()
        except Exception as e:
            logs.event(log, "restore_failed", logging.ERROR, error=str(e))
        try:
            self._write_journal(force=True)
        except OSError as e:        # a read-only or full state dir: the restore above is what matters
            logs.event(log, "journal_write_failed", logging.ERROR, error=str(e))
        if self.metrics is not None:
            self.metrics.stop()
        self.server.close()
        self.ctx.term()
        self._release_subtrees()      # (restore let it go; not if restore was skipped: a hung lane)
        self.unlock_state_dir()
        logs.event(log, "agent_stopped", ticks=self.ticks)

    def reload(self) -> None:
        """Read the config file again and apply what changed of the RELOADABLE keys. A reload that fails for
        any reason (a config error, a file that is not a regular one, a bug) logs one ``reload_failed``
        line naming it and keeps the running config whole: everything the new config needs is built
        first, and only then swapped in."""
        old = self.config
        try:
            new = configmod.load(self.config_path, self.cli)
            changed = [k for k in configmod.KEYS if getattr(new, k) != getattr(old, k)]
            need_restart = [k for k in changed if k not in RELOADABLE]
            live = {k: getattr(new, k) for k in changed if k in RELOADABLE}
            self.config = dataclasses.replace(old, **live)      # (the builders below read self.config)
            loader_cpus = self.config.resolved_loader_cpus() if "loader_cpus" in live else None
            guard = (self._build_memory_guard()
                     if {"loader_memory", "memory_pressure_psi", "memory_min_available"} & set(live) else None)
            controller = (self._build_controller(applied=self.controller.applied())
                          if set(POLICY_KEYS) & set(live) else None)
        except Exception as e:   # the daemon never stops for its config (STYLE 8 for the agent)
            self.config = old
            reason = str(e) if isinstance(e, configmod.ConfigError) else f"{type(e).__name__}: {e}"
            logs.event(log, "reload_failed", logging.ERROR, error=reason[:500], detail="keeping the running config")
            return
        if "log_level" in live:
            logging.getLogger().setLevel(getattr(logging, new.log_level.upper()))
        if "heartbeat_s" in live:
            self.registry.heartbeat_s = self.server.heartbeat_s = new.heartbeat_s
        if "unseen_job_timeout_s" in live:
            self.registry.unseen_timeout_s = new.unseen_job_timeout_s
        if loader_cpus is not None:
            self.collector.loader_cpus = loader_cpus
            self.collector.loader_cpus_auto = self.config.loader_cpus == "auto"
        if "max_jobs" in live:
            self.collector.max_jobs = new.max_jobs
        if "actuator_timeout_s" in live and controller is None:
            self.controller.actuator_timeout_s = new.actuator_timeout_s
        if guard is not None:
            self.collector.memory_guard = guard
        if controller is not None:
            self.controller = controller
        logs.event(log, "config_reloaded", changed=sorted(live), needs_restart=need_restart)

    def _refresh_node_resources(self, now: float) -> None:
        """The agent's CPUs and memory read again every ``NODE_REFRESH_S``, so an operator's
        ``systemctl set-property adloader-agent AllowedCPUs=... MemoryMax=...`` reaches the plans without a
        restart. CPUs: its affinity (systemd's ``AllowedCPUs``, a cpuset); an "auto" ``loader_cpus``
        follows their count. Memory: an "auto" ``loader_memory`` (the node's memory or the agent's own
        cgroup limit, whichever is lower, less its reserve) and an "auto" ``memory_min_available`` are
        computed again; a cut in force under pressure stays. Explicit values stay as configured. Each
        change is logged as a warning (``node_cpus_changed``, ``loader_memory_changed``). Before, all of
        this was read once, at start."""
        if self._node_read_at is not None and 0.0 <= now - self._node_read_at < NODE_REFRESH_S:
            return
        self._node_read_at = now
        ids = configmod.agent_cpu_ids()
        if ids != self.collector.cpu_ids:
            was = self.collector.cpu_ids
            self.collector.cpu_ids = ids
            if self.config.loader_cpus == "auto":
                self.collector.loader_cpus = self.config.resolved_loader_cpus()
            logs.event(log, "node_cpus_changed", logging.WARNING, cpus=len(ids), was=len(was),
                       loader_cpus=self.collector.loader_cpus)
        guard = self.collector.memory_guard
        if guard is None or "auto" not in (self.config.loader_memory, self.config.memory_min_available):
            return
        was_budget, was_min = guard.configured, guard.min_available
        if self.config.loader_memory == "auto":
            pids = tuple(p for job in self.registry.jobs.values() for p in job.pids() + job.worker_pids())
            guard.configured = self.config.resolved_loader_memory(pids)
        if self.config.memory_min_available == "auto":
            guard.min_available = self.config.resolved_memory_min_available()
        if (guard.configured, guard.min_available) != (was_budget, was_min):
            logs.event(log, "loader_memory_changed", logging.WARNING, loader_memory_bytes=guard.configured,
                       was=was_budget, memory_min_available_bytes=guard.min_available, was_min_available=was_min)

    # --- the tick ---------------------------------------------------------------------------------
    def tick(self, now: float):
        """One tick; never raises (a failure is logged and the loop goes on)."""
        t0 = time.perf_counter()
        c0 = time.thread_time()
        record = None
        try:
            self.registry.sweep(now)
            self._refresh_node_resources(now)
            for job, why in self.registry.take_departed():
                self.collector.forget(job)
                self.controller.forget(job)
                self._apply_error.pop(job, None)
                logs.event(log, "job_departed", job=job, why=why)
            record = self.controller.tick(now)
            for job, r in record.results.items():   # only jobs something was applied to this tick
                if r.ok and r.applied is not None:
                    w = r.applied.cpu_weight
                    logs.event(log, "allocation_applied", job=job, workers=r.applied.workers,
                               cpus=round(r.applied.cpus, 3), cpu_weight=round(w, 3) if w is not None else None,
                               reason=r.applied.reason)
                if r.ok:
                    self._apply_error.pop(job, None)
                elif _error_kind(r.error) != self._apply_error.get(job):
                    # each new failure of a job's apply, and its breaker opening (its text differs), once;
                    # the same failure whose text only counts on (a hang's "running for 12.0 s") is not new
                    logs.event(log, "apply_failed", logging.WARNING, job=job, error=r.error)
                    self._apply_error[job] = _error_kind(r.error)
            node = record.plan.node if record.plan is not None else None
            if node is not None and (node.loaders_yield, node.intermittent) != self._logged_yield:
                # each switch, with the reason: while not yielding the loaders weigh (and are capped at)
                # their planned cores, so an operator sees when and why the trainers lost their priority;
                # and when the subtree starts or stops weighing through the gaps of a load that comes
                # and goes (``foreign_intermittent``), which does not switch the yield itself
                logs.event(log, "loaders_yield", on=node.loaders_yield, reason=node.reason,
                           **({"intermittent": True} if node.intermittent else {}))
                self._logged_yield = (node.loaders_yield, node.intermittent)
            for e in record.errors:
                logs.once(f"tick_error:{e[:80]}", log, "tick_error", logging.WARNING, error=e)
            self.server.heartbeat(now)
        except Exception as e:
            logs.event(log, "tick_failed", logging.ERROR, error=f"{type(e).__name__}: {e}")
        self.ticks += 1
        self.last_tick_ms = (time.perf_counter() - t0) * 1000.0
        self.recent_ticks.append((self.last_tick_ms, (time.thread_time() - c0) * 1000.0,
                                  record.duration_s * 1000.0 if record is not None else 0.0,
                                  record.phases_ms if record is not None else {}))
        try:
            self._write_journal()
        except OSError as e:
            self.journal_error = str(e)
            logs.once("journal_write_failed", log, "journal_write_failed", logging.ERROR, error=str(e))
        if self.metrics is not None:
            try:
                self.metrics.update(self.status_doc(), self.server.counts, self.server.errors)
            except Exception as e:
                logs.once("metrics_failed", log, "metrics_failed", logging.WARNING, error=str(e))
        return record

    def _journal_now(self) -> None:
        """After messages: journal a registry change (allocations change only in a tick, which
        journals them itself), so a report that changed nothing costs one comparison."""
        if self._journal_key is not None and self._journal_key[0] == self.registry.version:
            return
        try:
            self._write_journal()
        except OSError as e:
            self.journal_error = str(e)
            logs.once("journal_write_failed", log, "journal_write_failed", logging.ERROR, error=str(e))

    def _write_journal(self, force: bool = False) -> None:
        applied = self.controller.applied()
        key = (self.registry.version, tuple(sorted((j, a.workers, round(a.cpus, 3), a.cpuset) for j, a in applied.items())))
        if not force and key == self._journal_key:
            return
        t0 = time.perf_counter()
        journal.save(self.config.state_dir, applied, self.registry.to_doc())
        self.journal_error = None
        self.last_journal_ms = (time.perf_counter() - t0) * 1000.0
        self._journal_key = key

    def _state_problems(self) -> list[str]:
        out = list(self.state_problems)
        for a in self.actuators:
            # (an actuator's lane may be inside a save right now: read only what Originals lets another
            # thread read, which never waits for that save)
            problem = getattr(getattr(a, "originals", None), "save_problem", None)
            err = problem() if problem is not None else None
            if err:
                out.append(f"cgroup originals not saved: {err}")
                break
        if self.journal_error:
            out.append(f"journal not saved: {self.journal_error}")
        return out

    def status_doc(self) -> dict:
        cfg = self.config
        snap = self.collector.last
        info = {
            "pid": os.getpid(), "uid": os.getuid(), "version": __version__, "protocol": protocol.VERSION,
            "endpoint": cfg.endpoint, "state_dir": cfg.state_dir, "policy": self.policy_name, "tick_s": cfg.tick_s,
            "heartbeat_s": cfg.heartbeat_s, "uptime_s": round(time.monotonic() - self.started_at, 1),
            "ticks": self.ticks, "last_tick_ms": round(self.last_tick_ms, 3) if self.last_tick_ms is not None else None,
            "loader_cpus": self.collector.loader_cpus, "loader_cpus_auto": self.collector.loader_cpus_auto,
            "loader_cpus_in_force": self.controller.loader_cpus_in_force if self.controller else None,
            "cpu_ids": list(self.collector.cpu_ids),
            "max_jobs": cfg.max_jobs, "cgroup_mode": self.cgroup_mode,
            "actuators": [getattr(a, "name", type(a).__name__) for a in self.actuators],
            "gpu_source": "nvml" if self.gpu.available else "client",
            "nvml_error": None if self.gpu.available else (self.gpu.last_error or None),
            "cpu_pressure": self.collector.pressure.cpu_some_avg10, "io_pressure": self.collector.pressure.io_some_avg10,
            "metrics_port": cfg.metrics_port, "errors": dict(self.server.errors), "messages": dict(self.server.counts),
            "recent_ticks": _tick_summary(self.recent_ticks), "journal_ms": self.last_journal_ms,
            "unseen_job_timeout_s": cfg.unseen_job_timeout_s, "job_scans": self.registry.scans,
            "pids_skipped": sum(getattr(a, "pids_skipped", 0) for a in self.actuators),
            "memory": self.collector.memory_state.to_dict() if self.collector.memory_state else None,
            "state_problems": self._state_problems()[:20],
            "connections": self.server.guard.snapshot() if self.server.guard is not None else None,
            "open_files_limit": self.server.fd_limit, "message_budget_hits": self.server.budget_hits,
            "tick_late_ms": {"p50": _pct(list(self.recent_late_ms), 0.5),
                             "max_recent": round(max(self.recent_late_ms), 3) if self.recent_late_ms else None,
                             "max": round(self.max_tick_late_ms, 3)},
        }
        return statusmod.build(agent_info=info, registry=self.registry, snapshot=snap,
                               record=self.controller.last_record, applied=self.controller.applied())

    # --- the service loop -------------------------------------------------------------------------
    def run(self) -> int:
        """Serve until SIGTERM/SIGINT. Installs the signal handlers (main thread only)."""
        rfd, wfd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        old_wakeup = signal.set_wakeup_fd(wfd)
        old = {s: signal.signal(s, h) for s, h in ((signal.SIGTERM, self.request_stop),
                                                   (signal.SIGINT, self.request_stop),
                                                   (signal.SIGHUP, self.request_reload))}
        try:
            try:
                self.start()
            except BaseException:
                self.server.close(refused=True)   # with the socket directory it made, empty only
                self.ctx.term()
                self._release_subtrees()
                self.unlock_state_dir()
                self._remove_made_state_dir()
                raise
            self._started = True
            self._made_state_dirs = []   # started: the state directory is the agent's to keep
            poller = zmq.Poller()
            poller.register(self.server.sock, zmq.POLLIN)
            poller.register(rfd, zmq.POLLIN)
            watchdog_s = env.watchdog_interval_s()
            next_watchdog = time.monotonic()
            next_tick = time.monotonic()
            while not self._stop:
                now = time.monotonic()
                if now >= next_tick:
                    late_ms = (now - next_tick) * 1000.0
                    self.recent_late_ms.append(late_ms)
                    self.max_tick_late_ms = max(self.max_tick_late_ms, late_ms)
                    self.server.handle_ready(now)   # messages already here count for this tick (a bye
                    self._journal_now()             # before the process is seen gone)
                    self.tick(now)
                    next_tick += self.config.tick_s
                    if next_tick <= time.monotonic():
                        next_tick = time.monotonic() + self.config.tick_s
                if watchdog_s and now >= next_watchdog:
                    sd_notify("WATCHDOG=1")
                    next_watchdog = now + watchdog_s / 2
                wake = min(next_tick, next_watchdog) if watchdog_s else next_tick
                timeout_ms = max(0, int((wake - time.monotonic()) * 1000) + 1)
                try:
                    events = dict(poller.poll(timeout_ms))
                except zmq.ZMQError as e:   # pyzmq retries EINTR itself; anything else is real
                    logs.event(log, "poll_failed", logging.ERROR, error=str(e))
                    raise
                if rfd in events:
                    try:
                        while os.read(rfd, 512):
                            pass
                    except BlockingIOError:
                        pass
                if self.server.sock in events:
                    self.server.handle_ready(time.monotonic())
                    self._journal_now()   # a new job is journaled before any tick can act on it
                if self._hup:
                    self._hup = False
                    self.reload()
            return 0
        finally:
            try:
                if getattr(self, "_started", False):
                    self.stop()
            finally:
                for s, h in old.items():
                    signal.signal(s, h)
                signal.set_wakeup_fd(old_wakeup)
                os.close(rfd)
                os.close(wfd)
