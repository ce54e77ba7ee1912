"""The agent's typed config: defaults <- TOML file <- environment <- command line (STYLE 10).

``load(path=None, cli={}, environ=None) -> AgentConfig``, validated once; every problem names the key
and where it came from. Unknown keys in the file are errors that name them. The file is read within
``CONFIG_READ_TIMEOUT_S`` (5 s; a hung network mount is a config error naming it, not a start or a
SIGHUP reload that never returns: ``read_toml``). A number given as text (environment, command line) is
ASCII digits without '_' (``_plain_number_text``).

Keys (flat; TOML key == field name; environment ``ADLOADER_<KEY upper>``; flag ``--<key with dashes>``
for the ones the command line offers):

    endpoint        str    where the agent binds (ipc:// and an absolute path of at most 100 bytes, or
                           tcp://...); default ``adloader.env.default_endpoint()``
    state_dir       str    journal directory, an absolute path; root /var/lib/adloader, a user <runtime dir>/state
    policy          str    allocation policy name (``agent.policies.POLICIES``), default "adaptive"
    tick_s          float  controller period, 0.05..60 s, default 1.0
    actuator_timeout_s  float  the longest a tick waits for one actuator call (a cgroup write, a release);
                           one that has not returned by then is that job's failure in the tick (three in
                           a row open its breaker) and that actuator is not called again until it
                           returns (``agent.controller.ActuatorLane``); the other jobs' calls it holds
                           back wait and are not counted as their failures; 0.01..300 s, default 5.0
    loader_cpus     float|"auto"  CPU cores for all jobs' loaders together; "auto" (default):
                           the CPUs in the agent's affinity mask minus a 10% reserve for the training
                           processes and the system (``auto_loader_cpus``), grown by the controller into
                           the part of it they leave (``policies.grown_loader_cpus``); the mask is read
                           again every 10 s while the agent runs (``Agent._refresh_node_resources``); at most 4096
    max_jobs        int    jobs the node is sized for (even-static divides by it), 0 = by jobs present
                           (at most 4096)
    cgroup_mode     str    auto|v1|v2|cooperative|off, default "auto"
    cgroup_root     str    an absolute path, default /sys/fs/cgroup
    cgroup_subtree  str    the agent's group in each hierarchy, job groups below it; one name (letters,
                           digits, _ - only), default "adloader"; give each agent on a machine its own
    cpu_knob        str    shares|quota|cpuset, default "shares"
    io_weights      bool   set IO weights where the kernel enforces them, default true
    metrics_port    int    Prometheus on 127.0.0.1:<port>; 0 = off (the default)
    heartbeat_s     float  agent heartbeat period, 0.1..300 s; a rank silent for 3x this has departed;
                           default 2.0
    log_level       str    debug|info|warning|error, default "info"
    hysteresis      float  0..1, no move for a predicted normalised gain under this plus the workers'
                           restart cost (a plan still holding a cold-start share pays the cost only),
                           default 0.03
    min_confidence  float  0..1, adaptive: a job whose predicted curve is less sure than this keeps its
                           cold-start share (one window of data gives 0.13, two 0.24); default 0.2
    fairness_floor  bool   adaptive: no job below what its GPU share or static-cores allotment (in the
                           loaders' part of the node) would give it, times ``floor_fraction``, unless
                           it cannot use that, default true
    floor_reference  str   habit|share, default "habit": the throughput the fairness floor keeps for a
                           job: "habit", what its static-cores allotment gives it with its user's own
                           num_workers (a batch scheduler's partition as the user runs it: the reference
                           of issue 11's fairness target), at most its GPU share's; "share", what its GPU
                           share gives with as many workers as use it, raised to its static-cores
                           allotment's (a job whose user asked for few workers keeps cores it would not
                           use)
    floor_fraction  float  (0, 1], adaptive with fairness_floor: that part of the throughput of its share
                           each job keeps (1: the whole share's; lower leaves the greedy more to move
                           to where it buys more, at a cost to the job that gives), default 1.0
    floor_allotment  str   loaders|whole, default "loaders": the static-cores allotment the fairness
                           floor is raised to: "loaders", its part of the node's loader CPUs (node CPUs
                           x its GPUs / all GPUs x loader_cpus / node CPUs, less its trainers' use: every
                           floor fits the loader budget); "whole", the whole allotment less its
                           trainers' use, what a batch scheduler's partition gives the job's loader
                           (floors may then exceed the budget, and the raises are scaled to fit it)
    observed_cores  str    share|received, default "share": the cores a predictor window of a job under
                           a CPU share counts, at least its share (the kernel's floor under contention);
                           "received": where the job's GPU waited for data and its workers waited for a
                           CPU, the CPU they received when that was less (``agent.controller.
                           observation_from_stats``: on a small node a contended CPU is shared per thread
                           more than per group weight, and the share's gap is not the job's inefficiency;
                           measured on 2 cores: +5.7% where habits oversubscribe the CPUs, -4.1% where the
                           trainers are busy, so not the default: BENCHMARKS.md, twenty-eighth pass)
    cpu_bound_min_workers  int  1..64, adaptive with CPU weights (the shares knob): the fewest workers a
                           job that wants more than its planned cores gets (``agent.policies.thread_split``):
                           1 (default) lets the smallest such plan be one thread; 2 gives every such job two
                           or more, so a small one is not one thread beside its neighbours' several (on a
                           small node a contended CPU is shared per thread more than per group weight)
    delivery_correction  float  1..16, adaptive with CPU weights (the shares knob): the most a CPU-bound
                           job's weight is raised over its planned cores so that it receives them, when
                           its workers received a smaller part of their cores than the other CPU-bound
                           jobs' (``agent.policies._delivery_factors``); default 1.0 (off: measured
                           within noise on 2 cores, BENCHMARKS.md, thirty-fifth pass)
    delivery_workers  int  0..8, adaptive with CPU weights (the shares knob): the most workers a
                           CPU-bound job gets over its thread split when its workers received less of its
                           planned cores than the other CPU-bound jobs' did (``agent.policies.
                           _delivery_workers``: a contended CPU on a small node is shared per thread more
                           than per group weight, and one worker beside several receives less); default 0
                           (off: a gain in fairness for 2.7% of the aggregate in one run on 2 cores, not
                           confirmed by a second, BENCHMARKS.md, forty-fourth and forty-fifth passes)
    finish_guard    bool   adaptive: when every job says how many steps it has left (the loader's
                           ``total_steps``), the jobs whose remaining time sets the node's finishing time
                           get the cores they can use before the rest is shared for throughput
                           (``agent.policies._finish_guard``); without those hints nothing changes,
                           default true
    loaders_yield   str    auto|never, default "auto": while the training processes need CPU and the
                           rest of the node is quiet, the loaders run only on CPU the trainers leave idle
                           (cgroup cpu.idle; ``agent.policies.node_allocation``); "never": the loaders'
                           subtree always weighs its planned cores
    loaders_yield_foreign_cores  float  CPU (cores) used outside the jobs' trainers and loaders above
                           which the loaders stop yielding (they would lose their cores to it); they
                           yield again under half of it; 0..4096, default 0.5
    foreign_weight  str    workers|cores, default "workers": what the loaders' subtree weighs against
                           other processes once their CPU stops the yield: one task per worker as
                           unmanaged workers weigh, or one per planned loader core (still capped at the
                           node less the trainers' use; ``agent.policies.PolicyConfig.foreign_weight``;
                           docs/operations.md); a load that comes in bursts of seconds: see
                           foreign_intermittent
    foreign_intermittent  str  weigh|cores|yield, default "weigh": what the loaders do while other
                           processes' load comes and goes (it stopped the yield again within
                           foreign_return_s of the yield resuming because it had left): "weigh" keeps
                           weighing as foreign_weight says, "cores" keeps weighing the planned cores,
                           until the load has stayed away foreign_return_s; "yield" switches as always,
                           3-6 s behind the load (``agent.policies.PolicyConfig.foreign_intermittent``;
                           docs/operations.md)
    foreign_return_s  float  seconds, 1..600, default 12: foreign_intermittent's window (a load back
                           within this long of leaving comes and goes; one away this long has left;
                           twice the most the switch lags the load)
                           (``agent.policies.PolicyConfig.foreign_return_s``; docs/operations.md)
    release_away_s  float  seconds, 0..3600, default 10: adaptive plans a job whose training loop has
                           been away from its loader this long (and 10 times its step: a validation
                           pass, a checkpoint save; never a wait for data) its least cores, its workers
                           kept, until it steps again; its neighbours take the room; 0: never
                           (``agent.policies.PolicyConfig.release_away_s``; docs/operations.md)
    loader_memory   bytes|str  memory for all jobs' loader workers together: bytes or a size
                           ("6GiB", "512MiB", "8GB"); "auto" (default): the node's memory, or the
                           memory limit over the agent's cgroup when lower and every job process is
                           under it too (one container; v2's delegated subtree), minus a 25% reserve (at least
                           2 GiB) for the training processes, page cache and system
                           (``auto_loader_memory``; computed again every 10 s while the agent
                           runs); "off": no budget
    memory_pressure_psi  float  PSI memory "some" (percent, over the last tick) at or above this is
                           pressure: the agent shrinks loader workers before the kernel kills
                           anything; default 10
    memory_min_available  bytes|str  MemAvailable below this is pressure too; "auto" (default):
                           5% of the node's memory, at least 256 MiB (computed again every 10 s)
    unseen_job_timeout_s  float  a registered job (Slurm prolog) with no connected rank is forgotten
                           when none of its processes has been seen for this long (a missed epilog
                           release); > 0, default 60.0
    max_connections  int   open connections from ordinary users, all together (root is not counted);
                           more are closed at once; 1..60000, default 1024
    connections_per_uid  int  open connections of one ordinary uid, 1..60000, default 64
    jobs_per_uid    int    jobs one ordinary uid may have on the node, 1..100000, default 32
    idle_jobs_per_uid  int  jobs an ordinary uid registered itself that no process joined yet, 0..100000,
                           default 4
    uid_cpu_share   float  agent CPU (seconds per second) one ordinary uid's messages may cost, averaged
                           over a few seconds; over it the uid's messages are dropped (rate_limited);
                           0.001..1, default 0.1
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import threading
import time
from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional, Union

from adloader import env, memory
from adloader.protocol import endpoint_problem
from agent.actuators import CPU_KNOBS
from agent.actuators import MODES as CGROUP_MODES

DEFAULT_CONFIG_PATH = "/etc/adloader/agent.toml"
LOG_LEVELS = ("debug", "info", "warning", "error")
LOADER_CPU_RESERVE = 0.10
LOADER_MEMORY_RESERVE = 0.25
LOADER_MEMORY_RESERVE_MIN = 2 << 30
SUBTREE_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,63}")
# key -> (lowest, highest) accepted; every number an operator can set has both ends
BOUNDS: dict[str, tuple[float, float]] = {
    "tick_s": (0.05, 60.0), "actuator_timeout_s": (0.01, 300.0), "heartbeat_s": (0.1, 300.0), "max_jobs": (0, 4096),
    "metrics_port": (0, 65535),
    "max_connections": (1, 60000), "connections_per_uid": (1, 60000), "jobs_per_uid": (1, 100000),
    "idle_jobs_per_uid": (0, 100000), "uid_cpu_share": (0.001, 1.0), "loaders_yield_foreign_cores": (0.0, 4096.0),
    "min_confidence": (0.0, 1.0), "foreign_return_s": (1.0, 600.0), "release_away_s": (0.0, 3600.0),
}
MAX_LOADER_CPUS = 4096.0


MAX_UNKNOWN_NAMED = 5  # unknown keys named in one error (a file of hundreds names the first few)
MAX_SHOWN_CHARS = 80   # an offending value in an error message is cut to this (a whole one can be thousands)


def shown(value: Any) -> str:
    """``repr(value)``, cut to ``MAX_SHOWN_CHARS`` with "..." so an error stays one readable line."""
    text = repr(value)
    return text if len(text) <= MAX_SHOWN_CHARS else text[:MAX_SHOWN_CHARS - 3] + "..."


class ConfigError(ValueError):
    """A config value that cannot be used; the message names the key and its source."""


@dataclass(frozen=True)
class AgentConfig:
    endpoint: str = ""
    state_dir: str = ""
    policy: str = "adaptive"
    tick_s: float = 1.0
    actuator_timeout_s: float = 5.0
    loader_cpus: Union[float, str] = "auto"
    max_jobs: int = 0
    cgroup_mode: str = "auto"
    cgroup_root: str = "/sys/fs/cgroup"
    cpu_knob: str = "shares"
    io_weights: bool = True
    metrics_port: int = 0
    heartbeat_s: float = 2.0
    log_level: str = "info"
    hysteresis: float = 0.03
    min_confidence: float = 0.2
    fairness_floor: bool = True
    floor_fraction: float = 1.0
    floor_reference: str = "habit"
    floor_allotment: str = "loaders"
    delivery_correction: float = 1.0
    observed_cores: str = "share"
    cpu_bound_min_workers: int = 1
    delivery_workers: int = 0
    finish_guard: bool = True
    loaders_yield: str = "auto"
    loaders_yield_foreign_cores: float = 0.5
    foreign_weight: str = "workers"
    foreign_intermittent: str = "weigh"
    foreign_return_s: float = 12.0
    release_away_s: float = 10.0
    loader_memory: Union[int, str] = "auto"
    memory_pressure_psi: float = 10.0
    memory_min_available: Union[int, str] = "auto"
    unseen_job_timeout_s: float = 60.0
    cgroup_subtree: str = "adloader"
    max_connections: int = 1024
    connections_per_uid: int = 64
    jobs_per_uid: int = 32
    idle_jobs_per_uid: int = 4
    uid_cpu_share: float = 0.1

    def resolved_loader_cpus(self) -> float:
        return auto_loader_cpus() if self.loader_cpus == "auto" else float(self.loader_cpus)

    def resolved_loader_memory(self, loader_pids: tuple[int, ...] = ()) -> Optional[int]:
        """The loader memory budget in bytes (None: "off", or "auto" where the node's memory is unknown).
        ``loader_pids``: the jobs' training processes and workers now (``auto_loader_memory``)."""
        if self.loader_memory == "off":
            return None
        return auto_loader_memory(loader_pids=loader_pids) if self.loader_memory == "auto" else int(self.loader_memory)

    def resolved_memory_min_available(self) -> int:
        if self.memory_min_available == "auto":
            total, _ = memory.meminfo()
            return max(256 << 20, int(0.05 * total)) if total else 256 << 20
        return int(self.memory_min_available)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


KEYS = tuple(f.name for f in fields(AgentConfig))
_TYPES = {f.name: f.type for f in fields(AgentConfig)}


def agent_cpu_ids() -> tuple[int, ...]:
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return tuple(range(os.cpu_count() or 1))


def auto_loader_cpus() -> float:
    """CPUs the agent may use (its affinity mask) minus a 10% reserve for the training processes
    themselves and the system; at least 0.5. (2 vCPUs -> 1.8, 64 -> 57.6.)"""
    n = len(agent_cpu_ids())
    return max(0.5, round(n * (1.0 - LOADER_CPU_RESERVE), 2))


def auto_loader_memory(proc_root: str = "/proc", cgroup_root: str = "/sys/fs/cgroup",
                       loader_pids: tuple[int, ...] = ()) -> Optional[int]:
    """The default loader memory budget: the node's MemTotal, or the memory limit over the agent's own
    cgroup when that is lower and binds the loaders too (read only), minus a reserve of
    ``LOADER_MEMORY_RESERVE`` (25%) and at least ``LOADER_MEMORY_RESERVE_MIN`` (2 GiB) for the training
    processes, page cache and system; at least 10% of it. (24 GiB node -> 18 GiB; 512 GiB -> 384 GiB.)
    None if MemTotal is unreadable.

    The agent's limit binds the loaders when every process of ``loader_pids`` (the jobs' training
    processes and workers; none: it binds nothing yet) is in the group whose limit it is or below it:
    cgroup v2 with the job groups in the agent's delegated subtree, or agent and jobs in one container.
    A limit on the agent alone (a Kubernetes DaemonSet's ``limits.memory``, a unit's ``MemoryMax`` on
    cgroup v1, where the jobs' memory groups are not the agent's) caps the agent, not the loaders: read
    as the budget, the DaemonSet's 512Mi held every job on the node to one worker (51 MiB)."""
    total, _ = memory.meminfo(proc_root)
    own = memory.cgroup_memory("self", proc_root, cgroup_root)
    limit = None
    if own.limit is not None and (total is None or own.limit < total) and loader_pids:

        def bound(pid: int) -> bool:
            path = memory.cgroup_memory(pid, proc_root, cgroup_root).path
            return path == own.path or path.startswith(own.path + "/")

        if all(bound(pid) for pid in loader_pids):
            limit = own.limit
    if total is None and limit is None:
        return None
    base = min(x for x in (total, limit) if x is not None)
    return max(int(base * 0.1), base - max(int(base * LOADER_MEMORY_RESERVE), LOADER_MEMORY_RESERVE_MIN))


def _plain_number_text(text: str) -> bool:
    """Whether a number given as text (environment, command line) is written as an operator means one:
    ASCII only and no '_'. Python's int() and float() also read '1_0' as 10 and digits of other scripts
    ('١٠', '１０') as ASCII ones, so a typo or a pasted value became a number no one wrote (a TOML number
    is parsed by TOML, which takes neither). Sizes (``parse_bytes``) take ASCII digits only already."""
    return text.isascii() and "_" not in text


def _coerce(key: str, value: Any, source: str) -> Any:
    kind = _TYPES[key]
    where = f"config key {key!r} from {source}"
    if key in ("loader_memory", "memory_min_available"):
        if isinstance(value, str) and value.strip().lower() in ("auto", "off"):
            v = value.strip().lower()
            if v == "off" and key != "loader_memory":
                raise ConfigError(f"{where} must be bytes, a size such as \"2GiB\", or \"auto\", got {shown(value)}")
            return v
        try:
            return memory.parse_bytes(value)
        except ValueError as e:
            raise ConfigError(f"{where}: {e}") from None
    if key == "loader_cpus":
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        kind = "float"
    if kind in ("float", float):
        if isinstance(value, bool):
            raise ConfigError(f"{where} must be a number, got {shown(value)}")
        if isinstance(value, str) and not _plain_number_text(value):
            raise ConfigError(f"{where} must be a number in ASCII digits, without '_', got {shown(value)}")
        try:
            v = float(value)
        except (TypeError, ValueError, OverflowError):
            raise ConfigError(f"{where} must be a number, got {shown(value)}") from None
        if not math.isfinite(v):
            raise ConfigError(f"{where} must be finite, got {shown(value)}")
        return v
    if kind in ("int", int):
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ConfigError(f"{where} must be an integer, got {shown(value)}")
        if isinstance(value, str) and not _plain_number_text(value):
            raise ConfigError(f"{where} must be an integer in ASCII digits, without '_', got {shown(value)}")
        if isinstance(value, str) and len(value.strip().lstrip("+-")) > 20:
            raise ConfigError(f"{where} must be an integer of at most 20 digits, got {value[:40]!r}...")
        try:
            return int(value)
        except (TypeError, ValueError, OverflowError):
            raise ConfigError(f"{where} must be an integer, got {shown(value)}") from None
    if kind in ("bool", bool):
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on"):
            return True
        if isinstance(value, str) and value.strip().lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{where} must be true or false, got {shown(value)}")
    if not isinstance(value, str):
        raise ConfigError(f"{where} must be a string, got {shown(value)}")
    return value


def _validate(cfg: AgentConfig, sources: Mapping[str, str]) -> None:
    def bad(key, why):
        raise ConfigError(f"config key {key!r} ({sources.get(key, 'default')}): {why}, got {shown(getattr(cfg, key))}")

    why = endpoint_problem(cfg.endpoint)
    if why:
        bad("endpoint", why)
    if not cfg.state_dir:
        bad("state_dir", "must be a directory path")
    # a relative path names a different directory in each working directory (an agent started by hand in
    # a checkout wrote its journal there, and the one systemd starts in / never found it)
    for key in ("state_dir", "cgroup_root"):
        if not os.path.isabs(getattr(cfg, key)):
            bad(key, "must be an absolute path")
    try:
        from agent.policies import POLICIES
    except ImportError:   # pragma: no cover
        POLICIES = {}
    if cfg.policy not in POLICIES:
        bad("policy", f"unknown policy; choose one of: {', '.join(sorted(POLICIES))}")
    for key, (lo, hi) in BOUNDS.items():
        if not lo <= getattr(cfg, key) <= hi:
            bad(key, f"must be between {lo:g} and {hi:g}")
    if cfg.loader_cpus != "auto" and not 0 < float(cfg.loader_cpus) <= MAX_LOADER_CPUS:
        bad("loader_cpus", f"must be > 0 and at most {MAX_LOADER_CPUS:g} cores, or \"auto\"")
    if not SUBTREE_RE.fullmatch(cfg.cgroup_subtree):
        bad("cgroup_subtree", "must be one name of letters, digits, _ and - (at most 64, not starting with -)")
    if cfg.cgroup_mode not in CGROUP_MODES:
        bad("cgroup_mode", f"must be one of {', '.join(CGROUP_MODES)}")
    if cfg.cpu_knob not in CPU_KNOBS:
        bad("cpu_knob", f"must be one of {', '.join(CPU_KNOBS)}")
    if cfg.log_level not in LOG_LEVELS:
        bad("log_level", f"must be one of {', '.join(LOG_LEVELS)}")
    from agent.policies import LOADERS_YIELD

    if cfg.loaders_yield not in LOADERS_YIELD:
        bad("loaders_yield", f"must be one of {', '.join(LOADERS_YIELD)}")
    from agent.policies import FOREIGN_INTERMITTENT, FOREIGN_WEIGHTS

    if cfg.foreign_weight not in FOREIGN_WEIGHTS:
        bad("foreign_weight", f"must be one of {', '.join(FOREIGN_WEIGHTS)}")
    if cfg.foreign_intermittent not in FOREIGN_INTERMITTENT:
        bad("foreign_intermittent", f"must be one of {', '.join(FOREIGN_INTERMITTENT)}")
    if not 0 <= cfg.hysteresis < 1:
        bad("hysteresis", "must be in [0, 1)")
    if not 0 < cfg.floor_fraction <= 1:
        bad("floor_fraction", "must be in (0, 1]")
    from agent.policies import FLOOR_ALLOTMENTS, FLOOR_REFERENCES

    if cfg.floor_reference not in FLOOR_REFERENCES:
        bad("floor_reference", f"must be one of {', '.join(FLOOR_REFERENCES)}")
    if cfg.floor_allotment not in FLOOR_ALLOTMENTS:
        bad("floor_allotment", f"must be one of {', '.join(FLOOR_ALLOTMENTS)}")
    if not 1 <= cfg.delivery_correction <= 16:
        bad("delivery_correction", "must be in [1, 16]")
    from agent.controller import OBSERVED_CORES

    if cfg.observed_cores not in OBSERVED_CORES:
        bad("observed_cores", f"must be one of {', '.join(OBSERVED_CORES)}")
    if not 1 <= cfg.cpu_bound_min_workers <= 64:
        bad("cpu_bound_min_workers", "must be in 1..64")
    if not 0 <= cfg.delivery_workers <= 8:
        bad("delivery_workers", "must be in 0..8")
    if isinstance(cfg.loader_memory, int) and cfg.loader_memory < (64 << 20):
        bad("loader_memory", "must be at least 64 MiB (or \"auto\" or \"off\")")
    if not 0 < cfg.memory_pressure_psi <= 100:
        bad("memory_pressure_psi", "must be a percentage in (0, 100]")
    if not 0 < cfg.unseen_job_timeout_s <= 30 * 86400:
        bad("unseen_job_timeout_s", "must be > 0 and at most 30 days")


CONFIG_READ_TIMEOUT_S = 5.0   # the longest a start, a reload or a command waits for the config file


def _read_file(path: str, missing_ok: bool = False) -> Optional[bytes]:
    """The config file's bytes (None: it does not exist, where ``missing_ok``). Runs on a reader thread
    (``_read_bounded``): on a network mount that stopped answering any of these calls can block for ever."""
    if missing_ok and not os.path.exists(path):
        return None
    # O_NONBLOCK: open() of a FIFO would wait for a writer (for ever: the agent never starts, a SIGHUP
    # reload never returns); it returns at once, and fstat refuses it. (A regular file ignores the flag.)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        kind = _file_kind(os.fstat(f.fileno()))
        if kind:
            raise ConfigError(f"config file {path} is not a regular file ({kind})")
        return f.read()


_reading: dict[str, float] = {}      # path -> when a read that outlived its wait began (it still runs)
_reading_lock = threading.Lock()


def _read_bounded(path: str, missing_ok: bool = False, timeout_s: Optional[float] = None) -> Optional[bytes]:
    """``_read_file`` on a daemon thread, waited for at most ``timeout_s`` (``CONFIG_READ_TIMEOUT_S``): a
    config file on a hung network mount was a start that never came up and a SIGHUP reload that held
    the service loop for ever. A read that outlives its wait is a ``ConfigError`` naming the file, and
    while it still runs no other read of that path is started (each one would be another thread stuck
    for good): a later start or reload is refused at once, saying so."""
    timeout_s = CONFIG_READ_TIMEOUT_S if timeout_s is None else timeout_s
    with _reading_lock:
        since = _reading.get(path)
        if since is not None:
            raise ConfigError(f"cannot read config file {path}: an earlier read of it has not returned after "
                              f"{time.monotonic() - since:.0f} s (a hung file system?)")
    out: dict[str, Any] = {}
    done = threading.Event()

    def read() -> None:
        try:
            out["data"] = _read_file(path, missing_ok)
        except BaseException as e:   # noqa: BLE001 — handed to the caller
            out["error"] = e
        with _reading_lock:
            done.set()
            _reading.pop(path, None)

    started = time.monotonic()
    threading.Thread(target=read, name="adloader-config-read", daemon=True).start()
    done.wait(timeout_s)
    with _reading_lock:
        if not done.is_set():
            _reading[path] = started
            raise ConfigError(f"cannot read config file {path}: no answer within {timeout_s:g} s "
                              f"(a hung file system?)")
    if "error" in out:
        raise out["error"]
    return out["data"]


def read_toml(path: str, *, missing_ok: bool = False, timeout_s: Optional[float] = None) -> Optional[dict]:
    """The config file's keys (None: it does not exist, where ``missing_ok``), read within ``timeout_s``
    (``_read_bounded``); every problem, an unknown key included, is a ``ConfigError`` naming the file."""
    data = _parse_toml(path, missing_ok=missing_ok, timeout_s=timeout_s)
    if data is not None:
        unknown = unknown_keys_problem(path, data)
        if unknown:
            raise ConfigError(f"{unknown}; known keys: {', '.join(KEYS)}")
    return data


def _parse_toml(path: str, *, missing_ok: bool = False, timeout_s: Optional[float] = None) -> Optional[dict]:
    """``read_toml`` without the check for unknown keys."""
    try:
        import tomllib
    except ImportError:   # Python 3.10
        import tomli as tomllib
    try:
        raw = _read_bounded(path, missing_ok, timeout_s)
        if raw is None:
            return None
        return tomllib.loads(raw.decode("utf-8"))
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    except RecursionError:   # tomllib parses nested arrays and inline tables recursively
        raise ConfigError(f"config file {path} is not valid TOML: nested too deeply") from None
    except UnicodeDecodeError as e:   # (tomllib decodes the bytes itself and lets this through)
        raise ConfigError(f"config file {path} is not valid TOML: not UTF-8 text ({e.reason} at byte "
                          f"{e.start})") from None


def unknown_keys_problem(path: str, data: Mapping[str, Any]) -> str:
    """"config file PATH: unknown key(s) 'endpiont' (did you mean 'endpoint'?)" naming at most
    ``MAX_UNKNOWN_NAMED`` of the file's keys that are not config keys (a ``[section]`` is one), or ""."""
    unknown = sorted(set(data) - set(KEYS))
    if not unknown:
        return ""
    named = ", ".join(map(_with_suggestion, unknown[:MAX_UNKNOWN_NAMED]))
    more = f" and {len(unknown) - MAX_UNKNOWN_NAMED} more..." if len(unknown) > MAX_UNKNOWN_NAMED else ""
    return f"config file {path}: unknown key(s) {named}{more}"


def _file_kind(st: os.stat_result) -> str:
    """What a file that is not a regular file is ("" for a regular file, and for the null device: an empty
    config, as ``--config /dev/null`` and the bench's ``os.devnull`` mean)."""
    import stat

    if stat.S_ISCHR(st.st_mode) and st.st_rdev == os.stat(os.devnull).st_rdev:
        return ""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(st.st_mode):
            return name
    return "" if stat.S_ISREG(st.st_mode) else "not a regular file"


def _with_suggestion(key: str) -> str:
    """``'tik_s'`` -> ``'tik_s' (did you mean 'tick_s'?)``; just the quoted key when none is close."""
    near = difflib.get_close_matches(str(key), KEYS, n=1, cutoff=0.75)
    return f"{shown(key)} (did you mean {near[0]!r}?)" if near else shown(key)


def load(path: Optional[str] = None, cli: Optional[Mapping[str, Any]] = None,
         environ: Optional[Mapping[str, str]] = None) -> AgentConfig:
    """Build the config. ``path=None`` reads DEFAULT_CONFIG_PATH if it exists (a missing default file
    is fine); an explicit path must exist. ``cli`` holds only the options given on the command line."""
    values: dict[str, Any] = {"endpoint": env.default_endpoint(environ=environ),
                              "state_dir": env.default_state_dir(environ=environ)}
    sources: dict[str, str] = {}
    file_path = path if path is not None else DEFAULT_CONFIG_PATH
    doc = read_toml(file_path, missing_ok=path is None)   # (the default file's existence asked within the bound)
    if doc is not None:
        for k, v in doc.items():
            values[k] = _coerce(k, v, f"file {file_path}")
            sources[k] = f"file {file_path}"
    misspelt = env.misspelt_agent_names(KEYS, environ)
    if misspelt:
        raise ConfigError("environment: " + "; ".join(f"{name} is not a config key's variable (did you mean {near}?)"
                                                      for name, near in sorted(misspelt.items())))
    for k, v in env.agent_overrides(KEYS, environ).items():
        values[k] = _coerce(k, v, f"environment ADLOADER_{k.upper()}")
        sources[k] = f"environment ADLOADER_{k.upper()}"
    for k, v in (cli or {}).items():
        if k not in KEYS:
            raise ConfigError(f"unknown config key {_with_suggestion(k)} on the command line")
        if v is None:
            continue
        values[k] = _coerce(k, v, "the command line")
        sources[k] = "the command line"
    cfg = AgentConfig(**values)
    _validate(cfg, sources)
    return cfg


ENDPOINT_FROM_ENV_NOTE = "endpoint from ADLOADER_ENDPOINT"


def endpoint_from_environment(flag: Optional[str] = None, environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether ``client_endpoint(flag, ...)`` took ADLOADER_ENDPOINT: a command that could not reach the
    agent says so (``ENDPOINT_FROM_ENV_NOTE``), since a variable set long ago is easy to forget."""
    environ = os.environ if environ is None else environ
    return not flag and bool(environ.get("ADLOADER_ENDPOINT", "").strip())


@dataclass(frozen=True)
class FileEndpoint:
    """What the agent's config file says about the endpoint, for the commands and scripts that talk to
    the agent (``file_endpoint``).

    ``endpoint``: the file's ``endpoint`` key, valid; None where it gives none, and then the caller
    uses its default. ``note``: "" when nothing is worth saying, else what went wrong, naming the file,
    for the caller's log line."""

    endpoint: Optional[str]
    note: str = ""


def file_endpoint(path: str, *, missing_ok: bool = True) -> FileEndpoint:
    """The ``endpoint`` key of the agent config file at ``path``, read with the agent's own reader
    (``_parse_toml``: bounded in time; TOML quoting, escapes, comments as the agent reads them).

    The one rule for the commands that read the endpoint (``client_endpoint``: ``adloader job``,
    ``adloader status``; the Slurm TaskProlog reads the key with bash alone, in two plain forms): a
    valid ``endpoint`` key is used even
    where the file also holds keys the agent does not know (nothing the file says is lost), and those
    keys are named in the note ("did you mean" included: a misspelt ``endpiont`` is not silent), since
    the agent refuses to start with them. A file that cannot be read or is not TOML, and an invalid
    ``endpoint`` value, give no endpoint and a note that names the file. An absent file gives none and
    no note where ``missing_ok``, else a note."""
    try:
        doc = _parse_toml(path, missing_ok=True)    # (bounded in time, the existence check with it)
    except ConfigError as e:
        return FileEndpoint(None, str(e))
    if doc is None:
        return FileEndpoint(None, "" if missing_ok else f"no agent config at {path}")
    notes = []
    unknown = unknown_keys_problem(path, doc)
    if unknown:
        notes.append(f"{unknown}, which the agent refuses to start with")
    value = doc.get("endpoint")
    why = None if value is None else "must be a string" if not isinstance(value, str) else endpoint_problem(value)
    if why:
        notes.append(f"config key 'endpoint' in {path} {why}, got {shown(value)}")
        value = None
    return FileEndpoint(value, "; ".join(notes))


def endpoint_argument_problem(flag: Optional[str] = None, environ: Optional[Mapping[str, str]] = None) -> str:
    """"--endpoint 'x': why" or "ADLOADER_ENDPOINT 'x': why" where the endpoint a command was given, on
    its command line or else in its environment, is malformed (``endpoint_problem``, as the agent checks
    its own); "" otherwise. The training-side client refuses a malformed ADLOADER_ENDPOINT the same way
    (``adloader.env.endpoint_problem``) rather than falling back to another agent."""
    if flag is not None:
        why = endpoint_problem(flag)
        return f"--endpoint {shown(flag)}: {why}" if why else ""
    environ = os.environ if environ is None else environ
    value = environ.get("ADLOADER_ENDPOINT", "").strip()
    why = endpoint_problem(value) if value else None
    return f"ADLOADER_ENDPOINT {shown(value)}: {why}" if why else ""


def client_endpoint(flag: Optional[str] = None, config_path: Optional[str] = None,
                    environ: Optional[Mapping[str, str]] = None) -> tuple[str, str]:
    """The endpoint a command on this node (``adloader job``, ``adloader status``, the Slurm scripts
    through them) talks to, and a note for its log line ("" when nothing is worth saying).

    One source of truth: the agent's own config file. In order: ``flag`` (``--endpoint``), else
    ADLOADER_ENDPOINT, else the ``endpoint`` key of ``config_path`` (default: DEFAULT_CONFIG_PATH when
    it exists), else ``adloader.env.endpoint()`` (the system socket, else the user's) -- the same
    precedence as the agent's own (file < environment < command line). The file is read by
    ``file_endpoint``: a valid endpoint is used and keys the agent does not know are named in the note;
    a file that cannot be read, or whose endpoint is invalid, is named in the note and the default is
    used. Light: tomllib only (the prolog pays for every import)."""
    if flag:
        return flag, ""
    environ = os.environ if environ is None else environ
    ep = environ.get("ADLOADER_ENDPOINT", "").strip()
    if ep:
        return ep, ""
    found = file_endpoint(config_path or DEFAULT_CONFIG_PATH, missing_ok=not config_path)
    endpoint = found.endpoint or env.endpoint(environ)
    if found.note and not found.endpoint:
        return endpoint, f"{found.note}: default endpoint"
    return endpoint, found.note
