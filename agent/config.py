"""The agent's typed config: defaults <- TOML file <- environment <- command line (STYLE 10).

``load(path=None, cli={}, environ=None) -> AgentConfig``, validated once; every problem names the key
and where it came from. Unknown keys in the file are errors that name them.

Keys (flat; TOML key == field name; environment ``ADLOADER_<KEY upper>``; flag ``--<key with dashes>``
for the ones the command line offers):

    endpoint        str    where the agent binds (ipc://...); default ``adloader.env.default_endpoint()``
    state_dir       str    journal directory; root /var/lib/adloader, a user <runtime dir>/state
    policy          str    allocation policy name (``agent.policies.POLICIES``), default "adaptive"
    tick_s          float  controller period, 0.05..60 s, default 1.0
    loader_cpus     float|"auto"  CPU cores for all jobs' loaders together; "auto" (default):
                           the CPUs in the agent's affinity mask minus a 10% reserve for the training
                           processes and the system (``auto_loader_cpus``); at most 4096
    max_jobs        int    jobs the node is sized for (even-static divides by it), 0 = by jobs present
                           (at most 4096)
    cgroup_mode     str    auto|v1|v2|cooperative|off, default "auto"
    cgroup_root     str    default /sys/fs/cgroup
    cgroup_subtree  str    the agent's group in each hierarchy, job groups below it; one name (letters,
                           digits, _ - only), default "adloader"; give each agent on a machine its own
    cpu_knob        str    shares|quota|cpuset, default "shares"
    io_weights      bool   set IO weights where the kernel enforces them, default true
    metrics_port    int    Prometheus on 127.0.0.1:<port>; 0 = off (the default)
    heartbeat_s     float  agent heartbeat period, 0.1..300 s; a rank silent for 3x this has departed;
                           default 2.0
    log_level       str    debug|info|warning|error, default "info"
    hysteresis      float  0..1, no move for a predicted normalised gain under this, default 0.03
    fairness_floor  bool   adaptive: no job below its even share unless it cannot use it, default true
    max_connections  int   open connections from ordinary users, all together (root is not counted);
                           more are closed at once; 1..60000, default 4096
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
import math
import os
import re
from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional, Union

from adloader import env

DEFAULT_CONFIG_PATH = "/etc/adloader/agent.toml"
CGROUP_MODES = ("auto", "v1", "v2", "cooperative", "off")
CPU_KNOBS = ("shares", "quota", "cpuset")
LOG_LEVELS = ("debug", "info", "warning", "error")
LOADER_CPU_RESERVE = 0.10
SUBTREE_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,63}")
# key -> (lowest, highest) accepted; every number an operator can set has both ends
BOUNDS: dict[str, tuple[float, float]] = {
    "tick_s": (0.05, 60.0), "heartbeat_s": (0.1, 300.0), "max_jobs": (0, 4096), "metrics_port": (0, 65535),
    "max_connections": (1, 60000), "connections_per_uid": (1, 60000), "jobs_per_uid": (1, 100000),
    "idle_jobs_per_uid": (0, 100000), "uid_cpu_share": (0.001, 1.0),
}
MAX_LOADER_CPUS = 4096.0


class ConfigError(ValueError):
    """A config value that cannot be used; the message names the key and its source."""


@dataclass(frozen=True)
class AgentConfig:
    endpoint: str = ""
    state_dir: str = ""
    policy: str = "adaptive"
    tick_s: float = 1.0
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
    fairness_floor: bool = True
    cgroup_subtree: str = "adloader"
    max_connections: int = 4096
    connections_per_uid: int = 64
    jobs_per_uid: int = 32
    idle_jobs_per_uid: int = 4
    uid_cpu_share: float = 0.1

    def resolved_loader_cpus(self) -> float:
        return auto_loader_cpus() if self.loader_cpus == "auto" else float(self.loader_cpus)

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


def _coerce(key: str, value: Any, source: str) -> Any:
    kind = _TYPES[key]
    where = f"config key {key!r} from {source}"
    if key == "loader_cpus":
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        kind = "float"
    if kind in ("float", float):
        if isinstance(value, bool):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        try:
            v = float(value)
        except (TypeError, ValueError, OverflowError):
            raise ConfigError(f"{where} must be a number, got {str(value)[:40]!r}") from None
        if not math.isfinite(v):
            raise ConfigError(f"{where} must be finite, got {value!r}")
        return v
    if kind in ("int", int):
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        if isinstance(value, str) and len(value.strip().lstrip("+-")) > 20:
            raise ConfigError(f"{where} must be an integer of at most 20 digits, got {value[:40]!r}...")
        try:
            return int(value)
        except (TypeError, ValueError, OverflowError):
            raise ConfigError(f"{where} must be an integer, got {str(value)[:40]!r}") from None
    if kind in ("bool", bool):
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on"):
            return True
        if isinstance(value, str) and value.strip().lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    if not isinstance(value, str):
        raise ConfigError(f"{where} must be a string, got {value!r}")
    return value


def _validate(cfg: AgentConfig, sources: Mapping[str, str]) -> None:
    def bad(key, why):
        raise ConfigError(f"config key {key!r} ({sources.get(key, 'default')}): {why}, got {getattr(cfg, key)!r}")

    if not cfg.endpoint.startswith(("ipc://", "tcp://")):
        bad("endpoint", "must start with ipc:// or tcp://")
    if cfg.endpoint.startswith("ipc://") and len(cfg.endpoint) - 6 > 100:
        bad("endpoint", "an ipc:// path must be at most 100 characters (the unix socket limit)")
    if not cfg.state_dir:
        bad("state_dir", "must be a directory path")
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
    if not 0 <= cfg.hysteresis < 1:
        bad("hysteresis", "must be in [0, 1)")


def read_toml(path: str) -> dict:
    try:
        import tomllib
    except ImportError:   # Python 3.10
        import tomli as tomllib
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    unknown = sorted(set(data) - set(KEYS))
    if unknown:
        raise ConfigError(f"config file {path}: unknown key(s) {', '.join(map(repr, unknown))}; "
                          f"known keys: {', '.join(KEYS)}")
    return data


def load(path: Optional[str] = None, cli: Optional[Mapping[str, Any]] = None,
         environ: Optional[Mapping[str, str]] = None) -> AgentConfig:
    """Build the config. ``path=None`` reads DEFAULT_CONFIG_PATH if it exists (a missing default file
    is fine); an explicit path must exist. ``cli`` holds only the options given on the command line."""
    values: dict[str, Any] = {"endpoint": env.default_endpoint(environ=environ),
                              "state_dir": env.default_state_dir(environ=environ)}
    sources: dict[str, str] = {}
    file_path = path if path is not None else (DEFAULT_CONFIG_PATH if os.path.exists(DEFAULT_CONFIG_PATH) else None)
    if file_path is not None:
        for k, v in read_toml(file_path).items():
            values[k] = _coerce(k, v, f"file {file_path}")
            sources[k] = f"file {file_path}"
    for k, v in env.agent_overrides(KEYS, environ).items():
        values[k] = _coerce(k, v, f"environment ADLOADER_{k.upper()}")
        sources[k] = f"environment ADLOADER_{k.upper()}"
    for k, v in (cli or {}).items():
        if k not in KEYS:
            raise ConfigError(f"unknown config key {k!r} on the command line")
        if v is None:
            continue
        values[k] = _coerce(k, v, "the command line")
        sources[k] = "the command line"
    cfg = AgentConfig(**values)
    _validate(cfg, sources)
    return cfg
